"""The warp-specialized forward (``triton_bias.WARP_SPECIALIZE``) against the forward as it is, on a GPU: the largest
difference of the outputs in each 64-row half of the query tiles, per head dim and grid, with the loop partitioned
(``WS=True``, as launched) and the same kernel not partitioned (``WS=False``), and with a zero table. On the H100
(Triton 3.6) ``test_warp_specialized_forward_equals_reference`` failed at head dim 16; this says where and why.

    python bench/ws_check.py [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from vitrel.kernels import triton_bias as tb
from vitrel.kernels.triton_bias import rel_bias_attention

CASES = [((4, 8), 0), ((8, 8), 0), ((5, 24), 1), ((14, 14), 1), ((32, 32), 0), ((64, 64), 1)]


def run(d: int, grid: tuple[int, int], prefix: int, ws: bool | None, zero: bool, dev) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(0)
    n = prefix + grid[0] * grid[1]
    q, k, v = (torch.randn(2, 2, n, d, generator=g).to(dev, torch.bfloat16) for _ in range(3))
    table = torch.randn(2, 2 * grid[0] - 1, 2 * grid[1] - 1, generator=g).to(dev)
    table = table * 0 if zero else table
    make = tb.Launch.make.__func__
    tb.WARP_SPECIALIZE.clear()
    if ws is not None:
        tb.WARP_SPECIALIZE.add("fwd")

        def patched(cls, kernel, grid_, positional, consts, options):
            if kernel == "fwd_ws":
                consts = {**consts, "WS": ws}
            return make(cls, kernel, grid_, positional, consts, options)

        tb.Launch.make = classmethod(patched)
    try:
        with torch.no_grad():
            out = rel_bias_attention(q, k, v, table, grid, prefix)
        torch.cuda.synchronize()
    finally:
        tb.Launch.make = classmethod(make)
        tb.WARP_SPECIALIZE.clear()
    return out.float()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--head-dims", type=int, nargs="+", default=[16, 32, 64, 128])
    args = ap.parse_args()
    dev = torch.device("cuda")
    import triton

    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}\n",
             "Max |WS - forward| over query rows r with r mod 128 < 64 (first half) and >= 64 (second half).\n",
             "| head dim | grid | prefix | table | WS=True first | WS=True second | WS=False first | WS=False second |",
             "|---:|---|---:|---|---:|---:|---:|---:|"]  # fmt: skip
    print("\n".join(lines), flush=True)
    for d in args.head_dims:
        for grid, prefix in CASES:
            for zero in (False, True):
                t0 = time.perf_counter()
                try:
                    ref = run(d, grid, prefix, None, zero, dev)
                    cells = []
                    for ws in (True, False):
                        diff = (run(d, grid, prefix, ws, zero, dev) - ref).abs().amax((0, 1, 3))
                        rows = torch.arange(diff.numel(), device=dev) % 128 < 64
                        first, second = diff[rows].max().item(), (diff[~rows].max().item() if (~rows).any() else 0.0)
                        cells += [f"{first:.3g}", f"{second:.3g}"]
                except Exception as e:  # noqa: BLE001 (a failing case is a row of the table)
                    cells = [f"error: {type(e).__name__}: {str(e)[:80]}", "", "", ""]
                row = f"| {d} | {grid[0]}x{grid[1]} | {prefix} | {'zero' if zero else 'random'} | " + " | ".join(cells)
                lines.append(row + f" |  ({time.perf_counter() - t0:.1f} s)")
                print(lines[-1], flush=True)
                if args.out:
                    open(args.out, "w").write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
