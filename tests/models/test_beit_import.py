"""``vitrel.from_timm("beit_*")``: timm's BEiT (the authors' microsoft/unilm code ported) as a vitrel ViT with
``pos="rel2d_beit"``: the same function and gradients in float64, each table layout BEiT has, and its refusals."""

from __future__ import annotations

import logging

import pytest
import timm
import torch

import vitrel
from tests.weights import lively
from vitrel.models.timm_import import UnsupportedTimmModel

SMALL = dict(img_size=48, patch_size=16, embed_dim=24, depth=2, num_heads=3, num_classes=4, init_values=0.1)


def _pair(**kw) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    t = lively(timm.create_model("beit_base_patch16_224", **{**SMALL, **kw})).double().eval()
    return t, vitrel.from_timm(t)


def _x() -> torch.Tensor:
    return torch.randn(2, 3, 48, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(
    "layout",
    [
        {},
        {"use_shared_rel_pos_bias": True, "use_rel_pos_bias": False},
        {"use_abs_pos_emb": True},
        {"swiglu_mlp": True, "scale_mlp": True},
    ],
    ids=["per_block", "shared", "with_abs_pos", "swiglu_scale_mlp"],
)
def test_same_function_and_gradients(layout):
    """Output and the gradients of the bias table, its class-token rows, layer scale, the q / v biases and the class
    token equal timm's BEiT: a table per block (fine-tuned BEiT, BEiT v2), one shared (BEiT's pre-training), and a
    table with an absolute embedding (carried as ``abs_pos="ape"``), and BEiT's SwiGLU and sub-LN options
    (``mlp_layer="swiglu"``, ``mlp_norm=True``)."""
    t, m = _pair(**layout)
    assert m.vitrel_cfg["pos"] == {"name": "rel2d_beit", "extend": "geometric"}
    assert m.vitrel_cfg["pos_share"] == ("use_shared_rel_pos_bias" in layout)
    assert m.vitrel_cfg["abs_pos"] == ("ape" if layout.get("use_abs_pos_emb") else None)
    assert m.vitrel_cfg["mlp_layer"] == ("swiglu" if layout.get("swiglu_mlp") else "mlp")
    assert m.vitrel_cfg["mlp_norm"] == bool(layout.get("scale_mlp"))
    out_t, out_m = t(_x()), m(_x())
    torch.testing.assert_close(out_m, out_t, rtol=1e-10, atol=1e-10)
    g = torch.randn_like(out_t)
    src = "rel_pos_bias" if layout.get("use_shared_rel_pos_bias") else "blocks.0.attn"
    ours = "rel_pos" if layout.get("use_shared_rel_pos_bias") else "blocks.0.attn.pos"
    theirs = [f"{src}.relative_position_bias_table", "blocks.1.gamma_1", "blocks.0.attn.q_bias", "cls_token"]
    gt = dict(zip(theirs, torch.autograd.grad(out_t, [t.get_parameter(k) for k in theirs], g)))
    mine = [f"{ours}.table", f"{ours}.prefix_terms", "blocks.1.ls1.gamma", "blocks.0.attn.q_bias", "cls_token"]
    gm = dict(zip(mine, torch.autograd.grad(out_m, [m.get_parameter(k) for k in mine], g)))
    table = torch.cat([gm[f"{ours}.table"].reshape(-1, 3), gm[f"{ours}.prefix_terms"]])
    torch.testing.assert_close(table, gt[theirs[0]], rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(gm["blocks.1.ls1.gamma"], gt["blocks.1.gamma_1"], rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(gm["blocks.0.attn.q_bias"], gt["blocks.0.attn.q_bias"], rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(gm["cls_token"], gt["cls_token"], rtol=1e-8, atol=1e-10)
    assert gt[theirs[0]][-3:].abs().min() > 0  # (the class-token rows reached: block 0, read by block 1)


def test_at_another_size_the_tables_resize_as_timms_beit_loader():
    """``from_timm(..., img_size=96)`` of a 48 px BEiT equals timm's BEiT built at 96 px with the weights through its
    ``checkpoint_filter_fn`` (BEiT's geometric resize of each table, ``extend="geometric"``); the default ``grow``
    would differ."""
    from timm.models.beit import checkpoint_filter_fn

    t, _ = _pair()
    big = timm.create_model("beit_base_patch16_224", **{**SMALL, "img_size": 96}).double().eval()
    with pytest.warns(UserWarning):  # (timm's interpolator, and vitrel's note on the resized tables)
        big.load_state_dict(checkpoint_filter_fn(t.state_dict(), big))
        m = vitrel.from_timm(t, img_size=96)
        grown = vitrel.from_timm(t, img_size=96, pos="rel2d_beit")
    x = torch.randn(2, 3, 96, 96, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(m(x), big(x), rtol=1e-10, atol=1e-10)
        assert (grown(x) - big(x)).abs().max() > 1e-3


def test_intermediates_equal_timms():
    t, m = _pair()
    with torch.no_grad():
        want = t.forward_intermediates(_x(), indices=[0, 1], intermediates_only=True)
        got = m.forward_intermediates(_x(), indices=[0, 1], intermediates_only=True)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_into_rel2d_full_the_offsets_carry_and_the_class_rows_are_reported_dropped(caplog):
    t, _ = _pair()
    with caplog.at_level(logging.INFO, logger="vitrel.models.timm_import"):
        m = vitrel.from_timm(t, pos="rel2d_full")
    assert "blocks.0.attn.relative_position_bias_table[-3:]: BEiT's class-token terms" in caplog.text
    flat = t.blocks[0].attn.relative_position_bias_table
    torch.testing.assert_close(m.blocks[0].attn.pos.table.reshape(-1, 3), flat[:-3], rtol=0, atol=0)
    with torch.no_grad():  # the class-token rows at zero: then rel2d_full is the same function
        for blk in t.blocks:
            blk.attn.relative_position_bias_table[-3:] = 0
        torch.testing.assert_close(m(_x()), t(_x()), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "kw, said",
    [
        ({"use_shared_rel_pos_bias": True}, "a relative bias in every block and a shared one"),
    ],
)
def test_what_vitrel_has_no_equivalent_of_is_refused(kw, said):
    t = timm.create_model("beit_base_patch16_224", **{**SMALL, **kw})
    with pytest.raises(UnsupportedTimmModel, match=said):
        vitrel.from_timm(t)
