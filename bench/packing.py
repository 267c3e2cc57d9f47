"""Packed vs padded vs fixed-resolution training on the same images: useful tokens/s, images/s, padding.

The images: Fashion-MNIST test images (real data), each resized to its own size (side scale drawn from
``--scales``, aspect ratio from 3/4 to 4/3, sides rounded to whole 4-pixel patches), patchified by timm's
``Patchify``. Three ways to train on them, one ViT (patch 4) per scheme, the same weights for every way:

* ``packed``: :class:`vitrel.data.packing.PackingCollator` (greedy first fit into rows of ``--seq-len`` tokens,
  ``segment_ids``; a block-diagonal mask keeps the images apart);
* ``padded``: the same collator in ``pad`` mode (timm NaFlex's way: one image per row, padded to the longest);
* ``fixed``: every image resized to one square size with about the mean number of tokens (the ordinary path).

A training step is forward, cross-entropy, backward and an SGD step; the variants take turns
(``vitrel.bench.alternate``) for ``--rounds`` rounds over the same ``--batches`` batches of ``--batch`` images, and the
table gives medians. "Useful tokens" are the images' patch tokens (padding excluded); for ``fixed`` they are its
resized images' tokens. The figure (``--figure``) is the first packed batch and its attention mask with block 0's
bias.

    OMP_NUM_THREADS=2 python bench/packing.py --rounds 5 --out bench/results/packing_cpu.md \
        --figure bench/results/packed_batch.png
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from timm.data.naflex_transforms import patchify_image

import vitrel
from vitrel.bench import alternate, machine_info
from vitrel.data.fashion_mnist import load_embedded_subset
from vitrel.data.packing import PackingCollator

PATCH = 4


def mixed_images(n: int, scales: tuple[float, float], seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``n`` normalised Fashion-MNIST test images ``[1, h_i, w_i]`` at random sizes, and their labels."""
    imgs, labels = load_embedded_subset("test")  # real Fashion-MNIST test images (the subset shipped with vitrel)
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        s = scales[0] + (scales[1] - scales[0]) * float(torch.rand((), generator=g))
        a = math.exp(math.log(4 / 3) * (2 * float(torch.rand((), generator=g)) - 1))
        h = max(2, round(28 * s * math.sqrt(a) / PATCH)) * PATCH
        w = max(2, round(28 * s / math.sqrt(a) / PATCH)) * PATCH
        x = torch.from_numpy(imgs[i]).float()[None, None] / 255.0
        x = F.interpolate(x, size=(h, w), mode="bilinear", align_corners=False)[0]
        out.append((x - 0.286) / 0.353)
    return out, torch.from_numpy(labels[:n]).long()


