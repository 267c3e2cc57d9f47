"""Typed configs (vitrel/config.py): every config in conf/ composes with its schema, a value of the wrong
type is refused at composition naming the key, and the keys that moved since vitrel 0.1 fail with the
new key's name (issue 20, items 6 and 8)."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

import vitrel.config as schema
from vitrel.config import check_moved_keys

CONF = Path(__file__).resolve().parents[2] / "conf"


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def _compose(overrides: list[str], config_name: str = "train"):
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose(config_name, overrides=overrides)


# each experiment and debug recipe; every option of the typed groups (and of model and logger), several
# groups per composition (the longest group sets the count); the other two entry points below
_GROUPS = {g: _options(g) for g in ("data", "trainer", "model", "logger")}
_N = max(len(v) for v in _GROUPS.values())
_DEBUG = _options("debug")
COMPOSITIONS = (
    [[f"experiment={e}", f"debug={_DEBUG[i % len(_DEBUG)]}"] for i, e in enumerate(_options("experiment"))]
    + [[f"{g}={opts[i % len(opts)]}" for g, opts in _GROUPS.items()] for i in range(_N)]
    + [["module/mixup=default", "module/ema=default", "logger=[wandb,csv,tensorboard]", "module.scheduler=null",
        "trainer.precision=32", "trainer.devices=[0,1]", "trainer.limit_train_batches=10", "trainer.max_time=00:01:00"]]
)  # fmt: skip


@pytest.mark.parametrize("overrides", COMPOSITIONS, ids=lambda o: " ".join(o))
def test_every_config_composes(overrides):
    """... with its schema, a data node holds only arguments its DataModule takes, and ``train()``'s key checks pass
    (no top-level key nothing reads, no moved or lightning-hydra-template key)."""
    from hydra.utils import get_class

    from vitrel.data.base import VisionDataModule

    cfg = _compose(overrides)
    OmegaConf.to_container(cfg, resolve=False)  # every node readable
    assert OmegaConf.get_type(cfg.trainer) is schema.TrainerConfig
    assert OmegaConf.get_type(cfg.module.optimizer) is schema.AdamWConfig
    assert issubclass(OmegaConf.get_type(cfg.data), schema.DataConfig)
    cls = get_class(cfg.data._target_)
    inits = [c.__init__ for c in cls.__mro__ if "__init__" in vars(c) and issubclass(c, VisionDataModule)]
    accepted = set().union(*(inspect.signature(init).parameters for init in inits))  # (each class's, kwargs passed on)
    assert not {k for k in cfg.data if not k.startswith("_")} - accepted
    schema.check_top_keys(cfg, schema.TrainConfig, "train.py")
    check_moved_keys(cfg)


def test_eval_and_predict_compose():
    ev = _compose(["ckpt_path=x.ckpt", "data=cifar10", "trainer=cpu"], "eval")
    pr = _compose(["ckpt_path=x.pt2", "input=images"], "predict")
    assert OmegaConf.get_type(ev) is schema.EvalConfig and OmegaConf.get_type(pr) is schema.PredictConfig
    schema.check_top_keys(ev, schema.EvalConfig, "eval.py")
    schema.check_top_keys(pr, schema.PredictConfig, "predict.py")


@pytest.mark.parametrize(
    "config_name, key",
    [("train", "seed"), ("train", "module.optimizer.lr"),
     ("train", "data.batch_size"), ("train", "trainer.max_epochs"), ("eval", "data.batch_size"), ("predict", "topk")],
    ids=lambda x: x,
)  # fmt: skip
def test_a_wrong_type_is_refused_at_composition_naming_the_key(config_name, key):
    required = {"eval": ["ckpt_path=x"], "predict": ["ckpt_path=x", "input=y"]}.get(config_name, [])
    with pytest.raises(ConfigCompositionException) as err:
        _compose([*required, f"{key}=abc"], config_name)
    assert f"full_key: {key}" in str(err.value.__cause__), err.value.__cause__


TYPED = [
    "seed", "test", "progress_bar", "matmul_precision", "optimized_metric", "task_name", "ckpt_path",
    "module.optimizer.lr", "module.optimizer.weight_decay", "module.optimizer.betas", "module.optimizer.eps",
    "module.scheduler.warmup_epochs", "module.scheduler.warmup_steps", "module.scheduler.min_lr",
    "module.label_smoothing", "module.ema_eval", "module.layer_decay",
    "data.batch_size", "data.eval_batch_size", "data.num_workers", "data.img_size", "data.augment", "data.val_fraction",
    "data.drop_last", "data.pin_memory", "data.canvas_size", "data.in_chans",
    "trainer.max_epochs", "trainer.max_steps", "trainer.num_nodes", "trainer.accumulate_grad_batches",
    "trainer.gradient_clip_val", "trainer.log_every_n_steps", "trainer.check_val_every_n_epoch",
]  # fmt: skip


def test_the_typed_keys_refuse_what_they_cannot_hold():
    """The same types (OmegaConf validates every assignment): a list is no number, string or flag."""
    from omegaconf.errors import ValidationError

    cfg = _compose([])
    for key in TYPED:
        with pytest.raises(ValidationError) as err:
            OmegaConf.update(cfg, key, ["abc"] if not key.endswith("betas") else "abc", merge=False)
        assert f"full_key: {key}" in str(err.value), (key, err.value)


def test_the_trainer_schema_is_lightnings_signature():
    """Every field is a Trainer argument with Lightning's default, so the schema adds nothing a
    Trainer would not get anyway."""
    from lightning.pytorch import Trainer

    params = inspect.signature(Trainer.__init__).parameters
    for f in dataclasses.fields(schema.TrainerConfig):
        if f.name in ("_target_", "_convert_"):
            continue
        assert f.name in params, f.name
        assert f.default == params[f.name].default, (f.name, f.default, params[f.name].default)


# ------------------------------------------------------------------------------ keys moved since 0.1
MOVED = {
    "+optim.lr=1e9": "optim.lr moved to module.optimizer.lr",
    "+optim.warmup_epochs=3": "optim.warmup_epochs moved to module.scheduler.warmup_epochs",
    "+module.mixup_alpha=0.8": "module.mixup_alpha moved to module/mixup=default with module.mixup.mixup_alpha",
    "+module.ema_decay=0.99": "module.ema_decay moved to module/ema=default with module.ema.decay",
    "+compile=true": "compile moved to module.compile",
    "+log_every_n_steps=5": "log_every_n_steps moved to trainer.log_every_n_steps",
    "+logger.csv={}": "logger.csv={} (adding a logger) moved to logger='[wandb,csv]'",
}


def test_every_moved_key_names_the_new_one():
    with pytest.raises(ValueError, match="moved") as err:
        check_moved_keys(_compose(list(MOVED)))
    for new in MOVED.values():
        assert new in str(err.value)
    base = _compose([])
    for name in schema.MOVED_KEYS:  # each old key of docs/training.md, alone
        cfg = copy.deepcopy(base)
        OmegaConf.update(cfg, name, 1, force_add=True)
        with pytest.raises(ValueError, match=f"{name} moved to {schema.MOVED_KEYS[name]}"):
            check_moved_keys(cfg)


def test_train_and_evaluate_refuse_moved_keys_before_building_anything(tmp_path, monkeypatch):
    import vitrel.train.evaluate
    import vitrel.train.run
    from vitrel.train.evaluate import evaluate
    from vitrel.train.run import train

    for where in (vitrel.train.run, vitrel.train.evaluate):
        monkeypatch.setattr(where, "instantiate", lambda *a, **k: pytest.fail("something was built"))
    with pytest.raises(ValueError, match="optim.lr moved to module.optimizer.lr"):
        train(_compose(["+optim.lr=1e9", f"paths.output_dir={tmp_path}"]))
    with pytest.raises(ValueError, match="optim.lr moved to module.optimizer.lr"):
        evaluate(_compose(["ckpt_path=x", "+optim.lr=1e9", f"paths.output_dir={tmp_path}"], "eval"))


def test_moved_key_hint_names_the_new_key_of_a_plain_override():
    from vitrel.train.cli import moved_key_hint

    hint = moved_key_hint(["optim.lr=1e-3", "compile=true", "+optim.lr=1", "optim.foo=2", "trainer.max_epochs=1"])
    assert hint.splitlines() == [
        "optim.lr=1e-3: optim.lr moved to module.optimizer.lr",
        "compile=true: compile moved to module.compile",
        "optim.foo=2: optim.foo moved to module.optimizer / module.scheduler",
    ]  # +optim.lr composes: check_moved_keys names it in train() / evaluate()
    assert moved_key_hint(["pos=rope2d_mixed", "module.optimizer.lr=1e-3"]) is None


@pytest.mark.parametrize("script", ["train.py", "eval.py"])
def test_a_moved_key_without_plus_is_refused_with_the_new_key(script, tmp_path):
    """``optim.lr=1e-3`` as vitrel 0.1 took it (no ``+``): Hydra refuses it at composition (``Key 'optim' not in``),
    before ``check_moved_keys`` runs, and the same run's error names the new key (docs/training.md)."""
    from tests.train_helpers import run_script_forked

    args = ["optim.lr=1e-3", f"hydra.run.dir={tmp_path}/r"] + (["ckpt_path=x"] if script == "eval.py" else [])
    r = run_script_forked(script, args, cwd=tmp_path)
    assert r.returncode == 1
    assert "Key 'optim' not in" in r.stderr, r.stderr[-2000:]
    assert f"{script}: optim.lr=1e-3: optim.lr moved to module.optimizer.lr" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "r").exists()  # refused before the run


