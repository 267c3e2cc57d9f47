"""Types of the Hydra configs: structured-config schemas, and the keys that moved since vitrel 0.1.

The YAML files in ``conf/`` name these dataclasses as the first entry of their defaults list (Hydra's
"Structured Configs as schemas"), so a value of the wrong type is refused while the config is composed,
with the key named, before any data or model is built::

    $ python train.py module.optimizer.lr=abc
    Error merging override module.optimizer.lr=abc
    Value 'abc' of type 'str' could not be converted to Float
        full_key: module.optimizer.lr

The schemas are registered in Hydra's ``ConfigStore`` when this module is imported (``import vitrel``
does it). Groups that are open-ended by design stay ``Any``: ``model`` (checked by the constructors),
``pos``, ``callbacks``, ``logger``, ``paths``. A key a schema does not list is still added with
``+key=value``. ``Any`` also marks values of several types (``trainer.devices``: 1, "auto" or a list;
``trainer.limit_train_batches``: a count or a fraction), which OmegaConf cannot express as a union.

:func:`check_moved_keys` refuses the keys of vitrel 0.1 that ``docs/training.md`` lists as moved
(``+optim.lr=1e9`` would otherwise be composed and ignored) and lightning-hydra-template's (:data:`TEMPLATE_KEYS`:
``+model.optimizer.lr``); ``train()`` and ``evaluate()`` call it first, and :func:`check_top_keys` a top-level key
the script does not read (``+epochs=3``).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Iterable
from dataclasses import dataclass, field, make_dataclass
from typing import Any, Union, get_args, get_origin, get_type_hints

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

__all__ = [
    "DataConfig",
    "ModuleConfig",
    "TrainerConfig",
    "TrainConfig",
    "EvalConfig",
    "PredictConfig",
    "MOVED_KEYS",
    "TEMPLATE_KEYS",
    "template_key",
    "check_moved_keys",
    "check_top_keys",
    "nearest_keys",
    "schema_keys",
    "check_resume",
    "ConfigError",
    "data_val_fraction",
    "register_configs",
]


# ---------------------------------------------------------------------------------------------- data
@dataclass
class DataConfig:
    """What every ``vitrel.data.VisionDataModule`` takes (``conf/data/*.yaml``)."""

    _target_: str = MISSING
    _convert_: str = "all"
    name: str | None = None
    root: str | None = None
    batch_size: int = 128
    eval_batch_size: int | None = None
    num_workers: int = 2
    img_size: int | None = None
    augment: bool = False
    augment_kwargs: dict[str, Any] = field(default_factory=dict)
    interpolation: str | None = None  # null: the data set's (with pretrained weights: theirs)
    mean: list[float] | None = None  # per-channel normalisation; null: the data set's (with pretrained weights: theirs)
    std: list[float] | None = None
    crop_pct: float | None = None  # eval resize / centre crop; null: the data set's (pretrained weights: theirs)
    pin_memory: bool = False
    drop_last: bool = False
    seed: int = 0
    val_fraction: float | None = 0.0  # held out of train as val; null: the data set's (its default_val_fraction)
    download: bool = True
    canvas_size: int | None = None
    canvas_mode: str = "random"
    loader: str | None = None
    batch_augment: Any = None  # a vitrel.data.BatchAugment node (memory loader)
    memory_budget_gb: float | None = None
    packing: Any = False  # false | true | "pad" | "pack": timm NaFlex batches (vitrel.data.packing)
    seq_len: int | None = None  # tokens per row of a NaFlex batch
    patch_size: int | None = None  # the model's patch size (NaFlex batches)
    max_tokens: int | None = None  # most patches of one image (null: seq_len)
    size_scale: list[float] | None = None  # [lo, hi]: random per-image size fraction (training)
    eval_max_ratio: float | None = 1.0  # evaluation resize cap (1.0: native sizes within the budget)
    size_choices: list[int] | None = None  # per-batch resolution in training: a side drawn per batch


@dataclass
class FashionMNISTDataConfig(DataConfig):
    subset: str = "embedded"
    in_chans: int = 1


@dataclass
class CIFARDataConfig(DataConfig):
    num_classes: int = 10
    verify: bool = True


@dataclass
class ImageNetDataConfig(DataConfig):
    num_classes: int | None = None
    train_dir: str = "train"
    val_dir: str = "val"
    source: str | None = None  # timm.data.create_dataset name: wds/..., hfds/..., hfids/..., tfds/...
    train_split: str = "train"
    val_split: str = "validation"
    num_samples: int | None = None
    dataset_kwargs: dict[str, Any] = field(default_factory=dict)
    on_bad_sample: str = "raise"  # raise | skip a file (class folders) or sample (shards) that cannot be read


@dataclass
class VideoFilesDataConfig(DataConfig):
    """The options of the data over video files (``data=video_folder``, ``data=video_list``): the clips."""

    num_classes: int | None = None
    num_frames: int = 16
    stride: int = 4
    clips_per_video: int = 1
    spatial_crops: int = 1  # evaluation crops along each clip's longer side (3: VideoMAE's and V-JEPA 2's views)
    num_segments: int = 1  # clips a sample, one from each of this many equal parts of the video, joined along time
    clip_repeats: int = 1  # training: each video decoded once, in this many augmented views (batch_size counts views)
    frame_sampling: str = "stride"  # stride | spread: a clip's frames one from each of num_frames parts of the video
    on_bad_sample: str = "raise"  # raise | skip a video that does not decode (named; the next one in its place)
    in_chans: int = 3  # 1: grey frames (PIL's convert("L"), as predict.py)


@dataclass
class VideoFolderDataConfig(VideoFilesDataConfig):
    train_dir: str = "train"
    val_dir: str = "val"
    extensions: list[str] = field(default_factory=lambda: [".mp4", ".avi", ".webm", ".mkv", ".mov", ".m4v"])


@dataclass
class VideoListDataConfig(VideoFilesDataConfig):
    """``data=video_list``: "path label" lists or Something-Something v2's JSON (``vitrel.data.video.lists``)."""

    train_list: str | None = None  # relative: under root
    val_list: str | None = None
    labels_file: str | None = None  # SSv2's something-something-v2-labels.json (with JSON lists)
    video_dir: str | None = None  # relative video paths and SSv2 ids are under root/video_dir (null: root)
    video_ext: str = ".webm"  # an SSv2 id's file: <video_dir>/<id><video_ext>
    class_names: Any = None  # a list, or a file of one name a line (SSv2: the labels file's)


@dataclass
class MovingFMNISTDataConfig(DataConfig):
    num_frames: int = 8
    size: int = 32
    object_size: int = 16
    speeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    orientations: list[int] = field(default_factory=lambda: [0, 45, 90, 135])
    train_images: int | None = None
    test_images: int | None = None
    in_chans: int = 1


@dataclass
class ArraysDataConfig(DataConfig):
    """``data=arrays``: one's own uint8 arrays in an ``.npz`` file (``vitrel.data.ArrayDataModule``)."""

    path: str | None = None
    num_classes: int | None = None
    class_names: list[str] | None = None


def data_val_fraction(data: Any) -> float:
    """The fraction of train a data config holds out as val: its ``val_fraction``, or when that is null the data
    set's (its ``_target_`` class's ``default_val_fraction``, as ``VisionDataModule`` resolves it; else 0, val is the
    test split)."""
    value = data.get("val_fraction")
    if value is not None:
        return float(value)
    from hydra.utils import get_class

    try:
        cls = get_class(str(data.get("_target_")))
    except Exception:  # noqa: BLE001  (no class, or none importable here: as a module without a default)
        return 0.0
    return float(getattr(cls, "default_val_fraction", 0.0) or 0.0)


# -------------------------------------------------------------------------------------------- module
@dataclass
class AdamWConfig:
    """``module.optimizer``: ``torch.optim.AdamW``, completed by the module with the parameter groups."""

    _target_: str = "torch.optim.AdamW"
    _partial_: bool = True
    lr: float = 1.0e-3
    weight_decay: float = 0.05
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1.0e-8
    fused: bool | None = None  # true: one fused kernel per parameter group (step=fast), None: torch's choice


@dataclass
class SGDConfig:
    """``module/optimizer=sgd``: ``torch.optim.SGD``, completed by the module with the parameter groups."""

    _target_: str = "torch.optim.SGD"
    _partial_: bool = True
    lr: float = 0.1
    weight_decay: float = 1.0e-4
    momentum: float = 0.9
    nesterov: bool = True
    dampening: float = 0.0
    fused: bool | None = None


@dataclass
class WarmupCosineConfig:
    """``module.scheduler``: ``vitrel.train.optim.warmup_cosine`` (null: a constant rate)."""

    _target_: str = "vitrel.train.optim.warmup_cosine"
    _partial_: bool = True
    warmup_epochs: float = 1.0
    warmup_steps: int | None = None
    min_lr: float = 1.0e-5
    warmup_lr: float = 1.0e-6


@dataclass
class ModuleConfig:
    """``vitrel.train.module.ClassifierModule`` (``conf/module/classifier.yaml``)."""

    _target_: str = "vitrel.train.module.ClassifierModule"
    _convert_: str = "all"
    # conf/module/optimizer/<name>.yaml, typed by its own schema (adamw_schema, sgd_schema); the default's keys are
    # those the hints for a misspelled key look through (schema_keys). MISSING: merged after the group (the probe
    # grid's schema, after the classifier's file), it leaves the group's node as it is
    optimizer: Any = field(default=MISSING, metadata={"schema": AdamWConfig})
    scheduler: WarmupCosineConfig | None = field(default_factory=WarmupCosineConfig)
    label_smoothing: float = 0.0
    mixup: Any = None  # module/mixup=default: a timm.data.Mixup node; naflex: a timm NaFlexMixup node
    ema: Any = None  # module/ema=default: a timm.utils.ModelEmaV3 node
    ema_eval: bool = True
    layer_decay: float | None = None
    compile: Any = False  # false | true | {torch.compile kwargs}
    sync_free: bool = False  # no host synchronisation in the training step (training metrics at epoch end)
    grad_checkpointing: bool = False  # model.set_grad_checkpointing(): recompute activations in backward (memory)
    freeze_backbone: bool = False  # train the head alone (linear / attentive probing): the rest frozen, in eval mode
    unfreeze_backbone_at_epoch: int | None = None  # with freeze_backbone: all trains from this epoch on (LP-FT)


@dataclass
class ProbeGridModuleConfig(ModuleConfig):
    """``vitrel.train.probe_grid.ProbeGridModule`` (``conf/module/probe_grid.yaml``): probes on a frozen backbone."""

    _target_: str = "vitrel.train.probe_grid.ProbeGridModule"
    freeze_backbone: bool = True
    probes: list[Any] = field(default_factory=list)  # [{lr, weight_decay}, ...]: one probe each


# ------------------------------------------------------------------------------------------- trainer
#: Trainer arguments the config does not hold: ``train()`` sets them from ``logger``, ``callbacks`` and ``progress_bar``
TRAINER_SET_BY_TRAIN = ("logger", "callbacks", "enable_progress_bar")
TRAINER_DOCS = "https://lightning.ai/docs/pytorch/stable/common/trainer.html#trainer-flags"
#: Lightning's unions that OmegaConf cannot hold, as the one type a config spells them in (``32`` is read as ``"32"``)
_TRAINER_SPELLED = {"accelerator": str, "precision": str | None, "gradient_clip_val": float | None,
                    "default_root_dir": str | None}  # fmt: skip
_PLAIN = (int, float, bool, str)


def _schema_type(hint: Any) -> Any:
    """An argument's annotation as an OmegaConf field type: a plain type, or it or None; ``Any`` for the unions
    OmegaConf cannot express (``devices``: 1, "auto" or a list; ``limit_train_batches``: a count or a fraction)."""
    if hint in _PLAIN:
        return hint
    members = [a for a in get_args(hint) if a is not type(None)] if get_origin(hint) is Union else []
    if len(members) == 1 and members[0] in _PLAIN:
        return members[0] | None
    return Any


def _trainer_config() -> type:
    """``lightning.pytorch.Trainer``'s arguments with Lightning's defaults and types, read from its signature (so the
    schema follows the installed Lightning), but :data:`TRAINER_SET_BY_TRAIN`."""
    from lightning.pytorch import Trainer

    hints = get_type_hints(Trainer.__init__)
    # (_convert_: plain dicts and lists, as Lightning takes them: max_time={hours: 1} is timedelta(**dict))
    fields = [("_target_", str, "lightning.pytorch.Trainer"), ("_convert_", str, field(default="all"))]
    for name, p in inspect.signature(Trainer.__init__).parameters.items():
        if name != "self" and name not in TRAINER_SET_BY_TRAIN:
            fields.append((name, _TRAINER_SPELLED.get(name) or _schema_type(hints[name]), field(default=p.default)))
    cls = make_dataclass("TrainerConfig", fields)
    cls.__module__, cls.__doc__ = __name__, _trainer_config.__doc__
    return cls


TrainerConfig = _trainer_config()


# ------------------------------------------------------------------------------- top-level configs
@dataclass
class TrainConfig:
    """``conf/train.yaml``: ``python train.py``."""

    task_name: str = "train"
    seed: int = 0
    ckpt_path: str | None = None
    resume: Any = "auto"  # "auto" | false
    test: bool = True
    progress_bar: str = "auto"
    matmul_precision: str = "high"
    optimized_metric: str | None = None
    model: Any = MISSING
    pos: Any = MISSING
    data: Any = MISSING
    module: Any = MISSING
    trainer: Any = MISSING
    logger: Any = None
    callbacks: Any = None
    paths: Any = MISSING
    study: Any = None  # the position-scheme study's settings (conf/experiment/study_base.yaml)


@dataclass
class EvalConfig:
    """``conf/eval.yaml``: ``python eval.py``."""

    task_name: str = "eval"
    seed: int = 0
    ckpt_path: str = MISSING
    split: str = "test"
    ema: Any = "auto"  # "auto" | true | false
    model_overrides: dict[str, Any] = field(default_factory=dict)
    progress_bar: str = "auto"
    per_class: Any = None  # the PerClassReport callback's node (conf/eval.yaml); null: no per-class report
    attention_distance: Any = None  # the AttentionDistance callback's node (conf/eval.yaml); null: none
    matmul_precision: str = "high"
    data: Any = MISSING
    trainer: Any = MISSING
    paths: Any = MISSING


@dataclass
class PredictConfig:
    """``conf/predict.yaml``: ``python predict.py``."""

    task_name: str = "predict"
    ckpt_path: str = MISSING
    input: str = MISSING
    results_file: str = MISSING
    topk: int = 5
    batch_size: int = 64
    num_workers: int = 0
    device: str = "auto"
    precision: str = "32-true"  # 32-true | bf16-mixed | 16-mixed (torch.autocast)
    ema: Any = "auto"  # "auto" | true | false
    model_overrides: dict[str, Any] = field(default_factory=dict)
    progress_bar: str = "auto"  # auto | tqdm | lines | none (true and false as auto and none)
    seq_len: int | None = None  # NaFlex: each image at its own size, packed into rows of seq_len tokens
    max_tokens: int | None = None  # NaFlex: most patches of one image (null: seq_len)
    apply_exif_orientation: bool = False  # phone photos turned upright by their EXIF orientation first
    class_names: Any = None  # labels: a list, or a file of one name a line (else the stored names, else indices)
    paths: Any = MISSING


def register_configs() -> None:
    """Store the schemas in Hydra's ``ConfigStore`` under the names ``conf/`` uses (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(name="eval_schema", node=EvalConfig)
    cs.store(name="predict_schema", node=PredictConfig)
    cs.store(group="data", name="fashion_mnist_schema", node=FashionMNISTDataConfig)
    cs.store(group="data", name="cifar_schema", node=CIFARDataConfig)
    cs.store(group="data", name="imagenet_schema", node=ImageNetDataConfig)
    cs.store(group="data", name="video_folder_schema", node=VideoFolderDataConfig)
    cs.store(group="data", name="video_list_schema", node=VideoListDataConfig)
    cs.store(group="data", name="moving_fmnist_schema", node=MovingFMNISTDataConfig)
    cs.store(group="data", name="arrays_schema", node=ArraysDataConfig)
    cs.store(group="module", name="classifier_schema", node=ModuleConfig)
    cs.store(group="module", name="probe_grid_schema", node=ProbeGridModuleConfig)
    cs.store(group="module/optimizer", name="adamw_schema", node=AdamWConfig)
    cs.store(group="module/optimizer", name="sgd_schema", node=SGDConfig)
    cs.store(group="trainer", name="trainer_schema", node=TrainerConfig)


register_configs()


# ----------------------------------------------------------------------- keys moved since vitrel 0.1
#: old key -> where it is now (docs/training.md, "Keys that moved since vitrel 0.1.0")
MOVED_KEYS: dict[str, str] = {
    "optim.lr": "module.optimizer.lr",
    "optim.weight_decay": "module.optimizer.weight_decay",
    "optim.betas": "module.optimizer.betas",
    "optim.eps": "module.optimizer.eps",
    "optim.warmup_epochs": "module.scheduler.warmup_epochs",
    "optim.warmup_steps": "module.scheduler.warmup_steps",
    "optim.min_lr": "module.scheduler.min_lr",
    "optim.warmup_lr": "module.scheduler.warmup_lr",
    "module.mixup_alpha": "module/mixup=default with module.mixup.mixup_alpha",
    "module.cutmix_alpha": "module/mixup=default with module.mixup.cutmix_alpha",
    "module.mixup_prob": "module/mixup=default with module.mixup.prob",
    "module.mixup_switch_prob": "module/mixup=default with module.mixup.switch_prob",
    "module.mixup_mode": "module/mixup=default with module.mixup.mode",
    "module.ema_decay": "module/ema=default with module.ema.decay",
    "module.ema_warmup": "module/ema=default with module.ema.use_warmup",
    "compile": "module.compile",
    "log_every_n_steps": "trainer.log_every_n_steps",
}
#: lightning-hydra-template's keys (its configs/model/mnist.yaml, configs/data/mnist.yaml) that vitrel names
#: otherwise, each with vitrel's (a key under a prefix: the same key under the new one)
TEMPLATE_KEYS: dict[str, str] = {
    "model.optimizer": "module.optimizer",
    "model.scheduler": "module.scheduler",
    "model.compile": "module.compile",
    "model.net": "model",
    "data.data_dir": "data.root (this data set's folder; paths.data_dir: the folder of every data set)",
    "data.train_val_test_split": "data.val_fraction (the test split is the data set's own)",
}
_ABSENT = object()


def template_key(key: str) -> str | None:
    """vitrel's key for one of lightning-hydra-template's (:data:`TEMPLATE_KEYS`; ``model.optimizer.lr`` ->
    ``module.optimizer.lr``), None for any other."""
    for old, new in TEMPLATE_KEYS.items():
        if key == old or key.startswith(old + "."):
            return new + key[len(old) :] if " " not in new else new
    return None


class ConfigError(ValueError):
    """A setting the run cannot take, named with what to set instead (``train.py`` prints it as one line)."""


def check_resume(cfg: DictConfig) -> Any:
    """``cfg.resume``: ``auto`` or false (``None`` and ``never`` are false), else a :class:`ConfigError` saying so."""
    resume = cfg.get("resume", "auto")
    if resume not in ("auto", False, "never", None):
        raise ConfigError(
            f"resume={resume}: resume takes auto (the default: resume from the run folder's checkpoints/last.ckpt when "
            "there is one) or false (start over); ckpt_path=last resumes and stops when there is no last.ckpt"
        )
    return resume


def check_moved_keys(cfg: DictConfig) -> None:
    """A :class:`ConfigError` naming the new key when ``cfg`` sets one of vitrel 0.1's keys (``+optim.lr=...``)."""
    found = [
        f"{old} moved to {new}"
        for old, new in MOVED_KEYS.items()
        if OmegaConf.select(cfg, old, default=_ABSENT, throw_on_missing=False) is not _ABSENT
    ]
    optim = cfg.get("optim") if isinstance(cfg, DictConfig) else None
    if isinstance(optim, DictConfig):
        found += [
            f"optim.{k} moved to module.optimizer / module.scheduler" for k in optim if f"optim.{k}" not in MOVED_KEYS
        ]
    elif "optim" in cfg:
        found.append("optim moved to module.optimizer / module.scheduler")
    theirs = [
        f"{old} (lightning-hydra-template's) is {template_key(old)} in vitrel"
        for old in TEMPLATE_KEYS
        if OmegaConf.select(cfg, old, default=_ABSENT, throw_on_missing=False) is not _ABSENT
    ]
    logger = cfg.get("logger")
    if isinstance(logger, DictConfig):
        empty = [n for n, e in logger.items() if isinstance(e, DictConfig) and len(e) == 0]
        kept = [n for n in logger if n not in empty]
        found += [f"logger.{n}={{}} (adding a logger) moved to logger='[{','.join([*kept, n])}]'" for n in empty]
    said = ["keys of vitrel 0.1 that moved (docs/training.md lists them): " + "; ".join(found) + "."] if found else []
    if said or theirs:
        raise ConfigError(" ".join([*said, *(f"{t}." for t in theirs), "Use the new keys."]))


def check_top_keys(cfg: DictConfig, schema: type, script: str) -> None:
    """A :class:`ConfigError` naming the nearest keys when ``cfg`` holds a top-level key that ``schema`` (the script's
    config class) lacks and no interpolation reads: Hydra lets ``+epochs=3`` (or an experiment's file) add any key
    at the top, and the run would go on without it. A key an interpolation reads (``${my_lr}``) is the user's own."""
    known = {f.name for f in dataclasses.fields(schema)} | {"hydra"}
    text = OmegaConf.to_yaml(cfg, resolve=False)
    read = set(re.findall(r"\$\{\s*([A-Za-z_]\w*)", text))  # (the top-level names interpolations start from)
    extra = [k for k in cfg if k not in known and k not in read]
    if not extra:
        return
    own, nested = [k for k in cfg if k in known and k != "hydra"], _dotted_keys(cfg)
    said = []
    for key in extra:
        near = nearest_keys(key, own) or nearest_keys(key, nested)  # (the top level's keys first)
        hint = f"; did you mean {' or '.join(near)}?" if near else ""
        why = "added with + or by a config file: the run would ignore it"
        said.append(f"{key}: {script} reads no top-level {key} ({why}){hint}")
    raise ConfigError("; ".join(said))


def nearest_keys(key: str, paths: Iterable[str], n: int = 3) -> list[str]:
    """Up to ``n`` dotted keys of ``paths`` (``trainer.max_epochs``) whose last name is ``key``, else whose last name
    is nearest to it (``difflib``, cutoff 0.75): what a misplaced or misspelled key meant."""
    import difflib

    leaves: dict[str, list[str]] = {}
    for path in paths:
        leaves.setdefault(path.rsplit(".", 1)[-1], []).append(path)
    near = leaves.get(key) or [
        p for m in difflib.get_close_matches(key, list(leaves), n=n, cutoff=0.75) for p in leaves[m]
    ]
    return near[:n]


def schema_keys(schema: type, prefix: str = "") -> list[str]:
    """The dotted keys of a schema dataclass, nested schemas walked (``ModuleConfig``: ``optimizer.lr`` ...; a field
    of a config group, typed ``Any``, by the schema its ``metadata`` names)."""
    out, named = [], {f.name: f.metadata["schema"] for f in dataclasses.fields(schema) if "schema" in f.metadata}
    for name, hint in get_type_hints(schema).items():
        inner = [named[name]] if name in named else [t for t in (hint, *get_args(hint)) if dataclasses.is_dataclass(t)]
        out += schema_keys(inner[0], f"{prefix}{name}.") if inner else [f"{prefix}{name}"]
    return out


def _dotted_keys(node: DictConfig, prefix: str = "") -> list[str]:
    """The dotted keys of ``node``'s settings below its top level, mappings walked (``trainer.max_epochs``,
    ``module.optimizer.lr``; not ``hydra``'s), interpolations left unresolved."""
    out = []
    for k in node:
        if k == "hydra" or str(k).startswith("_"):
            continue
        path, plain = f"{prefix}{k}", not (OmegaConf.is_missing(node, k) or OmegaConf.is_interpolation(node, k))
        if plain and isinstance(node[k], DictConfig):
            out += _dotted_keys(node[k], path + ".")
        elif prefix:
            out.append(path)
    return out
