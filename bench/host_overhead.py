"""The host's cost of one attention call, per implementation: a layer too small for the device to matter (one image,
one head of 64, ViT-S/16's 14 x 14 grid and a class token), called back to back with the device synchronized only
after each ``--repeat`` calls, so that on a GPU the device waits on the host and a call's time is the host's (Python,
the dispatcher, launches). Each against plain SDPA (``none``) in the same run; then the fused kernel's calls under
``cProfile`` (their dearest functions by own time) and, per call, its Triton launches and the torch operators it
runs beside them (each a launch of its own on a GPU).

    python bench/host_overhead.py --device cuda                       # on a GPU (bench/gpu.py's host section)
    TRITON_INTERPRET=1 python bench/host_overhead.py --device cpu --grid 3 --repeat 2 --rounds 1   # the code path

On a GPU, eager training steps of small models were bound by the host with ``attn_impl=triton``
(``bench/results/gpu_h100_retuned.md``: ViT-S's kernels busy 0.40 of its step): this says how much of that one
attention call costs, and where.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/step_profile.py, beside this file
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # vitrel, installed or not

from step_profile import host_times  # noqa: E402

from vitrel import Attention  # noqa: E402
from vitrel.bench import alternate, emit  # noqa: E402
from vitrel.kernels import triton as tb  # noqa: E402
from vitrel.kernels.triton import (
    op,  # noqa: E402
    planning,  # noqa: E402
)

#: the layers timed: scheme @ attn_impl (``none``: plain SDPA, the reference)
LAYERS = ["none@sdpa", "rel2d_full@sdpa", "rel2d_full@triton", "rel2d_full@triton_atomic", "rel2d_factored@fold"]
#: the layer profiled
PROFILED = "rel2d_full@triton"


def build(spec: str, grid: int, device: torch.device, dtype: torch.dtype) -> Attention:
    pos, impl = spec.split("@")
    return Attention(64, 1, pos=pos, grid=(grid, grid), num_prefix_tokens=1, attn_impl=impl).to(device, dtype)


def launches_and_ops(call) -> tuple[int, Counter]:
    """One ``call``'s Triton launches (:class:`vitrel.kernels.triton.Launch` calls) and its top-level torch operators
    (those no other operator called), by name."""
    count = 0
    real = tb.Launch.__call__

    def counted(self):
        nonlocal count
        count += 1
        return real(self)

    tb.Launch.__call__ = counted
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            call()
    finally:
        tb.Launch.__call__ = real
    ops = Counter(
        e.name
        for e in prof.events()
        if e.name.startswith("aten::") and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
    )
    return count, ops


def _empty_kernel():
    """A Triton kernel of one argument that does nothing: the floor of a launch's host cost."""
    import triton

    @triton.jit
    def empty(x):
        pass

    return empty


def parts(dev: torch.device, dtype: torch.dtype, grid: int, repeat: int, rounds: int) -> list[str]:
    """The host's cost of each piece of one ``rel2d_full@triton`` call (one image, one head of 64): a torch operator
    and a Triton launch for scale; each kernel's launch alone; the bias tiles; the launches' preparation; the op's
    bodies called directly, then through ``torch.ops`` (the dispatcher, and with a table that needs its gradient,
    the autograd wrapper of ``torch.library``); the table's gradient from the tiles' sums."""
    n = grid * grid + 1
    q, k, v = (torch.randn(1, 1, n, 64, device=dev, dtype=dtype) for _ in range(3))
    table = torch.randn(1, 2 * grid - 1, 2 * grid - 1, device=dev)
    args = op._op_args(q, k, v, table, (grid, grid), 1, None, None, False, None, None, "auto", None, True)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else None
    config = tb.default_config(q)
    out, lse = op._fwd_impl(*args)
    do = torch.randn_like(out)
    fwd = planning.fwd_launch(*args[:13], out, lse, sms, config)
    bwd = planning.bwd_launches(do, *args[:7], out, lse, *args[7:], True, sms, config)
    dbt = bwd.dbt
    t2 = table * planning.LOG2E
    req = [t.requires_grad_() for t in (q.clone(), k.clone(), v.clone(), table.clone())]
    grad_args = (*req, *args[4:])
    a, empty = torch.zeros(1, device=dev), _empty_kernel()
    calls = {
        "torch operator (a + 1)": lambda: a + 1,
        "Triton launch, an empty kernel of 1 argument": lambda: empty[(1,)](a),
        f"{fwd.kernel} launch alone ({len(fwd.args)} arguments)": fwd,
        **{
            f"{ln.kernel} launch alone ({len(ln.args)} arguments)": ln
            for ln in (bwd.delta, bwd.dkdv, bwd.dq, bwd.dbias, bwd.tile)
            if ln is not None
        },
        "bias tiles (_tile_args)": lambda: planning._tile_args(
            t2, None, "auto", grid, grid, 1, n, fwd.args["BM"], fwd.args.get("BN", fwd.args["BM"]), q, config, None
        ),
        "forward launch made (fwd_launch)": lambda: planning.fwd_launch(*args[:13], out, lse, sms, config),
        "backward launches made (bwd_launches)": lambda: planning.bwd_launches(
            do, *args[:7], out, lse, *args[7:], True, sms, config
        ),
        "forward body (_fwd_impl)": lambda: op._fwd_impl(*args),
        "forward op, no gradient (torch.ops)": lambda: torch.ops.vitrel.rel_bias_attention(*args),
        "forward op, gradients wanted (torch.ops + autograd)": lambda: torch.ops.vitrel.rel_bias_attention(*grad_args),
        "forward, gradients wanted (eager: op._Eager)": lambda: op._Eager.apply(*grad_args[:7], None, *grad_args[7:]),
        "backward body (_bwd_impl)": lambda: op._bwd_impl(do, *args[:7], out, lse, *args[7:], True),
    }
    if dbt is not None:
        calls["table gradient from the tiles' sums"] = lambda: tb.table_grad_from_tiles(
            dbt, bwd.patterns, grid, grid, 1, config
        )
    times = alternate(calls, rounds, warmup=2, repeat=repeat, device=dev)
    lines = [
        f"The pieces of one rel2d_full@triton call ({n} tokens, one head of 64, {dtype}), each {repeat} times between "
        f"synchronizations, median of {rounds} rounds:\n",
        "| piece | us / call |",
        "|---|---:|",
    ]
    return lines + [f"| {k} | {1e6 * statistics.median(v):.0f} |" for k, v in times.items()]


