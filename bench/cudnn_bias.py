"""cuDNN's fused attention with a learned relative bias and its gradient (dBias), measured (issue 58).

    python bench/cudnn_bias.py --out bench/results/cudnn_bias_h200.md   # on a Hopper GPU: every section
    python bench/cudnn_bias.py --small --out /tmp/cudnn_bias.md         # N = 196 only, fewer rounds
    python bench/cudnn_bias.py --sizes 1024 4096 --check-sizes 196      # chosen sizes (square grids)
    bash bench/gpu_session.sh cudnn "$OUT"                              # on a lent GPU machine (wheels: gpu_wheels.sh)
    python bench/cudnn_bias.py --device cpu --sizes 16 --check-sizes 16 --tokens 32   # the code path on a CPU

Needs CUDA (without it: a one-line error; ``--device cpu`` runs the code, no figures). The frontend rows need
NVIDIA's ``cudnn-frontend`` Python package (``import cudnn``, the wheel ``nvidia-cudnn-frontend==1.32.0`` in
``.whl/``); without it they are rows naming the import error. The graphs are built as NVIDIA's own test builds them
(NVIDIA/cudnn-frontend ``test/python/test_mhas.py``, ``test_sdpa_backward``, v1.23.0, commit 3929da2), the calls'
signatures checked in the 1.32.0 wheel: a ``pygraph`` with bf16 I/O and fp32 compute, ``sdpa(...,
generate_stats=True, bias=...)`` and ``sdpa_backward(..., bias=..., dBias=..., use_deterministic_algorithm=...)``,
each graph built once per shape, then executed on torch's stream with a workspace from torch's allocator.

bf16, ``--heads`` 6 x ``--head-dim`` 64, ``--tokens`` 65,536 per batch (batch = tokens // N), forward + backward:

1. **Check** (small sizes, ``--check-sizes``): the frontend's output, dq / dk / dv and dBias, and the table's gradient
   (dBias summed into the table), each against an fp32 PyTorch reference (explicit ``softmax(q k^T scale + bias) v``
   with autograd); SDPA's cuDNN backend with the bias (no grad) too.
2. **Time** per N: plain SDPA (no mask; default backends, then cuDNN and flash forced); SDPA with a ``[1, H, N, N]``
   bf16 bias that needs no grad (default backends, and under ``sdpa_kernel(CUDNN_ATTENTION)``: a refusal is a row)
   and with one that does (vitrel's ``sdpa`` path today); the frontend's graphs without bias, with bias, with bias and
   dBias (deterministic off and on), and the whole path a kernel would take (the table gathered into the bias, the
   graphs, dBias summed back into the table). Each row: the kernels the profiler names, median ms of ``--rounds``
   rounds of ``--repeat`` calls between two CUDA events (after ``--warmup`` calls), peak memory above the inputs
   (``max_memory_allocated`` after a reset: torch's allocator only, the frontend's workspaces included), whether
   outputs are finite and repeat bitwise.
3. **Table** per N: the gather of ``T[H, 2Hg-1, 2Wg-1]`` into the ``[1, H, N, N]`` bias (``T[h, dh + Hg - 1,
   dw + Wg - 1]``, dh = query row - key row) and the sum of dBias back into the table two ways: ``index_add_``
   (atomics on CUDA: order not fixed) and :func:`scatter_diagonal` (plain sums over diagonals: deterministic).
4. **Verdict**: the path with dBias within 1.25x plain SDPA at N = 4096 and 1.4x at 1024 (issue 58), or not.

Each table is written to ``--out`` as soon as it is measured; a failing row is a row with its error; no row starts
after ``--budget`` seconds (default 400; the whole run has not been timed on a GPU yet).
"""

from __future__ import annotations

import argparse
import gc
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GOALS = {4096: 1.25, 1024: 1.4}  # issue 58: the dBias path's time / plain SDPA's, at most


# ------------------------------------------------------------------------------------------- CPU-testable pieces
def grid_of(n: int) -> tuple[int, int]:
    side = math.isqrt(n)
    if side * side != n:
        raise SystemExit(f"bench/cudnn_bias.py: sizes must be square numbers (a square grid), got {n}")
    return side, side


