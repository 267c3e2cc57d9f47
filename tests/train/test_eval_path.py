"""eval.py walked through after a first small run: a video checkpoint without ``data=``, a checkpoint moved out of
its run folder, a model of a non-square size, NaFlex at a size that is not the images' own, and the run folder's
record read once per evaluation."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import OmegaConf

import vitrel
from tests.train_helpers import EVAL_PICTURES_OFF, FAST, TINY_VIT, compose, run_script_forked
from vitrel.train.evaluate import evaluate
from vitrel.train.run import train

SHORT = ["trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "logger=none"]
# no workers, on the CPU, no progress bar, no pictures
EVAL = [*FAST[:1], *FAST[2:4], *EVAL_PICTURES_OFF, "data.eval_batch_size=500"]


def _eval(out, ckpt, over: list[str]) -> tuple[dict, dict, object]:
    """``eval.py ckpt_path=<ckpt> <over>`` in-process: ``(metrics, eval_metrics.json, the data config scored)``."""
    cfg = compose(out, [f"ckpt_path={ckpt}", *over], config_name="eval")
    metrics = evaluate(cfg)
    return metrics, json.loads((out / "eval_metrics.json").read_text()), cfg.data


def _loss_by_hand(model, data_cfg, batches: int) -> float:
    """The mean cross-entropy of ``model`` over the first ``batches`` test batches of ``data_cfg``'s data module."""
    dm = instantiate(data_cfg)
    dm.setup("test")
    with torch.no_grad():
        loss = [F.cross_entropy(model(x), y, reduction="none") for x, y in list(dm.test_dataloader())[:batches]]
    return torch.cat(loss).mean().item()


def test_eval_py_on_a_video_checkpoint_without_data_is_one_line_whose_advice_runs(video_sweep, tmp_path):
    """``python eval.py ckpt_path=<a video run's last.ckpt>`` (no ``data=``: eval.py reads Fashion-MNIST) ended in a
    ValueError traceback. Now one line naming the run's data; that advice then scores the run's clips."""
    ckpt = video_sweep / "checkpoints" / "last.ckpt"
    r = run_script_forked("eval.py", [f"ckpt_path={ckpt}", *EVAL, f"hydra.run.dir={tmp_path}/e"], cwd=tmp_path)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "Error executing job" not in r.stderr, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("eval.py: ConfigError: "), last
    assert "last.ckpt was trained on data=moving_fmnist, but eval.py scores data=fashion_mnist unless told" in last
    advice = last.split("score it on the data it was trained on, ")[1].split(" (its run's")[0]
    assert advice == "data=moving_fmnist", last
    _, res, _ = _eval(tmp_path / "ok", ckpt, [advice, *FAST[:1], *FAST[2:4]])
    assert res["num_frames"] == 8 and res["data_from_run"]["train_images"] == 32 and res["num_images"] == 32


def test_eval_advice_for_a_run_on_a_regenerated_cifar_copy_runs(tmp_path):
    """A run on a CIFAR-10 copy in torchvision's format that is not the official release (``data.verify=false``),
    scored by ``eval.py ckpt_path=<run>`` without ``data=``: the one-line advice named ``data=cifar10 data.root=...``,
    which then stopped on the md5 check the run had switched off. The advice carries the run's ``data.verify=false``."""
    from tests.data.test_datamodules import make_cifar_files

    make_cifar_files(tmp_path / "cifar", 10, n_per_batch=20)
    run = tmp_path / "run"
    data = ["data=cifar10", f"data.root={tmp_path / 'cifar'}", "data.verify=false", "data.download=false"]
    cfg = compose(run, [*TINY_VIT, *FAST, *SHORT, *data, "test=false"])
    train(cfg)
    (run / ".hydra").mkdir()
    OmegaConf.save(cfg, run / ".hydra" / "config.yaml")  # (the record Hydra writes into the run folder)
    with pytest.raises(ValueError, match="score it on the data it was trained on") as err:
        _eval(tmp_path / "e", run, EVAL)
    advice = str(err.value).split("score it on the data it was trained on, ")[1].split(" (its run's")[0]
    assert advice == f"data=cifar10 data.root={tmp_path / 'cifar'} data.verify=false", advice
    _, res, _ = _eval(tmp_path / "ok", run, [*advice.split(), *EVAL])
    assert res["data"] == "cifar10" and res["num_images"] == 20