def test_the_current_keys_pass():
    check_moved_keys(_compose(["module/mixup=default", "module/ema=default", "logger=[wandb,csv]"]))


@pytest.mark.parametrize("name", _options("data_pos"))
def test_every_data_pos_file_is_options_of_one_scheme_for_one_data_set(name):
    """``conf/data_pos/<data>_<pos>.yaml`` is composed after the scheme when both are chosen: its name must be an
    existing data set and scheme (else it is silently never used), its keys options that scheme takes."""
    from vitrel.pos.registry import parse_pos

    pairs = [(d, name[len(d) + 1 :]) for d in _options("data") if name.startswith(d + "_")]
    pairs = [(d, p) for d, p in pairs if p in _options("pos")]
    assert len(pairs) == 1, f"conf/data_pos/{name}.yaml names no <data>_<pos> pair of conf/data and conf/pos"
    data, pos = pairs[0]
    cfg = _compose([f"data={data}", f"pos={pos}"])
    file = OmegaConf.load(CONF / "data_pos" / f"{name}.yaml")
    assert file and all(cfg.pos[k] == v for k, v in file.items())  # it reached the scheme
    parse_pos(OmegaConf.to_container(cfg.pos))  # options the scheme takes


def test_data_pos_follows_the_chosen_pair_and_yields_to_the_command_line():
    video = _compose(["experiment=video", "pos=rel3d_factored"])
    assert video.pos.init_std == 1.0  # conf/data_pos/moving_fmnist_rel3d_factored.yaml
    assert _compose(["experiment=video", "pos=rel3d_factored", "pos.init_std=0.05"]).pos.init_std == 0.05
    assert _compose(["pos=rel3d_factored"]).pos.init_std == 0.02  # the scheme's own default on other data
    assert "init_std" not in _compose(["experiment=video", "pos=rope3d_axial"]).pos
    plain = _compose(["experiment=video"])  # the recipe's own scheme, not the image default (refused on video)
    assert plain.pos.name == "rel3d_full" and plain.pos.init_std == 1.0  # (moving_fmnist_rel3d_full.yaml)


