"""``python eval.py ckpt_path=<run>/checkpoints/last.ckpt`` scores the samples the run was scored on: the data settings
of the run (its split, its clips, its preprocessing) are taken from its folder's record, or from the data config
stored with the weights, unless given; other data keeps its group's defaults."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

import vitrel
import vitrel.data.fashion_mnist as fm
from tests.train_helpers import EVAL_PICTURES_OFF, FAST, TINY_VIDEO, TINY_VIT, compose, run_script_forked
from vitrel.config import ConfigError
from vitrel.data.datasets import seeded_split
from vitrel.train.evaluate import evaluate

# no workers, on the CPU, no progress bar, no pictures, 4 batches
EVAL = [*FAST[:1], *FAST[2:4], *EVAL_PICTURES_OFF, "data.eval_batch_size=500"]
# the run: a seeded 20 % of train held out (data.seed by interpolation), resized bicubic with a 0.95 centre crop
RUN_DATA = ["seed=1", "data.seed=${seed}", "data.val_fraction=0.2", "data.interpolation=bicubic", "data.crop_pct=0.95"]


def _train_py(run, args: list[str]) -> dict:
    """``python train.py <args>`` in ``run`` (its ``.hydra/config.yaml`` as Hydra writes it; forked from the preloaded
    server: :func:`tests.train_helpers.run_script_forked`): its metrics.json."""
    args = [*args, "trainer.max_epochs=1", "logger=none", f"hydra.run.dir={run}"]
    r = run_script_forked("train.py", args, cwd=run.parent)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return json.loads((run / "metrics.json").read_text())["metrics"]


@pytest.fixture(scope="module")
def fmnist_run(tmp_path_factory):
    """``(run folder, its metrics)``: the tiny ViT, 2 steps, validated on all 2,000 held-out images, tested on all
    2,000 test images."""
    run = tmp_path_factory.mktemp("fmnist") / "run"
    fast = [*FAST, "trainer.limit_train_batches=2", "data.eval_batch_size=500"]  # (8 batches of val and test)
    return run, _train_py(run, [*TINY_VIT, *fast, *RUN_DATA])


def _eval(tmp_path, name: str, ckpt, over: list[str]) -> tuple[dict, dict, OmegaConf]:
    """``python eval.py ckpt_path=<ckpt> <over>`` in-process: ``(metrics, eval_metrics.json, its data config as
    scored)``."""
    cfg = compose(tmp_path / name, [f"ckpt_path={ckpt}", *over], config_name="eval")
    metrics = evaluate(cfg)
    return metrics, json.loads((tmp_path / name / "eval_metrics.json").read_text()), cfg.data


def _split(data_cfg, split: str) -> np.ndarray:
    """The indices into Fashion-MNIST's train images of ``split`` of the data module ``data_cfg`` builds."""
    return np.asarray(instantiate(data_cfg).raw_dataset(split).indices)


def test_the_run_log_says_what_it_trains_and_validates_on(fmnist_run):
    run, _ = fmnist_run
    line = "data: train 8,000 images, val 2,000 (held out of train: data.val_fraction=0.2, data.seed=1)"
    assert line in (run / "train.log").read_text()


def test_eval_records_the_model_overrides_it_scored_with(fmnist_run, tmp_path, capsys):
    """``eval.py ... +model_overrides.pos.extend=interpolate`` scores another model than the stored one: the line and
    ``eval_metrics.json`` said nothing of it (a RoPE scaling's 27.5 % looked like the plain 17.4 %)."""
    run, _ = fmnist_run
    over = ["+model_overrides.pos.extend=interpolate", "trainer.limit_test_batches=1", *EVAL]
    _, res, _ = _eval(tmp_path, "over", run / "checkpoints" / "last.ckpt", over)
    assert res["model_overrides"] == {"pos": {"extend": "interpolate"}}
    assert 'model_overrides {"pos": {"extend": "interpolate"}}: test/acc1' in capsys.readouterr().out
    _, plain, _ = _eval(tmp_path, "plain", run / "checkpoints" / "last.ckpt", ["trainer.limit_test_batches=1", *EVAL])
    assert plain["model_overrides"] == {} and "model_overrides" not in capsys.readouterr().out


