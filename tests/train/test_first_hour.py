"""What a new user runs in the first hour, checked for silent wrong answers: ``model=from_checkpoint`` reports the
model it built, the closing line says how many test images it scored, progress lines count as the epoch line does,
the errors give advice that works."""

from __future__ import annotations

import json
import re

import pytest

import vitrel
from tests.train_helpers import FAST, TINY_VIT, compose, run_script_forked
from vitrel.train.run import train

SHORT = ["trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1"]
SHORT += ["trainer.limit_test_batches=1", "logger=none"]


@pytest.fixture(scope="module")
def rope_run(tmp_path_factory):
    """A train.py run of the tiny ViT with ``pos=rope2d_mixed``: its folder."""
    run = tmp_path_factory.mktemp("rope_run")
    train(compose(run, [*TINY_VIT, *FAST, *SHORT, "pos=rope2d_mixed"]))
    return run


def test_from_checkpoint_reports_the_model_it_built(rope_run, tmp_path, caplog):
    """``model=from_checkpoint`` builds the file's architecture and scheme: metrics.json and the run's log say so,
    not the pos group's default (rel2d_factored) and not ``None``."""
    ckpt = rope_run / "checkpoints" / "last.ckpt"
    caplog.set_level("INFO", logger="lightning.pytorch")  # (rank_zero_info's)
    train(compose(tmp_path, ["model=from_checkpoint", f"model.path={ckpt}", *FAST, *SHORT]))
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert (saved["model"], saved["pos"]) == ("vitrel_vit_tiny_patch4_32", "rope2d_mixed")
    assert "model vitrel_vit_tiny_patch4_32 pos=rope2d_mixed " in caplog.text


@pytest.mark.parametrize("override", ["pos=alibi2d", "pos.extend=clip"])
def test_from_checkpoint_refuses_a_pos_override_before_any_work(rope_run, tmp_path, override):
    """A ``pos`` override would be silently ignored (the scheme is the file's): refused, naming the stored scheme,
    before anything is written."""
    ckpt = rope_run / "checkpoints" / "last.ckpt"
    run = tmp_path / "run"
    cfg = compose(run, ["model=from_checkpoint", f"model.path={ckpt}", *FAST, *SHORT, override])
    with pytest.raises(
        ValueError, match=rf"{override} has no effect with model=from_checkpoint.*\(rope2d_mixed\)"
    ) as e:
        train(cfg)
    assert not (run / "checkpoints").exists() and not (run / "metrics.json").exists()
    assert "with +model.pos.<key>=<value> (+model.pos.extend=interpolate)" in str(e.value)


def test_from_checkpoint_takes_one_scheme_option_as_the_refusal_says(rope_run, tmp_path):
    """``+model.pos.<key>=``, the route the refusal above names: that option changed, the others as trained."""
    ckpt = rope_run / "checkpoints" / "last.ckpt"
    over = [
        "model=from_checkpoint",
        f"model.path={ckpt}",
        "+model.pos.scaling={rope_type:linear,factor:2.0}",
        *FAST,
        *SHORT,
    ]
    train(compose(tmp_path / "run", over))
    pos = vitrel.load_model(tmp_path / "run" / "checkpoints" / "last.ckpt").vitrel_cfg["pos"]
    stored = vitrel.load_model(ckpt).vitrel_cfg["pos"]
    assert pos == {**stored, "scaling": {"rope_type": "linear", "factor": 2.0}} and stored.get("scaling") is None


