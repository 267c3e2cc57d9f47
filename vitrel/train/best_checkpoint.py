"""The best checkpoint by the monitored metric (``callbacks.model_checkpoint``): Lightning's ``ModelCheckpoint``,
whose state follows a run folder that was moved or copied.

Lightning reloads the best score, the top-k files and the last path only when the checkpoint's ``dirpath`` is the
callback's: resumed in a moved folder, the next validation became "best" whatever its score (a second best file
beside the first) and a copy kept naming the other folder's file. When the checkpoint's files are in the new folder
under the same names, the state is read with its paths there; otherwise Lightning's own rule applies (its warning).

Resumed in its own folder, the state is checked against the files (:func:`state_on_disk`): a run killed between
writing a new best file (which deletes the previous one) and writing ``last.ckpt`` left the resumed state naming a
file that is gone, which the run then recorded as its best (an audit's), and a best file no state names.
"""

from __future__ import annotations

import glob
import os
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_warn


class BestCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` that resumes in a moved or copied run folder with its best file and score."""

    def _generate_state_key(self, **kwargs: Any) -> str:
        """``ModelCheckpoint``'s key (``ModelCheckpoint{...}``), so checkpoints written with it resume with this."""
        return f"ModelCheckpoint{kwargs!r}"

    # a validation Lightning runs only because the fit stops mid-epoch (trainer.max_time) comes after last.ckpt, written
    # at the stopping step: a resume, whose state is of before it, would keep its file beside the next best one
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not _stop_validation(trainer):
            super().on_validation_end(trainer, pl_module)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not _stopped_mid_epoch(trainer):
            super().on_train_epoch_end(trainer, pl_module)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        old, new = state_dict.get("dirpath"), self.dirpath
        if old and new and old != new:
            state_dict = moved_state(state_dict, str(old), str(new))
        elif old and new:
            state_dict = state_on_disk(state_dict, str(new), self.filename, self.mode)
        super().load_state_dict(state_dict)


def _stop_validation(trainer: L.Trainer) -> bool:
    """The validation that ends now is one Lightning runs only for a stop mid-epoch
    (``LastCheckpoint.stop_validation``): one of ``trainer.val_check_interval`` at the stopping step is the fit's own
    (``last.ckpt`` is written after it)."""
    from vitrel.train.last_checkpoint import LastCheckpoint

    return any(isinstance(cb, LastCheckpoint) and cb.stop_validation for cb in trainer.callbacks)


def _stopped_mid_epoch(trainer: L.Trainer) -> bool:
    """The run's ``last.ckpt`` is of the step the fit stopped on mid-epoch (``LastCheckpoint.stopped_mid_epoch``)."""
    from vitrel.train.last_checkpoint import LastCheckpoint

    return any(isinstance(cb, LastCheckpoint) and cb.stopped_mid_epoch for cb in trainer.callbacks)


def moved_state(state: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    """``state`` (a ``ModelCheckpoint``'s) with its paths under ``old`` read under ``new``, when the best file is there
    under the same name; else ``state`` unchanged. A file the new folder lacks is dropped from the state."""

    def moved(path: str) -> str | None:
        rel = os.path.relpath(path, old) if path else ".."
        there = os.path.join(new, rel)
        return there if not rel.startswith("..") and os.path.isfile(there) else None

    best = state.get("best_model_path") or ""
    if best and moved(best) is None:
        return state
    out = dict(state, dirpath=new, best_model_path=moved(best) or "")
    out["best_k_models"] = {moved(k): v for k, v in (state.get("best_k_models") or {}).items() if moved(k)}
    for key in ("kth_best_model_path", "last_model_path"):
        if key in state:
            out[key] = moved(state[key] or "") or ""
    return out


def state_on_disk(state: dict[str, Any], dirpath: str, filename: str | None, mode: str) -> dict[str, Any]:
    """``state`` (a ``ModelCheckpoint``'s, resumed in its own ``dirpath``) without the files it names that are gone,
    its best and k-th best chosen again among those left (by ``mode``), each gone file named in a warning; files of
    the callback's ``filename`` in ``dirpath`` that it does not name (a stopped run's) are named in a warning too."""
    kept = {k: v for k, v in (state.get("best_k_models") or {}).items() if os.path.isfile(k)}
    gone = [k for k in (state.get("best_k_models") or {}) if k not in kept]
    best = state.get("best_model_path") or ""
    if best and not os.path.isfile(best) and best not in gone:
        gone.append(best)
    prefix = (filename or "").split("{", 1)[0]
    named = {os.path.abspath(k) for k in [*(state.get("best_k_models") or {}), best] if k}
    stray = [f for f in glob.glob(os.path.join(glob.escape(dirpath), f"{glob.escape(prefix)}*.ckpt")) if prefix]
    stray = sorted(os.path.basename(f) for f in stray if os.path.abspath(f) not in named)
    if stray:
        rank_zero_warn(
            f"{', '.join(stray)} in {dirpath}: not among the resumed checkpoint's best files (written by a run stopped "
            "before its last.ckpt); not this run's best"
        )
    if not gone:
        return state
    rank_zero_warn(
        f"{', '.join(os.path.basename(g) for g in gone)}, the resumed checkpoint's best file(s), are gone from "
        f"{dirpath} (a run stopped while saving removed them): the best is chosen among the files left and the "
        "validations from here on"
    )
    better = max if mode == "max" else min
    worse = min if mode == "max" else max
    out = dict(state, best_k_models=kept)
    out["best_model_path"] = better(kept, key=lambda k: float(kept[k])) if kept else ""
    out["best_model_score"] = kept[out["best_model_path"]] if kept else None
    out["kth_best_model_path"] = worse(kept, key=lambda k: float(kept[k])) if kept else ""
    out["kth_value"] = (
        kept[out["kth_best_model_path"]] if kept else torch.tensor(-torch.inf if mode == "max" else torch.inf)
    )
    return out
