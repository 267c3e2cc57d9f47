"""Lightning's SLURM requeue checkpoints (``hpc_ckpt_<n>.ckpt``, saved by its ``SIGUSR1`` handler in the trainer's
``default_root_dir``) among a run folder's own: which of them a resume may continue (:func:`newest_checkpoint`), and
their removal where Lightning would load them in place of the run's (:func:`drop_requeue_checkpoints`)."""

from __future__ import annotations

import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from vitrel.models.checkpoint import check_checkpoint

__all__ = ["drop_requeue_checkpoints", "drop_requeue_files", "load_keys", "newest_checkpoint", "requeue_checkpoints"]


def same_file(a: str | Path, b: str | Path) -> bool:
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def requeue_checkpoints(root: str | Path) -> list[Path]:
    """Lightning's SLURM requeue checkpoints, ``hpc_ckpt_<n>.ckpt`` in ``root`` (the trainer's
    ``default_root_dir``, where its ``SIGUSR1`` handler saves them), by ``n``."""
    root = Path(root)
    found = root.glob("hpc_ckpt_*.ckpt") if root.is_dir() else ()
    return sorted((p for p in found if p.stem[9:].isdigit()), key=lambda p: int(p.stem[9:]))


def newest_checkpoint(last: Path, root: str | Path) -> Path | None:
    """The run folder's checkpoint a resume continues: the newest by global step of ``last`` (its ``last.ckpt``) and
    Lightning's requeue checkpoints in ``root`` (:func:`requeue_checkpoints`) saved between training steps, a tie to
    ``last.ckpt``; None without any. Lightning loads the newest requeue file itself only when no checkpoint is passed
    to the fit, and then without comparing it with ``last.ckpt`` and without vitrel's checks: passed here, it gets
    them. A requeue file saved in the middle of a step or a validation (:func:`mid_step`) is passed over, with a
    warning: resumed, it skipped a batch or that validation and set the schedule an epoch back (an audit's)."""
    steps: dict[Path, int | None] = {last: None} if last.is_file() else {}  # (last.ckpt's read only if compared)
    for p in reversed(requeue_checkpoints(root)):
        ckpt = load_keys(p)  # (read once: where it was saved, and its step)
        why = mid_step(ckpt)
        if why is None:
            steps[p] = int(ckpt.get("global_step", -1))
            continue
        rank_zero_warn(
            f"{p.name}, Lightning's SLURM requeue checkpoint of step {ckpt.get('global_step')}, was saved {why}: a run "
            "resumed from it would not continue as the run did; passed over for "
            + (f"{last} (step {_global_step(last)})" if last.is_file() else "a start from scratch")
        )
    if len(steps) < 2:
        return next(iter(steps), None)
    if last in steps:
        steps[last] = _global_step(last)
    return max(steps, key=lambda p: steps[p])  # (the first of equals: last.ckpt, then the higher n)


def mid_step(ckpt: Mapping[str, Any]) -> str | None:
    """Why a requeue checkpoint ``ckpt`` cannot be continued exactly, or None. Lightning's ``SIGUSR1`` handler saves
    wherever the signal lands; vitrel continues a save between training steps (its own save at a step's end: every
    batch fetched trained, as many as its loader position counts) with no validation under way."""
    fit = (ckpt.get("loops") or {}).get("fit_loop") or {}
    train = (fit.get("epoch_loop.batch_progress") or {}).get("current") or {}
    val = fit.get("epoch_loop.val_loop.batch_progress") or {}
    vcur = val.get("current") or {}
    if vcur.get("ready") and not (val.get("is_last_batch") and vcur.get("ready") == vcur.get("completed")):
        return f"during a validation (at its batch {vcur.get('ready')})"
    loader = ((ckpt.get("callbacks") or {}).get("ExactResume") or {}).get("loader") or {}
    drawn = loader.get("batches", train.get("ready"))
    if train.get("processed") != train.get("ready") or drawn != train.get("ready"):
        return f"during a training step (batch {drawn} of the epoch drawn, not trained)"
    return None


def _global_step(path: Path) -> int:
    return int(load_keys(path).get("global_step", -1))


def load_keys(path: Path) -> Mapping[str, Any]:
    """The checkpoint at ``path``, its tensors left on disk where it can (a zip file); ``{}`` for no mapping."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except Exception:
        check_checkpoint(path)  # (a truncated or foreign file: its CheckpointError)
        raise
    return ckpt if isinstance(ckpt, Mapping) else {}


def drop_requeue_files(root: str | Path, why: str, keep: Path | None = None) -> list[Path]:
    """Remove the requeue checkpoints in ``root`` (but ``keep``, the one the run starts from), logged with ``why``:
    under SLURM Lightning would load the newest into any fit or test given no checkpoint, and a later resume would
    take one newer than the run's own. Every rank removes them (the same files: none is needed by any)."""
    found = [p for p in requeue_checkpoints(root) if keep is None or not same_file(p, keep)]
    for p in found:
        p.unlink(missing_ok=True)
    if found:
        rank_zero_info(f"removed Lightning's SLURM requeue checkpoint(s) {', '.join(p.name for p in found)}: {why}")
    return found


def drop_requeue_checkpoints(trainer: L.Trainer) -> list[Path]:
    """Remove Lightning's SLURM requeue checkpoints (``hpc_ckpt_<n>.ckpt``, written on ``SIGUSR1`` in the trainer's
    ``default_root_dir``) once the fit has finished, and return them. Under SLURM Lightning loads the newest of them
    in any ``trainer.test(module)`` (``ckpt_path=None`` means ``"hpc"`` there), so the test scored the weights of the
    signal's step, not the fitted ones, and so did a run resumed in the folder later. Rank 0 removes them; every rank
    waits for it, so that all test the same weights."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    if not SLURMEnvironment.detect():
        return []
    root = Path(str(trainer.default_root_dir))
    found = requeue_checkpoints(root)
    trainer.strategy.barrier("vitrel_hpc_ckpt_seen")  # (every rank has looked before rank 0 removes them)
    if trainer.is_global_zero:
        drop_requeue_files(
            root,
            "the finished fit supersedes them (under SLURM trainer.test would load them in place of the fitted "
            "weights)",
        )
    trainer.strategy.barrier("vitrel_hpc_ckpt_removed")
    return found
