"""A sweep as a researcher comparing position schemes runs it: ``python train.py -m pos=... seed=...`` (each job its
own folder and W&B run, one W&B group; the summary's mean ± standard deviation over seeds per scheme, the test images
scored), then the same sweep folder run again with another sweep (an earlier sweep's jobs left out, a job that fails
now shown failed with its error, not with its earlier run's metrics)."""

from __future__ import annotations

import csv
import json
import statistics

import pytest

import vitrel
from tests.train_helpers import FAST, TINY_VIT, compose, run_script, wandb_contents
from vitrel.train.run import train

pytestmark = pytest.mark.slow

TINY = [*TINY_VIT, *(a for a in FAST if a != "progress_bar=none"), "trainer.max_epochs=1"]
TINY += ["trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "trainer.limit_test_batches=2"]


def _metrics(job) -> dict:
    return json.loads((job / "metrics.json").read_text())


def test_seed_sweep_means_and_a_sweep_run_again_in_its_folder(tmp_path):
    sweep = tmp_path / "sweep"
    args = ["-m", "pos=rel2d_full,rope2d_mixed", "seed=0,1", *TINY, f"hydra.sweep.dir={sweep}", "logger=wandb"]
    r = run_script("train.py", args + ["trainer.log_every_n_steps=1"], cwd=tmp_path)
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
    assert "epoch 1/1" in r.stdout, "not a terminal: plain progress lines, no progress bar"
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
    r = run_script("train.py", args, cwd=tmp_path)
    assert r.returncode != 0 and "CheckpointError" in r.stderr, r.stderr[-4000:]
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
