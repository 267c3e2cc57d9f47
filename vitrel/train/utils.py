"""Helpers shared by ``train`` and ``evaluate``: building objects from their config nodes, the run
folder, the progress display, Hydra's runtime state, the log file, the entry points' warning filters.

Every config node that builds an object has a ``_target_`` (``hydra.utils.instantiate``);
``instantiate_callbacks`` / ``instantiate_loggers`` build the named entries of ``cfg.callbacks`` /
``cfg.logger`` (``null`` switches an entry off), as in lightning-hydra-template.
"""

from __future__ import annotations

import inspect
import logging
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback, RichProgressBar
from lightning.pytorch.loggers import Logger
from omegaconf import DictConfig, OmegaConf

__all__ = [
    "instantiate_callbacks",
    "instantiate_loggers",
    "plain",
    "scalars",
    "run_dir_of",
    "route_lightning_logs",
    "quiet_third_party",
    "progress_bar_kind",
    "progress_callbacks",
    "hydra_config",
    "override_key",
    "task_overrides",
    "is_multirun",
    "one_line_errors",
    "AcceleratorUnavailableError",
    "check_accelerator",
    "check_data_fits_model",
    "is_video_data",
    "is_video_architecture",
    "check_video_pairing",
]


def _instantiate_named(group: str, node: DictConfig | None, **declared: Any) -> list[Any]:
    from hydra.utils import instantiate

    if not node:
        return []
    if not isinstance(node, DictConfig):
        raise TypeError(f"`{group}` must be a mapping of named entries, got {type(node).__name__}")
    out = []
    for name, entry in node.items():
        if entry is None:
            continue  # switched off: <group>.<name>=null
        if not isinstance(entry, DictConfig) or "_target_" not in entry:
            raise ValueError(
                f"{group}.{name} has no _target_: each entry of `{group}` builds an object, "
                f"e.g. +{group}.{name}={{_target_: <class>, ...}}; set {group}.{name}=null to switch one off"
            )
        kwargs = {k: v for k, v in declared.items() if k in entry}
        if group == "callbacks" and "_convert_" not in entry:  # plain dicts and lists, as Lightning's take them
            kwargs["_convert_"] = "all"  # (StochasticWeightAveraging(swa_lrs=[...]), Timer(duration={...}))
        out.append(instantiate(entry, **kwargs))
    return out


def instantiate_callbacks(callbacks_cfg: DictConfig | None) -> list[Callback]:
    """The callbacks of ``cfg.callbacks`` (each entry a ``_target_`` node; ``null`` entries skipped)."""
    return _instantiate_named("callbacks", callbacks_cfg)


def instantiate_loggers(logger_cfg: DictConfig | None, resume_step: int | None = None) -> list[Logger]:
    """The loggers of ``cfg.logger`` (each entry a ``_target_`` node; ``null`` entries skipped).

    ``resume_step``: the global step of the checkpoint the run resumes (None: a new run); given to the
    entries that have a ``resume_step`` key, which continue their files from there
    (:mod:`vitrel.train.loggers`)."""
    return _instantiate_named("logger", logger_cfg, resume_step=resume_step)


def plain(node: Any) -> Any:
    """An OmegaConf node (or anything) as plain, resolved Python containers."""
    if OmegaConf.is_config(node):
        return OmegaConf.to_container(node, resolve=True)
    return node


def scalars(metrics: dict) -> dict[str, float]:
    """The one-number entries of a metrics dict as floats."""
    out = {}
    for k, v in metrics.items():
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            out[k] = float(v)
        elif isinstance(v, (int, float)):
            out[k] = float(v)
    return out


def run_dir_of(cfg: DictConfig) -> Path:
    """The run's output folder: ``cfg.paths.output_dir`` (Hydra's job folder by default)."""
    return Path(str(cfg.paths.output_dir)).resolve()


def apply_matmul_precision(cfg: DictConfig) -> None:
    """``torch.set_float32_matmul_precision(cfg.matmul_precision)`` on a CUDA machine (train.py, eval.py); a CPU's
    float32 matmuls stay exact."""
    if torch.cuda.is_available():
        torch.set_float32_matmul_precision(str(cfg.get("matmul_precision", "high")))


