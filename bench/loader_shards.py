"""Training loader throughput: ImageNet from webdataset shards (and a streamed Hugging Face parquet copy)
against the same images as an ImageFolder tree.

``--images`` JPEGs (random sizes ``--min-size``..``--max-size`` px, smooth colour fields with noise,
quality 90) in ``--classes`` class folders are written to a temporary folder, then to webdataset shards
(``python -m vitrel.data.shards write-wds``'s ``write_wds``, ``--shard-size``) and to parquet
(``write_hf``). Each variant is ``ImageNetDataModule(...).train_dataloader()`` with the same settings
(``img_size``, timm's training transform with ``augment``, batch size, ``--workers`` persistent workers):

* ``folder``: ``root=<tree>`` (torchvision ``ImageFolder``, shuffled ``DataLoader``);
* ``wds``: ``source="wds/imagenet"`` (timm's ``ReaderWds``);
* ``hfids``: ``source="hfids/<parquet folder>"`` (timm's ``ReaderHfids``, streaming the parquet files).

A timed call is one training epoch (every batch of the loader; the shard paths' epoch covers whole
batches per worker, so it may hold a few more images than the tree: images/s counts the images
yielded). One untimed epoch first starts the persistent workers; then the variants take turns
(``vitrel.bench.alternate``) for ``--rounds`` rounds; medians.

    OMP_NUM_THREADS=1 python bench/loader_shards.py --rounds 5 --out bench/results/loader_shards_cpu.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from vitrel.bench import alternate, machine_info
from vitrel.data import ImageNetDataModule
from vitrel.data.shards import write_hf, write_wds


def make_tree(root: Path, n: int, classes: int, lo: int, hi: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for i in range(n):
        c = i % classes
        h, w = (int(v) for v in rng.integers(lo, hi + 1, 2))
        yy, xx = np.mgrid[0:h, 0:w] / max(h, w)
        base = rng.uniform(0, 255, 3) * np.stack([yy, xx, 1 - yy], -1) + rng.normal(0, 20, (h, w, 3))
        d = root / "train" / f"n{c:08d}"
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(base.clip(0, 255).astype(np.uint8)).save(d / f"{i:06d}.JPEG", quality=90)
    for c in range(classes):  # a val folder per class (the module checks the layout)
        (root / "val" / f"n{c:08d}").mkdir(parents=True, exist_ok=True)


def epoch(loader) -> int:
    return sum(len(y) for _, y in loader)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=400)
    p.add_argument("--classes", type=int, default=4)
    p.add_argument("--min-size", type=int, default=64)
    p.add_argument("--max-size", type=int, default=224)
    p.add_argument("--shard-size", type=int, default=50)
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--augment", type=int, default=1, help="timm's training augmentation (1) or plain resize (0)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path, default=None, help="write the table (markdown) here")
    args = p.parse_args(argv)
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        make_tree(tmp / "tree", args.images, args.classes, args.min_size, args.max_size)
        write_wds(tmp / "tree", tmp / "wds", shard_size=args.shard_size)
        write_hf(tmp / "tree", tmp / "hf", shard_size=args.shard_size)
        common = dict(
            img_size=args.img_size,
            augment=bool(args.augment),
            batch_size=args.batch_size,
            num_workers=args.workers,
            pin_memory=False,
        )
        modules = {
            "folder": ImageNetDataModule(root=tmp / "tree", **common),
            "wds": ImageNetDataModule(root=tmp / "wds", source="wds/imagenet", **common),
            "hfids": ImageNetDataModule(root=tmp / "cache", source=f"hfids/{tmp / 'hf'}", **common),
        }
        loaders = {k: m.train_dataloader() for k, m in modules.items()}
        counts = {k: epoch(dl) for k, dl in loaders.items()}  # starts the persistent workers
        times = alternate({k: (lambda dl=dl: epoch(dl)) for k, dl in loaders.items()}, args.rounds, warmup=0)
    load1 = os.getloadavg()
    med = {k: statistics.median(v) for k, v in times.items()}
    rate = {k: counts[k] / med[k] for k in med}
    info = machine_info()
    lines = [
        f"Machine: {info['description']}; torch {info['torch']}. Shared with other jobs, noisy: compare ratios.",
        f"Load average (1, 5, 15 min) before: {' '.join(f'{v:.2f}' for v in load0)}; "
        f"after: {' '.join(f'{v:.2f}' for v in load1)}",
        f"Command: `OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '?')} python bench/loader_shards.py "
        + " ".join(sys.argv[1:])
        + "`",
        f"Data: {args.images} JPEGs {args.min_size}-{args.max_size} px, {args.classes} classes; shards of "
        f"{args.shard_size}; img_size {args.img_size}, augment={bool(args.augment)}, batch {args.batch_size}, "
        f"{args.workers} persistent workers; one training epoch per call, {args.rounds} rounds (alternating).",
        "",
        "| path | images an epoch | s per epoch (median) | rounds (s) | images/s | vs folder |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for k in med:
        rounds = ", ".join(f"{t:.2f}" for t in times[k])
        lines.append(
            f"| {k} | {counts[k]} | {med[k]:.2f} | {rounds} | {rate[k]:.0f} | **{rate[k] / rate['folder']:.2f}x** |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
