"""fire1d / fire2d: the bias and its gradients against float64 loops written from the equations
(vitrel/pos/schemes/fire.py's docstring), causal and bidirectional, prefix tokens, any grid at call time;
translation invariance where it holds (fire2d; fire1d below its threshold) and where it does not (fire1d
beyond it), the listing's defaults, weight decay."""

from __future__ import annotations

import math

import pytest
import torch

import vitrel
from tests.reference import autocast_param_errors
from vitrel.kernels import get_kernel
from vitrel.layers import Attention
from vitrel.layout.geometry import Grid
from vitrel.pos import build_pos
from vitrel.train.optim import param_groups

HEADS = 3


def _scheme(name: str, c, L, seed: int = 0, **kw):
    """A float64 scheme with random MLP weights (std 0.5: every unit matters) and the given c and L."""
    torch.manual_seed(seed)
    s = build_pos({"name": name, **kw}, num_heads=HEADS, head_dim=8, grid=(3, 4)).double()
    with torch.no_grad():
        for m in (s.mlp[0], s.mlp[2]):
            m.weight.normal_(0.0, 0.5)
            m.bias.normal_(0.0, 0.5)
        s.c.copy_(torch.as_tensor(c, dtype=torch.float64))
        s.L_multiplier.copy_(torch.as_tensor(L, dtype=torch.float64) / s.init_L)
    return s


def _mlp(s, x: list):
    """``f_theta(x)`` written out, every head: ``W2 relu(W1 x + b1) + b2`` with ``W1 x = sum_a W1[:, a] x_a``."""
    w1, b1, w2, b2 = s.mlp[0].weight, s.mlp[0].bias, s.mlp[2].weight, s.mlp[2].bias
    pre = b1
    for a, xa in enumerate(x):
        pre = pre + w1[:, a] * xa
    return (w2 * torch.clamp(pre, min=0.0)).sum(dim=1) + b2


def _dense(fn, h: int, w: int, prefix: int):
    """``[heads, N, N]``: ``fn((ri, ci), (rj, cj))`` (every head) between patches, 0 with a prefix token."""
    pts = [(r, c) for r in range(h) for c in range(w)]
    rows = [torch.zeros(HEADS, prefix + len(pts), dtype=torch.float64) for _ in range(prefix)]
    for qi in pts:
        row = [torch.zeros(HEADS, dtype=torch.float64)] * prefix + [fn(qi, kj) for kj in pts]
        rows.append(torch.stack(row, dim=1))
    return torch.stack(rows, dim=1)


def fire1d_reference(s, h: int, w: int, prefix: int, causal: bool):
    """``f(psi(|p_i - p_j|) / (psi(max(L, p_i)) + eps))``, ``psi(x) = log(|c x| + 1)``, ``L = |L_mult * L0|``."""
    L = torch.abs(s.L_multiplier * s.init_L)

    def psi(x):
        return torch.log(torch.abs(s.c * x) + 1.0)

    def fn(qi, kj):
        pi, pj = qi[0] * w + qi[1], kj[0] * w + kj[1]
        if causal and pj > pi:
            return torch.zeros(HEADS, dtype=torch.float64)
        norm = psi(L) if L > pi else psi(torch.tensor(float(pi), dtype=torch.float64))
        return _mlp(s, [psi(torch.tensor(float(abs(pi - pj)), dtype=torch.float64)) / (norm + s.eps)])

    return _dense(fn, h, w, prefix)


def fire2d_reference(s, h: int, w: int, prefix: int):
    """``f(sign(dh) psi_h(|dh|) / (psi_h(L_h) + eps), sign(dw) psi_w(|dw|) / (psi_w(L_w) + eps))``."""
    L = torch.abs(s.L_multiplier * s.init_L)

    def s_axis(d: int, a: int):
        psi = lambda x: torch.log(torch.abs(s.c[a] * x) + 1.0)  # noqa: E731
        return (
            math.copysign(1.0, d)
            * (d != 0)
            * psi(torch.tensor(float(abs(d)), dtype=torch.float64))
            / (psi(L[a]) + s.eps)
        )

    def fn(qi, kj):
        return _mlp(s, [s_axis(qi[0] - kj[0], 0), s_axis(qi[1] - kj[1], 1)])

    return _dense(fn, h, w, prefix)


def _check(s, reference, grid, prefix):
    """Forward and the gradients w.r.t. every parameter (MLP, c, L_multiplier) of ``sum(bias * R)``."""
    g = Grid(*grid)
    got = s.bias(g, prefix)
    ref = reference(s, g.h, g.w, prefix)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    r = torch.randn_like(ref)
    params = [p for _, p in s.named_parameters()]
    g_got = torch.autograd.grad((got * r).sum(), params)
    g_ref = torch.autograd.grad((ref * r).sum(), params)
    for (n, _), a, b in zip(s.named_parameters(), g_got, g_ref, strict=True):
        assert b.abs().max() > 0, n  # every parameter reaches the bias
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=n)


