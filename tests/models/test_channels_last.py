"""``model.to(memory_format=...)``, what timm's ``train.py --channels-last`` does: PyTorch converts every 4-D and 5-D
parameter and buffer (and refuses a 5-D one under ``channels_last``, a 4-D one under ``channels_last_3d``). Every
scheme's model converts, computes what the contiguous model computes (outputs and gradients, float32) and keeps its
state dict; weights stored in the schemes' earlier shapes (LieRE's and ComRoPE's 5-D generators, ``rel3d_full``'s
4-D table) load and give the same outputs."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import vitrel
from vitrel.pos import get_pos_class, list_pos

from ..weights import lively

#: (architecture, reduced sizes, input, memory format)
IMAGE = {
    "vitrel_vit_tiny_patch4_32": dict(depth=1, embed_dim=48),
    "vitrel_swin_tiny_patch2_window4_32": dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4)),
}
VIDEO = {
    "vitrel_vit_video_tiny_patch4_32": dict(depth=2, embed_dim=32, num_heads=2),
    "vitrel_swin3d_tiny_patch122_window444_32": dict(embed_dim=16, depths=(2, 2), num_heads=(2, 2)),
}
CASES = [
    *((arch, pos) for arch in IMAGE for pos in list_pos()),  # (a video scheme on images: one frame)
    *((arch, pos) for arch in VIDEO for pos in list_pos() if get_pos_class(pos).grid_dims in (3, None)),
]


def build(arch: str, pos, **kw) -> tuple[torch.nn.Module, torch.Tensor, torch.memory_format]:
    """A reduced model of ``arch`` with lively weights, an input for it and the memory format it converts to."""
    video = arch in VIDEO
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (a video scheme on an image model says so)
        m = vitrel.create_model(arch, pos=pos, **{**(VIDEO if video else IMAGE)[arch], **kw})
    lively(m.eval())
    g = torch.Generator().manual_seed(3)
    x = torch.randn((1, 1, 8, 32, 32) if video else (2, 3, 32, 32), generator=g)
    return m, x, torch.channels_last_3d if video else torch.channels_last


def assert_close_scaled(got: torch.Tensor, want: torch.Tensor, what: str, floor: float = 0.0) -> None:
    """Equal to float32 rounding: the converted patch embedding sums in another order (1e-6 to 1e-5 of the largest
    entry). ``floor``: the least scale (a gradient that is zero but for rounding, a bias under the softmax)."""
    scale = max(want.abs().max().item(), floor)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * scale, msg=lambda m: f"{what}: {m}")


#: the schemes whose outputs and gradients are compared whatever the conversion touched: those that stored 4-D or
#: 5-D tensors before, and a plain one (the patch convolution converted alone)
NUMBERS = ("liere", "comrope", "rel3d_full", "rel2d_full")


@pytest.mark.parametrize(("arch", "pos"), CASES)
def test_memory_format_conversion_keeps_the_model(arch, pos):
    """Every scheme's model converts and keeps its state dict's shapes. Where the conversion touched a tensor
    besides the patch convolution (or for :data:`NUMBERS`), the converted model computes what the contiguous one
    does; elsewhere the two hold the same tensors but for the patch convolution, which ``NUMBERS`` check."""
    ref, x, fmt = build(arch, pos)
    m = copy.deepcopy(ref)
    m.to(memory_format=fmt)
    before, after = ref.state_dict(), m.state_dict()
    assert {k: tuple(v.shape) for k, v in after.items()} == {k: tuple(v.shape) for k, v in before.items()}
    touched = [k for k, v in before.items() if after[k].stride() != v.stride()]
    assert touched, "the patch convolution converts"
    if pos not in NUMBERS and all(k.startswith("patch_embed.") for k in touched):
        return
    y = m(x.contiguous(memory_format=fmt))
    y.square().sum().backward()
    want = ref(x)
    want.square().sum().backward()
    assert_close_scaled(y, want, "logits")
    floor = 1e-3 * max(q.grad.abs().max().item() for q in ref.parameters())
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        assert p.grad is not None, name
        assert_close_scaled(p.grad, q.grad, name, floor)


#: the parameters stored in another shape before (the schemes' earlier layouts: same values, same order)
OLD_SHAPES = {
    "liere": {"generator": lambda s: (s.num_heads, 2, s.num_blocks, s.block_size, s.block_size)},
    "comrope": {
        "generator": lambda s: (s.num_heads, 1, s.num_blocks, s.block_size, s.block_size),
        "multiplier": lambda s: (1, 2, s.num_blocks, 1, 1),
    },
    "rel3d_full": {"table": lambda s: (2 * s.grid.t - 1, 2 * s.grid.h - 1, 2 * s.grid.w - 1, s.num_heads)},
}


def earlier_state_dict(m: torch.nn.Module, name: str) -> dict[str, torch.Tensor]:
    """``m``'s state dict with the parameters of its ``name`` schemes in their earlier shapes."""
    old, changed = {}, 0
    schemes = {n + ".": s for n, s in m.named_modules() if getattr(s, "name", None) == name}
    for key, value in m.state_dict().items():
        prefix, _, leaf = key.rpartition(".")
        scheme = schemes.get(prefix + ".")
        if scheme is not None and leaf in OLD_SHAPES[name]:
            shape = OLD_SHAPES[name][leaf](scheme)
            assert value.dim() not in (4, 5) and value.numel() == torch.Size(shape).numel()
            value, changed = value.reshape(shape), changed + 1
        old[key] = value.clone()
    assert changed >= len(schemes) >= 1  # (every block's scheme)
    return old