def test_unknown_pos_key_error_names_the_schemes_options(tmp_path):
    """``pos.typo=1`` (no ``+``): Hydra still refuses it at composition ("not in struct"), and the same run's error
    names the chosen scheme's options, so one run tells what to set (before, only ``+pos.typo=1`` did)."""
    from tests.train_helpers import run_script_forked

    r = run_script_forked(
        "train.py", ["pos=shaw2d_factored", "pos.typo=1", f"hydra.run.dir={tmp_path}/r"], cwd=tmp_path
    )
    assert r.returncode == 1
    assert "Key 'typo' is not in struct" in r.stderr, r.stderr[-2000:]
    want = "train.py: pos.typo=1: position scheme 'shaw2d_factored' has no option 'typo'; its options: clip_distance,"
    assert want in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "r").exists()  # refused before the run


def test_pos_hint_for_an_option_the_conf_file_does_not_set():
    from vitrel.train.cli import pos_option_hint

    hint = pos_option_hint(["pos=rel2d_factored", "pos.extend=clip", "pos.typo=2", "trainer.max_epochs=1"])
    assert hint == (
        "pos.typo=2: position scheme 'rel2d_factored' has no option 'typo'; its options: extend, init_std"
    ), hint
    assert pos_option_hint(["pos=rel2d_factored", "pos.extend=clip"]) is None  # a key the file sets: no hint
    unset = pos_option_hint(["pos=shaw2d_factored", "pos.max_distance=4"])  # an option conf/pos does not set
    assert (
        unset == "pos.max_distance=4: shaw2d_factored's conf/pos file does not set max_distance; add it with "
        "+pos.max_distance=4"
    ), unset
    assert pos_option_hint(["-m", "pos=rel2d_full,ape", "pos.typo=1"]) is None  # a sweep: Hydra's message alone


