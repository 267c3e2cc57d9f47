"""V-JEPA 2's video augmentation, written out from their code (facebookresearch/vjepa2, MIT; the RandAugment part
adapted there from timm, Apache-2.0, Ross Wightman): ``src/datasets/utils/video/randaugment.py`` (the ops of the
``inc`` and plain RandAugment lists, their level functions, ``AugmentOp`` over a list of frames, ``RandAugment``,
``rand_augment_transform``'s ``m`` / ``n`` / ``mstd`` / ``inc`` sections), ``src/datasets/utils/video/transforms.py``'s
``create_random_augment`` hyper-parameters, and ``src/datasets/utils/video/randerase.py``'s ``RandomErasing``
with ``cube=True`` (its default). Their names and order of random draws are kept; the reference the tests compare
vitrel's :mod:`vitrel.data.video.augment` against, not vitrel's code.
"""

from __future__ import annotations

import math
import random
import re

import numpy as np
import torch
from PIL import Image, ImageEnhance, ImageOps

_FILL = (128, 128, 128)
_MAX_LEVEL = 10.0


# ------------------------------------------------------------------------------- ops (PIL >= 5.2)
def _check_args_tf(kwargs):
    kwargs["resample"] = kwargs.pop("resample", Image.BILINEAR)  # (their _interpolation: one fixed here)


def shear_x(img, factor, **kwargs):
    _check_args_tf(kwargs)
    return img.transform(img.size, Image.AFFINE, (1, factor, 0, 0, 1, 0), **kwargs)


def shear_y(img, factor, **kwargs):
    _check_args_tf(kwargs)
    return img.transform(img.size, Image.AFFINE, (1, 0, 0, factor, 1, 0), **kwargs)


def translate_x_rel(img, pct, **kwargs):
    pixels = pct * img.size[0]
    _check_args_tf(kwargs)
    return img.transform(img.size, Image.AFFINE, (1, 0, pixels, 0, 1, 0), **kwargs)


def translate_y_rel(img, pct, **kwargs):
    pixels = pct * img.size[1]
    _check_args_tf(kwargs)
    return img.transform(img.size, Image.AFFINE, (1, 0, 0, 0, 1, pixels), **kwargs)


def rotate(img, degrees, **kwargs):
    _check_args_tf(kwargs)
    return img.rotate(degrees, **kwargs)


def solarize_add(img, add, thresh=128, **__):
    lut = [min(255, i + add) if i < thresh else i for i in range(256)]
    if img.mode in ("L", "RGB"):
        if img.mode == "RGB" and len(lut) == 256:
            lut = lut + lut + lut
        return img.point(lut)
    return img


def posterize(img, bits_to_keep, **__):
    if bits_to_keep >= 8:
        return img
    return ImageOps.posterize(img, bits_to_keep)


NAME_TO_OP = {
    "AutoContrast": lambda img, **__: ImageOps.autocontrast(img),
    "Equalize": lambda img, **__: ImageOps.equalize(img),
    "Invert": lambda img, **__: ImageOps.invert(img),
    "Rotate": rotate,
    "Posterize": posterize,
    "PosterizeIncreasing": posterize,
    "Solarize": lambda img, thresh, **__: ImageOps.solarize(img, thresh),
    "SolarizeIncreasing": lambda img, thresh, **__: ImageOps.solarize(img, thresh),
    "SolarizeAdd": solarize_add,
    "Color": lambda img, f, **__: ImageEnhance.Color(img).enhance(f),
    "ColorIncreasing": lambda img, f, **__: ImageEnhance.Color(img).enhance(f),
    "Contrast": lambda img, f, **__: ImageEnhance.Contrast(img).enhance(f),
    "ContrastIncreasing": lambda img, f, **__: ImageEnhance.Contrast(img).enhance(f),
    "Brightness": lambda img, f, **__: ImageEnhance.Brightness(img).enhance(f),
    "BrightnessIncreasing": lambda img, f, **__: ImageEnhance.Brightness(img).enhance(f),
    "Sharpness": lambda img, f, **__: ImageEnhance.Sharpness(img).enhance(f),
    "SharpnessIncreasing": lambda img, f, **__: ImageEnhance.Sharpness(img).enhance(f),
    "ShearX": shear_x,
    "ShearY": shear_y,
    "TranslateXRel": translate_x_rel,
    "TranslateYRel": translate_y_rel,
}


# ------------------------------------------------------------------------------- levels
def _randomly_negate(v):
    return -v if random.random() > 0.5 else v


def _enhance_increasing(level, _h):
    return (1.0 + _randomly_negate((level / _MAX_LEVEL) * 0.9),)


LEVEL_TO_ARG = {
    "AutoContrast": None,
    "Equalize": None,
    "Invert": None,
    "Rotate": lambda level, _h: (_randomly_negate((level / _MAX_LEVEL) * 30.0),),
    "Posterize": lambda level, _h: (int((level / _MAX_LEVEL) * 4),),
    "PosterizeIncreasing": lambda level, _h: (4 - int((level / _MAX_LEVEL) * 4),),
    "Solarize": lambda level, _h: (int((level / _MAX_LEVEL) * 256),),
    "SolarizeIncreasing": lambda level, _h: (256 - int((level / _MAX_LEVEL) * 256),),
    "SolarizeAdd": lambda level, _h: (int((level / _MAX_LEVEL) * 110),),
    "Color": lambda level, _h: ((level / _MAX_LEVEL) * 1.8 + 0.1,),
    "ColorIncreasing": _enhance_increasing,
    "Contrast": lambda level, _h: ((level / _MAX_LEVEL) * 1.8 + 0.1,),
    "ContrastIncreasing": _enhance_increasing,
    "Brightness": lambda level, _h: ((level / _MAX_LEVEL) * 1.8 + 0.1,),
    "BrightnessIncreasing": _enhance_increasing,
    "Sharpness": lambda level, _h: ((level / _MAX_LEVEL) * 1.8 + 0.1,),
    "SharpnessIncreasing": _enhance_increasing,
    "ShearX": lambda level, _h: (_randomly_negate((level / _MAX_LEVEL) * 0.3),),
    "ShearY": lambda level, _h: (_randomly_negate((level / _MAX_LEVEL) * 0.3),),
    "TranslateXRel": lambda level, h: (_randomly_negate((level / _MAX_LEVEL) * h.get("translate_pct", 0.45)),),
    "TranslateYRel": lambda level, h: (_randomly_negate((level / _MAX_LEVEL) * h.get("translate_pct", 0.45)),),
}