def test_model_overrides_of_what_eval_sets_itself_are_one_line(fmnist_run, tmp_path):
    """``+model_overrides.img_size=48`` (predict.py's way to another size) and ``+model_overrides.use_ema=false`` met
    eval.py's own ``img_size=`` and ``use_ema=`` in ``vitrel.load_model``'s call: a ``TypeError`` traceback (got
    multiple values). Refused first, naming eval.py's setting."""
    run, _ = fmnist_run
    for over, instead in (("img_size=48", r"data.img_size=<n>"), ("use_ema=false", "ema=true or ema=false")):
        key = over.split("=")[0]
        with pytest.raises(ConfigError, match=rf"^model_overrides.{key}: eval.py sets it itself, from {instead}: "):
            _eval(tmp_path, key, run / "checkpoints" / "last.ckpt", [f"+model_overrides.{over}", *EVAL])


def test_eval_on_val_scores_the_runs_held_out_images(fmnist_run, tmp_path, caplog):
    """After ``train.py data.val_fraction=0.2 data.seed=${seed} seed=1``, ``eval.py ckpt_path=... split=val`` held out
    the group's 10 % at seed 0: 814 of its 1,000 images were training images, scored without a word. Now: the run's
    2,000 held-out images (none of its training images), the run's preprocessing, the run's val scores; said in one
    line and recorded."""
    caplog.set_level("INFO", logger="lightning.pytorch")  # (rank_zero_info's)
    run, trained = fmnist_run
    metrics, res, data = _eval(tmp_path, "val", run / "checkpoints" / "last.ckpt", ["split=val", *EVAL])
    want_train, want_val = seeded_split(10_000, 0.2, 1)
    assert res["num_images"] == res["split_images"] == len(want_val) == 2000
    assert np.array_equal(_split(data, "val"), want_val) and np.array_equal(_split(data, "train"), want_train)
    assert res["data_from_run"] == {
        "seed": 1, "val_fraction": 0.2, "interpolation": "bicubic", "crop_pct": 0.95, "img_size": 28,
    }  # fmt: skip
    run_data = OmegaConf.load(run / ".hydra" / "config.yaml").data
    assert np.array_equal(_split(run_data, "val"), want_val)  # (the run's own data module, from its record)
    assert abs(metrics["val/acc1"] - trained["val/acc1"]) <= 1 / 2000
    assert metrics["val/loss"] == pytest.approx(trained["val/loss"], rel=1e-5)
    record = run / ".hydra" / "config.yaml"
    said = "data.seed=1 data.val_fraction=0.2 data.interpolation=bicubic data.crop_pct=0.95: the data settings of "
    assert said + f"last.ckpt's run ({record} and the split stored in last.ckpt; data.<key>=<v> for others)" in (
        caplog.text
    )


def test_the_split_comes_from_the_checkpoint_when_the_record_was_rewritten(fmnist_run, tmp_path):
    """A resume refused for another ``data.seed`` leaves Hydra's record of that command in the run folder (Hydra
    writes it before the run starts); ``eval.py split=val`` still scores the 2,000 images the weights were validated
    on: the split the checkpoint holds wins over the record's."""
    run, trained = fmnist_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    over = [*TINY_VIT, *FAST, "trainer.max_epochs=2", "logger=none", *RUN_DATA[1:], "seed=2", f"hydra.run.dir={copy}"]
    refused = run_script_forked("train.py", over, cwd=tmp_path)
    assert refused.returncode == 1 and "SplitMismatchError" in refused.stdout + refused.stderr
    assert OmegaConf.load(copy / ".hydra" / "config.yaml").seed == 2  # the record now says seed 2
    metrics, res, data = _eval(tmp_path, "val", copy / "checkpoints" / "last.ckpt", ["split=val", *EVAL])
    assert np.array_equal(_split(data, "val"), seeded_split(10_000, 0.2, 1)[1]) and res["data_from_run"]["seed"] == 1
    assert abs(metrics["val/acc1"] - trained["val/acc1"]) <= 1 / 2000


def test_a_command_line_key_wins_over_the_runs(fmnist_run, tmp_path, caplog):
    """``eval.py ckpt_path=... split=val data.seed=0``: seed 0's hold-out of the run's 20 %; the rest from the run. A
    warning says it is not the run's val split (it holds images the run trained on: counted)."""
    caplog.set_level("INFO", logger="lightning.pytorch")
    run, _ = fmnist_run
    _, res, data = _eval(tmp_path, "seed0", run / "checkpoints" / "last.ckpt", ["split=val", "data.seed=0", *EVAL])
    assert np.array_equal(_split(data, "val"), seeded_split(10_000, 0.2, 0)[1]) and res["split_images"] == 2000
    assert res["data_from_run"] == {"val_fraction": 0.2, "interpolation": "bicubic", "crop_pct": 0.95, "img_size": 28}
    assert "data.val_fraction=0.2 data.interpolation=bicubic data.crop_pct=0.95: the data settings" in caplog.text
    trained_on = np.intersect1d(_split(data, "val"), seeded_split(10_000, 0.2, 1)[0])  # the run's train (its seed 1)
    assert len(trained_on) > 1000, len(trained_on)
    assert (
        "split=val with data.seed=0 (the run's: 1): not the val split last.ckpt's run held out of train; it may hold "
        "images the run trained on (drop the override to score the run's)"
    ) in caplog.text


