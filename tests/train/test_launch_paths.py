"""Paths given on the command line name files relative to the folder a script is launched from (Hydra's
``to_absolute_path``), under ``hydra.job.chdir=true`` (the job runs in its output folder) as under ``false``, in single
runs and ``-m`` sweeps: train.py's ``data.path`` and ``ckpt_path``, eval.py's and predict.py's."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.train_helpers import FAST, TINY_VIT, run_script_forked

SHORT = ["trainer.max_epochs=1", "trainer.limit_train_batches=3", "trainer.limit_val_batches=1"]
SHORT += ["trainer.limit_test_batches=1", "logger=none"]
DATA = ["data=arrays", "data.path=fm.npz", *FAST[:2]]  # (relative: the launch folder's file)
CHDIR = "hydra.job.chdir=true"


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> Path:
    """A launch folder with ``fm.npz`` (a slice of the embedded Fashion-MNIST subset), eight of its test images as
    PNG files in ``images/``, and a finished run ``runs/a`` trained on it (launched there, without chdir)."""
    from vitrel.data.fashion_mnist import SUBSET_PATH

    root = tmp_path_factory.mktemp("launch")
    with np.load(SUBSET_PATH) as z:
        np.savez(root / "fm.npz", x_train=z["x_train"][:256], y_train=z["y_train"][:256], x_test=z["x_test"][:64],
                 y_test=z["y_test"][:64])  # fmt: skip
        (root / "images").mkdir()
        for i, a in enumerate(z["x_test"][:8]):
            Image.fromarray(a).save(root / "images" / f"{i}.png")
    r = run_script_forked("train.py", [*TINY_VIT, *FAST[2:], *SHORT, *DATA, "hydra.run.dir=runs/a"], cwd=root)
    assert r.returncode == 0, r.stderr[-3000:]
    return root


def test_train_py_relative_paths_under_chdir_single_run_and_sweep(launch):
    """``hydra.job.chdir=true data.path=fm.npz ckpt_path=runs/a/checkpoints/last.ckpt``: both were looked up in the
    run folder (``FileNotFoundError`` naming ``<run folder>/fm.npz``). Now the launch folder's, as without chdir, in
    a single run (resuming ``runs/a``'s checkpoint for one more epoch) and in a job of ``-m``, whose sweep summary
    (``hydra.sweep.dir=sweep``, relative as the default ``outputs/...``) was looked for in the job's folder: none."""
    resume = ["ckpt_path=runs/a/checkpoints/last.ckpt", "trainer.max_epochs=2"]
    args = [*TINY_VIT, *FAST[2:], *SHORT, *DATA, CHDIR]
    r = run_script_forked("train.py", [*args, *resume, "hydra.run.dir=runs/b"], cwd=launch)
    assert r.returncode == 0, r.stderr[-3000:]
    done = json.loads((launch / "runs" / "b" / "metrics.json").read_text())
    assert done["epochs"] == 2 and done["global_step"] == 6, done  # (3 steps of its own after runs/a's 3)
    r = run_script_forked("train.py", ["-m", *args, "seed=1", "hydra.sweep.dir=sweep"], cwd=launch)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((launch / "sweep" / "0" / "metrics.json").read_text())["status"] == "finished"
    rows = list(csv.DictReader((launch / "sweep" / "summary.csv").open()))  # (the sweep folder's, not sweep/0/sweep)
    assert [(r["job"], r["status"]) for r in rows] == [("0", "finished")], rows


def test_eval_py_relative_paths_under_chdir(launch, tmp_path):
    """``eval.py hydra.job.chdir=true ckpt_path=runs/a data.path=fm.npz``: ``ckpt_path=runs/a: no such file or folder``
    (looked up in eval's own run folder). Now the launch folder's run, scored on the launch folder's file."""
    args = ["ckpt_path=runs/a", *DATA, *FAST[2:4], CHDIR, f"hydra.run.dir={tmp_path / 'e'}"]
    r = run_script_forked("eval.py", args, cwd=launch)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "e" / "eval_metrics.json").read_text())
    assert res["num_images"] == 64 and Path(res["ckpt_path"]) == launch / "runs" / "a" / "checkpoints" / "last.ckpt"


