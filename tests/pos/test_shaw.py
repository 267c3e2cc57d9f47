"""Shaw-style relative keys and values (shaw2d_factored, shaw2d_full, shaw1d) inside ``Attention``.

Every check is against a dense float64 reference written from the equation with Python loops::

    A_ij = (q_i . k_j + q_i . r^K_ij) / sqrt(d) + mask_ij,  out_i = sum_j softmax_j(A)_ij (v_j + r^V_ij)

with ``r^K = r^V = 0`` whenever a prefix token is involved; forward (the fused fast path), logits,
the attention-dropout path and gradients w.r.t. the input and every table.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tests.reference import scheme_qkv, shaw_attention
from vitrel import Attention
from vitrel.pos import build_pos
from vitrel.pos.schemes.shaw import Shaw2dFactored, Shaw2dFull
from vitrel.pos.schemes.shaw1d import Shaw1d, expand_table, offset_range, shaw_logits, shaw_values
from vitrel.pos.shaw_base import skew, skew_all_offsets, unskew, unskew_all_offsets

SCHEMES = ["shaw2d_factored", "shaw2d_full", "shaw1d"]
DIM, HEADS = 24, 3


def _clip(d: int, half: int) -> int:
    return max(-half, min(half, d))


def pair_embeddings(pos, h: int, w: int, which: str):
    """``f((ri, ci), (rj, cj)) -> r_ij [d]`` for the scheme's key (``which="k"``) or value tables."""
    if isinstance(pos, Shaw2dFactored):
        th, tw = getattr(pos, f"rel_{which}h"), getattr(pos, f"rel_{which}w")
        kh, kw = (th.shape[0] - 1) // 2, (tw.shape[0] - 1) // 2
        return lambda pi, pj: th[_clip(pi[0] - pj[0], kh) + kh] + tw[_clip(pi[1] - pj[1], kw) + kw]
    if isinstance(pos, Shaw2dFull):
        t = getattr(pos, f"rel_{which}")
        kh, kw = (t.shape[0] - 1) // 2, (t.shape[1] - 1) // 2
        return lambda pi, pj: t[_clip(pi[0] - pj[0], kh) + kh, _clip(pi[1] - pj[1], kw) + kw]
    if isinstance(pos, Shaw1d):
        t = getattr(pos, f"rel_{which}")
        k = (t.shape[0] - 1) // 2
        return lambda pi, pj: t[_clip((pj[0] * w + pj[1]) - (pi[0] * w + pi[1]), k) + k]
    raise TypeError(type(pos))


def dense_rel(pos, h: int, w: int, prefix: int, which: str) -> torch.Tensor:
    """``[N, N, d]`` of ``r_ij`` with loops (zeros for prefix pairs); differentiable w.r.t. the tables."""
    f = pair_embeddings(pos, h, w, which)
    pts = [(r, c) for r in range(h) for c in range(w)]
    zero = torch.zeros(pos.head_dim, dtype=torch.float64)
    n = prefix + len(pts)
    rows = []
    for i in range(n):
        row = []
        for j in range(n):
            row.append(zero if i < prefix or j < prefix else f(pts[i - prefix], pts[j - prefix]))
        rows.append(torch.stack(row))
    return torch.stack(rows)


def reference(attn: Attention, x: torch.Tensor, grid, mask=None, causal=False, drop_seed=None):
    """Dense Shaw attention with the module's weights -> (logits, output)."""
    h, w = grid
    p = attn.num_prefix_tokens
    b, n, c = x.shape
    hd, d = attn.num_heads, attn.head_dim
    qkv = (x @ attn.qkv.weight.t() + attn.qkv.bias).reshape(b, n, 3, hd, d).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    rk, rv = dense_rel(attn.pos, h, w, p, "k"), dense_rel(attn.pos, h, w, p, "v")
    logits = (torch.einsum("bhid,bhjd->bhij", q, k) + torch.einsum("bhid,ijd->bhij", q, rk)) / math.sqrt(d)
    if mask is not None:  # [nW, n, n] window mask: batch element t uses window t % nW
        logits = logits + mask[torch.arange(b) % mask.shape[0]][:, None]
    if causal:
        logits = logits + torch.full((n, n), float("-inf"), dtype=x.dtype).triu(1)
    a = logits.softmax(-1)
    if drop_seed is not None:
        torch.manual_seed(drop_seed)
        a = F.dropout(a, attn.attn_drop)
    out = torch.einsum("bhij,bhjd->bhid", a, v) + torch.einsum("bhij,ijd->bhid", a, rv)
    out = out.transpose(1, 2).reshape(b, n, c)
    return logits, out @ attn.proj.weight.t() + attn.proj.bias


