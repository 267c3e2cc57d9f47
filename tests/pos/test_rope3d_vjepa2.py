"""``rope3d_vjepa2`` (vitrel/pos/schemes/rope3d_vjepa2.py): V-JEPA 2's released rotation against its code and against
the equation written out channel by channel, in float64, forward and gradients."""

from __future__ import annotations

import math

import pytest
import torch

from tests.pos.test_rope3d import vjepa2_qk
from tests.reference import coords3
from vitrel import Attention
from vitrel.layout.geometry import Grid3
from vitrel.pos import build_pos


def released_qk(q: torch.Tensor, grid: Grid3) -> torch.Tensor:
    """V-JEPA 2's ``RoPEAttention`` rotation as released (their ``repeat`` expansion, which its checkpoints were trained
    with): tests/pos/test_rope3d.py's rewrite of their code."""
    return vjepa2_qk(q, grid, fixed=False)


def equation_qk(q: torch.Tensor, grid: Grid3, prefix: int = 0) -> torch.Tensor:
    """The module docstring's equation, a loop over tokens and channels: channel ``c`` of axis ``a``'s section at
    ``theta_c = x_a * 10000^(-(c mod s) / s)``, pairs ``(2j, 2j+1)`` turned with their own angles; prefix tokens and
    the channels after the sections unchanged."""
    d = q.shape[-1]
    s = (d // 3) // 2
    out = q.clone()
    for n, x in enumerate(coords3(*grid)):
        theta = [0.0] * d
        for a in range(3):
            for c in range(2 * s):
                theta[2 * s * a + c] = x[a] * 10000.0 ** (-(c % s) / s)
        i = prefix + n
        for j in range(d // 2):
            a0, a1 = theta[2 * j], theta[2 * j + 1]
            x0, x1 = q[..., i, 2 * j], q[..., i, 2 * j + 1]
            out[..., i, 2 * j] = x0 * math.cos(a0) - x1 * math.sin(a0)
            out[..., i, 2 * j + 1] = x1 * math.cos(a1) + x0 * math.sin(a1)
    return out


@pytest.mark.parametrize("d", [16, 64, 80])
def test_equals_vjepa2_released_code(d):
    """ViT-L / ViT-g heads (64: 10 pairs an axis, 4 channels unrotated) and ViT-H's (80: 13 pairs, 2 unrotated)."""
    torch.manual_seed(0)
    grid = Grid3(3, 4, 5)
    s = build_pos("rope3d_vjepa2", num_heads=2, head_dim=d, grid=grid).double()
    q = torch.randn(2, 2, grid.n, d, dtype=torch.float64)
    qr, kr = s.rotate(q, q.flip(0), s.prepare(grid, 0, q.device, q.dtype))
    torch.testing.assert_close(qr, released_qk(q, grid), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(kr, released_qk(q.flip(0), grid), rtol=1e-12, atol=1e-12)
    # rope3d_axial (the authors' documented fix) is another function: the comparison can fail
    fixed = build_pos("rope3d_axial", num_heads=2, head_dim=d, grid=grid).double()
    qf, _ = fixed.rotate(q, q, fixed.prepare(grid, 0, q.device, q.dtype))
    assert (qf - qr).abs().max() > 1e-2


@pytest.mark.parametrize("prefix", [0, 2])
def test_attention_equals_the_equation_forward_and_gradients(prefix):
    """An attention layer with the scheme, at a grid other than the built one, against softmax(q~ k~^T / sqrt(d)) v
    with q~, k~ from the loop: output and the gradients of the input and of the projections."""
    torch.manual_seed(1)
    heads, d = 2, 16
    grid = Grid3(2, 3, 2)
    a = Attention(heads * d, heads, pos="rope3d_vjepa2", grid=(1, 2, 2), num_prefix_tokens=prefix).double()
    x = torch.randn(2, prefix + grid.n, heads * d, dtype=torch.float64, requires_grad=True)
    y = a(x, grid)
    xr = x.detach().clone().requires_grad_(True)
    q, k, v = a.qkv(xr).unflatten(-1, (3, heads, d)).permute(2, 0, 3, 1, 4)
    q, k = equation_qk(q, grid, prefix), equation_qk(k, grid, prefix)
    w = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), dim=-1)
    ref = a.proj((w @ v).transpose(1, 2).flatten(2))
    torch.testing.assert_close(y, ref, rtol=1e-10, atol=1e-12)
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, a.qkv.weight], g)
    want = torch.autograd.grad(ref, [xr, a.qkv.weight], g)
    for u, v_ in zip(got, want):
        torch.testing.assert_close(u, v_, rtol=1e-10, atol=1e-12)


def test_logits_depend_on_where_the_tubelets_are():
    """Not a rotation: ``|q~|`` changes with the position, and the same offset gives other logits elsewhere."""
    s = build_pos("rope3d_vjepa2", num_heads=1, head_dim=16, grid=(2, 4, 4)).double()
    assert not s.exactly_relative and not s.fusable_rotation()
    q = torch.randn(1, 1, 32, 16, dtype=torch.float64)
    qr, _ = s.rotate(q, q, s.prepare(Grid3(2, 4, 4), 0, q.device, q.dtype))
    assert (qr.norm(dim=-1) - q.norm(dim=-1)).abs().max() > 1e-3


def test_refuses_options_it_does_not_have():
    sizes = dict(num_heads=1, head_dim=64, grid=(2, 2, 2))
    with pytest.raises(ValueError, match="no scaling"):
        build_pos({"name": "rope3d_vjepa2", "scaling": {"rope_type": "linear", "factor": 2.0}}, **sizes)
    with pytest.raises(ValueError, match="has no option"):
        build_pos({"name": "rope3d_vjepa2", "layout": "interleaved"}, **sizes)
    with pytest.raises(ValueError, match="too small"):
        build_pos("rope3d_vjepa2", num_heads=1, head_dim=4, grid=(2, 2, 2))
