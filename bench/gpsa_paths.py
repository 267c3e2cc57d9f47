"""GPSA's attention two ways, timed against each other: is a split path worth writing?

``pos=gpsa`` runs on the eager kernel: the content softmax written out, the positional attention ``P`` mixed into it,
the mixture times ``v``. Without attention dropout the same output is ``(1 - s) SDPA(q, k, v) + s (P v)`` (prefix
rows: ``SDPA`` alone), which never holds the content weights. This times one ``vitrel.Attention`` layer's forward and
backward both ways (the split form written here, checked equal first), the two taking turns, and prints the medians::

    python bench/gpsa_paths.py --out bench/results/gpsa_paths_cpu_<date>.md     # 1,025 tokens: about a minute
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch
import torch.nn.functional as F

from vitrel import Attention
from vitrel.bench import alternate, emit, machine_info, medians

#: grid side:batch, about 4,000 to 6,000 tokens a batch at 65, 197 and 1,025 tokens an image
CASES = "8:64,14:32,32:4"


def split(a: Attention, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """The layer's output by ``(1 - s) SDPA(q, k, v) + s P v`` (no attention dropout)."""
    st = a.pos.prepare(grid, a.num_prefix_tokens, x.device, x.dtype)
    b, n, c = x.shape
    q, k, v = a.qkv(x).reshape(b, n, 3, a.num_heads, a.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    out = F.scaled_dot_product_attention(q, k, v, scale=a.scale)
    p = a.pos.positional_attention(None, st, x.dtype)  # [heads, N, N], prefix rows 0
    patch = (torch.arange(n, device=x.device) >= a.num_prefix_tokens).to(x.dtype)
    gate = torch.sigmoid(a.pos.gating).to(x.dtype)[:, None, None] * patch[:, None]
    out = out + gate * (p @ v - out)
    return a.proj(out.transpose(1, 2).reshape(b, n, c))


def step(a: Attention, x: torch.Tensor, grid: tuple[int, int], path=None) -> None:
    """One forward (the layer's own, or ``path``'s) and backward of its sum."""
    (a(x, grid) if path is None else path(a, x, grid)).sum().backward()


def main(argv: list[str] | None = None) -> list[str]:
    """Time the cases; the table's lines (written to ``--out`` too)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=CASES, help=f"grid side:batch, comma-separated (default {CASES})")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--width", type=int, default=192)
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--out", default=None, help="a Markdown file for the table")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    rows = []
    for case in args.cases.split(","):
        side, batch = (int(v) for v in case.split(":"))
        grid = (side, side)
        a = Attention(args.width, args.heads, pos="gpsa", grid=grid, num_prefix_tokens=1)
        x = torch.randn(batch, 1 + side * side, args.width, requires_grad=True)
        torch.testing.assert_close(split(a, x, grid), a(x, grid), rtol=1e-4, atol=1e-5)
        times = alternate(
            {"eager": functools.partial(step, a, x, grid), "split": functools.partial(step, a, x, grid, split)},
            args.rounds,
            zigzag=True,
        )
        med = medians(times)
        rows.append((1 + side * side, batch, med["eager"], med["split"]))
    machine = machine_info()
    lines = [
        "# GPSA: the eager path against a split SDPA + P v path (one layer, forward and backward)",
        "",
        f"- Command: `python bench/gpsa_paths.py {' '.join(sys.argv[1:] if argv is None else argv)}`",
        f"- Machine: {machine['description']}; torch {machine['torch']}",
        f"- Layer: width {args.width}, {args.heads} heads, one class token, float32; medians of {args.rounds} rounds "
        "taking turns (zigzag), after one untimed call each",
        "",
        "| tokens | batch | eager ms | split ms | split / eager |",
        "|---:|---:|---:|---:|---:|",
    ]
    lines += [f"| {n} | {b} | {e * 1e3:.1f} | {s * 1e3:.1f} | {s / e:.2f} |" for n, b, e, s in rows]
    return emit(lines, args.out)


if __name__ == "__main__":
    main()
