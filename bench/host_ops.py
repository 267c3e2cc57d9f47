"""The torch operators of one training step, counted on the CPU, vitrel's model against timm's, and where ours come
from: each operator is a launch on a GPU and its host work (about 17 us a call on the H100 machine's host,
``bench/results/host_overhead_h100.md``), so where a step is bound by the host (``bench/step_profile.py``: the kernels
busy well below the step's wall time), fewer operators is a faster step. Counted, not timed: the same on any machine.

    TRITON_INTERPRET=1 python bench/host_ops.py                                   # Swin-T and ViT-S, attn_impl=triton
    TRITON_INTERPRET=1 python bench/host_ops.py --attn-impl sdpa --pairs vit_rel2d_full

The fused kernel's launches are counted, not run (``attn_impl=triton`` on a CPU would run them through Triton's
interpreter, at length: the step's values are not needed). Each operator as it reaches the dispatcher under
:class:`~torch.utils._python_dispatch.TorchDispatchMode`, forward and backward (the optimizer's step is one fused
launch on a GPU, ``bench/models.py``), attributed to the innermost frame of vitrel or timm that called it (the
backward's: ``backward``). A custom op (``torch.ops.vitrel.*``, as ``torch.compile`` calls the fused kernel) counts as
one operator, its body's unseen: eager calls of ``attn_impl=triton`` run as an autograd function
(``vitrel.kernels.triton.op._Eager``), whose operators are all counted; ``bench/host_overhead.py`` counts one layer's
inside the op too (the profiler's top-level operators).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import traceback
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/models.py, beside this file
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # vitrel, installed or not

from models import PAIRS, build  # noqa: E402

from vitrel.bench import emit  # noqa: E402
from vitrel.kernels import triton as fused  # noqa: E402

#: the path parts that name a frame's package (the innermost such frame is an operator's source)
SOURCES = ("/vitrel/", "/timm/")


class Count(TorchDispatchMode):
    """Operators by name and by source (``file:function`` of the innermost vitrel or timm frame, else ``torch``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        self.sources: Counter = Counter()
        self.in_backward = False

    @staticmethod
    @contextlib.contextmanager
    def backward(c: Count):
        c.in_backward = True
        try:
            yield
        finally:
            c.in_backward = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.__name__.split(".")[0]] += 1
        frames = [f for f in traceback.extract_stack()[:-1] if any(s in f.filename for s in SOURCES)]
        f = frames[-1] if frames else None
        if f is None or f.filename.endswith("host_ops.py"):
            where = "backward (autograd)" if self.in_backward else "torch"
        else:
            where = f"{f.filename.split('/')[-1]}:{f.name}" + (" (backward)" if self.in_backward else "")
        self.sources[where] += 1
        return func(*args, **(kwargs or {}))


def count_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> Count:
    def step():
        model.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        with Count.backward(c):
            loss.backward()

    c = Count()
    step()  # (the caches filled: as from the second step on)
    c = Count()
    with c:
        step()
    return c


def main(argv: list[str] | None = None) -> list[str]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", nargs="+", default=["swin_rel2d_full", "vit_rel2d_full"], choices=list(PAIRS))
    ap.add_argument("--attn-impl", default="triton")
    ap.add_argument("--img-size", type=int, default=224)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    real = fused.Launch.__call__
    fused.Launch.__call__ = lambda self: None  # (counted by the dispatcher's view only: no kernel runs)
    lines = [
        f"torch {torch.__version__}; one forward and backward (after one), batch 1, {args.img_size} px, "
        f"attn_impl={args.attn_impl}; operators at the dispatcher\n",
    ]
    try:
        for key in args.pairs:
            ours_spec, timm_spec = PAIRS[key]
            x = torch.randn(1, 3, args.img_size, args.img_size)
            y = torch.zeros(1, dtype=torch.long)
            torch.manual_seed(0)
            ours = count_step(build(ours_spec, args.img_size, torch.device("cpu"), True, args.attn_impl).train(), x, y)
            theirs = count_step(build(timm_spec, args.img_size, torch.device("cpu"), False), x, y)
            n_ours, n_timm = sum(ours.ops.values()), sum(theirs.ops.values())
            lines += [
                f"### {key}: {ours_spec['name']} + {ours_spec.get('pos')} against {timm_spec['name']}\n",
                f"Operators a forward and backward: ours {n_ours}, timm {n_timm} ({n_ours / n_timm:.2f}x).\n",
                "| ours' source | operators a step |",
                "|---|---:|",
                *(f"| `{k}` | {v} |" for k, v in ours.sources.most_common(args.top)),
                "",
            ]
    finally:
        fused.Launch.__call__ = real
    return emit(lines, args.out)


if __name__ == "__main__":
    main()
