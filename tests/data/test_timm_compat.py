"""timm's RandAugment / AutoAugment under Pillow 13: posterize keeping 0 bits (vitrel.data.timm_compat)."""

from __future__ import annotations

import random

import numpy as np
import pytest
from PIL import Image, ImageOps
from timm.data import auto_augment
from timm.data.auto_augment import AugmentOp

from vitrel.data.timm_compat import black_posterize, posterize
from vitrel.data.transforms import augment_transform


def _img() -> Image.Image:
    return Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8))


def _ops(tf) -> list[AugmentOp]:
    found: list[AugmentOp] = []

    def walk(t):
        if isinstance(t, AugmentOp):
            found.append(t)
        for attr in ("transforms", "ops", "policy"):
            for u in getattr(t, attr, None) or ():
                walk(u) if not isinstance(u, list) else [walk(v) for v in u]

    walk(tf)
    return found


def test_posterize_of_0_bits_is_a_black_image_and_others_are_pillows():
    """Pillow 13 refuses ``ImageOps.posterize(img, 0)``, which timm's ``PosterizeIncreasing`` asks at magnitude 10 and
    ``Posterize`` below 2.5: ``ValueError: bits must be between or equal to 1 and 8``. 0 bits is a black image (what
    Pillow gave before 13, and what the policies mean); other levels are Pillow's posterize."""
    img = _img()
    for name, magnitude in (("PosterizeIncreasing", 10), ("Posterize", 0)):
        out = black_posterize([AugmentOp(name, prob=1.0, magnitude=magnitude)])[0](img)
        assert out.mode == "RGB" and out.size == img.size and not np.asarray(out).any()
    out = black_posterize([AugmentOp("PosterizeIncreasing", prob=1.0, magnitude=5)])[0](img)  # 4 - 2 = 2 bits
    assert np.array_equal(np.asarray(out), np.asarray(ImageOps.posterize(img, 2)))
    assert auto_augment.NAME_TO_OP["Posterize"] is not posterize  # timm itself left as it is


@pytest.mark.parametrize("policy", ["rand-n3-m10-mstd0-inc1", "original", "augmix-m5-w3"])
def test_the_recipes_augmentations_run_through_posterize_at_full_magnitude(policy):
    """``experiment=cifar10_vit``'s ``rand-m9-mstd0.5-inc1`` stopped the run in a loader worker once a posterize drew
    magnitude 10; here every image draws 3 ops at magnitude 10. AutoAugment's and AugMix's posterize ops are pointed
    at vitrel's too."""
    random.seed(0)
    np.random.seed(0)
    tf = augment_transform(32, (0.5,) * 3, (0.25,) * 3, auto_augment=policy)
    posterizes = [op for op in _ops(tf) if op.name.startswith("Posterize")]
    assert posterizes and all(op.aug_fn is posterize for op in posterizes)
    img = _img()
    assert all(tf(img).shape == (3, 32, 32) for _ in range(40))


def test_the_naflex_training_pipeline_posterizes_0_bits_black_too():
    """``data.packing`` with ``augment_kwargs.auto_augment``: timm's NaFlex training transforms, same ops."""
    from vitrel.data.packing import naflex_transform

    random.seed(0)
    tf = naflex_transform(
        train=True, patch_size=4, max_tokens=64, mean=(0.5,) * 3, std=(0.25,) * 3, augment=True,
        auto_augment="rand-n3-m10-mstd0-inc1",
    )  # fmt: skip
    posterizes = [op for op in _ops(tf) if op.name.startswith("Posterize")]
    assert posterizes and all(op.aug_fn is posterize for op in posterizes)
    assert all(tf(_img())["patches"].shape[-1] == 4 * 4 * 3 for _ in range(20))
