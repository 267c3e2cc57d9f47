"""A probe's training step (``module.freeze_backbone=true``) against the whole model's: bytes autograd keeps for the
backward pass, the profiler's peak of live allocations in one step (``vitrel.bench.cpu_peak_bytes``: weights
excluded) and the time of a step (forward, backward, AdamW step), alternated in one process, medians.

    PYTHONPATH=$PWD python bench/freeze_backbone.py [--batch 16] [--rounds 7] [--out FILE]
"""

from __future__ import annotations

import argparse

import torch

import vitrel
from vitrel import bench
from vitrel.train.module import ClassifierModule

SIZE = dict(depth=6, embed_dim=192, num_heads=3)  # small CPU sizes
PROBE = dict(global_pool="map", attn_pool_type="attentive", attn_pool_depth=2)  # (V-JEPA 2's kind, 2 blocks)
CLIPS = dict(in_chans=3, patch_size=8, num_frames=4, num_segments=2)  # 2 clips of 4 frames an input
MODELS = {  # label: (name, arguments, input shape without the batch)
    "vit, linear": ("vitrel_vit_tiny_patch4_32", SIZE, (3, 32, 32)),
    "vit, map pool": ("vitrel_vit_tiny_patch4_32", {**SIZE, "global_pool": "map"}, (3, 32, 32)),
    "video vit, attentive probe (2 segments)": (
        "vitrel_vit_video_tiny_patch4_32",
        {**SIZE, **CLIPS, **PROBE},
        (3, 8, 32, 32),
    ),  # fmt: skip
}


def measure(label: str, batch: int, rounds: int) -> list[float]:
    name, kw, shape = MODELS[label]
    x, y = torch.randn(batch, *shape), torch.randint(0, 10, (batch,))
    row, fns = [], {}
    for frozen in (False, True):
        torch.manual_seed(0)
        m = vitrel.create_model(name, pos="rel3d_factored" if "video" in name else "rel2d_full", num_classes=10, **kw)
        module = ClassifierModule(m, freeze_backbone=frozen).train()
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)

        def loss(m=m):
            return torch.nn.functional.cross_entropy(m(x), y)

        def step(m=m, opt=opt, loss=loss):
            loss().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()  # (AdamW's state made)
        row += [bench.saved_bytes(loss) / 2**20, bench.cpu_peak_bytes(step) / 2**20]
        fns["frozen" if frozen else "whole"] = step
        del module
    times = bench.medians(bench.alternate(fns, rounds=rounds, zigzag=True))
    return [*row, times["frozen"] / times["whole"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lines = [
        f"# A probe's training step against the whole model's (CPU, batch {args.batch}, medians of {args.rounds})",
        "",
        f"`PYTHONPATH=$PWD python bench/freeze_backbone.py --batch {args.batch} --rounds {args.rounds}`; "
        f"{bench.machine_info()['description']}, torch {torch.__version__}, commit {bench.source_commit()}",
        "",
        "| model | saved for backward, MiB (whole / frozen) | step peak, MiB (whole / frozen) | time frozen / whole |",
        "|---|---|---|---|",
    ]
    for label in MODELS:
        sw, pw, sf, pf, t = measure(label, args.batch, args.rounds)
        lines.append(f"| {label} | {sw:.1f} / {sf:.1f} | {pw:.1f} / {pf:.1f} | {t:.2f} |")
    bench.emit(lines, args.out)


if __name__ == "__main__":
    main()