def route_lightning_logs() -> None:
    """Under Hydra (the root logger has handlers) let Lightning's messages go through them only, so that they
    reach the run's log file (``<run folder>/<task>.log``: ``train.log``, ``eval.log``) as well as the console.

    Imported before Hydra sets up logging, Lightning gives its loggers (``lightning``, ``lightning.pytorch``,
    ``lightning.fabric``) console handlers of their own, and stops the latter two from propagating to the root
    logger: their messages went to the console only, never to the log file. With root handlers present, drop those
    console handlers and let the messages propagate.
    """
    if logging.getLogger().hasHandlers():
        for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
            lg = logging.getLogger(name)
            for h in list(lg.handlers):
                if type(h) is logging.StreamHandler:
                    lg.removeHandler(h)
            lg.propagate = True


class _DropMessages(logging.Filter):
    """Drops log records whose message starts with one of ``prefixes``."""

    def __init__(self, *prefixes: str) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


#: Lightning's advertisements (litlogger, litmodels), logged at INFO on every run without one of them
_LIGHTNING_TIPS = _DropMessages("\N{ELECTRIC LIGHT BULB} Tip:")
#: printed by W&B (``wandb.termwarn``, once a process) on every run: Lightning's ``WandbLogger`` always passes the
#: ``anonymous`` setting, which the wandb SDK no longer uses
_WANDB_ANONYMOUS = "The anonymous setting has no effect and will be removed in a future version."


def quiet_third_party() -> None:
    """Silence, in this process, third-party messages that say nothing to a vitrel user and come on every run:
    torch's deprecation of ``LeafSpec`` (a ``FutureWarning`` from inside Lightning), Lightning's tips advertising
    ``litlogger`` / ``litmodels``, and W&B's notice about the ``anonymous`` setting (which Lightning's
    ``WandbLogger`` passes itself). Called by the entry points (``train.py``, ``eval.py``, ``predict.py``,
    ``vitrel-train``, ``vitrel-eval``), never on import of the library: code that imports vitrel keeps every
    warning."""
    warnings.filterwarnings(
        "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
    )
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(_LIGHTNING_TIPS)
    try:
        from wandb.errors import term
    except ImportError:
        return
    # wandb has no filter for its messages; one given with repeat=False (as this one) is printed only while its text
    # (after termwarn's "WARNING" prefix) is not in this set yet
    shown, prefix = getattr(term, "_printed_messages", None), getattr(term, "WARN_STRING", None)
    if isinstance(shown, set) and isinstance(prefix, str):
        shown.add(f"{prefix} {_WANDB_ANONYMOUS}")


def progress_bar_kind(requested: str | bool = "auto") -> str:
    """``auto``: ``rich`` on a terminal, ``lines`` (plain lines) when stdout is not a TTY. ``false`` is ``none`` and
    ``true`` is ``auto``, as Lightning's ``enable_progress_bar`` (``progress_bar=false`` reaches here as "False")."""
    requested = {"false": "none", "true": "auto"}.get(str(requested).lower(), str(requested))
    if requested not in ("auto", "rich", "tqdm", "lines", "none"):
        raise ValueError(f"progress_bar must be auto, rich, tqdm, lines or none, got {requested!r}")
    if requested == "auto":
        return "rich" if sys.stdout.isatty() else "lines"
    return requested


def progress_display(requested: str | bool, callbacks_cfg: DictConfig | None, callbacks: list[Callback]) -> str:
    """:func:`progress_bar_kind`, or ``own`` when ``callbacks`` hold a Lightning progress bar of one's own
    (``+callbacks.bar={_target_: ...RichProgressBar, leave: true}``): that is the display, with ``progress_bar=auto``;
    another ``progress_bar`` is a :class:`~vitrel.config.ConfigError` naming the callback."""
    from lightning.pytorch.callbacks import ProgressBar

    from vitrel.config import ConfigError

    own = [type(cb).__name__ for cb in callbacks if isinstance(cb, ProgressBar)]
    if not own:
        return progress_bar_kind(requested)
    requested = {"false": "none", "true": "auto"}.get(str(requested).lower(), str(requested))
    if requested != "auto":
        entries = (callbacks_cfg or {}).items()
        names = [n for n, e in entries if e is not None and str(e.get("_target_", "")).endswith(f".{own[0]}")]
        raise ConfigError(
            f"progress_bar={requested} with a progress bar among the callbacks "
            f"({f'callbacks.{names[0]}: ' if names else ''}{own[0]}), which is the display: leave progress_bar=auto, "
            "or drop the callback"
        )
    return "own"


def progress_callbacks(kind: str) -> list[Callback]:
    """The progress display for ``progress_bar_kind(...)``: a rich bar, plain lines, or nothing
    (``tqdm`` is Lightning's default bar, which needs no callback; ``own``: a callback of one's own)."""
    from vitrel.train.progress import LineProgress

    if kind == "rich":
        return [RichProgressBar()]
    if kind == "lines":
        return [LineProgress()]
    return []