def test_group_option_hint_names_the_nearest_options():
    from vitrel.train.cli import group_option_hint

    hint = group_option_hint(["pos=rel2d_ful", "module/mixup=naflx", "trainer.max_epochs=1", "logger=[csv,wandbb]"])
    assert hint.splitlines() == [
        "pos=rel2d_ful: conf/pos has no rel2d_ful.yaml; did you mean pos=rel2d_full or pos=rel3d_full or "
        "pos=rel2d_cpb?",
        "module/mixup=naflx: conf/module/mixup has no naflx.yaml; did you mean module/mixup=naflex?",
        "logger=wandbb: conf/logger has no wandbb.yaml; did you mean logger=wandb?",
    ]
    sweep = group_option_hint(["-m", "pos=rel2d_full,rope2d_mixd", "+experiment=fmnist_naflx"])
    assert sweep.splitlines()[0].startswith("pos=rope2d_mixd: conf/pos has no rope2d_mixd.yaml; did you mean pos=")
    assert sweep.splitlines()[1].startswith("experiment=fmnist_naflx: conf/experiment has no fmnist_naflx.yaml;")
    assert group_option_hint(["pos=rel2d_full", "module/mixup=null", "logger=[csv,wandb]", "data=${oc.env:D}"]) is None
    assert group_option_hint(["pos=zzz"]) is None  # nothing near: Hydra's list of options alone
    assert group_option_hint(["pos=rel2d_ful", "hydra.searchpath=[file://x]"]) is None  # options elsewhere too


