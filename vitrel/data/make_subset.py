"""Build the embedded Fashion-MNIST subset shipped as ``vitrel/data/fashion_mnist_subset.npz``.

Stratified, seeded draw from the full set: ``per_class_train`` images of each class from train and
``per_class_test`` from test (default 1000 / 200: 10,000 / 2,000 images), kept in their original
order. The .npz holds ``x_train, y_train, x_test, y_test`` (uint8 ``[N, 28, 28]`` / ``[N]``) and
``idx_train, idx_test`` (positions in the full set, for provenance).

    python -m vitrel.data.make_subset                       # from /usr/share/datasets/fashion-mnist
    python -m vitrel.data.make_subset --root DIR --out X.npz

Fashion-MNIST: (c) Zalando SE, MIT License (see FASHION_MNIST_LICENSE.txt).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from vitrel.data.fashion_mnist import SUBSET_PATH, load_fashion_mnist

__all__ = ["stratified_indices", "make_subset", "main"]


def stratified_indices(labels: np.ndarray, per_class: int, rng: np.random.Generator) -> np.ndarray:
    """Sorted indices with exactly ``per_class`` samples of every class in ``labels`` (no replacement)."""
    picks = []
    for c in np.unique(labels):
        pool = np.flatnonzero(labels == c)
        if len(pool) < per_class:
            raise ValueError(f"class {c} has {len(pool)} samples, fewer than per_class={per_class}")
        picks.append(rng.choice(pool, size=per_class, replace=False))
    return np.sort(np.concatenate(picks))


def make_subset(
    root: str | Path | None = None,
    out: str | Path = SUBSET_PATH,
    per_class_train: int = 1000,
    per_class_test: int = 200,
    seed: int = 0,
) -> Path:
    """Write the stratified subset of the full set found from ``root`` (see ``locate_fashion_mnist``)."""
    rng = np.random.default_rng(seed)
    arrays = {}
    for split, per_class in (("train", per_class_train), ("test", per_class_test)):
        images, labels = load_fashion_mnist(root, split)
        idx = stratified_indices(labels, per_class, rng)
        arrays[f"x_{split}"] = images[idx].astype(np.uint8)
        arrays[f"y_{split}"] = labels[idx].astype(np.uint8)
        arrays[f"idx_{split}"] = idx.astype(np.int32)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, **arrays)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default=None, help="directory with the raw IDX files (default: search the usual places)")
    p.add_argument("--out", default=str(SUBSET_PATH))
    p.add_argument("--per-class-train", type=int, default=1000)
    p.add_argument("--per-class-test", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    out = make_subset(a.root, a.out, a.per_class_train, a.per_class_test, a.seed)
    with np.load(out) as z:
        sizes = {k: z[k].shape for k in z.files}
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB): {sizes}")


if __name__ == "__main__":
    main()
