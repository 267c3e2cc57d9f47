"""``optimized_metric`` (what ``train()`` returns to a Hydra sweeper): checked against the module's metric names
before the run trains, and the names a run logs are among them."""

from __future__ import annotations

import json
import warnings

import pytest
from torch import nn

from tests.train_helpers import FAST, TINY_VIT, compose
from vitrel.config import ConfigError
from vitrel.train.module import ClassifierModule
from vitrel.train.run import train

RUN = [*TINY_VIT, *FAST, "logger=none", "trainer.max_steps=2", "trainer.limit_val_batches=1"]


@pytest.mark.parametrize(
    "extra, said",
    [
        (["optimized_metric=val/acc"], "optimized_metric=val/acc is not a metric this run logs: one of "),
        (["optimized_metric=test/acc1", "test=false"], "test/acc1 is not a metric this run logs (test=false"),
        # mixed targets log no training accuracy: the run trained, then failed on a KeyError (an audit's)
        (["optimized_metric=train/acc1", "module/mixup=default", "data.drop_last=true"], "train/acc1 is not a metric"),
    ],
)
def test_a_metric_the_run_does_not_log_is_refused_before_it_trains(tmp_path, extra, said):
    with pytest.raises(ConfigError, match=r"val/acc1, val/acc5") as e:
        train(compose(tmp_path, [*RUN, *extra]))
    assert said in str(e.value)
    assert not (tmp_path / "checkpoints").exists()  # nothing trained


def test_the_metrics_a_run_logs_are_among_the_names_and_the_named_one_is_returned(tmp_path):
    got = train(compose(tmp_path, [*RUN, "trainer.limit_test_batches=1", "optimized_metric=test/acc1"]))
    logged = json.loads((tmp_path / "metrics.json").read_text())["metrics"]
    assert got == logged["test/acc1"]
    names = ClassifierModule(nn.Linear(2, 10), num_classes=10).metric_names()
    assert set(logged) - {"epoch", "step"} <= set(names), sorted(set(logged) - set(names))


@pytest.mark.parametrize(
    "extra, said",
    [
        (["hparams_search=fmnist_optuna", "optimized_metric=val/loss"], "direction maximize: the search would seek"),
        (["hydra/sweeper=optuna", "optimized_metric=val/acc1"], "direction minimize: the search would seek"),
    ],
)
def test_a_sweeper_direction_against_the_metric_is_refused_before_it_trains(tmp_path, extra, said):
    """Optuna's sweeper maximising a loss, or minimising an accuracy (its default direction is ``minimize``): each
    trial returned its metric and the study sought the worst runs. A job of such a sweep stops before it trains."""
    with pytest.raises(ConfigError, match=r"set hydra\.sweeper\.direction=(max|min)imize") as e:
        train(compose(tmp_path, [*RUN, *extra], multirun=True))
    assert said in str(e.value)
    assert not (tmp_path / "checkpoints").exists()  # nothing trained


def test_a_search_on_the_test_split_is_warned_of(tmp_path):
    """``optimized_metric=test/acc1`` under Optuna's sweeper chose its trials by the test split's score without a word:
    the best trial's test score is then no fair estimate. A warning names the val/ metric to search on; Hydra's basic
    sweeper reads no value (no warning)."""
    over = [*RUN, "hydra/sweeper=optuna", "hydra.sweeper.direction=maximize", "optimized_metric=test/acc1"]
    with pytest.warns(UserWarning, match=r"optimized_metric=test/acc1: the sweeper chooses .* search on a val/ metric"):
        train(compose(tmp_path / "optuna", over, multirun=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(compose(tmp_path / "basic", [*RUN, "optimized_metric=test/acc1"], multirun=True))
    assert not [w for w in caught if "the sweeper chooses" in str(w.message)]


VAL = [*RUN, "trainer.limit_test_batches=1", "optimized_metric=val/acc1"]  # (trainer.max_steps=2)


@pytest.mark.parametrize(
    "extra, said",
    [
        ([], "trainer.max_steps=2 ends it, it would first validate after optimizer step 563 (an epoch: 563 training"),
        (["trainer.limit_train_batches=2", "trainer.check_val_every_n_epoch=2"], "validate after optimizer step 4 "),
        (
            [
                "trainer.max_steps=-1",
                "trainer.max_epochs=1",
                "trainer.limit_train_batches=2",
                "trainer.check_val_every_n_epoch=2",
            ],
            "at most 1",
        ),
        (["trainer.limit_val_batches=0"], "this run validates never"),
    ],
)
def test_a_validation_metric_of_a_fit_that_ends_before_it_validates_is_refused_before_it_trains(tmp_path, extra, said):
    """``optimized_metric=val/acc1`` with a ``trainer.max_steps`` within the first epoch: the job trained and tested,
    then failed with a KeyError naming neither the cause nor the fix. Refused as the fit starts, with both."""
    with pytest.raises(ConfigError, match="optimized_metric=val/acc1 is a validation metric") as e:
        train(compose(tmp_path, [*VAL, *extra]))
    assert said in str(e.value), str(e.value)
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.json").exists()  # nothing trained
    train(compose(tmp_path / "as_is", [*VAL[:-1], *extra]))  # (Lightning's own loop: it validates never)
    assert json.loads((tmp_path / "as_is" / "metrics.json").read_text())["val_runs"] == 0


@pytest.mark.parametrize(
    "extra",
    [
        ["trainer.val_check_interval=2"],  # (batches, within the epoch)
        ["trainer.limit_train_batches=2"],  # (the epoch's end at step 2)
        ["trainer.val_check_interval=2", "trainer.check_val_every_n_epoch=null"],  # (batches counted over epochs)
        ["trainer.limit_train_batches=3", "trainer.accumulate_grad_batches=2"],  # (an epoch's partial last window)
        ["trainer.max_steps=4", "trainer.limit_train_batches=2", "trainer.check_val_every_n_epoch=2"],
    ],
)
def test_a_fit_that_validates_before_its_end_is_not_refused(tmp_path, extra):
    got = train(compose(tmp_path, [*VAL, *extra]))
    ran = json.loads((tmp_path / "metrics.json").read_text())
    assert ran["val_runs"] >= 1 and got == ran["metrics"]["val/acc1"], ran


def test_a_run_that_ended_before_it_validated_says_so_after_it(tmp_path):
    """A plan not known as the fit starts (a time-based ``trainer.val_check_interval``): the error after the run names
    the cause and the fix, not only the missing metric."""
    with pytest.raises(ConfigError, match=r"the run ended before its first validation \(val_runs=0 in metrics\.json"):
        train(compose(tmp_path, [*VAL, "trainer.val_check_interval='00:01:00:00'"]))
    assert json.loads((tmp_path / "metrics.json").read_text())["val_runs"] == 0