def test_a_registered_scheme_without_a_config_file_is_told_where_one_goes():
    """A launcher imported the module registering ``pos=quad2d`` but no ``my_conf/pos/quad2d.yaml`` is on the search
    path: Hydra's bare "Could not find 'pos/quad2d'" now ends with where the file goes."""
    import vitrel.pos.registry as registry
    from vitrel.pos import PositionScheme, register_pos
    from vitrel.train.cli import group_option_hint

    register_pos("quad2d")(type("Quad2d", (PositionScheme,), {"__module__": "my_schemes"}))
    try:
        hint = group_option_hint(["pos=quad2d"])
    finally:
        del registry._REGISTRY["quad2d"]
    assert hint.startswith("pos=quad2d: the scheme is registered (by my_schemes) but conf/pos has no quad2d.yaml"), hint
    assert "hydra.searchpath=[file://<that folder>]" in hint


def test_a_config_group_typo_ends_with_the_nearest_option(tmp_path):
    """``pos=rel2d_ful``: Hydra's refusal (its list of the 30-odd options, the search path) ends with the near one."""
    from tests.train_helpers import run_script_forked

    r = run_script_forked("train.py", ["pos=rel2d_ful", f"hydra.run.dir={tmp_path}/r"], cwd=tmp_path)
    assert r.returncode == 1
    assert "Could not find 'pos/rel2d_ful'" in r.stderr, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last == (
        "train.py: pos=rel2d_ful: conf/pos has no rel2d_ful.yaml; did you mean pos=rel2d_full or pos=rel3d_full or "
        "pos=rel2d_cpb?"
    ), r.stderr[-2000:]
    assert not (tmp_path / "r").exists()  # refused before the run


def test_key_typo_hint_names_the_nearest_keys_of_the_schemas():
    """A key the typed schemas lack (Hydra: ``Key 'max_epoch' not in 'TrainerConfig'``): the nearest keys of that
    node, the script's own top level, ``trainer``, ``module`` and any data schema's; nothing for right keys, additions
    (``+``), untyped nodes (``model.*``) or config groups."""
    from vitrel.train.cli import key_typo_hint

    hint = key_typo_hint(["trainer.max_epoch=1", "data.img_sze=48", "sed=1", "trainer.max_epochs=2", "pos=rel2d_ful"])
    assert hint.splitlines() == [
        "trainer.max_epoch=1: trainer has no max_epoch; did you mean trainer.max_epochs?",
        "data.img_sze=48: data has no img_sze; did you mean data.img_size?",
        "sed=1: train.py's config has no sed; did you mean seed?",
    ]
    assert (
        key_typo_hint(["ckpt_pth=x"], "eval") == "ckpt_pth=x: eval.py's config has no ckpt_pth; did you mean ckpt_path?"
    )
    assert key_typo_hint(["data.packing=pack", "data.val_dir=v", "module.ema_eval=false", "seed=1"]) is None
    assert key_typo_hint(["+trainer.max_epoch=1", "model.embed_dm=3", "hydra.run.dr=x", "trainer.zzz=1"]) is None


def test_a_key_typo_ends_with_the_nearest_key(tmp_path):
    """``trainer.max_epoch=1``: Hydra's refusal, then the key meant, before anything runs."""
    from tests.train_helpers import run_script_forked

    r = run_script_forked("train.py", ["trainer.max_epoch=1", f"hydra.run.dir={tmp_path}/r"], cwd=tmp_path)
    assert r.returncode == 1
    assert "Key 'max_epoch' not in 'TrainerConfig'" in r.stderr, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last == "train.py: trainer.max_epoch=1: trainer has no max_epoch; did you mean trainer.max_epochs?", last
    assert not (tmp_path / "r").exists()


