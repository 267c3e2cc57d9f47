"""Schemes measured from their training grid (RoPE ``scaling``, LieRE's ``coords: linspace``) keep it when the
model is rebuilt at another size: ``load_model(path, img_size=...)`` (``eval.py data.img_size``) and
``set_input_size`` give the trained model's function, at the new size and at the trained one."""

from __future__ import annotations

import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import vitrel
from vitrel.models.checkpoint import save_pretrained

VIT = "vitrel_vit_tiny_patch4_32"
VIT_ARGS = dict(embed_dim=32, depth=2, num_heads=2, num_classes=5)
SWIN = "vitrel_swin_tiny_patch2_window4_32"
SWIN_ARGS = dict(embed_dim=16, depths=(2, 2, 2, 2), num_heads=(2, 2, 2, 4), num_classes=5, drop_path_rate=0.0)

SCHEMES = [
    "liere",
    {"name": "rope2d_axial", "scaling": {"rope_type": "yarn", "factor": "auto"}},
    {"name": "rope2d_axial", "scaling": {"rope_type": "dynamic", "factor": 2}},
    {"name": "rope2d_mixed", "scaling": {"rope_type": "ntk", "factor": "auto"}},
    {"name": "rope1d", "scaling": {"rope_type": "linear", "factor": "auto"}},
]


def _model(arch: str, pos, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    args = {**(VIT_ARGS if arch == VIT else SWIN_ARGS), **kw}
    m = vitrel.create_model(arch, pos=pos, **args).eval()
    with torch.no_grad():  # non-trivial weights everywhere
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return m


def _load(path, **kw) -> torch.nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return vitrel.load_model(path, **kw).eval()


def _close(a: torch.nn.Module, b: torch.nn.Module, size: int) -> None:
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(size))
    with torch.no_grad():
        torch.testing.assert_close(a(x), b(x), rtol=0, atol=1e-5)


@pytest.mark.parametrize("pos", SCHEMES, ids=lambda p: p if isinstance(p, str) else f"{p['name']}-{p['scaling']}")
def test_load_at_another_size_keeps_the_trained_function(tmp_path, pos):
    m = _model(VIT, pos)
    save_pretrained(m, tmp_path)
    big = _load(tmp_path, img_size=48)
    _close(big, m, 48)  # eval.py data.img_size=48: the trained model's logits at 48 px
    _close(big, m, 32)  # and the trained size unchanged
    save_pretrained(big, tmp_path / "again")  # saved at 48, loaded at its stored size: still trained at 32
    _close(_load(tmp_path / "again"), m, 48)
    m.set_input_size(img_size=40)
    _close(m, _load(tmp_path), 40)


def test_weights_stored_without_the_reference_take_the_stored_size(tmp_path):
    """A checkpoint written before ``ref_grid`` existed: ``load_model`` takes the reference from the size the
    checkpoint stores; a plain state dict loads at the size built."""
    m = _model(VIT, "liere")
    save_pretrained(m, tmp_path)
    f = tmp_path / "model.safetensors"
    sd = load_file(f)
    with safe_open(str(f), "pt") as fh:
        meta = fh.metadata()
    save_file({k: v for k, v in sd.items() if not k.endswith("ref_grid")}, str(f), metadata=meta)
    _close(_load(tmp_path, img_size=48), m, 48)
    _close(_load(tmp_path), m, 32)


def test_scored_variant_without_the_option_loads():
    """liere's weights into ``coords: linspace_unit`` (the study's ``liere_interp``), and plain RoPE's into a scaled
    variant: strict loads, the reference of the weights' size."""
    m = _model(VIT, "liere")
    unit = _model(VIT, {"name": "liere", "coords": "linspace_unit"})
    unit.load_state_dict(m.state_dict())
    plain = _model(VIT, "rope2d_axial")
    scaled = _model(VIT, {"name": "rope2d_axial", "scaling": {"rope_type": "yarn", "factor": "auto"}})
    scaled.load_state_dict(plain.state_dict())
    assert "blocks.0.attn.pos.ref_grid" in scaled.state_dict()


def test_swin_at_another_size_keeps_each_stage_reference(tmp_path):
    """At 64 px the last stage's grid (4x4) is no longer smaller than the window: its scheme is built for 4x4, the
    trained one for 2x2."""
    m = _model(SWIN, "liere")
    save_pretrained(m, tmp_path)
    _close(_load(tmp_path, img_size=64), m, 64)


VIDEO = "vitrel_vit_video_tiny_patch4_32"


@pytest.mark.parametrize("pos", [
    {"name": "rope3d_mixed", "scaling": {"rope_type": "yarn", "factor": "auto"}},
    {"name": "rope3d_axial", "scaling": {"rope_type": "ntk", "factor": "auto"}},
], ids=lambda p: f"{p['name']}-{p['scaling']['rope_type']}")  # fmt: skip
def test_a_video_model_at_more_frames_and_pixels_keeps_the_trained_function(tmp_path, pos):
    """3-D RoPE with ``scaling`` reads its training grid ``(T, H, W)`` as the 2-D schemes do: a video model loaded
    with more frames and pixels (``eval.py data.num_frames=16 data.img_size=48``) scaled nothing, and at the trained
    size gave other logits."""
    torch.manual_seed(0)
    m = vitrel.create_model(VIDEO, pos=pos, embed_dim=32, depth=2, num_heads=2, num_classes=5, num_frames=8).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))
    save_pretrained(m, tmp_path)
    big = _load(tmp_path, img_size=48, num_frames=16)
    trained, built = m.blocks[0].attn.pos.grid, big.blocks[0].attn.pos.grid
    assert big.state_dict()["blocks.0.attn.pos.ref_grid"].tolist() == list(trained) != list(built)
    for frames, size in ((16, 48), (8, 32)):
        x = torch.randn(2, 1, frames, size, size, generator=torch.Generator().manual_seed(size))
        with torch.no_grad():
            torch.testing.assert_close(big(x), m(x), rtol=0, atol=1e-5)


@pytest.mark.parametrize("resize", [dict(num_frames=16), dict(num_frames=32, img_size=48)], ids=["frames", "both"])
def test_scaling_given_at_load_measures_time_from_the_trained_frames(tmp_path, resize):
    """Weights trained without ``scaling``, loaded with it (``eval.py '+model_overrides.pos.scaling=...'
    data.num_frames=16``): the reference is the trained clip length, as when loaded at the trained size; the new
    length made it the reference (a factor of 1: no scaling)."""
    torch.manual_seed(0)
    m = vitrel.create_model(VIDEO, pos="rope3d_axial", embed_dim=32, depth=2, num_heads=2, num_classes=5, num_frames=8)
    save_pretrained(m, tmp_path)
    scaled = {"scaling": {"rope_type": "linear", "factor": "auto"}}
    at_trained, resized = _load(tmp_path, pos=scaled), _load(tmp_path, pos=scaled, **resize)
    assert resized.blocks[0].attn.pos.ref_grid.tolist() == list(m.blocks[0].attn.pos.grid)
    size = resize.get("img_size", 32)
    x = torch.randn(2, 1, resize["num_frames"], size, size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(resized(x), at_trained(x), rtol=0, atol=1e-5)
