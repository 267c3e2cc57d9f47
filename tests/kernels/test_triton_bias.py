"""attn_impl="triton": the fused attention kernel with the bias read from an offset table, and its table gradient.

On this CPU the Triton kernels run through Triton's interpreter (``TRITON_INTERPRET=1``, set below before the
kernels are first used), in float32 at small sizes (tiles of 16, so a few tokens per side already span several
blocks), against the float64 reference written from the equation
``softmax(q k^T * scale + T[h, r_i - r_j + H - 1, c_i - c_j + W - 1] + mask) v`` (dense, autograd for the
gradients): outputs, ``dq, dk, dv`` and the gradient of every table parameter. Marked ``cuda``, the same cases
run in bf16 on a GPU (``pytest -m cuda``).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # before the kernels are first imported (vitrel imports them lazily)
    os.environ["TRITON_INTERPRET"] = "1"

import vitrel  # noqa: E402
from vitrel import Attention, device_cache  # noqa: E402
from vitrel.kernels import triton as fused  # noqa: E402
from vitrel.kernels.triton import rel_bias_attention  # noqa: E402
from vitrel.layout.geometry import as_grid, expand_offset_table  # noqa: E402
from vitrel.pos import list_pos  # noqa: E402
from vitrel.pos.registry import get_pos_class  # noqa: E402

triton = pytest.importorskip("triton")
tl = triton.language
from dataclasses import replace  # noqa: E402

from tests.weights import lively  # noqa: E402
from vitrel.kernels.triton import INTERPRETER, Warps, cuda_config, patterns  # noqa: E402
from vitrel.kernels.triton._jit import _bias_tile  # noqa: E402
from vitrel.kernels.triton.planning import fwd_launch  # noqa: E402

#: the CPU cases run through the interpreter (on a GPU machine, where it is off, ``pytest -m cuda`` runs the GPU ones)
pytestmark = pytest.mark.skipif(
    not (fused.interpreter_on() or torch.cuda.is_available()), reason="Triton's interpreter is off"
)
interpreted = pytest.mark.skipif(not fused.interpreter_on(), reason="Triton's interpreter is off (GPU machine)")
CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU")])
DEVICES = [pytest.param("cpu", marks=interpreted), CUDA]
TABLE_SCHEMES = [  # (image grids: the fused kernel refuses the video tables, tests/kernels/test_video_kernels.py)
    n for n in list_pos("relative") if get_pos_class(n).has_offset_table and get_pos_class(n).grid_dims == 2
]


def _tol(device: str) -> dict:
    """fp32 in the interpreter; bf16 inputs (fp32 accumulation) on a GPU."""
    return dict(atol=2e-5, rtol=2e-4) if device == "cpu" else dict(atol=3e-2, rtol=3e-2)


def reference(q, k, v, table, grid, prefix, mask=None, causal=False, scale=None):
    """float64, dense, straight from the equation."""
    n = q.shape[-2]
    logits = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if table is not None:
        logits = logits + expand_offset_table(table, as_grid(grid), prefix)
    if mask is not None:
        logits = logits + mask.repeat(q.shape[0] // mask.shape[0], 1, 1)[:, None]
    if causal:
        logits = logits + torch.full((n, n), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
    return logits.softmax(-1) @ v


def four_kernels(device: str = "cuda", d: int = 16, **changes):
    """The device's configuration (a GPU's for ``plan``) with the one-tile kernels off: the four backward kernels
    for calls of a few tokens, as on long sequences."""
    base = INTERPRETER if device == "cpu" else cuda_config(d)
    return replace(base, **{"fwd_one_tile_max": 0, "bwd_one_tile_max": 0, **changes})


def _inputs(b, h, n, d, grid, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64) for _ in range(3))
    table = torch.randn(h, 2 * grid[0] - 1, 2 * grid[1] - 1, generator=g, dtype=torch.float64)
    return q, k, v, table


def _check(
    device, b, h, d, grid, prefix, mask=None, causal=False, table_on=True, bias_read="auto", regions=None,
    deterministic=True, table_grad=True, dtype=None, scale=None, config=None,
):  # fmt: skip
    n = prefix + grid[0] * grid[1]
    if regions is not None:  # the reference reads the float mask the regions mean
        same = regions[:, :, None] == regions[:, None, :]
        mask = torch.zeros(same.shape, dtype=torch.float64).masked_fill(~same, float("-inf"))
    q, k, v, table = _inputs(b, h, n, d, grid)
    table = table if table_on else None
    dtype = dtype or (torch.float32 if device == "cpu" else torch.bfloat16)
    leaves64 = [t.requires_grad_() for t in (q, k, v, *((table,) if table_grad else ())) if t is not None]
    ref = reference(q, k, v, table, grid, prefix, mask, causal, scale)
    go = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=ref.dtype)  # (the order's RNG: no)
    grads_ref = torch.autograd.grad(ref, leaves64, go)
    qd, kd, vd = (t.detach().to(device, dtype).requires_grad_() for t in (q, k, v))
    td = None if table is None else table.detach().to(device, torch.float32).requires_grad_(table_grad)
    md = None if mask is None or regions is not None else mask.to(device, torch.float32)
    rd = None if regions is None else regions.to(device)
    settings = dict(mask=md, causal=causal, bias_read=bias_read, regions=rd, deterministic=deterministic, scale=scale)
    out = rel_bias_attention(qd, kd, vd, td, grid, prefix, **settings, config=config)
    leaves = [t for t in (qd, kd, vd, td) if t is not None and t.requires_grad]
    grads = torch.autograd.grad(out, leaves, go.to(device, dtype))
    tol = _tol("cuda" if dtype != torch.float32 else device)  # (half precision in the interpreter too)
    torch.testing.assert_close(out.double().cpu(), ref.detach(), **tol)
    for name, g, gr in zip("qkvT", grads, grads_ref):
        scale = gr.abs().max().item()
        torch.testing.assert_close(g.double().cpu() / scale, gr / scale, **tol, msg=f"d{name}")
    return out, grads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias_read", ["tiles", "gather"])
@pytest.mark.parametrize(
    ("grid", "prefix", "d"),
    [
        ((3, 5), 1, 16),
        ((5, 7), 0, 32),
        ((4, 6), 2, 24),
        ((2, 9), 4, 16),
        ((6, 3), 1, 16),
        ((4, 8), 1, 16),
        ((4, 24), 1, 16),
    ],
)
def test_kernel_equals_reference(device, grid, prefix, d, bias_read):
    """Output and the gradients of q, k, v and the table, prefix 0 / 1 / registers, a head dim that is not a power of
    two, grids wider and taller than a tile, narrower and wider than a tile (4 x 8: tiles of 16 tokens are two grid
    rows, so the bias tiles repeat; 4 x 24: they repeat by (q0 - k0, q0 mod 24), three phases, in one batch element
    and one head: the other grids run two of each), the bias read as tiles or gathered per score."""
    b = h = 1 if grid == (4, 24) else 2
    _check(device, b, h, d, grid, prefix, bias_read=bias_read)


@interpreted
@pytest.mark.parametrize("grid", [(4, 6), (4, 4), (3, 5)])
def test_bias_tiles_in_half_precision(grid):
    """Half-precision inputs: the bias tiles every kernel reads are in the inputs' type (as SDPA takes its float mask:
    half the bytes per score of float32 tiles, which bound the kernels by L2's bandwidth on an H100; the forward's
    too, now that its products compile unserialized with them:
    :func:`test_tensor_core_products_not_serialized_on_hopper`); float32 inputs keep float32 tiles; the kernels add
    them to float32 logits, so output and gradients stay within half precision of the float64 reference (grids whose
    tiles repeat, 4 x 4, and whose tiles are each exact, 3 x 5: -inf past the end). In fp16: the interpreter
    computes bf16 wrongly (every kernel, with or without a table); ``-m cuda`` runs bf16."""
    n = 1 + grid[0] * grid[1]
    table = torch.zeros(2, 2 * grid[0] - 1, 2 * grid[1] - 1)
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        q = torch.zeros(2, 2, n, 16, dtype=dt)
        launches = fused.plan(q, q, q, table, grid, 1, bias_read="tiles")  # (one tile of a GPU's backward)
        assert {name: launch.args["BT"].dtype for name, launch in launches.items()} == {"fwd": dt, "tile": dt}
        for det, want in ((True, {"fwd", "dkdv", "dq"}), (False, {"fwd", "dkdv", "dbias"})):  # (dbias: dq by atomics)
            launches = fused.plan(q, q, q, table, grid, 1, bias_read="tiles", deterministic=det,
                                        config=four_kernels())  # fmt: skip
            assert set(launches) == want | {"delta"}
            tiles = {name: launch.args["BT"].dtype for name, launch in launches.items() if name != "delta"}
            assert tiles == dict.fromkeys(want, dt), tiles
    _check("cpu", 2, 2, 16, grid, 1, bias_read="tiles", dtype=torch.float16)


@pytest.mark.parametrize(
    ("side", "prefix", "tm", "tw"),
    [(8, 1, 16, 16), (8, 0, 64, 64), (14, 1, 64, 64), (5, 2, 16, 16), (32, 1, 64, 32), (24, 1, 64, 64)],
)
def test_bias_tiles_equal_the_dense_bias(side, prefix, tm, tw):
    """Each ``[tm, tw]`` block of the dense bias (patch pairs; pairs with a prefix token and past the end are zeroed by
    the kernels) equals the tile of its pattern (``TilePatterns.index``, what the kernels compute); a grid whose width
    divides the tile has about ``2 n / tw`` patterns, not one per tile. Where each pattern is one tile, the tile is
    exact (the kernels read it with no mask)."""
    grid = as_grid((side, side))
    n = prefix + grid.n
    table = torch.randn(2, 2 * side - 1, 2 * side - 1, dtype=torch.float64)
    pat = fused.tile_patterns(grid.w, n, tm, tw)
    tiles = fused.bias_tiles(table, grid.h, grid.w, prefix, pat, tm, tw)
    assert tiles.shape == (2, pat.n_pat, tm, tw)
    n_qt, n_kt = -(-n // tm), -(-n // tw)
    dense = torch.nn.functional.pad(expand_offset_table(table, grid, prefix), (0, n_kt * tw - n, 0, n_qt * tm - n))
    t = torch.arange(max(n_qt * tm, n_kt * tw))
    patch = (t >= prefix) & (t < n)
    for qt in range(n_qt):
        for kt in range(n_kt):
            q0, k0 = qt * tm, kt * tw
            pair = patch[q0 : q0 + tm, None] & patch[None, k0 : k0 + tw]
            got = tiles[:, pat.index(q0, k0, tm, tw, grid.w)]
            want = dense[:, q0 : q0 + tm, k0 : k0 + tw]
            torch.testing.assert_close(torch.where(pair, got, 0.0), want, rtol=0, atol=0, msg=f"tile {qt}, {kt}")
            if pat.n_m == 0:  # one exact tile per pattern, read with no mask: 0 off the pairs, -inf past the end
                exact = torch.where(t[None, k0 : k0 + tw] < n, want, float("-inf"))
                torch.testing.assert_close(got, exact, rtol=0, atol=0, msg=f"exact tile {qt}, {kt}")
    if tm % side == 0 and tw % side == 0:  # q0 - k0 alone: about (n_qt tm + n_kt tw) / gcd(tm, tw) patterns
        assert pat.n_pat <= (n_qt * tm + n_kt * tw) // min(tm, tw) < n_qt * n_kt or n_qt == 1


@interpreted
def test_qkv_views_are_read_in_place(monkeypatch):
    """q, k, v as the qkv projection makes them (views of one ``[B, N, 3, heads, d]`` tensor, the head dim contiguous)
    are read through their strides, not copied (SDPA copies nothing either), and give the contiguous inputs' output
    and gradients exactly."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Copies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += not launching and func in (torch.ops.aten.clone.default, torch.ops.aten.copy_.default)
            return func(*args, **(kwargs or {}))

    launching = []  # (inside a launch: the interpreter's own copies, which a GPU does not make)
    call = fused.Launch.__call__
    monkeypatch.setattr(fused.Launch, "__call__", lambda self: (launching.append(1), call(self), launching.pop()))
    grid, prefix = (4, 5), 1
    qkv = torch.randn(2, prefix + 20, 3, 2, 16, requires_grad=True)
    table = torch.randn(2, 7, 9)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    assert not q.is_contiguous()
    with Copies() as copies:
        out = rel_bias_attention(q, k, v, table, grid, prefix)
    assert copies.n == 0
    go = torch.randn_like(out)
    (g,) = torch.autograd.grad(out, qkv, go)
    qkv_c = qkv.detach().clone().requires_grad_()
    ref = rel_bias_attention(*(t.contiguous() for t in qkv_c.permute(2, 0, 3, 1, 4).unbind(0)), table, grid, prefix)
    (g_ref,) = torch.autograd.grad(ref, qkv_c, go)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(g, g_ref, rtol=0, atol=0)


