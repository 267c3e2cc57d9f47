"""PaPE under mixed precision: error against float64 and CPU time, at growing grids, next to ``pos=none``.

A 2-block ``vitrel_vit_tiny_patch16_224`` with random weights (seed 0) on ``img_size = 16 x grid``, for ``none``,
``pape`` (``channels: compact``), ``pape`` with ``channels: parabolas`` (the authors' layout) and ``pape_ri``. Each
under ``torch.autocast("cpu", dtype)`` against the same weights in float64, relative errors (norm of the difference
over the norm of the reference):

- ``out``: ``forward_features`` (eval);
- ``grad``: the gradients of every parameter (concatenated) of ``<forward_features, g>``, ``g`` random;
- ``logits``: ``Attention.logits`` of one layer (dim 192, 3 heads, a class token, ``attn_impl="eager"``) on random
  tokens, and ``probs``: its softmax (the attention map);
- ``ms``: a forward and backward of the model under autocast, median of ``--rounds`` rounds taken in turns over the
  schemes of the grid; ``/none``: that time over ``none``'s.

``--before DIR`` runs the same measurement on the vitrel source tree in ``DIR`` (e.g. ``git archive <commit>`` of
the code before a change) in its own process, grid by grid in turns with this tree's, and adds the ratio of this
tree's time to that one's (``ms / before``)::

    mkdir -p /tmp/before && git archive c5069b6 | tar -x -C /tmp/before    # the code before the change
    OMP_NUM_THREADS=2 PYTHONPATH=. python bench/pape_autocast.py --before /tmp/before --out /tmp/pape_autocast.md
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SCHEMES = {
    "none": "none",
    "pape": "pape",
    "pape:channels=parabolas": {"name": "pape", "channels": "parabolas"},
    "pape_ri": "pape_ri",
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).norm() / ref.norm()).item()


def model(pos, grid: int):
    import vitrel

    torch.manual_seed(0)
    return vitrel.create_model("vitrel_vit_tiny_patch16_224", pos=pos, depth=2, img_size=16 * grid)


def errors(pos, grid: int, dtype: torch.dtype) -> dict[str, float]:
    from vitrel import Attention

    m = model(pos, grid).eval()
    m64 = copy.deepcopy(m).double()
    torch.manual_seed(1)
    x = torch.randn(1, 3, 16 * grid, 16 * grid)
    ref = m64.forward_features(x.double())
    g = torch.randn_like(ref)
    (ref * g).sum().backward()
    with torch.autocast("cpu", dtype=dtype):
        out = m.forward_features(x)
    (out.double() * g).sum().backward()
    used = [n for n, p in m64.named_parameters() if p.grad is not None]  # the head is not in forward_features
    grads = [torch.cat([dict(mm.named_parameters())[n].grad.double().flatten() for n in used]) for mm in (m, m64)]
    torch.manual_seed(0)
    a = Attention(192, 3, pos=pos, grid=(grid, grid), num_prefix_tokens=1, attn_impl="eager")
    a64 = copy.deepcopy(a).double()
    t = torch.randn(1, 1 + grid * grid, 192)
    with torch.no_grad():
        lref = a64.logits(t.double(), (grid, grid))
        with torch.autocast("cpu", dtype=dtype):
            logits = a.logits(t, (grid, grid))
    return {
        "out": rel(out.detach(), ref.detach()),
        "grad": rel(grads[0], grads[1]),
        "logits": rel(logits, lref),
        "probs": rel(logits.double().softmax(-1), lref.softmax(-1)),
    }


def times(grid: int, dtype: torch.dtype, rounds: int) -> dict[str, float]:
    from vitrel.bench import alternate

    torch.manual_seed(1)
    x = torch.randn(2, 3, 16 * grid, 16 * grid)
    models = {name: model(pos, grid).train() for name, pos in SCHEMES.items()}

    def step(m):
        def run():
            m.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=dtype):
                out = m.forward_features(x)
            out.float().square().mean().backward()

        return run

    t = alternate({k: step(m) for k, m in models.items()}, rounds, warmup=1, zigzag=True)
    return {k: 1e3 * statistics.median(v) for k, v in t.items()}


def measure(grid: int, dtypes: list[str], rounds: int) -> list[dict]:
    rows = []
    for d in dtypes:
        ms = times(grid, DTYPES[d], rounds)
        for name, pos in SCHEMES.items():
            rows.append({"grid": grid, "dtype": d, "scheme": name, **errors(pos, grid, DTYPES[d]), "ms": ms[name]})
    return rows


def child(src: str, grid: int, dtypes: list[str], rounds: int) -> list[dict]:
    """:func:`measure` in a process that imports vitrel from ``src``."""
    env = {**os.environ, "PYTHONPATH": src}
    args = [sys.executable, __file__, "--child", str(grid), "--dtypes", *dtypes, "--rounds", str(rounds)]
    done = subprocess.run(args, env=env, cwd=src, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the measurement in {src} failed:\n{done.stderr}")
    return json.loads(done.stdout.splitlines()[-1])


def table(rows: list[dict], before: list[dict] | None) -> str:
    head = "| grid | N | dtype | scheme | out | grad | logits | probs | ms | /none |"
    if before:
        head = (
            "| grid | N | dtype | scheme | out before | out | grad before | grad | logits before | logits "
            "| probs before | probs | ms | /none | ms / before |"
        )
    lines = [head, "|" + "---:|" * 2 + "---|---|" + "---:|" * (head.count("|") - 5)]
    none = {(r["grid"], r["dtype"]): r["ms"] for r in rows if r["scheme"] == "none"}
    old = {(r["grid"], r["dtype"], r["scheme"]): r for r in before or []}
    for r in rows:
        key = (r["grid"], r["dtype"], r["scheme"])
        cells = [str(r["grid"]), str(1 + r["grid"] ** 2), r["dtype"], r["scheme"]]
        for k in ("out", "grad", "logits", "probs"):
            cells += [f"{old[key][k]:.1e}", f"{r[k]:.1e}"] if before else [f"{r[k]:.1e}"]
        cells += [f"{r['ms']:.0f}", f"{r['ms'] / none[key[:2]]:.2f}x"]
        if before:
            cells.append(f"{r['ms'] / old[key]['ms']:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--grids", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--before", help="a vitrel source tree to measure as well, in its own process")
    ap.add_argument("--out", help="write the table here (markdown)")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(measure(args.child, args.dtypes, args.rounds)))
        return
    rows, before = [], [] if args.before else None
    for grid in args.grids:
        if args.before:
            before += child(str(Path(args.before).resolve()), grid, args.dtypes, args.rounds)
        rows += child(str(ROOT), grid, args.dtypes, args.rounds)
        print(f"grid {grid} done", file=sys.stderr, flush=True)
    from vitrel.bench import machine_info, source_commit

    text = (
        f"{machine_info()['description']}, torch {torch.__version__}; this tree {source_commit(ROOT)}"
        + (f", before: {args.before}" if args.before else "")
        + f"; times: median of {args.rounds} rounds, fwd+bwd, batch 2\n\n"
        + table(rows, before)
        + "\n"
    )
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
