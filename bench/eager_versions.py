"""Eager speed of two vitrel versions in one run: did a change make the plain PyTorch path slower?

Each version runs in its own worker process (``PYTHONPATH`` = that checkout), which builds the same
models with the same seed and times, on command, ``--steps`` training steps (forward, cross-entropy,
backward, AdamW step) or inference forwards (``torch.inference_mode``) of one model. The driver asks
the two workers in turn (zigzag: before, after, after, before, ...), ``--rounds`` times per model, so
both versions see the same machine load; the table has the medians and after / before.

    git worktree add /tmp/v0 839c787      # vitrel 0.1.0
    python bench/eager_versions.py --before /tmp/v0 --after . \
        --out bench/results/eager_versions_cpu_2026-11-23_since_0.1.0.md

Models: the default recipe's ViT (``vit_tiny_fmnist``: width 64, depth 4, 28x28, patch 4) and the
study's Swin (width 32, depths 2-2, 4x4 windows), with each ``--schemes`` entry; batch ``--batch-size``.
``--archs packed``: the ViT on NaFlex rows of two images of different sizes each (a token layout, ``segment_ids``).
``--archs attn``: one ``vitrel.Attention`` layer (width 64, 4 heads, a 4 x 4 grid and a class token, batch 1),
where the host's work per forward (choosing the kernel, preparing the scheme's state) is most of its time:

    python bench/eager_versions.py --before /tmp/v56 --archs attn --schemes rel2d_full,lookhere --steps 200
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

MODELS = {
    "vit": dict(name="vitrel_vit_tiny_patch4_32", img_size=28, in_chans=1, num_classes=10, embed_dim=64, depth=4,
                num_heads=4, mlp_ratio=2.0, global_pool="avg"),
    "swin": dict(name="vitrel_swin_tiny_patch2_window4_32", img_size=28, in_chans=1, num_classes=10, patch_size=4,
                 window_size=4, embed_dim=32, depths=[2, 2], num_heads=[2, 4], mlp_ratio=2.0),
    "attn": dict(layer=True, dim=64, num_heads=4, grid=[4, 4], num_prefix_tokens=1, batch=1),
    # the ViT on a NaFlex batch: two images a row (segment_ids), their sizes in turn from `packed`
    "packed": dict(name="vitrel_vit_tiny_patch4_32", img_size=28, in_chans=1, num_classes=10, embed_dim=64, depth=4,
                   num_heads=4, mlp_ratio=2.0, global_pool="avg", packed=[[28, 28], [16, 24], [24, 12], [20, 28]]),
}  # fmt: skip

SCHEMES = ["none", "ape", "rel2d_full", "rel2d_factored", "rel2d_cpb", "alibi2d", "rope2d_mixed", "shaw2d_factored"]

# the worker: builds every case once, then answers "<case> <mode>" lines with the seconds it took
WORKER = r"""
import json, sys, time
import torch
import vitrel

cfg = json.loads(sys.argv[1])
torch.set_num_threads(cfg["threads"])

def naflex(n, sizes, chans, g):  # timm's NaFlex dict: n images of `sizes` in turn, two a row, 4 px patches
    from timm.data.naflex_transforms import patchify_image
    rows = []
    for r in range(n // 2):
        parts = [patchify_image(torch.randn(chans, *sizes[(2 * r + i) % len(sizes)], generator=g), (4, 4))
                 for i in range(2)]
        seg = torch.cat([torch.full((q[0].shape[0],), s) for s, q in enumerate(parts)])
        rows.append([torch.cat([q[k] for q in parts]) for k in range(3)] + [seg])
    m = max(r[0].shape[0] for r in rows)
    pad = lambda t: torch.nn.functional.pad(t, (0, 0, 0, m - len(t)) if t.dim() == 2 else (0, m - len(t)))
    keys = ["patches", "patch_coord", "patch_valid", "segment_ids"]
    return {k: torch.stack([pad(r[i]) for r in rows]) for i, k in enumerate(keys)}

cases = {}
for key, (arch, scheme) in cfg["cases"].items():
    torch.manual_seed(0)
    kw = dict(cfg["models"][arch])
    g = torch.Generator().manual_seed(0)
    if kw.pop("layer", False):  # one attention layer: y is its grid
        model = vitrel.Attention(kw["dim"], kw["num_heads"], pos=scheme, grid=kw["grid"],
                                 num_prefix_tokens=kw["num_prefix_tokens"])
        n = kw["num_prefix_tokens"] + kw["grid"][0] * kw["grid"][1]
        cases[key] = (model, None, torch.randn(kw["batch"], n, kw["dim"], generator=g), tuple(kw["grid"]))
        continue
    sizes = kw.pop("packed", None)
    model = vitrel.create_model(kw.pop("name"), pos=scheme, **kw)
    x = torch.randn(cfg["batch"], kw["in_chans"], kw["img_size"], kw["img_size"], generator=g)
    if sizes:
        x = naflex(cfg["batch"], sizes, kw["in_chans"], g)
    y = torch.randint(0, kw["num_classes"], (cfg["batch"],), generator=g)
    cases[key] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4), x, y)

def train(model, opt, x, y):
    model.train()
    if opt is None:  # an attention layer: forward and backward
        model(x, y).sum().backward()
        return
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()

def infer(model, opt, x, y):
    with torch.inference_mode():
        model.eval()(x, y) if opt is None else model.eval()(x)

