"""Forward+backward time and peak memory of every position scheme, relative to plain SDPA.

    python bench/attention.py                     # CPU here: N = 64, 196, 1024 tokens
    python bench/attention.py --device cuda --dtype bf16 --out bench/results/attention_h100.md
    python bench/attention.py --schemes lookhere lookhere:fov=45 rope2d_mixed:basis=cayley   # scheme options
    python bench/attention.py --schemes rel2d_factored rel2d_factored@fold   # an attn_impl (sdpa, flex, fold, eager)
    python bench/attention.py --inference --schemes lookhere lookhere@flex   # forward only (flex on CPU)
    python bench/attention.py --causal --inference --schemes alibi1d alibi1d@flex   # causal 1-D attention
    python bench/attention.py --grid 8,14,14 --schemes rel3d_factored rel3d_factored@fold   # a video grid (T, H, W)

One vitrel ``Attention`` layer (ViT-S: dim 384, 6 heads of 64) per scheme, on a square grid of N
patches (or the grids of ``--grid``: ``H,W`` or a video's ``T,H,W``; default schemes: those that take the grids),
batch chosen so batch * N is constant. Schemes are timed in alternation, round after round, and each
is reported as the median of its rounds divided by the median of ``none`` (plain
``F.scaled_dot_product_attention``, no mask) measured in the same run. Memory: on CUDA the peak
allocated during forward+backward; on CPU the peak of the allocations the profiler records, and
the bytes saved for backward (activation memory) — both relative to ``none``. On CUDA also the kernels'
busy time of a call (``vitrel.bench.busy_seconds``: the host's time out) against ``none``'s: each timed call
is synchronized, so where a call's host work (Python, launches) outlasts its kernels, as the fused kernel's at
N = 196 can, its wall time is the host's, while in a model of many layers the host runs ahead of the GPU.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch

from vitrel import Attention
from vitrel.bench import alternate, busy_seconds, peak_bytes, saved_bytes
from vitrel.pos import get_pos_class, list_pos


def scheme_spec(text: str) -> str | dict:
    """``name`` or ``name:key=value,key=value`` (values parsed as YAML: numbers, null, lists)."""
    if ":" not in text:
        return text
    import yaml

    name, opts = text.split(":", 1)
    return {"name": name, **{k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in opts.split(","))}}


def square_grid(n: int) -> tuple[int, int]:
    side = int(round(n**0.5))
    if side * side != n:
        raise SystemExit(f"--tokens must be square numbers, got {n}")
    return side, side


def grid_arg(text: str) -> tuple[int, ...]:
    """``"8,14,14"`` -> ``(8, 14, 14)`` (two or three positive sides)."""
    try:
        sides = tuple(int(v) for v in text.split(","))
    except ValueError:
        sides = ()
    if len(sides) not in (2, 3) or min(sides) < 1:
        raise SystemExit(f"--grid takes H,W or T,H,W (positive integers), got {text!r}")
    return sides


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 196, 1024])
    ap.add_argument(
        "--grid", nargs="+", default=None, metavar="T,H,W", help="grids instead of --tokens: H,W or a video's T,H,W"
    )
    ap.add_argument(
        "--schemes",
        nargs="+",
        default=None,
        help="default: every relative scheme that takes the grids; name[:key=value,...] for options",
    )
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--tokens-per-batch", type=int, default=4096, help="batch = this // N (at least 1)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--out", default=None, help="also write the Markdown table here")
    ap.add_argument(
        "--inference",
        action="store_true",
        help="forward only, under torch.inference_mode (flex on CPU has no backward)",
    )
    ap.add_argument(
        "--causal",
        action="store_true",
        help="causal attention (every layer, `none` too: SDPA with the causal float mask; flex: a BlockMask)",
    )
    args = ap.parse_args()
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {args.rounds}")

    dev = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    grids = [grid_arg(g) for g in args.grid] if args.grid else [square_grid(n) for n in args.tokens]
    video = any(len(g) == 3 for g in grids)
    schemes = args.schemes or [
        s for s in list_pos("relative") if get_pos_class(s).grid_dims in (None, 3 if video else 2)
    ]
    if "none" in schemes:
        schemes.remove("none")
    schemes = ["none", *schemes]
    cuda = dev.type == "cuda"

    rows = []
    for grid in grids:
        n = math.prod(grid)
        b = max(1, args.tokens_per_batch // n)
        layers = {
            s: Attention(
                args.dim,
                args.heads,
                pos=scheme_spec(s.partition("@")[0]),
                grid=grid,
                causal=args.causal,
                attn_impl=s.partition("@")[2] or "auto",
            ).to(dev, dtype)
            for s in schemes
        }
        x = torch.randn(b, n, args.dim, device=dev, dtype=dtype, requires_grad=not args.inference)

        def step(s, layers=layers, x=x, grid=grid):
            if args.inference:
                with torch.inference_mode():
                    layers[s].eval()(x, grid)
                return
            y = layers[s](x, grid)
            y.float().square().mean().backward()

        times = alternate({s: (lambda s=s: step(s)) for s in schemes}, args.rounds, warmup=args.warmup, device=dev)
        mem = {s: peak_bytes(lambda s=s: step(s), dev) for s in schemes}
        busy = {s: busy_seconds(lambda s=s: step(s), dev) for s in schemes} if cuda else {}
        act = {
            s: 0 if args.inference else saved_bytes(lambda s=s, layers=layers, x=x, grid=grid: layers[s](x, grid))
            for s in schemes
        }
        t_ref = statistics.median(times["none"])
        for s in schemes:
            t = statistics.median(times[s])
            rows.append(
                dict(
                    N=n if not args.grid else f"{n} ({'x'.join(map(str, grid))})",
                    batch=b,
                    scheme=s,
                    ms=1e3 * t,
                    time_x=t / t_ref,
                    peak_x=mem[s] / max(mem["none"], 1),
                    act_x=act[s] / max(act["none"], 1),
                    peak_mb=mem[s] / 2**20,
                    busy_ms=1e3 * busy[s] if busy else None,
                    busy_x=busy[s] / busy["none"] if busy else None,
                )
            )
        print(f"done N={n}", file=sys.stderr)

    dev_name = torch.cuda.get_device_name(dev) if cuda else f"CPU ({torch.get_num_threads()} threads)"
    head = (
        f"Attention layer dim {args.dim}, {args.heads} heads, {args.dtype}, {dev_name}, torch {torch.__version__}; "
        f"median of {args.rounds} alternating rounds; ratios vs plain SDPA (`none`) in the same run"
        f"{'; forward only, inference_mode (saved-for-backward: none)' if args.inference else ''}"
        f"{'; causal (plain SDPA with the causal float mask as reference)' if args.causal else ''}.\n\n"
        f"| N | batch | scheme | {'fwd' if args.inference else 'fwd+bwd'} ms | time / SDPA | peak mem / SDPA | "
        "saved-for-backward / SDPA | kernels' busy ms | busy / SDPA's |\n"
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|"
    )
    lines = [head]
    for r in rows:
        ms = f"{r['ms']:.2f}" if cuda else "-"
        busy_cells = "- | -" if r["busy_ms"] is None else f"{r['busy_ms']:.2f} | {r['busy_x']:.2f}x"
        lines.append(
            f"| {r['N']} | {r['batch']} | {r['scheme']} | {ms} | {r['time_x']:.2f}x | {r['peak_x']:.2f}x | "
            f"{r['act_x']:.2f}x | {busy_cells} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(table + "\n")


if __name__ == "__main__":
    main()
