"""LieRE and ComRoPE (vitrel/pos/lie.py) against a float64 reimplementation of the authors' forward
(Longin-Yu/ComRoPE ``model.py`` at 7aeef08: ``get_positions``, ``get_exponent_matrix`` of each
attention class, the full ``d x d`` block-diagonal ``R = exp(sum_a A_a x_a)``, ``(R q) . (R k)``),
with scipy's ``expm`` for the exponential."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg
import torch

from vitrel import Attention

DIM, HEADS = 32, 2
HD = DIM // HEADS


def attn(name, grid=(3, 4), prefix=1, **opts):
    torch.manual_seed(0)
    a = Attention(DIM, HEADS, pos={"name": name, **opts}, grid=grid, num_prefix_tokens=prefix).double()
    return a


def authors_generators(scheme) -> np.ndarray:
    """``[heads, 2, d, d]``: each axis's generator as the full block-diagonal matrix, built as the authors'
    ``get_exponent_matrix`` (skew = F - F^T; ld: times the per-axis multiplier; ap: round-robin mask)."""
    b, m = scheme.block_size, scheme.num_blocks
    f = scheme.generator.detach().double().numpy()
    skew = f - np.swapaxes(f, -1, -2)  # [heads, axes or 1, m, b, b]
    if scheme.name == "comrope" and scheme.variant == "ld":
        skew = skew * scheme.multiplier.detach().double().numpy()
    elif scheme.name == "comrope":
        mask = np.zeros((2, m))
        for i in range(2):
            mask[i, i::2] = 1.0
        skew = np.broadcast_to(skew, (skew.shape[0], 2, m, b, b)) * mask[None, :, :, None, None]
    out = np.zeros((skew.shape[0], 2, m * b, m * b))
    for h in range(skew.shape[0]):
        for a in range(2):
            for j in range(m):
                out[h, a, j * b : (j + 1) * b, j * b : (j + 1) * b] = skew[h, a, j]
    return out


def authors_positions(grid, prefix, cls_position=0.5, axis_scale=True) -> np.ndarray:
    """``get_positions`` for an ``H x W`` grid (the authors' code takes a square one: per axis here)."""
    H, W = grid
    pos = [[r, c] for r in range(H) for c in range(W)]
    pos = np.array(pos, dtype=np.float64)
    if axis_scale:
        pos = (pos + 0.5) / np.array([H, W])
    cls = np.full((prefix, 2), cls_position if cls_position is not None else 0.0)
    return np.concatenate([cls, pos], axis=0)


def authors_logits(a: Attention, x: torch.Tensor, grid, cls_position=0.5, axis_scale=True) -> torch.Tensor:
    q, k, _ = a.qkv(x).reshape(x.shape[0], x.shape[1], 3, HEADS, HD).permute(2, 0, 3, 1, 4).unbind(0)
    gens = authors_generators(a.pos)
    pos = authors_positions(grid, a.num_prefix_tokens, cls_position, axis_scale)
    n = pos.shape[0]
    out = torch.zeros(x.shape[0], HEADS, n, n, dtype=torch.float64)
    for h in range(HEADS):
        rots = [scipy.linalg.expm(pos[i, 0] * gens[h, 0] + pos[i, 1] * gens[h, 1]) for i in range(n)]
        rq = np.stack([rots[i] @ q[:, h, i].detach().numpy().T for i in range(n)], axis=1)  # [d, n, B]
        rk = np.stack([rots[i] @ k[:, h, i].detach().numpy().T for i in range(n)], axis=1)
        out[:, h] = torch.from_numpy(np.einsum("dnb,dmb->bnm", rq, rk)) * HD**-0.5
    return out


CASES = [
    ("liere", {}),
    ("liere", {"block_size": 4}),
    ("comrope", {"variant": "ld"}),
    ("comrope", {"variant": "ld", "block_size": 4}),
    ("comrope", {"variant": "ap"}),
    ("comrope", {"variant": "ap", "block_size": 4}),
]


@pytest.mark.parametrize("name, opts", CASES)
def test_logits_equal_the_authors_forward(name, opts):
    a = attn(name, **opts)
    x = torch.randn(2, 1 + 12, DIM, dtype=torch.float64)
    torch.testing.assert_close(a.logits(x, grid=(3, 4)), authors_logits(a, x, (3, 4)), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("cls_position, coords", [(None, "normalized"), (0.5, "index")])
def test_options_prefix_unrotated_and_index_coords(cls_position, coords):
    a = attn("comrope", cls_position=cls_position, coords=coords, block_size=4)
    x = torch.randn(1, 1 + 12, DIM, dtype=torch.float64)
    want = authors_logits(a, x, (3, 4), cls_position=cls_position, axis_scale=coords == "normalized")
    torch.testing.assert_close(a.logits(x, grid=(3, 4)), want, rtol=1e-9, atol=1e-9)


def shift_violation(a: Attention) -> float:
    """Max |logit(i, j) - logit(i + s, j + s)| over patch pairs when the content moves by s = (1, 2)."""
    h, w = 5, 6
    torch.manual_seed(1)
    patches = torch.randn(1, h, w, DIM, dtype=torch.float64)
    shifted = torch.roll(patches, shifts=(1, 2), dims=(1, 2))
    la = a.logits(patches.reshape(1, h * w, DIM), grid=(h, w))
    lb = a.logits(shifted.reshape(1, h * w, DIM), grid=(h, w))
    src = torch.tensor([r * w + c for r in range(h - 1) for c in range(w - 2)])
    dst = torch.tensor([(r + 1) * w + (c + 2) for r in range(h - 1) for c in range(w - 2)])
    return (la[:, :, src][:, :, :, src] - lb[:, :, dst][:, :, :, dst]).abs().max().item()


@pytest.mark.parametrize("variant", ["ld", "ap"])
def test_comrope_is_exactly_relative_and_liere_approximately(variant):
    """ComRoPE's commuting generators: exact. LieRE with 4 x 4 blocks: its generators do not commute and
    the logits change with a translation (documented as approximate); with 2 x 2 blocks it is exact."""
    com = attn("comrope", grid=(5, 6), prefix=0, variant=variant, block_size=4)
    assert com.pos.exactly_relative and shift_violation(com) < 1e-9
    lie4 = attn("liere", grid=(5, 6), prefix=0, block_size=4)
    assert not lie4.pos.exactly_relative and shift_violation(lie4) > 1e-3
    lie2 = attn("liere", grid=(5, 6), prefix=0, block_size=2)
    assert lie2.pos.exactly_relative and shift_violation(lie2) < 1e-9


@pytest.mark.parametrize("name, opts", [("liere", {"block_size": 4}), ("comrope", {"variant": "ld"})])
def test_gradients_reach_the_generators(name, opts):
    a = attn(name, grid=(2, 2), prefix=1, **opts)
    x = torch.randn(1, 5, DIM, dtype=torch.float64)
    params = [p for n, p in a.pos.named_parameters()]

    def f(*ps):
        with torch.no_grad():
            for p, v in zip(params, ps):
                p.copy_(v)
        return a.logits(x, grid=(2, 2))

    # the analytic gradient against central differences of the whole logits
    a.zero_grad()
    w = torch.randn_like(a.logits(x, grid=(2, 2)))
    (a.logits(x, grid=(2, 2)) * w).sum().backward()
    for p in params:
        g = p.grad.clone()
        idx = tuple(int(i) for i in torch.nonzero(g.abs() > 1e-6)[0])
        eps, old = 1e-6, p.data[idx].item()
        with torch.no_grad():
            p.data[idx] = old + eps
            up = (a.logits(x, grid=(2, 2)) * w).sum().item()
            p.data[idx] = old - eps
            down = (a.logits(x, grid=(2, 2)) * w).sum().item()
            p.data[idx] = old
        assert g[idx].item() == pytest.approx((up - down) / (2 * eps), rel=1e-5, abs=1e-7)


def test_rotation_is_computed_once_per_forward_and_orthogonal():
    a = attn("comrope", block_size=4)
    st = a.pos.prepare((3, 4), 1, None, torch.float64)
    (r,) = st.rope
    assert r.shape == (HEADS, 13, HD // 4, 4, 4)
    eye = torch.eye(4, dtype=r.dtype).expand_as(r)
    torch.testing.assert_close(r @ r.transpose(-1, -2), eye)
    # 2 x 2 blocks: the plane rotations as cos / sin, equal to the matrix exponential's entries
    b2 = attn("liere", block_size=2).pos
    cos, sin = b2.prepare((3, 4), 1, None, torch.float64).rope
    from vitrel.pos.lie import block_rotations

    full = block_rotations(b2.generators().double(), b2.positions(b2.grid, 1, None, torch.float64))
    torch.testing.assert_close(cos, full[..., 0, 0])
    torch.testing.assert_close(sin, full[..., 1, 0])


@pytest.mark.parametrize(
    "name, opts, match",
    [
        ("liere", {"block_size": 3}, "block_size"),
        ("comrope", {"block_size": 16}, "block_size must divide 8"),  # ap needs d/2 % b: 16 > 8
        ("comrope", {"variant": "xy"}, "variant"),
        ("liere", {"coords": "pixels"}, "coords"),
    ],
)
def test_bad_options_are_one_clear_error(name, opts, match):
    if match.startswith("block_size must divide"):
        opts = {**opts, "variant": "ap"}
    with pytest.raises(ValueError, match=match):
        attn(name, **opts)
