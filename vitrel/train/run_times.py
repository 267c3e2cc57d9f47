"""A run's training and whole-run times across the processes that trained it (a run killed or stopped by a signal and
resumed, a sweep job run again in its folder): :class:`RunTimes`, kept in every checkpoint."""

from __future__ import annotations

import time
from typing import Any

from lightning.pytorch.callbacks import Callback

__all__ = ["RunTimes"]


class RunTimes(Callback):
    """The times of the processes that trained the run before this one, carried in its checkpoints.

    Each checkpoint keeps the earlier processes' times plus this process's up to the checkpoint's write: training
    (from ``trainer.fit``'s start: ``fit_started``, set by ``train()``) and the whole run (from ``train()``'s start:
    ``started``), and how many processes those are. A resumed run takes them from its checkpoint (``train()`` reads
    them as it checks the checkpoint, Lightning loads them again where it fits): :meth:`times` then gives the whole
    run's. Time an earlier process spent after the checkpoint the next one resumed (work done again) is not counted;
    neither is an earlier process that wrote no checkpoint that was resumed. A checkpoint written before vitrel kept
    them makes the earlier part unknown (None), also in the checkpoints of the run from there on.

    Not Lightning's ``Timer``, which keeps the training loop's time in checkpoints and resumes it: it has no figure for
    the whole run, it starts after the setup and the sanity check, and under ``ddp_spawn`` its hooks run in the spawned
    processes only, so the process that writes ``metrics.json`` would read 0 s.
    """

    def __init__(self, started: float) -> None:
        self.started = started  # time.time() as train() began
        self.fit_started: float | None = None  # time.time() as trainer.fit began
        self.before: dict[str, Any] | None = {"fit_s": 0.0, "wall_s": 0.0, "processes": 0}  # None: unknown

    def state_dict(self) -> dict[str, Any]:
        if self.before is None:
            return {"fit_s": None, "wall_s": None, "processes": None}
        now = time.time()
        fit = now - self.fit_started if self.fit_started is not None else 0.0
        return {
            "fit_s": self.before["fit_s"] + fit,
            "wall_s": self.before["wall_s"] + now - self.started,
            "processes": self.before["processes"] + 1,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The checkpoint's record (``{}``: a checkpoint written before vitrel kept one, the earlier part unknown)."""
        known = all(state_dict.get(k) is not None for k in ("fit_s", "wall_s", "processes"))
        self.before = {k: state_dict[k] for k in ("fit_s", "wall_s", "processes")} if known else None

    def times(self, fit_s: float, wall_s: float) -> dict[str, Any]:
        """The record's times, given this process's ``fit_s`` and ``wall_s``: ``fit_s`` and ``wall_s`` the whole
        run's, ``fit_s_before_resume`` / ``wall_s_before_resume`` the earlier processes' part (0 for a run never
        resumed) and ``resumes`` their number; all None when the checkpoint resumed had no record of them."""
        b = self.before
        if b is None:
            return dict.fromkeys(("fit_s", "wall_s", "fit_s_before_resume", "wall_s_before_resume", "resumes"))
        return {
            "fit_s": round(b["fit_s"] + fit_s, 2),
            "wall_s": round(b["wall_s"] + wall_s, 2),
            "fit_s_before_resume": round(b["fit_s"], 2),
            "wall_s_before_resume": round(b["wall_s"], 2),
            "resumes": int(b["processes"]),
        }
