"""The forward as it is at 14 x 14 + 1 (ViT-B/16's call) against a dense float-bias SDPA: NaN rows and largest
difference, head dims 16 to 128, batch 2 and 256, with and without grad."""

import torch

from vitrel.kernels import triton_bias as tb
from vitrel.kernels.triton_bias import rel_bias_attention

dev = torch.device("cuda")
for d in (16, 32, 64, 128):
    for b in (2, 64):
        for grid, prefix in (((14, 14), 1), ((5, 24), 1), ((32, 32), 0)):
            g = torch.Generator().manual_seed(0)
            n = prefix + grid[0] * grid[1]
            q, k, v = (torch.randn(b, 2, n, d, generator=g).to(dev, torch.bfloat16) for _ in range(3))
            table = torch.randn(2, 2 * grid[0] - 1, 2 * grid[1] - 1, generator=g).to(dev)
            plan = tb.plan(q, k, v, table, grid, prefix, sms=132)
            with torch.no_grad():
                out = rel_bias_attention(q, k, v, table, grid, prefix).float()
                out2 = rel_bias_attention(q, k, v, table, grid, prefix).float()
            nan_rows = out.isnan().any(-1).any(0).any(0).nonzero().flatten().tolist()
            print(f"d={d} b={b} grid={grid} p={prefix} fwd={plan['fwd'].kernel} nan rows {nan_rows[:8]}"
                  f"{'...' if len(nan_rows) > 8 else ''} ({len(nan_rows)}) same twice: "
                  f"{torch.equal(out.nan_to_num(), out2.nan_to_num())}", flush=True)