def hydra_config() -> Any | None:
    """Hydra's runtime config (``HydraConfig.get()``) when running under Hydra, else None."""
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get() if HydraConfig.initialized() else None


def task_overrides() -> list[str]:
    """The command line's overrides of this Hydra job (``hydra.overrides.task``); ``[]`` outside Hydra."""
    hc = hydra_config()
    return list(hc.overrides.task) if hc is not None else []


def override_key(override: str) -> str:
    """The key a command-line override sets: ``"data.img_size"`` for ``data.img_size=48``, ``+x.y=1``, ``~x.y``."""
    return override.lstrip("+~").split("=")[0]


def is_multirun() -> bool:
    """Whether this job is one of a ``-m`` sweep."""
    from hydra.types import RunMode

    hc = hydra_config()
    return hc is not None and hc.mode == RunMode.MULTIRUN


class AcceleratorUnavailableError(RuntimeError):
    """The trainer asks for an accelerator this machine does not have (a GPU where PyTorch sees none)."""


def check_accelerator(trainer_cfg: DictConfig, task: str = "train") -> None:
    """``trainer.accelerator`` gpu / cuda / mps on a machine without one: an :class:`AcceleratorUnavailableError`
    naming the trainer option and accelerator asked for and the CPU settings to ``task`` with instead (``"train"``,
    ``"evaluate"``), before anything is built (Lightning's own error, inside Hydra's traceback, names neither)."""
    from lightning.pytorch.accelerators import CUDAAccelerator, MPSAccelerator

    acc = str(trainer_cfg.get("accelerator", "auto"))
    kinds = {"gpu": (CUDAAccelerator, MPSAccelerator), "cuda": (CUDAAccelerator,), "mps": (MPSAccelerator,)}
    if acc.lower() not in kinds or any(kind.is_available() for kind in kinds[acc.lower()]):
        return
    hc = hydra_config()
    choice = hc.runtime.choices.get("trainer") if hc is not None else None
    named = choice not in (None, "default", "cpu")
    asked = f"trainer={choice} (trainer.accelerator={acc})" if named else f"trainer.accelerator={acc}"
    device = {"cuda": "a CUDA GPU", "mps": "an Apple GPU (MPS)"}.get(acc.lower(), "a GPU")
    built = "" if torch.version.cuda else "; this PyTorch is built without CUDA"
    if str(trainer_cfg.get("strategy", "auto")).startswith("ddp"):
        fix = (
            "for DDP on the CPU add trainer.accelerator=cpu trainer.devices=2 trainer.precision=32-true (2 processes), "
            f"or {task} in one process with trainer=cpu"
        )
    elif named:
        kept = "bf16 autocast and compiled step, minutes of compiling on a CPU" if choice == "gpu" else "other settings"
        fix = f"{task} on the CPU with trainer=cpu (trainer.accelerator=cpu alone keeps trainer={choice}'s {kept})"
    else:
        fix = f"{task} on the CPU with trainer.accelerator=cpu (or auto: a GPU where there is one), or trainer=cpu"
    raise AcceleratorUnavailableError(f"{asked} asks for {device}, and PyTorch sees none on this machine{built}: {fix}")


