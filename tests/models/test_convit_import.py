"""timm's ConViT (``convit_*``, the authors' facebookresearch/convit ported) into a vitrel ViT: ``pos="gpsa"`` in its
GPSA blocks (``pos_depth``), the class token joining after them (``prefix_at``), the same function and gradients.

Offline: timm's models built here with random weights, perturbed so that a wrong mapping shows."""

from __future__ import annotations

import logging

import pytest
import timm
import torch

import vitrel
from vitrel.models.timm_import import UnsupportedTimmModel, transfer_timm_weights

# ConViT's embed_dim is per head (timm's convit_tiny: 48 x 4 heads); GPSA in the first 2 of 3 blocks
SMALL = dict(img_size=64, embed_dim=16, num_heads=4, depth=3, local_up_to_layer=2, num_classes=5)


def _timm(seed: int = 0, **kw) -> torch.nn.Module:
    torch.manual_seed(seed)
    t = timm.create_model("convit_tiny", **{**SMALL, **kw}).double().eval()
    with torch.no_grad():
        for p in t.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return t


def _x(seed: int = 1) -> torch.Tensor:
    return torch.randn(2, 3, 64, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def test_the_released_layout_in_vitrels_terms():
    t = timm.create_model("convit_tiny")  # (the released configuration: GPSA in 10 of 12 blocks, 4 heads of 48)
    m = vitrel.from_timm(t)
    cfg = m.vitrel_cfg
    assert (cfg["pos"]["name"], cfg["abs_pos"], cfg["pos_depth"], cfg["prefix_at"]) == ("gpsa", "ape", 10, 10)
    assert (cfg["embed_dim"], cfg["num_heads"], cfg["qkv_bias"], cfg["global_pool"]) == (192, 4, False, "token")
    assert [blk.attn.pos.name for blk in m.blocks] == ["gpsa"] * 10 + ["none"] * 2
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(m.eval()(x), t.eval()(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("global_pool", ["token", "avg"])
def test_same_function_and_gradients_in_float64(global_pool):
    t = _timm(global_pool=global_pool)
    m = vitrel.from_timm(t)
    x = _x()
    got, want = m(x), t(x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    got.square().sum().backward()
    want.square().sum().backward()
    ours, theirs = dict(m.named_parameters()), dict(t.named_parameters())
    for i in range(2):  # GPSA blocks: qkv = [qk; v], the scheme's projection and gates
        a = f"blocks.{i}.attn"
        qkv = torch.cat([theirs[f"{a}.qk.weight"].grad, theirs[f"{a}.v.weight"].grad])
        torch.testing.assert_close(ours[f"{a}.qkv.weight"].grad, qkv, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(ours[f"{a}.pos.pos_proj"].grad, theirs[f"{a}.pos_proj.weight"].grad)
        torch.testing.assert_close(ours[f"{a}.pos.gating"].grad, theirs[f"{a}.gating_param"].grad)
    for k in ("cls_token", "blocks.2.attn.qkv.weight", "patch_embed.proj.weight", "head.weight"):
        torch.testing.assert_close(ours[k].grad, theirs[k].grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ours["abs_pos.pos_embed"].grad, theirs["pos_embed"].grad, rtol=1e-10, atol=1e-12)


def test_intermediates_and_pruning_as_timms():
    t, x = _timm(), _x()
    m = vitrel.from_timm(t)
    with torch.no_grad():
        for fmt in ("NCHW", "NLC"):
            (fg, got), (fw, want) = (n.forward_intermediates(x, output_fmt=fmt) for n in (m, t))
            torch.testing.assert_close(fg, fw, rtol=1e-12, atol=1e-12)
            for g, w in zip(got, want, strict=True):  # (timm's strips the class token once it joined)
                torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
        assert m.prune_intermediate_layers([1]) == t.prune_intermediate_layers([1]) == [1]
        torch.testing.assert_close(m.forward_features(x), t.forward_features(x), rtol=1e-12, atol=1e-12)
    assert m.num_prefix_tokens == t.num_prefix_tokens == 0


def test_the_transfer_report_and_another_scheme(caplog):
    t = _timm()
    m = vitrel.from_timm(t)
    rep = transfer_timm_weights(t, m)
    assert rep.converted["blocks.0.attn.qkv.weight"] == "cat(blocks.0.attn.qk.weight, blocks.0.attn.v.weight)"
    assert rep.converted["blocks.1.attn.pos.gating"] == "blocks.1.attn.gating_param"
    assert "softmax over keys cancels" in rep.dropped["blocks.0.attn.pos_proj.bias"] and not rep.initialised
    with caplog.at_level(logging.INFO, logger="vitrel.models.timm_import"):
        other = vitrel.from_timm(t, pos="rel2d_full")  # ConViT's layout and embedding with another scheme
    assert "GPSA's parameters" in caplog.text
    assert [blk.attn.pos.name for blk in other.blocks] == ["rel2d_full", "rel2d_full", "none"]
    assert other.vitrel_cfg["abs_pos"] == "ape" and other.vitrel_cfg["prefix_at"] == 2
    with torch.no_grad():
        for blk in other.blocks[:2]:
            blk.attn.pos.table.zero_()
        for theirs in t.blocks[:2]:
            theirs.attn.gating_param.fill_(-50.0)  # (GPSA as content attention alone: a zero bias's function)
        torch.testing.assert_close(other(_x()), t(_x()), rtol=1e-12, atol=1e-12)


def test_a_class_token_that_never_joins_is_refused():
    with pytest.raises(UnsupportedTimmModel, match="never joins"):
        vitrel.from_timm(timm.create_model("convit_tiny", **{**SMALL, "local_up_to_layer": 3}))
