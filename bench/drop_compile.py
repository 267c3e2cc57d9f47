"""Graphs compiled, compile seconds and steady step time of a compiled training step with ``token_drop`` as a range
and a size drawn per batch (``data.size_choices``), the default recipe's network (conf/model/vit_tiny_fmnist.yaml).

    PYTHONPATH=$PWD python bench/drop_compile.py [--backend inductor|aot_eager|eager|none] [--steps 24]
    PYTHONPATH=$PWD python bench/drop_compile.py --padding-cost [--steps 24]

A step: forward, cross-entropy, backward, AdamW. A step that compiled a graph counts as compile time (its time less
the steady median); steady: the median of the steps that compiled nothing. ``--backend none``: eager, no compile.
``--padding-cost``: eager steps alternating rows padded to the lowest rate's count (today) with rows cut to the
draw's longest kept count (the path before, ``length=None``), same draws: medians, their ratio and the mean row
lengths, in one process so that a loaded machine slows both alike.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import nullcontext
from unittest import mock

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import vitrel
import vitrel.models.vit as vit_module


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--sizes", type=int, nargs="+", default=[20, 28])
    ap.add_argument("--token-drop", type=float, nargs="+", default=[0.25, 0.75])
    ap.add_argument("--padding-cost", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    drop = args.token_drop[0] if len(args.token_drop) == 1 else args.token_drop
    model = vitrel.create_model(
        "vitrel_vit_tiny_patch4_32", pos="rel2d_factored", img_size=28, in_chans=1, num_classes=10, embed_dim=64,
        depth=4, num_heads=4, mlp_ratio=2.0, global_pool="avg", token_drop=drop,
    ).train()  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if args.padding_cost:
        return padding_cost(model, opt, args)
    step_model = model if args.backend == "none" else torch.compile(model, backend=args.backend, dynamic=False)
    g = torch.Generator().manual_seed(0)
    times, new_graphs = [], []
    for _ in range(args.steps):
        s = args.sizes[int(torch.randint(len(args.sizes), (1,), generator=g))]
        x = torch.randn(args.batch, 1, s, s, generator=g)
        y = torch.randint(10, (args.batch,), generator=g)
        before = counters["stats"]["unique_graphs"]
        t0 = time.perf_counter()
        loss = F.cross_entropy(step_model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        new_graphs.append(counters["stats"]["unique_graphs"] - before)
    steady = [t for t, n in zip(times, new_graphs) if n == 0] or times[-3:]
    med = statistics.median(steady)
    compile_s = sum(t - med for t, n in zip(times, new_graphs) if n)
    print(f"backend={args.backend} steps={args.steps} sizes={args.sizes} token_drop={drop} batch={args.batch}")
    print(f"graphs compiled: {sum(new_graphs)} (per step: {new_graphs})")
    print(f"steps that compiled: {sum(1 for n in new_graphs if n)}; compile s: {compile_s:.1f}")
    print(f"steady step ms (median of {len(steady)} steps without a compile): {1000 * med:.1f}")


def padding_cost(model, opt, args) -> None:
    """Eager steps, padded and compact alternating on the same batch and draw (one size per step pair)."""
    g = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {"padded": [], "compact": []}
    rows: dict[str, list[int]] = {"padded": [], "compact": []}
    for i in range(args.steps):
        s = args.sizes[int(torch.randint(len(args.sizes), (1,), generator=g))]
        x = torch.randn(args.batch, 1, s, s, generator=g)
        y = torch.randint(10, (args.batch,), generator=g)
        order = ("padded", "compact") if i % 2 else ("compact", "padded")
        for how in order:
            compact = mock.patch.object(vit_module, "token_drop_keep_max", lambda *a: None)  # length=None
            with compact if how == "compact" else nullcontext():
                torch.manual_seed(i)
                t0 = time.perf_counter()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                times[how].append(time.perf_counter() - t0)
                opt.zero_grad(set_to_none=True)  # no update: both paths see the same weights
                torch.manual_seed(i)
                with torch.no_grad():
                    rows[how].append(model.forward_features(x).shape[1])
    pad, comp = (statistics.median(times[k][1:]) for k in ("padded", "compact"))
    print(f"padding cost: sizes={args.sizes} token_drop={args.token_drop} batch={args.batch} steps={args.steps}")
    print(f"mean row length (prefix included): padded {statistics.mean(rows['padded']):.2f}, "
          f"compact {statistics.mean(rows['compact']):.2f}")  # fmt: skip
    print(f"eager step ms (median): padded {1000 * pad:.1f}, compact {1000 * comp:.1f}, ratio {pad / comp:.3f}")


if __name__ == "__main__":
    main()
