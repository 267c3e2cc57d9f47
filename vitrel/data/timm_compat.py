"""timm's augmentations with the Pillow installed: RandAugment / AutoAugment's posterize keeping 0 bits.

timm's ``Posterize`` ops map the top (``PosterizeIncreasing``, RandAugment's ``inc1`` policies: magnitude 10) or the
bottom (``Posterize``: magnitudes below 2.5; AutoAugment's ``v0`` policy) of their range to 0 bits kept: a black
image (TensorFlow's AutoAugment, timm's note "This results in black image with Tpu posterize"), which is what
``PIL.ImageOps.posterize(img, 0)`` gave before Pillow 13. Pillow 13 refuses ``bits`` outside 1..8 with a
``ValueError``, so a run with ``data.augment_kwargs.auto_augment=rand-m9-mstd0.5-inc1`` (``experiment=cifar10_vit``,
``cifar100_swin``, ``imagenet_vit_small``) stopped in a loader worker after a few hundred images.
:func:`black_posterize` points the posterize ops of a pipeline vitrel built at :func:`posterize`, which gives that
black image for 0 bits and is timm's function otherwise; timm itself is left as it is.
"""

from __future__ import annotations

from typing import Any

from PIL import Image, ImageOps

__all__ = ["posterize", "black_posterize"]


def posterize(img: Image.Image, bits_to_keep: int, **__: Any) -> Image.Image:
    """timm's ``posterize``: the ``bits_to_keep`` most significant bits of every channel; 8 or more: the image, 0 (or
    fewer): every value 0, as Pillow gave before 13."""
    if bits_to_keep >= 8:
        return img
    if bits_to_keep <= 0:
        return img.point(lambda _: 0)
    return ImageOps.posterize(img, bits_to_keep)


def black_posterize(transform: Any) -> Any:
    """``transform`` (a torchvision ``Compose`` of timm's pipeline) with the posterize ops of its RandAugment /
    AutoAugment / AugMix (``ops``, or ``policy``'s sub-policies) calling :func:`posterize`; returned for chaining."""
    from timm.data.auto_augment import AugmentOp
    from timm.data.auto_augment import posterize as timms

    def walk(t: Any) -> None:
        if isinstance(t, AugmentOp):
            if t.aug_fn is timms:
                t.aug_fn = posterize
        elif isinstance(t, list | tuple):
            for u in t:
                walk(u)
        else:
            for attr in ("transforms", "ops", "policy"):
                if isinstance(getattr(t, attr, None), list | tuple):
                    walk(getattr(t, attr))

    walk(transform)
    return transform
