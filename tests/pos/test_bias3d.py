"""The 3-D bias schemes (rel3d_full, rel3d_factored, alibi3d) against float64 references written from the equations
with loops: bias, logits, outputs, the tables' gradients; translation in t, h and w; T = 1 against the 2-D schemes;
call grids larger than the tables (each ``extend`` rule); checkpoints loaded at another size; refusals."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from tests.reference import alibi_slopes_reference, coords3, dense_bias_at, reference_attention
from vitrel import Attention
from vitrel.layout.geometry import Grid, Grid3
from vitrel.layout.tokens import TokenLayout
from vitrel.pos import build_pos

HEADS, DIM = 3, 24
GRIDS = [(2, 3, 4), (3, 2, 2)]


def dense_bias3(fn, heads: int, grid, prefix: int) -> torch.Tensor:
    """``[heads, N, N]``: ``fn(head, p_i, p_j)`` between tubelets ``(t, row, col)``, 0 for pairs with a prefix token."""
    return dense_bias_at(fn, heads, coords3(*grid), prefix)


def _row(d: int, length: int) -> int:
    """Row of offset ``d`` in a table axis of ``length = 2 L - 1`` rows, clamped to its edge."""
    half = (length - 1) // 2
    return max(-half, min(half, d)) + half


def _offsets(pi, pj) -> tuple[int, int, int]:
    return pi[0] - pj[0], pi[1] - pj[1], pi[2] - pj[2]


def full_index(table_shape, pi, pj) -> tuple[int, int, int]:
    return tuple(_row(d, s) for d, s in zip(_offsets(pi, pj), table_shape[:3]))


def ref_full(pos):
    t = pos.table_4d().detach().double()
    return lambda h, pi, pj: t[(*full_index(t.shape, pi, pj), h)]


def ref_factored(pos):
    tables = [x.detach().double() for x in (pos.table_t, pos.table_h, pos.table_w)]
    return lambda h, pi, pj: sum(tb[_row(d, tb.shape[0]), h] for tb, d in zip(tables, _offsets(pi, pj)))


def _slope(pos, h: int) -> float:
    if pos.slope_rule == "geometric":
        return 2.0 ** (-8.0 * (h + 1) / pos.num_heads)
    return alibi_slopes_reference(pos.num_heads)[h]


def ref_alibi3d(pos):
    return lambda h, pi, pj: -_slope(pos, h) * math.sqrt(sum(d * d for d in _offsets(pi, pj)))


REFS = {"rel3d_full": ref_full, "rel3d_factored": ref_factored, "alibi3d": ref_alibi3d}
CASES = [
    ("rel3d_full", {}),
    ("rel3d_full", {"extend": "clip"}),
    ("rel3d_factored", {}),
    ("alibi3d", {}),
    ("alibi3d", {"slopes": "geometric"}),
]


def _make(name, grid, prefix=0, seed=1, **kw):
    torch.manual_seed(seed)
    a = Attention(DIM, HEADS, pos={"name": name, **kw}, grid=grid, num_prefix_tokens=prefix).double()
    with torch.no_grad():  # away from the init: every entry matters
        for p in a.pos.parameters():
            p.normal_(0, 0.5)
    return a


def test_shapes_and_declarations():
    a = _make("rel3d_full", (2, 3, 4))
    assert a.pos.table.shape == (3, 5, 7 * HEADS) and a.pos.grid == Grid3(2, 3, 4)  # (3-D: see test_channels_last)
    assert a.pos.table_4d().shape == (3, 5, 7, HEADS)
    torch.testing.assert_close(a.pos.table_4d()[1, 2, 3], a.pos.table[1, 2, 3 * HEADS : 4 * HEADS], rtol=0, atol=0)
    f = _make("rel3d_factored", (2, 3, 4)).pos
    assert (f.table_t.shape, f.table_h.shape, f.table_w.shape) == ((3, HEADS), (5, HEADS), (7, HEADS))
    assert sum(p.numel() for p in _make("alibi3d", (2, 3, 4)).pos.parameters()) == 0
    for name in REFS:
        assert build_pos(name, num_heads=2, head_dim=8, grid=(2, 3, 3)).grid_dims == 3


@pytest.mark.parametrize(("name", "kw"), CASES)
@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("prefix", [0, 1])
def test_bias_matches_reference(name, kw, grid, prefix):
    a = _make(name, grid, prefix, **kw)
    ref = dense_bias3(REFS[name](a.pos), HEADS, grid, prefix)
    torch.testing.assert_close(a.bias(grid), ref, rtol=1e-12, atol=1e-12)
    # the offset table (flex) read at every pair's offset is the same bias
    t = a.pos.offset_table(Grid3(*grid))
    assert t.shape == (HEADS, *(2 * n - 1 for n in grid))
    for i, pi in enumerate(coords3(*grid)):
        for j, pj in enumerate(coords3(*grid)):
            idx = tuple(d + n - 1 for d, n in zip(_offsets(pi, pj), grid))
            torch.testing.assert_close(t[(slice(None), *idx)].double(), ref[:, prefix + i, prefix + j])


def _table_grad_reference(pos, g_bias: torch.Tensor, grid, prefix: int) -> dict[str, torch.Tensor]:
    """d loss / d table from d loss / d bias by the chain rule written out: each pair's gradient added to the table
    entries its bias reads (loops)."""
    pts = coords3(*grid)
    grads = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in pos.named_parameters()}
    if "table" in grads:  # stored [2T-1, 2H-1, (2W-1) heads]: a view of it as [2T-1, 2H-1, 2W-1, heads]
        grads["table"] = grads["table"].view(*grads["table"].shape[:2], -1, pos.num_heads)
    for h in range(pos.num_heads):
        for a, pi in enumerate(pts):
            for b, pj in enumerate(pts):
                g = g_bias[h, prefix + a, prefix + b]
                if "table" in grads:
                    grads["table"][(*full_index(grads["table"].shape, pi, pj), h)] += g
                for n, d in zip(("table_t", "table_h", "table_w"), _offsets(pi, pj)):
                    if n in grads:
                        grads[n][_row(d, grads[n].shape[0]), h] += g
    return grads


@pytest.mark.parametrize(("name", "kw"), CASES)
@pytest.mark.parametrize("prefix", [0, 1])
def test_logits_output_and_table_gradients_match_reference(name, kw, prefix):
    grid = (2, 3, 4)
    a = _make(name, grid, prefix, **kw)
    n = prefix + 24
    torch.manual_seed(2)
    x = torch.randn(2, n, DIM, dtype=torch.float64, requires_grad=True)
    out = a(x, grid)  # attn_impl auto: SDPA with the bias in its float mask
    g_out = torch.randn_like(out)
    params = dict(a.pos.named_parameters())
    grads = torch.autograd.grad(out, [x, *params.values()], g_out)

    bias_ref = dense_bias3(REFS[name](a.pos), HEADS, grid, prefix).requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    logits_ref, out_ref = reference_attention(a, x_ref, bias_ref)
    torch.testing.assert_close(a.logits(x, grid), logits_ref)
    torch.testing.assert_close(out, out_ref)
    gx_ref, g_bias = torch.autograd.grad(out_ref, [x_ref, bias_ref], g_out)
    torch.testing.assert_close(grads[0], gx_ref)
    ref = _table_grad_reference(a.pos, g_bias, grid, prefix)
    assert set(ref) == set(params)
    for (pname, _), got in zip(params.items(), grads[1:]):
        torch.testing.assert_close(got, ref[pname].reshape(got.shape), msg=pname)


@pytest.mark.parametrize("name", list(REFS))
@pytest.mark.parametrize("shift", [(1, 0, 0), (0, 1, 0), (0, 0, 2), (1, 1, 1)])
@pytest.mark.parametrize("prefix", [0, 1])
def test_translation_in_t_h_w_leaves_the_logits(name, shift, prefix):
    """Content moved by ``shift`` (t, h, w): the logits between the moved tokens (and the prefix tokens) are the
    logits before the move."""
    grid = (3, 3, 4)
    a = _make(name, grid, prefix)
    torch.manual_seed(3)
    box = [(t, r, c) for t, r, c in coords3(*grid) if t + shift[0] < 3 and r + shift[1] < 3 and c + shift[2] < 4]
    idx = {p: prefix + (p[0] * 3 + p[1]) * 4 + p[2] for p in coords3(*grid)}
    x = torch.randn(1, prefix + 36, DIM, dtype=torch.float64)
    y = torch.randn(1, prefix + 36, DIM, dtype=torch.float64)
    y[:, :prefix] = x[:, :prefix]
    src = list(range(prefix)) + [idx[p] for p in box]
    dst = list(range(prefix)) + [idx[(p[0] + shift[0], p[1] + shift[1], p[2] + shift[2])] for p in box]
    y[:, dst] = x[:, src]
    lx, ly = a.logits(x, grid), a.logits(y, grid)
    torch.testing.assert_close(ly[:, :, dst][:, :, :, dst], lx[:, :, src][:, :, :, src], rtol=1e-12, atol=1e-12)
    # the test can fail: a term of the query's absolute position breaks it
    with torch.no_grad():
        absolute = a.bias(grid) + torch.linspace(0, 1, prefix + 36, dtype=torch.float64)[:, None]
    bad = lambda z: reference_attention(a, z, absolute)[0]  # noqa: E731
    assert (bad(y)[:, :, dst][:, :, :, dst] - bad(x)[:, :, src][:, :, :, src]).abs().max() > 1e-3


@pytest.mark.parametrize("prefix", [0, 1])
def test_at_one_frame_the_schemes_are_their_2d_counterparts(prefix):
    """T = 1: rel3d_full is rel2d_full given the table's dt = 0 slice; rel3d_factored is rel2d_factored given
    ``table_h + b_t[0]`` (the frame term is one constant per head); alibi3d is alibi2d. An image grid is one frame."""
    space = (3, 4)
    full3 = _make("rel3d_full", (3, *space), prefix)
    full2 = _make("rel2d_full", space, prefix, seed=7)
    fac3 = _make("rel3d_factored", (3, *space), prefix)
    fac2 = _make("rel2d_factored", space, prefix, seed=7)
    with torch.no_grad():
        full2.pos.table.copy_(full3.pos.table_4d()[2])  # dt = 0: row T - 1
        fac2.pos.table_h.copy_(fac3.pos.table_h + fac3.pos.table_t[2])
        fac2.pos.table_w.copy_(fac3.pos.table_w)
    pairs = [(full3, full2), (fac3, fac2), (_make("alibi3d", (3, *space), prefix), _make("alibi2d", space, prefix))]
    x = torch.randn(2, prefix + 12, DIM, dtype=torch.float64)
    for a3, a2 in pairs:
        weights = {k: v for k, v in a3.state_dict().items() if not k.startswith("pos.")}
        a2.load_state_dict({**weights, **a2.pos.state_dict(prefix="pos.")})  # the same q, k, v, proj
        for g3 in [(1, *space), space]:
            torch.testing.assert_close(a3.bias(g3), a2.bias(space), rtol=0, atol=0)
            torch.testing.assert_close(a3(x, g3), a2(x, space), rtol=1e-12, atol=1e-12)
    with torch.no_grad():  # the test can fail: any other slice differs
        full2.pos.table.copy_(full3.pos.table_4d()[1])
    assert (full3.bias((1, *space)) - full2.bias(space)).abs().max() > 1e-2


def _cubic_weights(t: float) -> list[float]:
    """Keys' cubic convolution (a = -0.75, PyTorch's bicubic) at the 4 taps around a point ``t`` past the second."""
    a = -0.75

    def k(x: float) -> float:
        x = abs(x)
        if x <= 1:
            return (a + 2) * x**3 - (a + 3) * x**2 + 1
        return a * x**3 - 5 * a * x**2 + 8 * a * x - 4 * a if x < 2 else 0.0

    return [k(t + 1), k(t), k(1 - t), k(2 - t)]


def cubic_resize(values: list[float], n_out: int) -> list[float]:
    """1-D bicubic resize with ``align_corners=False`` (timm's ``resize_rel_pos_bias_table_simple``), written out."""
    n_in = len(values)
    out = []
    for i in range(n_out):
        src = (i + 0.5) * n_in / n_out - 0.5
        i0 = math.floor(src)
        w = _cubic_weights(src - i0)
        out.append(sum(wk * values[min(max(i0 - 1 + k, 0), n_in - 1)] for k, wk in enumerate(w)))
    return out


def resize_axis(table: torch.Tensor, axis: int, n: int) -> torch.Tensor:
    """``table`` with axis ``axis`` resized to ``n`` by :func:`cubic_resize`, every line on its own."""
    moved = table.movedim(axis, -1)
    lines = moved.reshape(-1, moved.shape[-1])
    out = torch.tensor([cubic_resize(line.tolist(), n) for line in lines], dtype=torch.float64)
    return out.reshape(*moved.shape[:-1], n).movedim(-1, axis)


@pytest.mark.parametrize("name", ["rel3d_full", "rel3d_factored"])
@pytest.mark.parametrize("extend", ["grow", "clip", "interpolate"])
@pytest.mark.parametrize("prefix", [0, 1])
def test_a_call_grid_larger_than_the_table(name, extend, prefix):
    """grow / clip: offsets beyond the table take its edge; interpolate: the table resized to the call grid, bicubic
    along each axis (the reference resizes the built table line by line)."""
    built, big = (2, 2, 3), (3, 4, 3)
    a = _make(name, built, prefix, extend=extend)
    got = a.bias(big)
    if extend != "interpolate":
        ref = dense_bias3(REFS[name](a.pos), HEADS, big, prefix)
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
        return
    sizes = [2 * n - 1 for n in big]
    if name == "rel3d_full":
        t = a.pos.table_4d().detach().double()
        for axis, n in enumerate(sizes):
            t = resize_axis(t, axis, n)
        fn = lambda h, pi, pj: t[(*full_index(t.shape, pi, pj), h)]  # noqa: E731
    else:
        tables = (a.pos.table_t, a.pos.table_h, a.pos.table_w)
        ts = [resize_axis(p.detach().double(), 0, n) for p, n in zip(tables, sizes)]
        fn = lambda h, pi, pj: sum(tb[_row(d, tb.shape[0]), h] for tb, d in zip(ts, _offsets(pi, pj)))  # noqa: E731
    ref = dense_bias3(fn, HEADS, big, prefix)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)  # (the resize runs in float32, as timm's)
    # the table is differentiable through the resize: every entry gets a gradient
    got.sum().backward()
    assert all(p.grad is not None and (p.grad != 0).all() for p in a.pos.parameters())


