"""One's own images as uint8 arrays: ``vitrel.data.ArrayDataModule`` refuses labels that are not integer class
indices, warns of labels 1..C, and ``data=arrays data.path=<.npz>`` trains and is scored by ``eval.py``."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from tests.train_helpers import FAST, TINY_VIT, compose, run_script_forked
from vitrel.train.evaluate import evaluate

SHORT = ["trainer.max_epochs=2", "logger=none"]


def test_array_labels_are_integer_class_indices():
    """``ArrayDataModule``: float labels were truncated (1.5 -> 1) and digit strings read as numbers, silently;
    labels 1..C gave C + 1 classes, one without images, silently."""
    from vitrel.data import ArrayDataModule

    x = np.zeros((6, 8, 8), np.uint8)
    for labels in (np.array([0.0, 1.5, 2, 0, 1, 2]), np.array(list("120120"))):
        with pytest.raises(ValueError, match="labels must be integer class indices"):
            ArrayDataModule(train=(x, labels), test=(x, labels))
    with pytest.warns(UserWarning, match=r"labels are 1..3: num_classes=4 .*labels 1..C\? subtract 1"):
        ArrayDataModule(train=(x, np.arange(6) % 3 + 1), test=(x, np.arange(6) % 3 + 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ArrayDataModule(train=(x, np.arange(6) % 3), test=(x, np.arange(6) % 3)).num_classes == 3


def test_arrays_of_ones_own_train_and_eval_by_name(tmp_path, caplog):
    """``data=arrays data.path=<.npz>`` (``conf/data/arrays.yaml``) trains; ``eval.py ... data=arrays`` scores the
    checkpoint on the run's file without naming it again (``data.path`` is taken from the run, as ``data.root``), and
    the run's ``data.class_names`` with it: eval warned that every class differed from the checkpoint's ('0' here
    but 'ant' there) and wrote ``per_class.csv`` with the indices for names."""
    rng = np.random.default_rng(0)
    y = np.arange(60) % 3
    x = np.clip(y[:, None, None] * 100 + 20 * rng.standard_normal((60, 16, 16)), 0, 255).astype(np.uint8)
    np.savez(tmp_path / "my_set.npz", x_train=x[:48], y_train=y[:48], x_test=x[48:], y_test=y[48:])
    data = ["data=arrays", f"data.path={tmp_path / 'my_set.npz'}", "data.class_names=[ant,bee,cat]", *FAST[:2]]
    args = [*TINY_VIT, *FAST[2:4], *SHORT, *data, f"hydra.run.dir={tmp_path / 'run'}"]
    r = run_script_forked("train.py", args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    saved = json.loads((tmp_path / "run" / "metrics.json").read_text())["metrics"]
    assert saved["test/acc1"] > 0.5, saved  # (chance: 1/3)
    metrics = evaluate(compose(tmp_path / "eval", [f"ckpt_path={tmp_path / 'run'}", "data=arrays"], "eval"))
    assert metrics["test/acc1"] == pytest.approx(saved["test/acc1"])
    assert "class_names=[ant,bee,cat]" in caplog.text and "scored against others" not in caplog.text
    rows = (tmp_path / "eval" / "per_class.csv").read_text().splitlines()
    assert [r.split(",")[1] for r in rows[1:]] == ["ant", "bee", "cat"]