def test_val_of_weights_that_record_no_split_warns_that_it_may_hold_training_images(fmnist_run, tmp_path, caplog):
    """``eval.py ckpt_path=<export folder> split=val``: an export records no val split, so the group's hold-out (seed
    0, 10 %) is scored, here 814 of its 1,000 images the run (seed 1, 20 %) trained on; it was scored without a
    word. Now a warning names the keys to give; with them given, none."""
    from vitrel.models.checkpoint import export_model

    caplog.set_level("INFO", logger="lightning.pytorch")
    run, _ = fmnist_run
    export = export_model(run / "checkpoints" / "last.ckpt", tmp_path / "export")
    _, res, data = _eval(tmp_path, "export", export, ["split=val", *EVAL])
    assert len(np.intersect1d(_split(data, "val"), seeded_split(10_000, 0.2, 1)[0])) > 500
    said = "split=val: export records no val split (a .ckpt does): scored the hold-out of data.seed=0"
    assert said in caplog.text and "give the run's data.seed and data.val_fraction" in caplog.text
    caplog.clear()
    _eval(tmp_path, "given", export, ["split=val", "data.seed=1", "data.val_fraction=0.2", *EVAL])
    assert "records no val split" not in caplog.text


def test_a_moved_checkpoint_is_scored_with_its_stored_preprocessing(fmnist_run, tmp_path):
    """A checkpoint copied out of its run folder (no record beside it): the interpolation and crop it was trained
    with, from the data config stored with the weights (as timm's validate.py takes them from the model's
    pretrained_cfg), so its test score is the run's; the group's bilinear full-image resize scores differently."""
    run, trained = fmnist_run
    moved = tmp_path / "moved" / "model.ckpt"
    moved.parent.mkdir()
    shutil.copy(run / "checkpoints" / "last.ckpt", moved)
    metrics, res, _ = _eval(tmp_path, "moved", moved, EVAL)
    assert res["num_images"] == 2000 and abs(metrics["test/acc1"] - trained["test/acc1"]) <= 1 / 2000
    assert metrics["test/loss"] == pytest.approx(trained["test/loss"], rel=1e-5)
    split = {"seed": 1, "val_fraction": 0.2}  # (the split it trained with: a moved checkpoint's val is the run's)
    assert res["data_from_run"] == {"interpolation": "bicubic", "crop_pct": 0.95, **split, "img_size": 28}
    plain, res, _ = _eval(tmp_path, "plain", moved, [*EVAL, "data.interpolation=bilinear", "data.crop_pct=1.0"])
    assert res["data_from_run"] == {**split, "img_size": 28}
    # (another score than the run's, beyond the 1e-5 the same preprocessing is held to above: the tiny run is near
    # chance, so the loss moves by about 1e-4)
    assert plain["test/loss"] != pytest.approx(trained["test/loss"], rel=1e-5)


def test_a_run_setting_that_does_not_resolve_here_is_an_error_naming_the_key(fmnist_run, tmp_path, monkeypatch):
    """A run whose ``data.crop_pct`` read an environment variable that eval.py's environment lacks: one error naming
    the key to give, before anything is scored or written (not the group's crop in silence)."""
    run, _ = fmnist_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    record = copy / ".hydra" / "config.yaml"
    text = record.read_text()
    assert "  crop_pct: 0.95\n" in text
    record.write_text(text.replace("  crop_pct: 0.95\n", "  crop_pct: ${oc.env:VITREL_TEST_RUN_CROP}\n", 1))
    monkeypatch.delenv("VITREL_TEST_RUN_CROP", raising=False)
    cfg = compose(tmp_path / "eval", [f"ckpt_path={copy / 'checkpoints' / 'last.ckpt'}", *EVAL], config_name="eval")
    with pytest.raises(ValueError) as said:
        evaluate(cfg)
    assert str(said.value) == (
        f"data.crop_pct=${{oc.env:VITREL_TEST_RUN_CROP}} of {record} does not resolve here (KeyError raised while "
        "resolving interpolation: \"Environment variable 'VITREL_TEST_RUN_CROP' not found\"): give data.crop_pct=<the "
        "run's>"
    )
    assert not (tmp_path / "eval" / "eval_metrics.json").exists()


