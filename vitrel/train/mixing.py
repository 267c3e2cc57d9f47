"""Mixup / CutMix on the batches a run trains on, and which mixer goes with which batches.

``module/mixup=default`` is timm's ``Mixup``: batches of equal-size image tensors, or clips (:func:`mix_clips`).
``module/mixup=naflex`` is timm's ``NaFlexMixup``: NaFlex batches (``data.packing``), whose images have sizes of their
own (:func:`mix_naflex`). Each refuses the other's batches (:func:`check_mixup_fits`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from lightning.pytorch.callbacks import Callback
from torch import Tensor

from vitrel.config import ConfigError

__all__ = [
    "MIXUP_NAFLEX", "NAFLEX_MIXUP_IMAGES", "is_naflex_mixup", "check_mixup_fits", "EvenMixBatches", "mix_clips",
    "mix_naflex",
]  # fmt: skip

#: why timm's Mixup and NaFlex batches do not go together (``train()`` refuses the pair before training)
MIXUP_NAFLEX = (
    "module/mixup=default (timm Mixup) mixes batches of equal-size image tensors; NaFlex batches (data.packing) hold "
    "images of many sizes as patches: use module/mixup=naflex (timm NaFlexMixup), or module.mixup=null"
)
#: why timm's NaFlexMixup and batches of image tensors or clips do not go together
NAFLEX_MIXUP_IMAGES = (
    "module/mixup=naflex (timm NaFlexMixup) mixes NaFlex batches (data.packing); batches of image tensors or clips "
    "take module/mixup=default (timm Mixup)"
)


def is_naflex_mixup(mixup: Any) -> bool:
    """``mixup`` is timm's ``NaFlexMixup`` (takes lists of images of any sizes), not a mixer of tensors."""
    from timm.data.naflex_mixup import NaFlexMixup

    return isinstance(mixup, NaFlexMixup)


def check_mixup_fits(mixup: Any, naflex: bool) -> None:
    """A ``ValueError`` when the mixer ``mixup`` (None: no mixing) does not take the run's batches (``naflex``: NaFlex
    dicts, else image tensors or clips)."""
    if mixup is None or naflex == is_naflex_mixup(mixup):
        return
    raise ValueError(MIXUP_NAFLEX if naflex else NAFLEX_MIXUP_IMAGES)


class EvenMixBatches(Callback):
    """timm's ``Mixup`` mixes each image with another of its batch, so it takes even batches only; an odd
    ``data.batch_size``, or epochs that end in an odd batch (``data.drop_last=false``), failed at the first such step,
    the last of an epoch, in a traceback. Checked as the fit starts, from the training loader (its batch size, its
    sampler's images a process; a video data module's ``clip_repeats`` views of each clip), unless the epochs stop
    before their last batch (``trainer.limit_train_batches``, ``trainer.max_steps``): a
    :class:`~vitrel.config.ConfigError` naming what to set."""

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        mixup = getattr(pl_module, "mixup_fn", None)
        if mixup is None or is_naflex_mixup(mixup):
            return
        trainer.estimated_stepping_batches  # noqa: B018 (builds the training loader, whatever the callbacks' order)
        dl = trainer.train_dataloader
        bs = getattr(dl, "batch_size", None)
        if bs is None:  # (a loader of its own batch sampler: its batches are checked at the step)
            return
        r = getattr(trainer.datamodule, "clip_repeats", 1)
        need = "module/mixup mixes pairs of images in a batch and needs even batches"
        if bs * r % 2:
            raise ConfigError(f"data.batch_size={bs * r} is odd: {need}; use an even data.batch_size")
        try:
            n = len(dl.sampler)
        except TypeError:  # (an iterable data set: its workers yield whole batches)
            return
        batches, steps = -(-n // bs), trainer.max_steps * trainer.accumulate_grad_batches
        if trainer.num_training_batches < batches or 0 <= steps < batches:  # (limited: the odd batch never comes)
            return
        if not dl.drop_last and n % bs * r % 2:
            raise ConfigError(
                f"each training epoch ends in a batch of {n % bs * r} (of {n:,} images a process, "
                f"data.batch_size={bs * r}, data.drop_last=false): {need}; set data.drop_last=true"
            )


def mix_clips(mixup: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]], x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """timm's ``Mixup`` / CutMix on images ``[B, C, H, W]``, or per clip on clips ``[B, C, T, H, W]``: the frames are
    folded into the channels for the call, so a clip is mixed with one other clip and CutMix pastes one box, the same
    for every frame (timm's call on the 5-D tensor would cut its box across time and height)."""
    if x.dim() != 5:
        return mixup(x, y)
    b, c, t, h, w = x.shape
    mixed, target = mixup(x.reshape(b, c * t, h, w), y)
    return mixed.reshape(b, c, t, h, w), target


def mix_naflex(mixup: Callable, x: Mapping[str, Any], y: Tensor, patch_size: int) -> tuple[dict[str, Any], Tensor]:
    """timm's ``NaFlexMixup`` on a NaFlex batch ``x`` with targets ``y`` (one per image, in the batch's image order):
    the images are put back together from their patches, mixed as timm's NaFlex loader mixes them before patchifying
    (pairs of near aspect ratio; Mixup over their central overlap, CutMix a box in it; each image keeps its size), and
    cut into ``patch_size`` patches again at their tokens' places. Returns the batch (a copy of ``x`` with new
    ``patches``: rows, segments, coordinates and padding as they were) and the soft targets ``[B, num_classes]``."""
    import torch
    from timm.data.naflex_transforms import patchify_image

    from vitrel.models.naflex import parse_naflex

    check_mixup_fits(mixup, naflex=True)
    batch = parse_naflex(x)
    images = batch.images(patch_size)
    if len(images) != len(y):
        raise ValueError(f"the NaFlex batch holds {len(images)} images for {len(y)} targets")
    mixed, targets = mixup(images, y)
    patches = torch.as_tensor(x["patches"]).clone()
    for i, (img, grid) in enumerate(zip(mixed, batch.image_grids, strict=True)):
        mine = batch.image == i
        coords = batch.coords[mine]
        cut = patchify_image(img.contiguous(), (patch_size, patch_size), pad=False, include_info=False)
        patches[mine] = cut[coords[:, 0] * grid.w + coords[:, 1]].to(patches.dtype)
    return {**x, "patches": patches}, torch.stack(list(targets))