@contextmanager
def one_line_errors(script: str) -> Iterator[None]:
    """Errors about the user's files, sizes and machine (an unreadable or mismatched checkpoint, a missing or altered
    data set, a busy run folder, a data set over the memory budget, images the model cannot cut into patches, a resume
    with another validation split, or mid-epoch with another batch size or number of processes, a GPU trainer on a
    machine without one, an attention kernel that cannot run there, a non-finite training loss) end a single run
    with their message alone, ``<script>: <message>`` (exit code 1), as ``predict.py`` does: the message says what to
    do, a traceback adds nothing. Hydra's ``InstantiationException`` around one of them, or around a ``ValueError``
    vitrel's own code raised (a bad data, model or scheme setting: ``data.batch_size=0``, ``model.num_heads=5``,
    ``pos.fov=60``), is unwrapped: ``<script>: data: ValueError: <message>`` (the config key, then the error). Under
    ``-m`` they are raised, so that the job fails as Hydra's jobs fail and the sweep goes on."""
    from hydra.errors import InstantiationException

    from vitrel.config import ConfigError
    from vitrel.data.datasets import DatasetIntegrityError, DatasetNotFoundError, SplitMismatchError
    from vitrel.data.memory import MemoryBudgetError
    from vitrel.data.shards import ShardCountError, ShardSplitError
    from vitrel.kernels.registry import KernelDeviceError
    from vitrel.models.ckpt_files import CheckpointError
    from vitrel.models.input_size import InputSizeError
    from vitrel.train.callbacks import NonFiniteLossError, ResumePositionError
    from vitrel.train.data_contract import TargetError
    from vitrel.train.rundir import RunFolderBusy

    user_errors = (
        CheckpointError,
        DatasetNotFoundError,
        DatasetIntegrityError,
        SplitMismatchError,
        RunFolderBusy,
        MemoryBudgetError,
        ResumePositionError,
        AcceleratorUnavailableError,
        ConfigError,
        NonFiniteLossError,
        TargetError,
        ShardCountError,
        ShardSplitError,
        KernelDeviceError,
    )
    try:
        yield
    except (*user_errors, InputSizeError) as e:
        if is_multirun():
            raise
        raise SystemExit(f"{script}: {type(e).__name__}: {e}") from None
    except InstantiationException as e:
        cause = e.__cause__
        while isinstance(cause, InstantiationException):  # (one per nested _target_)
            cause = cause.__cause__
        if is_multirun() or not (isinstance(cause, user_errors) or _raised_by_vitrel(cause)):
            raise
        key = next((line[len("full_key: ") :] for line in str(e).splitlines() if line.startswith("full_key: ")), "")
        raise SystemExit(f"{script}: {key + ': ' if key else ''}{type(cause).__name__}: {cause}") from None


def _raised_by_vitrel(error: BaseException | None) -> bool:
    """Whether ``error`` is a ``ValueError`` raised by vitrel's own code (a data module, a model or a position scheme
    refusing a setting), not by a library it called (numpy on a damaged file, torch: there the traceback says
    more)."""
    import vitrel

    if not isinstance(error, ValueError) or error.__traceback__ is None:
        return False
    tb = error.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    return Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(Path(vitrel.__file__).resolve().parent)


def check_data_fits_model(dm: Any, model: torch.nn.Module, whose: str = "the model", training: bool = True) -> None:
    """Refuse, before any batch is made, data settings that the model ``model`` cannot take, naming the key and its
    value: ``data.patch_size`` (NaFlex batches, ``data.packing``) other than the model's patch size, and a side of
    ``data.size_choices`` that is not a positive multiple of it (or, for a model built with a strict input size, not
    its ``img_size``), as an :class:`~vitrel.models.input_size.InputSizeError` (one line from ``train.py``).
    ``whose`` names the model in the message (``evaluate``: the checkpoint). Models without a ``vitrel_cfg`` patch
    size are not checked. A video scheme fed token layouts (NaFlex batches; ``model.token_drop`` when ``training``) is
    a :class:`~vitrel.config.ConfigError`."""
    from timm.layers import to_2tuple

    from vitrel.models.input_size import InputSizeError

    _check_schemes_take_layouts(dm, model, training)
    patch = (getattr(model, "vitrel_cfg", None) or {}).get("patch_size")
    if patch is None:
        return
    ph, pw = (int(v) for v in to_2tuple(patch))
    shown = ph if ph == pw else f"{ph}x{pw}"
    if getattr(dm, "packing", None) is not None and dm.patch_size is not None and (dm.patch_size,) * 2 != (ph, pw):
        raise InputSizeError(
            f"data.patch_size={dm.patch_size} but {whose} has patches of {shown}: NaFlex batches (data.packing="
            f"{dm.packing}) are cut into the model's patches; set data.patch_size={shown}"
        )
    choices = getattr(dm, "size_choices", None)
    if choices:
        bad = [s for s in choices if s < max(ph, pw) or s % ph or s % pw]
        if bad:
            raise InputSizeError(
                f"data.size_choices={list(choices)}: {', '.join(map(str, bad))} "
                f"{'is' if len(bad) == 1 else 'are'} not a positive multiple of the patch size {shown} of {whose}"
            )
        img = tuple(getattr(model, "img_size", ()) or ())
        fixed = [s for s in choices if (s, s) != img] if getattr(model, "strict_img_size", False) else []
        if fixed:
            raise InputSizeError(
                f"data.size_choices={list(choices)}: {whose} takes only its img_size {img} (strict_img_size); "
                "build it with dynamic_img_size=True (model.dynamic_img_size=true) for batches of other sizes"
            )