@pytest.mark.parametrize(("side", "prefix"), [(8, 1), (5, 1), (4, 0)])
def test_host_work_of_a_call_is_a_few_tensor_ops(monkeypatch, side, prefix):
    """What a call computes on the host from integers alone (the bias tiles' indices and masks, the ``dbias`` launch
    order, the table gradient's layout, placeholders) is made once per shape and device: a second call of the same
    shape builds its launches, forward and backward, with at most 20 tensor ops (the first: about 80, each a CUDA
    launch on a GPU, where they cost more than the kernels at small sizes) and reduces the table's gradient with at
    most 32 (views included); the same launches either way. Patterns that repeat (8 x 8, prefix 1) and exact tiles;
    the one-tile backward's launch (5 x 5 and 4 x 4 fit one tile of a GPU's) with at most 16."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    n = prefix + side * side
    q = torch.randn(2, 2, n, 16)
    table = torch.randn(2, 2 * side - 1, 2 * side - 1)
    if n <= 64:
        one = fused.plan(q, q, q, table, (side, side), prefix, bias_read="tiles")
        with Ops() as ops:
            again = fused.plan(q, q, q, table, (side, side), prefix, bias_read="tiles")
        assert set(again) == {"fwd", "tile"} and ops.n <= 16, (set(again), ops.n)
        torch.testing.assert_close(again["tile"].args["BT"], one["tile"].args["BT"], rtol=0, atol=0)
    config = four_kernels()
    first = fused.plan(q, q, q, table, (side, side), prefix, bias_read="tiles", config=config)
    with Ops() as ops:
        again = fused.plan(q, q, q, table, (side, side), prefix, bias_read="tiles", config=config)
    assert ops.n <= 20, ops.n
    written = {"O", "LSE", "DELTA", "DK", "DV", "DQ", "DT", "DBT", "SCRATCH"}  # (outputs, or read from them)
    for name, launch in first.items():
        for key, value in launch.args.items():
            if isinstance(value, torch.Tensor) and key not in written:
                torch.testing.assert_close(again[name].args[key], value, rtol=0, atol=0, msg=f"{name} {key}")
    sums = first["dbias"] if "dbias" in first else first["dq"]  # (dq sums the bias tiles' gradient where it can)
    pat = fused.tile_patterns(side, n, sums.args["BM"], sums.args["BN"])
    assert (pat.n_pat, pat.d_min, pat.n_m) == sums.args["patterns"]  # (the kernels' tuple)
    sums_buffer = sums.args["DBT" if "dbias" in first else "DT"]
    dbt = torch.randn(sums_buffer.shape)  # [n_split, heads, n_pat, blk, blk] (plan's tiles: a GPU's)
    fused.table_grad_from_tiles(dbt, pat, side, side, prefix)  # (its index made, and kept)
    launches = []
    monkeypatch.setattr(fused.Launch, "__call__", lambda launch: launches.append(launch.kernel))
    with Ops() as ops:
        fused.table_grad_from_tiles(dbt, pat, side, side, prefix)
    assert ops.n <= 2 and launches == ["table_grad"], (ops.n, launches)  # (its output; the index kept)


def test_nothing_kept_from_a_graphs_stream(monkeypatch):
    """Where a tensor made now may not be kept (:func:`vitrel.device_cache.keeps`: a CUDA stream other than the default
    one, as CUDA graph capture and ``torch.compile``'s graph trees use, whose pool hands its blocks out again), every
    call makes its own: nothing enters the caches, and the launches are the same."""
    q = torch.randn(2, 2, 1 + 36, 16)
    table = torch.randn(2, 11, 11)
    patterns._tile_index.cache_clear()
    monkeypatch.setattr(device_cache, "keeps", lambda device: False)
    config = four_kernels()  # (the four kernels: 37 tokens fit one tile of a GPU's)
    first = fused.plan(q, q, q, table, (6, 6), 1, bias_read="tiles", config=config)
    again = fused.plan(q, q, q, table, (6, 6), 1, bias_read="tiles", config=config)
    assert patterns._tile_index.cache_info().currsize == 0
    torch.testing.assert_close(again["dq"].args["BT"], first["dq"].args["BT"], rtol=0, atol=0)
    monkeypatch.undo()
    fused.plan(q, q, q, table, (6, 6), 1, bias_read="tiles")
    assert patterns._tile_index.cache_info().currsize > 0  # (on the CPU: kept)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU")
def test_keeps_only_on_the_default_stream():
    """On CUDA, tensors are kept from the device's default stream only: not from a side stream, where a CUDA graph is
    captured."""
    dev = torch.device("cuda")
    assert device_cache.keeps(dev)
    with torch.cuda.stream(torch.cuda.Stream()):
        assert not device_cache.keeps(dev)


@pytest.mark.parametrize(
    ("grid", "prefix", "tm", "tw"),
    [((4, 8), 1, 16, 16), ((5, 7), 0, 16, 16), ((4, 8), 1, 32, 16), ((5, 7), 0, 32, 16), ((14, 14), 1, 128, 64),
     ((8, 8), 1, 32, 16), ((16, 16), 0, 64, 32), ((3, 5), 2, 32, 16)],
)  # fmt: skip
def test_table_grad_from_tiles_sums_each_offset(grid, prefix, tm, tw):
    """``table_grad_from_tiles`` of the per-pattern sums of a gradient ``G`` over ``[tm, tw]`` tiles (square, and
    query tiles twice the key tiles: the ``dbias`` kernel's ``dbias_tile``; patterns by ``(q0 - k0, q0 mod W)`` or
    one per tile, ViT-B/16's 14 x 14 grid with a class token among them), split in three batch shares as the
    ``dbias`` programs write them, is, at each table offset, the sum of ``G`` over the patch pairs at that offset:
    from the equation, in loops, float64 (the kernel sums in float32)."""
    gh, gw = grid
    n = prefix + gh * gw
    pat = fused.tile_patterns(gw, n, tm, tw)
    g = torch.randn(2, n, n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    want = torch.zeros(2, 2 * gh - 1, 2 * gw - 1, dtype=torch.float64)
    for i in range(prefix, n):
        for j in range(prefix, n):
            pi, pj = i - prefix, j - prefix
            want[:, pi // gw - pj // gw + gh - 1, pi % gw - pj % gw + gw - 1] += g[:, i, j]
    tiles_q, tiles_k = -(-n // tm), -(-n // tw)
    padded = torch.zeros(2, tiles_q * tm, tiles_k * tw, dtype=torch.float64)
    padded[:, prefix:n, prefix:n] = g[:, prefix:, prefix:]  # (the kernel's sums: zero off the patch pairs)
    dbt = torch.zeros(2, pat.n_pat, tm, tw, dtype=torch.float64)
    for qb in range(tiles_q):
        for kb in range(tiles_k):
            tile = padded[:, qb * tm : (qb + 1) * tm, kb * tw : (kb + 1) * tw]
            dbt[:, pat.index(qb * tm, kb * tw, tm, tw, gw)] += tile
    shares = torch.stack([dbt / 2, dbt / 4, dbt / 4]).float()  # (exact in binary: the shares add to dbt)
    got = fused.table_grad_from_tiles(shares, pat, gh, gw, prefix)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("side", "prefix", "tm", "tw", "causal"),
    [(8, 1, 16, 16, False), (24, 1, 64, 64, False), (5, 2, 16, 16, True), (64, 1, 64, 64, False),
     (1, 0, 16, 16, True), (8, 1, 32, 16, False), (64, 1, 128, 64, False), (14, 1, 128, 64, False),
     (5, 2, 32, 16, True), (1, 0, 32, 16, True), (16, 0, 64, 32, False)],
)  # fmt: skip
def test_dbias_programs_longest_first(side, prefix, tm, tw, causal):
    """Each ``dbias`` program's work (``TilePatterns.tiles``) counts the tiles of its pattern, from ``index`` over every
    ``[tm, tw]`` tile (square, and query tiles twice the key tiles: ``KernelConfig.dbias_tile``; causal: those with a
    pair on or below the diagonal); the programs launch longest first, each ``(pattern, head, share)`` once; both
    computed on the device they are for."""
    grid_w = side if side > 1 else 70
    n = prefix + side * grid_w
    pat = fused.tile_patterns(grid_w, n, tm, tw)
    tiles_q, tiles_k = -(-n // tm), -(-n // tw)
    pairs = [(qb, kb) for qb in range(tiles_q) for kb in range(tiles_k) if kb * tw < (qb + 1) * tm or not causal]
    seen = [pat.index(qb * tm, kb * tw, tm, tw, grid_w) for qb, kb in pairs]
    tiles = pat.tiles(n, tm, tw, grid_w, causal)
    assert tiles.tolist() == torch.bincount(torch.tensor(seen), minlength=pat.n_pat).tolist()
    order = fused.dbias_order(tiles, 3, 2).long()
    assert sorted(order.tolist()) == list(range(pat.n_pat * 3 * 2))
    work = tiles[order // 6]
    assert (work[:-1] >= work[1:]).all() and work[0] == tiles.max()
    # made on the inputs' device, not copied there (a copy from the host syncs, and a CUDA graph cannot capture it)
    assert fused.dbias_order(pat.tiles(n, tm, tw, grid_w, causal, "meta"), 3, 2).device.type == "meta"


@pytest.mark.parametrize("device", DEVICES)
def test_batch_beyond_the_cuda_grid(device, monkeypatch):
    """A batch whose ``batch x heads`` programs exceed CUDA's grid (65,535 on its second axis; here 4 or 12) runs as
    shares of the batch: a full grid (shares of 2, the last of 1), a batch of windows whose region ids repeat every 4
    (shares of 4, not 6), and a mask per batch element (sliced with its share), packed rows of images of different
    layouts (their tokens sliced)."""
    from vitrel.layout.geometry import Grid
    from vitrel.layout.windows import window_regions

    config = four_kernels(device, grid_y_max=4)  # 2 heads: at most 2 batch elements a launch
    _check(device, 3, 2, 16, (3, 4), 1, config=config)
    wide = four_kernels(device, grid_y_max=12)  # (at most 6, where the regions take 4)
    _check(device, 8, 2, 16, (4, 5), 0, regions=window_regions(Grid(7, 9), (4, 5), (2, 2)), config=wide)
    mask = torch.zeros(3, 12, 12, dtype=torch.float64)
    mask[torch.arange(3), :, torch.arange(3)] = float("-inf")  # element b masks key b
    _check(device, 3, 2, 16, (3, 4), 0, mask=mask, config=config)
    # packed rows (2 heads): one a launch, its tokens sliced
    _check_layout(device, 0, *tile_aligned_tokens(), config=four_kernels(device, grid_y_max=2))


def test_launch_configuration_by_head_dim_and_bias_read():
    """On a GPU (``plan`` builds a GPU's launches anywhere), as measured fastest on an H100
    (``bench/results/triton_tune_h100_tiles.md``): head dim 64 takes the square 64 x 64 tile in every kernel (the
    forward in 4 warps and 3 stages, the backward's in 4 and 3), its ``dbias`` kernel sharing the ``dq`` kernel's bias
    tiles; head dim 32 (Swin's) 64 x 64 and 2 stages; head dim 128 the forward's 64 x 32 in 4 warps, and where the
    bias is read whole or there is none ``dkdv`` 64 x 128, ``dq`` and ``dbias`` 128 x 64 (``KernelConfig``'s
    ``dkdv_tile``, ``dq_tile``, ``dbias_tile``), each in 8 warps; else the square 32 x 32 in 4 warps."""

    def launches(d=64, table=True, **kw):
        q = torch.zeros(2, 2, 65, d, dtype=torch.bfloat16)
        return fused.plan(q, q, q, torch.zeros(2, 15, 15) if table else None, (8, 8), 1, **kw)

    def tile(**kw):
        fwd = launches(**kw)["fwd"]
        return fwd.args["BM"], fwd.args["BN"]

    assert tile(bias_read="tiles") == tile(table=False) == tile(bias_read="gather") == (64, 64)
    assert tile(mask=torch.zeros(1, 65, 65)) == tile(d=32) == (64, 64)
    assert launches()["fwd"].options == {"num_warps": 4, "num_stages": 3}  # (its bias tile double-buffered)
    assert launches(d=32)["fwd"].options == launches(d=128)["fwd"].options == {"num_warps": 4, "num_stages": 2}
    tokens = torch.stack([torch.zeros(65), torch.arange(65) // 8 - 1, torch.arange(65) % 8, torch.zeros(65)])
    assert tile(tokens=tokens.int().expand(2, 4, 65).contiguous(), table=False) == (64, 64)
    assert launches(bias_read="gather")["dq"].options["num_stages"] == 3
    # dbias: the dq kernel's square tiles (one set of bias tiles for both), 4 warps, 3 stages
    square, masked = launches(), launches(mask=torch.zeros(1, 65, 65))
    assert square["dbias"].args["BT"] is square["dq"].args["BT"] and square["dbias"].options == square["dq"].options
    w, m = square["dbias"], masked["dbias"]
    assert (w.args["BM"], w.args["BN"], *w.args["DBT"].shape[-2:], w.options["num_stages"]) == (64, 64, 64, 64, 3)
    assert (m.args["BM"], m.args["BN"], m.options["num_stages"]) == (64, 64, 3)
    assert launches(d=32)["dkdv"].options == {"num_warps": 4, "num_stages": 2}
    calls = dict(
        tiles=dict(bias_read="tiles"), none=dict(table=False), gather=dict(bias_read="gather"),
        mask=dict(mask=torch.zeros(1, 65, 65)), d32=dict(d=32),
    )  # fmt: skip
    for kernel in ("dkdv", "dq"):
        got = {k: launches(**kw)[kernel] for k, kw in calls.items()}
        got = {k: (x.args["BM"], x.args["BN"], x.options["num_warps"]) for k, x in got.items()}
        assert got == dict.fromkeys(calls, (64, 64, 4)), (kernel, got)
    fixed = launches(bias_read="gather", table_grad=False)["dq"]
    assert (fixed.args["BM"], fixed.args["BN"], fixed.args["TABLE_GRAD"]) == (64, 64, 0)
    assert launches()["dq"].options == {"num_warps": 4, "num_stages": 3}
    # head dim 128: the forward 64 x 32 in 4 warps; dkdv 64 x 128, dq 128 x 64, each in 8 warps, where the bias is
    # read whole or there is none; else the backward's square 32 x 32 in 4 warps
    wide, narrow = {"fwd": (64, 32, 4), "dkdv": (64, 128, 8), "dq": (128, 64, 8)}, {"fwd": (64, 32, 4)}
    narrow.update(dkdv=(32, 32, 4), dq=(32, 32, 4))
    for kw, want in [
        (dict(bias_read="tiles"), wide), (dict(table=False), wide),
        (dict(bias_read="gather"), narrow), (dict(mask=torch.zeros(1, 65, 65)), {**narrow, "dbias": (32, 32, 4)}),
    ]:  # fmt: skip
        got = {k: (x.args["BM"], x.args.get("BN", x.args["BM"]), x.options["num_warps"])
               for k, x in launches(d=128, **kw).items() if k != "delta"}  # fmt: skip
        assert got == want, (kw, got)
    # the dq kernel sums the bias tiles' gradient where its tiles are one pattern each (head dim 128's 128 x 64)
    assert launches(d=128)["dq"].args["TABLE_GRAD"] == 2 and launches()["dq"].args["TABLE_GRAD"] == 0
    # a forward tile of the configuration's (as bench/triton_tune.py sets one); the bias tiles within the budget
    # read whole, beyond it gathered (auto) or an error (2 heads, bf16 tiles)
    wide = replace(cuda_config(64), fwd_tile=(64, 128))
    assert tile(bias_read="tiles", config=wide) == tile(table=False, config=wide) == (64, 128)
    size = fused.tile_patterns(8, 65, 64, 64).n_pat * 64 * 64 * 2 * 2
    assert launches(config=replace(cuda_config(64), tile_budget_bytes=size))["fwd"].args["TILED"]
    assert not launches(config=replace(cuda_config(64), tile_budget_bytes=size - 1))["fwd"].args["TILED"]
    with pytest.raises(ValueError, match="above the budget"):
        tile(bias_read="tiles", config=replace(cuda_config(64), tile_budget_bytes=size - 1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("grid", "prefix", "d", "in_dq"), [((3, 7), 0, 32, True), ((4, 6), 2, 24, True),
                                                           ((5, 5), 1, 16, True), ((3, 8), 1, 16, False),
                                                           ((14, 14), 1, 16, True)])  # fmt: skip
def test_table_grad_in_dq_equals_reference(device, grid, prefix, d, in_dq):
    """The bias tiles' gradient summed by the ``dq`` kernel (where each of its tiles is one pattern, so
    a program's tiles are the only ones of their patterns) instead of the ``dbias`` kernel: the table's gradient and
    q, k, v's against the float64 reference, with and without prefix tokens (their pairs are not the table's); the
    launches asserted (no ``dbias`` launch), and where the ``dq`` kernel's tiles share patterns (3 x 8), the
    ``dbias`` kernel as before (patterns of several phases: :func:`test_dbias_kernel_equals_reference`);
    ViT-B/16's 197 tokens with a GPU's launches (its 64-token tiles, one pattern each too; four a side, the last of
    5 tokens), in the interpreter too (one head; the other grids two). A batch of 3, so a program sums two batch
    elements. Two runs bitwise equal (the sums in a fixed order)."""
    n = prefix + grid[0] * grid[1]
    config = cuda_config(d) if grid == (14, 14) else None  # (the interpreter's 16-token tiles: the other grids)
    h = 1 if grid == (14, 14) else 2
    q, k, v, table = (t.float() for t in _inputs(3, h, n, d, grid))  # (3: a share of two, in the interpreter's 2)
    sms = None if device == "cpu" else 132
    launches = fused.plan(q, k, v, table, grid, prefix, bias_read="tiles", sms=sms, config=config)
    if device == "cpu" or grid == (14, 14):  # (a GPU's tiles: the others fit one tile, or one pattern a tile)
        assert (launches["dq"].args["TABLE_GRAD"] == 2) is in_dq and ("dbias" in launches) is not in_dq
        assert launches["dq"].grid[0] > 1  # (more than one query tile: the four kernels, not the one-tile one)
    runs = [_check(device, 3, h, d, grid, prefix, bias_read="tiles", config=config) for _ in range(2)]
    (out, grads), (out2, grads2) = runs
    assert torch.equal(out, out2) and all(torch.equal(a, b) for a, b in zip(grads, grads2))


@interpreted
@pytest.mark.parametrize(("grid", "prefix", "causal"), [((4, 8), 1, False), ((5, 7), 0, False), ((1, 37), 0, True)])
def test_forward_tiles_wider_than_tall(grid, prefix, causal):
    """The forward with key tiles twice its query tiles (16 x 32 here, as 64 x 128 on a GPU at head dim 64; the
    backward's tiles stay square): its bias tiles repeat by ``(q0 - k0, q0 mod W)`` with ``gcd(BM, BN)`` steps, or are
    each exact; causal masks within a tile that straddles the diagonal. One batch element (the batch's offsets do
    not depend on the tile: :func:`test_kernel_equals_reference`)."""
    config = replace(INTERPRETER, fwd_tile=(16, 32))
    assert fused.plan(*(torch.zeros(1, 1, 41, 16),) * 3, None, (5, 8), 1, config=config)["fwd"].args["BN"] == 32
    _check("cpu", 1, 2, 16, grid, prefix, causal=causal, bias_read="tiles", config=config)


_NOT_SQUARE = [
    ((4, 8), 1, False, "table"), ((5, 7), 0, False, "table"), ((1, 37), 0, True, "table"), ((4, 8), 1, False, "none"),
    ((5, 7), 1, False, "atomic"), ((8, 8), 0, False, "skip"),
]  # fmt: skip


@interpreted
@pytest.mark.parametrize(
    ("kernel", "grid", "prefix", "causal", "case"),
    [("dkdv", *c) for c in _NOT_SQUARE]
    + [("dq", *c) for c in _NOT_SQUARE if c[-1] != "atomic"]
    + [("dbias", *c) for c in _NOT_SQUARE if c[-1] != "none"],
)
def test_backward_tiles_not_square(kernel, grid, prefix, causal, case):
    """The ``dkdv`` kernel with a key block twice its query tiles (16 x 32 here, as head dim 128's 64 x 128 on a
    GPU: ``KernelConfig.dkdv_tile``), the ``dq`` kernel with a query block twice its key tiles (32 x 16, as its
    128 x 64; with ``dq`` by atomics there is no ``dq`` kernel), and the ``dbias`` kernel likewise (with ``dq`` by
    atomics, where the ``dq`` kernel would sum the tiles' gradient), summing the table's gradient per pattern of those
    tiles; the others keep the square tile,
    so two sets of bias tiles: its tiles' bias repeats by ``(q0 - k0, q0 mod W)``, or each is exact; causal; no
    table; ``dq`` added by atomics; LookHere's ``-inf`` entries with the visible-tile flags pooled to its tile (the
    tiles it skips). One batch element, but for ``dbias``'s two shares (the batch's offsets do not depend on the
    tile: :func:`test_kernel_equals_reference`)."""
    tile = {"dkdv": (16, 32), "dq": (32, 16), "dbias": (32, 16)}[kernel]
    own = {f"{kernel}_tile": tile}
    det = kernel != "dbias" and case != "atomic"  # (the dbias kernel's test: dq by atomics, so it runs)
    config = replace(INTERPRETER, **own)
    q = torch.zeros(1, 1, 41, 16)
    t = torch.zeros(1, 9, 15)
    launches = fused.plan(q, q, q, t, (5, 8), 1, deterministic=kernel != "dbias", config=four_kernels(**own))
    assert (launches[kernel].args["BM"], launches[kernel].args["BN"]) == tile
    other = launches["dq" if kernel == "dkdv" else "dkdv"].args
    tm, tw = other["BT"].shape[-2:]  # (plan's tiles: a GPU's, 64 x 64)
    assert launches[kernel].args["BT"].shape[-2:] == tile and tm == tw == other["BM"] == other["BN"]
    if case != "skip":
        settings = dict(table_on=case != "none", deterministic=det, bias_read="tiles", config=config)
        _check("cpu", 2 if kernel == "dbias" else 1, 2, 16, grid, prefix, causal=causal, **settings)
        return
    q, k, v, table = _masked_table_case(grid, prefix)
    leaves = [t.requires_grad_() for t in (q, k, v, table)]
    ref = reference(q, k, v, table, grid, prefix)
    go = torch.randn_like(ref)
    gref = torch.autograd.grad(ref, leaves, go)
    blocks = fused.visible_tiles(table.float(), as_grid(grid), prefix)
    call = dict(blocks=blocks, deterministic=det, sms=None, config=config)
    launch = fused.plan(q.float(), q.float(), q.float(), table.float(), grid, prefix, **call)[kernel]
    flags = fused.tile_flags(blocks, *tile)  # (dkdv's rows: its key blocks, the flags' columns)
    lists = fused.tile_lists(flags.mT if kernel == "dkdv" else flags)
    visits = flags.to(launch.args["BLK"].dtype) if kernel == "dbias" else lists  # (dbias reads a flag a tile)
    assert 0 < int(flags.sum()) < flags.numel() and torch.equal(launch.args["BLK"], visits)
    qd, kd, vd, td = (t.detach().float().requires_grad_() for t in (q, k, v, table))
    out = rel_bias_attention(qd, kd, vd, td, grid, prefix, blocks=blocks, deterministic=det, config=config)
    g = torch.autograd.grad(out, (qd, kd, vd, td), go.float())
    torch.testing.assert_close(out.double(), ref.detach(), **_tol("cpu"))
    for a, r in zip(g[:3], gref[:3]):
        torch.testing.assert_close(a.double(), r, **_tol("cpu"))
    finite = torch.isfinite(table)
    torch.testing.assert_close(g[3].double()[finite], gref[3][finite], **_tol("cpu"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("grid", "prefix", "case"),
    [((12, 12), 1, "table"), ((9, 16), 0, "fp16"), ((1, 150), 0, "causal"), ((12, 12), 1, "none"),
     ((12, 12), 1, "atomic"), ((7, 9), 2, "gather"), ((10, 13), 1, "d128"), ((12, 12), 1, "wide"),
     ((1, 150), 0, "wide causal")],
)  # fmt: skip
def test_gpu_launch_configuration_equals_reference(device, grid, prefix, case):
    """The launches a GPU gets (head dim 64: the square 64 x 64 tiles in every kernel; head dim 128: the forward's
    64 x 32, ``dkdv``'s 64 x 128, ``dq``'s and ``dbias``'s 128 x 64 where the bias is read whole or there is none,
    the square 32 x 32 where ``dq`` sums the gradient's diagonals; their bias tiles of those shapes, in the inputs'
    type) run through the interpreter equal the float64 reference, output and gradients (the table's too): what the
    other tests check with the interpreter's 16-token tiles, here in the shapes the H100 runs. Grids of several tiles
    a side, prefix tokens, fp16 tiles, causal, no table, ``dq`` by atomics, the bias gathered per score, head dim
    128, and (``wide``) head dim 64's wide tiles, which ``bench/triton_tune.py`` times (the forward's and ``dkdv``'s
    64 x 128, ``dq``'s and ``dbias``'s 128 x 64, as the defaults were before the H100 tuning), each a
    :class:`~vitrel.kernels.triton.config.KernelConfig` handed to the call. Under ``-m cuda`` the
    same on the GPU, in bf16: the only GPU check of the wide tiles against the reference (the others' head dims take
    square ones)."""
    d, sq = (128, 32) if case == "d128" else (64, 64)
    config = cuda_config(d)
    if case.startswith("wide"):
        wide = dict(fwd_tile=(64, 128), dkdv_tile=(64, 128), dq_tile=(128, 64), dbias_tile=(128, 64))
        config = replace(config, **wide, wide=Warps(8, 2))
    q = torch.zeros(1, 1, prefix + grid[0] * grid[1], d)
    kw = dict(bias_read="gather" if case == "gather" else "tiles", deterministic=case != "atomic")
    launches = fused.plan(q, q, q, None, grid, prefix, config=config)
    shapes = {k: (x.args["BM"], x.args.get("BN")) for k, x in launches.items()}
    if d == 128:
        fwd, dkdv, dq, dbias_tile = (64, 32), (64, 128), (128, 64), (128, 64)
    elif case.startswith("wide"):
        fwd, dkdv, dq, dbias_tile = (64, 128), (64, 128), (128, 64), (128, 64)
    else:
        fwd = dkdv = dq = dbias_tile = (64, 64)
    assert shapes == {"fwd": fwd, "delta": (128, None), "dkdv": dkdv, "dq": dq}, shapes
    t = torch.zeros(1, 2 * grid[0] - 1, 2 * grid[1] - 1)
    square = fused.plan(q, q, q, t, grid, prefix, bias_read="gather", config=config)["dq"].args
    assert (square["BM"], square["BN"], square["TABLE_GRAD"]) == (sq, sq, 1)
    tiles = fused.plan(q, q, q, t, grid, prefix, bias_read="tiles", config=config)  # (the dq kernel sums the
    sums = tiles["dbias"] if "dbias" in tiles else tiles["dq"]  # tiles' gradient where they are one pattern each)
    assert (sums.args["BM"], sums.args["BN"]) == (dbias_tile if "dbias" in tiles else dq)
    assert sums.args["DBT" if "dbias" in tiles else "DT"].numel() > 1
    causal = case.endswith("causal")
    settings = dict(table_on=case != "none", causal=causal, dtype=torch.float16 if case == "fp16" else None)
    _check(device, 1 if d == 128 else 2, 2, d, grid, prefix, **kw, **settings, config=config)


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_causal_1d(device):
    """Causal 1-D (a 1 x N grid): the keys after the query masked, the blocks above the diagonal skipped."""
    _check(device, 2, 2, 16, (1, 37), 0, causal=True)


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_without_table(device):
    """No bias (a rotary scheme's or no position): plain attention."""
    _check(device, 1, 2, 16, (4, 5), 1, table_on=False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tma", [True, False])
@pytest.mark.parametrize(
    ("grid", "prefix", "causal", "table_on"), [((5, 7), 1, False, True), ((1, 37), 0, True, False)]
)
def test_forward_reads_keys_and_values_with_or_without_tma(device, tma, grid, prefix, causal, table_on):
    """The forward's key and value tiles read through tensor descriptors (``TMA``, rows past the end zero-filled by
    the descriptor) or by addresses (rows clamped), the same against the reference; the interpreter emulates the
    descriptors (on a GPU: ``pytest -m cuda``, Hopper or later for the descriptors). Which one a launch takes
    (:func:`fused.tma_reads`) is asserted, so neither path goes untested: the configuration's
    ``tma_min_tiles`` is 1 here (these grids are one key tile of a GPU's), or beyond the call's tiles."""
    least = dict(tma_min_tiles=1 if tma else 1 << 30)
    config = four_kernels(device, **least)  # (fwd_tile has no TMA)
    q, k, v, table = (t.float() for t in _inputs(2, 2, prefix + grid[0] * grid[1], 16, grid))
    assert fused.plan(q, k, v, table, grid, prefix, config=four_kernels(**least))["fwd"].args["TMA"] is tma
    _check(device, 2, 2, 16, grid, prefix, causal=causal, table_on=table_on, config=config)


def test_tma_reads_where_the_tensors_allow():
    """Tensor descriptors where the accelerator's rules hold (unit stride on the head dim, other strides and the
    address multiples of 16 bytes, rows of 16 bytes or more): a contiguous tensor and a view of a fused ``qkv``, not a
    view that starts off 16 bytes nor one strided along the head dim; not where the loop is short
    (``KernelConfig.tma_min_tiles``), not on the CPU without the interpreter or a planned GPU launch."""
    x = torch.randn(2, 3, 40, 16)
    qkv = torch.randn(2, 40, 3, 3, 16)
    view = qkv[:, :, 1].transpose(1, 2)
    off = torch.randn(2, 3, 40, 17)[..., 1:]
    lanes = torch.randn(2, 3, 40, 32)[..., ::2]
    assert fused.tma_reads(x, x, 16, True) and fused.tma_reads(view, view, 16, True)
    assert not fused.tma_reads(off, off, 16, True)
    assert not fused.tma_reads(lanes, lanes, 16, True)
    assert not fused.tma_reads(x.half()[..., :4], x.half()[..., :4], 4, True)  # (8-byte rows)
    assert fused.plan(x[:, :, :10], x[:, :, :10], x[:, :, :10], None, (3, 3), 1)["fwd"].kernel == "fwd_tile"
    # (10 tokens: else the one-tile forward, which has no TMA)
    short = fused.plan(x[:, :, :10], x[:, :, :10], x[:, :, :10], None, (3, 3), 1, config=four_kernels())["fwd"]
    long = fused.plan(*(torch.randn(1, 2, 1025, 64),) * 3, None, (32, 32), 1)["fwd"]
    assert not short.args["TMA"] and long.args["TMA"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("grid", "prefix", "causal"), [((4, 24), 1, False), ((4, 6), 2, False), ((1, 37), 0, True)])
def test_dbias_kernel_equals_reference(device, grid, prefix, causal):
    """The ``dbias`` kernel (the table's gradient per tile pattern: each tile of a pattern, then the program's share
    of the batch) gives the table's gradient of the reference: patterns of many tiles (4 x 24: three phases, up to
    three tiles a pattern; one head, the others' two) and of one (with ``dq`` by atomics, where the ``dq`` kernel
    would sum them), prefix pairs, causal; 3 batch elements in shares of 2 and 1 (the interpreter's; on a GPU
    ``pytest -m cuda``, in bf16)."""
    config = four_kernels(device)  # (grids that fit one tile of a GPU's backward too)
    det = grid == (4, 24)
    h = 1 if det else 2
    n = prefix + grid[0] * grid[1]
    q, k, v, table = (t.float() for t in _inputs(3, h, n, 16, grid))
    launches = fused.plan(q, k, v, table, grid, prefix, bias_read="tiles", deterministic=det, sms=None,
                                config=four_kernels("cpu"))  # fmt: skip
    assert "dbias" in launches and launches["dbias"].args["n_split"] == 2
    if det:  # (the interpreter's 16-token tiles: 39 patterns of 49 tiles, in three phases of q0 mod 24)
        n_pat, _, n_m = launches["dbias"].args["patterns"]
        assert n_m == 3 and n_pat < (-(-n // 16)) ** 2
    _check(device, 3, h, 16, grid, prefix, causal=causal, bias_read="tiles", deterministic=det, config=config)


def _one_tile_regions():
    from vitrel.layout.geometry import Grid
    from vitrel.layout.windows import window_regions

    return window_regions(Grid(8, 8), (4, 4), (2, 2))  # four windows of 16 tokens, the last of four regions


#: ``(batch, heads, head dim, grid, prefix, settings, whether the one-tile kernel runs)``, each call's tokens one tile
_ONE_TILE = [
    (3, 2, 16, (3, 5), 1, {}, True),  # the table's gradient over shares of 2 and 1 batch elements (interpreter)
    (3, 2, 24, (3, 4), 2, {}, True),  # registers, a head dim not a power of two
    (4, 2, 16, (4, 4), 0, dict(table_on=False), True),  # no table (the unscaled logits)
    (3, 2, 16, (3, 5), 0, dict(causal=True), True),
    (3, 2, 16, (3, 5), 1, dict(table_grad=False), True),  # a fixed table: a program per batch element
    (3, 2, 16, (3, 5), 1, dict(bias_read="gather", table_grad=False), True),  # the bias gathered per score
    (3, 2, 16, (3, 5), 1, dict(deterministic=False), True),  # (no atomics to take: the same kernel)
    (8, 2, 16, (4, 4), 0, dict(regions="swin"), True),  # Swin's shifted windows, their regions masked
    (4, 2, 16, (4, 4), 0, dict(mask="windows"), True),  # a float mask per window
    (2, 2, 16, (3, 5), 1, dict(bias_read="gather"), False),  # gathered with the gradient: the dq kernel's diagonals
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tile_fwd", [True, False])
@pytest.mark.parametrize(("b", "h", "d", "grid", "prefix", "settings", "one"), _ONE_TILE)
def test_one_tile_backward_equals_reference(monkeypatch, device, tile_fwd, b, h, d, grid, prefix, settings, one):
    """A call whose tokens fit one tile of the backward (Swin's windows) runs its backward as one
    kernel, ``tile`` (``dq, dk, dv`` written whole, the table's gradient summed over a share of the batch): equal to
    the reference with and without a table, its gradient or a fixed one, prefix tokens, causal, a window's regions or
    float mask; the four kernels where the table's gradient is gathered. Its forward likewise (``fwd_tile``, a
    share of the batch a program), or (``fwd_one_tile_max`` 0) the forward of any call (a program a batch element,
    with its ``ONE``: its one key tile's softmax, with no rescaling). The launches are recorded as they run."""
    config = INTERPRETER if device == "cpu" else cuda_config(d)
    config = replace(config, fwd_one_tile_max=config.fwd_one_tile_max if tile_fwd else 0)
    ran = []
    call = fused.Launch.__call__
    name = lambda launch: launch.kernel + ("/one" if launch.args.get("ONE") else "")  # noqa: E731 (fwd: one key tile)
    monkeypatch.setattr(fused.Launch, "__call__", lambda self: (ran.append(name(self)), call(self))[1])
    settings = dict(settings)
    if settings.get("regions") == "swin":
        settings["regions"] = _one_tile_regions()
    if settings.get("mask") == "windows":
        mask = torch.zeros(2, 16, 16, dtype=torch.float64)
        mask[0, :, 3] = -5.0
        region = torch.tensor([0] * 6 + [1] * 6 + [2] * 4)
        mask[1] = torch.where(region[:, None] == region[None, :], 0.0, float("-inf"))
        settings["mask"] = mask
    _check(device, b, h, d, grid, prefix, **settings, config=config)
    fwd = "fwd_tile" if tile_fwd else "fwd/one"
    sums = settings.get("table_on", True) and settings.get("table_grad", True) and settings.get("bias_read") != "gather"
    table_grad = ["table_grad"] * (one and sums)  # (the tile kernel's sums reduced to the table: one launch)
    assert ran == ([fwd, "tile"] if one else [fwd, "delta", "dkdv", "dq"]) + table_grad, ran


@interpreted
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scale", [12.0, -12.0])
def test_kernel_without_table_scales_as_it_subtracts(scale, causal):
    """No bias: the logits scaled in the softmax's subtraction (``RAW``), the row's maximum taken of the unscaled
    logits, which holds for a positive scale only (a negative one scales first). Logits of up to about 250 (base 2):
    a maximum taken wrongly overflows ``exp2`` (or underflows every score) instead of cancelling out."""
    grid, prefix = ((1, 37), 0) if causal else ((4, 5), 1)
    _check("cpu", 1, 2, 16, grid, prefix, table_on=False, causal=causal, scale=scale)


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_window_mask(device):
    """A batch of windows with a mask per window (``b % nW``: Swin's shifted windows), ``-inf`` and finite."""
    grid = (4, 4)
    mask = torch.zeros(2, 16, 16, dtype=torch.float64)
    region = torch.tensor([0] * 6 + [1] * 6 + [2] * 4)
    mask[1] = torch.where(region[:, None] == region[None, :], 0.0, float("-inf"))
    mask[0, :, 3] = -5.0
    _check(device, 4, 2, 16, grid, 0, mask=mask)


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_window_regions(device):
    """A batch of windows' layout (:meth:`TokenLayout.windows`, Swin's shifted windows): the region ids of each
    window (``b % nW``) masked in the kernel equal the float mask they mean. A 7 x 9 map in 4 x 5 windows shifted by
    (2, 2): four windows of 20 tokens (two tiles each); the last holds all nine regions (the seam and the padding on
    both axes)."""
    from vitrel.layout.geometry import Grid
    from vitrel.layout.windows import window_regions

    regions = window_regions(Grid(7, 9), (4, 5), (2, 2))
    assert regions.shape == (4, 20) and len(regions[3].unique()) == 9  # seam x seam x padding: all nine
    _check(device, 8, 2, 16, (4, 5), 0, regions=regions)


def _masked_table_case(grid=(8, 8), prefix=1):
    n = prefix + grid[0] * grid[1]
    q, k, v, table = _inputs(1, 2, n, 16, grid)
    table[0, :, : grid[1] - 1] = float("-inf")  # head 0 sees only the keys on its column or to its left
    table[1, grid[0] :, :] = float("-inf")  # head 1 sees only keys below or on its row
    return q, k, v, table


@interpreted
@pytest.mark.parametrize("grid", [(8, 8), (3, 5)])
@pytest.mark.parametrize("skip", [False, True])
def test_kernel_masked_table_entries(skip, grid):
    """``-inf`` table entries (LookHere's views) mask their pairs; whole tiles of them give no NaN; with the
    visible-tile flags (``skip``) the kernels skip the tiles they mask whole and give the same; the table's gradient
    at its finite entries. 3 x 5 and a prefix token: one tile (the one-tile backward, which reads no flags: its tile
    is visited whole, and its ``-inf`` entries mask their pairs)."""
    prefix = 1
    q, k, v, table = _masked_table_case(grid, prefix)
    leaves = [t.requires_grad_() for t in (q, k, v, table)]
    ref = reference(q, k, v, table, grid, prefix)
    go = torch.randn_like(ref)
    gref = torch.autograd.grad(ref, leaves, go)
    dev = "cpu"
    qd, kd, vd, td = (t.detach().float().to(dev).requires_grad_() for t in (q, k, v, table))
    blocks = fused.visible_tiles(table.float(), as_grid(grid), prefix) if skip else None
    if skip and grid == (8, 8):
        assert 0 < int(blocks.sum()) < blocks.numel()  # some tiles are skipped
    out = rel_bias_attention(qd, kd, vd, td, grid, prefix, blocks=blocks)
    g = torch.autograd.grad(out, (qd, kd, vd, td), go.float())
    torch.testing.assert_close(out.double(), ref.detach(), **_tol(dev))
    for a, r in zip(g[:3], gref[:3]):
        torch.testing.assert_close(a.double(), r, **_tol(dev))
    finite = torch.isfinite(table)
    torch.testing.assert_close(g[3].double()[finite], gref[3][finite], **_tol(dev))


@interpreted
def test_visible_tiles_are_the_dense_definition_and_are_read():
    """The flags equal the dense definition (some visible pair in a 16 x 16 tile of tokens, prefix pairs visible),
    computed in chunks; a flag cleared on a visible tile changes the output: the kernel skips what they say."""
    grid, prefix = as_grid((8, 8)), 1
    q, k, v, table = _masked_table_case((8, 8), prefix)
    seen = torch.isfinite(expand_offset_table(table, grid, prefix))  # (pairs with a prefix token: 0, visible)
    n = seen.shape[-1]
    nt = -(-n // 16)
    dense = torch.nn.functional.pad(seen, (0, nt * 16 - n, 0, nt * 16 - n), value=False)
    dense = dense.view(2, nt, 16, nt, 16).any(4).any(2).int()
    for chunk in (16, 32, 1024):
        assert torch.equal(fused.visible_tiles(table, grid, prefix, chunk=chunk), dense)
    blocks = dense.clone()
    blocks[1, 0, 0] = 0  # queries 0-15 of head 1 see keys 0-15
    out = rel_bias_attention(q.float(), k.float(), v.float(), table.float(), grid, prefix, blocks=blocks)
    ref = reference(q, k, v, table, grid, prefix)
    assert not torch.allclose(out[0, 1, :16].double(), ref[0, 1, :16], atol=1e-3)
    torch.testing.assert_close(out[0, 0].double(), ref[0, 0], **_tol("cpu"))


def test_tile_flags_pool_the_blocks():
    """The 16-token visible-tile flags pooled to a kernel's tile (a flag per tile, what the kernels load): 1 where any
    of the tile's blocks is, ragged edges included."""
    blocks = (torch.rand(2, 9, 9, generator=torch.Generator().manual_seed(0)) < 0.2).int()
    got = fused.tile_flags(blocks, 32, 64)
    want = torch.zeros(2, 5, 3, dtype=torch.int32)
    for h in range(2):
        for i in range(5):
            for j in range(3):
                want[h, i, j] = int(blocks[h, 2 * i : 2 * i + 2, 4 * j : 4 * j + 4].any())
    assert torch.equal(got, want) and 0 < int(want.sum()) < want.numel()


@interpreted
def test_kernel_reads_the_tile_flags_at_its_tile():
    """At 32-token tiles (a GPU's tiles are 64; the interpreter's 16), the forward skips the tiles whose pooled flag
    is 0 and gives the reference: a flag read at the wrong tile skips visible pairs."""
    grid, prefix = (12, 8), 0
    q, k, v, table = _inputs(1, 2, 96, 16, grid)
    table[:, :10] = table[:, 12:] = float("-inf")  # a query sees the keys of its row and of the next (dh = -1, 0)
    blocks = fused.visible_tiles(table.float(), as_grid(grid), prefix)
    pooled = fused.tile_flags(blocks, 32, 32)
    assert 0 < int(pooled.sum()) < pooled.numel()  # some 32 x 32 tiles are skipped
    qf, kf, vf = (t.float().contiguous() for t in (q, k, v))
    out, lse = torch.empty_like(qf), torch.empty(*qf.shape[:2], fused.stats_len(qf.shape[2]))
    config = replace(INTERPRETER, fwd_tile=(32, 32))
    launch = fwd_launch(
        qf, kf, vf, table.float(), None, None, blocks, 16**-0.5, *grid, prefix, False, "auto", out, lse, None, config
    )
    launch()
    torch.testing.assert_close(out.double(), reference(q, k, v, table, grid, prefix), **_tol("cpu"))


@interpreted
@pytest.mark.parametrize("tile_fwd", [False, True])
def test_row_stats_padded_for_unmasked_reads(tile_fwd):
    """The forward's log-sum-exp and the backward's ``D`` are ``[B, H, NP]`` (``NP``: N up to a multiple of
    ``STATS_ROWS``), which the backward's kernels read with no mask: every padding row holds +inf (log-sum-exp, so a
    query past the end has ``p = 0``), past the forward's last query tile too, and 0 (``D``); the rows of real
    queries the base-2 log-sum-exp of their logits and ``rowsum(o * do)``."""
    grid = (4, 5)
    n = 1 + grid[0] * grid[1]
    q, k, v, table = (t.float() for t in _inputs(2, 2, n, 16, grid))
    # (the delta kernel: 21 tokens fit one tile of a GPU's; the one-tile forward writes all 128 rows itself)
    config = replace(cuda_config(16), bwd_one_tile_max=0, fwd_one_tile_max=64 if tile_fwd else 0)
    launches = fused.plan(q, k, v, table, grid, 1, config=config)
    assert launches["fwd"].kernel == ("fwd_tile" if tile_fwd else "fwd")
    lse, delta, do = launches["fwd"].args["LSE"], launches["delta"].args["DELTA"], launches["delta"].args["DO"]
    assert lse.shape == delta.shape == (2, 2, fused.stats_len(n)) == (2, 2, 128)
    # (rows only the last program's loop writes; the one-tile forward's every program writes a padded block's rows)
    assert launches["fwd"].args["BM"] < 128 and (tile_fwd or launches["fwd"].grid[0] * launches["fwd"].args["BM"] < 128)
    lse.fill_(float("nan"))
    delta.fill_(float("nan"))
    do.copy_(torch.randn_like(do))
    launches["fwd"]()
    launches["delta"]()
    logits = torch.einsum("bhid,bhjd->bhij", q, k) * 16**-0.5 + expand_offset_table(table, as_grid(grid), 1)
    torch.testing.assert_close(lse[..., :n], torch.logsumexp(logits, -1) / math.log(2), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(delta[..., :n], (launches["fwd"].args["O"] * do).sum(-1), atol=1e-5, rtol=1e-5)
    assert torch.all(lse[..., n:] == float("inf")) and torch.all(delta[..., n:] == 0)


@triton.jit
def _read_bias_tile(BT, OUT, h, q0, k0, n_kt, n_pat, TM: tl.constexpr, TW: tl.constexpr, PAIRS: tl.constexpr):
    """The bias tile of queries from ``q0`` and keys from ``k0`` (a tile per pattern: ``n_m = 0``) as the kernels read
    it (:func:`_bias_tile`), stored in float32."""
    tile = _bias_tile(BT, h, q0, k0, n_kt * TW, 1, n_pat, 0, 1, 0, 1, True, True, TM, TW, PAIRS)
    tl.store(OUT + tl.arange(0, TM)[:, None] * TW + tl.arange(0, TW)[None, :], tile)


@interpreted
def test_bf16_bias_tiles_read_as_pairs():
    """bf16 bias tiles read as 32-bit words of two entries and widened by hand (``PAIRS``: the forward's and
    ``dq``'s) give each entry's float in its place, bit for bit as torch widens them: every kind of value (negative,
    -0, -inf, subnormal, the largest). (bf16 logits are not computed right in the interpreter, so the kernels' own
    tests read float32 tiles here, and its own bf16 conversion flushes subnormals; ``-m cuda`` runs this path whole.)
    """
    g = torch.Generator().manual_seed(0)
    tiles = (torch.randn(2, 4, 16, 32, generator=g) * 100).bfloat16()
    tiles[1, 3, 0, :4] = torch.tensor([float("-inf"), -0.0, 1e-40, 3e38])
    out = torch.full((16, 32), float("nan"))
    _read_bias_tile[(1,)](tiles, out, 1, 16, 32, 2, 4, 16, 32, True)  # (pattern 1 * 2 + 1 of head 1)
    assert torch.equal(out.view(torch.int32), tiles[1, 3].float().view(torch.int32))


@interpreted
def test_kernel_causal_with_visible_tiles():
    """Causal 1-D with a banded table (``-inf`` beyond 8 tokens) and its visible-tile flags: the kernels loop over
    the listed tiles, the causal ones (above the diagonal) dropped from the lists; output and gradients equal the
    reference."""
    grid = (1, 70)
    q, k, v, table = _inputs(1, 2, 70, 16, grid)
    table[:, :, : 69 - 8] = table[:, :, 69 + 9 :] = float("-inf")
    blocks = fused.visible_tiles(table.float(), as_grid(grid), 0)
    assert 0 < int(blocks.sum()) < blocks.numel()
    leaves = [t.requires_grad_() for t in (q, k, v)]
    ref = reference(q, k, v, table, grid, 0, causal=True)
    go = torch.randn_like(ref)
    gref = torch.autograd.grad(ref, leaves, go)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    out = rel_bias_attention(qf, kf, vf, table.float(), grid, 0, causal=True, blocks=blocks)
    grads = torch.autograd.grad(out, (qf, kf, vf), go.float())
    torch.testing.assert_close(out.double(), ref.detach(), **_tol("cpu"))
    for a, r in zip(grads, gref):
        torch.testing.assert_close(a.double(), r, **_tol("cpu"))


@interpreted
def test_query_tiles_with_no_visible_key_tile():
    """A table that shows each query only the keys 40 or more tokens before it (1-D, 70 tokens): the first query
    tiles' lists of visible key tiles are empty, and the forward visits the first invisible tile instead (its loop
    runs at least once: ``tl.assume``, which keeps ptxas from serializing its products); a query with nothing visible
    gives 0, with no NaN in the output or the gradients; the other rows and all gradients equal the reference's."""
    grid = (1, 70)
    q, k, v, table = _inputs(1, 2, 70, 16, grid)
    table[:, :, : 69 + 40] = float("-inf")  # offsets i - j < 40 (entry i - j + 69)
    blocks = fused.visible_tiles(table.float(), as_grid(grid), 0)
    assert int(fused.tile_lists(fused.tile_flags(blocks, 16, 16))[:, 0, 0].max()) == 0  # (nothing)
    seen = slice(40, None)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    # the reference of the rows with something visible (softmax over a row of -inf is NaN, and so its gradients)
    logits = (q @ k.transpose(-1, -2)) * 16**-0.5 + expand_offset_table(table, as_grid(grid))
    ref = logits[..., seen, :].softmax(-1) @ v
    go = torch.randn(q.shape, dtype=torch.float64)
    go[..., :40, :] = 0
    gref = torch.autograd.grad(ref, leaves, go[..., seen, :])
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    out = rel_bias_attention(qf, kf, vf, table.float(), grid, 0, blocks=blocks)
    grads = torch.autograd.grad(out, (qf, kf, vf), go.float())
    assert torch.all(out[..., :40, :] == 0) and torch.all(grads[0][..., :40, :] == 0)
    torch.testing.assert_close(out[..., seen, :].double(), ref.detach(), **_tol("cpu"))
    for a, r in zip(grads, gref):
        torch.testing.assert_close(a.double(), r, **_tol("cpu"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU")
@pytest.mark.parametrize("deterministic", [True, False])
def test_cuda_graph_captures_forward_and_backward(deterministic):
    """The op's forward and backward make no host sync and no copy from the host (the ``dbias`` order, the tile
    lists and patterns are made on the device): ``torch.cuda.graph`` captures them, as ``trainer=gpu``'s
    reduce-overhead step does, and a replay gives the eager gradients."""
    grid, prefix = (12, 12), 1
    q, k, v, table = (t.cuda() for t in _inputs(4, 2, prefix + 144, 32, grid))
    q, k, v = (t.bfloat16().requires_grad_() for t in (q, k, v))
    table = table.float().requires_grad_()
    go = torch.randn_like(q)

    def step():
        out = rel_bias_attention(q, k, v, table, grid, prefix, bias_read="tiles", deterministic=deterministic)
        return torch.autograd.grad(out, (q, k, v, table), go)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        eager = step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, eager):
        torch.testing.assert_close(a.float(), b.float(), atol=1e-2, rtol=1e-2)


@interpreted
def test_table_gradient_is_deterministic():
    """Partial sums per program reduced by tensor sums: two backward passes give bitwise equal table gradients."""
    grid, prefix = (4, 6), 1
    q, k, v, table = (t.float() for t in _inputs(3, 2, prefix + 24, 16, grid))
    table.requires_grad_()
    loss = lambda: rel_bias_attention(q, k, v, table, grid, prefix).square().sum()  # noqa: E731
    runs = [torch.autograd.grad(loss(), table)[0] for _ in "ab"]
    assert torch.equal(runs[0], runs[1])


def layout_reference(q, k, v, tables, tokens):
    """float64, dense: a token layout's attention from the equation. ``tokens [B, 4, N]`` (segment, row, column,
    group); a token sees its segment's tokens; a patch pair (rows >= 0) adds ``T[group_i, h, r_i - r_j + GH - 1,
    c_i - c_j + GW - 1]``."""
    seg, row, col, grp = tokens.long().unbind(1)
    b, n = seg.shape
    gh, gw = (tables.shape[-2] + 1) // 2, (tables.shape[-1] + 1) // 2
    logits = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    bias = torch.zeros_like(logits)
    for bi in range(b):
        for i in range(n):
            for j in range(n):
                if row[bi, i] >= 0 and row[bi, j] >= 0 and seg[bi, i] == seg[bi, j]:
                    dh, dw = row[bi, i] - row[bi, j] + gh - 1, col[bi, i] - col[bi, j] + gw - 1
                    bias[bi, :, i, j] = tables[grp[bi, i], :, dh, dw]
    same = seg[:, None, :, None] == seg[:, None, None, :]
    return (logits + bias).masked_fill(~same, float("-inf")).softmax(-1) @ v


def tile_aligned_tokens() -> tuple[torch.Tensor, int, tuple[int, int]]:
    """``[2, 4, 48]`` tokens whose rows visit different tiles of 16: row 0 three 4 x 4 images, one a tile (each tile
    sees only itself); row 1 two 5 x 5 images of 24 tokens (the middle tile sees all three); one group, extent 5 x 5."""
    rc = torch.stack(torch.meshgrid(torch.arange(5), torch.arange(5), indexing="ij"), -1).reshape(-1, 2)
    small = rc[(rc < 4).all(1)]
    row0 = [torch.cat([torch.full((16, 1), s), small, torch.zeros(16, 1, dtype=torch.long)], 1) for s in range(3)]
    row1 = [torch.cat([torch.full((24, 1), s), rc[:24], torch.zeros(24, 1, dtype=torch.long)], 1) for s in range(2)]
    return torch.stack([torch.cat(row0), torch.cat(row1)]).transpose(1, 2).contiguous(), 1, (5, 5)


def packed_tokens(prefix: int = 1, seed: int = 0) -> tuple[torch.Tensor, int]:
    """``[2, 4, N]`` tokens of two packed rows on the extent 4 x 5, and the number of groups (3): row 0 a whole 4 x 5
    image and a 2 x 3 one; row 1 a 3 x 2 image with 2 tokens dropped, a 2 x 3 one, and a 4 x 5 one with half its
    tokens dropped, each image's tokens shuffled; padding after each row."""
    g = torch.Generator().manual_seed(seed)
    grids = [(4, 5), (2, 3), (3, 2)]

    def image(group: int, seg: int, keep: float = 1.0) -> torch.Tensor:
        h, w = grids[group]
        rc = torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij"), -1).reshape(-1, 2)
        rc = rc[torch.randperm(len(rc), generator=g)[: max(1, round(keep * len(rc)))]]
        rc = torch.cat([torch.full((prefix, 2), -1), rc])
        return torch.cat([torch.full((len(rc), 1), seg), rc, torch.full((len(rc), 1), group)], 1)

    rows = [torch.cat([image(0, 0), image(1, 1)]), torch.cat([image(2, 0, 0.67), image(1, 1), image(0, 2, 0.5)])]
    n = max(len(r) for r in rows) + 5
    pad = torch.tensor([-1, -1, -1, 0])
    out = torch.stack([torch.cat([r, pad.expand(n - len(r), 4)]) for r in rows])
    return out.transpose(1, 2).contiguous(), len(grids)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("prefix", [0, 1, 2])
def test_kernel_token_layout_equals_reference(device, prefix):
    """Packed images of three sizes, dropped tokens in any order, padding: each token attends to its own image (padding
    to padding) with the bias of its image's group table; outputs, ``dq, dk, dv`` and the gradient of every group's
    table (read only at the offsets its images have)."""
    _check_layout(device, prefix)


@interpreted
def test_layout_tokens_and_regions_padded_for_unmasked_reads():
    """The kernels read a layout's tokens ``[B, 4, N]`` padded to ``[B, 4, NP]`` (``stats_len``), with no mask: the
    tokens as given, then segment -2, row -1 (no patch), column 0, group 0 (with masked loads, rows of four packed
    32 x 32 images issued 6-10 % more instructions a tile, sm_90)."""
    tokens, _ = packed_tokens(1)
    b, _, n = tokens.shape
    q = torch.zeros(b, 2, n, 16)
    launch = fused.plan(q, q, q, torch.zeros(3, 2, 7, 9), (4, 5), 1, tokens=tokens)["fwd"]
    tok = launch.args["TOK"]
    assert tok.shape == (b, 4, fused.stats_len(n)) == (b, 4, 128) and tok.is_contiguous()
    assert torch.equal(tok[..., :n], tokens.int())
    assert torch.equal(tok[..., n:], torch.tensor([-2, -1, 0, 0], dtype=torch.int32)[:, None].expand(b, 4, 128 - n))
    # a batch of windows' region ids [Mb, N] likewise: padded with -1 (masked, 1-3 % more instructions on interior
    # tiles and 5-10 % on a seam's)
    regions = torch.arange(20).remainder(3).expand(2, 20)
    w = torch.zeros(4, 2, 20, 16)
    launch = fused.plan(w, w, w, torch.zeros(2, 7, 9), (4, 5), regions=regions)["fwd"]
    mask = launch.args["MASK"]  # (its rows read at stats_len(N) apart)
    assert launch.args["MASK_KIND"] == 2 and mask.shape == (2, 128) and mask.stride(0) == 128
    assert torch.equal(launch.args["MASK"][:, :20], regions.int()) and torch.all(launch.args["MASK"][:, 20:] == -1)


def _check_layout(device, prefix, tokens=None, groups=3, grid=(4, 5), config=None):
    if tokens is None:
        tokens, groups = packed_tokens(prefix)
    b, _, n = tokens.shape
    h, d = 2, 16
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    shape = (groups, h, 2 * grid[0] - 1, 2 * grid[1] - 1)
    tables = torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
    ref = layout_reference(q, k, v, tables, tokens)
    go = torch.randn_like(ref)
    grads_ref = torch.autograd.grad(ref, (q, k, v, tables), go)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    qd, kd, vd = (t.detach().to(device, dtype).requires_grad_() for t in (q, k, v))
    td = tables.detach().to(device, torch.float32).requires_grad_()
    out = rel_bias_attention(qd, kd, vd, td, grid, prefix, tokens=tokens.to(device), config=config)
    grads = torch.autograd.grad(out, (qd, kd, vd, td), go.to(device, dtype))
    tol = _tol(device)
    torch.testing.assert_close(out.double().cpu(), ref.detach(), **tol)
    for name, gi, gr in zip("qkvT", grads, grads_ref):
        scale = gr.abs().max().item()
        torch.testing.assert_close(gi.double().cpu() / scale, gr / scale, **tol, msg=f"d{name}")


@interpreted
def test_layout_table_gradient_is_deterministic():
    tokens, groups = packed_tokens(1, seed=3)
    q, k, v = (torch.randn(2, 1, tokens.shape[-1], 16) for _ in range(3))  # (one head: the sums' order is per head)
    tables = torch.randn(groups, 1, 7, 9, requires_grad=True)
    go = torch.randn_like(q)
    g1, g2 = (torch.autograd.grad(rel_bias_attention(q, k, v, tables, (4, 5), 1, tokens=tokens), tables, go)[0]
              for _ in range(2))  # fmt: skip
    assert torch.equal(g1, g2)


@interpreted
@pytest.mark.parametrize("pos", ["rel2d_full", "lookhere"])
def test_vit_packed_images_and_dropped_tokens(pos):
    """``create_model(..., attn_impl="triton")`` on a NaFlex dict (images of three sizes, two in one row) and on a
    list of images equals each image alone through sdpa, and its parameters' gradients equal sdpa's on the same
    packed batch; token dropping in training gives sdpa's output for the same kept tokens."""
    from tests.layout.test_tokens import alone, images, model, packed

    imgs = images(torch.float32)
    kw = dict(embed_dim=32, num_heads=2)  # (two heads of 16: the kernels' programs per head, not more of them)
    tri, ref = model(pos, torch.float32, attn_impl="triton", **kw), model(pos, torch.float32, **kw)
    d = packed(imgs)
    out, each = tri(d), alone(ref, imgs)  # (one interpreted forward serves the output's check and the gradients)
    torch.testing.assert_close(out, each, rtol=0, atol=2e-5)
    torch.testing.assert_close(tri([i[None] for i in imgs]), each, rtol=0, atol=2e-5)
    params = [p for p in tri.parameters() if p.requires_grad]
    g = torch.autograd.grad(out.square().sum(), params)
    g_ref = torch.autograd.grad(ref(d).square().sum(), [p for p in ref.parameters() if p.requires_grad])
    for (name, _), gi, gr in zip(tri.named_parameters(), g, g_ref):
        scale = max(gr.abs().max().item(), 1e-3)
        torch.testing.assert_close(gi / scale, gr / scale, atol=2e-5, rtol=1e-4, msg=name)
    tri.train()
    ref.train()
    tri.token_drop = ref.token_drop = 0.4
    x = torch.randn(2, 3, 16, 12)
    torch.manual_seed(7)
    y = tri.forward_features(x)
    torch.manual_seed(7)
    torch.testing.assert_close(y, ref.forward_features(x), rtol=0, atol=2e-5)


def _scheme_attention(name, prefix, causal=False):
    torch.manual_seed(0)
    a = Attention(32, 2, pos=name, grid=(3, 4), num_prefix_tokens=prefix, causal=causal).double()
    with torch.no_grad():
        for t in a.pos.parameters():  # away from the init, so that every entry matters
            t.normal_(0.0, 0.5)
    return a


@interpreted
@pytest.mark.parametrize("name", TABLE_SCHEMES)
@pytest.mark.parametrize("prefix", [0, 1])
def test_every_table_scheme_through_attention(name, prefix):
    """``Attention(..., attn_impl="triton")`` equals the float64 SDPA path on a grid larger than the one the scheme
    was built for (tables grown / clamped as the scheme says), outputs and the gradient of every parameter
    (the scheme's own: tables, MLPs, slopes)."""
    causal = get_pos_class(name).causal_aware and prefix == 0
    a = _scheme_attention(name, prefix, causal)
    x = torch.randn(2, prefix + 4 * 5, 32, dtype=torch.float64)
    y_ref = a(x, grid=(4, 5))
    params = dict(a.named_parameters())
    g_ref = torch.autograd.grad(y_ref.square().sum(), list(params.values()))
    a.attn_impl = "triton"
    a.float()
    y = a(x.float(), grid=(4, 5))
    g = torch.autograd.grad(y.square().sum(), list(params.values()))
    torch.testing.assert_close(y.double(), y_ref, atol=1e-5, rtol=1e-4)
    for (pname, _), gi, gr in zip(params.items(), g, g_ref):
        # (FIRE's last bias: zero gradient by softmax invariance, the sum of every table entry's gradient, which
        # cancels to float32's rounding, about 2e-7 here: absolute 2e-6 for it)
        scale = max(gr.abs().max().item(), 1e-1)
        torch.testing.assert_close(gi.double() / scale, gr / scale, atol=2e-5, rtol=1e-4, msg=pname)


@interpreted
def test_lookhere_narrow_views_through_attention():
    a = Attention(32, 4, pos={"name": "lookhere", "fov": 45}, grid=(4, 4), num_prefix_tokens=1).double()
    x = torch.randn(2, 17, 32, dtype=torch.float64)
    ref = a(x, grid=(4, 4))
    a.attn_impl = "triton"
    torch.testing.assert_close(a.float()(x.float(), grid=(4, 4)).double(), ref, atol=1e-5, rtol=1e-4)


@interpreted
@pytest.mark.parametrize("impl", ["triton", "triton_atomic"])
@pytest.mark.parametrize("arch", ["vit", "swin"])
def test_lookhere_in_a_model_of_several_blocks(arch, impl):
    """LookHere's blocks share their views' skipped tiles (``LookHere.prepare_many``): the kernel's own flags
    (``skip_blocks``: triton's visible tiles, not flex's BlockMask), and the model equals its ``sdpa`` twin, the
    output and the slopes' and the head's gradients."""
    torch.manual_seed(0)
    pos = {"name": "lookhere", "fov": 45}
    if arch == "vit":
        name, kw = "vitrel_vit_tiny_patch4_32", dict(img_size=32, embed_dim=32, depth=2, num_heads=4, num_classes=3)
    else:
        name = "vitrel_swin_tiny_patch2_window4_32"
        kw = dict(img_size=16, embed_dim=32, depths=(2,), num_heads=(2,), window_size=4, num_classes=3)
    ref = lively(vitrel.create_model(name, pos=pos, **kw))  # (timm's init: near-uniform attention, blind checks)
    m = vitrel.create_model(name, pos=pos, attn_impl=impl, **kw)
    m.load_state_dict(ref.state_dict())
    if arch == "vit":  # (each block its own scheme: pos_share off)
        states = m.position_states(vitrel.Grid(8, 8), torch.zeros(1))
        assert states[0].block_mask is states[1].block_mask and states[0].block_mask.dtype == torch.int32
    x = torch.randn(1 if arch == "vit" else 2, 3, kw["img_size"], kw["img_size"])  # (ViT: one image, the blocks'
    # shared flags need no batch)
    y_ref, y = ref(x), m(x)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-4)
    params = [(n, p, q) for (n, p), q in zip(ref.named_parameters(), m.parameters()) if p.requires_grad]
    gr = torch.autograd.grad(y_ref.square().sum(), [p for _, p, _ in params])
    g = torch.autograd.grad(y.square().sum(), [q for _, _, q in params])
    for (n, _, _), a, b in zip(params, g, gr):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=n)


@interpreted
@pytest.mark.parametrize("shift", [True, False])
def test_swin_windows(shift):
    """A Swin (windows of 4 x 4, shifted or not) with ``attn_impl="triton"`` equals its ``sdpa`` twin."""
    kw = dict(img_size=16, embed_dim=32, depths=(2,), num_heads=(2,), window_size=4, num_classes=3)
    torch.manual_seed(0)
    ref = vitrel.create_model("vitrel_swin_tiny_patch2_window4_32", pos="rel2d_full", **kw)
    m = vitrel.create_model("vitrel_swin_tiny_patch2_window4_32", pos="rel2d_full", attn_impl="triton", **kw)
    m.load_state_dict(ref.state_dict())
    if not shift:
        for mod in (ref, m):
            for blk in mod.modules():
                if hasattr(blk, "shift_size"):
                    blk.shift_size = 0
    x = torch.randn(2, 3, 16, 16)
    y_ref, y = ref(x), m(x)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-4)
    gr = torch.autograd.grad(y_ref.square().sum(), [p for n, p in ref.named_parameters() if "table" in n])
    g = torch.autograd.grad(y.square().sum(), [p for n, p in m.named_parameters() if "table" in n])
    for a, b in zip(g, gr):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@interpreted
def test_vit_model_and_compile():
    """``create_model(..., attn_impl="triton")`` equals sdpa; ``torch.compile`` captures the custom op whole
    (``fullgraph=True``), forward and backward."""
    kw = dict(img_size=16, embed_dim=32, depth=2, num_heads=2, num_classes=3)
    torch.manual_seed(0)
    ref = vitrel.create_model("vitrel_vit_tiny_patch4_32", pos="rel2d_factored", **kw)
    m = vitrel.create_model("vitrel_vit_tiny_patch4_32", pos="rel2d_factored", attn_impl="triton", **kw)
    m.load_state_dict(ref.state_dict())
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(m(x), ref(x), atol=1e-5, rtol=1e-4)
    c = torch.compile(m, fullgraph=True)
    y = c(x)
    torch.testing.assert_close(y, ref(x), atol=1e-5, rtol=1e-4)
    y.sum().backward()
    assert all(p.grad is not None for p in m.parameters() if p.requires_grad)


@interpreted
@pytest.mark.parametrize("pos", ["rel2d_full", "lookhere"])
def test_torch_export_and_onnx_refusal(pos, tmp_path, monkeypatch):
    """``torch.export`` keeps the custom op as one node (``torch.ops.vitrel.rel_bias_attention``) and the program
    computes the model's function, with dynamic sizes at every size (the grid a SymInt of the op's; neither the
    table's rows nor LookHere's skipped tiles pinned to the example's size), and on CPU without the interpreter says
    so as an eager call does; ONNX, which has no such operator, is refused with the way out."""
    from vitrel.export import export_onnx, export_program

    kw = dict(img_size=16, embed_dim=32, depth=1, num_heads=2, num_classes=3)
    m = vitrel.create_model("vitrel_vit_tiny_patch4_32", pos=pos, attn_impl="triton", **kw).eval()
    x = torch.randn(2, 3, 16, 16)
    ep = export_program(m, x, dynamic="hw")
    assert "vitrel.rel_bias_attention" in str(ep.graph)
    for y in (x, torch.randn(1, 3, 24, 32)):
        torch.testing.assert_close(ep.module()(y), m(y), atol=1e-5, rtol=1e-5)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # (the program on CPU without the interpreter: vitrel's error)
    with pytest.raises(ValueError, match="set TRITON_INTERPRET=1"):
        ep.module()(x)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="attn_impl='sdpa'"):
        export_onnx(m, tmp_path / "m.onnx", x, dynamic="static")


@interpreted
def test_clear_errors(monkeypatch):
    """On CPU without the interpreter, dropout, a scheme with no table, bfloat16 in the interpreter: one clear error
    each."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        fused.check_device(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    a = Attention(32, 2, pos="rel2d_full", grid=(3, 3), attn_impl="triton").train()
    a.attn_drop = 0.1  # (set on a built layer: the forward's own check; at build, tests/kernels/test_registry.py)
    with pytest.raises(ValueError, match="no attention dropout"):
        a(torch.randn(1, 9, 32), grid=(3, 3))
    with pytest.raises(ValueError, match="shaw2d_full has no offset table to read"):
        Attention(32, 2, pos="shaw2d_full", grid=(3, 3), attn_impl="triton")(torch.randn(1, 9, 32), grid=(3, 3))
    q = torch.randn(1, 2, 9, 16, dtype=torch.bfloat16)  # (the interpreter's bf16 products are wrong)
    with pytest.raises(ValueError, match="products of bfloat16 tensors are wrong"):
        rel_bias_attention(q, q, q, torch.zeros(2, 5, 5), (3, 3))


#: bench/, where the ahead-of-time compiler's tools are (``triton_aot.py``)
BENCH = Path(__file__).resolve().parents[2] / "bench"


#: the snippets compiled for sm_90 (each prints one line: what its test reads), run in one process (``hopper``)
HOPPER: dict[str, str] = {}

#: runs HOPPER's snippets (JSON on stdin), each with its own globals and stdout; prints ``{name: {"line" | "error"}}``
_RUNNER = r"""
import contextlib, io, json, sys, traceback
snippets, out = json.loads(sys.stdin.read()), {}
for name, code in snippets.items():
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            exec(compile(code, name, "exec"), {"__name__": name})
        out[name] = {"line": buf.getvalue().strip().splitlines()[-1]}
    except Exception:
        out[name] = {"error": traceback.format_exc()}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def hopper() -> dict[str, dict[str, str]]:
    """Every :data:`HOPPER` snippet's result, run in one fresh process with the interpreter off (the kernels must be
    JIT functions; one process, not one a test: starting one takes ~6 s of the suite)."""
    import json
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join([str(BENCH), *sys.path])}
    out = subprocess.run([sys.executable, "-c", _RUNNER], input=json.dumps(HOPPER), capture_output=True, text=True,
                         env=env, timeout=900)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _compiled_for_hopper(hopper: dict[str, dict[str, str]], name: str) -> str:
    """The last line snippet ``name`` printed; skips where Triton has no CUDA backend."""
    result = hopper[name]
    error = result.get("error", "")
    if error and "backend" in error.lower() and "cuda" not in error.lower():
        pytest.skip("Triton has no CUDA backend here")
    assert not error, error[-3000:]
    return result["line"]


HOPPER["kernels"] = (
    "import json; from triton_aot import compile_bias_kernels as compile_for; "
    "print(json.dumps({f'{k}{v}': s for v in ('', '_layout', '_regions', '_atomic') for k, s in compile_for(90, "
    "64, layout=v == '_layout', regions=v == '_regions', deterministic=v != '_atomic').items()}))"
)


def test_kernels_compile_for_hopper(hopper):
    """The kernels (full grid, token layout, windows' regions, ``dq`` by atomics; the bias tiles' gradient where they
    are read) compile ahead of time for an H100 / H200 (sm_90) with the launch configuration used there, in bf16,
    within its shared memory (232,448 bytes): what the interpreter cannot check."""
    import json

    shared = json.loads(_compiled_for_hopper(hopper, "kernels"))
    names = {f"{k}{v}" for k in ("fwd", "delta", "dkdv", "dq") for v in ("", "_layout")}
    names |= {"dbias", "fwd_atomic", "delta_atomic", "dkdv_atomic", "dbias_atomic"}  # (no dq kernel)
    names |= {"fwd_regions", "tile_regions"}  # (windows of 49 tokens: the one-tile backward)
    assert set(shared) == names and all(0 < v <= 232448 for v in shared.values()), shared


_SPECIALIZED = r"""
import json, re, torch
import triton_aot as aot
from vitrel.kernels import triton as tb

q = torch.zeros(2, 2, 65, 64, dtype=torch.bfloat16)
c = aot.compile_launch(tb.plan(q, q, q, torch.zeros(2, 15, 15), (8, 8), 1)["fwd"])
ir, ptx = c.asm["ttir"], c.asm["ptx"]
attrs = [re.search("%" + re.escape(a) + r": [^{\n]*?(\{[^}]*\})?\s*loc", ir) for a in ("Q", "sq.2", "N", "n_mask_b")]
wide = re.search(r"ld\.global(\.\w+)*\.v4\.b32|cp\.async[^;]*, 16;", ptx) is not None
print(json.dumps([m.group(1) if m else "constant" for m in attrs] + [wide]))
"""
HOPPER["specialized"] = _SPECIALIZED


def test_compile_launch_specializes_like_the_jit(hopper):
    """``compile_launch`` compiles a call's launch as Triton's JIT does: addresses and integers divisible by 16 declared
    so (``tt.divisibility``: the head dim's stride, 64), others not (65 tokens), integers equal to 1 constants (one
    mask row); so the key and value rows load 16 bytes at a time, as on a GPU (without the declarations: 2)."""
    import json

    q_attr, stride_attr, n_attr, mask_rows, wide = json.loads(_compiled_for_hopper(hopper, "specialized"))
    assert "tt.divisibility = 16" in q_attr and "tt.divisibility = 16" in stride_attr
    assert n_attr is None and mask_rows == "constant" and wide


HOPPER["dkdv"] = (
    "import re, torch, triton_aot as aot; from dataclasses import replace; "
    "from vitrel.kernels import triton as tb; "
    "q = torch.randn(2, 2, 65, 64).bfloat16(); t = torch.randn(2, 15, 15); "
    "wide = replace(tb.cuda_config(64), dkdv_tile=(64, 128), wide=tb.Warps(8, 2)); "
    "irs = [aot.compile_launch(tb.plan(q, q, q, t, (8, 8), 1, bias_read='tiles', **kw)['dkdv']).asm['ttgir'] "
    "for kw in ({}, {'config': wide})]; "
    "print(*(f\"{len(re.findall(r'tt.trans .*: tensor<[^>]*#mma> ->', ir))},{ir.count('ttg.memdesc_trans ')},"
    "{ir.count('warp_group_dot ')}\" for ir in irs))"
)


def test_dkdv_products_take_registers_as_they_stand(hopper):
    """The ``dkdv`` kernel computes its tiles transposed (keys by queries, as Triton's tutorial), so ``p^T`` and
    ``dS^T``, the left operands of the ``dv`` and ``dk`` products, are used as they stand in registers: compiled for
    sm_90, its code holds no transpose of a register tensor (each went through shared memory: a store, a barrier and
    a load a tile), only transposed views of the tiles in shared memory (``q``, ``do^T``); the square tile and the
    wide one (64 x 128, head dim 128's ``dkdv_tile``)."""
    for counts in _compiled_for_hopper(hopper, "dkdv").split():
        products_transposed, view_transposes, products = map(int, counts.split(","))
        assert products_transposed == 0 and view_transposes >= 2 and products == 4, counts


HOPPER["serialized"] = (
    "import json, torch, vitrel.layout.geometry, triton_aot as aot; from vitrel.kernels import triton as tb; "
    "q = torch.randn(2, 6, 4097, 64).bfloat16(); t = torch.randn(6, 127, 127); "
    "w = torch.randn(4, 3, 49, 32).bfloat16(); r = torch.arange(49).remainder(3).expand(2, 49); "
    "b = t.clone(); b[:, :48] = b[:, 80:] = float('-inf'); "
    "blk = tb.visible_tiles(b, vitrel.layout.geometry.Grid(64, 64), 1); "
    "calls = dict(tiles=tb.plan(q, q, q, t, (64, 64), 1), none=tb.plan(q, q, q, None, (64, 64), 1), "
    "atomic=tb.plan(q, q, q, t, (64, 64), 1, deterministic=False), "
    "flags=tb.plan(q, q, q, b, (64, 64), 1, blocks=blk), "
    "regions=tb.plan(w, w, w, torch.randn(3, 13, 13), (7, 7), regions=r), "
    "d128=tb.plan(*(torch.randn(1, 3, 4097, 128).bfloat16(),) * 3, t[:3], (64, 64), 1)); "
    "print(json.dumps({f'{c}/{k}': aot.serialized_products(aot.compile_launch(x)) "
    "for c, ls in calls.items() for k, x in ls.items()}))"
)


def test_tensor_core_products_not_serialized_on_hopper(hopper):
    """Compiled for sm_90 as the JIT compiles them, no kernel of the layer's calls has its tensor-core products
    serialized by ptxas (its note C7515: each product waiting for the one before, where they overlap the softmax):
    the table read as bias tiles (what a full grid takes), no table, ``dq`` by atomics, a table with ``-inf`` entries
    and its visible-tile flags (LookHere's), Swin's windows with their region ids, head dim 128's wide tiles. What it
    caught: the ``dkdv`` kernel's transposes of ``p`` and ``dS`` (before its tiles were transposed), and with
    half-precision bias tiles the forward's loop without ``tl.assume(last > first)`` (its zero-trip path placed
    between a product and its wait; with visible-tile flags too), under the Triton of the H100 pass (3.6) and this
    one."""
    import json

    serialized = json.loads(_compiled_for_hopper(hopper, "serialized"))
    assert len(serialized) == 25 and not any(serialized.values()), serialized
    assert "regions/tile" in serialized  # (the windows' backward: one kernel)


HOPPER["dq"] = (
    "import json, torch, triton_aot as aot; from vitrel.kernels import triton as tb; "
    "q = torch.zeros(2, 12, 197, 64, dtype=torch.bfloat16); "
    "ls = tb.plan(q, q, q, torch.zeros(12, 27, 27), (14, 14), 1, bias_read='tiles'); "
    "c = aot.compile_launch(ls['dq']); "
    "sums = ls['dq'].args['TABLE_GRAD'] == 2; "
    "print(json.dumps([sorted(ls), sums, c.metadata.shared, aot.serialized_products(c)]))"
)


def test_table_grad_in_dq_compiles_for_hopper(hopper):
    """Compiled for sm_90 as the JIT compiles it (ViT-B/16's call: 197 tokens, a class token, 12 heads of 64, bias
    tiles), the ``dq`` kernel that sums the bias tiles' gradient keeps its products
    unserialized, within the shared memory, and the call plans no ``dbias`` launch."""
    import json

    names, tile_grad, shared, serialized = json.loads(_compiled_for_hopper(hopper, "dq"))
    assert names == ["delta", "dkdv", "dq", "fwd"] and tile_grad and 0 < shared <= 232448 and not serialized


def test_launch_configuration_is_one_frozen_object_per_device():
    """The launch configuration is a frozen :class:`~vitrel.kernels.triton.config.KernelConfig`, chosen by head dim
    on CUDA (64: 3 stages; 128: 64 x 32 forward tiles and its own backward tiles) and the interpreter's 16-token
    tiles on CPU; one that the kernels cannot take is refused as it is made; the package's names are its modules'
    objects (the old import paths: tests/layout/test_import_layers.py)."""
    import dataclasses

    from vitrel.kernels.triton import KernelConfig, attend, default_config, rope

    assert cuda_config(64).fwd.options() == {"num_warps": 4, "num_stages": 3} and cuda_config(64).dq_tile is None
    assert (cuda_config(128).fwd_tile, cuda_config(128).bwd_tile, cuda_config(128).dq_tile) == ((64, 32), 32, (128, 64))
    assert cuda_config(16) == cuda_config(32) == KernelConfig()
    assert default_config(torch.zeros(1, 1, 4, 64)) is INTERPRETER
    with pytest.raises(dataclasses.FrozenInstanceError):
        INTERPRETER.bwd_tile = 64
    with pytest.raises(ValueError, match="powers of two"):
        KernelConfig(fwd_tile=(64, 48))
    with pytest.raises(ValueError, match="at most the backward's tile"):
        KernelConfig(bwd_tile=32)
    with pytest.raises(ValueError, match="head dims up to 128"):
        cuda_config(256)
    assert fused.rel_bias_attention is rel_bias_attention is vitrel.kernels.triton.rel_bias_attention
    assert attend.TritonAtomicKernel is vitrel.kernels.get_kernel("triton_atomic")
    assert rope.rope_rotate is vitrel.kernels.triton.rope_rotate


@pytest.mark.parametrize("impl", ["triton", "triton_atomic"])
def test_a_flop_count_without_autograd_runs_at_the_built_grid(impl):
    """Lightning's model summary counts FLOPs in a forward under ``no_grad`` (``FlopCounterMode``, whose module hooks
    assert every tensor input needing grad has a ``grad_fn``): ``train.py pos=rel2d_full +model.attn_impl=triton``
    stopped there on torch's ``Expected gradient function to be set`` (an audit's), since at the built grid the offset
    table handed to the blocks was a view of the parameter made without autograd. It runs, as sdpa computes."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    kw = dict(depth=1, pos="rel2d_full", img_size=8, num_classes=3)
    m = vitrel.create_model("vitrel_vit_tiny_patch4_32", attn_impl=impl, **kw).eval()
    ref = vitrel.create_model("vitrel_vit_tiny_patch4_32", attn_impl="sdpa", **kw).eval()
    ref.load_state_dict(lively(m).state_dict())
    x = torch.randn(1, 3, 8, 8)
    with torch.no_grad(), FlopCounterMode(display=False) as count:
        out = m(x)
    assert count.get_total_flops() > 0
    torch.testing.assert_close(out, ref(x).detach(), atol=1e-5, rtol=1e-5)
