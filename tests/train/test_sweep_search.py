"""A search sweeper's sweep (``hparams_search=fmnist_optuna``) as a researcher may write it: a ``seed=0,1,2`` list,
which Optuna's sweeper makes a search dimension (its best trial the luckiest seed), is refused before any trial; a
best trial chosen on the test split (``optimized_metric`` a ``test/`` one, or ``val/`` with ``data.val_fraction=0``)
is said below the summary's best-trial line and as the sweep starts. Hydra's basic sweeper picks nothing: its seed
lists are the summary's means."""

from __future__ import annotations

import atexit
import logging

import pytest
from omegaconf import OmegaConf

from vitrel.train.hydra_callbacks import SweepSummary
from vitrel.train.sweepers import BASIC_SWEEPER, optuna_best

OPTUNA = "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"
SPACE = {"module.optimizer.lr": "tag(log, interval(1.0e-4, 1.0e-2))"}  # conf/hparams_search/fmnist_optuna.yaml's


def _config(tmp_path, task, sweeper=OPTUNA, params=SPACE, metric="val/acc1", val_fraction=0.1, data=None):
    hydra = {"sweeper": {"_target_": sweeper, "params": params, "direction": "maximize"}}
    hydra.update(overrides={"task": list(task)}, sweep={"dir": str(tmp_path / "sweep"), "subdir": "${hydra.job.num}"})
    data = {**(data or {}), "val_fraction": val_fraction}
    return OmegaConf.create({"hydra": hydra, "optimized_metric": metric, "data": data})


def _start(config) -> SweepSummary:
    cb = SweepSummary()
    try:
        cb.on_multirun_start(config)
    finally:
        atexit.unregister(cb._at_exit)
    return cb


@pytest.mark.parametrize(
    "task, params",
    [
        (["hparams_search=fmnist_optuna", "seed=0,1,2"], SPACE),
        (["hparams_search=fmnist_optuna", "seed=range(3)"], SPACE),
        (["hparams_search=fmnist_optuna"], {**SPACE, "seed": "choice(0, 1)"}),  # (in the search file)
    ],
)
def test_a_search_over_seeds_is_refused_before_any_trial(tmp_path, task, params):
    config = _config(tmp_path, task, params=params)
    with pytest.raises(SystemExit, match=r"ConfigError: seed=.*Optuna sweeper would search the seed"):
        _start(config)
    assert not (tmp_path / "sweep").exists()  # nothing of a sweep begun


@pytest.mark.parametrize(
    "task, sweeper",
    [(["hparams_search=fmnist_optuna", "seed=3"], OPTUNA), (["pos=none,ape", "seed=0,1"], BASIC_SWEEPER)],
)
def test_one_seed_searched_or_a_seed_list_of_the_basic_sweeper_is_taken(tmp_path, task, sweeper):
    _start(_config(tmp_path, task, sweeper=sweeper))
    assert (tmp_path / "sweep" / ".sweep_id").exists()


def _best_line(tmp_path, **kw) -> str | None:
    sweep = tmp_path / "sweep"
    sweep.mkdir(exist_ok=True)
    (sweep / "optimization_results.yaml").write_text(
        "name: optuna\nbest_params:\n  module.optimizer.lr: 0.003\nbest_value: 0.25\n"
    )
    rows = [{"job": str(i), "overrides": f"module.optimizer.lr={lr}"} for i, lr in enumerate((0.001, 0.003))]
    return optuna_best(_config(tmp_path, ["hparams_search=fmnist_optuna"], **kw), sweep, rows, [])


