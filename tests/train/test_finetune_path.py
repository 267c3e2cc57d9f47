"""Fine-tuning timm weights with ``train.py model.init_from=timm:<name> model.init_file=<file>``, checked for silent
wrong answers: the images are normalised as the pretrained weights expect (their ``pretrained_cfg``, not the data
set's statistics), the checkpoints, ``eval.py`` and ``model=from_checkpoint`` keep that, and a resume is built from
the checkpoint, not from the pretrained file (which may have moved), and refused with other pretrained weights."""

from __future__ import annotations

import hashlib
import json
import logging

import pytest
import torch
from omegaconf import OmegaConf

from tests.data.test_datamodules import make_cifar_files
from tests.train_helpers import FAST, compose, run_script_forked
from vitrel.config import ConfigError
from vitrel.models.checkpoint import CheckpointError
from vitrel.models.data_config import stored_data_config
from vitrel.train.evaluate import evaluate
from vitrel.train.run import train

SHORT = ["trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "trainer.limit_test_batches=1"]
SHORT += ["logger=none", "test=false"]
TIMM = "vit_tiny_patch16_224"  # pretrained_cfg: mean = std = 0.5, bicubic, crop_pct 0.9 (CIFAR-10's: bilinear, 1.0)
HALF = [0.5, 0.5, 0.5]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Fake CIFAR-10 in its on-disk format and a small timm ViT's weights as safetensors: the overrides of a run."""
    import timm
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("finetune")
    make_cifar_files(root / "cifar", 10, n_per_batch=8)
    weights = root / "vit.safetensors"
    save_file(timm.create_model(TIMM, img_size=32, patch_size=4, depth=2).state_dict(), str(weights))
    data = ["data=cifar10", f"data.root={root / 'cifar'}", "data.verify=false", "data.val_fraction=0.0"]
    model = [f"model.init_from=timm:{TIMM}", f"model.init_file={weights}", "pos=rel2d_factored"]
    model += ["+model.timm_kwargs={img_size: 32, patch_size: 4, depth: 2}"]
    return root, weights, [*data, *model, *FAST, *SHORT]


def _run(run, args, caplog):
    """``train.py args`` in ``run`` with its ``.hydra/config.yaml`` record (as Hydra writes it; eval.py reads it)."""
    cfg = compose(run, args)
    (run / ".hydra").mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, run / ".hydra" / "config.yaml")
    with caplog.at_level(logging.INFO):
        train(cfg)
    return run / "checkpoints" / "last.ckpt"


def test_a_finetune_normalises_as_the_pretrained_weights_and_eval_scores_so(sources, tmp_path, caplog):
    """Without ``data.mean`` / ``data.std`` / ``data.interpolation`` / ``data.crop_pct`` the run takes the pretrained
    weights' (timm's convention) and says so with the data set's own; the checkpoint stores them and eval.py
    preprocesses with them though the run record says null; a value given wins."""
    _, _, args = sources
    ckpt = _run(tmp_path / "run", [*args, "trainer.max_epochs=1"], caplog)
    said = [r.getMessage() for r in caplog.records if "data.mean=" in r.getMessage()]
    assert len(said) == 1 and "data.std=[0.5,0.5,0.5] data.interpolation=bicubic data.crop_pct=0.9:" in said[0], said
    assert "CIFARDataModule's own: mean [0.4914,0.4822,0.4465]" in said[0] and "bilinear, crop_pct 1 " in said[0]
    stored = stored_data_config(ckpt)
    assert stored["mean"] == HALF and stored["std"] == HALF and stored["interpolation"] == "bicubic", stored
    assert stored["crop_pct"] == 0.9, stored  # the evaluation crop of timm's resolve_data_config(model=model)

    ev = tmp_path / "eval"
    caplog.clear()
    with caplog.at_level(logging.INFO):
        evaluate(compose(ev, [f"ckpt_path={ckpt}", *args[:4]], config_name="eval"))
    taken = json.loads((ev / "eval_metrics.json").read_text())["data_from_run"]
    assert taken["mean"] == HALF and taken["std"] == HALF and taken["interpolation"] == "bicubic", taken
    assert taken["crop_pct"] == 0.9, taken
    said = [r.getMessage() for r in caplog.records if "data.mean=" in r.getMessage()]  # train.py's line, in its form
    assert len(said) == 1 and "data.interpolation=bicubic data.crop_pct=0.9: those last.ckpt was" in said[0]
    assert "CIFARDataModule's own: mean [0.4914,0.4822,0.4465]" in said[0], said
    # the files' class names (class_0, ...), as the run stored them: no warning that they differ (it compared them
    # with CIFAR's official names, which the module holds until setup reads batches.meta: an audit's)
    assert "scored against others" not in caplog.text, caplog.text

    given = ["data.mean=[0.4,0.4,0.4]", "data.crop_pct=1.0"]
    stored = stored_data_config(_run(tmp_path / "given", [*args, "trainer.max_epochs=1", *given], caplog))
    assert stored["mean"] == pytest.approx([0.4] * 3) and stored["std"] == HALF and stored["crop_pct"] == 1.0, stored


