"""Lightning's own callbacks and trainer features added to a vitrel run (``+callbacks.<name>=...``,
``trainer.<arg>=...``): each one's figures right, or a one-line refusal."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from tests.train_helpers import FAST, TINY_VIT, compose
from vitrel.train.run import train

QUICK = [*TINY_VIT, *FAST, "logger=none", "trainer.limit_val_batches=1", "trainer.limit_test_batches=1"]


class SlowSteps(Callback):
    """Each training batch takes ``seconds`` longer (a wall clock for ``trainer.max_time`` to run out on)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, *args) -> None:
        time.sleep(self.seconds)


@pytest.mark.parametrize("stop", ["trainer.max_time=00:00:00:01", "trainer.max_steps=3"])
def test_a_stop_mid_epoch_resumes_the_rest_of_the_epoch(tmp_path, stop):
    """``trainer.max_time`` or ``trainer.max_steps`` stops the fit mid-epoch; ``last.ckpt`` is that step's, so the
    resumed run trains the epoch's remaining batches: 2 epochs of 6 batches end at step 12 after 2 validations, as
    without the stop (Lightning runs the epoch-end hooks at the stop, and a ``last.ckpt`` written there resumed at
    the next epoch: step 9 of 12; with max_steps epoch 0 was never validated). The validation Lightning runs at a
    ``max_time`` stop is logged but writes no best file: the resumed run's state is of before it, and its file stayed
    beside the resumed run's best."""
    run = [*QUICK, "trainer.max_epochs=2", "trainer.limit_train_batches=6"]
    train(compose(tmp_path, [*run, stop]), callbacks=[SlowSteps(0.4 if "max_time" in stop else 0.0)])
    stopped = json.loads((tmp_path / "metrics.json").read_text())["global_step"]
    assert 0 < stopped < 6, stopped  # (mid-epoch 0)
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == stopped
    train(compose(tmp_path, run))
    resumed = json.loads((tmp_path / "metrics.json").read_text())
    assert (resumed["global_step"], resumed["val_runs"]) == (12, 2)
    train(compose(tmp_path / "whole", run))  # the same run, not stopped: the same weights
    whole = torch.load(tmp_path / "whole" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    ended = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert max((ended["state_dict"][k] - v).abs().max().item() for k, v in whole["state_dict"].items()) == 0.0
    best = sorted(p.name for p in (tmp_path / "checkpoints").glob("best-*.ckpt"))
    assert best == [Path(resumed["best_ckpt"]).name], best  # (save_top_k=1: no file of the stop's validation left)


def test_lightning_arguments_given_as_mappings_and_lists_reach_lightning_as_python_ones(tmp_path):
    """``trainer.max_time={minutes: 5}`` and ``Timer(duration={...})`` (Lightning: ``timedelta(**dict)``) and
    ``StochasticWeightAveraging(swa_lrs=[...])`` are built from plain dicts and lists: OmegaConf's containers failed
    in Lightning's checks ("Missing key total_seconds"; "swa_lrs should a positive float, or a list of positive
    floats" for a list of one)."""
    from datetime import timedelta

    from hydra.utils import instantiate
    from lightning.pytorch.callbacks import StochasticWeightAveraging, Timer

    from vitrel.train.utils import instantiate_callbacks

    swa = "+callbacks.swa={_target_: lightning.pytorch.callbacks.StochasticWeightAveraging, swa_lrs: [0.001]}"
    timer = "+callbacks.timer={_target_: lightning.pytorch.callbacks.Timer, duration: {minutes: 5}}"
    cfg = compose(tmp_path, [*QUICK, swa, timer, "trainer.max_time={minutes: 5}"])
    built = {type(cb): cb for cb in instantiate_callbacks(cfg.callbacks)}
    assert built[StochasticWeightAveraging]._swa_lrs == [0.001]
    assert built[Timer]._duration == 300.0
    trainer = instantiate(cfg.trainer, logger=False, enable_progress_bar=False)
    timers = [cb for cb in trainer.callbacks if isinstance(cb, Timer)]
    assert timers[0]._duration == timedelta(minutes=5).total_seconds()


class WeightsTested(Callback):
    """The network's weights as the test phase starts (``self.state``)."""

    def on_test_start(self, trainer, pl_module) -> None:
        self.state = {k: v.detach().clone() for k, v in pl_module.model.state_dict().items()}


def test_swa_last_checkpoint_holds_the_averaged_weights_the_test_scored(tmp_path):
    """``StochasticWeightAveraging`` puts its average into the network when the fit ends, after the last epoch's
    ``last.ckpt``: that file (which ``eval.py``, ``predict.py`` and ``vitrel.load_model`` take) held the last step's
    weights, up to 0.006 off the averaged ones the run's test scored; now it holds those."""
    swa = "+callbacks.swa={_target_: lightning.pytorch.callbacks.StochasticWeightAveraging, swa_lrs: 1e-3,"
    swa += " swa_epoch_start: 1}"
    tested = WeightsTested()
    train(compose(tmp_path, [*QUICK, "trainer.max_epochs=2", "trainer.limit_train_batches=2", swa]), [tested])
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    saved = {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}
    assert saved.keys() == tested.state.keys()
    assert max((saved[k] - v).abs().max().item() for k, v in tested.state.items()) == 0.0


RICH = "+callbacks.bar={_target_: lightning.pytorch.callbacks.RichProgressBar, leave: true}"


def test_a_progress_bar_callback_of_ones_own_is_the_display(tmp_path):
    """``+callbacks.bar={_target_: ...RichProgressBar, leave: true}`` (Lightning's way to set a bar up) is the run's
    display: it stopped the run before training with Lightning's "configured with `enable_progress_bar=False` but
    found `RichProgressBar`" (``progress_bar=auto`` off a terminal: plain lines)."""
    from lightning.pytorch.callbacks import ProgressBar, RichProgressBar

    seen = []

    class Bars(Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            seen.extend(cb for cb in trainer.callbacks if isinstance(cb, ProgressBar))

    run = [a for a in QUICK if a != "progress_bar=none"]
    train(compose(tmp_path, [*run, "trainer.max_epochs=1", "trainer.limit_train_batches=1", RICH]), [Bars()])
    assert len(seen) == 1 and isinstance(seen[0], RichProgressBar) and seen[0]._leave
    assert json.loads((tmp_path / "metrics.json").read_text())["status"] == "finished"


def test_a_progress_bar_callback_with_another_progress_bar_setting_is_refused(tmp_path):
    """``progress_bar=none`` (or ``lines``, ``tqdm``, ``rich``) with a bar among the callbacks asks for two displays:
    one line naming both, before anything is built."""
    from vitrel.config import ConfigError

    cfg = compose(tmp_path / "run", [*QUICK, RICH])  # (QUICK: progress_bar=none)
    with pytest.raises(ConfigError, match=r"progress_bar=none with a progress bar among the callbacks \(callbacks.bar"):
        train(cfg)
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize(
    ("target", "said"),
    [
        ("LearningRateFinder", "no lr attribute to set.*module.optimizer.lr"),
        ("BatchSizeFinder", "after the learning-rate schedule.*data.batch_size"),
    ],
)
def test_lightnings_tuner_callbacks_are_refused_before_the_run(tmp_path, target, said):
    """``LearningRateFinder`` stopped in its search with Lightning's ``AttributeError`` (the module has no ``lr``:
    ``module.optimizer.lr`` is built into the optimizer); ``BatchSizeFinder`` trained at another batch size than the
    schedule was planned for, and its trial restores counted as 2 resumes in ``metrics.json`` of a new run. Both: one
    line naming the callback and the setting to use instead, before anything is built."""
    from vitrel.config import ConfigError

    cb = f"+callbacks.tune={{_target_: lightning.pytorch.callbacks.{target}}}"
    with pytest.raises(ConfigError, match=rf"callbacks\.tune \({target}\).*{said}"):
        train(compose(tmp_path / "run", [*QUICK, cb]))
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_closing_line_names_the_metric_the_best_checkpoint_is_chosen_by(tmp_path, capsys):
    """``callbacks.model_checkpoint.monitor=val/loss mode=min``: the closing line said ``(best val/acc1: ...)`` of a
    file chosen by the lowest ``val/loss``; it names the monitored metric, which ``metrics.json`` keeps too."""
    mon = ["callbacks.model_checkpoint.monitor=val/loss", "callbacks.model_checkpoint.mode=min"]
    train(compose(tmp_path, [*QUICK, "trainer.max_epochs=1", "trainer.limit_train_batches=1", *mon]))
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("checkpoint  "))
    assert "  (best val/loss: " in line, line
    assert json.loads((tmp_path / "metrics.json").read_text())["best_monitor"] == "val/loss"


def test_a_run_early_stopping_stopped_run_again_in_its_folder_trains_nothing(tmp_path, capsys):
    """A run ``EarlyStopping`` stopped (epoch 3 of 10), run again in its folder (a requeued job, a sweep run again:
    ``resume=auto``), resumed ``last.ckpt`` and trained one more epoch each time (3 -> 4 epochs, the test score
    changed): Lightning keeps the callback's state, not the trainer's stop. It stops before training, as a run that
    reached ``max_epochs`` does."""
    es = "+callbacks.early_stop={_target_: lightning.pytorch.callbacks.EarlyStopping, monitor: val/acc1, mode: max,"
    es += " patience: 2, min_delta: 2.0}"  # (no accuracy gains 2.0: stops after epoch 0 and 2 more)
    run = [*QUICK, "trainer.max_epochs=10", "trainer.limit_train_batches=1", es]
    train(compose(tmp_path, run))
    first = json.loads((tmp_path / "metrics.json").read_text())
    assert (first["epochs"], first["global_step"]) == (3, 3)
    # the record and the closing line say what stopped it (before: only "3 epochs" of max_epochs=10)
    assert first["stopped_by"].startswith("EarlyStopping in epoch 3 (Monitored metric val/acc1 did not improve")
    assert f"3 steps; stopped by {first['stopped_by']})" in capsys.readouterr().out
    train(compose(tmp_path, run))
    again = json.loads((tmp_path / "metrics.json").read_text())
    assert (again["epochs"], again["global_step"], again["resumed_finished"]) == (3, 3, True)
    assert again["stopped_by"] == first["stopped_by"]


@pytest.mark.parametrize(
    "override",
    [
        "+callbacks.es={_target_: lightning.pytorch.callbacks.EarlyStopping, monitor: val/acc, mode: max}",
        "callbacks.model_checkpoint.monitor=val/acc",
    ],
)
def test_a_monitored_metric_the_run_does_not_log_is_refused_before_training(tmp_path, override):
    """``EarlyStopping`` / ``ModelCheckpoint`` monitoring ``val/acc`` (no such metric: ``val/acc1``) stopped with
    Lightning's error only at the end of the first epoch, its training lost (no ``last.ckpt``: the error comes before
    the epoch's save). Refused before training, naming the metrics the run logs, as ``optimized_metric`` is."""
    from vitrel.config import ConfigError

    run = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"monitor=val/acc\b.*not a metric this run logs: .*val/acc1"):
        train(compose(run, [*QUICK, "trainer.max_epochs=1", "trainer.limit_train_batches=1", override]))
    assert not (run / "checkpoints").exists()


