"""A run stopped by SIGTERM mid-epoch and resumed: its ``metrics.json``, its closing line and the sweep table's row
give the whole run's times (the stopped process's up to its checkpoint, then the resumed one's), not the resumed
process's alone, and its ``val_runs`` counts the validations of both."""

from __future__ import annotations

import json
import signal
import time

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from tests.train_helpers import FAST, TINY_VIT, SendSignal, compose
from vitrel.train.run import train
from vitrel.train.run_times import RunTimes
from vitrel.train.sweep_table import format_table, summary_rows

# 2 epochs of 4 steps; SIGTERM at step 5 saves last.ckpt after step 6 (epoch 2, after epoch 1's validation), exits
ARGS = [*TINY_VIT, *FAST, "trainer.max_epochs=2", "trainer.limit_train_batches=4", "trainer.limit_val_batches=1"]
ARGS += ["test=false", "callbacks.model_checkpoint=null", "logger=none"]


class Peek(Callback):
    """The run's RunTimes as the trainer sets up, before Lightning loads the checkpoint's callback states: what the
    process that writes metrics.json has where the fit runs in other processes (``ddp_spawn``)."""

    before: dict | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.before = dict(next(cb for cb in trainer.callbacks if isinstance(cb, RunTimes)).before)


def _carried(ckpt, callback: str = "RunTimes") -> dict:
    return torch.load(ckpt, map_location="cpu", weights_only=True)["callbacks"][callback]


def test_a_resumed_run_records_the_whole_runs_times(tmp_path, capsys):
    job = tmp_path / "sweep" / "0"  # (a sweep's job folder: the table below reads it)
    with pytest.raises(SystemExit) as stop:
        train(compose(job, ARGS), callbacks=[SendSignal(at_step=5)])
    assert stop.value.code == 128 + signal.SIGTERM and not (job / "metrics.json").exists()
    ckpt = job / "checkpoints" / "last.ckpt"
    first = _carried(ckpt)  # the stopped process's times up to its checkpoint (after step 6)
    assert _carried(ckpt, "CountValidations") == {"count": 1}  # epoch 1's validation
    assert first["processes"] == 1 and 0 < first["fit_s"] < first["wall_s"], first
    old = tmp_path / "old" / "checkpoints"  # the same checkpoint as one written before vitrel kept the times
    old.mkdir(parents=True)
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    del state["callbacks"]["RunTimes"], state["callbacks"]["CountValidations"]
    torch.save(state, old / "last.ckpt")

    capsys.readouterr()
    t = time.time()
    peek = Peek()
    train(compose(job, ARGS), callbacks=[peek])  # resume=auto
    took = time.time() - t
    m = json.loads((job / "metrics.json").read_text())
    assert m["status"] == "finished" and m["global_step"] == 8 and m["epochs"] == 2
    assert m["val_runs"] == 2, "the validation of the stopped process's first epoch not counted"
    assert m["resumes"] == 1 and peek.before == first, (m, peek.before)
    assert [m["fit_s_before_resume"], m["wall_s_before_resume"]] == [round(first[k], 2) for k in ("fit_s", "wall_s")]
    assert m["fit_s"] >= first["fit_s"] and m["wall_s"] >= first["wall_s"]  # the first part is in
    assert m["fit_s"] > m["fit_s_before_resume"] and m["wall_s"] > m["wall_s_before_resume"]  # so is the second
    assert m["wall_s"] - m["wall_s_before_resume"] <= took + 0.02  # and only once: this process's within its call
    assert m["fit_s"] - m["fit_s_before_resume"] <= m["wall_s"] - m["wall_s_before_resume"]
    last = _carried(ckpt)  # the resumed process's checkpoints carry both parts on, for a later resume
    assert last["processes"] == 2 and m["fit_s_before_resume"] < last["fit_s"] <= m["fit_s"], (last, m)

    closing = (
        f"training {m['fit_s']:.0f} s (2 epochs, 8 steps; {m['fit_s_before_resume']:.0f} s before the resume); "
        f"whole run {m['wall_s']:.0f} s ({m['wall_s_before_resume']:.0f} s before the resume)"
    )
    assert closing in capsys.readouterr().out
    rows, *_ = summary_rows(job.parent, ["val/acc1"])  # the sweep table's row of the job: the whole run's time
    assert [(r["job"], r["status"], r["wall_s"]) for r in rows] == [("0", "finished", m["wall_s"])], rows
    assert f"{m['wall_s']:.0f}" in format_table(rows, ["val/acc1"]).splitlines()[-1]

    # resumed from the checkpoint without them: the earlier part, and so the whole run's times, unknown (not this
    # process's), said in the closing line; its own checkpoints keep them unknown
    with pytest.warns(UserWarning, match="holds no record of the time the run took before it") as warned:
        train(compose(old.parent, ARGS))
    said = [str(w.message) for w in warned if "holds no record" in str(w.message)]
    assert len(said) == 1 and "(val_runs)" in said[0], said  # one warning, naming every unknown figure
    m = json.loads((old.parent / "metrics.json").read_text())
    assert m["global_step"] == 8 and m["status"] == "finished"
    assert [m[k] for k in ("fit_s", "wall_s", "fit_s_before_resume", "wall_s_before_resume", "resumes")] == [None] * 5
    assert m["val_runs"] is None  # (the validations before the checkpoint: unknown)
    assert "; the time before the resume is not in its checkpoint); whole run (unknown)" in capsys.readouterr().out
    assert _carried(old / "last.ckpt") == {"fit_s": None, "wall_s": None, "processes": None}
