"""``data.on_bad_sample=skip`` in ``train.py``'s test and ``eval.py``: an unreadable file of the scored split is left
out, each readable file scored once: the metrics are those of the split without the file, and the image counts the
closing lines and records give are the readable files'."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from tests.data.test_datamodules import make_imagenet_tree
from tests.train_helpers import FAST, TINY_VIT, compose
from vitrel.train.run import train


def test_eval_scores_the_readable_files_once_and_counts_them(tmp_path, capsys, caplog):
    """val/ of 6 JPEGs, one truncated: train.py's test and eval.py score the other 5 (top-1 and loss equal to eval.py
    on a copy of the tree without the file), say ``5 images, 1 unreadable files left out`` and name the file in one
    log line. (Replaced by the next file, as in training, the next image was scored twice: 6 images, other metrics.)"""
    from vitrel.train.evaluate import evaluate

    tree, clean = tmp_path / "tree", tmp_path / "clean"
    make_imagenet_tree(tree)
    shutil.copytree(tree, clean)
    (clean / "val" / "n0002" / "n0002_0.JPEG").unlink()
    bad = tree / "val" / "n0002" / "n0002_0.JPEG"
    bad.write_bytes(bad.read_bytes()[:200])
    data = ["data=imagenet", "data.img_size=32", "data.batch_size=4", "data.num_workers=0", "data.on_bad_sample=skip"]
    run = tmp_path / "run"
    short = ["trainer.max_epochs=1", "trainer.limit_train_batches=2", "logger=none"]
    with caplog.at_level(logging.WARNING):
        fit = train(compose(run, [*TINY_VIT, *FAST, *short, *data, f"data.root={tree}"]))
    record = json.loads((run / "metrics.json").read_text())
    assert (record["test_images"], record["test_split_images"], record["test_limited_by"]) == (5, 5, None)
    line = f"test: 1 unreadable image file(s) left out of 6 in {tree / 'val'} (data.on_bad_sample=skip; the others "
    assert caplog.text.count(line + "each scored once): n0002/n0002_0.JPEG") == 1, caplog.text
    ckpt = run / "checkpoints" / "last.ckpt"
    results = {}
    for root in (tree, clean):
        over = [f"ckpt_path={ckpt}", *data, f"data.root={root}", "trainer.accelerator=cpu", "progress_bar=none"]
        evaluate(compose(tmp_path / f"eval_{root.name}", over, config_name="eval"))
        results[root.name] = json.loads((tmp_path / f"eval_{root.name}" / "eval_metrics.json").read_text())
    said = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("last.ckpt on imagenet test "))
    assert "(5 images, 1 unreadable files left out)" in said, said
    got, want = results["tree"], results["clean"]
    assert (got["num_images"], got["split_images"], got["unreadable"]) == (5, 5, [str(bad)])
    assert (want["num_images"], want["split_images"], want["unreadable"]) == (5, 5, [])
    assert got["metrics"]["test/acc1"] == want["metrics"]["test/acc1"] == fit["test/acc1"]
    assert got["metrics"]["test/loss"] == pytest.approx(want["metrics"]["test/loss"], rel=1e-5)