def batches(imgs, labels, batch: int, seq_len: int, fixed: int) -> dict[str, list]:
    """The same images as packed, padded and fixed-size batches."""
    out: dict[str, list] = {"packed": [], "padded": [], "fixed": []}
    longest = max(i.shape[1] * i.shape[2] // PATCH**2 for i in imgs)
    pack, pad = PackingCollator(seq_len, "pack"), PackingCollator(longest, "pad")
    for s in range(0, len(imgs) - batch + 1, batch):
        items = []
        for x, y in zip(imgs[s : s + batch], labels[s : s + batch]):
            p, c, v = patchify_image(x, (PATCH, PATCH))
            items.append(({"patches": p, "patch_coord": c, "patch_valid": v}, int(y)))
        out["packed"].append(pack(items))
        out["padded"].append(pad(items))
        sq = torch.stack([F.interpolate(x[None], size=(fixed, fixed), mode="bilinear")[0] for x in imgs[s : s + batch]])
        out["fixed"].append((sq, labels[s : s + batch]))
    return out


def useful_tokens(b) -> int:
    x = b[0]
    if isinstance(x, dict):
        return int(x["patch_valid"].sum())
    return x.shape[0] * (x.shape[-2] // PATCH) * (x.shape[-1] // PATCH)


def step_fn(model, opt, data):
    def run() -> None:
        for x, y in data:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()

    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schemes", default="rel2d_full,rope2d_mixed,shaw2d_factored")
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--scales", default="0.5,2.0", help="side scale range against 28 px")
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--figure", type=Path, default=None)
    args = ap.parse_args(argv)
    scales = tuple(float(v) for v in args.scales.split(","))
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {args.rounds}")
    if args.images < args.batch:
        raise SystemExit(f"--images {args.images} makes no batch of --batch {args.batch}: give at least that many")
    imgs, labels = mixed_images(args.images, scales, args.seed)
    tokens = [i.shape[1] * i.shape[2] // PATCH**2 for i in imgs]
    if max(tokens) > args.seq_len:  # (a packed row holds whole images)
        raise SystemExit(
            f"--seq-len {args.seq_len} is shorter than the largest image ({max(tokens)} tokens at --scales "
            f"{args.scales}): give --seq-len {max(tokens)} or more, or smaller --scales"
        )
    fixed = max(2, round(math.sqrt(statistics.mean(tokens)))) * PATCH
    data = batches(imgs, labels, args.batch, args.seq_len, fixed)
    pads = {k: statistics.mean(float(b[0]["padding_fraction"]) for b in data[k]) for k in ("packed", "padded")}
    rows_per = {k: statistics.mean(b[0]["patches"].shape[0] for b in data[k]) for k in ("packed", "padded")}
    n_img = len(data["fixed"]) * args.batch
    useful = {k: sum(useful_tokens(b) for b in v) for k, v in data.items()}
    lines = [
        "# Packed vs padded vs fixed-resolution training (CPU)",
        "",
        f"Machine: {machine_info()['description']}; torch {torch.__version__}.",
        f"Command: `OMP_NUM_THREADS={torch.get_num_threads()} python bench/packing.py {' '.join(sys.argv[1:])}`",
        "",
        f"{n_img} Fashion-MNIST test images at their own sizes (side scale {scales[0]}-{scales[1]} x 28 px, aspect "
        f"3/4-4/3, patch {PATCH}): {min(tokens)}-{max(tokens)} tokens per image, mean {statistics.mean(tokens):.1f}. "
        f"Batches of {args.batch} images. packed: rows of {args.seq_len} tokens, {rows_per['packed']:.1f} rows per "
        f"batch, padding {pads['packed']:.1%}; padded: one row per image of {data['padded'][0][0]['seq_len']} "
        f"tokens, padding {pads['padded']:.1%}; fixed: {fixed}x{fixed} px ({(fixed // PATCH) ** 2} tokens per image, "
        "no padding). ViT, embed 192, 3 heads, depth "
        f"{args.depth}, SGD step; medians of {args.rounds} rounds, the variants taking turns.",
        "",
        "| scheme | way | step time per image (ms) | images/s | useful tokens/s | time vs packed |",
        "|---|---|---:|---:|---:|---:|",
    ]
    figure_done = False
    for name in args.schemes.split(","):
        torch.manual_seed(args.seed)
        model = vitrel.create_model(
            "vitrel_vit_tiny_patch4_32", pos=name, img_size=28, in_chans=1, num_classes=10, depth=args.depth
        )
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        model.train()
        times = alternate({k: step_fn(model, opt, v) for k, v in data.items()}, args.rounds)
        med = {k: statistics.median(v) for k, v in times.items()}
        for k in data:
            lines.append(
                f"| {name} | {k} | {1e3 * med[k] / n_img:.2f} | {n_img / med[k]:.0f} | {useful[k] / med[k]:.0f} | "
                f"{med[k] / med['packed']:.2f}x |"
            )
        print("\n".join(lines[-3:]), flush=True)
        if args.figure is not None and not figure_done:
            from vitrel.viz import plot_packed_batch

            first = data["packed"][0][0]
            few = {k: v[:3] for k, v in first.items() if k in ("patches", "patch_coord", "patch_valid", "segment_ids")}
            scheme = model.blocks[0].attn.pos
            fig = plot_packed_batch(few, scheme, model.num_prefix_tokens, patch_size=PATCH)
            args.figure.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(args.figure, dpi=120)
            figure_done = True
    text = "\n".join(lines) + "\n"
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
