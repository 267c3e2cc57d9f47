"""timm's augmentations with the Pillow installed: RandAugment / AutoAugment's posterize keeping 0 bits.

timm's ``Posterize`` ops map the top (``PosterizeIncreasing``, RandAugment's ``inc1`` policies: magnitude 10) or the
bottom (``Posterize``: magnitudes below 2.5; AutoAugment's ``v0`` policy) of their range to 0 bits kept: a black
image (TensorFlow's AutoAugment, timm's note "This results in black image with Tpu posterize"), which is what
``PIL.ImageOps.posterize(img, 0)`` gave before Pillow 13. Pillow 13 refuses ``bits`` outside 1..8 with a
``ValueError``, so a run with ``data.augment_kwargs.auto_augment=rand-m9-mstd0.5-inc1`` (``experiment=cifar10_vit``,
``cifar100_swin``, ``imagenet_vit_small``) stopped in a loader worker after a few hundred images.
:func:`patch_posterize` (run when :mod:`vitrel.data` is imported) points timm's ops at :func:`posterize`, which
gives that black image for 0 bits and is timm's function otherwise.
"""

from __future__ import annotations

from typing import Any

from PIL import Image, ImageOps

__all__ = ["posterize", "patch_posterize"]


def posterize(img: Image.Image, bits_to_keep: int, **__: Any) -> Image.Image:
    """timm's ``posterize``: the ``bits_to_keep`` most significant bits of every channel; 8 or more: the image, 0 (or
    fewer): every value 0, as Pillow gave before 13."""
    if bits_to_keep >= 8:
        return img
    if bits_to_keep <= 0:
        return img.point(lambda _: 0)
    return ImageOps.posterize(img, bits_to_keep)


def patch_posterize() -> None:
    """Point timm's ``auto_augment.posterize`` and the ops that use it (``NAME_TO_OP``) at :func:`posterize`
    (idempotent; ops built before keep timm's)."""
    from timm.data import auto_augment

    original = auto_augment.posterize
    if original is posterize:
        return
    auto_augment.posterize = posterize
    for name, op in list(auto_augment.NAME_TO_OP.items()):
        if op is original:
            auto_augment.NAME_TO_OP[name] = posterize