@pytest.mark.parametrize(
    ("override", "said"),
    [  # EarlyStopping's default mode is min; the config's model_checkpoint says max (for val/acc1)
        ("+callbacks.es={_target_: lightning.pytorch.callbacks.EarlyStopping, monitor: val/acc1}", "mode=max"),
        ("callbacks.model_checkpoint.monitor=val/loss", "mode=min"),
    ],
)
def test_a_monitor_mode_against_its_metric_is_refused_before_training(tmp_path, override, said):
    """``EarlyStopping(monitor=val/acc1)`` without ``mode`` (Lightning's default ``min``) stopped a run whose accuracy
    kept rising; ``callbacks.model_checkpoint.monitor=val/loss`` kept the config's ``mode: max``, so the "best" file
    was the epoch of the highest validation loss. Refused before training, naming the mode to set."""
    from vitrel.config import ConfigError

    run = tmp_path / "run"
    with pytest.raises(ConfigError, match=rf"would keep the worst.*set .*{said}"):
        train(compose(run, [*QUICK, "trainer.max_epochs=1", "trainer.limit_train_batches=1", override]))
    assert not (run / "checkpoints").exists()


class LogMyMetric(Callback):
    """A callback of one's own that logs ``val/my_metric`` (1 - the validation loss) at each validation's end."""

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        pl_module.log("val/my_metric", 1.0 - trainer.callback_metrics["val/loss"])


