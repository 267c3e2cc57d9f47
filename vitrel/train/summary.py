"""The closing lines a training run prints (:func:`report`: accuracy, times, where its folder, checkpoints and W&B
run are) and the parts of its ``metrics.json`` record that need a reading: a test of part of the split, a resumed run
that had nothing left to train (:func:`resumed_finished`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from omegaconf import DictConfig

from vitrel.train.sweep_rerun import finished_record

__all__ = ["report", "resumed_finished", "tested_part", "split_size", "known_size", "test_limit", "BEFORE_RESUME"]

#: the record's part of its times spent before the (last) resume (:meth:`~vitrel.train.run_times.RunTimes.times`)
BEFORE_RESUME = ("fit_s_before_resume", "wall_s_before_resume", "resumes")


def report(result: dict, wandb_where: str | None, classes: str = "", noun: str = "images") -> str:
    """The run's closing lines: accuracy, wall time, and where the run folder, checkpoints and W&B run are.
    ``classes``: :meth:`~vitrel.train.progress.CountTestImages.classes_note`, said of a test of part of the split;
    ``noun``: what the split holds ("videos" for a video data set)."""
    m = result["metrics"]
    stage = "test" if "test/acc1" in m else "val"
    lines = []
    if f"{stage}/acc1" in m:
        extra = [f"top-5 {100 * m[k]:.1f} %" for k in (f"{stage}/acc5",) if k in m]
        extra += [f"loss {m[k]:.3f}" for k in (f"{stage}/loss",) if k in m]
        n, total = result["test_images"], result["test_split_images"]
        part = ""
        if stage == "test" and tested_part(n, total):
            part = f" on {n} of the {total} test {noun}{classes} ({result['test_limited_by']})"
        lines.append(f"{stage} accuracy {100 * m[f'{stage}/acc1']:.2f} % ({', '.join(extra)}){part}")
    fit_s, wall_s = (f"{result[k]:.0f} s" if result[k] is not None else "(unknown)" for k in ("fit_s", "wall_s"))
    again = "; resumed finished: nothing left to train, tested again" if result.get("resumed_finished") else ""
    fit_before, wall_before = _before_resume(result)
    stopped = f"; stopped by {result['stopped_by']}" if result.get("stopped_by") else ""
    lines.append(
        f"training {fit_s} ({_epochs(result)}, {_plural(result['global_step'], 'step')}"
        f"{fit_before}{stopped}); whole run {wall_s}{wall_before}{again}"
    )
    lines.append(f"run folder  {result['run_dir']}")
    if result["last_ckpt"] or result["best_ckpt"]:
        by = result.get("best_monitor", "val/acc1")  # (a metrics.json of before vitrel kept it: val/acc1)
        best = f"  ({f'best {by}' if by else 'newest kept'}: {result['best_ckpt']})" if result["best_ckpt"] else ""
        lines.append(f"checkpoint  {result['last_ckpt'] or result['best_ckpt']}{best}")
    if wandb_where:
        lines.append(f"W&B run     {wandb_where}")
    return "\n".join(lines)


def tested_part(scored: int | None, split: int | None) -> bool:
    """The test loop scored part of the split (not: all of it, or more, a DistributedSampler padding the ranks)."""
    return scored is not None and split is not None and scored < split


def known_size(dataset: Any) -> int | None:
    """``len(dataset)``, a timm stream's its reader's ``num_samples`` (the whole split: its ``len`` is one rank's
    share under DDP); None where it is unknown: no length, or a stream's 0 (timm's webdataset reader of a brace
    pattern of shards without ``|<num_samples>`` says 0, and was reported as a split of 0 images)."""
    whole = getattr(getattr(dataset, "reader", None), "num_samples", None)
    if whole:
        return int(whole)
    try:
        n = len(dataset)
    except TypeError:
        return None
    return None if n == 0 and isinstance(dataset, torch.utils.data.IterableDataset) else n


def split_size(loaders: Any, left_out: Sequence[str] = ()) -> int | None:
    """The number of samples of the test loader's data set, less the unreadable files ``left_out`` of it
    (:class:`~vitrel.data.unreadable.ReportUnreadable`); None when it is unknown (:func:`known_size`)."""
    loader = loaders[0] if isinstance(loaders, (list, tuple)) else loaders
    n = known_size(getattr(loader, "dataset", None))
    return None if n is None else n - len(left_out)


def test_limit(trainer_cfg: DictConfig) -> str:
    """The trainer setting that limits the test loop: ``fast_dev_run`` (``debug=fdr``) or ``limit_test_batches``."""
    if trainer_cfg.get("fast_dev_run"):
        return "trainer.fast_dev_run"
    return "trainer.limit_test_batches"


def _before_resume(result: dict) -> tuple[str, str]:
    """What the closing line adds to the training and whole-run times of a resumed run: the part of each before the
    (last) resume (:class:`~vitrel.train.run_times.RunTimes`), or that it is unknown."""
    if "resumes" not in result:  # (a finished run's record written before vitrel kept the part: resumed_finished)
        return "", ""
    n = result["resumes"]
    if n is None:
        return "; the time before the resume is not in its checkpoint", ""
    if n == 0:
        return "", ""
    when = "before the resume" if n == 1 else f"before the last of {n} resumes"
    return f"; {result['fit_s_before_resume']:.0f} s {when}", f" ({result['wall_s_before_resume']:.0f} s {when})"


def _epochs(result: dict) -> str:
    """``3 epochs``, or with a stop's unfinished epoch ``3 epochs and 40 steps of the next``."""
    part = result.get("partial_epoch_steps")  # (a record of before vitrel kept it: none)
    return _plural(result["epochs"], "epoch") + (f" and {_plural(part, 'step')} of the next" if part else "")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def resumed_finished(result: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """The record of a run that resumed a checkpoint with nothing left to train (a finished run, or a finished job of
    a sweep, run again in its folder): the finished run's validation metrics, epochs and times
    (:func:`~vitrel.train.sweep_rerun.finished_record`), this pass's test metrics (the same weights), and
    ``resumed_finished: true``. Without the finished run's record, its times are unknown (None), not this pass's."""
    earlier = finished_record(run_dir, result["global_step"])
    result = {k: v for k, v in result.items() if k not in BEFORE_RESUME}  # (this pass's: the finished run's, if kept)
    if earlier is None:
        rank_zero_info(f"resumed a finished run with no record of it in {run_dir}: its validation and times unknown")
        return {**result, "wall_s": None, "fit_s": None, "resumed_finished": True}
    figures = ("epochs", "partial_epoch_steps", "val_runs", "wall_s", "fit_s", *BEFORE_RESUME)
    kept = {k: earlier[k] for k in figures if k in earlier}
    return {**result, **kept, "metrics": {**earlier.get("metrics", {}), **result["metrics"]}, "resumed_finished": True}