def _check_schemes_take_layouts(dm: Any, model: torch.nn.Module, training: bool) -> None:
    """NaFlex batches (``data.packing``) and token dropping (``model.token_drop``) give the attention token layouts,
    which a video scheme inside it (``rel3d_full`` on an image model: one frame) does not take: a
    :class:`~vitrel.config.ConfigError` naming its image form, before any batch (it came from the first forward, a
    traceback through Lightning's sanity check)."""
    from vitrel.config import ConfigError
    from vitrel.pos.base import PositionScheme
    from vitrel.pos.registry import image_scheme

    packing, drop = getattr(dm, "packing", None), getattr(model, "token_drop", 0) if training else 0
    if packing is None and not drop:
        return
    for m in model.modules():
        if isinstance(m, PositionScheme) and m.kind != "absolute" and m.grid_dims == 3:
            given = f"data.packing={packing} (NaFlex batches)" if packing is not None else f"model.token_drop={drop}"
            image = image_scheme(type(m))
            raise ConfigError(
                f"pos={m.name} takes full video grids (T, H, W), and {given} gives the attention packed or "
                "token-dropped images, which video schemes do not take"
                + (f": use pos={image}, the same scheme on images" if image else "")
            )


# ------------------------------------------------------------------------------------------ video
def is_video_data(dm: Any) -> bool:
    """Whether the data module gives clips ``[B, C, T, H, W]`` (a :class:`vitrel.data.video.VideoDataModule`, or
    ``eval.py``'s test split of one, its ``scored_data``)."""
    from vitrel.data.video.base import VideoDataModule

    return isinstance(getattr(dm, "scored_data", dm), VideoDataModule)


def is_video_architecture(name: str) -> bool:
    """Whether the vitrel architecture ``name`` takes clips: its class is built with ``num_frames``."""
    from vitrel.models.registry import MODEL_ARGS, check_architecture

    cls = MODEL_ARGS[check_architecture(name)][0]
    return "num_frames" in inspect.signature(cls.__init__).parameters


def _model_configs(video: bool) -> list[str]:
    """The ``conf/model`` options whose architecture takes clips (``video``) or images."""
    from vitrel.models.registry import MODEL_ARGS

    out = []
    for path in sorted((Path(__file__).resolve().parents[2] / "conf" / "model").glob("*.yaml")):
        name = OmegaConf.load(path).get("name")
        if name in MODEL_ARGS and is_video_architecture(name) == video:
            out.append(f"model={path.stem}")
    return out


def check_video_pairing(architecture: str, dm: Any, whose: str = "the model", fix: str | None = None) -> None:
    """Refuse, before anything is built, a video data module with an image architecture or image data with a video
    architecture (a :class:`~vitrel.config.ConfigError`), naming the ``conf/model`` options that fit the data
    (``fix``: the advice instead, e.g. eval.py's data to score a checkpoint on)."""
    video = is_video_data(dm)
    if video == is_video_architecture(architecture):
        return
    from vitrel.config import ConfigError  # (a ValueError: train.py and eval.py print it as one line)

    data = type(dm).__name__
    if video:
        fits = ", ".join(_model_configs(True)) or "a vitrel_vit_video_* or vitrel_swin3d_* architecture"
        raise ConfigError(
            f"{data} gives clips [B, C, T, H, W] but {whose} ({architecture}) is an image model "
            f"(images [B, C, H, W]): {fix or 'use a video model: ' + fits}"
        )
    models = ", ".join(_model_configs(False))
    raise ConfigError(
        f"{data} gives images [B, C, H, W] but {whose} ({architecture}) is a video model (clips [B, C, T, H, W]): "
        f"{fix or f'use an image model ({models}) or video data (data=moving_fmnist, data=video_folder)'}"
    )


def check_channels_fit(model_cfg: DictConfig, dm: Any) -> None:
    """A ``model.in_chans`` set on the command line that the data's images do not have (``+model.in_chans=1`` on
    RGB data) is refused before the model is built, naming the keys; the model's own error came at the first step,
    under a traceback. Not checked: ``model=from_checkpoint`` (its first layer is adapted to the data's channels)."""
    from vitrel.models.input_size import InputSizeError

    want, have = model_cfg.get("in_chans"), getattr(dm, "in_chans", None)
    if want is None or have is None or int(want) == int(have) or model_cfg.get("path") is not None:
        return
    # grey data that repeats its channel on request (Fashion-MNIST, Moving Fashion-MNIST: data.in_chans=3)
    takes = int(want) == 3 and "in_chans" in inspect.signature(type(dm).__init__).parameters
    data = "data.in_chans=3 or " if takes else ""
    raise InputSizeError(
        f"model.in_chans={want} but {type(dm).__name__} gives {have}-channel images: set {data}leave model.in_chans "
        "unset (the data sets it)"
    )
