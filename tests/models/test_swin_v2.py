"""Swin V2 (Liu et al. 2022) in vitrel's Swin: ``cosine_attn`` (scaled cosine attention), ``post_norm``
(res-post-norm blocks, patch merging normalised after its reduction) and ``rel2d_cpb``, against the equations in
float64 and timm's ``SwinTransformerV2`` (the authors' model as timm ports it) through ``from_timm``."""

from __future__ import annotations

import math

import pytest
import timm
import torch
from torch import nn

import vitrel
from tests.weights import lively
from vitrel import Attention
from vitrel.layout.windows import unwindow
from vitrel.models import save_pretrained
from vitrel.models.swin_blocks import PatchMerging

SMALL = dict(img_size=64, embed_dim=16, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4), window_size=4, num_classes=7)


def _timm_v2(name: str = "swinv2_tiny_window8_256", **kw) -> nn.Module:
    """timm's Swin V2 in float64, its weights redrawn (its post-norms too: timm starts their scales at 0, which
    makes every block the identity and any comparison vacuous)."""
    torch.manual_seed(0)
    t = lively(timm.create_model(name, **{**SMALL, **kw})).double().eval()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for n, p in t.named_parameters():
            if ".norm1." in n or ".norm2." in n:
                p.copy_((1.0 if n.endswith("weight") else 0.0) + 0.3 * torch.randn(p.shape, generator=g))
    return t


def test_cosine_attention_is_the_equation_forward_and_gradients():
    """``softmax(cos(q_i, k_j) exp(min(s_h, log 100)) + B) v``, per head, with ``s_h`` above and below the clamp: the
    output and the gradients of the input, ``qkv`` and ``s`` against a float64 loop over heads."""
    torch.manual_seed(0)
    a = lively(Attention(12, 3, pos="rel2d_cpb", grid=(3, 3), cosine=True)).double()
    with torch.no_grad():
        a.logit_scale.copy_(torch.tensor([0.5, 2.0, 6.0], dtype=torch.float64).view(3, 1, 1))  # 6 > log 100
    assert a.scale == 1.0
    x = torch.randn(2, 9, 12, dtype=torch.float64, requires_grad=True)
    out = a(x)
    qkv = (x @ a.qkv.weight.T + a.qkv.bias).view(2, 9, 3, 3, 4)
    bias = a.pos.bias(a.pos.grid)
    want = []
    for h in range(3):
        q, k, v = qkv[:, :, 0, h], qkv[:, :, 1, h], qkv[:, :, 2, h]
        cos = (q / q.norm(dim=-1, keepdim=True)) @ (k / k.norm(dim=-1, keepdim=True)).transpose(1, 2)
        logits = cos * torch.exp(torch.clamp(a.logit_scale[h, 0, 0], max=math.log(100.0))) + bias[h]
        want.append(torch.softmax(logits, -1) @ v)
    want = torch.cat(want, dim=-1) @ a.proj.weight.T + a.proj.bias
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, a.qkv.weight, a.logit_scale), g)
    ref = torch.autograd.grad(want, (x, a.qkv.weight, a.logit_scale), g)
    for u, w in zip(got, ref):
        torch.testing.assert_close(u, w, rtol=1e-10, atol=1e-12)
    assert got[2][2].abs().item() == 0.0 < got[2][:2].abs().min().item()  # (the clamped head has no gradient)


def test_post_norm_block_and_merging_are_the_equations():
    """``post_norm``: a block is ``x + LN1(W-MSA(x))`` then ``x + LN2(MLP(x))``, the merging ``LN(Linear(4C, 2C))``."""
    torch.manual_seed(0)
    m = vitrel.create_model("vitrel_swin_tiny_patch2_window4_32", post_norm=True, cosine_attn=True, pos="rel2d_cpb",
                            embed_dim=16, depths=(2, 2), num_heads=(2, 2))  # fmt: skip
    m = lively(m).double().eval()
    blk, merge = m.layers[0].blocks[1], m.layers[1].downsample
    x = torch.randn(2, 8, 8, 16, dtype=torch.float64)
    with torch.no_grad():
        windows, grid, win, shift, layout = blk.windows(x)
        attn = unwindow(blk.attn(windows, mask=layout), grid, win, shift)
        y = x + blk.norm1(attn)
        torch.testing.assert_close(blk(x), y + blk.norm2(blk.mlp(y)), rtol=1e-12, atol=1e-12)
        merged = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], -1)
        torch.testing.assert_close(merge(x), merge.norm(merged @ merge.reduction.weight.T), rtol=1e-12, atol=1e-12)
    assert isinstance(PatchMerging(16, post_norm=True).norm, nn.LayerNorm) and PatchMerging(
        16, post_norm=True
    ).norm.normalized_shape == (32,)


@pytest.mark.parametrize(
    "name, kw",
    [
        ("swinv2_tiny_window8_256", {}),
        ("swinv2_base_window12to16_192to256", dict(pretrained_window_sizes=(3, 3, 3, 2))),  # fine-tuned windows
    ],
)
def test_timms_swin_v2_is_the_same_function(name, kw):
    """``from_timm`` reads timm's Swin V2: ``rel2d_cpb`` normalised by each block's ``pretrained_window_size`` (the
    stage whose grid shrinks the window included), ``post_norm``, ``cosine_attn``, the q / v biases with a zero k
    bias. Equal in float64 to 1e-7 (timm computes its log-spaced offsets in float32); a list of two sizes gives each
    image alone. The pretrained windows matter, as does the logit scale."""
    t = _timm_v2(name, **kw)
    m = vitrel.from_timm(t)
    assert m.vitrel_cfg["post_norm"] and m.vitrel_cfg["cosine_attn"] and m.vitrel_cfg["pos"]["name"] == "rel2d_cpb"
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(m(x), t(x), rtol=1e-7, atol=1e-7)
        images = [torch.randn(3, 64, 64, dtype=torch.float64), torch.randn(3, 32, 48, dtype=torch.float64)]
        together = m(images)
        for i, img in enumerate(images):
            torch.testing.assert_close(together[i], m(img[None])[0], rtol=1e-10, atol=1e-10)
        if kw:
            for stage in m.layers:
                for b in stage.blocks:
                    b.attn.pos._ref = b.attn.pos.grid  # (normalised by the window instead)
            assert (m(x) - t(x)).abs().max() > 1e-3
        m = vitrel.from_timm(t)
        m.layers[0].blocks[0].attn.logit_scale.zero_()
        assert (m(x) - t(x)).abs().max() > 1e-3


def test_checkpoint_weight_decay_and_refusals(tmp_path):
    """A checkpoint keeps the blocks and each CPB's normalising window; the logit scales are not weight-decayed (timm's
    ``no_weight_decay``); the options are bools."""
    t = _timm_v2("swinv2_base_window12to16_192to256", pretrained_window_sizes=(3, 3, 3, 2))
    m = vitrel.from_timm(t)
    save_pretrained(m, tmp_path / "m")
    back = vitrel.load_model(tmp_path / "m").double().eval()
    x = torch.randn(1, 3, 64, 64, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(back(x), m(x), rtol=1e-12, atol=1e-12)
    assert tuple(back.layers[0].blocks[0].attn.pos._ref) == (3, 3)
    decay_free = m.no_weight_decay()
    assert {n for n, _ in m.named_parameters() if n.endswith("logit_scale")} <= decay_free
    for flag in ("post_norm", "cosine_attn"):
        with pytest.raises(ValueError, match=f"{flag} must be true or false"):
            vitrel.create_model("vitrel_swin_tiny_patch2_window4_32", **{flag: 1})
