"""Batched image augmentation: tensor ops on a whole batch, with per-sample random parameters.

The memory loader (``data.loader=memory``, :mod:`vitrel.data.memory`) takes a batch of uint8 images
``[B, C, h, w]`` by index from the data set held on the training device and runs it through
:func:`batch_pipeline`, one tensor op per step for the whole batch:

1. **placement** (uint8; the translation canvas and/or a random translation)::

       out[b, :, i, j] = x[b, :, i - top_b, j - left_b]   where 0 <= i - top_b < h and 0 <= j - left_b < w,
       out[b, :, i, j] = 0 (black)                         elsewhere

   A translation by ``(dy, dx)``, ``|dy|, |dx| <= t``, is ``top = dy, left = dx`` at the same size: the
   random crop of the image zero-padded by ``t`` on every side (``RandomCrop(padding=t)``). The canvas is
   ``top ~ U{0..H_c - h}``, ``left ~ U{0..W_c - w}`` (or centred) into ``H_c x W_c``, then the translation.
2. **horizontal flip** (uint8) of the samples whose draw says so (probability ``hflip``).
3. **ToTensor + Normalize**: ``(x / 255 - mean) / std``, the same float operations as torchvision's, so
   the values equal the per-sample pipeline's.
4. **random resized crop** (``scale`` set; timm's ``RandomResizedCrop`` parameters, bilinear sampling with
   ``torchvision.ops.roi_align``, averaging when the crop shrinks), else the plain resize and centre
   crop to ``img_size`` (``torchvision``'s resize on the batch; nothing at the native size).
5. **random erasing** (``re_prob``; timm ``RandomErasing``'s parameters: ``1..re_count`` boxes sharing an
   area fraction in ``[0.02, 1/3]``, aspect ratio log-uniform in ``[0.3, 1/0.3]``), after normalisation
   as timm does: filled with 0 (``const``), a normal value per channel (``rand``) or per pixel (``pixel``).

Random parameters: :meth:`BatchAugment.sample` draws them for every position of an epoch's order at
once, from a ``torch.Generator`` seeded by ``(seed, epoch)``; sample ``k`` of the epoch gets row ``k``.
So each sample has its own parameters, an epoch is a pure function of the seed (a resumed epoch gets
the same ones), and DDP ranks taking positions ``r::world`` of the order see exactly what one process
would. Only the ``pixel`` erasing noise is drawn per batch (from a generator seeded by the batch's
place in the epoch).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torchvision.transforms import InterpolationMode
from torchvision.transforms import functional as TF

__all__ = [
    "BatchAugment", "place", "hflip", "normalize", "resize_shorter", "resize_crop", "resized_crop", "erase",
    "batch_pipeline",
]  # fmt: skip


#: the random erasing fills (timm's ``re_mode``)
ERASE_MODES = ("const", "rand", "pixel")


def place(x: Tensor, out_hw: tuple[int, int], top: Tensor, left: Tensor) -> Tensor:
    """Paste each image of ``x`` ``[B, C, h, w]`` at its ``(top[b], left[b])`` into a zero canvas
    ``[B, C, H, W]`` (offsets may be negative or push part of the image out: that part is cut)."""
    b, c, h, w = x.shape
    H, W = out_hw
    rows = torch.arange(H, device=x.device)[None] - top.to(x.device)[:, None]  # [B, H] source rows
    cols = torch.arange(W, device=x.device)[None] - left.to(x.device)[:, None]  # [B, W]
    inside = ((rows >= 0) & (rows < h))[:, :, None] & ((cols >= 0) & (cols < w))[:, None, :]  # [B, H, W]
    bi = torch.arange(b, device=x.device)[:, None, None]
    out = x.permute(0, 2, 3, 1)[bi, rows.clamp(0, h - 1)[:, :, None], cols.clamp(0, w - 1)[:, None, :]]  # [B,H,W,C]
    out = out.masked_fill(~inside[..., None], 0)
    return out.permute(0, 3, 1, 2).contiguous()


def hflip(x: Tensor, flip: Tensor) -> Tensor:
    """Mirror the images ``x[b]`` with ``flip[b]`` true (left-right)."""
    return torch.where(flip.to(x.device)[:, None, None, None], x.flip(-1), x)


def normalize(x: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """uint8 ``[B, C, H, W]`` -> ``(x / 255 - mean) / std`` in float32, computed as torchvision's
    ``ToTensor`` + ``Normalize`` do (same values); ``mean``, ``std``: ``[C, 1, 1]`` float32."""
    return x.float().div_(255).sub_(mean).div_(std)


def resize_shorter(
    x: Tensor, size: int, crop_pct: float = 1.0, interpolation: InterpolationMode = InterpolationMode.BILINEAR
) -> Tensor:
    """The shorter side of ``x`` resized to ``floor(size / crop_pct)`` (antialiased): the evaluation pipeline's
    resize, before its crop or crops."""
    return TF.resize(x, [int(math.floor(size / crop_pct))], interpolation=interpolation, antialias=True)


def resize_crop(
    x: Tensor, size: int, crop_pct: float = 1.0, interpolation: InterpolationMode = InterpolationMode.BILINEAR
) -> Tensor:
    """Shorter side to ``floor(size / crop_pct)`` then the centre ``size x size`` (the evaluation
    pipeline); nothing when ``x`` already is ``size x size`` and ``crop_pct == 1``."""
    if tuple(x.shape[-2:]) == (size, size) and int(math.floor(size / crop_pct)) == size:
        return x
    return TF.center_crop(resize_shorter(x, size, crop_pct, interpolation), [size, size])


def resized_crop(x: Tensor, boxes: Tensor, size: int) -> Tensor:
    """Crop box ``b`` = ``(top, left, height, width)`` (pixels) of image ``b`` and resize it to
    ``size x size``: bilinear samples at the output pixel centres (``roi_align``, half-pixel aligned),
    averaged over ``ceil(box / size)`` samples per output pixel when the box is larger."""
    from torchvision.ops import roi_align

    t, lft, h, w = boxes.to(x.device, torch.float32).unbind(-1)
    rois = torch.stack([torch.arange(len(x), device=x.device, dtype=torch.float32), lft, t, lft + w, t + h], -1)
    return roi_align(x, rois, (size, size), spatial_scale=1.0, sampling_ratio=-1, aligned=True)


def erase(x: Tensor, boxes: Tensor, active: Tensor, mode: str = "const", fill: Tensor | None = None) -> Tensor:
    """Fill boxes ``boxes[b, k] = (top, left, height, width)`` of ``x[b]`` where ``active[b, k]``:
    with 0 (``const``) or with ``fill`` (``[B, K, C, 1, 1]`` for ``rand``, ``[B, K, C, H, W]`` for ``pixel``)."""
    H, W = x.shape[-2:]
    boxes, active = boxes.to(x.device), active.to(x.device)
    rows, cols = torch.arange(H, device=x.device), torch.arange(W, device=x.device)
    for k in range(boxes.shape[1]):
        t, lft, h, w = boxes[:, k].unbind(-1)
        inr = (rows[None] >= t[:, None]) & (rows[None] < (t + h)[:, None])  # [B, H]
        inc = (cols[None] >= lft[:, None]) & (cols[None] < (lft + w)[:, None])  # [B, W]
        mask = (inr[:, :, None] & inc[:, None, :] & active[:, k, None, None])[:, None]  # [B, 1, H, W]
        x = x.masked_fill(mask, 0.0) if mode == "const" else torch.where(mask, fill[:, k].to(x.dtype), x)
    return x


@dataclass(frozen=True)
class BatchAugment:
    """Training augmentation of the memory loader, applied to whole batches (see the module docstring).

    Args:
        translate: largest shift in pixels (each sample: ``dy, dx ~ U{-translate..translate}``, zero fill),
            i.e. a random crop of the image padded by ``translate``. 0: off.
        hflip: probability of a left-right flip (0 for data where a mirror image is another class).
        scale: None, or ``(min, max)`` area fraction of a random resized crop (timm's ``scale``).
        ratio: aspect-ratio range of that crop (timm's ``ratio``).
        re_prob: probability of random erasing (timm's ``re_prob``); ``re_mode``: ``const``, ``rand`` or
            ``pixel``; ``re_count``: up to this many boxes (timm's ``re_count``).
    """

    translate: int = 0
    hflip: float = 0.0
    scale: Sequence[float] | None = None
    ratio: Sequence[float] = (3 / 4, 4 / 3)
    re_prob: float = 0.0
    re_mode: str = "const"
    re_count: int = 1

    def __post_init__(self) -> None:
        if self.translate < 0:
            raise ValueError(f"translate must be >= 0 pixels, got {self.translate}")
        for name in ("hflip", "re_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be a probability in [0, 1], got {getattr(self, name)}")
        if self.scale is not None and not (len(self.scale) == 2 and 0.0 < self.scale[0] <= self.scale[1] <= 1.0):
            raise ValueError(f"scale must be (min, max) with 0 < min <= max <= 1, got {self.scale}")
        if not (len(self.ratio) == 2 and 0.0 < self.ratio[0] <= self.ratio[1]):
            raise ValueError(f"ratio must be (min, max) with 0 < min <= max, got {self.ratio}")
        if self.re_mode not in ERASE_MODES:
            raise ValueError(f"re_mode must be const, rand or pixel, got {self.re_mode!r}")
        if self.re_count < 1:
            raise ValueError(f"re_count must be >= 1, got {self.re_count}")

    # ---- parameters ---------------------------------------------------------------------------
    def sample(self, n: int, in_hw: tuple[int, int], out_hw: tuple[int, int], channels: int, generator) -> dict:
        """Random parameters of ``n`` samples (CPU tensors, one row per sample) for images placed in an
        ``in_hw`` frame (after canvas and translation) and fed to the model at ``out_hw``."""
        g, p = generator, {}
        if self.translate:
            p["shift"] = torch.randint(-self.translate, self.translate + 1, (n, 2), generator=g)
        if self.hflip:
            p["flip"] = torch.rand(n, generator=g) < self.hflip
        if self.scale is not None:
            p["crop"] = _crop_boxes(n, in_hw, self.scale, self.ratio, g)
        if self.re_prob:
            p["erase"], p["erase_on"] = _erase_boxes(n, out_hw, self.re_prob, self.re_count, g)
            if self.re_mode == "rand":
                p["erase_fill"] = torch.randn(n, self.re_count, channels, 1, 1, generator=g)
        return p


def _uniform(n: int, lo: float, hi: float, g, *shape: int) -> Tensor:
    return lo + (hi - lo) * torch.rand(n, *shape, generator=g, dtype=torch.float64)


def _randint_upto(hi: Tensor, g) -> Tensor:
    """``U{0..hi}`` element-wise (``hi >= 0``)."""
    return (torch.rand(hi.shape, generator=g, dtype=torch.float64) * (hi + 1)).floor().long().clamp_max(hi)


def _crop_boxes(n: int, hw: tuple[int, int], scale, ratio, g, attempts: int = 10) -> Tensor:
    """timm/torchvision ``RandomResizedCrop.get_params`` for ``n`` samples: ``(top, left, h, w)``."""
    H, W = hw
    area = _uniform(n, scale[0], scale[1], g, attempts) * H * W
    log_r = _uniform(n, math.log(ratio[0]), math.log(ratio[1]), g, attempts)
    ar = torch.exp(log_r)
    w = torch.sqrt(area * ar).round().long()
    h = torch.sqrt(area / ar).round().long()
    ok = (w > 0) & (h > 0) & (w <= W) & (h <= H)
    first = ok.double().argmax(1)  # the first attempt that fits
    pick = lambda t: t.gather(1, first[:, None])[:, 0]  # noqa: E731
    h, w, found = pick(h), pick(w), ok.any(1)
    # fallback (no attempt fits): the central crop at the nearest allowed aspect ratio
    in_ratio = W / H
    if in_ratio < min(ratio):
        fw, fh = W, int(round(W / min(ratio)))
    elif in_ratio > max(ratio):
        fw, fh = int(round(H * max(ratio))), H
    else:
        fw, fh = W, H
    h, w = torch.where(found, h, fh), torch.where(found, w, fw)
    top = torch.where(found, _randint_upto(H - h, g), torch.full_like(h, (H - fh) // 2))
    left = torch.where(found, _randint_upto(W - w, g), torch.full_like(w, (W - fw) // 2))
    return torch.stack([top, left, h, w], -1)


def _erase_boxes(n: int, hw: tuple[int, int], prob: float, count: int, g, attempts: int = 10):
    """timm ``RandomErasing`` parameters: boxes ``[n, count, 4]`` and which are used ``[n, count]``."""
    H, W = hw
    on = torch.rand(n, generator=g) < prob
    k = torch.randint(1, count + 1, (n,), generator=g)  # boxes of this sample (timm: U{1..re_count})
    area = _uniform(n, 0.02, 1 / 3, g, count, attempts) * H * W / k[:, None, None]
    ar = torch.exp(_uniform(n, math.log(0.3), math.log(1 / 0.3), g, count, attempts))
    h = torch.sqrt(area * ar).round().long()
    w = torch.sqrt(area / ar).round().long()
    ok = (w < W) & (h < H)
    first = ok.double().argmax(-1, keepdim=True)
    h, w = h.gather(-1, first)[..., 0], w.gather(-1, first)[..., 0]
    top, left = _randint_upto((H - h).clamp_min(0), g), _randint_upto((W - w).clamp_min(0), g)
    used = on[:, None] & ok.any(-1) & (torch.arange(count)[None] < k[:, None])
    return torch.stack([top, left, h, w], -1), used


def batch_pipeline(
    x: Tensor,
    *,
    mean: Tensor,
    std: Tensor,
    img_size: int,
    frame_hw: tuple[int, int] | None = None,
    offsets: Tensor | None = None,
    params: dict | None = None,
    crop_pct: float = 1.0,
    interpolation: InterpolationMode = InterpolationMode.BILINEAR,
    re_mode: str = "const",
    noise: torch.Generator | None = None,
) -> Tensor:
    """uint8 images ``[B, C, h, w]`` -> the model's float input ``[B, C, img_size, img_size]``.

    ``frame_hw``/``offsets``: the canvas (``[B, 2]`` ``(top, left)``; None: the image's own frame).
    ``params``: one batch's rows of :meth:`BatchAugment.sample` (None: evaluation, no randomness).
    ``noise``: generator of the ``pixel`` erasing noise (on ``x``'s device).
    """
    params = params or {}
    frame = frame_hw or tuple(x.shape[-2:])
    top = offsets[:, 0] if offsets is not None else None
    left = offsets[:, 1] if offsets is not None else None
    if "shift" in params:
        dy, dx = params["shift"].unbind(-1)
        top, left = (dy, dx) if top is None else (top + dy, left + dx)
    if top is not None:
        x = place(x, frame, top, left)
    if "flip" in params:
        x = hflip(x, params["flip"])
    x = normalize(x, mean, std)
    if "crop" in params:
        x = resized_crop(x, params["crop"], img_size)
    else:
        x = resize_crop(x, img_size, crop_pct, interpolation)
    if "erase" in params:
        fill = params.get("erase_fill")
        if re_mode == "pixel":
            k = params["erase"].shape[1]
            fill = torch.randn(len(x), k, *x.shape[1:], generator=noise, device=x.device)
        x = erase(x, params["erase"], params["erase_on"], re_mode, fill)
    return x