MY_MONITORS = [
    "callbacks.model_checkpoint.monitor=val/my_metric",
    "+callbacks.es={_target_: lightning.pytorch.callbacks.EarlyStopping, monitor: val/my_metric, mode: max}",
]


def test_a_monitored_metric_a_callback_of_ones_own_logs_is_let_through(tmp_path):
    """``ModelCheckpoint`` / ``EarlyStopping`` monitoring ``val/my_metric``, which a callback of one's own logs with
    ``pl_module.log``, was refused before training (only the module's metric names were read): it trains, and the best
    file is chosen by it. Misspellings of the module's own names stay refused (above)."""
    run = [*QUICK, "trainer.max_epochs=2", "trainer.limit_train_batches=1", *MY_MONITORS]
    result = train(compose(tmp_path, run), callbacks=[LogMyMetric()])
    record = json.loads((tmp_path / "metrics.json").read_text())
    assert record["best_monitor"] == "val/my_metric" and record["best_ckpt"] is not None
    assert result["val/my_metric"] == pytest.approx(1.0 - result["val/loss"])


def test_a_monitored_metric_nobody_logs_is_lightnings_error_at_the_first_validation(tmp_path):
    """A name the module cannot know and no callback logs: Lightning's own error, at the first validation's end."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    run = [*QUICK, "trainer.max_epochs=2", "trainer.limit_train_batches=1", MY_MONITORS[0]]
    with pytest.raises(MisconfigurationException, match=r"monitor='val/my_metric'.*could not find the monitored key"):
        train(compose(tmp_path, run))
    assert not (tmp_path / "metrics.json").exists()


@pytest.mark.parametrize("monitor", ["val/acc1_epoch", "val/los", "test/acc1"])
def test_a_monitor_near_the_modules_own_metric_is_refused_before_training(tmp_path, monitor):
    """Still refused before training: Lightning's suffix on a metric logged once, a misspelling, a test metric."""
    from vitrel.config import ConfigError

    with pytest.raises(ConfigError, match=rf"monitor={monitor}\b.*not a metric this run logs"):
        train(compose(tmp_path, [*QUICK, "trainer.max_epochs=1", f"callbacks.model_checkpoint.monitor={monitor}"]))
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("+callbacks.model_checkpoint.every_n_train_steps=5", "last_checkpoint.every_n_train_steps=5"),
        ("+callbacks.model_checkpoint.train_time_interval={_target_: datetime.timedelta, minutes: 30}",
         "last_checkpoint.every_n_minutes=30"),
    ],
)  # fmt: skip
def test_a_best_checkpoint_saved_between_validations_is_refused_before_training(tmp_path, override, said):
    """``callbacks.model_checkpoint.every_n_train_steps`` (``experiment=imagenet_vit_small`` set 2000) saved the best
    file mid-epoch, weights no validation had scored, under the previous validation's ``val/acc1``: eval.py of that
    file scored less than the score it was kept for. Refused before training, naming last.ckpt's own trigger."""
    from vitrel.config import ConfigError

    with pytest.raises(ConfigError, match=rf"between validations.*{said}"):
        train(compose(tmp_path, [*QUICK, "trainer.max_epochs=1", override]))
    assert not (tmp_path / "checkpoints").exists()