def test_from_checkpoint_with_timm_weights_named_too_says_which_key_to_drop(rope_run, tmp_path):
    """``experiment=finetune_cifar10 model=from_checkpoint``: the experiment's ``model.init_from`` stayed in the model
    node and the build failed with ``unexpected argument(s) init_from=...``; refused first, naming the key to drop."""
    ckpt = rope_run / "checkpoints" / "last.ckpt"
    over = ["model=from_checkpoint", f"model.path={ckpt}", "+model.init_from=timm:vit_tiny_patch16_224"]
    with pytest.raises(ValueError, match=r"model.init_from=timm:vit_tiny_patch16_224 starts .* '~model.init_from'"):
        train(compose(tmp_path / "run", [*over, *FAST, *SHORT]))
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("pos", ["rel2d_full", "alibi2d"])
def test_loading_a_run_under_another_scheme_names_both(rope_run, pos):
    """``vitrel.load_model(ckpt, pos=...)`` (and ``create_model(..., checkpoint_path=ckpt, pos=...)``) with a scheme
    whose parameters the weights do not hold: the error named missing and unexpected keys only ("another
    model?"); it now names the run's scheme and this one, and how to load the run's."""
    from vitrel.models.checkpoint import CheckpointError

    ckpt = rope_run / "checkpoints" / "last.ckpt"
    says = rf"trained with pos=rope2d_mixed, this model has pos={pos}, whose parameters .* leave pos out"
    with pytest.raises(CheckpointError, match=says):
        vitrel.load_model(ckpt, pos=pos)
    with pytest.raises(CheckpointError, match=says):
        vitrel.create_model("vitrel_vit_tiny_patch4_32", checkpoint_path=str(ckpt), pos=pos)


def test_from_checkpoint_pos_refusal_is_one_line_from_train_py(rope_run, tmp_path):
    """``python train.py model=from_checkpoint ... pos=<another>`` ends with its message alone, as train.py's other
    refusals (``one_line_errors``): no traceback."""
    ckpt = rope_run / "checkpoints" / "last.ckpt"
    args = ["model=from_checkpoint", f"model.path={ckpt}", *FAST, *SHORT, "pos=alibi2d", f"hydra.run.dir={tmp_path}/r"]
    r = run_script_forked("train.py", args, cwd=tmp_path)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "Error executing job" not in r.stderr, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("train.py: ConfigError: pos=alibi2d has no effect with model=from_checkpoint"), last


def test_resume_of_another_model_advises_a_route_that_works(rope_run, tmp_path):
    """Resuming a checkpoint with another ``pos=`` is refused; the advice it gives (start a new run from the
    weights) is a command that runs: ``model=from_checkpoint model.path=<file>``."""
    from vitrel.models.checkpoint import CheckpointError

    ckpt = rope_run / "checkpoints" / "last.ckpt"
    cfg = compose(tmp_path / "resume", [*TINY_VIT, *FAST, *SHORT, "pos=alibi2d", f"ckpt_path={ckpt}"])
    with pytest.raises(CheckpointError, match="holds another model") as err:
        train(cfg)
    advice = re.search(r"model=from_checkpoint model\.path=(\S+)", str(err.value))
    assert advice is not None, str(err.value)
    new = tmp_path / "new"
    train(compose(new, ["model=from_checkpoint", f"model.path={advice.group(1)}", *FAST, *SHORT]))
    assert json.loads((new / "metrics.json").read_text())["status"] == "finished"


@pytest.mark.parametrize("limit", [1, None])
def test_closing_line_says_when_the_test_score_is_of_part_of_the_split(tmp_path, capsys, limit):
    """``trainer.limit_test_batches`` (and ``debug=fdr``) score a few batches of the test split: the closing
    ``test accuracy`` line and metrics.json say how many images of how many; a full test says nothing more."""
    over = [*TINY_VIT, *FAST, *SHORT, f"trainer.limit_test_batches={'null' if limit is None else limit}"]
    train(compose(tmp_path, over))
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("test accuracy "))
    saved = json.loads((tmp_path / "metrics.json").read_text())
    if limit is None:
        assert (saved["test_images"], saved["test_split_images"]) == (2000, 2000)
        assert line.endswith(")") and " of the " not in line
    else:  # FAST: batches of 16
        assert (saved["test_images"], saved["test_split_images"]) == (16, 2000)
        assert line.endswith(" on 16 of the 2000 test images, 9 of the 10 classes (trainer.limit_test_batches)"), line


def test_progress_lines_count_epochs_from_one_and_cover_validation_and_test(tmp_path, capsys):
    """Not on a terminal (logs, SLURM): the step lines count epochs from 1 as the epoch lines do (``epoch 1 step 1/2``
    then ``epoch 1/1 ...``, not ``epoch 0 step 1/2``), and validation and test (``eval.py``'s whole run) print their
    progress too."""
    over = [*TINY_VIT, *FAST, *SHORT, "trainer.limit_val_batches=2", "trainer.limit_test_batches=2"]
    train(compose(tmp_path, [*over, "progress_bar=lines", "trainer.log_every_n_steps=1"]))
    lines = [x.split("  (")[0] for x in capsys.readouterr().out.splitlines()]
    assert [x for x in lines if " step " in x][0].startswith("epoch 1 step 1/2  ")
    assert not any(x.startswith("epoch 0") for x in lines)
    assert len([x for x in lines if x.startswith("epoch 1/1 ")]) == 1  # the epoch's line (step lines have no total)
    assert {"val batch 1/2", "val batch 2/2", "test batch 1/2", "test batch 2/2"} <= set(lines)