def test_other_data_takes_nothing_from_the_run(fmnist_run, tmp_path):
    """``eval.py ckpt_path=<the Fashion-MNIST run> data=fashion_mnist_naflex split=val``: that group's own split
    (10 % at seed 0) and preprocessing, not the run's."""
    run, _ = fmnist_run
    over = ["data=fashion_mnist_naflex", "split=val", "trainer.limit_test_batches=1", *EVAL]
    _, res, data = _eval(tmp_path, "naflex", run / "checkpoints" / "last.ckpt", over)
    assert res["split_images"] == 1000 and res["data_from_run"] == {}
    assert (data.seed, data.val_fraction, data.interpolation, data.crop_pct) == (0, 0.1, None, None)


def test_eval_scores_the_clips_of_a_moving_fmnist_run(tmp_path):
    """``train.py experiment=video data.speeds=[2] data.orientations=[90,135] data.seed=3`` (32 test images), then
    ``eval.py ckpt_path=... data=moving_fmnist``: the run's 32 test clips (its motions, its images, as the data
    module of the run's record renders them), not the group's 4,000 clips of other motions; the run's test score."""
    run = tmp_path / "run"
    motion = ["data.speeds=[2]", "data.orientations=[90,135]", "data.seed=3"]
    trained = _train_py(run, [*TINY_VIDEO, "pos=none", *motion])
    metrics, res, data = _eval(tmp_path, "eval", run / "checkpoints" / "last.ckpt", ["data=moving_fmnist", *EVAL])
    assert res["num_images"] == res["split_images"] == 32
    ours = instantiate(data).make_dataset("test")
    theirs = instantiate(OmegaConf.load(run / ".hydra" / "config.yaml").data).make_dataset("test")
    assert len(ours) == len(theirs) == 32
    for i in range(32):
        (x, y), (want_x, want_y) = ours[i], theirs[i]
        assert y == want_y and torch.equal(x, want_x), i
    assert abs(metrics["test/acc1"] - trained["test/acc1"]) <= 1 / 32
    assert metrics["test/loss"] == pytest.approx(trained["test/loss"], rel=1e-5)
    assert res["data_from_run"] == {
        "seed": 3, "train_images": 32, "test_images": 16, "speeds": [2], "orientations": [90, 135], "img_size": 32,
        "num_frames": 8,
    }  # fmt: skip


def test_ema_auto_scores_the_weights_the_run_tested(tmp_path):
    """A run with an EMA that validates and tests its trained weights (``module.ema_eval=false``): ``eval.py``'s
    ``ema=auto`` scores those, so its test score is the run's (it took the EMA copy the checkpoint holds, another
    model); with the default ``ema_eval`` it scores the EMA copy, as the run did."""
    from vitrel.train.run import train

    ema = ["module/ema=default", "module.ema.decay=0.5", "module.ema.use_warmup=false"]
    short = [
        *TINY_VIT,
        *FAST,
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=4",
        "logger=none",
        *ema,
    ]  # (timm's first EMA updates copy)
    short += ["data.eval_batch_size=500", "callbacks.pos_images=null"]
    for name, eval_ema in (("raw", False), ("ema", True)):
        run = tmp_path / name
        trained = train(compose(run, [*short, f"module.ema_eval={str(eval_ema).lower()}"]))
        metrics, res, _ = _eval(tmp_path, f"eval_{name}", run / "checkpoints" / "last.ckpt", EVAL)
        assert res["ema"] is eval_ema and res["num_images"] == 2000
        assert abs(metrics["test/acc1"] - trained["test/acc1"]) <= 1 / 2000
        assert metrics["test/loss"] == pytest.approx(trained["test/loss"], rel=1e-5)
        other, _, _ = _eval(
            tmp_path, f"other_{name}", run / "checkpoints" / "last.ckpt", [*EVAL, f"ema={not eval_ema}"]
        )
        assert other["test/loss"] != pytest.approx(trained["test/loss"], rel=1e-3)  # (the other weights score apart)


