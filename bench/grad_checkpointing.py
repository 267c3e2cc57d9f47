"""Memory and time of gradient checkpointing (``model.set_grad_checkpointing()``, ``module.grad_checkpointing``) on
each model family: bytes autograd keeps for backward outside the checkpointed blocks, the profiler's peak of live
allocations in one forward + backward (``vitrel.bench.cpu_peak_bytes``: activations, gradients, temporaries; weights
excluded), and the step time with over without, alternated in one process.

    PYTHONPATH=$PWD python bench/grad_checkpointing.py [--batch 8] [--rounds 5] [--out FILE]
"""

from __future__ import annotations

import argparse

import torch

import vitrel
from vitrel import bench

MODELS = {  # small CPU sizes of each family: (name, arguments)
    "vit": ("vitrel_vit_tiny_patch4_32", dict(depth=6, embed_dim=96, num_heads=3)),
    "swin": ("vitrel_swin_tiny_patch2_window4_32", dict(embed_dim=48, depths=(2, 2, 2, 2), num_heads=(3, 3, 6, 6))),
    "video vit": ("vitrel_vit_video_tiny_patch4_32", dict(depth=6, embed_dim=96, num_heads=3, patch_size=8)),
    "swin3d": (
        "vitrel_swin3d_tiny_patch122_window444_32",
        dict(embed_dim=48, depths=(2, 2, 2, 2), num_heads=(3, 3, 6, 6)),
    ),
}
SCHEMES = {
    "vit": ["rel2d_full", "rel2d_cpb", "rope2d_mixed", "lookhere", "shaw2d_full"],
    "swin": ["rel2d_full", "rel2d_cpb", "rope2d_mixed"],
    "video vit": ["rel3d_full", "rope3d_mixed"],
    "swin3d": ["rel3d_full", "rope3d_mixed"],
}


def measure(family: str, pos: str, batch: int, rounds: int) -> list[float]:
    name, kw = MODELS[family]
    torch.manual_seed(0)
    m = vitrel.create_model(name, pos=pos, **kw).train()
    c, h, w = m.pretrained_cfg["input_size"]
    x = torch.randn(batch, c, h, w) if "video" not in name and "3d" not in name else torch.randn(batch, c, 8, h, w)

    def step() -> None:
        m(x).sum().backward()
        m.zero_grad(set_to_none=True)

    row = []
    for ckpt in (False, True):
        m.set_grad_checkpointing(ckpt)
        row.append(bench.saved_bytes(lambda: m(x).sum()) / 2**20)
        m.zero_grad(set_to_none=True)
        row.append(bench.cpu_peak_bytes(step) / 2**20)

    def set_and_step(ckpt: bool):
        return lambda: (m.set_grad_checkpointing(ckpt), step())

    fns = {"off": set_and_step(False), "on": set_and_step(True)}
    times = bench.medians(bench.alternate(fns, rounds=rounds, zigzag=True))
    return [*row, times["on"] / times["off"]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lines = [
        f"batch {args.batch}, float32, {bench.machine_info('cpu')['description']}",
        "",
        "| model | pos | saved MiB off | saved MiB on | peak MiB off | peak MiB on | step time on / off |",
        "|---|---|---|---|---|---|---|",
    ]
    for family, schemes in SCHEMES.items():
        for pos in schemes:
            s0, p0, s1, p1, t = measure(family, pos, args.batch, args.rounds)
            lines.append(f"| {family} | `{pos}` | {s0:.1f} | {s1:.1f} | {p0:.1f} | {p1:.1f} | {t:.2f} |")
    bench.emit(lines, args.out)


if __name__ == "__main__":
    main()