def test_size_choices_travel_with_a_checkpoint_moved_out_of_its_run(tmp_path, caplog):
    """A run with ``data.size_choices=[28,36]``: its last.ckpt copied elsewhere (no run folder) and scored at 36 px was
    rebuilt at 36 (its table's offsets interpolated); the run folder's record was the only place the choices were
    kept. The checkpoint now stores them: the copy runs as trained, as by hand."""
    run = tmp_path / "run"
    train(compose(run, [*TINY_VIT, *FAST, *SHORT, "pos=rel2d_full", "data.size_choices=[28,36]", "test=false"]))
    moved = tmp_path / "elsewhere" / "model.ckpt"
    moved.parent.mkdir()
    state = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert state["hyper_parameters"]["data_config"]["size_choices"] == [28, 36]
    for k, v in state["state_dict"].items():  # a table whose edge differs from its inside, as a longer run's
        if k.endswith("attn.pos.table"):
            v[0], v[-1], v[:, 0], v[:, -1] = 8.0, -8.0, 6.0, -6.0
    torch.save(state, moved)
    caplog.set_level("INFO")
    metrics, res, data_cfg = _eval(tmp_path / "e", moved, [*EVAL, "data.img_size=36", "trainer.limit_test_batches=1"])
    assert res["img_size"] == 36 and "is one of the run's data.size_choices" in caplog.text
    model = vitrel.load_model(moved).eval()  # built at 28 px, as trained
    assert metrics["test/loss"] == pytest.approx(_loss_by_hand(model, data_cfg, 1), abs=1e-5)


@pytest.mark.parametrize("built", [[32, 48], 32])
def test_every_route_feeds_a_model_built_apart_the_images_it_was_trained_on(tmp_path, built):
    """``train.py +model.img_size=[32,48]`` (or ``=32``) trains an 8x12- (8x8-) patch model on 28-px images.
    ``eval.py`` rebuilt the non-square one at 28x28 (its learned table resized to 7x7 patches: another function) and
    fed the square one 32-px images; ``predict.py``, the exports and ``load_model``'s ``pretrained_cfg`` (what timm's
    ``resolve_data_config`` reads) resized images to the built size. Each now keeps the model as built and feeds it
    the run's 28-px images, as trained (eval's loss by hand); eval_metrics.json and the line say both sizes."""
    from vitrel.export import main as export_main
    from vitrel.inference import load_predictor

    run = tmp_path / "run"
    train(compose(run, [*TINY_VIT, *FAST, *SHORT, f"+model.img_size={built}", "test=false"]))
    ckpt = run / "checkpoints" / "last.ckpt"
    metrics, res, data_cfg = _eval(tmp_path / "e", ckpt, [*EVAL, "trainer.limit_test_batches=1"])
    hw = [built, built] if isinstance(built, int) else built
    assert (res["img_size"], res["model_img_size"]) == (28, hw)
    model = vitrel.load_model(ckpt).eval()
    assert list(vitrel.models.input_size.to_2tuple(model.vitrel_cfg["img_size"])) == hw
    assert metrics["test/loss"] == pytest.approx(_loss_by_hand(model, data_cfg, 1), abs=1e-5)
    assert model.pretrained_cfg["input_size"] == (1, 28, 28)  # (timm.data.resolve_model_data_config's)
    assert vitrel.load_model(ckpt, img_size=36).pretrained_cfg["input_size"] == (1, 36, 36)  # (asked: taken)
    assert load_predictor(run).data_config["input_size"] == [1, 28, 28]  # predict.py's
    assert export_main([str(ckpt), str(tmp_path / "x"), "--pt2"]) == 0
    assert json.loads((tmp_path / "x" / "config.json").read_text())["pretrained_cfg"]["input_size"] == [1, 28, 28]
    for exported in (tmp_path / "x", tmp_path / "x" / "model.pt2"):
        assert load_predictor(exported).data_config["input_size"] == [1, 28, 28]