@pytest.mark.parametrize(
    ("arch", "pos"),
    [
        ("vitrel_vit_tiny_patch4_32", "liere"),
        ("vitrel_vit_tiny_patch4_32", {"name": "liere", "preset": "comrope_baseline"}),
        ("vitrel_swin_tiny_patch2_window4_32", {"name": "liere", "block_size": 4}),
        ("vitrel_vit_tiny_patch4_32", "comrope"),
        ("vitrel_vit_tiny_patch4_32", {"name": "comrope", "variant": "ap", "block_size": 4}),
        ("vitrel_vit_video_tiny_patch4_32", "rel3d_full"),
        ("vitrel_swin3d_tiny_patch122_window444_32", "rel3d_full"),
    ],
)
def test_earlier_stored_shapes_load(arch, pos):
    """A state dict with the earlier shapes loads strictly into a fresh model, which then gives the same outputs."""
    m, x, _ = build(arch, pos)
    fresh, _, _ = build(arch, pos)
    fresh.load_state_dict(earlier_state_dict(m, pos if isinstance(pos, str) else pos["name"]))
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), m(x), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("arch", "pos"), [("vitrel_vit_tiny_patch4_32", "comrope"), ("vitrel_vit_video_tiny_patch4_32", "rel3d_full")]
)
def test_a_training_checkpoint_with_the_earlier_shapes_loads(arch, pos, tmp_path):
    """``vitrel.load_model`` and timm's ``pretrained_cfg_overlay=dict(file=...)`` on a training checkpoint whose
    scheme parameters have the earlier shapes: the same model."""
    import timm

    m, x, _ = build(arch, pos)
    sd = {"model." + k: v for k, v in earlier_state_dict(m, pos).items()}
    torch.save({"state_dict": sd, "vitrel_cfg": m.vitrel_cfg}, tmp_path / "old.ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (no data config stored)
        loaded = [
            vitrel.load_model(tmp_path / "old.ckpt"),
            timm.create_model(
                arch,
                pretrained=True,
                pretrained_cfg_overlay={"file": str(tmp_path / "old.ckpt")},
                **(VIDEO if arch in VIDEO else IMAGE)[arch],
                pos=pos,
            ),
        ]
    with torch.no_grad():
        for got in loaded:
            torch.testing.assert_close(got.eval()(x), m(x), rtol=0, atol=0)