@pytest.mark.parametrize("extend", ["grow", "clip", "interpolate"])
def test_a_checkpoint_loads_at_another_size(extend):
    """A table trained at (2, 2, 3) loaded into a model built for (3, 4, 3): grow / clip keep every offset it had
    and give new offsets the edge value (the same function at every grid); interpolate resizes the whole table
    (tricubic), as at call time."""
    small, big = (2, 2, 3), (3, 4, 3)
    a = _make("rel3d_full", small, 1, extend=extend)
    b = _make("rel3d_full", big, 1, seed=5, extend=extend)
    with pytest.warns(UserWarning, match=r"rel3d_full: resized .*\(3, 3, 5, 3\) -> \(5, 7, 5, 3\)"):
        b.load_state_dict(a.state_dict())
    old, new = a.pos.table_4d().detach(), b.pos.table_4d().detach()
    earlier = {**a.state_dict(), "pos.table": old.clone()}  # stored 4-D, the earlier shape: resized the same
    c = _make("rel3d_full", big, 1, seed=5, extend=extend)
    with pytest.warns(UserWarning, match=r"rel3d_full: resized .*\(3, 3, 5, 3\) -> \(5, 7, 5, 3\)"):
        c.load_state_dict(earlier)
    torch.testing.assert_close(c.pos.table, b.pos.table, rtol=0, atol=0)
    x = torch.randn(2, 1 + 12, DIM, dtype=torch.float64)
    if extend in ("grow", "clip"):
        torch.testing.assert_close(new[1:4, 2:5, :], old)  # the offsets it had, exactly
        torch.testing.assert_close(b(x, small), a(x, small))
        torch.testing.assert_close(b.bias(big), a.bias(big))
    if extend == "interpolate":
        t = old.double()
        for axis, n in enumerate(new.shape[:3]):
            t = resize_axis(t, axis, n)
        torch.testing.assert_close(new, t, rtol=1e-5, atol=1e-5)
    f = _make("rel3d_factored", small, 0, extend=extend)
    g = _make("rel3d_factored", big, 0, seed=5, extend=extend)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g.load_state_dict(f.state_dict())
    assert g.pos.table_t.shape == (5, HEADS) and g.pos.table_h.shape == (7, HEADS)
    if extend != "interpolate":
        torch.testing.assert_close(g.bias(small), f.bias(small))
        torch.testing.assert_close(g.bias(big), f.bias(big))


