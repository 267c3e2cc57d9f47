"""A hyperparameter search as a researcher runs it with Hydra's Optuna sweeper (``hparams_search=fmnist_optuna``, as
lightning-hydra-template's ``hparams_search/mnist_optuna.yaml``): the value each trial returns is its job's
``optimized_metric``, Optuna's best is the best job's (named below the summary table); the study run again in its
folder resumes its own trials, and another study there (other drawn values in the same job folders) is refused, not
reported with the old trials' scores."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from tests.train_helpers import FAST, TINY_VIT, run_script_forked

TINY = [*TINY_VIT, *FAST, "trainer.max_epochs=1", "logger=none"]
TINY += ["trainer.limit_train_batches=2", "trainer.limit_val_batches=2", "trainer.limit_test_batches=1"]


def _study(sweep, seed: int, tmp_path):
    args = ["hparams_search=fmnist_optuna", *TINY, f"hydra.sweep.dir={sweep}", "hydra.sweeper.n_trials=2"]
    return run_script_forked("train.py", [*args, f"hydra.sweeper.sampler.seed={seed}"], cwd=tmp_path)


def _drawn(job: dict) -> dict[str, float]:
    return {o.split("=")[0]: float(o.split("=")[1]) for o in job["overrides"] if o.startswith("module.optimizer.")}


@pytest.mark.slow
def test_an_optuna_study_its_best_trial_and_another_study_in_its_folder(tmp_path):
    sweep = tmp_path / "sweep"
    r = _study(sweep, 1, tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    jobs = [json.loads((sweep / str(j) / "metrics.json").read_text()) for j in range(2)]
    drawn = [_drawn(j) for j in jobs]
    for d in drawn:  # conf/hparams_search/fmnist_optuna.yaml's search space
        assert 1e-4 <= d["module.optimizer.lr"] <= 1e-2 and 0 <= d["module.optimizer.weight_decay"] <= 0.1, d
    assert drawn[0] != drawn[1]
    result = OmegaConf.to_container(OmegaConf.load(sweep / "optimization_results.yaml"))
    acc = [j["metrics"]["val/acc1"] for j in jobs]  # each trial's value: its last validation (optimized_metric)
    best = max(range(2), key=lambda i: (acc[i], -i))  # direction maximize (a tie: the first trial)
    assert result["best_value"] == pytest.approx(acc[best]) and result["best_params"] == drawn[best], (result, acc)
    said = f"Optuna's best trial (maximize val/acc1): job {best}, {acc[best]:.4f}, module.optimizer.lr="
    out = r.stdout[r.stdout.index("Sweep summary (2 jobs") :]
    assert said in out and said in (sweep / "summary.md").read_text(), out

    # another study (another sampler seed) in the folder: its trial 0 lands in trial 0's folder with other values
    r = _study(sweep, 2, tmp_path)
    assert r.returncode != 0 and "ConfigError" in r.stderr, r.stdout[-2000:] + r.stderr[-4000:]
    assert f"module.optimizer.lr: checkpoint module.optimizer.lr={drawn[0]['module.optimizer.lr']}" in r.stderr
    kept = json.loads((sweep / "0" / "metrics.previous.json").read_text())
    assert kept["metrics"] == jobs[0]["metrics"]

    # the first study again (its seed): its trials draw the same values and resume their finished runs
    (sweep / "optimization_results.yaml").unlink()
    r = _study(sweep, 1, tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    again = [json.loads((sweep / str(j) / "metrics.json").read_text()) for j in range(2)]
    assert [a["resumed_finished"] for a in again] == [True, True] and [_drawn(a) for a in again] == drawn
    assert OmegaConf.to_container(OmegaConf.load(sweep / "optimization_results.yaml")) == result