def main(argv: list[str] | None = None) -> list[str]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--grid", type=int, default=14, help="grid side (a class token besides)")
    ap.add_argument("--repeat", type=int, default=200, help="calls between two synchronizations")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    n = args.grid**2 + 1
    layers = {s: build(s, args.grid, dev, dtype) for s in LAYERS}
    x = torch.randn(1, n, 64, device=dev, dtype=dtype, requires_grad=True)
    grid = (args.grid, args.grid)

    def fwd_bwd(s):
        layers[s](x, grid).float().sum().backward()

    def fwd(s):
        with torch.inference_mode():
            layers[s].eval()(x, grid)
        layers[s].train()

    calls = {f"{s} fwd+bwd": (lambda s=s: fwd_bwd(s)) for s in LAYERS}
    calls.update({f"{s} fwd": (lambda s=s: fwd(s)) for s in LAYERS})
    times = alternate(calls, args.rounds, warmup=2, repeat=args.repeat, device=dev)
    med = {k: statistics.median(v) for k, v in times.items()}
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    lines = [
        f"{name}, torch {torch.__version__}; one image, 1 head of 64, {args.grid} x {args.grid} grid + 1 token "
        f"({n} tokens), {dtype}; {args.repeat} calls between synchronizations, median of {args.rounds} rounds\n",
        "| layer | fwd+bwd us / call | / plain SDPA | fwd us / call | / plain SDPA |",
        "|---|---:|---:|---:|---:|",
    ]
    ref_fb, ref_f = med["none@sdpa fwd+bwd"], med["none@sdpa fwd"]
    for s in LAYERS:
        fb, f = med[f"{s} fwd+bwd"], med[f"{s} fwd"]
        lines.append(f"| {s} | {1e6 * fb:.0f} | {fb / ref_fb:.2f}x | {1e6 * f:.0f} | {f / ref_f:.2f}x |")
    count, ops = launches_and_ops(lambda: fwd_bwd(PROFILED))
    lines += [
        "",
        f"{PROFILED}, one fwd+bwd call: {count} Triton launches, {sum(ops.values())} top-level torch operators "
        f"({', '.join(f'{k[6:]} {v}' for k, v in ops.most_common(12))}).",
    ]
    host = host_times(lambda: fwd_bwd(PROFILED), dev, args.repeat)  # (ms and calls per call of fwd_bwd)
    own = sorted(host["own"].items(), key=lambda kv: -kv[1][0])[: args.top]
    lines += [
        "",
        f"{PROFILED} under cProfile: {1e3 * host['wall_ms']:.0f} us a call (the profiler's cost included); the "
        f"{args.top} dearest functions by own time:",
        "",
        "| function | calls / call | us / call |",
        "|---|---:|---:|",
    ]
    lines += [f"| `{k[:100]}` | {nc:.1f} | {1e3 * ms:.1f} |" for k, (ms, nc) in own]
    lines += ["", *parts(dev, dtype, args.grid, max(1, args.repeat // 4), args.rounds)]  # (15 pieces: fewer calls)
    return emit(lines, args.out)


if __name__ == "__main__":
    main()
