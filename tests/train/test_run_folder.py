"""``eval.py ckpt_path=<run folder>`` and ``predict.py ckpt_path=<run folder>`` were refused with one line naming
``checkpoints/last.ckpt``: they take the checkpoint the run's own test scored (the final weights, ``last.ckpt``; not
the best-epoch file) and say so in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
from omegaconf import OmegaConf
from PIL import Image

from tests.train_helpers import FAST, TINY_VIT, compose, run_script_forked
from vitrel.train.evaluate import evaluate
from vitrel.train.predict import run_predict

# two epochs of 2 steps; the "best" file kept by the lowest epoch (Lightning's monitor candidate): epoch 0's weights
RUN = [*TINY_VIT, *FAST, "trainer.max_epochs=2", "trainer.limit_train_batches=2", "trainer.limit_val_batches=2"]
RUN += ["trainer.limit_test_batches=2", "data.eval_batch_size=64", "logger=none"]
RUN += ["callbacks.model_checkpoint.monitor=epoch", "callbacks.model_checkpoint.mode=min"]
EVAL = [*FAST[:1], *FAST[2:4], "trainer.limit_test_batches=2", "data.eval_batch_size=64"]
SAID = "is a train.py run folder: taking checkpoints/last.ckpt, the run's final weights, which its own test scored"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """``(run folder, its metrics)`` of ``python train.py`` with a best-epoch file of epoch 0 beside ``last.ckpt``."""
    folder = tmp_path_factory.mktemp("run") / "run"
    r = run_script_forked("train.py", [*RUN, f"hydra.run.dir={folder}"], cwd=folder.parent)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return folder, json.loads((folder / "metrics.json").read_text())["metrics"]


def _eval(tmp_path, name: str, ckpt) -> tuple[dict, dict]:
    cfg = compose(tmp_path / name, [f"ckpt_path={ckpt}", *EVAL], config_name="eval")
    return evaluate(cfg), json.loads((tmp_path / name / "eval_metrics.json").read_text())


def test_eval_of_a_run_folder_scores_what_the_runs_test_scored(run, tmp_path, caplog):
    caplog.set_level("INFO", logger="vitrel.models.ckpt_files")
    folder, trained = run
    assert sorted(f.name for f in (folder / "checkpoints").glob("*.ckpt")) == ["best-epoch000.ckpt", "last.ckpt"]
    metrics, res = _eval(tmp_path, "folder", folder)
    assert res["ckpt_path"] == str(folder / "checkpoints" / "last.ckpt")
    assert metrics["test/loss"] == pytest.approx(trained["test/loss"], rel=1e-5)
    said = [r.getMessage() for r in caplog.records if "train.py run folder" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"{folder} {SAID}; best-epoch000.ckpt: the best validation epoch")
    best, _ = _eval(tmp_path, "best", folder / "checkpoints" / "best-epoch000.ckpt")  # (not what the run tested)
    assert best["test/loss"] != pytest.approx(trained["test/loss"], rel=1e-5)


def test_predict_on_a_run_folder_uses_its_last_ckpt(run, tmp_path, caplog):
    caplog.set_level("INFO", logger="vitrel.models.ckpt_files")
    folder, _ = run
    images = tmp_path / "images"
    images.mkdir()
    for i in range(3):
        Image.fromarray(np.random.default_rng(i).integers(0, 256, (28, 28), dtype=np.uint8)).save(images / f"{i}.png")
    rows = {}
    for name, ckpt in (("folder", folder), ("last", folder / "checkpoints" / "last.ckpt")):
        cfg = OmegaConf.create(dict(ckpt_path=str(ckpt), input=str(images), results_file=str(tmp_path / f"{name}.csv")))
        cfg.progress_bar = False
        summary = run_predict(cfg)
        rows[name] = (tmp_path / f"{name}.csv").read_text()
        if name == "folder":
            assert summary["model"] == str(folder / "checkpoints" / "last.ckpt")
    assert rows["folder"] == rows["last"]
    said = [r.getMessage() for r in caplog.records if "train.py run folder" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"{folder} {SAID}")


def test_a_run_folder_without_a_checkpoint_and_a_sweep_folder_say_what_to_give(tmp_path, video_sweep):
    """The run folder of a ``train.py`` that stopped before saving (a refused setting), given as ``ckpt_path``, was
    "has no model.safetensors (and no single .safetensors / .ckpt / .bin / .pth file)"; a ``-m`` sweep's folder the
    same. Each now says what it is and what to give; a job's folder of the sweep loads."""
    import vitrel
    from vitrel.models.ckpt_files import CheckpointError

    failed = tmp_path / "failed"
    r = run_script_forked("train.py", [*RUN, "model.num_heads=3", f"hydra.run.dir={failed}"], cwd=tmp_path)
    assert r.returncode == 1 and (failed / ".hydra").is_dir(), r.stdout[-2000:] + r.stderr[-4000:]
    said = rf"{failed} is a run folder \(\.hydra/\) holding no checkpoint .* \(its log: train\.log\)"
    with pytest.raises(CheckpointError, match=said):
        vitrel.load_model(failed)
    with pytest.raises(CheckpointError, match=said):
        evaluate(compose(tmp_path / "eval", [f"ckpt_path={failed}", *EVAL], config_name="eval"))
    sweep = video_sweep.parent
    assert (sweep / "multirun.yaml").is_file()  # (Hydra's, as `python train.py -m` wrote it)
    with pytest.raises(CheckpointError, match=rf"{sweep} is a -m sweep's folder: .* \(1 here, e\.g\. {video_sweep}\)"):
        vitrel.load_model(sweep)
    assert vitrel.load_model(video_sweep).vitrel_cfg["pos"] == {"name": "none"}


def test_train_py_resumes_from_a_run_folder(run, tmp_path):
    """``train.py ckpt_path=<run folder>`` ended in a traceback (``IsADirectoryError``) where ``eval.py`` and
    ``predict.py`` take the folder: it resumes from the run's ``last.ckpt`` (its ``checkpoints/`` folder the same),
    says so, and the same command run again in the new folder (a requeued job) continues that folder's own run. A
    folder that is no run's is one line."""
    import torch

    folder = run[0]
    args = [a for a in RUN if not a.startswith("trainer.max_epochs")] + ["trainer.max_epochs=3"]
    for i, given in enumerate((folder, folder / "checkpoints")):
        new = tmp_path / f"new{i}"
        r = run_script_forked("train.py", [*args, f"ckpt_path={given}", f"hydra.run.dir={new}"], cwd=tmp_path)
        out = r.stdout + r.stderr
        assert r.returncode == 0, out[-4000:]
        assert f"ckpt_path={given} is a train.py run folder: resuming from checkpoints/last.ckpt" in out
        assert "(3 epochs, 6 steps; " in out and "before the resume)" in out  # (4 steps of them in the run given)
    assert torch.load(new / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 6
    again = [*args[:-1], "trainer.max_epochs=4", f"ckpt_path={given}", f"hydra.run.dir={new}"]
    r = run_script_forked("train.py", again, cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and f"continuing from {new / 'checkpoints' / 'last.ckpt'}" in out, out[-4000:]
    assert "(4 epochs, 8 steps; " in out
    (tmp_path / "other").mkdir()
    r = run_script_forked("train.py", [*args, f"ckpt_path={tmp_path / 'other'}", f"hydra.run.dir={new}2"], cwd=tmp_path)
    assert r.returncode == 1
    said = f"train.py: CheckpointError: ckpt_path={tmp_path / 'other'} is a folder but not a train.py run folder"
    assert r.stderr.strip().splitlines()[-1].startswith(said), r.stderr[-3000:]
