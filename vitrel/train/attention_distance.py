"""How far each head of a trained ViT or Swin (image or video) looks: :class:`AttentionDistance` writes
``attention_distance.csv`` and ``attention_distance.png`` in the run folder after the test
(:func:`vitrel.viz.attention_distance`, the mean attention distance per block and head in input pixels, and in frames
for a video model, on the test's first images or clips), and :func:`read_distances` reads the CSV back (the sweep
summary draws every job's in one picture)."""

from __future__ import annotations

import csv
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from torch.nn.modules.utils import _pair

__all__ = ["AttentionDistance", "CSV", "PNG", "read_distances", "sweep_distances", "write_distances"]

log = logging.getLogger(__name__)

CSV, PNG = "attention_distance.csv", "attention_distance.png"


def write_distances(path: str | Path, distances: Tensor, frames: Tensor | None = None) -> None:
    """``distances [blocks, heads]`` as rows ``block,head,distance_px`` (both from 0; a Swin's blocks counted across
    stages), with a column ``distance_frames`` from ``frames [blocks, heads]`` (a video model's temporal distance)
    when given. NaN entries (a Swin block's missing heads, :func:`~vitrel.viz.attention_distance`) get no row."""
    if frames is not None and frames.shape != distances.shape:
        raise ValueError(f"frames {tuple(frames.shape)} and distances {tuple(distances.shape)} differ in shape")
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["block", "head", "distance_px", *(["distance_frames"] if frames is not None else [])])
        for block, head in torch.cartesian_prod(*map(torch.arange, distances.shape)).tolist():
            v = float(distances[block, head])
            if v != v:  # NaN: a head the block does not have
                continue
            extra = [repr(float(frames[block, head]))] if frames is not None else []
            w.writerow([block, head, repr(v), *extra])


def read_distances(path: str | Path, column: str = "distance_px") -> Tensor:
    """The ``[blocks, heads]`` tensor (float64) of a CSV :func:`write_distances` wrote: its ``column``
    (``distance_px``, or a video model's ``distance_frames``), NaN where a block has no such head."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if column not in (reader.fieldnames or []):
            raise ValueError(f"{path} has no column {column!r} (its columns: {reader.fieldnames})")
        rows = [(int(r["block"]), int(r["head"]), float(r[column])) for r in reader]
    out = torch.full((max(r[0] for r in rows) + 1, max(r[1] for r in rows) + 1), float("nan"), dtype=torch.float64)
    for block, head, v in rows:
        out[block, head] = v
    return out


def sweep_distances(sweep_dir: str | Path, groups: Sequence[tuple[str, Sequence[str]]]) -> dict[str, Tensor]:
    """Each setting's distances, ``groups`` of ``(label, job folders)`` (the sweep summary's
    :func:`~vitrel.train.sweep_table.distance_groups`): its jobs' heads side by side ``[depth, heads x jobs]``
    (a seed sweep's setting: its seeds), from the jobs that wrote ``attention_distance.csv``; a setting with none left
    out."""
    out = {}
    for label, jobs in groups:
        found = [f for j in jobs if (f := Path(sweep_dir) / j / CSV).exists()]
        if found:
            out[label] = torch.cat([read_distances(f) for f in found], dim=1)
    return out


class AttentionDistance(Callback):
    """After the test: the mean attention distance of the weights the test scored (the EMA copy under
    ``module.ema_eval``) on the test's first ``images`` images (or clips) of process 0, written to ``save_dir`` as
    ``attention_distance.csv`` (rows ``block,head,distance_px``; a video model adds ``distance_frames``) and
    ``attention_distance.png`` (one dot per head against depth, in pixels). A ViT, video ViT, Swin or Video Swin
    (:func:`vitrel.viz.attention_distance`); NaFlex batches give their images, each at its own size. For another
    model, or NaFlex images with dropped patches, one log line says it was left out."""

    def __init__(self, save_dir: str | Path, images: int = 64) -> None:
        if images < 1:
            raise ValueError(f"callbacks.attention_distance.images must be at least 1, got {images}")
        self.save_dir, self.images = Path(save_dir), int(images)
        self._kept: list[Tensor] = []
        self._why_not: str | None = None

    def on_test_start(self, trainer, pl_module) -> None:
        self._kept, self._why_not = [], None
        from vitrel.viz_distance import check_distance_model

        model = pl_module.scored_network
        try:
            check_distance_model(model)
        except TypeError:
            self._why_not = f"{type(model).__name__} is not a ViT, video ViT, Swin or Video Swin"

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        need = self.images - len(self._kept)
        if self._why_not is not None or need <= 0 or batch is None or trainer.global_rank != 0:
            return
        x = batch[0]
        if isinstance(x, Mapping):  # a NaFlex dict: its images, each at its own size
            model = pl_module.scored_network
            try:
                x = model.read_input(x).batch.images(_pair(model.patch_embed.patch_size)[0])
            except ValueError as e:  # (patches dropped: no whole image)
                self._why_not = str(e)
                return
        elif isinstance(x, Tensor) and x.dim() == 6:  # data.clips_per_video > 1: [B, K, C, T, H, W], each clip
            x = x.flatten(0, 1)
        elif not isinstance(x, Tensor) or x.dim() not in (4, 5):
            self._why_not = f"the test batches are not images, clips or NaFlex dicts ({type(x).__name__})"
            return
        self._kept.extend(t.detach() for t in x[:need])

    def on_test_end(self, trainer, pl_module) -> None:
        if trainer.global_rank != 0:
            return
        if self._why_not is not None or not self._kept:
            log.info("attention distance: left out (%s)", self._why_not or "no test images")
            return
        from vitrel.train.sweep_plot import save_png
        from vitrel.viz import attention_distance, plot_attention_distance

        kept, self._kept = self._kept, []
        # in the scored network's dtype: under *-true precision the test's images are bf16 / fp16, its EMA float32
        dtype = next(pl_module.scored_network.parameters()).dtype
        kept = [t.to(dtype) for t in kept]
        x = torch.stack(kept) if len({t.shape for t in kept}) == 1 else kept  # (NaFlex: images of several sizes)
        video = kept[0].dim() == 4
        if video:  # pixels in the frame plane, and frames apart
            d, frames = attention_distance(pl_module.scored_network, x, frames=True)
        else:
            d, frames = attention_distance(pl_module.scored_network, x), None
        self.save_dir.mkdir(parents=True, exist_ok=True)
        write_distances(self.save_dir / CSV, d, frames)
        n = f"{d.shape[0]} blocks x {d.shape[1]} heads" if not d.isnan().any() else f"{d.shape[0]} blocks"
        what = "test clips" if video else "test images"
        save_png(plot_attention_distance(d, f"mean attention distance ({n}, {what})", frames), self.save_dir / PNG)
        log.info("attention distance: %s and %s (%s)", CSV, PNG, n)
