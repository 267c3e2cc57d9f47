"""Which classes a model gets wrong: the test's per-class report (:mod:`vitrel.train.per_class`) that ``python
train.py`` writes into its run folder and ``python eval.py`` beside ``eval_metrics.json``, checked against a confusion
matrix counted by a loop over the same predictions; eval.py's ``gflops``; the data root eval's advice names for a run
without its ``hydra.yaml``."""

from __future__ import annotations

import csv
import json
import logging
import os
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from omegaconf import OmegaConf

from tests.train_helpers import FAST, TINY_VIT, compose, run_script_forked
from vitrel.train.attention_distance import CSV, read_distances
from vitrel.train.eval_data import run_settings, trained_data
from vitrel.train.evaluate import evaluate

RUN_FAST = [a for a in FAST if "per_class" not in a and "attention_distance" not in a]  # (FAST leaves them out)
EVAL = [*FAST[:1], *FAST[2:4], "data.eval_batch_size=500"]  # no workers, on the CPU, no progress bar, 4 batches
TEST_IMAGES = 2000  # the embedded Fashion-MNIST subset's test split


class SavePredictions(Callback):
    """Each rank's test predictions (the top-1 class of the logits ``test_step`` returns) and targets, in batch order,
    to ``<dir>/preds_rank<r>.pt`` as the test ends."""

    def __init__(self, dir: str) -> None:
        self.dir, self.preds, self.targets = Path(dir), [], []

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self.preds.append(outputs["logits"].argmax(-1).cpu())
        self.targets.append(outputs["target"].cpu())

    def on_test_end(self, trainer, pl_module) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        pairs = {"preds": torch.cat(self.preds), "targets": torch.cat(self.targets)}
        torch.save(pairs, self.dir / f"preds_rank{trainer.global_rank}.pt")


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _matrix(path: Path) -> tuple[list[str], list[list[int]]]:
    """``confusion.csv``: its column names (the predicted classes) and its counts, a row per true class."""
    with path.open(newline="") as f:
        header, *rows = list(csv.reader(f))
    return header[1:], [[int(v) for v in row[1:]] for row in rows]


@pytest.fixture(scope="module")
def tested_run(tmp_path_factory):
    """``python train.py`` on the tiny ViT, 2 steps, tested on the whole test split, its test predictions saved:
    ``(run folder, metrics.json, the saved predictions folder)``."""
    root = tmp_path_factory.mktemp("per_class")
    run, saved = root / "run", root / "preds"
    save = f"+callbacks.save_preds={{_target_: tests.train.test_per_class.SavePredictions, dir: '{saved}'}}"
    args = [*TINY_VIT, *RUN_FAST, "trainer.limit_train_batches=2", "trainer.max_epochs=1", "data.eval_batch_size=500"]
    r = run_script_forked("train.py", [*args, save, "logger=none", f"hydra.run.dir={run}"], cwd=root)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return run, json.loads((run / "metrics.json").read_text()), saved


def test_train_py_writes_a_per_class_report_equal_to_a_naive_count(tested_run):
    """The run folder's ``confusion.csv`` is the matrix a loop over the test's (target, prediction) pairs counts; its
    per-class recall and precision are ``per_class.csv``'s (torchmetrics'); the supports total the test split; the
    diagonal over the total is the run's ``test/acc1`` (micro-averaged top-1); the most confused pair comes first."""
    run, record, saved = tested_run
    pairs = torch.load(saved / "preds_rank0.pt")
    naive = [[0] * 10 for _ in range(10)]
    for t, p in zip(pairs["targets"].tolist(), pairs["preds"].tolist()):
        naive[t][p] += 1
    names, counts = _matrix(run / "confusion.csv")
    assert counts == naive
    assert names[:2] == ["T-shirt/top", "Trouser"]  # (the data module's class names)
    rows = _rows(run / "per_class.csv")
    assert [int(r["class"]) for r in rows] == list(range(10)) and [r["name"] for r in rows] == names
    support = [sum(row) for row in naive]
    predicted = [sum(naive[t][p] for t in range(10)) for p in range(10)]
    assert [int(r["support"]) for r in rows] == support and sum(support) == TEST_IMAGES == record["test_images"]
    assert [int(r["predicted"]) for r in rows] == predicted
    for i, r in enumerate(rows):
        assert int(r["correct"]) == naive[i][i]
        assert float(r["acc1"]) == pytest.approx(naive[i][i] / support[i], abs=1e-6)
        if predicted[i] == 0:  # (no image predicted as it: no precision)
            assert r["precision"] == ""
        else:
            assert float(r["precision"]) == pytest.approx(naive[i][i] / predicted[i], abs=1e-6)
    right = sum(naive[i][i] for i in range(10))
    assert right / TEST_IMAGES == pytest.approx(record["metrics"]["test/acc1"], rel=1e-6)
    top = max((naive[t][p], -t, -p) for t in range(10) for p in range(10) if t != p)
    first = _rows(run / "confused_pairs.csv")[0]
    assert (int(first["count"]), -int(first["true"]), -int(first["predicted"])) == top
    assert (run / "confusion.png").stat().st_size > 10_000


