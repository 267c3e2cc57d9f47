"""The plain attributes timm users' code reads off a model (``pos_embed``, ``num_layers``, ``no_embed_class`` ...) are
there with timm's values for the same configuration, and ``pos_embed`` is the Parameter the model trains: finetuning
scripts (MAE / DeiT ``interpolate_pos_embed``, ``timm.layers.resample_abs_pos_embed``) edit the model through it."""

from __future__ import annotations

import pytest
import timm
import torch
from timm.layers import resample_abs_pos_embed

import vitrel

VIT = dict(img_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=5)
SWIN = dict(
    img_size=32, patch_size=2, embed_dim=16, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4), window_size=4, num_classes=5
)
VIT_CASES = [dict(), dict(reg_tokens=2), dict(class_token=False, global_pool="avg", reg_tokens=1)]


def _vit(**kw) -> torch.nn.Module:
    torch.manual_seed(0)
    return vitrel.create_model("vitrel_vit_tiny_patch4_32", **{**VIT, "pos": "ape", **kw}).eval()


def interpolate_pos_embed(model: torch.nn.Module, checkpoint_model: dict) -> None:
    """MAE's / DeiT's ``util/pos_embed.py::interpolate_pos_embed`` as finetuning scripts carry it (square grids):
    resizes the checkpoint's ``pos_embed`` to the model's, reading ``model.pos_embed`` and ``patch_embed``."""
    pos_embed_checkpoint = checkpoint_model["pos_embed"]
    embedding_size = pos_embed_checkpoint.shape[-1]
    num_patches = model.patch_embed.num_patches
    num_extra_tokens = model.pos_embed.shape[-2] - num_patches
    orig_size = int((pos_embed_checkpoint.shape[-2] - num_extra_tokens) ** 0.5)
    new_size = int(num_patches**0.5)
    if orig_size != new_size:
        extra_tokens = pos_embed_checkpoint[:, :num_extra_tokens]
        pos_tokens = pos_embed_checkpoint[:, num_extra_tokens:]
        pos_tokens = pos_tokens.reshape(-1, orig_size, orig_size, embedding_size).permute(0, 3, 1, 2)
        pos_tokens = torch.nn.functional.interpolate(
            pos_tokens, size=(new_size, new_size), mode="bicubic", align_corners=False
        )
        pos_tokens = pos_tokens.permute(0, 2, 3, 1).flatten(1, 2)
        checkpoint_model["pos_embed"] = torch.cat((extra_tokens, pos_tokens), dim=1)


# ---------------------------------------------------------------------------- pos_embed
def test_pos_embed_is_the_parameter_the_model_trains():
    m = _vit().train()
    assert m.pos_embed is m.abs_pos.pos_embed
    assert any(p is m.pos_embed for p in m.parameters())
    m(torch.randn(2, 3, 32, 32)).square().sum().backward()
    assert m.pos_embed.grad is not None and m.pos_embed.grad.abs().sum() > 0
    keys = set(m.state_dict())  # the state-dict key is unchanged: checkpoints written before still load
    assert "abs_pos.pos_embed" in keys and "pos_embed" not in keys
    _vit().load_state_dict(m.state_dict())


@pytest.mark.parametrize("kw", VIT_CASES, ids=["token", "registers", "avg"])
def test_pos_embed_shape_is_timms(kw):
    """vitrel adds the embedding to the patch tokens only: timm's ``no_embed_class=True`` shape ``[1, N, C]``."""
    ours = _vit(**kw)
    theirs = timm.create_model("vit_tiny_patch16_224", pretrained=False, no_embed_class=True, **VIT, **kw)
    assert ours.pos_embed.shape == theirs.pos_embed.shape
    assert ours.no_embed_class is theirs.no_embed_class is True


@pytest.mark.parametrize("pos", ["rel2d_full", "rope2d_axial", "sincos2d", "none"])
def test_pos_embed_is_none_without_a_learned_table_as_timms(pos):
    theirs = timm.create_model("vit_tiny_patch16_224", pretrained=False, pos_embed="none", **VIT)
    assert _vit(pos=pos).pos_embed is None and theirs.pos_embed is None
    assert _vit(pos="rope2d_axial", abs_pos="ape").pos_embed.shape == (1, 64, 32)  # the absolute one beside RoPE


def test_interpolate_pos_embed_through_the_alias_changes_the_model():
    """A finetuning script's edit: a checkpoint's 4 x 4 embedding resized to the model's 8 x 8 grid (MAE's function,
    and timm's ``resample_abs_pos_embed``) and copied in through ``model.pos_embed``: the model computes with it."""
    m = _vit()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        before = m(x)
    small = torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(1))
    ckpt = {"pos_embed": small}
    interpolate_pos_embed(m, ckpt)
    timm_way = resample_abs_pos_embed(small, new_size=m.patch_embed.grid_size, old_size=(4, 4), num_prefix_tokens=0)
    for new in (ckpt["pos_embed"], timm_way):
        with torch.no_grad():
            m.pos_embed.copy_(new)
            after = m(x)
        assert not torch.allclose(before, after, atol=1e-3)
        torch.testing.assert_close(m.state_dict()["abs_pos.pos_embed"], new, rtol=0, atol=0)
        fresh = _vit()  # (as a checkpoint of the edited model loads)
        fresh.load_state_dict(m.state_dict())
        with torch.no_grad():
            torch.testing.assert_close(fresh(x), after)


def test_replacing_pos_embed_is_one_error_naming_what_works():
    m = _vit()
    with pytest.raises(AttributeError, match=r"copy_\(new\).*set_input_size"):
        m.pos_embed = torch.nn.Parameter(torch.zeros(1, 64, 32))
    assert m.pos_embed is m.abs_pos.pos_embed


# ---------------------------------------------------------------------------- plain attributes
VIT_ATTRS = (
    "embed_dim", "num_features", "head_hidden_size", "num_prefix_tokens", "num_reg_tokens", "has_class_token",
    "no_embed_class", "pool_include_prefix", "global_pool", "num_classes", "in_chans", "grad_checkpointing",
    "feature_info",
)  # fmt: skip
SWIN_ATTRS = (
    "num_layers", "embed_dim", "num_features", "head_hidden_size", "global_pool", "num_classes", "in_chans",
    "feature_info", "output_fmt",
)  # fmt: skip


@pytest.mark.parametrize("kw", VIT_CASES, ids=["token", "registers", "avg"])
def test_vit_attributes_are_timms(kw):
    ours = _vit(**kw)
    theirs = timm.create_model("vit_tiny_patch16_224", pretrained=False, no_embed_class=True, **VIT, **kw)
    assert {a: getattr(ours, a) for a in VIT_ATTRS} == {a: getattr(theirs, a) for a in VIT_ATTRS}


@pytest.mark.parametrize("depths", [(2, 2, 2, 2), (2, 2, 2)], ids=["four", "three"])
def test_swin_attributes_are_timms(depths):
    kw = {**SWIN, "depths": depths, "num_heads": SWIN["num_heads"][: len(depths)]}
    ours = vitrel.create_model("vitrel_swin_tiny_patch2_window4_32", **kw)
    theirs = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, **kw)
    assert {a: getattr(ours, a) for a in SWIN_ATTRS} == {a: getattr(theirs, a) for a in SWIN_ATTRS}
    assert ours.num_layers == len(depths)
