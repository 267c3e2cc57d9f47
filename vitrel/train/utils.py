"""Helpers shared by ``train`` and ``evaluate``: building objects from their config nodes, the run
folder, Hydra's runtime state, the log file, the entry points' warning filters.

Every config node that builds an object has a ``_target_`` (``hydra.utils.instantiate``);
``instantiate_callbacks`` / ``instantiate_loggers`` build the named entries of ``cfg.callbacks`` /
``cfg.logger`` (``null`` switches an entry off), as in lightning-hydra-template.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback
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
    "hydra_config",
    "override_key",
    "task_overrides",
    "is_multirun",
    "AcceleratorUnavailableError",
    "check_accelerator",
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