def test_a_best_trial_chosen_on_the_test_split_says_so(tmp_path, caplog):
    line = _best_line(tmp_path, val_fraction=0.0)
    assert line.startswith("Optuna's best trial (maximize val/acc1): job 1, 0.2500, module.optimizer.lr=0.003"), line
    said = "chosen on the test split (optimized_metric=val/acc1 with data.val_fraction=0, which validates on the test"
    assert f"{said} split)" in line, line
    assert "job 1's test/* overestimate new data" in line, line
    assert "chosen on the test split (optimized_metric=test/acc1 is a test split score)" in _best_line(
        tmp_path, metric="test/acc1"
    )
    with caplog.at_level(logging.WARNING, logger="vitrel.train.sweepers"):
        _start(_config(tmp_path, ["hparams_search=fmnist_optuna", "data.val_fraction=0"], val_fraction=0.0))
    said = [r.name for r in caplog.records if "the best trial is chosen on the test split" in r.getMessage()]
    assert said == ["vitrel.train.sweepers"], caplog.text  # (the logger a filter on its name reaches)


def test_a_best_trial_chosen_on_a_held_out_split_is_the_plain_line(tmp_path, caplog):
    line = _best_line(tmp_path, val_fraction=0.1)
    assert line == "Optuna's best trial (maximize val/acc1): job 1, 0.2500, module.optimizer.lr=0.003", line
    with caplog.at_level(logging.WARNING, logger="vitrel.train.sweepers"):  # (the basic sweeper picks nothing)
        _start(_config(tmp_path, ["pos=none,ape", "data.val_fraction=0"], sweeper=BASIC_SWEEPER, val_fraction=0.0))
    assert "test split" not in caplog.text, caplog.text


def test_a_null_val_fraction_is_the_data_sets_default_for_the_best_trial(tmp_path):
    """``data.val_fraction=null``: Fashion-MNIST's default holds out 10 % of train (a plain line); ImageNet's is 0,
    the test split (said). A null was read as 0 for both."""
    fmnist = {"_target_": "vitrel.data.FashionMNISTDataModule"}
    line = _best_line(tmp_path, val_fraction=None, data=fmnist)
    assert line == "Optuna's best trial (maximize val/acc1): job 1, 0.2500, module.optimizer.lr=0.003", line
    imagenet = {"_target_": "vitrel.data.ImageNetDataModule"}
    assert "chosen on the test split" in _best_line(tmp_path, val_fraction=None, data=imagenet)


def test_a_direction_against_the_metric_stops_the_sweep_in_one_line(tmp_path):
    """``train.py -m hparams_search=fmnist_optuna optimized_metric=val/loss`` (the search maximises): each job refused
    it before training, but Hydra printed "Error executing job" and a traceback for it (an audit's: three times). The
    sweep now stops as it starts, in one line, before any job."""
    from tests.train_helpers import run_script_forked

    args = ["-m", "hparams_search=fmnist_optuna", "optimized_metric=val/loss", "hydra.sweeper.n_trials=1"]
    r = run_script_forked("train.py", [*args, f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "Traceback" not in out and "Error executing job" not in out, out[-3000:]
    said = "train.py: ConfigError: optimized_metric=val/loss with the sweeper's direction maximize"
    assert said in r.stderr and "hydra.sweeper.direction=minimize" in r.stderr, r.stderr[-2000:]
    assert not list((tmp_path / "sweep").glob("0")), "no job ran"


def test_the_slurm_launcher_without_a_number_of_devices_stops_the_sweep_in_one_line(tmp_path):
    """``train.py -m hydra/launcher=slurm trainer=ddp`` (``devices: auto``): OmegaConf's interpolation error about
    ``hydra.launcher.gpus_per_node`` (an audit's), which did not say what to give. Now one line naming
    ``trainer.devices``, before any job is submitted."""
    from tests.train_helpers import run_script_forked

    args = ["-m", "hydra/launcher=slurm", "trainer=ddp", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    r = run_script_forked("train.py", args, cwd=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stdout + r.stderr, (r.stdout + r.stderr)[-3000:]
    assert "train.py: ConfigError: hydra/launcher=slurm sizes every job from trainer.devices" in r.stderr
    assert "which is 'auto': give the sweep a number, e.g. trainer.devices=8" in r.stderr