def rel_index(grid: tuple[int, int], device: torch.device | str | None = None) -> torch.Tensor:
    """``[N * N]`` long index into a flattened ``[2Hg-1, 2Wg-1]`` table: query ``i`` (row ``ih``, column ``iw``),
    key ``j``: ``(ih - jh + Hg - 1) * (2Wg - 1) + (iw - jw + Wg - 1)``, row-major over ``(i, j)``."""
    hg, wg = grid
    ih = torch.arange(hg, device=device).repeat_interleave(wg)  # [N]: token t = ih * wg + iw
    iw = torch.arange(wg, device=device).repeat(hg)
    dh = ih[:, None] - ih[None, :] + hg - 1
    dw = iw[:, None] - iw[None, :] + wg - 1
    return (dh * (2 * wg - 1) + dw).reshape(-1)


def gather_bias(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``[H, 2Hg-1, 2Wg-1]`` table -> ``[1, H, N, N]`` bias (``index``: :func:`rel_index`), in the table's dtype."""
    n = math.isqrt(index.numel())
    return table.flatten(1).index_select(1, index).view(1, table.shape[0], n, n)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The sums' dtype: fp32 for bf16 / fp16 / fp32 gradients, fp64 for fp64 (the tests)."""
    return torch.promote_types(dtype, torch.float32)


def scatter_index_add(dbias: torch.Tensor, index: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """``[1, H, N, N]`` dBias -> ``[H, 2Hg-1, 2Wg-1]`` table gradient by ``index_add_`` (on CUDA: atomics, the order
    of the additions not fixed, so the low bits may differ run to run)."""
    hg, wg = grid
    h = dbias.shape[1]
    out = torch.zeros(h, (2 * hg - 1) * (2 * wg - 1), device=dbias.device, dtype=acc_dtype(dbias.dtype))
    out.index_add_(1, index, dbias.reshape(h, -1).to(out.dtype))
    return out.view(h, 2 * hg - 1, 2 * wg - 1)


def diagonal_sums(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x[..., i, j]`` (square, n) -> ``out[..., c] = sum_i x[..., i, c - i]``, ``c`` in ``0 .. 2n-2``, summed in
    ``dtype``: each row padded with n zeros and the rows read back 2n-1 wide, which shifts row i right by i; then a
    plain sum (a fixed order: deterministic)."""
    n = x.shape[-1]
    p = F.pad(x, (0, n)).flatten(-2)[..., : n * (2 * n - 1)]
    return p.unflatten(-1, (n, 2 * n - 1)).sum(-2, dtype=dtype)


def scatter_diagonal(dbias: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """:func:`scatter_index_add`'s result by sums over diagonals, without atomics: the key axes reversed make the
    offset ``i - j + n - 1`` a diagonal ``i + (n - 1 - j)``; the rows' pair first, then the columns'. dBias is read in
    its own dtype (one reversed copy, one padded) and summed in fp32 (fp64 for fp64)."""
    hg, wg = grid
    h = dbias.shape[1]
    acc = acc_dtype(dbias.dtype)
    a = dbias.reshape(h, hg, wg, hg, wg).flip(3, 4)  # [h, ih, iw, jh', jw']
    rows = diagonal_sums(a.permute(0, 2, 4, 1, 3), acc)  # [h, iw, jw', 2hg-1]
    return diagonal_sums(rows.permute(0, 3, 1, 2), acc)  # [h, 2hg-1, 2wg-1]


def reference_attention(q, k, v, bias, scale: float) -> torch.Tensor:
    """``softmax(q k^T * scale + bias) v``, explicit, in q's dtype (the fp32 reference; fp64 in the tests)."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias
    return torch.matmul(s.softmax(-1), v)


# ------------------------------------------------------------------------------------------- GPU measurement helpers
def short(err: BaseException, width: int = 140) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return f"{type(err).__name__}: {text}"[:width].replace("|", "/")


def time_ms(fn: Callable, warmup: int, rounds: int, repeat: int, dev: torch.device) -> float:
    """Median ms per call: ``rounds`` rounds of ``repeat`` calls between two CUDA events (on a CPU: the clock), after
    ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    if dev.type != "cuda":
        from vitrel.bench import alternate

        return 1e3 * statistics.median(alternate({"fn": fn}, rounds, warmup=0, repeat=repeat)["fn"])
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(repeat):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / repeat)
    return statistics.median(times)


def peak_mb(fn: Callable, dev: torch.device) -> float:
    """MiB allocated at the peak of one call above what was allocated before it (torch's allocator; on a CPU the
    profiler's record of allocations, ``vitrel.bench.cpu_peak_bytes``)."""
    if dev.type != "cuda":
        from vitrel.bench import cpu_peak_bytes

        return cpu_peak_bytes(fn) / 2**20
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    del out
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def kernel_kinds(fn: Callable, dev: torch.device) -> str:
    """The attention kernels one call runs (``torch.profiler``; on a CPU its operators): their kind (cudnn / flash /
    efficient) and names."""
    from vitrel.bench import profiled_kernel_times

    fn()
    rows = profiled_kernel_times(fn, dev, 1)
    kinds, names = [], []
    for name, (ms, _) in sorted(rows.items(), key=lambda kv: -kv[1][0]):
        low = name.lower()
        if "cudnn" in low or "fort_native" in low:
            kind = "cudnn"
        elif "flash" in low:
            kind = "flash"
        elif "fmha" in low or "cutlass" in low or "efficient" in low or "mem_eff" in low:
            kind = "efficient"
        elif "attention" in low or "sdpa" in low or "softmax" in low:
            kind = "other attention"
        else:
            continue
        if kind not in kinds:
            kinds.append(kind)
        if len(names) < 3:
            names.append(f"`{name[:60]}` {ms:.2f} ms")
    return f"{'+'.join(kinds) or 'none found'}: {'; '.join(names)}".replace("|", "/")


# ------------------------------------------------------------------------------------------- the frontend's graphs
class Frontend:
    """cudnn-frontend's graphs as ``test_mhas.py`` builds them: one handle on torch's current stream, a ``pygraph``
    per graph (bf16 I/O, fp32 intermediates and compute), validated, planned (heuristics A then FALLBACK), built."""

    def __init__(self, handle=True, sm_version: int | None = None) -> None:
        import cudnn

        self.cudnn = cudnn
        self.handle = None
        if handle:
            self.handle = cudnn.create_handle()
            cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
        if sm_version is None:
            major, minor = torch.cuda.get_device_capability()
            sm_version = 10 * major + minor
        self.sm_version = sm_version

    def versions(self) -> str:
        c = self.cudnn
        return f"cudnn-frontend {c.__version__}, its cuDNN {c.backend_version_string()}"

    def _graph(self):
        c = self.cudnn
        return c.pygraph(
            io_data_type=c.data_type.BFLOAT16,
            intermediate_data_type=c.data_type.FLOAT,
            compute_data_type=c.data_type.FLOAT,
            handle=self.handle,
            sm_version=self.sm_version,
        )

    def _finish(self, g, plans: bool) -> None:
        g.validate()
        g.build_operation_graph()
        if plans:
            g.create_execution_plans([self.cudnn.heur_mode.A, self.cudnn.heur_mode.FALLBACK])
            g.check_support()
            g.build_plans()

    def forward(self, q, k, v, bias, scale: float, plans: bool = True):
        """The forward graph and its ports (``q k v bias o stats``; bias None: none): tensors shaped as the
        templates given (o like q, stats ``[B, H, N, 1]`` fp32)."""
        g = self._graph()
        ports = {"q": g.tensor_like(q), "k": g.tensor_like(k), "v": g.tensor_like(v)}
        if bias is not None:
            ports["bias"] = g.tensor_like(bias)
        o, stats = g.sdpa(
            name="sdpa",
            q=ports["q"],
            k=ports["k"],
            v=ports["v"],
            generate_stats=True,
            attn_scale=scale,
            bias=ports.get("bias"),
        )
        o.set_output(True).set_dim(list(q.shape)).set_stride(list(q.stride()))
        stats.set_output(True).set_data_type(self.cudnn.data_type.FLOAT)
        ports.update(o=o, stats=stats)
        self._finish(g, plans)
        return g, ports

    def backward(self, q, k, v, bias, dbias, scale: float, deterministic: bool, plans: bool = True):
        """The backward graph and its ports (``q k v o dO stats [bias] [dBias] dq dk dv``); dbias (a ``[1, H, N, N]``
        template) asks for the bias's gradient."""
        g = self._graph()
        ports = {name: g.tensor_like(t) for name, t in (("q", q), ("k", k), ("v", v), ("o", q), ("dO", q))}
        b, h, n, _ = q.shape
        ports["stats"] = g.tensor_like(torch.empty(b, h, n, 1, dtype=torch.float32, device=q.device))
        if bias is not None:
            ports["bias"] = g.tensor_like(bias)
        if dbias is not None:
            ports["dBias"] = g.tensor_like(dbias).set_stride([h * n * n, n * n, n, 1])
        dq, dk, dv = g.sdpa_backward(
            name="sdpa_backward",
            q=ports["q"],
            k=ports["k"],
            v=ports["v"],
            o=ports["o"],
            dO=ports["dO"],
            stats=ports["stats"],
            attn_scale=scale,
            bias=ports.get("bias"),
            dBias=ports.get("dBias"),
            use_deterministic_algorithm=deterministic,
        )
        for port, t in ((dq, q), (dk, k), (dv, v)):
            port.set_output(True).set_dim(list(t.shape)).set_stride(list(t.stride()))
        ports.update(dq=dq, dk=dk, dv=dv)
        self._finish(g, plans)
        return g, ports

    def execute(self, graph, ports: dict, tensors: dict) -> None:
        ws = torch.empty(graph.get_workspace_size(), device=tensors["q"].device, dtype=torch.uint8)
        graph.execute({ports[k]: t for k, t in tensors.items()}, ws, handle=self.handle)


def frontend_call(fe: Frontend, fwd, bwd, q, k, v, do, bias, want_dbias: bool) -> Callable:
    """One forward + backward through the built graphs, its outputs allocated per call (as a kernel would):
    returns ``(o, dq, dk, dv[, dBias])``."""
    b, h, n, _ = q.shape

    def call():
        o = torch.empty_like(q)
        stats = torch.empty(b, h, n, 1, device=q.device, dtype=torch.float32)
        ins = dict(q=q, k=k, v=v, **({"bias": bias} if bias is not None else {}))
        fe.execute(*fwd, {**ins, "o": o, "stats": stats})
        grads = dict(dq=torch.empty_like(q), dk=torch.empty_like(k), dv=torch.empty_like(v))
        if want_dbias:
            grads["dBias"] = torch.empty(1, h, n, n, device=q.device, dtype=q.dtype)
        fe.execute(*bwd, {**ins, "o": o, "dO": do, "stats": stats, **grads})
        return (o, *grads.values())

    return call


def sdpa_call(q, k, v, do, bias=None, backend=None, bias_grad: bool = False) -> Callable:
    """SDPA forward + backward of q, k, v (and of the bias where ``bias_grad``) under ``sdpa_kernel(backend)`` where
    given."""
    from torch.nn.attention import sdpa_kernel

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    if bias_grad:
        bias = bias.detach().requires_grad_()

    def run():
        o = F.scaled_dot_product_attention(*leaves, attn_mask=bias)
        return (o, *torch.autograd.grad(o, [*leaves, *([bias] if bias_grad else [])], do))

    def call():
        if backend is None:
            return run()
        with sdpa_kernel([backend]):
            return run()

    return call


# ------------------------------------------------------------------------------------------- sections
class Report:
    def __init__(self, out: str | None, budget: float) -> None:
        self.out, self.budget, self.t0 = out, budget, time.monotonic()
        self.lines: list[str] = []

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def over(self) -> bool:
        return self.elapsed() > self.budget

    def progress(self, msg: str) -> None:
        print(f"[cudnn_bias {self.elapsed():5.0f} s] {msg}", file=sys.stderr, flush=True)

    def add(self, lines: list[str]) -> None:
        self.lines += lines
        print("\n".join(lines), flush=True)
        if self.out:
            Path(self.out).parent.mkdir(parents=True, exist_ok=True)
            Path(self.out).write_text("\n".join(self.lines) + "\n")


def free(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def max_err(x: torch.Tensor, ref: torch.Tensor) -> str:
    return f"{(x.float() - ref.float()).abs().max().item():.3g} / {ref.float().abs().max().item():.3g}"


def check(rep: Report, fe, fe_err: str | None, b: int, n: int, heads: int, d: int, dev: torch.device) -> None:
    """Outputs and gradients of the frontend's graphs (and SDPA's cuDNN backend) against the fp32 reference."""
    from torch.nn.attention import SDPBackend

    grid = grid_of(n)
    scale = d**-0.5
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v, do = (torch.randn(b, heads, n, d, generator=g).to(dev, torch.bfloat16) for _ in range(4))
    table = (0.5 * torch.randn(heads, 2 * grid[0] - 1, 2 * grid[1] - 1, generator=g)).to(dev, torch.bfloat16)
    index = rel_index(grid, dev)
    bias = gather_bias(table, index)
    leaves = [t.float().requires_grad_() for t in (q, k, v, table)]
    o_ref = reference_attention(*leaves[:3], gather_bias(leaves[3], index), scale)
    o_ref.backward(do.float())
    bias_leaf = bias.float().requires_grad_()
    (dbias_ref,) = torch.autograd.grad(
        reference_attention(*(t.detach() for t in leaves[:3]), bias_leaf, scale), bias_leaf, do.float()
    )
    refs = [o_ref, *(t.grad for t in leaves[:3]), dbias_ref, leaves[3].grad]

    def row(name: str, outs: list[torch.Tensor] | None, err: str = "") -> None:
        if outs is None:
            rep.add([f"| {b} | {n} | {name} | - | - | - | - | - | - | - | {err} |"])
            return
        cells = [max_err(x, r) if x is not None else "-" for x, r in zip(outs, refs)]
        finite = all(bool(torch.isfinite(x).all()) for x in outs if x is not None)
        close = all(  # cudnn-frontend's own test tolerance for bf16 (atol 7e-2, rtol 2e-2)
            torch.allclose(x.float(), r.float(), atol=7e-2, rtol=2e-2) for x, r in zip(outs[:5], refs) if x is not None
        )
        rep.add(
            [
                f"| {b} | {n} | {name} | {' | '.join(cells)} | {'yes' if finite else '**NO**'} | "
                f"{'yes' if close else '**no**'} |"
            ]
        )

    try:
        outs = sdpa_call(q, k, v, do, bias, SDPBackend.CUDNN_ATTENTION)()
        row("SDPA + bias [CUDNN_ATTENTION] (bias no grad)", [*outs, None, None])
    except Exception as e:  # a refusal is a finding
        row("SDPA + bias [CUDNN_ATTENTION] (bias no grad)", None, short(e))
    fwd = None
    for det in (False, True):
        name = f"frontend bias + dBias, deterministic {'on' if det else 'off'}"
        if fe is None:
            row(name, None, fe_err or "no frontend")
            continue
        try:
            fwd = fwd or fe.forward(q, k, v, bias, scale)
            bwd = fe.backward(q, k, v, bias, bias, scale, det)
            o, dq, dk, dv, db = frontend_call(fe, fwd, bwd, q, k, v, do, bias, True)()
            row(name, [o, dq, dk, dv, db, scatter_diagonal(db, grid)])
        except Exception as e:
            row(name, None, short(e))


def gather_scatter_rows(n: int, heads: int, args, index: torch.Tensor) -> list[str]:
    """The gather of the table into the bias and the two sums of dBias back into it, timed."""
    grid = grid_of(n)
    g = torch.Generator(device="cpu").manual_seed(1)
    table = torch.randn(heads, 2 * grid[0] - 1, 2 * grid[1] - 1, generator=g).to(args.dev)
    dbias = torch.randn(1, heads, n, n, generator=g).to(args.dev, torch.bfloat16)
    ref = scatter_diagonal(dbias, grid)
    rows = []
    for name, fn in (
        (
            "gather: `table.bfloat16()` then `index_select` -> [1, H, N, N] bf16",
            lambda: gather_bias(table.bfloat16(), index),
        ),
        ("dBias -> table: `index_add_` (atomics)", lambda: scatter_index_add(dbias, index, grid)),
        ("dBias -> table: `scatter_diagonal` (deterministic)", lambda: scatter_diagonal(dbias, grid)),
    ):
        try:
            ms = time_ms(fn, args.warmup, args.rounds, args.repeat, args.dev)
            mb = peak_mb(fn, args.dev)
            a, b = fn(), fn()
            same = "yes" if torch.equal(a, b) else "no"
            diff = f"{(a - ref).abs().max().item():.3g}" if a.shape == ref.shape else "-"
            rows.append(f"| {n} | {name} | {ms:.3f} | {mb:.0f} | {same} | {diff} | |")
        except Exception as e:
            rows.append(f"| {n} | {name} | - | - | - | - | {short(e)} |")
    return rows


def time_size(rep: Report, fe, fe_err: str | None, n: int, args, results: dict) -> None:
    from torch.nn.attention import SDPBackend

    heads, d = args.heads, args.head_dim
    b = max(1, args.tokens // n)
    grid = grid_of(n)
    scale = d**-0.5
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v, do = (torch.randn(b, heads, n, d, generator=g).to(args.dev, torch.bfloat16) for _ in range(4))
    index = rel_index(grid, args.dev)
    table = (0.5 * torch.randn(heads, 2 * grid[0] - 1, 2 * grid[1] - 1, generator=g)).to(args.dev)
    bias = gather_bias(table.bfloat16(), index)
    built: dict = {}
    workspace: dict = {}  # the graphs of the row last made: their workspaces, MiB

    def graphs(with_bias: bool, dbias: bool, det: bool):
        if fe is None:
            raise RuntimeError(fe_err or "no frontend")
        key_f, key_b = ("fwd", with_bias), ("bwd", with_bias, dbias, det)
        if key_f not in built:
            built[key_f] = fe.forward(q, k, v, bias if with_bias else None, scale)
        if key_b not in built:
            built[key_b] = fe.backward(q, k, v, bias if with_bias else None, bias if dbias else None, scale, det)
        workspace["MiB"] = tuple(built[kk][0].get_workspace_size() / 2**20 for kk in (key_f, key_b))
        return built[key_f], built[key_b]

    def fe_row(with_bias, dbias, det):
        def make():
            fwd, bwd = graphs(with_bias, dbias, det)
            return frontend_call(fe, fwd, bwd, q, k, v, do, bias if with_bias else None, dbias)

        return make

    def full_path(det: bool, deterministic_sum: bool):
        def make():
            fwd, bwd = graphs(True, True, det)

            def call():
                bias_ = gather_bias(table.bfloat16(), index)
                outs = frontend_call(fe, fwd, bwd, q, k, v, do, bias_, True)()
                dbias = outs[-1]
                dt = scatter_diagonal(dbias, grid) if deterministic_sum else scatter_index_add(dbias, index, grid)
                return (*outs[:-1], dt)

            return call

        return make

    rows_spec = [
        ("SDPA, no mask (default backends)", lambda: sdpa_call(q, k, v, do), False),
        ("SDPA, no mask [CUDNN_ATTENTION]", lambda: sdpa_call(q, k, v, do, None, SDPBackend.CUDNN_ATTENTION), False),
        ("SDPA, no mask [FLASH_ATTENTION]", lambda: sdpa_call(q, k, v, do, None, SDPBackend.FLASH_ATTENTION), False),
        ("SDPA + bias (no grad), default backends", lambda: sdpa_call(q, k, v, do, bias), False),
        ("SDPA + bias with grad (vitrel's `sdpa` today)", lambda: sdpa_call(q, k, v, do, bias, bias_grad=True), False),
        (
            "SDPA + bias (no grad) [CUDNN_ATTENTION]",
            lambda: sdpa_call(q, k, v, do, bias, SDPBackend.CUDNN_ATTENTION),
            False,
        ),
        ("frontend, no bias", fe_row(False, False, False), True),
        ("frontend, bias, no dBias", fe_row(True, False, False), True),
        ("frontend, bias + dBias, deterministic off", fe_row(True, True, False), True),
        ("frontend, bias + dBias, deterministic on", fe_row(True, True, True), True),
        ("path: gather + frontend dBias (det. off) + `index_add_`", full_path(False, False), True),
        ("path: gather + frontend dBias (det. on) + `scatter_diagonal`", full_path(True, True), True),
    ]
    rep.add(
        [
            f"\n## N = {n} ({grid[0]}x{grid[1]}), batch {b}, {heads} heads x {d}, bf16, forward + backward\n",
            "| row | kernels (profiler) | ms | / SDPA | peak MiB | peak / SDPA | workspace MiB fwd / bwd | finite | "
            "repeats bitwise | note |",
            "|---|---|---:|---:|---:|---:|---:|---|---|---|",
        ]
    )
    ref_ms = ref_mb = None
    for name, make, frontend in rows_spec:
        if rep.over():
            rep.add([f"| {name} | - | - | - | - | - | - | - | - | skipped: past --budget {rep.budget:.0f} s |"])
            continue
        rep.progress(f"N={n} {name}")
        try:
            t_build = time.monotonic()
            fn = make()
            build_s = time.monotonic() - t_build
            kinds = kernel_kinds(fn, args.dev)
            ms = time_ms(fn, args.warmup, args.rounds, args.repeat, args.dev)
            mb = peak_mb(fn, args.dev)
            a = fn()
            bb = fn()
            finite = all(bool(torch.isfinite(x).all()) for x in a)
            same = all(torch.equal(x, y) for x, y in zip(a, bb))
            del a, bb
        except Exception as e:
            rep.add([f"| {name} | - | - | - | - | - | - | - | - | {short(e)} |"])
            free(args.dev)
            continue
        if ref_ms is None and name.startswith("SDPA, no mask (default"):
            ref_ms, ref_mb = ms, mb
        ws = "{:.0f} / {:.0f}".format(*workspace["MiB"]) if frontend else "-"
        note = f"graphs built in {build_s:.1f} s" if frontend and build_s > 0.05 else ""
        rx = f"{ms / ref_ms:.2f}x" if ref_ms else "-"
        rm = f"{mb / ref_mb:.2f}x" if ref_mb else "-"
        rep.add(
            [
                f"| {name} | {kinds} | {ms:.3f} | {rx} | {mb:.0f} | {rm} | {ws} | {'yes' if finite else '**NO**'} | "
                f"{'yes' if same else 'no'} | {note} |"
            ]
        )
        results[(n, name)] = ms
    results[(n, "SDPA")] = ref_ms
    built.clear()
    free(args.dev)
    if rep.over():
        return
    rep.progress(f"N={n} table gather / scatter")
    rep.add(
        [
            f"\n### N = {n}: the table [{heads}, {2 * grid[0] - 1}, {2 * grid[1] - 1}] <-> the bias "
            f"[1, {heads}, {n}, {n}]\n",
            "| N | step | ms | peak MiB | repeats bitwise | max abs diff vs `scatter_diagonal` | note |",
            "|---:|---|---:|---:|---|---:|---|",
            *gather_scatter_rows(n, heads, args, index),
        ]
    )


def verdict(results: dict) -> str:
    """Issue 58's decision from the path rows (gather + graphs + sum into the table) against plain SDPA."""
    det = "path: gather + frontend dBias (det. on) + `scatter_diagonal`"
    nondet = "path: gather + frontend dBias (det. off) + `index_add_`"
    parts, missing, ok_det, ok_any = [], [], True, True
    for n, goal in GOALS.items():
        ref = results.get((n, "SDPA"))
        r_det, r_non = results.get((n, det)), results.get((n, nondet))
        if ref is None or (r_det is None and r_non is None):
            missing.append(str(n))
            continue
        x_det = r_det / ref if r_det is not None else math.inf
        x_non = r_non / ref if r_non is not None else math.inf
        ok_det &= x_det <= goal
        ok_any &= min(x_det, x_non) <= goal
        parts.append(f"N = {n}: {x_det:.2f}x deterministic, {x_non:.2f}x not (goal <= {goal}x)")
    if missing:
        return f"**Verdict: undecided** (no path or SDPA row at N = {', '.join(missing)}). " + "; ".join(parts)
    if ok_det:
        word = '**Verdict: within the goal** (deterministic): build `attn_impl="cudnn"`'
    elif ok_any:
        word = "**Verdict: within the goal only without determinism** (cuDNN's non-deterministic backward, atomics)"
    else:
        word = "**Verdict: not within the goal**: issue 58 is a measured no"
    return f"{word}. The dBias path's time / plain SDPA's: " + "; ".join(parts) + "."


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", help="N (square grids), in this order; default 4096 1024 196")
    ap.add_argument(
        "--check-sizes", type=int, nargs="*", help="N of the check (batch 2 up to N = 256, else 1); default 196 1024"
    )
    ap.add_argument("--tokens", type=int, default=65536, help="tokens per batch: batch = tokens // N")
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--repeat", type=int, default=5, help="calls between two CUDA events (a round)")
    ap.add_argument("--budget", type=float, default=400, help="seconds: no row starts after them")
    ap.add_argument("--small", action="store_true", help="N = 196 (unless given; check and time), 3 rounds of 2")
    ap.add_argument("--out", default=None, help="write the Markdown tables here (as each is measured)")
    ap.add_argument(
        "--device", default="cuda", help="cpu: the same code path, the frontend's rows errors (the tests; no figures)"
    )
    args = ap.parse_args(argv)
    if args.small:
        args.warmup, args.rounds, args.repeat = 1, 3, 2
    args.sizes = args.sizes or ([196] if args.small else [4096, 1024, 196])
    args.check_sizes = args.check_sizes if args.check_sizes is not None else [196] if args.small else [196, 1024]
    for n in (*args.sizes, *args.check_sizes):
        grid_of(n)
    args.dev = torch.device(args.device)
    if args.dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "bench/cudnn_bias.py: needs a CUDA GPU (torch.cuda.is_available() is False); "
            'run it on the GPU machine: bash bench/gpu_session.sh cudnn "$OUT"'
        )
    from vitrel.bench import source_commit

    rep = Report(args.out, args.budget)
    fe, fe_err = None, "cudnn-frontend: CUDA only"
    try:
        if args.dev.type == "cuda":
            fe = Frontend()
            fe_versions = fe.versions()
    except Exception as e:  # the frontend's rows say why
        fe_err = f"cudnn-frontend unavailable: {short(e)}"
    if fe is None:
        fe_versions = fe_err
    if args.dev.type == "cuda":
        prop = torch.cuda.get_device_properties(args.dev)
        dev_name = f"{prop.name} (sm_{prop.major}{prop.minor}, {prop.total_memory / 2**30:.0f} GiB)"
    else:
        dev_name = f"CPU ({torch.get_num_threads()} threads: the code path, no figures)"
    clock = "CUDA events" if args.dev.type == "cuda" else "the clock"
    rep.add(
        [
            "# cuDNN fused attention with a relative bias and dBias (issue 58)\n",
            f"{dev_name}, Python "
            f"{platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}, cuDNN "
            f"{torch.backends.cudnn.version()}), {fe_versions}; vitrel {source_commit(ROOT)}.\n",
            f"Command: `python {' '.join(['bench/cudnn_bias.py', *(argv if argv is not None else sys.argv[1:])])}`. "
            f"Times: median of {args.rounds} rounds of {args.repeat} calls ({clock}) after {args.warmup}; peak: "
            "MiB above the inputs at one call's peak (torch's allocator); / SDPA: against `SDPA, no mask (default "
            "backends)` at the same N. q, k, v, dO `[B, H, N, d]` contiguous bf16, scale d^-0.5.\n",
            "## Check: errors against the fp32 reference (max abs error / max abs reference)\n",
            "| batch | N | what | o | dq | dk | dv | dBias | table grad | finite | "
            "o .. dBias within atol 7e-2, rtol 2e-2 |",
            "|---:|---:|---|---|---|---|---|---|---|---|---|",
        ]
    )
    for n in args.check_sizes:
        rep.progress(f"check N={n}")
        try:
            check(rep, fe, fe_err, 2 if n <= 256 else 1, n, args.heads, args.head_dim, args.dev)
        except Exception as e:
            rep.add([f"| - | {n} | check | - | - | - | - | - | - | - | {short(e)} |"])
    results: dict = {}
    for n in args.sizes:
        try:
            time_size(rep, fe, fe_err, n, args, results)
        except Exception as e:
            rep.add([f"\nN = {n}: {short(e, 300)}"])
        free(args.dev)
    rep.add(["", verdict(results), f"\n({rep.elapsed():.0f} s)"])
    rep.progress("done")


if __name__ == "__main__":
    main()