def make(name: str, build_grid, prefix: int, seed: int = 0, **kw) -> Attention:
    torch.manual_seed(seed)
    m = Attention(DIM, HEADS, pos=name, grid=build_grid, num_prefix_tokens=prefix, **kw).double()
    with torch.no_grad():
        for t in m.pos.parameters():  # larger than the 0.02 init so the terms matter in the check
            t.normal_(0.0, 0.5)
    return m


def window_mask(nw: int, n: int) -> torch.Tensor:
    """Swin-style ``[nW, n, n]`` mask: 0 or -100, the diagonal always visible."""
    g = torch.Generator().manual_seed(1)
    m = torch.where(torch.rand(nw, n, n, generator=g) < 0.4, -100.0, 0.0).double()
    return m * (1 - torch.eye(n, dtype=torch.float64))


def _params(m: Attention):
    return [x for _, x in sorted(m.pos.named_parameters())]


def _check(m: Attention, grid, batch=2, mask=None, causal=False, atol=1e-10):
    h, w = grid
    x = torch.randn(batch, m.num_prefix_tokens + h * w, DIM, dtype=torch.float64, requires_grad=True)
    ref_logits, ref_out = reference(m, x, grid, mask=mask, causal=causal)
    wout = torch.randn_like(ref_out)
    ref_grads = torch.autograd.grad((ref_out * wout).sum(), [x, *_params(m)])

    out = m(x, grid, mask=mask)
    torch.testing.assert_close(out, ref_out, atol=atol, rtol=1e-9)
    grads = torch.autograd.grad((out * wout).sum(), [x, *_params(m)])
    names = ["x"] + sorted(n for n, _ in m.pos.named_parameters())
    for name, g, rg in zip(names, grads, ref_grads):
        torch.testing.assert_close(g, rg, atol=atol, rtol=1e-9, msg=lambda s, name=name: f"grad {name}: {s}")

    logits = m.logits(x, grid, mask=mask)
    finite = torch.isfinite(ref_logits)
    assert torch.equal(finite, torch.isfinite(logits))
    torch.testing.assert_close(logits[finite], ref_logits[finite], atol=atol, rtol=1e-9)


@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize("prefix", [0, 1])
@pytest.mark.parametrize("grid", [(3, 4), (4, 4)])
def test_forward_logits_grads(name, prefix, grid):
    _check(make(name, grid, prefix), grid)


@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize("prefix", [0, 1])
def test_window_mask(name, prefix):
    grid, nw = (3, 4), 2
    mask = window_mask(nw, prefix + 12)
    _check(make(name, grid, prefix), grid, batch=2 * nw, mask=mask)


@pytest.mark.parametrize("name", SCHEMES)
def test_clipping_clip_distance_and_larger_grid(name):
    # explicit clipping (tables of 2*1+1 rows) and a call grid larger than the built one
    _check(make(name, (3, 4), 1, clip_distance=1), (3, 4))
    _check(make(name, (2, 3), 1), (4, 5))


def test_factored_per_axis_clip_distance():
    m = make("shaw2d_factored", (4, 5), 0, clip_distance=(1, 2))
    assert m.pos.rel_kh.shape[0] == 3 and m.pos.rel_kw.shape[0] == 5
    _check(m, (4, 5))


