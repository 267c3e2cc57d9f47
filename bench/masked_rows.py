"""Cost of the closed-row guard (``vitrel.layout.softmax.masked_softmax``) on the eager paths.

An attention layer's forward + backward with a key padding mask, the guard against a plain softmax (NaN in a row
the mask closes), alternated in one process, median of ``--rounds``. Usage::

    OMP_NUM_THREADS=1 PYTHONPATH=. python bench/masked_rows.py --out bench/results/masked_rows_cpu.md
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import vitrel.kernels.eager as eager
import vitrel.pos.shaw_base as shaw_base
from vitrel.bench import alternate, machine_info, medians
from vitrel.layers.attention import Attention


def plain(logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return logits.softmax(-1)


def measure(pos: str, impl: str, batch: int, rounds: int) -> dict[str, float]:
    """Median seconds of one forward + backward, guarded and plain (alternated, zigzag)."""
    torch.manual_seed(0)
    layer = Attention(384, 6, pos=pos, grid=(14, 14), num_prefix_tokens=1, attn_impl=impl)
    x = torch.randn(batch, 197, 384, requires_grad=True)
    keep = torch.ones(batch, 197, dtype=torch.bool)
    keep[::2, 150:] = False  # every other image ends in 47 padding tokens
    guard = eager.masked_softmax

    def step(softmax) -> None:
        eager.masked_softmax = shaw_base.masked_softmax = softmax
        layer(x, (14, 14), keep[:, None, None]).sum().backward()

    try:
        times = alternate({"guard": lambda: step(guard), "plain": lambda: step(plain)}, rounds, warmup=2, zigzag=True)
    finally:
        eager.masked_softmax = shaw_base.masked_softmax = guard
    return medians(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=["rel2d_full@eager", "lookhere@eager", "shaw2d_full@shaw"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--out", default=None, help="also write the Markdown table here")
    args = ap.parse_args()
    lines = [
        f"`{' '.join(['python', 'bench/masked_rows.py', *sys.argv[1:]])}`; {machine_info()['description']}, "
        f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}; "
        f"{args.batch} x 197 tokens, dim 384, 6 heads, fp32, forward + backward, median of {args.rounds}",
        "",
        "| scheme @ kernel | guard / plain | guard ms | plain ms |",
        "|---|---|---|---|",
    ]
    for case in args.cases:
        pos, impl = case.split("@")
        t = measure(pos, impl, args.batch, args.rounds)
        g, p = t["guard"], t["plain"]
        lines.append(f"| `{case}` | {g / p:.3f} | {g * 1e3:.1f} | {p * 1e3:.1f} |")
        print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("# The closed-row guard on the eager paths (CPU)\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
