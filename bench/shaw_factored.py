"""Forward+backward time of the shaw2d_factored fast path (one SDPA call) vs plain SDPA, on CPU.

    OMP_NUM_THREADS=2 python bench/shaw_factored.py --threads 2

Runs are interleaved (plain, fast, eager, plain, ...) so that load from other processes hits every
variant alike; prints the median and the min over ``--reps`` timed runs after one warm-up.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from vitrel.bench import alternate
from vitrel.kernels import get_kernel
from vitrel.kernels.eager import attend_eager
from vitrel.layout.geometry import Grid
from vitrel.pos.schemes.shaw import Shaw2dFactored, shaw2d_factored_attention


def variants(q, k, v, pos: Shaw2dFactored, g: Grid, eager: bool) -> dict[str, Callable[[], torch.Tensor]]:
    scale = q.shape[-1] ** -0.5
    tables = (pos.rel_kh, pos.rel_kw, pos.rel_vh, pos.rel_vw)
    out: dict[str, Callable[[], torch.Tensor]] = {
        "plain SDPA": lambda: F.scaled_dot_product_attention(q, k, v),
        "shaw2d_factored fast": lambda: shaw2d_factored_attention(q, k, v, *tables, g, 0, None, scale),
    }
    if eager:
        st = pos.prepare(g, 0, q.device, q.dtype, get_kernel("eager"))
        out["shaw2d_factored eager"] = lambda: attend_eager(q, k, v, None, scale, st)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--sides", type=int, nargs="+", default=[14, 32], help="square grid sides (N = side^2)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--eager", action="store_true", help="also time the eager content_logits/values path")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    b, h, d = args.batch, args.heads, args.head_dim
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, B={b}, heads={h}, head_dim={d}, fp32")
    for side in args.sides:
        g = Grid(side, side)
        q, k, v = (torch.randn(b, h, g.n, d, requires_grad=True) for _ in range(3))
        pos = Shaw2dFactored(num_heads=h, head_dim=d, grid=g)
        fns = variants(q, k, v, pos, g, args.eager)
        steps = {name: (lambda fn=fn: fn().sum().backward()) for name, fn in fns.items()}
        times = alternate(steps, args.reps, warmup=1)
        base = statistics.median(times["plain SDPA"])
        for name, ts in times.items():
            med = statistics.median(ts)
            print(
                f"N={g.n:5d} ({side}x{side})  {name:24s} fwd+bwd median {med * 1e3:8.1f} ms  "
                f"min {min(ts) * 1e3:8.1f} ms  x{med / base:.2f}"
            )


if __name__ == "__main__":
    main()
