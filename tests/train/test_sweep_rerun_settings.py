"""A sweep run again in its folder with another setting neither sweep varies (``module.optimizer.lr=1e-3`` added):
each job resumes its folder's run, which keeps the checkpoint's weights, optimizer and rates, and a finished one is
only tested again. The summary's figures are then those of the settings the runs were trained with: its table marks
such a job and says below it what they were trained with (``summary.md``, ``summary.csv``'s ``trained_with``), so
that the header's ``all jobs: module.optimizer.lr=0.001`` is not read as those figures' setting."""

from __future__ import annotations

import csv
import json
import warnings

import pytest
import torch
from hydra.types import RunMode
from omegaconf import OmegaConf

from vitrel.train.hydra_callbacks import SweepSummary
from vitrel.train.sweep_files import SWEEP_JOB

FIRST = ["pos=none", "seed=0", "trainer.max_epochs=1"]  # the jobs as the sweep first ran them


def _job(sweep, num: int, overrides: list[str], ckpt_overrides: list[str] | None, record: dict) -> None:
    """Job ``num`` of the sweep run again: its folder's checkpoint (of ``ckpt_overrides``), Hydra's record of its
    overrides, :class:`SweepSummary`'s job start, then the ``metrics.json`` the job writes."""
    job = sweep / str(num)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(overrides)))
    if ckpt_overrides is not None:
        (job / "checkpoints").mkdir()
        torch.save({SWEEP_JOB: {"overrides": ckpt_overrides, "swept": ["seed"]}}, job / "checkpoints" / "last.ckpt")
    hydra = {"mode": RunMode.MULTIRUN, "runtime": {"output_dir": str(job)}, "sweep": {"dir": str(sweep)}}
    SweepSummary().on_job_start(OmegaConf.create({"hydra": hydra}))
    metrics = {"test/acc1": 0.5, "val/acc1": 0.4}
    (job / "metrics.json").write_text(json.dumps({"status": "finished", "metrics": metrics, "overrides": overrides,
                                                  **record}))  # fmt: skip


def test_a_job_that_resumed_a_run_of_other_settings_is_marked_with_them(tmp_path):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / ".sweep_id").write_text("again\n")
    lr = ["module.optimizer.lr=0.001"]
    _job(sweep, 0, [*FIRST, *lr], FIRST, {"resumed_finished": True, "resumes": 1})  # finished: tested again
    more = [*FIRST[:2], "trainer.max_epochs=3", *lr]
    _job(sweep, 1, more, [*FIRST[:2], "module.optimizer.lr=0.002"], {"resumes": 1})  # interrupted, trained on
    _job(sweep, 2, [*FIRST[:2], "trainer.max_epochs=3"], FIRST, {"resumes": 1})  # another length only: its own run
    _job(sweep, 3, [*FIRST, *lr], FIRST, {"resumes": 0})  # resume=false: trained anew with the job's settings
    SweepSummary()._summarize(sweep, show=False)

    text = (sweep / "summary.md").read_text()
    status = {line.split()[0]: line.split("finished", 1)[1].strip() for line in text.splitlines() if "finished" in line
              and line.split()[0].isdigit()}  # fmt: skip
    assert status == {"0": "*", "1": "*", "2": "", "3": ""}, text
    below = text[text.index("*: the job resumed its folder's run") :]
    assert "job 0 trainer.max_epochs=1 module.optimizer.lr=0.001: module.optimizer.lr (not set)" in below, text
    assert "job 1 trainer.max_epochs=3 module.optimizer.lr=0.001: module.optimizer.lr=0.002" in below, text
    assert "job 2" not in below and "job 3" not in below, text
    rows = {r["job"]: r["trained_with"] for r in csv.DictReader((sweep / "summary.csv").open())}
    assert rows == {"0": "module.optimizer.lr (not set)", "1": "module.optimizer.lr=0.002", "2": "", "3": ""}, rows


def test_a_sweep_run_again_with_its_own_settings_has_no_mark(tmp_path):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / ".sweep_id").write_text("again\n")
    _job(sweep, 0, FIRST, FIRST, {"resumed_finished": True, "resumes": 1})
    _job(sweep, 1, ["pos=none", "seed=1", "trainer.max_epochs=1"], None, {"resumes": 0})  # (no checkpoint: new)
    SweepSummary()._summarize(sweep, show=False)
    text = (sweep / "summary.md").read_text()
    assert "*" not in text.split("accuracies as fractions", 1)[1], text
    assert not (sweep / "1" / ".trained_with.json").exists()