def test_predict_py_relative_paths_under_chdir(launch, tmp_path):
    """``predict.py hydra.job.chdir=true ckpt_path=runs/a input=images results_file=preds.csv``: the checkpoint was
    looked up in predict's run folder; now all three are the launch folder's, as without chdir."""
    args = ["ckpt_path=runs/a", "input=images", "results_file=preds.csv", CHDIR, f"hydra.run.dir={tmp_path / 'p'}"]
    r = run_script_forked("predict.py", args, cwd=launch)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(launch / "preds.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert sorted(r["filename"] for r in rows) == [f"{i}.png" for i in range(8)]
    assert not (tmp_path / "p" / "preds.csv").exists()


def test_only_relative_paths_change(tmp_path, monkeypatch):
    """Relative values of the listed keys become the launch folder's (here, outside Hydra: the current folder); absolute
    ones, interpolations resolving to one, ``~``, ``last``, URLs, null and other keys stay as given."""
    from omegaconf import OmegaConf

    from vitrel.train.launch_paths import TRAIN_PATHS, launch_paths

    monkeypatch.chdir(tmp_path)
    given = {
        "ckpt_path": "last",
        "paths": {"root_dir": ".", "data_dir": "${paths.root_dir}/data", "log_dir": "/abs/outputs", "home": "~/x"},
        "data": {"root": "${paths.data_dir}", "path": None, "train_dir": "train"},
        "model": {"path": "hf-hub:timm/vit_tiny", "init_file": "w/model.safetensors"},
        "callbacks": {"last": {"dirpath": "${paths.log_dir}/ckpt"}, "mine": {"dirpath": "ckpts"}, "off": None},
        "logger": {"csv": {"save_dir": "s3://bucket/logs"}},
    }
    out = OmegaConf.create(given)  # (the job's config, changed in place)
    launch_paths(out, TRAIN_PATHS)
    assert out.paths.root_dir == str(tmp_path) and out.paths.data_dir == f"{tmp_path}/data"
    assert out.data.root == f"{tmp_path}/data" and out.data.train_dir == "train" and out.data.path is None
    assert out.model.init_file == str(tmp_path / "w" / "model.safetensors")
    assert out.callbacks.mine.dirpath == str(tmp_path / "ckpts")
    kept = OmegaConf.to_container(out, resolve=False)
    assert kept["data"]["root"] == "${paths.data_dir}" and kept["paths"]["home"] == "~/x"
    assert kept["callbacks"]["last"]["dirpath"] == "${paths.log_dir}/ckpt"
    assert (out.ckpt_path, out.model.path) == ("last", "hf-hub:timm/vit_tiny")
    assert out.logger.csv.save_dir == "s3://bucket/logs"


def test_eval_py_takes_the_runs_relative_data_path_from_the_runs_launch_folder(launch, tmp_path):
    """``eval.py ckpt_path=<launch>/runs/a data=arrays`` launched from another folder that has an ``fm.npz`` of its
    own (32 test images; the run's has 64): the run's ``data.path=fm.npz`` (as its ``.hydra/config.yaml`` records it)
    was taken relative to eval's launch folder, so eval scored that other file's 32 images as the run's data. Now the
    run's launch folder's (``hydra.runtime.cwd`` of its ``hydra.yaml``): its 64. ``data.path`` given to eval stays
    eval's launch folder's."""
    other = tmp_path / "other"
    other.mkdir()
    with np.load(launch / "fm.npz") as z:
        np.savez(other / "fm.npz", **{k: z[k][:32] for k in z.files})
    args = [f"ckpt_path={launch / 'runs' / 'a'}", *DATA[:1], *FAST[:4]]
    for name, given, images in (("run", [], 64), ("given", ["data.path=fm.npz"], 32)):
        r = run_script_forked("eval.py", [*args, *given, f"hydra.run.dir={tmp_path / name}"], cwd=other)
        assert r.returncode == 0, r.stderr[-3000:]
        res = json.loads((tmp_path / name / "eval_metrics.json").read_text())
        assert res["num_images"] == images, (name, res)
        assert res["data_from_run"].get("path") == (str(launch / "fm.npz") if not given else None), res
