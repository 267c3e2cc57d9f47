"""Launch configurations of the fused bias kernel (``attn_impl="triton"``) on one GPU: forward and forward + backward
time of ``rel_bias_attention`` for each tile shape / warps / stages, against plain SDPA in the same process.

    python bench/triton_tune.py --out bench/results/triton_tune_h200_first_kernel.md      # on a GPU (bf16)
    python bench/triton_tune.py --sides 64 --head-dims 128                   # head dim 128's rows alone
    python bench/triton_tune.py --in-dq                                      # dT in dq / dkdv, or the dbias kernel

The layer of ``bench/attention.py`` (6 heads of 64, 65,536 tokens per batch) at N = 1 + 32^2 and 1 + 64^2, and with
3 heads of 128 at the larger (``--head-dims``); medians of alternating rounds (``vitrel.bench.alternate``). Each
row gives the wall time of a call and its kernels' busy time (``vitrel.bench.busy_seconds``: the host's time out),
each against plain SDPA's: at short sequences (N = 197, Swin's windows) a call's wall time can be its host's. Each
row is a :class:`~vitrel.kernels.triton.config.KernelConfig` handed to the call; the winners go into
``vitrel/kernels/triton/config.py``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dataclasses import replace  # noqa: E402

from vitrel.bench import alternate, busy_seconds  # noqa: E402
from vitrel.kernels import triton as tb  # noqa: E402
from vitrel.kernels.triton.config import INTERPRETER, KernelConfig, Warps, cuda_config  # noqa: E402

#: (BM, BN, warps, stages, and optionally "no TMA": the key and value tiles read by address, not through tensor
#: descriptors) of the forward: the default first, then the 128-query tiles, then the others
FWD = [
    (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 4, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 2),
    (64, 128, 4, 2), (64, 128, 4, 3), (64, 128, 4, 2, "no TMA"),
]  # fmt: skip
#: (square tile, warps, stages) of the backward, the dkdv kernel's own (BM, BN, warps, stages) and the dq kernel's,
#: or None: the square tile; and optionally "square dbias" (its square tile where the configuration has its own) or
#: "wide dbias" (128 x 64 in 8 warps and 2 stages where it has none). The default first, then the wide tiles
BWD = [
    (64, 4, 3, None, None), (64, 4, 2, None, None), (64, 4, 3, (64, 128, 8, 2), (128, 64, 8, 2), "wide dbias"),
    (64, 4, 3, (64, 128, 8, 2), None), (64, 4, 3, None, (128, 64, 8, 2)), (64, 4, 3, None, None, "wide dbias"),
]  # fmt: skip
#: head dim 128 (3 heads, at the largest of --sides): its defaults first, then the others
FWD_128 = [(64, 32, 4, 2), (64, 32, 4, 3), (128, 64, 8, 2), (64, 64, 4, 2), (64, 32, 4, 2, "no TMA")]
BWD_128 = [
    (32, 4, 2, (64, 128, 8, 2), (128, 64, 8, 2)),
    (32, 4, 2, None, None),
    (32, 4, 2, (32, 128, 8, 2), (128, 64, 8, 2)),
    (32, 4, 2, (64, 128, 8, 2), (128, 64, 8, 2), "square dbias"),
]
CONFIGS = {64: (FWD, BWD), 128: (FWD_128, BWD_128)}
#: the calls of ``--in-dq`` as (grid side, prefix tokens) of the layer at head dim 64: ViT-B/16's 14 x 14 with a class
#: token (each dq tile one pattern: the dq kernel sums the table's gradient) and 32 x 32 (patterns shared: the dbias
#: kernel)
IN_DQ_CALLS = [(14, 1), (32, 0)]
#: Swin-T's first stage (8,192 windows of 7 x 7 for 128 images, 3 heads of 32, a shifted block's region ids), whose
#: backward fits one tile: the one-tile kernel's (warps, stages), its default first, the four kernels it replaces
#: (None: delta, dkdv, dq, dbias), then the others
WINDOWS = [(4, 1), None, (8, 2), (4, 2), (8, 1)]
#: the same windows' forward alone: the one-tile forward's (warps, stages), its default first, and None: a program
#: a window (the forward kernel of any call)
WINDOWS_FWD = [(4, 1), None, (4, 2), (8, 2)]


def kernel_launches(q, k, v, table, grid, prefix: int = 1, **kwargs) -> dict:
    """The launches of one call of the fused kernel, forward and backward (the table's gradient too where there is a
    table), each ready to run alone: ``vitrel.kernels.triton.plan`` on the inputs' device (a CUDA device's launch
    configuration, on any device), the forward run once first, since the backward's launches read its output and
    log-sum-exp. They read a zero output gradient: for their time, not their values."""
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.device.type == "cuda" else 132
    launches = tb.plan(q, k, v, table, grid, prefix, sms=sms, **kwargs)
    launches["fwd"]()
    return launches


def diagnose(side: int, rounds: int) -> list[str]:
    """Where the time goes at one size: the forward with and without the table, the backward with and without the
    table's gradient, causal; FlexAttention with a bf16 table compiled with 64 x 64 blocks, 2 stages; and each of the
    fused kernel's launches alone (``kernel_launches``: with the table's gradient, without a table, and with the square
    ``dkdv`` and ``dq`` tiles of a configuration with wide ones)."""
    from torch.nn.attention.flex_attention import flex_attention

    dev = torch.device("cuda")
    n = 1 + side * side
    b = max(1, 65536 // n)
    q, k, v = (torch.randn(b, 6, n, 64, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    table = torch.randn(6, 2 * side - 1, 2 * side - 1, device=dev, requires_grad=True)
    fixed = table.detach()
    go = torch.randn_like(q)
    g = (side, side)
    rows = torch.arange(n, device=dev).clamp(min=1) - 1
    r, c = rows // side, rows % side
    tb16 = table.detach().to(torch.bfloat16).requires_grad_()

    def score_mod(score, bi, h, qi, ki):
        return score + tb16[h, r[qi] - r[ki] + side - 1, c[qi] - c[ki] + side - 1]

    opts = {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 2, "BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64,
            "BLOCK_N2": 32}  # fmt: skip
    flex = torch.compile(flex_attention)

    def nograd(fn):
        def run():
            with torch.no_grad():
                fn()

        return run

    cases = {
        "plain SDPA fwd": nograd(lambda: F.scaled_dot_product_attention(q, k, v)),
        "triton fwd, table (bias tiles)": nograd(
            lambda: tb.rel_bias_attention(q, k, v, table, g, 1, bias_read="tiles")
        ),
        "triton fwd, table (gathered per score)": nograd(
            lambda: tb.rel_bias_attention(q, k, v, table, g, 1, bias_read="gather")
        ),
        "triton fwd, no table": nograd(lambda: tb.rel_bias_attention(q, k, v, None, g, 1)),
        "plain SDPA fwd+bwd": lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v), (q, k, v), go),
        "triton fwd+bwd, table + dT (bias tiles)": lambda: torch.autograd.grad(
            tb.rel_bias_attention(q, k, v, table, g, 1, bias_read="tiles"), (q, k, v, table), go
        ),
        "triton fwd+bwd, table + dT (gathered per score)": lambda: torch.autograd.grad(
            tb.rel_bias_attention(q, k, v, table, g, 1, bias_read="gather"), (q, k, v, table), go
        ),
        "triton fwd+bwd, fixed table (no dT)": lambda: torch.autograd.grad(
            tb.rel_bias_attention(q, k, v, fixed, g, 1), (q, k, v), go
        ),
        "triton fwd+bwd, no table": lambda: torch.autograd.grad(
            tb.rel_bias_attention(q, k, v, None, g, 1), (q, k, v), go
        ),
        "triton fwd+bwd, table + dT (bias tiles), dq by atomics": lambda: torch.autograd.grad(
            tb.rel_bias_attention(q, k, v, table, g, 1, bias_read="tiles", deterministic=False), (q, k, v, table), go
        ),
        "triton fwd+bwd, fixed table (no dT), dq by atomics": lambda: torch.autograd.grad(
            tb.rel_bias_attention(q, k, v, fixed, g, 1, deterministic=False), (q, k, v), go
        ),
        "triton fwd+bwd, no table, dq by atomics": lambda: torch.autograd.grad(
            tb.rel_bias_attention(q, k, v, None, g, 1, deterministic=False), (q, k, v), go
        ),
        "flex bf16 table fwd+bwd (64x64, 2 stages)": lambda: torch.autograd.grad(
            flex(q, k, v, score_mod=score_mod, kernel_options=opts), (q, k, v, tb16), go
        ),
    }
    alone = (
        ("table + dT, bias tiles", table.detach(), {"bias_read": "tiles"}), ("no table", None, {}),
        ("table + dT, bias tiles, wide dkdv and dq", table.detach(),
         {"bias_read": "tiles", "config": replace(cuda_config(64), dkdv_tile=(64, 128), dq_tile=(128, 64))}),
    )  # fmt: skip
    for label, tab, kw in alone:
        for name, launch in kernel_launches(q.detach(), k.detach(), v.detach(), tab, g, **kw).items():
            if label.endswith("wide dkdv and dq") and name not in ("dkdv", "dq"):
                continue
            cases[f"triton {name} kernel alone ({label})"] = launch
    tiles = kernel_launches(q.detach(), k.detach(), v.detach(), table.detach(), g, bias_read="tiles")
    for name in ("fwd", "dkdv", "dq"):  # (the bias tiles' reads from L2 out, their instructions kept)
        cases[f"triton {name} kernel alone, one bias tile read by every tile"] = _one_tile(tiles[name])
    fwd = tiles["fwd"]
    cases["triton fwd kernel alone, bias tiles, 4 stages"] = fwd._replace(options={**fwd.options, "num_stages": 4})
    lines = [f"\n### Where the time goes, N = {n}, batch {b}\n", "| case | ms | kernels' busy ms |", "|---|---:|---:|"]
    for name, fn in cases.items():
        try:
            t = statistics.median(alternate({"x": fn}, rounds, warmup=2, repeat=3, device=dev)["x"])
            lines.append(f"| {name} | {1e3 * t:.3f} | {1e3 * _busy(fn, dev):.3f} |")
        except Exception as e:  # noqa: BLE001 - say what failed
            lines.append(f"| {name} | failed: {str(e).splitlines()[0][:90]} | - |")
        print(lines[-1], flush=True)
    return lines


def _one_tile(launch: tb.Launch) -> tb.Launch:
    """``launch`` (the forward, ``dkdv`` or ``dq``, the bias read as tiles) reading its first tile for every tile: one
    pattern, selected by ``_pattern_index`` for every ``q0 - k0`` (``n_m`` 1, ``d_min`` ``-N``, ``g_d`` ``2^30``). It
    computes attention with that tile's bias everywhere (the table's gradient summed in ``dq`` is then not one: its
    programs add into one pattern's sums at once); its time is the kernel's with the bias tiles' reads from L2 out,
    their instructions kept."""
    a = dict(launch.args)
    a.update(BT=a["BT"][:, :1].contiguous(), patterns=(1, -a["N"], 1), g_d=1 << 30, g_m=1)  # (n_pat, d_min, n_m)
    return launch._replace(args=a)


def _busy(fn, dev) -> float | None:
    """Seconds the GPU is busy per call of ``fn`` (``vitrel.bench.busy_seconds``: its kernels' sum, the host's time
    out); None on a CPU (the interpreter's rows: their code path, not their time)."""
    return busy_seconds(fn, dev) if dev.type == "cuda" else None


def _cells(wall: float, busy: float | None, ref: tuple[float, float | None]) -> str:
    """A row's time columns: wall ms and its ratio to ``ref``'s, the kernels' busy ms and its ratio (``-`` where
    either is unknown)."""
    busy_cells = "- | -" if busy is None or ref[1] is None else f"{1e3 * busy:.3f} | {busy / ref[1]:.2f}x"
    return f"{1e3 * wall:.3f} | {wall / ref[0]:.2f}x | {busy_cells} |"


def _half(dev: torch.device) -> torch.dtype:
    """The inputs' type: bf16 on CUDA; fp16 in Triton's interpreter (the tests' CPU runs), which computes bf16 products
    wrongly (``vitrel.kernels.triton.check_device``)."""
    return torch.bfloat16 if dev.type == "cuda" else torch.float16


def _time_row(lines: list[str], args: argparse.Namespace, dev, cells: str, fn, ref, repeat: int = 3) -> None:
    """Append the row ``cells`` (its first columns) with ``fn``'s median wall time (``args.rounds`` alternating
    rounds), its kernels' busy time (:func:`_busy`) and their ratios to ``ref`` (``(wall, busy)`` seconds) to
    ``lines``, or that it failed (a configuration the device cannot take: say so), print it and write ``lines`` to
    ``args.out``."""
    try:
        m = statistics.median(alternate({"x": fn}, args.rounds, warmup=2, repeat=repeat, device=dev)["x"])
        row = f"{cells} {_cells(m, _busy(fn, dev), ref)}"
    except Exception as e:  # noqa: BLE001 - a config the device cannot take: say so
        row = f"{cells} failed: {str(e)[:60]} | - | - | - |"
    _add_row(lines, args, row)


def _add_row(lines: list[str], args: argparse.Namespace, row: str) -> None:
    """Append ``row`` to ``lines``, print it and write ``lines`` to ``args.out`` (a run stopped at its time limit keeps
    every row it had)."""
    lines.append(row)
    print(row, flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


def _layer_calls(dev, side: int, prefix: int, hd: int, tokens: int) -> tuple[int, dict]:
    """The layer's tokens at one grid side (``prefix`` tokens first, ``384 / hd`` heads of ``hd``, ``tokens`` a batch),
    and its calls on random bf16 inputs: plain SDPA's forward and forward + backward, the fused kernel's (``tri_fb``:
    with the table's gradient or not, ``dq`` by atomics or not) and its launches (``plan``, for a device of ``sms``
    multiprocessors)."""
    n = prefix + side * side
    b, h, grid = max(1, tokens // n), 384 // hd, (side, side)
    q, k, v = (torch.randn(b, h, n, hd, device=dev, dtype=_half(dev), requires_grad=True) for _ in range(3))
    table = torch.randn(h, 2 * side - 1, 2 * side - 1, device=dev, requires_grad=True)
    go = torch.randn_like(q)

    def sdpa_f():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v)

    def sdpa_fb():
        torch.autograd.grad(F.scaled_dot_product_attention(q, k, v), (q, k, v), go)

    def tri_f(config=None):
        with torch.no_grad():
            tb.rel_bias_attention(q, k, v, table, grid, prefix, config=config)

    def tri_fb(grad_t=True, det=True, config=None):
        t = table if grad_t else table.detach()  # (a table that needs no gradient: the kernel computes none)
        leaves = (q, k, v, table) if grad_t else (q, k, v)
        out = tb.rel_bias_attention(q, k, v, t, grid, prefix, deterministic=det, config=config)
        torch.autograd.grad(out, leaves, go)

    def plan(sms, **kw):
        return tb.plan(q, k, v, table, grid, prefix, sms=sms, **kw)

    return n, dict(sdpa_f=sdpa_f, sdpa_fb=sdpa_fb, tri_f=tri_f, tri_fb=tri_fb, plan=plan)


def _sdpa_rows(lines: list[str], args: argparse.Namespace, dev, n: int, calls: dict, at: str = "") -> dict:
    """Plain SDPA's forward and forward + backward times (``args.rounds`` alternating rounds), their rows appended to
    ``lines``; returns them (``f``, ``fb``), the rows' reference."""
    t = alternate({"f": calls["sdpa_f"], "fb": calls["sdpa_fb"]}, args.rounds, warmup=2, repeat=5, device=dev)
    ref = {kk: (statistics.median(x), _busy(calls[f"sdpa_{kk}"], dev)) for kk, x in t.items()}
    lines.append(f"| {n} | fwd | {at}plain SDPA | {_cells(*ref['f'], ref['f'])}")
    lines.append(f"| {n} | fwd+bwd | {at}plain SDPA | {_cells(*ref['fb'], ref['fb'])}")
    return ref


def _base(dev: torch.device, hd: int) -> KernelConfig:
    """The configuration the rows change: the GPU's at head dim ``hd``, or the interpreter's (the tests' CPU runs)."""
    return cuda_config(hd) if dev.type == "cuda" else INTERPRETER


def _bwd_config(base: KernelConfig, hd: int, blk: int, w: int, st: int, wides: list) -> tuple[KernelConfig, str]:
    """A backward row's configuration and its label."""
    square, wide_dbias = "square dbias" in wides[2:], "wide dbias" in wides[2:]
    own = {"dkdv_tile": None, "dq_tile": None}
    parts, warps = [], base.wide
    for name, wide in zip(("dkdv", "dq"), wides):
        if wide:
            own[f"{name}_tile"], warps = wide[:2], Warps(wide[2], wide[3])
        parts.append(f"{name} {wide[0]} x {wide[1]} warps {wide[2]} stages {wide[3]}" if wide else f"{name} square")
    if square:
        own["dbias_tile"] = None
    if wide_dbias:
        own["dbias_tile"], warps = (128, 64), Warps(8, 2)
    one = min(blk, base.bwd_one_tile_max)
    config = replace(
        base, bwd_tile=blk, bwd=Warps(w, st), wide=warps, **own, fwd_one_tile_max=one, bwd_one_tile_max=one
    )
    flags = ["square dbias"] * square + ["dbias 128 x 64 warps 8 stages 2"] * wide_dbias
    return config, ", ".join([f"bwd tile {blk} warps {w} stages {st}", *parts, *flags])


def tune_size(
    side: int, args: argparse.Namespace, lines: list[str], hd: int = 64, device: str = "cuda", tokens: int = 65536
) -> None:
    """The rows of one grid side and head dim (``CONFIGS``), ``tokens`` per batch, appended to ``lines`` (and written
    to ``args.out`` as they come)."""
    dev = torch.device(device)
    fwd_rows, bwd_rows = CONFIGS[hd]
    at = "" if hd == 64 else f"head dim {hd}, "
    n, calls = _layer_calls(dev, side, 1, hd, tokens)
    tri_f, tri_fb = calls["tri_f"], calls["tri_fb"]
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else None
    base = _base(dev, hd)
    ref = _sdpa_rows(lines, args, dev, n, calls, at)
    for bm, bn, w, st, *no_tma in fwd_rows:
        config = replace(base, fwd_tile=(bm, bn), fwd=Warps(w, st), tma_min_tiles=1 << 30 if no_tma else 8)
        label = f"{at}BM {bm} BN {bn} warps {w} stages {st}" + (", no TMA" if no_tma else "")
        _time_row(lines, args, dev, f"| {n} | fwd | {label} |", functools.partial(tri_f, config), ref["f"], repeat=5)
    for blk, w, st, *wides in bwd_rows:
        config, label = _bwd_config(base, hd, blk, w, st, wides)
        label = at + label
        dbias_only = len(wides) > 2 and not any(wides[:2])  # (a row that changes only the dbias kernel)
        settings = ((True, True), (True, False)) if len(wides) > 2 else ((True, True), (False, True), (True, False))
        for grad_t, det in settings:  # (last: dq by atomics, triton_atomic's)
            name = f"fwd+bwd{'' if grad_t else ' (no dT)'}{'' if det else ' (dq by atomics)'}"
            if dbias_only and "dbias" not in calls["plan"](sms, deterministic=det, config=config):  # (dT in dq)
                row = f"| {n} | {name} | {label} | not run: no dbias kernel in this call | - | - | - |"
                _add_row(lines, args, row)
                continue
            fn = functools.partial(tri_fb, grad_t, det, config)
            _time_row(lines, args, dev, f"| {n} | {name} | {label} |", fn, ref["fb"])
    if args.out:
        Path(args.out).write_text("\n".join(lines) + f"\n\n({time.ctime()})\n")


#: the rows of ``--in-dq`` a call: (label, deterministic, the launch and its argument that must be true for the row
#: to be what it says), the default first
IN_DQ_ROWS = [
    ("the table's gradient in dq", True, ("dq", "TABLE_GRAD")),
    ("dq by atomics, the dbias kernel", False, ("dbias", "TILED")),
]


def tune_in_dq(args: argparse.Namespace, lines: list[str], device: str = "cuda", tokens: int = 65536, calls=None):
    """Forward + backward with the table's gradient summed by the ``dq`` kernel (the default) and by the ``dbias``
    kernel with ``dq`` by atomics (``triton_atomic``), against plain SDPA, at :data:`IN_DQ_CALLS` (or ``calls``),
    appended to ``lines`` (and written to ``args.out`` as they come); a call that cannot take a row's form says so."""
    dev = torch.device(device)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else None
    for side, prefix in calls or IN_DQ_CALLS:
        n, fns = _layer_calls(dev, side, prefix, 64, tokens)
        ref = _sdpa_rows(lines, args, dev, n, fns)
        for config, det, check in IN_DQ_ROWS:
            launch = fns["plan"](sms, deterministic=det).get(check[0])
            if launch is None or not launch.args[check[1]]:
                row = f"| {n} | fwd+bwd | {config} | not taken (patterns shared, or one tile) | - | - | - |"
                _add_row(lines, args, row)
                continue
            fb = functools.partial(fns["tri_fb"], True, det)
            _time_row(lines, args, dev, f"| {n} | fwd+bwd | {config} |", fb, ref["fb"])


def tune_windows(args: argparse.Namespace, lines: list[str], device: str = "cuda", images: int = 128) -> None:
    """The rows of :data:`WINDOWS` (fwd + bwd, with the table's gradient and with a fixed table) against plain SDPA on
    the same windows, appended to ``lines`` (and written to ``args.out`` as they come)."""
    from vitrel.layout.geometry import Grid
    from vitrel.layout.windows import window_layout, window_regions

    dev = torch.device(device)
    side, hd = (56, 7) if images else (8, 4)  # (images 0: a 8 x 8 map in 4 x 4 windows, for a test)
    regions = window_layout(window_regions(Grid(side, side), (hd, hd), (hd // 2, hd // 2)), (hd, hd)).segment.to(dev)
    b, n = max(1, images) * regions.shape[0], hd * hd
    q, k, v = (torch.randn(b, 3, n, 32, device=dev, dtype=_half(dev), requires_grad=True) for _ in range(3))
    table = torch.randn(3, 2 * hd - 1, 2 * hd - 1, device=dev, requires_grad=True)
    go = torch.randn_like(q)

    def sdpa_fb():
        torch.autograd.grad(F.scaled_dot_product_attention(q, k, v), (q, k, v), go)

    def tri_fb(grad_t, config):
        t = table if grad_t else table.detach()
        leaves = (q, k, v, table) if grad_t else (q, k, v)
        out = tb.rel_bias_attention(q, k, v, t, (hd, hd), 0, regions=regions, config=config)
        torch.autograd.grad(out, leaves, go)

    def sdpa_f():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v)

    def tri_f(config):
        with torch.no_grad():
            tb.rel_bias_attention(q, k, v, table, (hd, hd), 0, regions=regions, config=config)

    where = f"{b} windows of {hd} x {hd}"

    def sdpa_ref(fn) -> tuple[float, float | None]:
        return statistics.median(alternate({"x": fn}, args.rounds, warmup=2, repeat=5, device=dev)["x"]), _busy(fn, dev)

    ref = sdpa_ref(sdpa_fb)
    lines.append(f"| {n} | fwd+bwd | {where}, plain SDPA | {_cells(*ref, ref)}")
    base = _base(dev, 32)
    ref_f = sdpa_ref(sdpa_f)
    lines.append(f"| {n} | fwd | {where}, plain SDPA | {_cells(*ref_f, ref_f)}")
    for row in WINDOWS_FWD:
        config = replace(base, fwd_one_tile_max=0) if row is None else replace(base, fwd_one_tile=Warps(*row))
        kind = f"one-tile fwd warps {row[0]} stages {row[1]}" if row else "fwd a window a program"
        _time_row(lines, args, dev, f"| {n} | fwd | {where}, {kind} |", functools.partial(tri_f, config), ref_f)
    for row in WINDOWS:
        if row is None:
            config = replace(base, bwd_one_tile_max=0)
        else:
            config = replace(base, bwd_one_tile=Warps(*row), bwd_one_tile_each=Warps(*row))
        kind = f"{where}, " + (f"one-tile bwd warps {row[0]} stages {row[1]}" if row else "four bwd kernels")
        for grad_t in (True, False):
            label = f"fwd+bwd{'' if grad_t else ' (no dT)'}"
            _time_row(lines, args, dev, f"| {n} | {label} | {kind} |", functools.partial(tri_fb, grad_t, config), ref)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sides", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--diagnose", action="store_true", help="only the breakdown at each of --sides")
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128], choices=[64, 128],
                    help="64: every row at each of --sides; 128: its rows at the largest")  # fmt: skip
    ap.add_argument("--no-windows", dest="windows", action="store_false", help="without Swin-T's windows' rows")
    ap.add_argument("--in-dq", action="store_true",
                    help="only the rows of where the table's gradient is summed (IN_DQ_CALLS, IN_DQ_ROWS)")  # fmt: skip
    args = ap.parse_args()
    if args.diagnose:
        text = "\n".join(line for side in args.sides for line in diagnose(side, args.rounds))
        if args.out:
            Path(args.out).write_text(f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n{text}\n")
        return
    dev = torch.device("cuda")
    lines = [f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}; medians of {args.rounds} rounds\n"]
    head = "| N | pass | config | ms | / plain SDPA | kernels' busy ms | / plain SDPA's |"
    lines += [head, "|---:|---|---|" + "---:|" * 4]
    if args.in_dq:
        tune_in_dq(args, lines)
        return
    if args.windows:  # first: the shortest rows, and the one-tile kernels' only timing
        tune_windows(args, lines)
    for side in args.sides if 64 in args.head_dims else ():
        tune_size(side, args, lines)
    if 128 in args.head_dims:
        tune_size(args.sides[-1], args, lines, 128)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + f"\n\n({time.ctime()})\n")


if __name__ == "__main__":
    main()