def test_a_single_run_resumed_with_another_optimizer_setting_says_it_does_not_apply(tmp_path):
    """``python train.py ... module.optimizer.lr=0.05`` resuming a run trained with the default lr: Lightning's resume
    restores the optimizer and schedule (the new lr does not apply) while ``.hydra/config.yaml`` records it; this was
    silent (a sweep job warned). The run's checkpoints now record its command line, and the resume names the
    difference; a longer run (``trainer.max_epochs``) is not one."""
    from tests.train_helpers import FAST, TINY_VIT, run_script_forked

    base = [*TINY_VIT, *FAST, "trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "test=false"]
    base += ["logger=none", f"hydra.run.dir={tmp_path / 'run'}"]
    first = run_script_forked("train.py", [*base, "trainer.max_epochs=1"], cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    job = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)[SWEEP_JOB]
    assert job["swept"] == [] and "trainer.max_epochs=1" in job["overrides"], job
    again = run_script_forked("train.py", [*base, "trainer.max_epochs=2", "module.optimizer.lr=0.05"], cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    said = again.stdout + again.stderr
    line = "trained with other settings (module.optimizer.lr: checkpoint (not on the command line), now module."
    assert line + "optimizer.lr=0.05)" in said, said[-3000:]
    assert "trainer.max_epochs" not in said.split("trained with other settings", 1)[1].split(")")[0]


def test_the_seed_means_and_the_picture_carry_the_mark(tmp_path):
    """``-m seed=0,1,2`` run again in its folder with ``module.optimizer.lr=0.01``: summary.md marked each job, but
    ``summary_seeds.csv``, the means table and ``summary.png`` gave the resumed runs' figures under the new setting
    unmarked. The means of marked jobs (finished ones) carry the mark: a ``trained_with`` column, ``*`` after the
    seeds, and in the picture's labels, its title saying what ``*`` means."""
    from vitrel.train.sweep_plot import plot_rows
    from vitrel.train.sweep_table import summary_rows

    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / ".sweep_id").write_text("again\n")
    lr = "module.optimizer.lr=0.01"
    for seed in range(3):
        first = ["pos=none", f"seed={seed}", "trainer.max_epochs=1"]
        _job(sweep, seed, [*first, lr], first, {"resumed_finished": True, "resumes": 1})
    summary = SweepSummary()
    summary._summarize(sweep, show=False)
    (mean,) = csv.DictReader((sweep / "summary_seeds.csv").open())
    assert (mean["overrides"], mean["n"], mean["trained_with"]) == (
        f"pos=none trainer.max_epochs=1 {lr}",
        "3",
        "module.optimizer.lr (not set)",
    ), mean
    text = (sweep / "summary.md").read_text()
    means = text[text.index("mean ± standard deviation over seeds") :].splitlines()
    assert means[4].split("  ")[1].strip() == "3 *", means
    rows, seeds, *_ = summary_rows(sweep, summary.metrics)
    data = plot_rows(rows, seeds)
    assert data.labels == [f"pos=none trainer.max_epochs=1 {lr} (3 seeds) *"] and data.other_settings, data
    data = plot_rows(rows, [])  # (one bar per job)
    assert data.labels == [f"{j}: seed={j} *" for j in range(3)], data.labels

    (sweep / "2" / ".trained_with.json").unlink()  # job 2 trained anew with the job's settings: means still marked
    summary._summarize(sweep, show=False)
    (mean,) = csv.DictReader((sweep / "summary_seeds.csv").open())
    assert mean["trained_with"] == "module.optimizer.lr (not set)"


def test_a_run_moved_between_one_and_several_processes_resumes_without_a_settings_warning():
    """1 process resumed with ``trainer=ddp trainer.devices=2 trainer.precision=32-true`` (docs/training.md's CPU
    recipe) warned that a rate given now does not apply, naming ``trainer=ddp`` and the precision: how a run runs,
    as its devices. Another rate still warns."""
    from vitrel.train.resume import check_same_sweep_job

    ddp = ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true"]
    ckpt = {SWEEP_JOB: {"overrides": ["trainer.max_epochs=1"], "swept": []}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_same_sweep_job(ckpt, {"overrides": [*ddp, "trainer.log_every_n_steps=6"], "swept": []}, "run")
    said = r"trained with other settings \(module.optimizer.lr: checkpoint \(not on the command line\)"
    with pytest.warns(UserWarning, match=said):
        check_same_sweep_job(ckpt, {"overrides": [*ddp, "module.optimizer.lr=0.05"], "swept": []}, "run")