def test_eval_py_writes_the_same_report_and_gflops(tested_run, tmp_path):
    """``python eval.py ckpt_path=<run>/checkpoints/last.ckpt`` scores the weights the run tested: the same counts,
    beside its ``eval_metrics.json``, which has the run's ``gflops`` (the same size)."""
    run, record, _ = tested_run
    out = tmp_path / "eval"
    args = [f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}", *EVAL, f"hydra.run.dir={out}"]
    r = run_script_forked("eval.py", args, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    result = json.loads((out / "eval_metrics.json").read_text())
    assert result["num_images"] == TEST_IMAGES
    assert _matrix(out / "confusion.csv") == _matrix(run / "confusion.csv")
    assert sum(int(r["support"]) for r in _rows(out / "per_class.csv")) == TEST_IMAGES
    assert (out / "confusion.png").is_file()
    assert record["gflops"] > 0 and result["gflops"] == pytest.approx(record["gflops"], rel=1e-9)
    # the same weights, size and first 64 test images: the run's attention distances
    torch.testing.assert_close(read_distances(out / CSV), read_distances(run / CSV), rtol=1e-9, atol=1e-9)


def test_eval_at_another_size_counts_its_gflops_and_leaves_out_a_picture_of_too_many_classes(
    tested_run, tmp_path, caplog
):
    """At ``data.img_size=56`` (4x the 28's tokens) the gflops are those of that size; above ``max_png_classes`` no
    ``confusion.png``, one log line naming the CSV; ``per_class=null``: no report."""
    run, record, _ = tested_run
    ckpt = f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}"
    over = [ckpt, *EVAL, "trainer.limit_test_batches=1", "data.img_size=56", "per_class.max_png_classes=5"]
    with caplog.at_level(logging.INFO, logger="vitrel.train.per_class"):
        evaluate(compose(tmp_path / "big", over, config_name="eval"))
    result = json.loads((tmp_path / "big" / "eval_metrics.json").read_text())
    assert result["gflops"] > 4 * record["gflops"]
    # twice the grid's side in patches, the patch kept: (the 2-step model's near-uniform) heads look about twice as far
    ratio = read_distances(tmp_path / "big" / CSV).mean() / read_distances(run / CSV).mean()
    assert 1.8 < ratio < 2.2, ratio
    assert sum(int(r["support"]) for r in _rows(tmp_path / "big" / "per_class.csv")) == result["num_images"] == 500
    assert not (tmp_path / "big" / "confusion.png").exists()
    (line,) = [m for m in caplog.messages if "no confusion.png" in m]
    assert str(tmp_path / "big" / "per_class.csv") in line and "10 classes, above max_png_classes=5" in line

    nulls = ["per_class=null", "attention_distance=null"]
    evaluate(compose(tmp_path / "none", [ckpt, *EVAL, "trainer.limit_test_batches=1", *nulls], "eval"))
    assert (tmp_path / "none" / "eval_metrics.json").is_file()
    assert not {"per_class.csv", "confusion.csv", "confusion.png", CSV} & set(os.listdir(tmp_path / "none"))


def test_a_relative_root_of_a_run_without_its_hydra_yaml_is_evals_launch_folders_in_both_uses(tmp_path, monkeypatch):
    """A run record whose ``data.root`` is a literal relative path, without the ``hydra.yaml`` that says where the run
    was launched: the root eval takes from it and the root its advice names are one path, against eval's own launch
    folder (the advice named the bare relative path)."""
    monkeypatch.chdir(tmp_path)
    record = tmp_path / "run" / ".hydra" / "config.yaml"
    record.parent.mkdir(parents=True)
    run = OmegaConf.create({"data": {"name": "fashion_mnist", "root": "my_data", "verify": True}})
    OmegaConf.save(run, record)
    data_cfg = OmegaConf.create({"name": "fashion_mnist", "root": "/elsewhere"})
    taken, given, _ = run_settings(tmp_path / "run" / "last.ckpt", (record, run), {}, {}, data_cfg)
    expected = str(tmp_path / "my_data")
    assert {**taken, **given} == {"root": expected}
    assert f"data=fashion_mnist data.root={expected} " in trained_data((record, run))