def test_an_experiment_chosen_with_plus_ends_with_the_override_that_runs(tmp_path):
    """``+experiment=fmnist_quick`` (Hydra's docs choose experiments so): train.yaml already holds ``experiment:
    null``, and Hydra's refusal advised ``override experiment: fmnist_quick``, a defaults-list line, not a command. It
    ends with the override that runs; other groups the defaults hold (eval.py's ``data``) are told the same, a missing
    option is :func:`group_option_hint`'s, and a group the defaults lack is no business of the hint."""
    from tests.train_helpers import run_script_forked

    r = run_script_forked("train.py", ["+experiment=fmnist_quick", f"hydra.run.dir={tmp_path}/r"], cwd=tmp_path)
    assert r.returncode == 1 and "Multiple values for experiment" in r.stderr, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last == (
        "train.py: +experiment=fmnist_quick: train.yaml's defaults already hold experiment (none chosen); choose it "
        "without the +: experiment=fmnist_quick"
    ), r.stderr[-2000:]
    assert not (tmp_path / "r").exists()  # refused before the run
    from vitrel.train.cli import added_group_hint

    assert added_group_hint(["-m", "+pos=rope2d_mixed,alibi2d", "seed=0,1"]) == (
        "+pos=rope2d_mixed,alibi2d: train.yaml's defaults already hold pos (rel2d_factored); choose it without the +: "
        "pos=rope2d_mixed,alibi2d"
    )
    assert added_group_hint(["+data=cifar10", "ckpt_path=x"], "eval").endswith("choose it without the +: data=cifar10")
    assert added_group_hint(["+experiment=fmnist_qick", "experiment=fmnist_quick", "pos=rope2d_mixed"]) is None
    assert added_group_hint(["++experiment=fmnist_quick", "+pos.scaling=x", "+model.depth=2"]) is None


def test_an_added_trainer_key_lightning_lacks_is_refused_naming_the_nearest(tmp_path):
    """``+trainer.max_epoch=1``: Hydra adds any key with ``+``; Lightning then refused it inside Hydra's error
    (``Trainer.__init__() got an unexpected keyword argument 'max_epoch'``) after the run had begun. Refused first,
    in one line naming the argument meant; one with no near argument gets Lightning's list of them."""
    from omegaconf import OmegaConf

    from tests.train_helpers import run_script_forked
    from vitrel.config import ConfigError
    from vitrel.train.target_keys import check_trainer_keys

    r = run_script_forked("train.py", ["+trainer.max_epoch=1", f"hydra.run.dir={tmp_path}/r"], cwd=tmp_path)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last == (
        "train.py: ConfigError: trainer.max_epoch: Lightning's Trainer takes no max_epoch; did you mean "
        "trainer.max_epochs?"
    ), r.stderr[-2000:]
    assert not (tmp_path / "r" / "metrics.json").exists()
    trainer = OmegaConf.create({"_target_": "lightning.pytorch.Trainer", "_convert_": "all", "max_epochs": 1})
    check_trainer_keys(trainer)  # (Hydra's own keys and Lightning's arguments pass)
    trainer.zzz = 1
    with pytest.raises(ConfigError, match=r"trainer.zzz: Lightning's Trainer takes no zzz; its arguments: https://"):
        check_trainer_keys(trainer)