def test_naflex_eval_filling_the_budget_says_the_size_it_ran(tmp_path, capsys):
    """``eval.py data=fashion_mnist_naflex data.eval_max_ratio=null`` scales every 28x28 image to fill 64 patches,
    32x32: the line said "at native sizes". It now says the size scored (and native when it is), and ``gflops``
    counts one image at that size (it was the model's nominal size: a 28-px count for 32-px images, an audit's).
    ``data.img_size=48`` on the command line, which NaFlex batches do not score at (an ``eval.py -m`` over sizes gave
    rows alike, each named by its size), is refused in one line naming what scores at 48."""
    from vitrel.train.flops import forward_flops

    run = tmp_path / "run"
    train(compose(run, [*TINY_VIT, *FAST, *SHORT, "data=fashion_mnist_naflex", "data.batch_size=8", "test=false"]))
    ckpt = run / "checkpoints" / "last.ckpt"
    over = ["data=fashion_mnist_naflex", "data.num_workers=0", *FAST[2:4], "trainer.limit_test_batches=1"]
    capsys.readouterr()
    _, fill, _ = _eval(tmp_path / "fill", ckpt, [*over, "data.eval_max_ratio=null"])
    line = capsys.readouterr().out.strip().splitlines()[-2]  # (the last: the file it wrote)
    assert "native" not in line and "at 32x32 (grid 8x8, NaFlex pack" in line, line
    assert fill["naflex_size"] == [32, 32] and fill["grid"] == [8, 8]  # (the grid was data.img_size's, 7x7)
    _, res, _ = _eval(tmp_path / "native", ckpt, over)
    line = capsys.readouterr().out.strip().splitlines()[-2]
    assert "at the images' native 28x28 (grid 7x7, NaFlex pack" in line, line
    assert res["naflex_size"] == [28, 28] and res["grid"] == [7, 7]
    model = vitrel.load_model(ckpt)
    for size, gflops in ((28, res["gflops"]), (32, fill["gflops"])):
        assert gflops == pytest.approx(forward_flops(model, torch.zeros(1, 1, size, size)) / 1e9), size
    r = run_script_forked("eval.py", [f"ckpt_path={ckpt}", *over, "data.img_size=48"], cwd=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    said = "NaFlex data (data.packing=pack) scores each image at its own size within data.max_tokens patches"
    assert said in r.stderr and "data.max_tokens=144 data.seq_len=144 data.eval_max_ratio=null" in r.stderr, r.stderr


def test_an_evaluation_reads_the_run_record_once(tmp_path, monkeypatch):
    """vitrel/train/evaluate.py read the run folder's ``.hydra/config.yaml`` in four places of one evaluation (another
    command rewriting it between reads would mix two records): once now, passed down."""
    import vitrel.train.evaluate as ev

    run = tmp_path / "run"
    train(compose(run, [*TINY_VIT, *FAST, *SHORT, "test=false"]))
    reads = []
    real = ev.run_record
    monkeypatch.setattr(ev, "run_record", lambda ckpt: reads.append(ckpt) or real(ckpt))
    _eval(tmp_path / "e", run / "checkpoints" / "last.ckpt", [*EVAL, "trainer.limit_test_batches=1", "split=val"])
    assert len(reads) == 1, reads


def test_other_class_names_are_a_log_warning_of_eval(tmp_path, caplog):
    """Class names unlike the checkpoint's: a ``warnings.warn`` attributed to a line of vitrel's own
    (``vitrel/train/evaluate.py: _warn_other_class_names(...)``), outside ``eval.log``. Now a log warning, as
    eval.py's other warnings (another val split, a NaFlex run's nominal size): on the console and in ``eval.log``."""
    from types import SimpleNamespace

    from vitrel.train.evaluate import _warn_other_class_names

    dm = SimpleNamespace(class_names=["cat", "dog", "fox"])
    caplog.set_level("WARNING", logger="vitrel.train.evaluate")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no Python warning)
        _warn_other_class_names(tmp_path / "last.ckpt", {"class_names": ["cat", "fox", "dog"]}, dm)
    said = [r.getMessage() for r in caplog.records if r.name == "vitrel.train.evaluate"]
    assert len(said) == 1 and said[0].startswith("class 1 is 'dog' here but 'fox' in last.ckpt; class 2 is"), said


def test_eval_on_an_export_folder_reports_the_weights_it_holds_and_refuses_the_others(tmp_path):
    """``python -m vitrel.export`` of a ``module/ema=default`` run takes the EMA copy; ``eval.py ckpt_path=<export>
    ema=false`` then scored that copy and wrote ``"ema": false``. The export's config.json now records which weights
    it holds; eval.py on it reports them, scores them under ema=auto or that choice, and refuses the other one."""
    from vitrel.export import main as export_main
    from vitrel.models.checkpoint import CheckpointError

    run = tmp_path / "run"
    ema = ["module/ema=default", "module.ema.decay=0.5", "module.ema.use_warmup=false"]
    train(compose(run, [*TINY_VIT, *FAST, *SHORT, *ema, "test=false"]))
    ckpt, one = run / "checkpoints" / "last.ckpt", [*EVAL, "trainer.limit_test_batches=1"]
    losses = {}
    for held, flag in ((True, []), (False, ["--ema", "false"])):
        out = tmp_path / f"export_{held}"
        assert export_main([str(ckpt), str(out), *flag]) == 0
        assert json.loads((out / "config.json").read_text())["ema"] is held
        scored, res, _ = _eval(tmp_path / f"e_{held}", out, one)
        assert res["ema"] is held
        same, res, _ = _eval(tmp_path / f"same_{held}", out, [*one, f"ema={str(held).lower()}"])
        assert res["ema"] is held and same == scored
        with pytest.raises(CheckpointError, match=f"holds the {'EMA' if held else 'trained'} weights only"):
            _eval(tmp_path / f"other_{held}", out, [*one, f"ema={str(not held).lower()}"])
        from_ckpt, res, _ = _eval(tmp_path / f"ckpt_{held}", ckpt, [*one, f"ema={str(held).lower()}"])
        assert res["ema"] is held and from_ckpt["test/loss"] == pytest.approx(scored["test/loss"], abs=1e-6)
        losses[held] = scored["test/loss"]
    assert losses[True] != pytest.approx(losses[False], abs=1e-4)  # (the two sets score apart)
