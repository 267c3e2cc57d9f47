"""Spiral RoPE (vitrel/pos/schemes/rope.py, ``spiral_rope``) against a float64 loop reference of its equation."""

from __future__ import annotations

import math

import pytest
import torch

from vitrel import Attention
from vitrel.layout.geometry import as_grid
from vitrel.pos.registry import build_pos

HEADS, D = 2, 16


def scheme(**opts):
    return build_pos({"name": "spiral_rope", **opts}, num_heads=HEADS, head_dim=D, grid=(3, 4))


def ref_angles(grid, K, same_theta, base):
    """theta[p, k * d/(2K) + j] = (c cos(pi k/K) + r sin(pi k/K)) * omega_{k, j}, with loops."""
    H, W = grid
    per = D // (2 * K)
    out = torch.zeros(H * W, D // 2, dtype=torch.float64)
    for r in range(H):
        for c in range(W):
            for k in range(K):
                proj = c * math.cos(math.pi * k / K) + r * math.sin(math.pi * k / K)
                for j in range(per):
                    t = j if same_theta else k + j * K  # round robin over the d/2 frequencies
                    dim = D // K if same_theta else D
                    out[r * W + c, k * per + j] = proj * base ** (-2 * t / dim)
    return out


@pytest.mark.parametrize("K, same_theta", [(1, False), (2, False), (4, False), (4, True), (8, False)])
def test_angles_equal_the_equation(K, same_theta):
    s = scheme(directions=K, same_theta=same_theta, base=100.0)
    torch.testing.assert_close(s.angles(as_grid((5, 3))), ref_angles((5, 3), K, same_theta, 100.0))


def test_two_directions_with_shared_frequencies_are_axial_rope_with_halves_swapped():
    """Direction 0 is the column axis, 1 the row axis; rope2d_axial rotates the rows first: the same angles once
    the two halves of the pairs are exchanged (what swapping the halves of each head's q and k channels does)."""
    spiral = scheme(directions=2, same_theta=True, base=100.0)
    axial = build_pos({"name": "rope2d_axial", "base": 100.0}, num_heads=HEADS, head_dim=D, grid=(3, 4))
    g = as_grid((6, 7))
    q = D // 4
    swapped = torch.cat((axial.angles(g)[:, q:], axial.angles(g)[:, :q]), dim=-1)
    torch.testing.assert_close(spiral.angles(g), swapped, rtol=0, atol=1e-12)
    assert (spiral.angles(g) - axial.angles(g)).abs().max() > 1  # without the swap they differ


def test_every_frequency_is_distinct_by_default():
    f = scheme(directions=4).direction_freqs()
    assert f.shape == (4, D // 8) and f.flatten().unique().numel() == D // 2


def test_logits_are_relative_and_differentiable():
    torch.manual_seed(0)
    a = Attention(HEADS * D, HEADS, pos={"name": "spiral_rope", "directions": 4}, grid=(4, 4)).double()
    x = torch.randn(1, 16, HEADS * D, dtype=torch.float64, requires_grad=True)
    a.logits(x, grid=(4, 4)).sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize(
    "opts, match",
    [
        ({"directions": 3}, "divisible by 2 \\* directions"),
        ({"directions": 0}, "positive integer"),
        ({"scaling": {"rope_type": "yarn", "factor": 2}}, "linear only"),
    ],
)
def test_bad_options_are_one_clear_error(opts, match):
    with pytest.raises(ValueError, match=match):
        scheme(**opts)
