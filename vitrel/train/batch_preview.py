"""What a run trains on, as a picture in its folder: ``batch.png`` (:class:`BatchPreview`).

The first training batch's images as the training step gets them: after the loader's and the batch's augmentation
and, with ``module.mixup``, mixed as the step mixes them (``ClassifierModule.mix``, with the random states put
back after, so the step draws the same mix and the run is the run without the picture), the normalisation undone.
Each image is titled with its class, or a mixed image with the two largest shares of its soft target. NaFlex images
(``data.packing``) keep their own aspect ratios; a clip shows its frames side by side. A wrong normalisation, an
augmentation too strong, labels that do not match: seen at a glance, in the run's first seconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from vitrel.train.exact_resume import rng_state, set_rng_state
from vitrel.train.sweep_plot import save_png

__all__ = ["BatchPreview", "batch_images", "draw_batch"]


def batch_images(x: Tensor | dict, patch_size: int | None = None) -> list[Tensor]:
    """A training batch's images ``[C, H, W]``: a batch ``[B, C, H, W]``; clips ``[B, C, T, H, W]`` with their frames
    side by side (``[C, H, T * W]``); a NaFlex dict's images put back from their patches (``patch_size``)."""
    if isinstance(x, dict):
        from vitrel.models.naflex import parse_naflex

        if patch_size is None:
            raise ValueError("a NaFlex batch's images need the model's patch size")
        return parse_naflex(x).images(patch_size)
    if x.dim() == 5:
        return list(x.permute(0, 1, 3, 2, 4).flatten(3))  # [B, C, H, T, W] -> [B, C, H, T * W]
    return list(x)


def _title(i: int, y: Tensor, target: Tensor | None, names: Sequence[str] | None) -> str:
    def name(k: int) -> str:
        return str(names[k]) if names and 0 <= k < len(names) else str(k)

    if target is None:  # (a target the step refuses, -100 or a float, is shown as it is: the step names it)
        v = y[i]
        return name(int(v)) if v.dim() == 0 and not v.is_floating_point() else str(v.tolist())
    shares, classes = target[i].float().topk(min(2, target.shape[-1]))
    parts = [f"{name(int(k))} {float(s):.2f}" for s, k in zip(shares, classes, strict=True) if float(s) >= 0.05]
    return "\n".join(parts)


def draw_batch(
    images: Sequence[Tensor],
    y: Tensor,
    path: str | Path,
    *,
    target: Tensor | None = None,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    class_names: Sequence[str] | None = None,
    title: str = "",
) -> Path:
    """``images`` (normalised with ``mean`` and ``std``; None: each shown from its own min to max) titled with their
    classes ``y`` (or the shares of their soft ``target``), drawn into ``path``."""
    from vitrel.figures import hide_ticks, new_figure

    n = len(images)
    wide = max(img.shape[-1] / img.shape[-2] for img in images)
    cols = max(1, min(n, round(math.sqrt(n / wide)) or 1))
    rows = math.ceil(n / cols)
    titles = [_title(i, y, target, class_names) for i in range(n)]
    lines = [line for t in titles for line in t.splitlines()] or [""]
    col = max(1.8 * min(wide, 4), 0.065 * max(map(len, lines)))  # (inches: an image, or its longest title line)
    tall = 0.15 * max(t.count("\n") + 1 for t in titles)  # (two lines under Mixup)
    fig = new_figure(max(col * cols, 0.075 * len(title)), (1.85 + tall) * rows + 0.4)  # (the title whole too)
    for i, img in enumerate(images):
        a = img.detach().float().cpu()
        if mean is not None and std is not None:
            c = a.shape[0]
            a = a * torch.tensor(list(std)[:c]).view(c, 1, 1) + torch.tensor(list(mean)[:c]).view(c, 1, 1)
        else:
            a = (a - a.min()) / (a.max() - a.min()).clamp_min(1e-8)
        a = a.clamp(0, 1)
        ax = fig.add_subplot(rows, cols, i + 1)
        if a.shape[0] < 3:  # (grey; of two channels, the first)
            ax.imshow(a[0].numpy(), cmap="gray", vmin=0, vmax=1)
        else:
            ax.imshow(a[:3].permute(1, 2, 0).numpy())
        ax.set_title(titles[i], fontsize=8)
        hide_ticks(ax)
    if title:
        fig.suptitle(title, fontsize=9)
    path = Path(path)
    save_png(fig, path)
    return path


class BatchPreview(Callback):
    """Draws the first training batch of a fit (module docstring) into ``<save_dir>/<filename>``: at most ``images``
    of its images, on the global rank 0. A resumed run draws its own first batch."""

    def __init__(self, save_dir: str | Path, filename: str = "batch.png", images: int = 16) -> None:
        if not (isinstance(images, int) and images >= 1):
            raise ValueError(f"BatchPreview: images={images!r}: how many images to draw, 1 or more")
        self.path, self.images = Path(save_dir) / filename, images
        self._drawn = False

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int):
        if self._drawn or not trainer.is_global_zero or not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            return  # (drawn; another rank; no batch, every file of it unreadable; a batch the step itself refuses)
        self._drawn = True
        x, y = batch
        target, mixed = None, getattr(pl_module, "mixup_fn", None) is not None
        if mixed and not hasattr(pl_module, "mix"):  # (a LightningModule of one's own: its mixing is its own)
            return
        if mixed:
            saved = rng_state()
            try:
                x, target = pl_module.mix(x.clone() if isinstance(x, Tensor) else x, y)
            except ValueError:  # (a batch the mixer does not take: the step itself refuses it, saying why)
                return
            finally:
                set_rng_state(saved)
        proj = getattr(getattr(getattr(pl_module, "model", None), "patch_embed", None), "proj", None)
        if isinstance(x, dict) and proj is None:  # (NaFlex patches of a model that is not vitrel's: no patch size)
            return
        images = batch_images(x, proj.kernel_size[0] if proj is not None else None)[: self.images]
        dm = trainer.datamodule
        kind = "clips (frames side by side)" if isinstance(x, Tensor) and x.dim() == 5 else "images"
        draw_batch(
            images,
            y,
            self.path,
            target=target,
            mean=getattr(dm, "mean", None),
            std=getattr(dm, "std", None),
            class_names=getattr(dm, "class_names", None),
            title=f"the first training batch as the step gets it: {len(images)} of its {len(y)} {kind}"
            + (", mixed (the target's shares)" if mixed else ""),
        )