def test_progress_bar_false_turns_the_progress_off_as_lightning_enable_progress_bar(tmp_path, capsys):
    """``progress_bar=false`` (Lightning's ``enable_progress_bar=False`` spelling) is ``progress_bar=none``, not a
    ValueError about the spelling after the data was read."""
    train(compose(tmp_path, [*TINY_VIT, *FAST, *SHORT, "progress_bar=false", "trainer.log_every_n_steps=1"]))
    assert " step " not in capsys.readouterr().out


def test_eval_scores_a_run_at_the_size_it_was_trained_at(tmp_path):
    """``python train.py ... data.img_size=32`` then ``python eval.py ckpt_path=<its last.ckpt>``: eval.py scores the
    model at 32 px, the size it was trained at (as timm's validate.py), and gives train.py's test accuracy; not at
    the data config's native 28 px."""
    from vitrel.train.evaluate import evaluate

    run = tmp_path / "run"
    over = [*TINY_VIT, *FAST, *SHORT, "data.img_size=32", "trainer.limit_test_batches=null", "data.eval_batch_size=500"]
    trained = train(compose(run, over))
    out = tmp_path / "eval"
    ckpt = run / "checkpoints" / "last.ckpt"
    metrics = evaluate(compose(out, [f"ckpt_path={ckpt}", *FAST[:1], *FAST[2:4]], config_name="eval"))
    res = json.loads((out / "eval_metrics.json").read_text())
    assert (res["img_size"], res["img_size_from"], res["grid"], res["num_images"]) == (32, "checkpoint", [8, 8], 2000)
    assert abs(metrics["test/acc1"] - trained["test/acc1"]) <= 1 / 2000
    # data.img_size given: that size
    evaluate(compose(tmp_path / "eval28", [f"ckpt_path={ckpt}", "data.img_size=28", *FAST[:1], *FAST[2:4]], "eval"))
    res = json.loads((tmp_path / "eval28" / "eval_metrics.json").read_text())
    assert (res["grid"], res["img_size_from"]) == ([7, 7], "data")


def test_eval_names_the_file_it_wrote(rope_run, tmp_path, capsys):
    """``python eval.py`` ends with the path of its ``eval_metrics.json``, as ``predict.py`` names its CSV and
    ``train.py`` its run folder: a newcomer learns where the scores went without the docs."""
    from vitrel.train.evaluate import evaluate

    out = tmp_path / "eval"
    ckpt = rope_run / "checkpoints" / "last.ckpt"
    evaluate(compose(out, [f"ckpt_path={ckpt}", *FAST[:1], *FAST[2:4], "trainer.limit_test_batches=1"], "eval"))
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == f"wrote {out.resolve() / 'eval_metrics.json'}", last
    assert (out / "eval_metrics.json").is_file()


def test_eval_split_val_where_val_is_the_test_split_says_so(tmp_path, capsys):
    """``train.py data.val_fraction=0`` validates on the test split; ``eval.py split=val`` of that run scored the test
    split as ``val/acc1`` and said ``fashion_mnist val (... of its 2000 images)``: a "validation" score that was the
    test score. The line and ``eval_metrics.json`` now say the val split scored is the test split."""
    from vitrel.train.evaluate import evaluate

    run = tmp_path / "run"
    train(compose(run, [*TINY_VIT, *FAST, *SHORT, "data.val_fraction=0"]))
    out = tmp_path / "eval"
    over = [f"ckpt_path={run}", *FAST[:1], *FAST[2:4], "trainer.limit_test_batches=1", "split=val"]
    evaluate(compose(out, over, "eval"))
    line = capsys.readouterr().out.strip().splitlines()[-2]
    assert " on fashion_mnist val (the test split: the run's data.val_fraction=0; 64 of its 2000 images" in line, line
    assert json.loads((out / "eval_metrics.json").read_text())["val_is_test"] is True
    evaluate(compose(tmp_path / "eval2", [*over[:-1], "split=test"], "eval"))  # (a test split is just that)
    assert "val_fraction" not in capsys.readouterr().out.strip().splitlines()[-2]
    assert json.loads((tmp_path / "eval2" / "eval_metrics.json").read_text())["val_is_test"] is False