# c negative too (psi takes |c x|); L between positions, so both branches of max(L, p_i) occur on 3 x 4
@pytest.mark.parametrize(("c", "L"), [(0.37, 5.3), (-0.8, 2.6)])
@pytest.mark.parametrize("causal", [False, True])
def test_fire1d_equals_the_equation(c, L, causal):
    s = _scheme("fire1d", c, L, causal=causal)
    for grid, prefix in [((3, 4), 1), ((2, 5), 0)]:  # the built grid, then another at call time
        _check(s, lambda s, h, w, p: fire1d_reference(s, h, w, p, causal), grid, prefix)


def test_fire2d_equals_the_equation():
    s = _scheme("fire2d", [0.37, -0.9], [2.6, 4.1])  # offsets on both sides of each threshold
    for grid, prefix in [((3, 4), 1), ((5, 2), 0)]:
        _check(s, fire2d_reference, grid, prefix)
    # the offset table is the bias read by offset (what flex reads)
    g = Grid(4, 3)
    t = s.offset_table(g)
    assert t.shape == (HEADS, 7, 5)
    torch.testing.assert_close(vitrel.layout.geometry.expand_offset_table(t, g, 1), s.bias(g, 1), rtol=0, atol=0)


def test_fire1d_causal_in_attention():
    """A causal Attention builds fire1d causal; kept pairs (j <= i) get the bidirectional values."""
    a = Attention(24, HEADS, pos="fire1d", grid=(3, 4), num_prefix_tokens=1, causal=True)
    b = Attention(24, HEADS, pos="fire1d", grid=(3, 4), num_prefix_tokens=1)
    assert a.pos.causal and not b.pos.causal
    b.load_state_dict(a.state_dict())
    ba, bb = a.pos.bias(Grid(3, 4), 1), b.pos.bias(Grid(3, 4), 1)
    torch.testing.assert_close(ba, bb.tril())
    assert bb.triu(1).abs().max() > 0


@pytest.mark.parametrize("name", ["fire1d", "fire2d"])
def test_fire_mlp_gradients_under_autocast_are_those_of_float32_mlp(name):
    """Under fp16 autocast at a 24 x 24 grid, c, L and the MLP's weights get gradients within 7.8e-3 (fire1d's L) and
    1.0e-3 (fire2d) of float64 (the qkv weight's: 6e-4); with the MLP under autocast, up to 2.7e-2 and 4.3e-2:
    its inputs, fire2d's table gradient and every pair's gradient were rounded to fp16 before the sums over the
    pairs. Left out: the last layer's bias, whose gradient is the kernel's bias gradient summed over every pair, a
    sum that cancels (softmax rows), so that its error is the kernel's whatever the MLP's dtype (5e-3 to 7e-3)."""
    grid = (24, 24)
    torch.manual_seed(1)
    a = Attention(48, HEADS, pos=name, grid=grid, num_prefix_tokens=1)
    errors = autocast_param_errors(a, grid)
    for n, err in errors.items():
        if n != "mlp.2.bias":
            assert err < 1e-2, (n, err)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["fire1d", "fire2d"])
def test_fire_under_autocast_is_float32_bit_for_bit(name, dtype):
    # the MLP and what feeds it run in the weights' dtype with autocast off: under autocast the bias, the offset
    # table and the parameters' gradients (for a given bias gradient) are those of float32, bit for bit
    s = build_pos(name, num_heads=HEADS, head_dim=8, grid=(3, 4))
    g = Grid(5, 7)

    def grads(out):  # (outside autocast, as a training step's backward)
        torch.manual_seed(0)
        loss = sum((t * torch.randn(t.shape)).sum() for t in out)
        return out + list(torch.autograd.grad(loss, list(s.parameters())))

    def run():
        return [s.bias(g, 1)] + ([s.offset_table(g)] if s.has_offset_table else [])

    want = grads(run())
    with torch.autocast("cpu", dtype=dtype):
        out = run()
    for t, w in zip(grads(out), want, strict=True):
        assert t.dtype == torch.float32
        torch.testing.assert_close(t, w, rtol=0, atol=0)


def _patch_bias(s, grid, pairs):
    b = s.bias(Grid(*grid), 0)
    return torch.stack([b[:, i, j] for i, j in pairs], dim=1)