def test_an_added_top_level_key_nothing_reads_is_refused_naming_the_nearest(tmp_path):
    """``+epochs=3`` (timm's train.py's name) was composed and ignored: the run trained its configured epochs and
    said nothing. ``train.py``, ``eval.py`` and ``predict.py`` now refuse a top-level key their config does not have
    and no interpolation reads, before anything runs, naming the key meant (the top level's own first, then
    ``trainer``, ``module``, ``data`` ... by last name); a key of the user's own that an interpolation reads passes
    (every configuration conf/ composes passes too: :func:`test_every_config_composes`)."""
    from tests.train_helpers import run_script_forked
    from vitrel.config import ConfigError, EvalConfig, PredictConfig, TrainConfig, check_top_keys

    r = run_script_forked("train.py", ["+epochs=3", f"hydra.run.dir={tmp_path}/r"], cwd=tmp_path)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == (
        "train.py: ConfigError: epochs: train.py reads no top-level epochs (added with + or by a config file: the run "
        "would ignore it); did you mean trainer.min_epochs or trainer.max_epochs?"
    ), r.stderr[-2000:]
    assert not (tmp_path / "r" / "metrics.json").exists()
    for added, meant in [("+lr=0.1", "module.optimizer.lr"), ("+workers=2", "data.num_workers"), ("+sed=1", "seed")]:
        with pytest.raises(
            ConfigError, match=rf"reads no top-level {added[1:].split('=')[0]}\b.*did you mean {meant}\b"
        ):
            check_top_keys(_compose([added]), TrainConfig, "train.py")
    check_top_keys(_compose(["+my_lr=0.01", "module.optimizer.lr=${my_lr}"]), TrainConfig, "train.py")
    with pytest.raises(
        ConfigError, match=r"reads no top-level zzz \(added with \+ or by a config file: the run would "
    ):
        check_top_keys(_compose(["+zzz=1"]), TrainConfig, "train.py")
    with pytest.raises(ConfigError, match=r"predict.py reads no top-level top_k .*did you mean topk\?$"):
        check_top_keys(_compose(["ckpt_path=x", "input=y", "+top_k=3"], "predict"), PredictConfig, "predict.py")
    with pytest.raises(ConfigError, match=r"eval.py reads no top-level split_name"):
        check_top_keys(_compose(["ckpt_path=x", "+split_name=val"], "eval"), EvalConfig, "eval.py")
    for option in _options("hparams_search"):  # (experiment and debug: test_every_config_composes)
        check_top_keys(_compose([f"hparams_search={option}"]), TrainConfig, "train.py")


def test_a_top_level_key_the_schemas_lack_is_looked_for_in_every_node():
    """``epochs=3`` / ``lr=0.1`` (no ``+``): Hydra refuses them, and the hint names the key meant in ``trainer``,
    ``module`` (its optimizer's too) or ``data``; ``module.lr`` names the optimizer's."""
    from vitrel.train.cli import key_typo_hint

    assert key_typo_hint(["epochs=3", "lr=0.1", "batch_size=8", "module.lr=0.1"]).splitlines() == [
        "epochs=3: train.py's config has no epochs; did you mean trainer.min_epochs or trainer.max_epochs?",
        "lr=0.1: train.py's config has no lr; did you mean module.optimizer.lr?",
        "batch_size=8: train.py's config has no batch_size; did you mean data.batch_size?",
        "module.lr=0.1: module has no lr; did you mean module.optimizer.lr?",
    ]


def test_lightning_hydra_templates_keys_name_vitrels():
    """A lightning-hydra-template user's keys (``model.optimizer.lr``, ``data.data_dir``, ``model.net.*``): Hydra
    refuses them without ``+`` and the hint names vitrel's key; with ``+`` they composed and reached the model's
    constructor (a ``TypeError`` listing its arguments) or were ignored (``data.data_dir`` by the data module's
    ``TypeError``): ``check_moved_keys`` now names vitrel's first."""
    from vitrel.config import ConfigError, template_key
    from vitrel.train.cli import moved_key_hint

    assert moved_key_hint(["model.optimizer.lr=0.1", "model.net.embed_dim=64", "seed=1"]).splitlines() == [
        "model.optimizer.lr=0.1: model.optimizer.lr (lightning-hydra-template's) is module.optimizer.lr in vitrel",
        "model.net.embed_dim=64: model.net.embed_dim (lightning-hydra-template's) is model.embed_dim in vitrel",
    ]
    assert template_key("data.data_dir").startswith("data.root (this data set's folder; paths.data_dir")
    assert template_key("model.optimizers") is None and template_key("module.optimizer.lr") is None
    for added, said in [
        ("+model.optimizer.lr=0.1", "model.optimizer (lightning-hydra-template's) is module.optimizer in vitrel"),
        ("+data.data_dir=/x", "data.data_dir (lightning-hydra-template's) is data.root (this data set's folder"),
        ("+model.compile=true", "model.compile (lightning-hydra-template's) is module.compile in vitrel"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(said)):
            check_moved_keys(_compose([added]))
