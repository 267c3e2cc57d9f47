"""timm's RandAugment / AutoAugment under Pillow 13: posterize keeping 0 bits (vitrel.data.timm_compat)."""

from __future__ import annotations

import random

import numpy as np
from PIL import Image, ImageOps
from timm.data.auto_augment import AugmentOp

import vitrel.data  # noqa: F401  (points timm's posterize ops at vitrel's)
from vitrel.data.transforms import augment_transform


def _img() -> Image.Image:
    return Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8))


def test_posterize_of_0_bits_is_a_black_image_and_others_are_pillows():
    """Pillow 13 refuses ``ImageOps.posterize(img, 0)``, which timm's ``PosterizeIncreasing`` asks at magnitude 10 and
    ``Posterize`` below 2.5: ``ValueError: bits must be between or equal to 1 and 8``. 0 bits is a black image (what
    Pillow gave before 13, and what the policies mean); other levels are Pillow's posterize."""
    img = _img()
    for name, magnitude in (("PosterizeIncreasing", 10), ("Posterize", 0)):
        out = AugmentOp(name, prob=1.0, magnitude=magnitude)(img)
        assert out.mode == "RGB" and out.size == img.size and not np.asarray(out).any()
    out = AugmentOp("PosterizeIncreasing", prob=1.0, magnitude=5)(img)  # 4 - int(0.5 * 4) = 2 bits
    assert np.array_equal(np.asarray(out), np.asarray(ImageOps.posterize(img, 2)))


def test_the_recipes_randaugment_runs_through_posterize_at_full_magnitude():
    """``experiment=cifar10_vit``'s ``rand-m9-mstd0.5-inc1`` stopped the run in a loader worker once a posterize drew
    magnitude 10; here every image draws 3 ops at magnitude 10."""
    random.seed(0)
    np.random.seed(0)
    tf = augment_transform(32, (0.5,) * 3, (0.25,) * 3, auto_augment="rand-n3-m10-mstd0-inc1")
    img = _img()
    assert all(tf(img).shape == (3, 32, 32) for _ in range(40))