def _class_folders(root, classes=3, per_class=4):
    """An ImageNet-layout tree (``train/<wnid>/``, ``val/<wnid>/``) of small random RGB JPEGs."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c in range(classes):
            d = root / split / f"n{c:08d}"
            d.mkdir(parents=True)
            for i in range(per_class):
                Image.fromarray(rng.integers(0, 255, (36, 36, 3), dtype=np.uint8)).save(d / f"{i}.JPEG")
    return root


def test_eval_on_other_data_names_the_data_the_run_trained_on(tmp_path):
    """``python eval.py ckpt_path=<a run on ImageNet-layout folders>`` reads Fashion-MNIST unless told: refused before
    the weights are read, with the run's own ``data=imagenet data.root=...`` (from the folder ``train.py`` wrote),
    which then works as given."""
    from tests.train_helpers import run_script_forked
    from vitrel.train.evaluate import evaluate

    tree = _class_folders(tmp_path / "tree")
    run = tmp_path / "run"
    args = ["data=imagenet", f"data.root={tree}", "data.img_size=32", "data.batch_size=4", *TINY_VIT, *FAST[:1]]
    args += [*FAST[2:], *SHORT, f"hydra.run.dir={run}"]
    r = run_script_forked("train.py", args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    ckpt = run / "checkpoints" / "last.ckpt"
    with pytest.raises(ValueError) as refused:  # (eval.py's evaluate(), in-process)
        evaluate(compose(tmp_path / "eval", [f"ckpt_path={ckpt}"], config_name="eval"))
    assert "was trained on data=imagenet, but eval.py scores data=fashion_mnist unless told" in str(refused.value)
    with pytest.raises(ValueError) as refused:  # (data= given: its classes)
        evaluate(compose(tmp_path / "eval", [f"ckpt_path={ckpt}", "data=fashion_mnist"], config_name="eval"))
    assert "classifies 3 classes but FashionMNISTDataModule has 10 (data=fashion_mnist)" in str(refused.value)
    hint = re.search(r"trained on, (data=imagenet data\.root=\S+) \(its run's ", str(refused.value))
    assert hint is not None, str(refused.value)
    assert hint.group(1) == f"data=imagenet data.root={tree}"
    ev = tmp_path / "eval2"
    evaluate(compose(ev, [f"ckpt_path={ckpt}", *hint.group(1).split(), "data.num_workers=0"], config_name="eval"))
    assert json.loads((ev / "eval_metrics.json").read_text())["num_images"] == 12


def test_cifar_errors_name_the_command_line_keys_that_fix_them(tmp_path):
    """``python train.py data=cifar10 data.root=...`` on a converted copy (not the official md5s), or on a folder
    without the files: the errors name ``data.verify=false`` / ``data.download=true``, and the first then runs."""
    from tests.data.test_datamodules import make_cifar_files
    from vitrel.data.datasets import DatasetIntegrityError, DatasetNotFoundError

    make_cifar_files(tmp_path / "cifar", 10, n_per_batch=8)
    args = ["data=cifar10", *TINY_VIT, *FAST[:1], *FAST[2:], *SHORT, "test=false"]
    with pytest.raises(DatasetIntegrityError, match=r"\(train.py and eval.py: data.verify=false\)"):
        train(compose(tmp_path / "a", [*args, f"data.root={tmp_path / 'cifar'}"]))
    assert train(compose(tmp_path / "b", [*args, f"data.root={tmp_path / 'cifar'}", "data.verify=false"]))
    with pytest.raises(DatasetNotFoundError, match=r"download=True \(train.py: data.download=true\)"):
        train(compose(tmp_path / "c", [*args, f"data.root={tmp_path / 'none'}", "data.download=false"]))


def _message_lines(stderr: str) -> list[str]:
    """stderr without the log's timestamped lines and Python warnings."""
    return [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith("[") and "Warning" not in ln]