print("ready", flush=True)
for line in sys.stdin:
    key, mode, *calls = line.split()
    fn = train if mode == "train" else infer
    if calls:  # the Python function calls of the steps (cProfile's count: the host's work, whatever the load)
        import cProfile, pstats
        prof = cProfile.Profile()
        prof.runcall(lambda: [fn(*cases[key]) for _ in range(cfg["steps"])])
        print(pstats.Stats(prof).total_calls, flush=True)
        continue
    t0 = time.perf_counter()
    for _ in range(cfg["steps"]):
        fn(*cases[key])
    print(time.perf_counter() - t0, flush=True)
"""


class Worker:
    def __init__(self, tree: Path, cfg: dict) -> None:
        env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKER, json.dumps(cfg)], cwd=tree, env=env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )  # fmt: skip
        if self.proc.stdout.readline().strip() != "ready":  # type: ignore[union-attr]
            raise RuntimeError(f"the worker for {tree} did not start")

    def time(self, key: str, mode: str, calls: bool = False) -> float:
        """Seconds of ``--steps`` steps of ``key`` in ``mode``; with ``calls``, their Python function calls."""
        self.proc.stdin.write(f"{key} {mode}{' calls' if calls else ''}\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return float(self.proc.stdout.readline())  # type: ignore[union-attr]

    def close(self) -> None:
        self.proc.stdin.close()  # type: ignore[union-attr]
        self.proc.wait()


def git_rev(tree: Path) -> str:
    out = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "?"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="checkout of the earlier version")
    ap.add_argument("--after", default=".", help="checkout of the later version (default: this one)")
    ap.add_argument(
        "--schemes", default="none,ape,rel2d_full,rel2d_factored,rel2d_cpb,alibi2d,rope2d_mixed,shaw2d_factored"
    )
    ap.add_argument("--archs", default="vit,swin")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5, help="steps per timing")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--out", default=None, help="write the Markdown table here")
    ap.add_argument("--calls", action="store_true", help="also count each step's Python function calls (cProfile)")
    args = ap.parse_args(argv)
    cases = {f"{a}/{s}": (a, s) for a in args.archs.split(",") for s in args.schemes.split(",")}
    cfg = dict(cases=cases, models=MODELS, batch=args.batch_size, steps=args.steps, threads=args.threads)
    trees = {"before": Path(args.before), "after": Path(args.after)}
    load0 = os.getloadavg()
    workers = {k: Worker(t, cfg) for k, t in trees.items()}
    times: dict[tuple[str, str, str], list[float]] = {}
    order = ["before", "after"]
    for key in cases:  # warm-up: one untimed step of each kind
        for mode in ("train", "infer"):
            for w in workers.values():
                w.time(key, mode)
    for r in range(args.rounds):
        for key in cases:
            for mode in ("train", "infer"):
                for v in order if r % 2 == 0 else order[::-1]:
                    times.setdefault((key, mode, v), []).append(workers[v].time(key, mode) / args.steps)
        print(f"round {r + 1}/{args.rounds} timed", flush=True)
    calls = {}  # (key, mode, version): Python function calls a step
    for key in cases if args.calls else ():
        for mode in ("train", "infer"):
            for v in order:
                calls[(key, mode, v)] = workers[v].time(key, mode, calls=True) / args.steps
    for w in workers.values():
        w.close()
    load1 = os.getloadavg()
    revs = {k: git_rev(t) for k, t in trees.items()}
    lines = [
        "# Eager speed: two vitrel versions, same run\n",
        f"- Command: `python bench/eager_versions.py {' '.join(sys.argv[1:] if argv is None else argv)}`",
        f"- Versions: before = {revs['before']} ({args.before}), after = {revs['after']} ({args.after}); "
        f"torch {torch.__version__}, {os.cpu_count()} cores, {args.threads} torch thread(s) per worker",
        f"- Load average (1, 5, 15 min) at start {' '.join(f'{x:.2f}' for x in load0)}, at end "
        f"{' '.join(f'{x:.2f}' for x in load1)}",
        f"- Batch {args.batch_size} (an attention layer: 1); each timing {args.steps} steps; {args.rounds} rounds, "
        "versions alternating (zigzag), after one untimed warm-up timing each; medians of ms per step. `train` = "
        "forward + cross-entropy + backward + AdamW step (an attention layer: forward + backward of its sum), "
        "`infer` = forward under `torch.inference_mode`.\n",
        "| model | scheme | train before ms | train after ms | after / before | infer before ms | infer after ms "
        "| after / before |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    ratios = {"train": [], "infer": []}
    for key, (arch, scheme) in cases.items():
        cells = []
        for mode in ("train", "infer"):
            b, a = (1e3 * statistics.median(times[(key, mode, v)]) for v in ("before", "after"))
            ratios[mode].append(a / b)
            cells += [f"{b:.1f}", f"{a:.1f}", f"{a / b:.2f}x"]
        lines.append(f"| {arch} | {scheme} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(
        "Median over the models of after / before: train "
        f"{statistics.median(ratios['train']):.2f}x, infer {statistics.median(ratios['infer']):.2f}x."
    )
    if calls:
        lines += [
            "",
            "Python function calls a step (cProfile's count, after the timings; the same whatever the machine's load):",
            "",
            "| model | scheme | train before | train after | infer before | infer after |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for key, (arch, scheme) in cases.items():
            cells = [f"{calls[(key, m, v)]:.0f}" for m in ("train", "infer") for v in order]
            lines.append(f"| {arch} | {scheme} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