_RAND_TRANSFORMS = [
    "AutoContrast", "Equalize", "Invert", "Rotate", "Posterize", "Solarize", "SolarizeAdd", "Color", "Contrast",
    "Brightness", "Sharpness", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel",
]  # fmt: skip
_RAND_INCREASING_TRANSFORMS = [
    "AutoContrast", "Equalize", "Invert", "Rotate", "PosterizeIncreasing", "SolarizeIncreasing", "SolarizeAdd",
    "ColorIncreasing", "ContrastIncreasing", "BrightnessIncreasing", "SharpnessIncreasing", "ShearX", "ShearY",
    "TranslateXRel", "TranslateYRel",
]  # fmt: skip


class AugmentOp:
    """Their ``AugmentOp``: one draw, applied to every image of a list."""

    def __init__(self, name, prob=0.5, magnitude=10, hparams=None):
        self.aug_fn, self.level_fn = NAME_TO_OP[name], LEVEL_TO_ARG[name]
        self.prob, self.magnitude, self.hparams = prob, magnitude, hparams.copy()
        self.kwargs = {"fillcolor": hparams.get("img_mean", _FILL), "resample": hparams["interpolation"]}
        self.magnitude_std = self.hparams.get("magnitude_std", 0)

    def __call__(self, img_list):
        if self.prob < 1.0 and random.random() > self.prob:
            return img_list
        magnitude = self.magnitude
        if self.magnitude_std and self.magnitude_std > 0:
            magnitude = random.gauss(magnitude, self.magnitude_std)
        magnitude = min(_MAX_LEVEL, max(0, magnitude))
        level_args = self.level_fn(magnitude, self.hparams) if self.level_fn is not None else ()
        return [self.aug_fn(img, *level_args, **dict(self.kwargs)) for img in img_list]


class RandAugment:
    def __init__(self, ops, num_layers=2):
        self.ops, self.num_layers = ops, num_layers

    def __call__(self, img):
        for op in np.random.choice(self.ops, self.num_layers, replace=True, p=None):
            img = op(img)
        return img


def create_random_augment(crop_size: int, auto_augment: str) -> RandAugment:
    """Their ``create_random_augment(input_size=(crop_size, crop_size), auto_augment, interpolation="bicubic")``."""
    hparams = {"translate_const": int(crop_size * 0.45), "interpolation": Image.BICUBIC}
    magnitude, num_layers, transforms = _MAX_LEVEL, 2, _RAND_TRANSFORMS
    for c in auto_augment.split("-")[1:]:
        key, val = re.split(r"(\d.*)", c)[:2]
        if key == "mstd":
            hparams.setdefault("magnitude_std", float(val))
        elif key == "inc" and bool(val):
            transforms = _RAND_INCREASING_TRANSFORMS
        elif key == "m":
            magnitude = int(val)
        elif key == "n":
            num_layers = int(val)
    return RandAugment([AugmentOp(n, 0.5, magnitude, hparams) for n in transforms], num_layers)


# ------------------------------------------------------------------------------- random erasing
class RandomErasing:
    """Their ``RandomErasing(probability, mode=..., max_count=..., device="cpu")`` with ``cube=True``, on a
    ``[T, C, H, W]`` clip (their ``VideoTransform`` permutes ``[C, T, H, W]`` to it), ``num_splits`` 0."""

    def __init__(self, probability=0.5, mode="const", max_count=None, min_area=0.02, max_area=1 / 3, min_aspect=0.3):
        self.probability, self.min_area, self.max_area = probability, min_area, max_area
        self.log_aspect_ratio = (math.log(min_aspect), math.log(1 / min_aspect))
        self.min_count, self.max_count = 1, max_count or 1
        self.per_pixel, self.rand_color = mode == "pixel", mode == "rand"

    def _get_pixels(self, patch_size, dtype):
        if self.per_pixel:
            return torch.empty(patch_size, dtype=dtype).normal_()
        if self.rand_color:
            return torch.empty((patch_size[0], 1, 1), dtype=dtype).normal_()
        return torch.zeros((patch_size[0], 1, 1), dtype=dtype)

    def __call__(self, img):
        batch_size, chan, img_h, img_w = img.size()
        if random.random() > self.probability:
            return img
        area = img_h * img_w
        count = self.min_count if self.min_count == self.max_count else random.randint(self.min_count, self.max_count)
        for _ in range(count):
            for _ in range(100):
                target_area = random.uniform(self.min_area, self.max_area) * area / count
                aspect_ratio = math.exp(random.uniform(*self.log_aspect_ratio))
                h = int(round(math.sqrt(target_area * aspect_ratio)))
                w = int(round(math.sqrt(target_area / aspect_ratio)))
                if w < img_w and h < img_h:
                    top = random.randint(0, img_h - h)
                    left = random.randint(0, img_w - w)
                    for i in range(batch_size):
                        img[i][:, top : top + h, left : left + w] = self._get_pixels((chan, h, w), img.dtype)
                    break
        return img