def test_eval_at_one_of_the_runs_size_choices_scores_the_model_as_trained(tmp_path):
    """A run with ``data.size_choices=[28,36]`` trained its 36-px batches on the model built at 28 px: offsets past
    its 13x13 table read the table's edge. ``eval.py data.img_size=36`` rebuilt the model at 36 px, interpolating
    those offsets instead: another function than the one trained at 36. At a size the run trained at, eval.py runs
    the stored model as trained (said in the log); checked against a forward by hand. Another size is rebuilt. (The
    run trains in-process: eval.py takes the size choices stored with the weights; its own scores are not read.)"""
    import torch.nn.functional as F

    from vitrel.train.run import train

    run = tmp_path / "run"
    short = ["trainer.max_epochs=1", "trainer.limit_train_batches=4", "trainer.limit_val_batches=1", "test=false"]
    train(compose(run, [*TINY_VIT, *FAST, *short, "logger=none", "pos=rel2d_full", "data.size_choices=[28,36]"]))
    ckpt = run / "checkpoints" / "last.ckpt"
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    for k, v in state["state_dict"].items():  # a table whose edge differs from its inside, as a longer run's
        if k.endswith("attn.pos.table"):
            v[0], v[-1], v[:, 0], v[:, -1] = 8.0, -8.0, 6.0, -6.0
    torch.save(state, ckpt)
    metrics, scored, data_cfg = _eval(tmp_path, "eval", ckpt, [*EVAL, "data.img_size=36"])
    assert scored["img_size"] == 36
    dm = instantiate(data_cfg)
    dm.setup("test")
    model = vitrel.load_model(ckpt).eval()  # built at 28 px, as trained
    with torch.no_grad():
        loss = [F.cross_entropy(model(x), y, reduction="none") for x, y in list(dm.test_dataloader())[:4]]
    assert metrics["test/loss"] == pytest.approx(torch.cat(loss).mean().item(), abs=1e-5)
    other, _, _ = _eval(tmp_path, "eval44", ckpt, [*EVAL, "data.img_size=44"])  # not trained at: rebuilt (runs)
    assert other["test/loss"] != metrics["test/loss"]


def test_val_of_weights_that_record_no_split_warns_with_val_fraction_null(tmp_path, caplog):
    """``data.val_fraction=null`` is Fashion-MNIST's 10 % hold-out, so ``split=val`` of weights that record no split
    warns as with ``0.1`` (a null was read as 0, val is the test split: no warning)."""
    from pathlib import Path

    from vitrel.train.evaluate import _warn_unknown_val_split

    cfg = compose(tmp_path, ["data=fashion_mnist", "data.val_fraction=null"])
    with caplog.at_level("WARNING", logger="vitrel.train.evaluate"):
        _warn_unknown_val_split(Path("export"), cfg.data, {}, None)
    assert "split=val: export records no val split (a .ckpt does)" in caplog.text, caplog.text


@pytest.mark.skipif(
    not fm.DEBIAN_DIR.is_dir(), reason="Debian dataset-fashion-mnist not installed (.ci/run installs it)"
)
def test_a_full_fashion_mnist_run_is_not_scored_on_the_shipped_subset(tmp_path):
    """``train.py data=fashion_mnist_full``, then ``eval.py ckpt_path=<run>`` without ``data=``: the default group's
    images (the shipped 2k-test subset, 10 classes, 1 channel, as the run's) were scored in their place, silently,
    and with ``split=val`` a hold-out of which 914 of 1,000 images the run trained on. Refused, naming the run's
    data, which then scores the run's test; the checkpoint moved out of its run folder, ``split=val`` is refused on
    the subset's hold-out (its split record says 60,000 training samples, not 10,000)."""
    run = tmp_path / "run"
    limits = ["trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "trainer.limit_test_batches=2"]
    trained = _train_py(run, [*TINY_VIT, *FAST, "data=fashion_mnist_full", *limits])
    ckpt = run / "checkpoints" / "last.ckpt"
    ev = [*EVAL, "data.eval_batch_size=16", "trainer.limit_test_batches=2"]  # (the run's 2 test batches)
    with pytest.raises(ValueError, match=r"last.ckpt was trained on data=fashion_mnist_full, but eval.py scores "
                       r"data=fashion_mnist unless told: .* data=fashion_mnist_full \(its run's "):  # fmt: skip
        _eval(tmp_path, "default", ckpt, ev)
    assert not (tmp_path / "default" / "eval_metrics.json").exists()
    metrics, res, _ = _eval(tmp_path, "full", ckpt, ["data=fashion_mnist_full", *ev])
    assert res["split_images"] == 10_000 and metrics["test/loss"] == pytest.approx(trained["test/loss"], rel=1e-5)
    moved = tmp_path / "moved.ckpt"
    shutil.copy(ckpt, moved)
    with pytest.raises(ValueError, match=r"split=val: moved.ckpt's run held out 0.1 of 60000 training samples \(seed "
                       r"0\), this data 0.1 of 10000 training samples \(seed 0\): another hold-out"):  # fmt: skip
        _eval(tmp_path, "moved", moved, ["split=val", *ev])
    _, res, _ = _eval(tmp_path, "moved_full", moved, ["data=fashion_mnist_full", "split=val", *ev])
    assert res["split_images"] == 6_000
