"""A sweep as a researcher comparing position schemes runs it: ``python train.py -m pos=... seed=...`` (each job its
own folder and W&B run, one W&B group; the summary's mean ± standard deviation over seeds per scheme, the test images
scored), then the same sweep folder run again with another sweep (an earlier sweep's jobs left out, a job that fails
now shown failed with its error, not with its earlier run's metrics, the table printed though the sweep fails); and
the summary's picture, ``summary.png``, from fabricated job folders."""

from __future__ import annotations

import csv
import json
import logging
import statistics
import warnings

import pytest
from omegaconf import OmegaConf

import vitrel
from tests.train_helpers import EVAL_PICTURES_OFF, FAST, TINY_VIT, compose, run_script_forked, wandb_contents
from vitrel.train.hydra_callbacks import SweepSummary
from vitrel.train.run import train
from vitrel.train.sweep_plot import plot_rows
from vitrel.train.sweep_table import _eval_setting, summary_rows

TINY = [*TINY_VIT, *(a for a in FAST if a != "progress_bar=none"), "trainer.max_epochs=1"]
TINY += ["trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "trainer.limit_test_batches=2"]


def _metrics(job) -> dict:
    return json.loads((job / "metrics.json").read_text())


@pytest.mark.slow
def test_seed_sweep_means_and_a_sweep_run_again_in_its_folder(tmp_path):
    sweep = tmp_path / "sweep"
    tiny = [a for a in TINY if not a.startswith("callbacks.attention_distance")]  # (its sweep picture drawn)
    args = ["-m", "pos=rel2d_full,rope2d_mixed", "seed=0,1", *tiny, f"hydra.sweep.dir={sweep}", "logger=wandb"]
    r = run_script_forked("train.py", args + ["trainer.log_every_n_steps=1"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    groups = set()
    for job, pos in enumerate(("rel2d_full", "rel2d_full", "rope2d_mixed", "rope2d_mixed")):
        m = _metrics(sweep / str(job))
        assert m["status"] == "finished" and m["pos"] == pos and m["overrides"][0] == f"pos={pos}"
        runs = list((sweep / str(job) / "wandb").glob("offline-run-*/run-*.wandb"))
        assert len(runs) == 1, f"job {job} should have exactly one W&B run"
        config, history, run = wandb_contents(runs[0])
        assert config["pos"]["name"] == pos and config["trainer"]["limit_train_batches"] == 2
        assert history["test/acc1"] == pytest.approx(m["metrics"]["test/acc1"])
        assert any(k.startswith("lr-AdamW") for k in history) and "train/loss_step" in history, sorted(history)
        groups.add(run.run_group)
    assert groups == {f"train-{sweep.name}"}, "one W&B group per sweep"
    from PIL import Image

    with Image.open(sweep / "summary.png") as im:  # two settings: a figure a few inches high, at 110 dpi
        assert im.format == "PNG" and im.size[0] == 880 and 200 < im.size[1] < 400, im.size
    assert (sweep / "attention_distance.png").stat().st_size > 0  # every job's heads, a colour per scheme
    assert "epoch 1/1" in r.stdout, "not a terminal: plain progress lines, no progress bar"
    assert r.stdout.count("Sweep summary (4 jobs") == 1 and "stopped before its end" not in r.stdout
    # jobs 0, 1: rel2d_full seeds 0, 1; jobs 2, 3: rope2d_mixed
    acc = {j: _metrics(sweep / str(j))["metrics"]["test/acc1"] for j in range(4)}
    means = list(csv.DictReader((sweep / "summary_seeds.csv").open()))
    assert [(m["overrides"], m["n"]) for m in means] == [("pos=rel2d_full", "2"), ("pos=rope2d_mixed", "2")]
    for m, jobs in zip(means, ((0, 1), (2, 3))):
        assert float(m["test/acc1 mean"]) == pytest.approx(statistics.mean(acc[j] for j in jobs))
        assert float(m["test/acc1 std"]) == pytest.approx(statistics.stdev(acc[j] for j in jobs))
    out = r.stdout[r.stdout.index("Sweep summary") :]
    assert "mean ± standard deviation over seeds" in out and f"{statistics.mean((acc[0], acc[1])):.4f} ± " in out
    assert "32/2000" in out, "the test images scored of the split's (trainer.limit_test_batches)"
    rows = list(csv.DictReader((sweep / "summary.csv").open()))
    assert [(x["test_images"], x["test_split_images"]) for x in rows] == [("32", "2000")] * 4
    # each job's parameters, as the checkpoint it wrote holds them (the schemes' own parameters differ)
    params = [sum(p.numel() for p in vitrel.load_model(sweep / str(j) / "checkpoints" / "last.ckpt").parameters())
              for j in range(4)]  # fmt: skip
    assert [int(x["params"]) for x in rows] == params and params[0] != params[2]
    assert f"{params[0] / 1e3:.1f}k" in out

    # the folder again, jobs 0 and 1 (the documented retry): job 0's checkpoint is now damaged, its resume fails; job 1
    # resumes finished (nothing left to train) and keeps its run's record; jobs 2, 3 are the earlier sweep's
    ckpt = sweep / "0" / "checkpoints" / "last.ckpt"
    ckpt.write_bytes(ckpt.read_bytes()[:1000])
    first = _metrics(sweep / "1")
    args = ["-m", "pos=rel2d_full", "seed=0,1", *TINY, f"hydra.sweep.dir={sweep}", "logger=none"]
    r = run_script_forked("train.py", args, cwd=tmp_path)
    assert r.returncode != 0 and "CheckpointError" in r.stderr, r.stderr[-4000:]
    out = r.stdout[r.stdout.index("The sweep stopped before its end") :]  # the table so far, printed at exit
    assert "Sweep summary (2 jobs" in out and "job 0 seed=0: CheckpointError:" in out, out
    md = (sweep / "summary.md").read_text()
    assert md.startswith("Sweep summary (2 jobs") and "job folders 2, 3: of an earlier sweep" in md, md
    rows = list(csv.DictReader((sweep / "summary.csv").open()))
    assert len(rows) == 2 and rows[0]["status"] == "failed (CheckpointError)", rows
    assert rows[0]["test/acc1"] == "" and "last.ckpt" in rows[0]["error"], rows
    assert "job 0 seed=0: CheckpointError:" in md, md
    again = _metrics(sweep / "1")  # the finished run's validation, epochs and times, not the rerun's
    assert again["resumed_finished"] is True and "resumed_finished" not in first
    assert again["metrics"]["val/acc1"] == first["metrics"]["val/acc1"] and again["metrics"]["test/acc1"] == acc[1]
    assert [again[k] for k in ("epochs", "global_step", "wall_s", "fit_s")] == [
        first[k] for k in ("epochs", "global_step", "wall_s", "fit_s")
    ]
    assert rows[1]["val/acc1"] == str(first["metrics"]["val/acc1"]) and rows[1]["wall_s"] == str(first["wall_s"])
    assert json.loads((sweep / "0" / "metrics.previous.json").read_text())["metrics"]["test/acc1"] == acc[0]
    means = list(csv.DictReader((sweep / "summary_seeds.csv").open()))  # this sweep's: job 1 alone finished
    assert [(m["n"], m["jobs"], float(m["test/acc1 mean"])) for m in means] == [("1", "2", acc[1])], means

    # job 1's folder run again as a single run (its metrics.json, no metrics.previous.json): the record kept again;
    # then with no record of the finished run at all: its times unknown, not the rerun's
    (sweep / "1" / "metrics.previous.json").unlink()
    cfg = compose(sweep / "1", ["pos=rel2d_full", "seed=1", *TINY, "logger=none"])
    assert train(cfg)["val/acc1"] == first["metrics"]["val/acc1"]
    single = _metrics(sweep / "1")
    assert single["resumed_finished"] is True and [single[k] for k in ("epochs", "wall_s", "fit_s")] == [
        first[k] for k in ("epochs", "wall_s", "fit_s")
    ]
    (sweep / "1" / "metrics.json").unlink()
    train(cfg)
    unknown = _metrics(sweep / "1")
    assert unknown["resumed_finished"] is True and unknown["wall_s"] is None and unknown["fit_s"] is None
    assert "val/acc1" not in unknown["metrics"] and unknown["metrics"]["test/acc1"] == acc[1]


@pytest.mark.slow
def test_a_sweep_run_again_with_other_lists_refuses_the_folder_of_another_job(tmp_path):
    """Hydra gives a sweep's jobs their folders by job number: run again in its folder with other lists (here only
    the seed to retry), job 0 is ``seed=1`` while folder 0 holds ``seed=0``'s finished run. Resumed, it reported
    seed 0's weights as seed 1's (its summary row and metrics.json said ``seed=1``); it is refused, naming both."""
    sweep = tmp_path / "sweep"
    args = [*TINY, f"hydra.sweep.dir={sweep}", "logger=none"]
    r = run_script_forked("train.py", ["-m", "pos=rel2d_full", "seed=0,1", *args], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    first = _metrics(sweep / "0")
    assert first["overrides"][:2] == ["pos=rel2d_full", "seed=0"]
    r = run_script_forked("train.py", ["-m", "pos=rel2d_full", "seed=1", *args], cwd=tmp_path)
    assert r.returncode != 0 and "ConfigError" in r.stderr, r.stdout[-2000:] + r.stderr[-4000:]
    assert "seed: checkpoint seed=0, this job seed=1" in r.stderr, r.stderr[-4000:]
    rows = list(csv.DictReader((sweep / "summary.csv").open()))
    assert [(x["status"], x["test/acc1"]) for x in rows] == [("failed (ConfigError)", "")], rows
    kept = json.loads((sweep / "0" / "metrics.previous.json").read_text())
    assert kept["metrics"]["test/acc1"] == first["metrics"]["test/acc1"] and kept["overrides"] == first["overrides"]


def test_an_eval_sweep_summarises_each_jobs_scores(tmp_path):
    """``python eval.py -m ckpt_path=<run> data.img_size=28,36 split=test,val`` (a resolution-transfer sweep): its
    table read the training record ``metrics.json``, which eval.py does not write, and showed every finished job as
    ``failed (no metrics.json)``, with training's columns. Each job's row now holds its ``eval_metrics.json``: its
    split's scores, the images scored, finished."""
    train(compose(tmp_path / "run", [*TINY, "logger=none"]))
    sweep = tmp_path / "sweep"
    args = ["-m", f"ckpt_path={tmp_path / 'run'}", "data.img_size=28,36", "split=test,val", *EVAL_PICTURES_OFF]
    args += ["data.num_workers=0", "trainer.accelerator=cpu", "progress_bar=none", "trainer.limit_test_batches=1"]
    r = run_script_forked("eval.py", [*args, f"hydra.sweep.dir={sweep}"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    rows = list(csv.DictReader((sweep / "summary.csv").open()))
    assert [x["status"] for x in rows] == ["finished"] * 4, rows
    for job, row in enumerate(rows):
        record = json.loads((sweep / str(job) / "eval_metrics.json").read_text())
        split = record["split"]
        assert row["overrides"] == f"data.img_size={record['img_size']} split={split}", row
        assert float(row[f"{split}/acc1"]) == pytest.approx(record["metrics"][f"{split}/acc1"])
        assert row[f"{split}/loss"] != "" and row[f"{'val' if split == 'test' else 'test'}/acc1"] == "", row
        assert (row["images"], row["split_images"]) == (str(record["num_images"]), str(record["split_images"]))
    out = r.stdout[r.stdout.index("Sweep summary (4 jobs") :]
    assert "no metrics.json" not in out and "epochs" not in out and "64/2000" in out and "64/1000" in out, out


def test_an_eval_sweep_over_a_sweeps_checkpoints_names_what_each_was_trained_with(tmp_path):
    """``python eval.py -m ckpt_path=<sweep>/0,<sweep>/1,... data.img_size=36``: the rows were labelled by checkpoint
    path alone (which scheme is job 0?). Each row now holds the settings its training sweep varied (``trained``),
    read from the checkpoint, in ``summary.csv``, the printed table and ``eval_metrics.json``; over a seed sweep's
    checkpoints the table of each scheme's mean ± standard deviation over its seeds follows, as a training sweep's."""
    train_sweep = tmp_path / "train"
    args = ["-m", "pos=rel2d_full,none", "seed=0,1", *TINY, "logger=none", "test=false"]
    r = run_script_forked("train.py", [*args, f"hydra.sweep.dir={train_sweep}"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    sweep = tmp_path / "eval"
    ckpts = ",".join(str(train_sweep / j) for j in "0123")
    args = ["-m", f"ckpt_path={ckpts}", "data.img_size=36", *EVAL_PICTURES_OFF]
    args += ["data.num_workers=0", "trainer.accelerator=cpu", "progress_bar=none", "trainer.limit_test_batches=1"]
    r = run_script_forked("eval.py", [*args, f"hydra.sweep.dir={sweep}"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    rows = list(csv.DictReader((sweep / "summary.csv").open()))
    trained = [f"pos={p} seed={s}" for p in ("rel2d_full", "none") for s in (0, 1)]
    assert [(x["trained"], x["status"]) for x in rows] == [(t, "finished") for t in trained]
    assert json.loads((sweep / "3" / "eval_metrics.json").read_text())["trained"] == "pos=none seed=1"
    table = r.stdout[r.stdout.index("Sweep summary (4 jobs") :]
    assert "trained" in table and "pos=rel2d_full seed=1" in table, table
    means = list(csv.DictReader((sweep / "summary_seeds.csv").open()))
    assert [(m["overrides"], m["n"]) for m in means] == [("pos=rel2d_full", "2"), ("pos=none", "2")], means
    for m, pair in zip(means, (rows[:2], rows[2:])):  # each scheme's seeds: the mean and sample std of their rows
        acc = [float(x["test/acc1"]) for x in pair]
        assert float(m["test/acc1 mean"]) == pytest.approx(statistics.mean(acc))
        assert float(m["test/acc1 std"]) == pytest.approx(statistics.stdev(acc))
    assert "mean ± standard deviation over seeds" in table and "pos=none  " in table, table
    assert "could not draw" not in r.stdout + r.stderr and (sweep / "summary.png").stat().st_size > 0
    failed = {"status": "failed (CheckpointError)", "overrides": [f"ckpt_path={train_sweep / '2'}", "split=val"]}
    assert _eval_setting(failed) == ["pos=none", "seed=0", "split=val"], "a failed job: its checkpoint's settings"


def test_a_predict_sweep_writes_each_jobs_predictions_and_no_score_table(tmp_path):
    """``python predict.py -m ... topk=1,2``: predictions have no scores to tabulate, yet the training sweep's table
    was printed and saved with every job ``failed (no metrics.json)``. Each job writes its predictions; no table."""
    from PIL import Image

    train(compose(tmp_path / "run", [*TINY, "logger=none"]))
    (tmp_path / "images").mkdir()
    Image.new("L", (28, 28), 128).save(tmp_path / "images" / "grey.png")
    sweep = tmp_path / "sweep"
    args = ["-m", f"ckpt_path={tmp_path / 'run'}", f"input={tmp_path / 'images'}", "topk=1,2", "progress_bar=none"]
    r = run_script_forked("predict.py", [*args, f"hydra.sweep.dir={sweep}"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert [len(next(csv.reader((sweep / j / "predictions.csv").open()))) for j in "01"] == [4, 7]
    assert "Sweep summary" not in r.stdout and not (sweep / "summary.csv").exists(), r.stdout[-2000:]


# ---------------------------------------------------------------------------------------- summary.png, fabricated jobs
def _job(sweep, job, overrides, metrics=None, status="finished", sweep_id="s1"):
    """A job folder as a sweep leaves it: ``.hydra/overrides.yaml``, ``.sweep_id`` and (unless it failed before
    writing one) ``metrics.json`` with ``metrics``."""
    d = sweep / str(job)
    (d / ".hydra").mkdir(parents=True, exist_ok=True)
    (d / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    (d / ".sweep_id").write_text(sweep_id + "\n")
    if metrics is not None:
        record = {"status": status, "metrics": metrics, "overrides": overrides, "params": 1000, "epochs": 1}
        (d / "metrics.json").write_text(json.dumps(record))


def _summarize(sweep):
    SweepSummary().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}}))


def _plot(sweep):
    rows, means, *_ = summary_rows(sweep, SweepSummary().metrics)
    return plot_rows(rows, means)


def test_summary_png_one_bar_per_job_a_failed_job_a_row_val_without_test(tmp_path):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / ".sweep_id").write_text("s1\n")
    _job(sweep, 0, ["pos=rel2d_full", "lr=1e-3"], {"test/acc1": 0.8125, "val/acc1": 0.79})
    _job(sweep, 1, ["pos=rope2d_mixed", "lr=1e-3"])  # failed before writing metrics.json
    (sweep / "1" / "error.txt").write_text("RuntimeError: out of memory\n")
    _job(sweep, 2, ["pos=shaw2d_factored", "lr=1e-3"], {"val/acc1": 0.6})  # run with test=false
    _job(sweep, 3, ["pos=none", "lr=1e-3"], {"test/acc1": 0.5})
    data = _plot(sweep)
    assert data.labels == ["0: pos=rel2d_full", "1: pos=rope2d_mixed", "2: pos=shaw2d_factored", "3: pos=none"]
    assert data.values == [pytest.approx(81.25), None, pytest.approx(60.0), pytest.approx(50.0)]
    assert data.metrics == ["test/acc1", None, "val/acc1", "test/acc1"]
    assert data.notes == ["", "failed (RuntimeError)", "", ""] and data.errors == [None] * 4
    assert (data.jobs, data.finished, data.seeds) == (4, 3, False)
    assert "[val/acc1]" in data.xlabel() and "test/acc1" in data.xlabel()
    _summarize(sweep)
    from PIL import Image

    with Image.open(sweep / "summary.png") as im:
        assert im.format == "PNG" and im.size[0] == 880 and 200 < im.size[1] < 400, im.size
    assert (sweep / "summary.md").exists()

    only_val = tmp_path / "val"  # every job without a test metric: the axis says validation
    only_val.mkdir()
    _job(only_val, 0, ["seed=0"], {"val/acc1": 0.25}, sweep_id="x")
    _job(only_val, 1, ["seed=1"], {"val/acc1": 0.75}, sweep_id="x")
    data = _plot(only_val)
    assert data.metrics == ["val/acc1"] and data.values == [pytest.approx(50.0)]
    assert data.xlabel().startswith("validation top-1 accuracy (%)")


def test_summary_png_seed_sweep_mean_sample_std_and_each_seed(tmp_path):
    sweep = tmp_path / "sweep"
    acc = {"rel2d_full": [0.61, 0.64, 0.70], "rope2d_mixed": [0.55, None, 0.58], "none": [None, None, None]}
    job = 0
    for pos, values in acc.items():
        for seed, v in enumerate(values):
            _job(sweep, job, [f"pos={pos}", f"seed={seed}"], None if v is None else {"test/acc1": v, "val/acc1": 0.1})
            job += 1
    data = _plot(sweep)
    assert data.seeds and (data.jobs, data.finished) == (9, 5)
    assert data.labels == ["pos=rel2d_full (3 seeds)", "pos=rope2d_mixed (2 seeds of 3)", "pos=none (0 seeds of 3)"]
    for i, values in enumerate(acc.values()):
        pct = [100 * v for v in values if v is not None]
        assert data.points[i] == pytest.approx(pct)
        if pct:
            assert data.values[i] == pytest.approx(statistics.mean(pct))
            assert data.errors[i] == pytest.approx(statistics.stdev(pct)), "± the sample standard deviation"
    assert data.values[2] is None and data.notes[2] == "failed" and data.points[2] == []
    assert data.metrics == ["test/acc1", "test/acc1", None]
    _summarize(sweep)
    seeds = list(csv.DictReader((sweep / "summary_seeds.csv").read_text().splitlines()))  # the table's numbers
    assert [100 * float(r["test/acc1 std"]) for r in seeds[:2]] == pytest.approx(data.errors[:2])
    assert (sweep / "summary.png").stat().st_size > 0


def test_a_seed_sweep_of_one_setting_names_it(tmp_path):
    """``-m pos=rope2d_mixed seed=0,1``: the seed table and the picture called its setting "(none)", which in a tool of
    position schemes reads as ``pos=none``."""
    sweep = tmp_path / "sweep"
    for seed in (0, 1):
        _job(sweep, seed, ["pos=rope2d_mixed", f"seed={seed}"], {"test/acc1": 0.5 + seed / 10, "val/acc1": 0.1})
    assert _plot(sweep).labels == ["pos=rope2d_mixed (2 seeds)"]
    _summarize(sweep)
    (row,) = csv.DictReader((sweep / "summary_seeds.csv").read_text().splitlines())
    assert row["overrides"] == "pos=rope2d_mixed"


def test_summary_png_failing_to_draw_is_a_warning(tmp_path, monkeypatch, caplog):
    from matplotlib.figure import Figure

    sweep = tmp_path / "sweep"
    _job(sweep, 0, ["pos=rel2d_full"], {"test/acc1": 0.5})
    _job(sweep, 1, ["pos=none"], {"test/acc1": 0.4})
    _summarize(sweep)
    assert (sweep / "summary.png").exists()

    def broken(self, *args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(Figure, "savefig", broken)
    (sweep / "summary.md").unlink()
    with caplog.at_level(logging.WARNING, logger="vitrel.train.hydra_callbacks"):
        _summarize(sweep)
    assert (sweep / "summary.md").read_text().startswith("Sweep summary (2 jobs")
    assert (sweep / "summary.csv").exists()
    assert not (sweep / "summary.png").exists(), "no earlier picture left to be taken for this summary"
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(sweep / "summary.png") in w and "OSError: disk full" in w for w in warned), warned
    assert not list(sweep.glob(".summary.png.*")), "no partial file left"


def test_a_sweep_stopped_before_any_job_says_so_not_an_empty_table(tmp_path, capsys):
    """``train.py -m pos=rel2d_full,typo``: Hydra refuses the sweep before its first job, and the exit hook printed
    "its jobs so far" over nothing. Now one line saying no job ran."""
    hook = SweepSummary()
    (tmp_path / ".sweep_id").write_text("abc\n")  # (on_multirun_start's; no job folder yet)
    hook._unended = tmp_path
    hook._at_exit()
    out = capsys.readouterr().out
    assert "The sweep stopped before any job ran" in out and "its jobs so far" not in out, out
    assert not (tmp_path / "summary.md").exists()


def test_a_job_stopped_before_its_first_validation_says_so_in_the_table(tmp_path):
    """``trainer.max_steps`` within the first epoch: Lightning ends the fit before the epoch's validation (the sanity
    check is no validation), so the job has no ``val/acc1``; its ``metrics.json`` counts the validations that ran (0)
    and the table says why the cell is empty, where a job that validated shows its value."""
    from vitrel.train.sweep_table import collect_sweep, format_table

    quick = [*TINY, "test=false", "logger=none", "progress_bar=none"]
    train(compose(tmp_path / "0", [*quick, "trainer.max_steps=1"]))
    train(compose(tmp_path / "1", quick))
    assert [_metrics(tmp_path / j).get("val_runs") for j in "01"] == [0, 1]
    assert "val/acc1" not in _metrics(tmp_path / "0")["metrics"]
    rows = collect_sweep(tmp_path, ["val/acc1"])
    table = format_table(rows, ["val/acc1"]).splitlines()
    assert "no validation ran" in table[2] and "no validation ran" not in table[3], table
    assert f"{_metrics(tmp_path / '1')['metrics']['val/acc1']:.4f}" in table[3], table


def _sweep_cfg(sweep, task, job=None):
    """The Hydra config a :class:`SweepSummary` hook sees: the sweep's (``job=None``) or that of its job ``job``."""
    from hydra.types import RunMode

    hydra = {
        "mode": RunMode.MULTIRUN,
        "sweeper": {"_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper", "params": None},
        "sweep": {"dir": str(sweep), "subdir": "${hydra.job.num}"},
        "overrides": {"task": task},
        "runtime": {"output_dir": str(sweep / str(job or 0))},
    }
    return OmegaConf.create({"hydra": hydra})


def test_an_interrupted_sweep_shows_the_job_it_stopped_and_those_it_never_ran(tmp_path, capsys):
    """``train.py -m pos=rel2d_full,rope2d_mixed seed=0,1`` stopped by SIGTERM (or Ctrl-C) in job 1: the job leaves
    through ``SystemExit``, Hydra calls no ``on_job_end``, and the table printed at exit said job 1 "failed (no
    metrics.json)", left out jobs 2 and 3, named ``pos=rel2d_full`` as every job's setting and gave a mean row
    "(none)". Now job 1 is interrupted (its last.ckpt kept), jobs 2, 3 are rows "not run" with their overrides, the
    means are per scheme over finished seeds only, and the table says how to finish the sweep in its folder."""
    sweep = tmp_path / "sweep"
    task = ["pos=rel2d_full,rope2d_mixed", "seed=0,1", "trainer.max_epochs=1"]
    jobs = [[f"pos={p}", f"seed={s}", "trainer.max_epochs=1"] for p in ("rel2d_full", "rope2d_mixed") for s in (0, 1)]
    hook = SweepSummary()
    hook.on_multirun_start(_sweep_cfg(sweep, task))
    sid = (sweep / ".sweep_id").read_text().strip()
    _job(sweep, 0, jobs[0], sweep_id=sid)  # (the folder Hydra makes)
    hook.on_job_start(_sweep_cfg(sweep, task, 0))
    _job(sweep, 0, jobs[0], {"test/acc1": 0.5}, sweep_id=sid)
    hook.on_job_end(_sweep_cfg(sweep, task, 0))
    _job(sweep, 1, jobs[1], sweep_id=sid)
    hook.on_job_start(_sweep_cfg(sweep, task, 1))
    (sweep / "1" / "checkpoints").mkdir()  # SIGTERM: last.ckpt saved, no metrics.json, no on_job_end
    (sweep / "1" / "checkpoints" / "last.ckpt").write_bytes(b"ckpt")
    hook._at_exit()
    out = capsys.readouterr().out
    rows = list(csv.DictReader((sweep / "summary.csv").open()))
    assert [(r["job"], r["overrides"], r["status"]) for r in rows] == [
        ("0", "pos=rel2d_full seed=0", "finished"),
        ("1", "pos=rel2d_full seed=1", "interrupted"),
        ("2", "pos=rope2d_mixed seed=0", "not run"),
        ("3", "pos=rope2d_mixed seed=1", "not run"),
    ], rows
    assert "last.ckpt kept" in rows[1]["error"] and "failed" not in out[out.index("Sweep summary") :], out
    assert "Sweep summary (4 jobs" in out and "all jobs: trainer.max_epochs=1\n" in out, out
    means = list(csv.DictReader((sweep / "summary_seeds.csv").open()))
    assert [(m["overrides"], m["n"], m["jobs"], m["test/acc1 mean"]) for m in means] == [
        ("pos=rel2d_full", "1", "2", "0.5"),
        ("pos=rope2d_mixed", "0", "2", ""),
    ], means
    assert f"run the same command again with hydra.sweep.dir={sweep}" in out, out
    data = _plot(sweep)
    assert data.notes == ["", "not run"] and data.values[0] == pytest.approx(50.0), data

    # the same command in the folder: job 1 runs again, its mark of the interruption goes
    again = SweepSummary()
    again.on_multirun_start(_sweep_cfg(sweep, task))
    again.on_job_start(_sweep_cfg(sweep, task, 1))
    assert not (sweep / "1" / "interrupted.txt").exists()
    import atexit

    atexit.unregister(again._at_exit)  # (its sweep never ends here: no table at pytest's exit)


def test_a_sweep_stopped_shows_its_jobs_of_other_processes_interrupted(tmp_path, capsys):
    """``hydra/launcher=joblib`` (or ``submitit_local``): the jobs run in processes of their own, with copies of the
    callback. Job 0 was SIGTERMed (its last.ckpt saved, its lock released), job 1 killed by the launcher as the sweep
    stopped (its lock left behind): the launching process's table said both "failed (no metrics.json)", with no way
    to finish the sweep, since only the process that ran a job knew it had started. Job 2 still runs (a live lock of
    another process) and is left as it is."""
    import os
    import pickle
    import socket
    import subprocess
    import sys
    from dataclasses import asdict

    from vitrel.train.rundir import LOCK_NAME, LockOwner

    sweep = tmp_path / "sweep"
    task = ["seed=0,1,2"]
    hook = SweepSummary()
    hook.on_multirun_start(_sweep_cfg(sweep, task))
    sid = (sweep / ".sweep_id").read_text().strip()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    for job, pid in ((0, None), (1, int(gone.stdout)), (2, os.getppid())):
        _job(sweep, job, [f"seed={job}"], sweep_id=sid)
        pickle.loads(pickle.dumps(hook)).on_job_start(_sweep_cfg(sweep, task, job))  # (in the job's process)
        (sweep / str(job) / "checkpoints").mkdir()
        if job == 0:
            (sweep / str(job) / "checkpoints" / "last.ckpt").write_bytes(b"ckpt")
        if pid is not None:
            owner = LockOwner(pid=pid, host=socket.gethostname(), started="2026-12-02T06:00:00")
            (sweep / str(job) / LOCK_NAME).write_text(json.dumps(asdict(owner)))
    hook._at_exit()
    out = capsys.readouterr().out
    rows = list(csv.DictReader((sweep / "summary.csv").open()))
    assert [(r["job"], r["status"]) for r in rows] == [
        ("0", "interrupted"),
        ("1", "interrupted"),
        ("2", "failed (no metrics.json)"),
    ], rows
    assert "last.ckpt kept" in rows[0]["error"] and "no last.ckpt" in rows[1]["error"], rows
    assert f"jobs 0, 1 not finished: run the same command again with hydra.sweep.dir={sweep}" in out, out


def test_a_sweep_run_again_with_another_setting_warns_naming_it():
    """A sweep run again in its folder with a setting neither sweep varies changed (``module.optimizer.lr``): each
    job resumed its folder's run without a word, a finished one only tested again, so the summary gave the first
    sweep's scores under the new setting. It warns, naming the key; a longer run (``trainer.max_epochs``) does not."""
    from vitrel.train.resume import check_same_sweep_job
    from vitrel.train.sweep_files import SWEEP_JOB

    theirs = ["pos=rel2d_full", "seed=0", "module.optimizer.lr=0.001", "trainer.max_epochs=1"]
    ckpt = {SWEEP_JOB: {"overrides": theirs, "swept": ["seed"]}}
    mine = ["pos=rel2d_full", "seed=0", "module.optimizer.lr=0.003", "trainer.max_epochs=1"]
    with pytest.warns(UserWarning, match=r"lr: checkpoint module\.optimizer\.lr=0\.001, this job"):
        check_same_sweep_job(ckpt, {"overrides": mine, "swept": ["seed"]}, "sweep/0/checkpoints/last.ckpt")
    longer = [*theirs[:3], "trainer.max_epochs=5"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_same_sweep_job(ckpt, {"overrides": longer, "swept": ["seed"]}, "sweep/0/checkpoints/last.ckpt")


def test_a_job_that_raised_after_writing_its_metrics_json_shows_as_failed(tmp_path, capsys):
    """A job that wrote its ``metrics.json``, then raised (``optimized_metric=val/acc1`` of a fit that never validated,
    a plan Lightning only knows as it runs): the summary took the status from ``metrics.json`` and showed the job
    ``finished``, its error (``error.txt``) nowhere, its figures in the seed means. It is failed, with its error, in
    summary.md, summary.csv and summary.png's rows, and out of the means."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.utils import JobReturn, JobStatus
    from omegaconf import open_dict, read_write

    from vitrel.config import ConfigError

    sweep, task = tmp_path / "sweep", ["seed=0,1"]
    hook = SweepSummary()
    hook.on_multirun_start(_sweep_cfg(sweep, task))
    sid = (sweep / ".sweep_id").read_text().strip()
    quick = [*TINY, "logger=none", "progress_bar=none", "trainer.max_steps=2", "optimized_metric=val/acc1"]
    for job, extra in ((0, ["trainer.val_check_interval='00:01:00:00'"]), (1, [])):  # (job 0: no validation)
        d = sweep / str(job)
        _job(sweep, job, [f"seed={job}"], sweep_id=sid)
        hook.on_job_start(_sweep_cfg(sweep, task, job))
        cfg = compose(d, [*quick, *extra, f"seed={job}"], multirun=True)
        with read_write(HydraConfig.get()), open_dict(HydraConfig.get()):
            HydraConfig.get().overrides.task = [f"seed={job}"]  # (the job's overrides, as -m seed=0,1 gives them)
        ended = JobReturn(status=JobStatus.COMPLETED)
        try:
            ended.return_value = train(cfg)
        except ConfigError as e:
            ended.status, ended._return_value = JobStatus.FAILED, e
        hook.on_job_end(_sweep_cfg(sweep, task, job), job_return=ended)
    assert _metrics(sweep / "0")["status"] == "finished", "the error came after the record"
    hook._at_exit()
    rows = list(csv.DictReader((sweep / "summary.csv").open()))
    assert [r["status"] for r in rows] == ["failed (ConfigError)", "finished"], rows
    assert "the run ended before its first validation" in rows[0]["error"] and rows[1]["error"] == "", rows
    assert rows[0]["test/acc1"] != "", "its figures kept"
    md = (sweep / "summary.md").read_text()
    assert "failed:\njob 0 seed=0: ConfigError: optimized_metric=val/acc1: the run ended before" in md, md
    (mean,) = csv.DictReader((sweep / "summary_seeds.csv").open())
    assert (mean["n"], mean["jobs"], float(mean["test/acc1 mean"])) == ("1", "2", float(rows[1]["test/acc1"]))
    data = _plot(sweep)
    assert data.points == [[pytest.approx(100 * float(rows[1]["test/acc1"]))]] and data.finished == 1, data
    assert "Sweep summary (2 jobs" in capsys.readouterr().out


def test_a_long_setting_label_wraps_and_keeps_the_picture_whole(tmp_path):
    """A seed sweep of one setting of six overrides: its 150-character label took the 8-inch picture's width,
    constrained_layout gave up (its warning) and cut the label and the x-axis name. Labels wrap."""
    from vitrel.train.sweep_plot import PlotRows, plot_sweep, save_png

    label = " ".join(f"module.optimizer.setting_{i}=0.002" for i in range(4)) + " trainer.accelerator=cpu (3 seeds)"
    rows = PlotRows([label], [30.0], [2.0], [[28.0, 30.0, 32.0]], ["test/acc1"], [""], 3, 3, seeds=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (constrained_layout's "axes sizes collapsed to zero")
        fig = plot_sweep(rows, "sweep")
        save_png(fig, tmp_path / "summary.png")
    ax = fig.axes[0]
    shown = ax.get_yticklabels()[0].get_text()
    assert shown.replace("\n", " ") == label and max(map(len, shown.splitlines())) <= 56
    renderer = fig.canvas.get_renderer()
    inside = fig.bbox
    for text in (ax.xaxis.label, ax.get_yticklabels()[0]):
        box = text.get_window_extent(renderer)
        assert inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0, (text.get_text(), box)