def test_the_imagenet_recipe_saves_last_ckpt_mid_epoch_and_the_best_file_at_validations(tmp_path):
    """The recipe's 2,000-step saves are last.ckpt's; its best-checkpoint callback passes the check above."""
    from hydra.utils import instantiate

    from vitrel.train.run import _check_saved_when_scored

    cfg = compose(tmp_path, ["experiment=imagenet_vit_small"])
    assert cfg.callbacks.last_checkpoint.every_n_train_steps == 2000
    _check_saved_when_scored(instantiate(cfg.callbacks.model_checkpoint))


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("data.batch_size=7", r"data.batch_size=7 is odd: module/mixup .* use an even data.batch_size"),
        ("data.val_fraction=0.1001", r"ends in a batch of 7 \(of 8,999 images a process, data.batch_size=16, "
         r"data.drop_last=false\): .*set data.drop_last=true"),
    ],
)  # fmt: skip
def test_mixup_with_an_odd_batch_is_refused_as_the_fit_starts(tmp_path, override, said):
    """timm's Mixup takes even batches; an odd ``data.batch_size`` failed at the first step, an epoch ending in an odd
    batch (``data.drop_last=false``, the default) only at that epoch's last step, each in a traceback (an audit: after
    a whole epoch). Refused as the fit starts, before a step, naming what to set."""
    from vitrel.config import ConfigError

    run = [*QUICK, "trainer.max_epochs=1", "module/mixup=default", override]
    with pytest.raises(ConfigError, match=said):
        train(compose(tmp_path, run))
    assert not (tmp_path / "checkpoints").exists()


def test_mixup_epochs_that_stop_before_their_odd_batch_train(tmp_path):
    """An epoch cut before its odd last batch (``trainer.limit_train_batches``) never meets it: the run trains."""
    run = [*QUICK, "trainer.max_epochs=1", "module/mixup=default", "data.val_fraction=0.1001"]
    train(compose(tmp_path, [*run, "trainer.limit_train_batches=2"]))
    assert json.loads((tmp_path / "metrics.json").read_text())["global_step"] == 2