def test_from_checkpoint_of_a_finetune_keeps_its_normalisation(sources, tmp_path, caplog):
    """``model=from_checkpoint`` of a fine-tuned run normalises as that run did (its stored data config), not with
    the data set's statistics."""
    _, _, args = sources
    ckpt = _run(tmp_path / "run", [*args, "trainer.max_epochs=1"], caplog)
    again = [*args[:4], "model=from_checkpoint", f"model.path={ckpt}", *FAST, *SHORT, "trainer.max_epochs=1"]
    stored = stored_data_config(_run(tmp_path / "again", again, caplog))
    assert stored["mean"] == HALF and stored["interpolation"] == "bicubic", stored


def test_a_resumed_finetune_is_built_from_its_checkpoint_not_from_init_file(sources, tmp_path, caplog):
    """A resume of a fine-tune re-read ``model.init_file`` before the checkpoint's weights replaced it: with the file
    moved it failed (``CheckpointError: no such file or folder``). It is built from the checkpoint's stored
    configuration, said in one line, keeps the run's normalisation, and a changed model setting is still refused."""
    root, weights, args = sources
    run = tmp_path / "run"
    moved = root / "moved.safetensors"
    _run(run, [*args, "trainer.max_epochs=1"], caplog)
    weights.rename(moved)
    try:
        caplog.clear()
        ckpt = _run(run, [*args, "trainer.max_epochs=2"], caplog)
    finally:
        moved.rename(weights)
    said = [r.getMessage() for r in caplog.records if "is built from the configuration stored in it" in r.getMessage()]
    assert len(said) == 1 and f"model.init_file={weights}) are not read" in said[0], said
    assert torch.load(ckpt, map_location="cpu", weights_only=True)["epoch"] == 1  # (the second epoch ran)
    assert stored_data_config(ckpt)["mean"] == HALF
    with pytest.raises(CheckpointError, match="holds another model than the one configured"):
        _run(run, [*args, "trainer.max_epochs=3", "pos=rope2d_axial"], caplog)