def test_a_damaged_checkpoint_is_one_line_on_train_py_and_eval_py(tmp_path):
    """A truncated ``last.ckpt`` (resumed by ``resume=auto``) and a damaged ``eval.py ckpt_path=``: the message alone,
    ``<script>: CheckpointError: ...`` and exit code 1, as predict.py prints it; no traceback."""
    from tests.train_helpers import run_script_forked

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"PK\x03\x04 cut short")
    r = run_script_forked("train.py", [*TINY_VIT, *FAST[:1], *FAST[2:], *SHORT, f"hydra.run.dir={run}"], tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = _message_lines(r.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"train.py: CheckpointError: cannot read {run}"), r.stderr
    args = [f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}", f"hydra.run.dir={tmp_path / 'eval'}"]
    r = run_script_forked("eval.py", args, tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = _message_lines(r.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"eval.py: CheckpointError: cannot read {run}"), r.stderr


def test_eval_of_a_missing_checkpoint_is_a_checkpoint_error(tmp_path):
    """``eval.py ckpt_path=<a path that is not there>``: a CheckpointError (one line from eval.py, as above), before
    any data is read."""
    from vitrel.models.checkpoint import CheckpointError
    from vitrel.train.evaluate import evaluate

    cfg = compose(tmp_path, [f"ckpt_path={tmp_path / 'nowhere.ckpt'}", "data.root=/nonexistent"], config_name="eval")
    with pytest.raises(CheckpointError, match="nowhere.ckpt: no such file or folder"):
        evaluate(cfg)


def test_one_line_errors_leave_a_sweep_job_failing_as_hydra_jobs_fail(tmp_path):
    """Under ``-m`` the error is raised (the job fails, the sweep goes on), not turned into an exit of the process."""
    from vitrel.models.checkpoint import CheckpointError
    from vitrel.train.user_errors import one_line_errors

    compose(tmp_path, [*TINY_VIT], multirun=True)
    with pytest.raises(CheckpointError, match="bad file"), one_line_errors("train.py"):
        raise CheckpointError("bad file")
    compose(tmp_path, [*TINY_VIT])
    with pytest.raises(SystemExit, match="train.py: CheckpointError: bad file"), one_line_errors("train.py"):
        raise CheckpointError("bad file")


def test_a_video_scheme_on_an_image_model_warns_once_naming_the_image_scheme(tmp_path, caplog):
    """``python train.py pos=rel3d_factored`` (an image model) ran as one frame without a word: one warning, when the
    model is built (not at every forward), naming ``pos=rel2d_factored``; its checkpoint reloads with one warning."""
    import vitrel

    caplog.set_level("WARNING", logger="vitrel.models.backbone")
    train(compose(tmp_path, [*TINY_VIT, *FAST, *SHORT, "pos=rel3d_factored"]))
    said = [r.getMessage() for r in caplog.records if r.name == "vitrel.models.backbone"]
    assert len(said) == 1, said
    assert said[0].startswith("pos=rel3d_factored is a video scheme (grids T x H x W): VisionTransformer takes images")
    assert "runs as one frame (T = 1)" in said[0] and "For images use pos=rel2d_factored;" in said[0]
    caplog.clear()
    vitrel.load_model(tmp_path / "checkpoints" / "last.ckpt")
    assert len([r for r in caplog.records if r.name == "vitrel.models.backbone"]) == 1


def test_a_vit_that_pads_to_whole_patches_trains_and_evaluates_at_any_size(tmp_path):
    """``+model.dynamic_img_pad=true data.img_size=30`` (patches of 4: timm's ViT pads the images to 32): train.py and
    eval.py refused the size before the model was built (the patch check knew no padding). The run trains on the
    padded 8 x 8 grid, eval.py scores its checkpoint as its own test did, and the model reloads padding."""
    from vitrel.train.evaluate import evaluate

    run = tmp_path / "run"
    over = [*TINY_VIT, *FAST, *SHORT, "+model.dynamic_img_pad=true", "data.img_size=30", "data.size_choices=[26,30]"]
    trained = train(compose(run, [*over, "trainer.limit_test_batches=null", "data.eval_batch_size=500"]))
    ckpt = run / "checkpoints" / "last.ckpt"
    assert vitrel.load_model(ckpt).patch_embed.dynamic_img_pad
    metrics = evaluate(compose(tmp_path / "eval", [f"ckpt_path={ckpt}", *FAST[:1], *FAST[2:4]], config_name="eval"))
    res = json.loads((tmp_path / "eval" / "eval_metrics.json").read_text())
    assert (res["img_size"], res["grid"]) == (30, [8, 8])
    assert abs(metrics["test/acc1"] - trained["test/acc1"]) <= 1 / 2000


@pytest.mark.parametrize(
    "model, says",
    [
        (
            ["model=vitrel_vit_small_patch16_224"],
            "28x28 (data.img_size), are not a whole number of the 16x16 patches of vitrel_vit_small_patch16_224: set "
            "data.img_size=224 (the size vitrel_vit_small_patch16_224 is made for), or the nearest larger multiple of "
            "16, data.img_size=32 (the images are resized to it); or keep the size and pad the images to whole patches "
            "with +model.dynamic_img_pad=true (timm's)",
        ),
        (
            ["model=vitrel_swin_tiny_patch4_window7_224", "data.img_size=30"],
            "30x30 (data.img_size), are not a whole number of the 4x4 patches of vitrel_swin_tiny_patch4_window7_224: "
            "set data.img_size=224 (the size vitrel_swin_tiny_patch4_window7_224 is made for), or the nearest larger "
            "multiple of 4, data.img_size=32",
        ),
    ],
    ids=["vit_small_patch16_224", "swin_tiny_patch4_at_30"],
)
def test_data_the_model_cannot_cut_into_patches_is_one_line_saying_what_to_set(tmp_path, model, says):
    """``python train.py model=vitrel_vit_small_patch16_224`` on the default Fashion-MNIST (28 px, patches of 16)
    failed inside Hydra's instantiation without advice: one line from train.py naming ``data.img_size`` (the
    architecture's size, or the nearest multiple of the patch), before anything is built or written; the nearest
    multiple then runs. (A Swin with patches of 4 takes 28 px as it is.)"""
    from vitrel.train.user_errors import one_line_errors

    run = tmp_path / "run"
    with pytest.raises(SystemExit) as said, one_line_errors("train.py"):
        train(compose(run, [*model, *FAST, *SHORT]))
    assert str(said.value).startswith("train.py: InputSizeError: FashionMNISTDataModule's images, "), said.value
    assert says in str(said.value)
    assert ("dynamic_img_pad" in str(said.value)) == ("swin" not in model[0])  # (timm's Swin does not pad)
    assert not (run / "checkpoints").exists() and not (run / "metrics.json").exists()
    if model[0] == "model=vitrel_vit_small_patch16_224":  # the advice runs (one block: the size is what is tested)
        advice = re.search(r"nearest larger multiple of 16, (data\.img_size=\d+)", str(said.value)).group(1)
        train(compose(tmp_path / "ok", [*model, "+model.depth=1", advice, *FAST, *SHORT]))
        assert json.loads((tmp_path / "ok" / "metrics.json").read_text())["status"] == "finished"


@pytest.mark.parametrize("chans", [3, 2])
def test_a_model_in_chans_the_data_does_not_give_is_one_line_naming_the_keys(tmp_path, chans):
    """``+model.in_chans=3`` on grey Fashion-MNIST ended at the first step in the patch embedding's "expected images
    [B, 3, H, W], got (64, 1, 28, 28)" under a traceback: now one line before anything is written, naming
    ``data.in_chans=3`` where the data repeats its channel; that advice trains."""
    from vitrel.train.user_errors import one_line_errors

    run = tmp_path / "run"
    with pytest.raises(SystemExit) as said, one_line_errors("train.py"):
        train(compose(run, [f"+model.in_chans={chans}", *FAST, *SHORT]))
    data = "data.in_chans=3 or " if chans == 3 else ""
    assert str(said.value) == (
        f"train.py: InputSizeError: model.in_chans={chans} but FashionMNISTDataModule gives 1-channel images: set "
        f"{data}leave model.in_chans unset (the data sets it)"
    )
    assert not (run / "checkpoints").exists()
    if chans == 3:
        train(compose(tmp_path / "ok", ["+model.in_chans=3", "data.in_chans=3", *FAST, *SHORT]))
        assert json.loads((tmp_path / "ok" / "metrics.json").read_text())["status"] == "finished"


def test_eval_and_from_checkpoint_at_a_size_that_is_not_whole_patches_say_what_to_set(rope_run, tmp_path):
    """``eval.py ckpt_path=<run at 28 px, patches of 4> data.img_size=30`` was a CheckpointError ("cannot rebuild ...")
    blaming the file: now one line naming the size it was trained at (eval.py's default) and the nearest multiple;
    ``model=from_checkpoint`` at 30 px in train.py says the same, before any work."""
    from vitrel.train.evaluate import evaluate
    from vitrel.train.user_errors import one_line_errors

    ckpt = rope_run / "checkpoints" / "last.ckpt"
    with pytest.raises(SystemExit) as said, one_line_errors("eval.py"):
        evaluate(compose(tmp_path / "eval", [f"ckpt_path={ckpt}", "data.img_size=30", *FAST[:1]], config_name="eval"))
    assert str(said.value) == (
        f"eval.py: InputSizeError: FashionMNISTDataModule's images, 30x30 (data.img_size), are not a whole number of "
        f"the 4x4 patches of {ckpt} (vitrel_vit_tiny_patch4_32): set data.img_size=28 (the size it was trained at, "
        "what eval.py takes without data.img_size), or the nearest larger multiple of 4, data.img_size=32 (the images "
        "are resized to it)"
    )
    run = tmp_path / "run"
    with pytest.raises(SystemExit, match=r"set data.img_size=28 \(the size vitrel_vit_tiny_patch4_32 was trained at\)"):
        with one_line_errors("train.py"):
            train(compose(run, ["model=from_checkpoint", f"model.path={ckpt}", "data.img_size=30", *FAST, *SHORT]))
    assert not (run / "checkpoints").exists()


def test_a_part_of_a_split_sorted_by_class_says_which_classes_it_holds(tmp_path, capsys):
    """An ImageFolder's test split is sorted by class: ``trainer.limit_test_batches=1`` scores the first class only.
    Lightning's convention (the first batches) is kept, and the predictions keep the split's order; the closing lines
    of train.py and eval.py say how many classes the part holds when that is fewer than the model's, and a warning
    after the first validation says it of ``limit_val_batches`` (val/* and the best checkpoint)."""
    from vitrel.train.evaluate import evaluate

    tree = _class_folders(tmp_path / "tree")
    data = ["data=imagenet", f"data.root={tree}", "data.img_size=32", "data.batch_size=4", "data.num_workers=0"]
    run = tmp_path / "run"
    says = r"validation scored 1 of the 3 classes \(trainer.limit_val_batches=1 of a split sorted by class"
    with pytest.warns(UserWarning, match=says):
        train(compose(run, [*TINY_VIT, *FAST, *SHORT, *data]))  # (data.batch_size=4 after FAST's 16)
    lines = capsys.readouterr().out.splitlines()
    line = next(x for x in lines if x.startswith("test accuracy "))
    assert line.endswith(" on 4 of the 12 test images, 1 of the 3 classes (trainer.limit_test_batches)"), line
    ckpt = run / "checkpoints" / "last.ckpt"
    for limit, says in [("1", "(4 of its 12 images, 1 of the 3 classes: trainer.limit_test_batches)"),
                        ("null", "(12 images)")]:  # fmt: skip
        over = [f"ckpt_path={ckpt}", *data, f"trainer.limit_test_batches={limit}", "progress_bar=none"]
        evaluate(compose(tmp_path / f"eval{limit}", over, config_name="eval"))
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("last.ckpt on imagenet test "))
        assert says in line, line


def test_one_val_batch_of_a_seeded_sample_is_not_warned_of(tmp_path, recwarn):
    """Fashion-MNIST's val split is a seeded sample of train: one batch of 4 holds some of the 10 classes by chance,
    not the first ones, and nothing is said."""
    train(compose(tmp_path, [*TINY_VIT, *FAST, *SHORT, "data.batch_size=4"]))
    assert not [w for w in recwarn if "validation scored" in str(w.message)]


def test_timm_weights_without_a_network_are_one_line_whose_advice_trains(tmp_path, monkeypatch):
    """``model.init_from=timm:<name>`` on a machine without a network (compute nodes often have none) ended in the
    Hub's ``LocalEntryNotFoundError`` wrapped by Hydra, after its retries: one line from train.py naming
    ``model.init_file``, before any work; a file of the weights given that way trains."""
    import huggingface_hub.constants
    import timm
    from safetensors.torch import save_file

    from vitrel.train.user_errors import one_line_errors

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # (as HF_HUB_OFFLINE=1: no retries)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf"))  # an empty cache
    name = "vit_tiny_patch16_224.augreg_in21k"
    base = [f"model.init_from=timm:{name}", "pos=rel2d_factored", "data.img_size=32", *FAST, *SHORT]
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as said, one_line_errors("train.py"):
        train(compose(run, base))
    assert str(said.value).startswith(
        f"train.py: CheckpointError: cannot fetch timm's pretrained weights of {name} (LocalEntryNotFoundError: "
    ), said.value
    assert "Without a network, give them as a file: model.init_file=<file or folder> (train.py)" in str(said.value)
    assert not (run / "checkpoints").exists()
    weights = tmp_path / "model.safetensors"  # what the advice asks for (here timm's init, not its trained weights)
    save_file(timm.create_model(name, pretrained=False).state_dict(), str(weights))
    train(compose(tmp_path / "ok", [*base, f"model.init_file={weights}"]))
    assert json.loads((tmp_path / "ok" / "metrics.json").read_text())["status"] == "finished"


@pytest.mark.parametrize(
    "over, given",
    [
        (["experiment=fmnist_naflex", "pos=rel3d_full"], "data.packing=pack (NaFlex batches)"),
        ([*TINY_VIT, "pos=rope3d_mixed", "model.token_drop=0.25"], "model.token_drop=0.25"),
    ],
)
def test_a_video_scheme_fed_token_layouts_is_refused_before_any_batch(tmp_path, over, given):
    """A video scheme on an image model runs as one frame, but not on token layouts: NaFlex batches or token dropping
    failed at the first forward, a traceback through Lightning's sanity check. One ConfigError naming the image form."""
    from vitrel.config import ConfigError

    cfg = compose(tmp_path, [*over, "model.embed_dim=32", "model.depth=1", "model.num_heads=2", *FAST, *SHORT])
    name = cfg.pos.name
    with pytest.raises(ConfigError) as err:
        train(cfg)
    image = name.replace("3d", "2d")
    assert str(err.value) == (
        f"pos={name} takes full video grids (T, H, W), and {given} gives the attention packed or token-dropped images, "
        f"which video schemes do not take: use pos={image}, the same scheme on images"
    )
    assert not (tmp_path / "checkpoints").exists()


def test_mixup_with_naflex_batches_is_refused_before_any_batch(tmp_path):
    """timm's Mixup mixes equal-size image tensors: with ``data.packing`` the module refused it at the first training
    step, a traceback through Lightning; now one ConfigError before the run trains, naming the override that fixes it.
    """
    from vitrel.config import ConfigError

    over = ["experiment=fmnist_naflex", "module/mixup=default", "model.embed_dim=32", "model.depth=1"]
    cfg = compose(tmp_path, [*over, "model.num_heads=2", *FAST, *SHORT])
    with pytest.raises(ConfigError, match=r"^module/mixup=default \(timm Mixup\) .*module/mixup=naflex .*=null$"):
        train(cfg)
    assert not (tmp_path / "checkpoints").exists()


def test_eval_of_a_video_scheme_on_naflex_batches_is_refused(tmp_path):
    """A model trained on images with a video scheme (one frame) scored on NaFlex data: the same refusal from eval.py;
    on plain images it scores (its stored token_drop is the training's)."""
    from vitrel.config import ConfigError
    from vitrel.train.evaluate import evaluate

    run = tmp_path / "run"
    train(compose(run, [*TINY_VIT, *FAST, *SHORT, "pos=rel3d_factored", "test=false"]))
    ev = [f"ckpt_path={run}", *FAST[:1], *FAST[2:4], "trainer.limit_test_batches=1"]
    with pytest.raises(ConfigError, match=r"^pos=rel3d_factored takes full video grids .*data\.packing=pack"):
        evaluate(compose(tmp_path / "naflex", [*ev, "data=fashion_mnist_naflex"], config_name="eval"))
    assert evaluate(compose(tmp_path / "images", ev, config_name="eval"))["test/acc1"] >= 0