BLOCKED = ["shaw2d_full", "shaw1d"]  # queries in blocks, each with its own dropout draws
DROPOUT_CASES = [(name, 1, {}) for name in SCHEMES if name not in BLOCKED]
for _name in BLOCKED:
    DROPOUT_CASES += [
        (_name, 1, {"attn_impl": "eager"}),  # the eager path draws one mask for the whole layer
        (_name, 0, {"block_queries": 10**6}),  # one block: the same draws as the reference
    ]


@pytest.mark.parametrize(("name", "prefix", "kw"), DROPOUT_CASES)
def test_dropout_path(name, prefix, kw):
    """Training with attention dropout uses content_values on the dropped-out weights."""
    m = make(name, (3, 3), prefix, attn_drop=0.3, **kw)
    m.train()
    x = torch.randn(2, prefix + 9, DIM, dtype=torch.float64)
    _, ref = reference(m, x, (3, 3), drop_seed=7)
    torch.manual_seed(7)
    out = m(x, (3, 3))
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("name", BLOCKED)
@pytest.mark.parametrize("prefix", [0, 1])
def test_blocks_dropout_gradients(name, prefix):
    """Query blocks with attention dropout: the backward recomputes each block (checkpoint) with the
    forward's dropout draws, so autograd's gradient is that of the function the forward computed."""
    m = make(name, (3, 2), prefix, attn_drop=0.3, block_queries=2)  # 3 blocks (of one row: shaw2d_full)
    m.train()
    x = torch.randn(1, prefix + 6, DIM, dtype=torch.float64, requires_grad=True)

    def f(x):
        torch.manual_seed(11)
        return m(x, (3, 2))

    assert torch.autograd.gradcheck(f, (x,), eps=1e-6, atol=1e-6, fast_mode=True)


@pytest.mark.parametrize("skew", [False, True])
@pytest.mark.parametrize("prefix", [0, 1])
@pytest.mark.parametrize("block_queries", [1, 8, 10, 10**6])
def test_full_blocks_equal_reference(monkeypatch, skew, prefix, block_queries):
    """Blocks of 1 row (5 blocks), 2 rows (a short last block), 3 rows and one block, with a window mask and
    clipping on both axes; both forms of a block: cells (gather / scatter_add, eager) and the skew trick
    along the columns (what runs under torch.compile)."""
    import vitrel.pos.schemes.shaw as shaw

    monkeypatch.setattr(shaw, "_use_skew", lambda: skew)
    grid, nw = (5, 4), 2
    m = make("shaw2d_full", grid, prefix, block_queries=block_queries, clip_distance=(3, 2))
    _check(m, grid, batch=2 * nw, mask=window_mask(nw, prefix + 20))
    _check(make("shaw2d_full", (2, 3), prefix, block_queries=block_queries), (4, 5))  # grid larger than built


def test_full_blocks_under_compile_use_the_skew_form():
    """Under torch.compile, shaw2d_full's blocks take the skew form: the graph dynamo hands the backend has no
    gather or scatter_add of scores (inductor compiles scatter_add into slow loops); eagerly, the cells form."""
    m = make("shaw2d_full", (4, 4), 1)
    x = torch.randn(2, 17, DIM, dtype=torch.float64)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compiler.reset()
    with torch.no_grad():
        out = torch.compile(m, backend=backend)(x, (4, 4))
        torch.testing.assert_close(out, m(x, (4, 4)), atol=1e-12, rtol=1e-10)
    code = "".join(gm.code for gm in graphs)
    assert graphs and "scatter_add" not in code and "gather" not in code


@pytest.mark.parametrize("prefix", [0, 1])
@pytest.mark.parametrize("block_queries", [1, 7, 10**6])
def test_shaw1d_blocks_equal_reference(prefix, block_queries):
    """shaw1d's blocks of 1 query (20 blocks), 7 (a short last block) and one block, with a window mask and
    clipping: each block's skew runs with its own query offset."""
    grid, nw = (5, 4), 2
    m = make("shaw1d", grid, prefix, block_queries=block_queries, clip_distance=6)
    _check(m, grid, batch=2 * nw, mask=window_mask(nw, prefix + 20))