def test_a_resume_from_other_pretrained_weights_is_refused_naming_both(sources, tmp_path, caplog):
    """The checkpoints record the weights the run started from (``model.init_from`` / ``model.init_file``); a resume
    configured with others (another tag of the architecture, another file) would go on training the checkpoint's
    run under their name: ``train.py`` refuses it in one line naming both, before the loggers open, and the run's
    own weights still resume. A checkpoint that records none (vitrel 0.1's) is not checked."""
    root, weights, args = sources
    run = tmp_path / "run"
    ckpt = _run(run, [*args, "trainer.max_epochs=1"], caplog)
    recorded = torch.load(ckpt, map_location="cpu", weights_only=True)["hyper_parameters"]["started_from"]
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    expected = {"model.init_from": f"timm:{TIMM}", "model.init_file": str(weights), "model.init_file sha256": digest}
    assert recorded == expected, recorded

    tagged = [a.replace(f"timm:{TIMM}", f"timm:{TIMM}.augreg_in21k") for a in args]
    proc = run_script_forked("train.py", [*tagged, "trainer.max_epochs=2", f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    last = (proc.stdout + proc.stderr).strip().splitlines()[-1]
    assert last.startswith(f"train.py: ConfigError: {ckpt} was trained from other weights than the configured"), last
    assert f"(model.init_from: checkpoint timm:{TIMM}, configured timm:{TIMM}.augreg_in21k)" in last, last
    assert f"Resume with the weights it started from (model.init_from=timm:{TIMM} model.init_file={weights};" in last

    other = root / "other.safetensors"
    other.write_bytes(weights.read_bytes() + b" ")  # (other bytes: not read, the refusal comes first)
    with pytest.raises(ConfigError, match=f"model.init_file: checkpoint {weights}, configured {other}"):
        _run(run, [*[a.replace(str(weights), str(other)) for a in args], "trainer.max_epochs=2"], caplog)
    assert torch.load(_run(run, [*args, "trainer.max_epochs=2"], caplog), weights_only=True)["epoch"] == 1

    moved = root / "moved" / "weights.safetensors"  # the same file at another path: known by its content
    moved.parent.mkdir()
    moved.write_bytes(weights.read_bytes())
    at_moved = [a.replace(str(weights), str(moved)) for a in args]
    assert torch.load(_run(run, [*at_moved, "trainer.max_epochs=3"], caplog), weights_only=True)["epoch"] == 2
    gone = [a.replace(str(weights), str(root / "gone.safetensors")) for a in args]
    with pytest.warns(UserWarning, match=f"model.init_file={moved}; the configured .* is not there to compare"):
        assert torch.load(_run(run, [*gone, "trainer.max_epochs=4"], caplog), weights_only=True)["epoch"] == 3


def test_a_checkpoint_that_records_no_pretrained_weights_is_not_checked():
    from tests.train.test_compat_train import CKPT
    from vitrel.train.resume import check_same_start

    old = torch.load(CKPT, map_location="cpu", weights_only=True)  # (vitrel 0.1.0's: no started_from)
    check_same_start(old, {"model.init_from": f"timm:{TIMM}"}, CKPT)
    with pytest.raises(ConfigError, match=r"\(model.init_from: checkpoint \(none\), configured timm:.*from scratch"):
        check_same_start({"hyper_parameters": {"started_from": {}}}, {"model.init_from": f"timm:{TIMM}"}, "x.ckpt")


def test_a_timm_folder_normalises_as_its_config_json_says_not_as_the_names_default_tag(sources, tmp_path, caplog):
    """``model.init_file=<timm export folder>`` of DINO weights (``vit_small_patch16_224.dino``: ImageNet's mean and
    std) given as ``timm:vit_small_patch16_224``, whose default tag (``augreg``) normalises with 0.5: the run took
    0.5 and logged it as "the pretrained weights'" (an audit's). The folder's ``config.json`` says what its weights
    expect, as timm's ``local-dir:`` reads it; the run, its checkpoint and ``from_timm`` take that."""
    import timm
    from timm.models import save_for_hf

    import vitrel

    args, folder = sources[2], tmp_path / "dino"
    small = dict(img_size=32, patch_size=4, depth=2, embed_dim=48, num_heads=2)
    save_for_hf(timm.create_model("vit_small_patch16_224.dino", **small), str(folder), model_args=small)
    imagenet = [0.485, 0.456, 0.406]
    assert json.loads((folder / "config.json").read_text())["pretrained_cfg"]["mean"] == imagenet
    assert list(vitrel.from_timm("vit_small_patch16_224", checkpoint_path=folder).pretrained_cfg["mean"]) == imagenet
    model = ["model.init_from=timm:vit_small_patch16_224", f"model.init_file={folder}", "pos=rel2d_factored"]
    ckpt = _run(tmp_path / "run", [*args[:4], *model, *FAST, *SHORT, "trainer.max_epochs=1"], caplog)
    said = [r.getMessage() for r in caplog.records if "data.mean=" in r.getMessage()]
    assert len(said) == 1 and "data.mean=[0.485,0.456,0.406] data.std=[0.229,0.224,0.225]" in said[0], said
    assert stored_data_config(ckpt)["mean"] == pytest.approx(imagenet)