def test_alibi3d_extends_to_any_grid_and_weighs_a_frame_as_a_patch():
    a = _make("alibi3d", (2, 2, 2), 1)
    big = (4, 3, 5)
    torch.testing.assert_close(a.bias(big), dense_bias3(ref_alibi3d(a.pos), HEADS, big, 1), rtol=1e-12, atol=1e-12)
    b = a.bias((2, 1, 2))  # one frame apart and one column apart: the same penalty
    torch.testing.assert_close(b[:, 1, 3], b[:, 1, 2])


def test_token_layouts_and_bad_options_are_refused():
    a = Attention(DIM, HEADS, pos="rel3d_full", grid=(2, 3, 3))
    layout = TokenLayout.packed([Grid(3, 3), Grid(2, 3)], 0)
    with pytest.raises(ValueError, match="rel3d_full.*full video grids.*token layouts"):
        a.pos.prepare(layout)
    with pytest.raises(ValueError, match="extend must be one of"):
        Attention(DIM, HEADS, pos={"name": "rel3d_factored", "extend": "stretch"}, grid=(2, 3, 3))
    with pytest.raises(ValueError, match="2x3x3 with 0 prefix token\\(s\\) needs 18 tokens"):
        a(torch.randn(1, 17, DIM), (2, 3, 3))


def test_the_table_is_video_swins_flat_table_reshaped():
    """Video Swin's ``WindowAttention3D`` (SwinTransformer/Video-Swin-Transformer, ``mmaction/models/backbones/
    swin_transformer.py``) reads ``table[relative_position_index]`` from a flat ``[(2T-1)(2H-1)(2W-1), heads]`` table;
    its index, rebuilt here as that code builds it, reads the same bias from ``attn.pos.table.reshape(-1, heads)``."""
    window = (2, 3, 4)
    a = _make("rel3d_full", window)
    coords = torch.stack(torch.meshgrid(*(torch.arange(n) for n in window), indexing="ij")).flatten(1)
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0).contiguous()
    for axis, n in enumerate(window):
        rel[:, :, axis] += n - 1
    rel[:, :, 0] *= (2 * window[1] - 1) * (2 * window[2] - 1)
    rel[:, :, 1] *= 2 * window[2] - 1
    index = rel.sum(-1)
    flat = a.pos.table.reshape(-1, HEADS)
    swin = flat[index.reshape(-1)].reshape(24, 24, HEADS).permute(2, 0, 1)
    torch.testing.assert_close(a.bias(window), swin, rtol=0, atol=0)