def test_shaw1d_causal_attention_module():
    m = make("shaw1d", (1, 7), 0, causal=True)
    _check(m, (1, 7), causal=True)
    # a true 1-D sequence: the module equals the functional causal shaw_attention (then its projection)
    x = torch.randn(2, 7, DIM, dtype=torch.float64)
    q, k, v = scheme_qkv(m, x, m.pos.grid)
    ref = shaw_attention(q, k, v, m.pos.rel_k, m.pos.rel_v, causal=True)
    got = m(x, m.pos.grid)
    torch.testing.assert_close(got, m.proj(ref.transpose(1, 2).reshape(x.shape)), atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("prefix", [0, 1])
def test_factored_equals_full_outer_sum(prefix):
    grid = (3, 5)
    fac = make("shaw2d_factored", grid, prefix, seed=3)
    full = make("shaw2d_full", grid, prefix, seed=3)
    full.load_state_dict({k: v for k, v in fac.state_dict().items() if not k.startswith("pos.")}, strict=False)
    with torch.no_grad():
        full.pos.rel_k.copy_(fac.pos.rel_kh[:, None] + fac.pos.rel_kw[None, :])
        full.pos.rel_v.copy_(fac.pos.rel_vh[:, None] + fac.pos.rel_vw[None, :])
    x = torch.randn(2, prefix + 15, DIM, dtype=torch.float64)
    torch.testing.assert_close(fac(x, grid), full(x, grid), atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(fac.logits(x, grid), full.logits(x, grid), atol=1e-12, rtol=1e-10)


def test_tables_and_config():
    pos = build_pos({"name": "shaw2d_factored", "clip_distance": None}, num_heads=2, head_dim=8, grid=(3, 5))
    assert pos.rel_kh.shape == (5, 8) and pos.rel_kw.shape == (9, 8) and pos.clip_distance == (2, 4)
    assert 0.01 < torch.cat([pos.rel_kh, pos.rel_kw, pos.rel_vh, pos.rel_vw]).std() < 0.03  # trunc_normal std 0.02
    pos = build_pos("shaw2d_full", num_heads=2, head_dim=8, grid=(3, 5), clip_distance=2)
    assert pos.rel_k.shape == (5, 5, 8)
    pos = build_pos("shaw1d", num_heads=2, head_dim=8, grid=(3, 5))
    assert pos.rel_k.shape == (29, 8) and pos.clip_distance == 14
    for name in SCHEMES:
        pos = build_pos(name, num_heads=2, head_dim=8, grid=(3, 3))
        names = [n for n, _ in pos.named_parameters()]
        assert names and all(any(key in n for key in pos.no_weight_decay_keys) for n in names)
    with pytest.raises(ValueError, match="clip_distance"):
        build_pos("shaw2d_factored", num_heads=2, head_dim=8, grid=(3, 3), clip_distance=-1)
    m = Attention(16, 2, pos="shaw2d_factored", grid=(3, 3))
    with pytest.raises(ValueError, match="tokens"):
        m(torch.randn(1, 10, 16), (3, 3))


@pytest.mark.parametrize("name", SCHEMES)
def test_resize_on_load(name):
    small = make(name, (2, 3), 1)
    big = make(name, (3, 4), 1, seed=1)
    with pytest.warns(UserWarning, match="resized"):
        big.load_state_dict(small.state_dict())
    for (n, s), b in zip(small.pos.named_parameters(), big.pos.parameters()):
        assert b.shape[-1] == s.shape[-1] and b.shape != s.shape, n
        if b.dim() == 2:  # offsets the small table had keep their values
            c = (b.shape[0] - s.shape[0]) // 2
            torch.testing.assert_close(b[c : c + s.shape[0]], s)
        else:
            ch, cw = (b.shape[0] - s.shape[0]) // 2, (b.shape[1] - s.shape[1]) // 2
            torch.testing.assert_close(b[ch : ch + s.shape[0], cw : cw + s.shape[1]], s)
    _check(big, (3, 4))


class _MaxNumel(TorchDispatchMode):
    """Records the largest tensor produced by any aten op, the op names, and the head dims SDPA kernels see."""

    def __init__(self):
        super().__init__()
        self.max_numel, self.ops, self.sdpa_dims = 0, set(), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.add(str(func))
        if "scaled_dot_product" in str(func):
            self.sdpa_dims.append(args[0].shape[-1])
        for o in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(o, torch.Tensor):
                self.max_numel = max(self.max_numel, o.numel())
        return out


@pytest.mark.parametrize("name", SCHEMES)
def test_fast_path_large_grid_memory(name):
    """32x32 grid (N = 1024), forward and backward: the fast paths never build N x N x d; the query blocks
    of shaw2d_full and shaw1d no N x N either, nor the factored path's single SDPA call with the flash kernel."""
    torch.manual_seed(0)
    grid, heads, dim = (32, 32), 2, 32
    n, d = 1 + 32 * 32, dim // heads
    m = Attention(dim, heads, pos=name, grid=grid, num_prefix_tokens=1)
    x = torch.randn(1, n, dim, requires_grad=True)
    rec = _MaxNumel()
    with rec:
        out = m(x, grid)
        out.square().sum().backward()
    assert rec.max_numel < n * n * d
    if name in BLOCKED:
        assert rec.max_numel < n * n / 4
    elif any("flash_attention" in op for op in rec.ops):
        assert rec.max_numel < heads * n * n
    with torch.no_grad():  # and it agrees with the eager content_logits / content_values path
        st = m.pos.prepare(m.pos.grid, 1, x.device, x.dtype, m.choose_kernel(m.pos, n, x.device))
        q, k, v = scheme_qkv(m, x, state=st)
        a = ((q @ k.transpose(-2, -1) + m.pos.content_logits(q, st)) * m.scale).softmax(-1)
        eager = a @ v + m.pos.content_values(a, st)
        fast = m.pos.attend(q, k, v, None, m.scale, st)
    torch.testing.assert_close(fast, eager, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(("grid", "head_dim"), [((3, 4), 8), ((14, 14), 64), ((5, 5), 6)])
def test_factored_sdpa_head_dim_is_a_multiple_of_8(grid, head_dim):
    """shaw2d_factored's augmented q', k', v' are padded with zeros to a multiple of 8 channels (flash / cuDNN
    kernels want it): every SDPA kernel it calls sees such a head dim; the result is checked by the tests above."""
    m = Attention(head_dim * 2, 2, pos="shaw2d_factored", grid=grid)
    x = torch.randn(1, grid[0] * grid[1], head_dim * 2)
    rec = _MaxNumel()
    with rec:
        m(x, grid)
    assert any("scaled_dot_product" in op for op in rec.ops)
    assert rec.sdpa_dims and all(dim % 8 == 0 for dim in rec.sdpa_dims)


@pytest.mark.parametrize("name", SCHEMES)
def test_eager_impl_runs_the_eager_path(name, monkeypatch):
    """attn_impl="eager" is the softmax written out (content_logits / content_values), equal to the reference."""
    import vitrel.kernels.eager as kernels

    calls = []
    real = kernels.attend_eager
    monkeypatch.setattr(kernels, "attend_eager", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    _check(make(name, (3, 4), 1, attn_impl="eager"), (3, 4))
    assert calls
    calls.clear()
    _check(make(name, (3, 4), 1), (3, 4))
    assert not calls


# ---- The skew functional API of ``vitrel.pos.schemes.shaw1d`` against naive gathers and loops (float64).
torch.manual_seed(0)
DT = torch.float64


@pytest.mark.parametrize("n_q,n_k", list(itertools.product([1, 2, 4, 5], [1, 3, 5])))
def test_skew_unskew_match_naive(n_q, n_k):
    for length, shift in itertools.product([1, 3, n_q + n_k - 1, 9], range(-3, n_q + 4)):
        x = torch.randn(2, 3, n_q, length, dtype=DT)
        s = skew(x, n_k, shift)
        assert s.shape == (2, 3, n_q, n_k)
        a = torch.randn(2, 3, n_q, n_k, dtype=DT)
        p = unskew(a, length, shift)
        assert p.shape == (2, 3, n_q, length)
        ref_p = torch.zeros_like(p)
        for i in range(n_q):
            for j in range(n_k):
                m = j - i + shift
                if 0 <= m < length:
                    assert torch.equal(s[..., i, j], x[..., i, m]), (n_q, n_k, length, shift, i, j)
                    ref_p[..., i, m] += a[..., i, j]
        assert torch.equal(p, ref_p), (n_q, n_k, length, shift)


def test_skew_is_gather_when_all_offsets_present():
    """With ``L = n_q + n_k - 1`` and ``shift = n_q - 1`` every entry is valid: skew == gather."""
    n_q, n_k = 6, 4
    length = n_q + n_k - 1
    x = torch.randn(5, n_q, length, dtype=DT)
    idx = torch.arange(n_k)[None, :] - torch.arange(n_q)[:, None] + n_q - 1
    torch.testing.assert_close(skew(x, n_k, n_q - 1), x.gather(-1, idx.expand(5, n_q, n_k)), rtol=0, atol=0)
    # the adjoint identity <skew(x), a> == <x, unskew(a)>
    a = torch.randn(5, n_q, n_k, dtype=DT)
    torch.testing.assert_close((skew(x, n_k, n_q - 1) * a).sum(), (x * unskew(a, length, n_q - 1)).sum())


@pytest.mark.parametrize("n_q,n_k", list(itertools.product([1, 2, 5], [1, 3, 4])))
def test_all_offsets_forms_equal_naive(n_q, n_k):
    """``skew_all_offsets`` / ``unskew_all_offsets`` (every offset present) against naive loops, and bit for bit
    against :func:`skew` / :func:`unskew` at the same arguments."""
    length = n_q + n_k - 1
    x, a = torch.randn(2, n_q, length, dtype=DT), torch.randn(2, n_q, n_k, dtype=DT)
    s, p = skew_all_offsets(x, n_k), unskew_all_offsets(a)
    ref_s, ref_p = torch.empty(2, n_q, n_k, dtype=DT), torch.zeros(2, n_q, length, dtype=DT)
    for i, j in itertools.product(range(n_q), range(n_k)):
        ref_s[:, i, j] = x[:, i, j - i + n_q - 1]
        ref_p[:, i, j - i + n_q - 1] = a[:, i, j]
    torch.testing.assert_close(s, ref_s, rtol=0, atol=0)
    torch.testing.assert_close(p, ref_p, rtol=0, atol=0)
    torch.testing.assert_close(s, skew(x, n_k, n_q - 1), rtol=0, atol=0)
    torch.testing.assert_close(p, unskew(a, length, n_q - 1), rtol=0, atol=0)
    with pytest.raises(ValueError, match="n_q \\+ n_k - 1"):
        skew_all_offsets(x[..., :-1], n_k)


def test_shaw1d_exports_without_size_branches():
    """At dynamic sizes (``torch.export``) Shaw's skews trace sizes without ``max`` / ``min`` (the export and ONNX
    conversion of a shaw1d model reasoned about nested ``Max`` sizes for minutes: docs/export.md), and the program
    equals eager at other sizes."""
    import torch.fx.experimental._config as fx_config

    tables = torch.randn(15, 8), torch.randn(15, 8)

    class Terms(torch.nn.Module):
        def forward(self, x):  # x [B, h, H, W, d]: the queries of an H x W grid
            q = x.flatten(2, 3)
            s = shaw_logits(q, tables[0], q.shape[-2], q_offset=0)
            return shaw_values(s.softmax(-1), tables[1], q_offset=0)

    dim = torch.export.Dim
    shapes = ({0: dim("b", min=1, max=8), 2: dim("h", min=1, max=4), 3: dim("w", min=1, max=4)},)
    with fx_config.patch(backed_size_oblivious=True), torch.no_grad():
        ep = torch.export.export(Terms(), (torch.randn(2, 2, 3, 3, 8),), dynamic_shapes=shapes)
    sizes = [str(s) for n in ep.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor) for s in n.meta["val"].shape]
    assert not [s for s in sizes if "max" in s.lower() or "min" in s.lower()]
    x = torch.randn(3, 2, 2, 4, 8, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(x), Terms()(x), rtol=0, atol=0)


def test_skew_causal_memory_efficient_huang():
    """Causal self attention needs only ``L = n`` offsets (-(n-1)..0): the lower triangle is exact."""
    n = 5
    r_min, length = offset_range(n, n, 0, causal=True)
    assert (r_min, length) == (-(n - 1), n)
    x = torch.randn(n, length, dtype=DT)
    s = skew(x, n, n - 1)
    for i in range(n):
        for j in range(i + 1):
            assert s[i, j] == x[i, j - i + n - 1]


def naive_shaw(q, k, v, rel_k, rel_v, causal, clip_distance, q_offset, scale=None):
    """Loops straight from the equation."""
    n_q, d = q.shape[-2:]
    n_k = k.shape[-2]
    half = (rel_k.shape[0] - 1) // 2
    kc = half if clip_distance is None else clip_distance
    if q_offset is None:
        q_offset = n_k - n_q if causal else 0
    scale = 1 / math.sqrt(d) if scale is None else scale
    logit_rows, outs = [], []
    for i in range(n_q):
        row = []
        for j in range(n_k):
            r = max(-kc, min(kc, j - (i + q_offset))) + half
            val = ((q[..., i, :] * k[..., j, :]).sum(-1) + (q[..., i, :] * rel_k[r]).sum(-1)) * scale
            if causal and j > i + q_offset:
                val = torch.full_like(val, float("-inf"))
            row.append(val)
        logit_rows.append(torch.stack(row, -1))
    logits = torch.stack(logit_rows, -2)
    a = logits.softmax(-1)
    for i in range(n_q):
        o = 0
        for j in range(n_k):
            r = max(-kc, min(kc, j - (i + q_offset))) + half
            o = o + a[..., i, j, None] * (v[..., j, :] + rel_v[r])
        outs.append(o)
    return logits, torch.stack(outs, -2)


CASES = [
    # (n_q, n_k, causal, table half K, clip_distance, q_offset)
    (5, 5, False, 4, None, None),  # full self attention, every offset in the table
    (5, 5, True, 4, None, None),  # causal self attention
    (6, 6, False, 2, None, None),  # offsets beyond the table clamp to its edge
    (6, 6, True, 3, 1, None),  # causal, clipped at clip_distance < K
    (3, 7, False, 3, 2, None),  # cross, n_q < n_k
    (7, 3, False, 3, None, None),  # cross, n_q > n_k
    (3, 7, True, 5, None, None),  # causal cross: queries are the last 3 positions
    (4, 6, False, 4, 3, 2),  # explicit q_offset
    (4, 6, True, 6, None, 1),  # causal with an explicit q_offset
]


@pytest.mark.parametrize("n_q,n_k,causal,half,clip_distance,q_offset", CASES)
def test_shaw_attention_matches_naive(n_q, n_k, causal, half, clip_distance, q_offset):
    d = 4
    q = torch.randn(2, 2, n_q, d, dtype=DT, requires_grad=True)
    k = torch.randn(2, 2, n_k, d, dtype=DT, requires_grad=True)
    v = torch.randn(2, 2, n_k, d, dtype=DT, requires_grad=True)
    rel_k = torch.randn(2 * half + 1, d, dtype=DT, requires_grad=True)
    rel_v = torch.randn(2 * half + 1, d, dtype=DT, requires_grad=True)
    inputs = [q, k, v, rel_k, rel_v]
    kw = dict(causal=causal, clip_distance=clip_distance, q_offset=q_offset)
    ref_logits, ref = naive_shaw(*inputs, **kw)
    out = shaw_attention(*inputs, **kw)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    w = torch.randn_like(ref)
    ref_g = torch.autograd.grad((ref * w).sum(), inputs)
    got_g = torch.autograd.grad((out * w).sum(), inputs)
    for name, g, rg in zip("q k v rel_k rel_v".split(), got_g, ref_g):
        torch.testing.assert_close(g, rg, rtol=1e-10, atol=1e-12, msg=lambda s, name=name: f"grad {name}: {s}")
    # the content logit term alone, where it is defined (not the masked causal entries)
    qo = q_offset if q_offset is not None else (n_k - n_q if causal else 0)
    s = shaw_logits(q, rel_k, n_k, q_offset=qo, causal=causal, clip_distance=clip_distance)
    plain = q @ k.transpose(-2, -1) / math.sqrt(d)
    visible = torch.isfinite(ref_logits)
    torch.testing.assert_close((plain + s / math.sqrt(d))[visible], ref_logits[visible])


def test_gradcheck_tiny():
    q = torch.randn(1, 3, 2, dtype=DT, requires_grad=True)
    k = torch.randn(1, 4, 2, dtype=DT, requires_grad=True)
    v = torch.randn(1, 4, 2, dtype=DT, requires_grad=True)
    rk = torch.randn(5, 2, dtype=DT, requires_grad=True)
    rv = torch.randn(5, 2, dtype=DT, requires_grad=True)
    for causal in (False, True):
        assert torch.autograd.gradcheck(
            lambda *t, c=causal: shaw_attention(*t, causal=c, clip_distance=1), (q, k, v, rk, rv)
        )


def test_clipping_gives_edge_embedding():
    """Offsets with |r| > clip_distance use exactly the edge rows r^K[+-clip_distance]."""
    n, d, half, md = 7, 3, 4, 2
    table = torch.arange((2 * half + 1) * d, dtype=DT).reshape(2 * half + 1, d)  # distinct rows
    q = torch.eye(d, dtype=DT).repeat(n, 1)[:n]  # q_i picks one coordinate
    s = shaw_logits(q, table, n, clip_distance=md)
    for i in range(n):
        for j in range(n):
            r = j - i
            row = table[half + max(-md, min(md, r))]
            assert s[i, j] == q[i] @ row, (i, j)
            if r > md:
                assert s[i, j] == q[i] @ table[half + md]
            if r < -md:
                assert s[i, j] == q[i] @ table[half - md]
    e = expand_table(table, -6, 13, md)
    assert torch.equal(e[:4], table[half - md].expand(4, d)) and torch.equal(e[-4:], table[half + md].expand(4, d))
    # values: uniform weights over keys beyond the clip distance pick the edge value row only
    a = torch.zeros(1, n, dtype=DT)
    a[0, 5:] = 0.5  # offsets 5 and 6 from query 0, both beyond md
    torch.testing.assert_close(shaw_values(a, table, clip_distance=md)[0], table[half + md])


def test_errors():
    q = torch.randn(1, 4, 2)
    with pytest.raises(ValueError, match="clip_distance"):
        shaw_logits(q, torch.randn(5, 2), 4, clip_distance=3)
    with pytest.raises(ValueError, match="2K\\+1"):
        shaw_logits(q, torch.randn(4, 2), 4)
    with pytest.raises(ValueError, match="q_offset"):
        shaw_attention(q, q[:, :2], q[:, :2], torch.randn(5, 2), torch.randn(5, 2), causal=True)
    with pytest.raises(ValueError, match="match"):
        shaw_attention(q, q, q, torch.randn(5, 3), torch.randn(5, 2))


@pytest.mark.parametrize("pos", ["shaw1d", "shaw2d_full"])
def test_exported_program_has_one_query_block(pos):
    """``torch.export`` at a concrete grid (a batch-size program) traces one block of queries, not the eager CPU
    path's Python loop of blocks (11 copies of a block's graph on this 8 x 8 grid), and equals eager."""
    import vitrel
    from vitrel.export import export_program

    torch.manual_seed(0)
    m = vitrel.create_model("vitrel_vit_tiny_patch4_32", pos=pos, embed_dim=32, depth=1, num_heads=2).eval()
    x = torch.randn(2, 3, 32, 32)
    ep = export_program(m, x, dynamic="batch")
    softmaxes = [n for n in ep.graph.nodes if "softmax" in str(n.target)]
    assert len(softmaxes) == 1, len(softmaxes)
    x3 = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(x3), m(x3), rtol=1e-5, atol=1e-5)