def test_fire2d_is_translation_invariant_and_the_same_on_every_grid():
    s = _scheme("fire2d", [0.37, -0.9], [2.6, 4.1])
    h, w = 4, 5
    pts = [(r, c) for r in range(h - 1) for c in range(w - 2)]
    for sh, sw in [(1, 2), (1, 0), (0, 1)]:
        a = [(r * w + c, r2 * w + c2) for r, c in pts for r2, c2 in pts]
        b = [((r + sh) * w + c + sw, (r2 + sh) * w + c2 + sw) for r, c in pts for r2, c2 in pts]
        torch.testing.assert_close(_patch_bias(s, (h, w), a), _patch_bias(s, (h, w), b), rtol=0, atol=1e-13)
    # the same offsets on another grid: the same values
    big = s.offset_table(Grid(6, 7))
    torch.testing.assert_close(big[:, 5 - 3 : 5 + 4, 6 - 4 : 6 + 5], s.offset_table(Grid(h, w)), rtol=0, atol=1e-13)


def _shift_violation_1d(s, n: int, shift: int) -> float:
    """max |b(i, j) - b(i + shift, j + shift)| over the raster positions of a 1 x n grid."""
    b = s.bias(Grid(1, n), 0)
    m = n - shift
    return (b[:, :m, :m] - b[:, shift:, shift:]).abs().max().item()


def test_fire1d_is_relative_only_below_its_threshold():
    """psi(max(L, p_i)) is psi(L) while every position is below L (then the bias is a function of |d|), and reads
    the query's position beyond it: no offset table, and flex is refused."""
    below = _scheme("fire1d", 0.37, 40.0)
    assert _shift_violation_1d(below, 12, 3) < 1e-13
    beyond = _scheme("fire1d", 0.37, 4.0)
    assert _shift_violation_1d(beyond, 12, 3) > 1e-3
    assert not type(beyond).has_offset_table and type(beyond).depends_on_extent
    with pytest.raises(ValueError, match="fire1d has no such table"):
        beyond.prepare(Grid(3, 4), 0, kernel=get_kernel("flex"))


def test_fire1d_raster_order_depends_on_the_width():
    """The raster index p = row * W + col: vertical neighbours are W apart."""
    s = _scheme("fire1d", 0.37, 40.0)
    b4, b6 = s.bias(Grid(2, 4), 0), s.bias(Grid(2, 6), 0)
    torch.testing.assert_close(b4[:, 4, 0], b6[:, 4, 0])  # |d| = 4 on both
    assert (b4[:, 4, 0] - b6[:, 6, 0]).abs().max() > 1e-6  # (1, 0) vs (0, 0): |d| = 4 vs 6


@pytest.mark.parametrize("name", ["fire1d", "fire2d"])
def test_the_listings_defaults_and_names(name):
    """MLP (1 or 2) -> 32 -> heads with ReLU, c = 0.1, L = |1 * 512|, eps 1e-6; the listing's state-dict names."""
    s = build_pos(name, num_heads=HEADS, head_dim=8, grid=(3, 4))
    axes = 1 if name == "fire1d" else 2
    assert [type(m) for m in s.mlp] == [torch.nn.Linear, torch.nn.ReLU, torch.nn.Linear]
    assert s.mlp[0].in_features == axes and s.mlp[0].out_features == 32 and s.mlp[2].out_features == HEADS
    assert torch.all(s.c == 0.1) and torch.all(s.threshold() == 512.0) and s.eps == 1e-6
    assert set(s.state_dict()) == {"c", "init_L", "L_multiplier"} | {
        f"mlp.{i}.{t}" for i in (0, 2) for t in ("weight", "bias")
    }
    assert not s.init_L.requires_grad and "init_L" not in dict(s.named_parameters())


@pytest.mark.parametrize("name", ["fire1d", "fire2d"])
def test_init_c_zero_is_refused(name):
    """At c = 0, |c x| has gradient 0 in c: psi stays 0 and the scheme would train as no position at all."""
    with pytest.raises(ValueError, match="init_c must be non-zero"):
        build_pos(name, num_heads=HEADS, head_dim=8, grid=(3, 4), init_c=0.0)
    s = build_pos(name, num_heads=HEADS, head_dim=8, grid=(3, 4), init_c=-0.1)  # |c| is what counts
    assert torch.all(s.psi(torch.tensor(7.0)) > 0)


def test_c_and_L_get_no_weight_decay_the_mlp_weights_do():
    m = vitrel.create_model("vitrel_vit_tiny_patch4_32", pos="fire2d", embed_dim=32, depth=1, num_heads=2)
    decay, no_decay = param_groups(m)
    ids = {id(p) for p in no_decay["params"]}
    pos = m.blocks[0].attn.pos
    assert id(pos.c) in ids and id(pos.L_multiplier) in ids and id(pos.mlp[0].bias) in ids
    assert id(pos.mlp[0].weight) in {id(p) for p in decay["params"]}
