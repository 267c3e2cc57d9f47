"""Reading weight files safely: Lightning checkpoints (``torch.load(..., weights_only=True)`` only), safetensors and
their metadata, exported ``config.json``; every failure a :class:`CheckpointError` naming the file and the reason.
:mod:`vitrel.models.checkpoint` builds loading and exporting on it."""

from __future__ import annotations

import json
import logging
import os
import pickle
import pickletools
import re
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

__all__ = [
    "CheckpointError",
    "CONFIG_NAME",
    "WEIGHTS_NAME",
    "clean_state_dict",
    "extract_model_state",
    "follow_umask",
    "run_checkpoint",
    "stored_config",
    "timm_bin_config",
]

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
#: timm's ``save_for_hf`` weights without safetensors (its default), with its ``config.json`` beside them
TIMM_BIN_NAME = "pytorch_model.bin"
_EMA_PREFIXES = ("ema_model.", "model_ema.", "ema.")


def has_ema_keys(state_dict: Any) -> bool:
    """Whether a state dict holds an EMA copy (keys under Lightning's / timm's EMA prefixes)."""
    return isinstance(state_dict, Mapping) and any(k.startswith(_EMA_PREFIXES) for k in state_dict)


_STRIP = ("_orig_mod.", "module.")
_LAST, _BEST = "last.ckpt", "best-epoch*.ckpt"  # what train.py's callbacks write in <run folder>/checkpoints/

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded: unsafe, truncated/corrupt, or not matching the model."""


# ---------------------------------------------------------------------------- writing
def _umask() -> int:
    """The process's umask, read without changing it where the OS says it (Linux ``/proc``); else set and restored."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(path: str | os.PathLike) -> None:
    """Give a file the permissions ``open()`` would have (``0o666`` less the umask: ``0644`` under umask 022); for
    files written by a library that creates them ``0600`` (safetensors' ``save_file``, ``tempfile.mkstemp``)."""
    os.chmod(path, 0o666 & ~_umask())


# ---------------------------------------------------------------------------- state dicts
def _strip_leading(key: str) -> str:
    changed = True
    while changed:
        changed = False
        for p in _STRIP:
            if key.startswith(p):
                key, changed = key[len(p) :], True
    return key


def clean_state_dict(state_dict: Mapping[str, Any], prefix: str | None = None) -> dict[str, Tensor]:
    """The backbone's weights from a (possibly wrapped) state dict.

    Keeps the keys under ``prefix`` (default: ``"model."`` when any key has it, else all keys), strips
    it and any leading ``_orig_mod.`` (``torch.compile``) / ``module.`` (DDP, ``AveragedModel``), and
    drops ``n_averaged`` counters.
    """
    keys = list(state_dict)
    if prefix is None:
        prefix = "model." if any(k.startswith("model.") for k in keys) else ""
    out: dict[str, Tensor] = {}
    for k in keys:
        if not k.startswith(prefix):
            continue
        name = _strip_leading(k[len(prefix) :])
        if name == "n_averaged":
            continue
        v = state_dict[k]
        if not isinstance(v, Tensor):
            raise CheckpointError(f"state dict entry {k!r} is a {type(v).__name__}, not a tensor")
        out[name] = v
    if not out:
        raise CheckpointError(f"no weights under the prefix {prefix!r} in the state dict (keys: {_preview(keys)})")
    return out


def extract_model_state(ckpt: Mapping[str, Any], use_ema: bool = False) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """``(vitrel_cfg, state_dict)`` of the backbone in a training checkpoint (already ``torch.load``-ed).

    Expected keys (what ``vitrel.train`` writes):

    * ``ckpt["vitrel_cfg"]``: ``model.vitrel_cfg`` - a plain dict with ``"architecture"`` and the
      constructor arguments; the LightningModule stores it at the top level in ``on_save_checkpoint``.
      Fallback: ``ckpt["hyper_parameters"]["vitrel_cfg"]``.
    * ``ckpt["state_dict"]``: the LightningModule's state dict; the backbone's weights under
      ``"model."`` (``"model._orig_mod."`` when compiled with ``torch.compile``), EMA weights (if
      any) under ``"ema_model."`` / ``"model_ema."`` / ``"ema."`` (optionally followed by
      ``"module."``). Other entries (loss modules, metrics) are ignored.

    A plain ``{"vitrel_cfg": ..., "state_dict": <backbone state dict>}`` works too. Everything in the
    file must be tensors and plain containers (str, int, float, bool, None, list, tuple, dict): the
    file is read with ``weights_only=True``, so e.g. Hydra ``DictConfig`` objects in
    ``hyper_parameters`` make it unreadable - store ``OmegaConf.to_container(cfg)`` instead.

    Args:
        ckpt: the loaded checkpoint dict.
        use_ema: take the EMA weights instead of the live ones (error if there are none).
    """
    if not isinstance(ckpt, Mapping):
        raise CheckpointError(f"a training checkpoint is a dict, got {type(ckpt).__name__}")
    cfg = ckpt.get("vitrel_cfg")
    if cfg is None:
        hp = ckpt.get("hyper_parameters")
        if isinstance(hp, Mapping):
            cfg = hp.get("vitrel_cfg")
    if not isinstance(cfg, Mapping) or "architecture" not in cfg:
        raise CheckpointError(
            "the checkpoint has no model configuration: expected a dict 'vitrel_cfg' with an 'architecture' at the "
            "top level (or in 'hyper_parameters'); is it a vitrel checkpoint? "
            f"top-level keys: {_preview(list(ckpt))}"
        )
    sd = ckpt.get("state_dict")
    if not isinstance(sd, Mapping):
        raise CheckpointError(f"the checkpoint has no 'state_dict' dict (top-level keys: {_preview(list(ckpt))})")
    return dict(cfg), ema_state_dict(sd) if use_ema else clean_state_dict(sd)


def ema_state_dict(state_dict: Mapping[str, Any]) -> dict[str, Tensor]:
    """The EMA copy's weights in a training module's state dict (under ``ema_model.`` / ``model_ema.`` / ``ema.``,
    then :func:`clean_state_dict`); a :class:`CheckpointError` when it holds none."""
    prefix = next((p for p in _EMA_PREFIXES if any(k.startswith(p) for k in state_dict)), None)
    if prefix is None:
        raise CheckpointError(f"use_ema=True but the checkpoint holds no EMA weights (prefixes {_EMA_PREFIXES})")
    return clean_state_dict(state_dict, prefix)


def _preview(keys: list, n: int = 8) -> str:
    s = ", ".join(map(str, keys[:n]))
    return s + (f", ... ({len(keys)} in all)" if len(keys) > n else "")


# ---------------------------------------------------------------------------- reading files
def _torch_load(path: Path, mmap: bool = False) -> Any:
    """``torch.load`` (weights only, on the CPU) with clear errors; ``mmap``: tensors stay on disk (zip files)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise CheckpointError(_unpickling_error(path, str(e))) from None
    except (
        RuntimeError,
        EOFError,
        OSError,
        ValueError,
        KeyError,
        IndexError,
        AttributeError,
        TypeError,
        SafetensorError,
    ) as e:
        raise CheckpointError(f"cannot read {path}: truncated or not a torch checkpoint ({_first_line(e)})") from None


# torch's weights-only unpickler names the global it refused ("Unsupported global: GLOBAL numpy...",
# "Trying to load unsupported GLOBAL posix.system ..."); any other failure of it ("Unsupported operand 66")
# is either a pickle in a form it does not read (a bare pickle.dump) or bytes that are no pickle at all
_REFUSED_GLOBAL = re.compile(r"unsupported (?:global:\s*)?GLOBAL\s+(\S+)", re.IGNORECASE)
_UNPICKLER_SAID = re.compile(r"WeightsUnpickler error:\s*(\S[^\n]*)")


def _unpickling_error(path: Path, msg: str) -> str:
    """Our message for torch's ``UnpicklingError``: an unsafe pickle (objects other than tensors and
    plain containers: refused, unpickling them could run code) told apart from a damaged or foreign file."""
    refused = _REFUSED_GLOBAL.search(msg)
    names = [refused.group(1)] if refused else _pickle_globals(path)
    if names is not None:
        what = f"globals: {', '.join(sorted(set(names))[:4])}" if names else "a pickle torch's safe reader refuses"
        return (
            f"refused to load {path}: it holds pickled objects other than tensors and plain containers ({what}), "
            "which could run code when unpickled. vitrel reads only tensors, numbers, strings and containers: "
            "save the state dict (torch.save(model.state_dict(), ...)) or a .safetensors file instead"
        )
    said = _UNPICKLER_SAID.search(msg)
    detail = said.group(1).strip() if said else (msg.strip().splitlines() or ["no detail"])[-1]
    return f"cannot read {path}: damaged, truncated or not a torch checkpoint (the unpickler stopped: {detail})"


def _pickle_globals(path: Path) -> list[str] | None:
    """The globals a bare pickle file names, read with ``pickletools`` (which executes nothing); None
    when the file is a zip archive or its bytes are not a well-formed pickle (damaged, another format)."""
    if zipfile.is_zipfile(path):
        return None
    names: list[str] = []
    strings: list[str] = []
    try:
        with open(path, "rb") as f:
            for op, arg, _ in pickletools.genops(f):
                if op.name == "GLOBAL":
                    names.append(str(arg).replace(" ", "."))
                elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                    names.append(f"{strings[-2]}.{strings[-1]}")
                elif isinstance(arg, str):
                    strings.append(arg)
    except Exception:  # any parse failure (unknown opcode, cut short, bad argument) means: not a pickle
        return None
    return names


def _first_line(e: BaseException) -> str:
    """``Type: first sentence`` of an exception (torch's zip reader appends a paragraph of advice)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0].split('. ')[0]}" if lines else type(e).__name__


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            out = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read the configuration {path}: {e}") from None
    if not isinstance(out, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return out


def _cfg_from_config_json(cfg: Mapping[str, Any], where: Path) -> dict[str, Any]:
    """``vitrel_cfg`` from an exported ``config.json`` (ours, or timm's architecture + model_args)."""
    if isinstance(cfg.get("vitrel_cfg"), Mapping):
        return dict(cfg["vitrel_cfg"])
    if "architecture" in cfg:
        return {"architecture": cfg["architecture"], **dict(cfg.get("model_args") or {})}
    raise CheckpointError(f"{where} has neither 'vitrel_cfg' nor 'architecture'")


def _safetensors_metadata(path: Path) -> dict[str, str]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: truncated or not a safetensors file ({e})") from None


def run_checkpoint(path: str | os.PathLike, say: bool = True) -> Path:
    """The checkpoint to load for ``path``: ``path`` itself unless it is the folder of a ``train.py`` run (one with a
    ``checkpoints/`` folder, or that folder: holding ``last.ckpt`` or ``best-epoch*.ckpt``; not an export folder).
    There it is ``last.ckpt``, the final weights, which the run's own test scored (``train.py`` tests the weights it
    ends with, not the best-epoch file); without one, the single ``best-epoch*.ckpt``. ``say``: log one line naming
    the file taken and why."""
    p = Path(path)
    if not p.is_dir() or (p / WEIGHTS_NAME).is_file():
        return p
    folder = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    last, best = folder / _LAST, sorted(folder.glob(_BEST))
    if folder is p and not (last.is_file() or best):
        if not _weight_files(p):
            _refuse_run_folder(p)
        return p  # no run's checkpoints: an export or weights folder
    if last.is_file():
        chosen = last
        other = f"; {', '.join(f.name for f in best)}: the best validation epoch's, give it for that" if best else ""
        why = f"the run's final weights, which its own test scored{other}"
    elif len(best) == 1:
        chosen = best[0]
        why = f"the best validation epoch's; no {_LAST} (the final weights the run's test scored) is there"
    else:
        found = f"{len(best)} best-epoch files: {', '.join(f.name for f in best)}" if best else "no .ckpt"
        raise CheckpointError(f"{p} is a train.py run folder but {folder} has no {_LAST} and {found}: give the file")
    if say:
        log.info(f"{p} is a train.py run folder: taking {chosen.relative_to(p)}, {why}")
    return chosen


def _refuse_run_folder(p: Path) -> None:
    """:class:`CheckpointError` for a folder of Hydra's that holds no checkpoint: a run's (``.hydra/``), saying where to
    look, or a ``-m`` sweep's (``multirun.yaml``), naming its jobs' folders."""
    if (p / "multirun.yaml").is_file():
        jobs = sorted((d.name for d in p.iterdir() if (d / ".hydra").is_dir()), key=lambda n: (len(n), n))
        which = f"{len(jobs)} here, e.g. {p / jobs[0]}" if jobs else f"{p}/<job number>"
        raise CheckpointError(f"{p} is a -m sweep's folder: give the run folder of one of its jobs ({which})")
    if (p / ".hydra").is_dir():
        logs = ", ".join(f.name for f in sorted(p.glob("*.log"))) or "none"
        raise CheckpointError(
            f"{p} is a run folder (.hydra/) holding no checkpoint (no checkpoints/ folder, no weights file): its run "
            f"stopped before its first save, saved elsewhere, or was not train.py's (its log: {logs}). Give a run "
            "folder of train.py that saved checkpoints/, or a checkpoint file"
        )


def _weight_files(folder: Path) -> list[Path]:
    """The weights files of the first kind ``folder`` holds, in this order: ``.safetensors``, ``.ckpt``, ``.bin``,
    ``.pth``, ``.pt`` (sorted)."""
    for suffix in (".safetensors", ".ckpt", ".bin", ".pth", ".pt"):
        found = sorted(folder.glob(f"*{suffix}"))
        if found:
            return found
    return []


def _resolve(path: str | os.PathLike) -> Path:
    p = run_checkpoint(path, say=False)
    if p.is_dir():
        w = p / WEIGHTS_NAME
        if w.is_file():
            return w
        cands = _weight_files(p)
        if len(cands) != 1:
            hint = f"; {len(cands)} candidates: {', '.join(f.name for f in cands)}: give one" if cands else ""
            raise CheckpointError(
                f"{p} has no {WEIGHTS_NAME} (and no single .safetensors / .ckpt / .bin / .pth file){hint}"
            )
        return cands[0]
    if not p.is_file():
        raise CheckpointError(f"no such checkpoint: {p}")
    if p.suffix.lower() in (".pt2", ".json"):
        _refuse_export_file(p)
    if p.suffix.lower() == ".onnx":
        raise CheckpointError(
            f"{p} is an ONNX model, which runs in ONNX Runtime (onnxruntime.InferenceSession: input 'images', a "
            "video model's 'clips'; output 'logits'), not in PyTorch; its preprocessing (input_size, mean, std, resize "
            "...) is JSON in the file's own metadata, key 'vitrel_data_config' (get_modelmeta().custom_metadata_map; "
            "docs/export.md#onnx). Load the export folder or the .ckpt it came from (predict.py also takes the "
            "folder's model.pt2)"
        )
    return p


def _refuse_export_file(p: Path) -> None:
    """:class:`CheckpointError` for an export folder's ``model.pt2`` (a ``torch.export`` program, not weights) or its
    ``config.json`` (no weights): what loads them instead (docs/export.md)."""
    held = (p.parent / WEIGHTS_NAME).is_file() or (p.parent / TIMM_BIN_NAME).is_file()
    folder = f"vitrel.load_model('{p.parent}')" if held else None
    if p.suffix.lower() == ".pt2":
        then = f"; the weights beside it load with {folder}" if folder else ""
        raise CheckpointError(
            f"{p} is a torch.export program (python -m vitrel.export ... --pt2), not weights to rebuild a model from: "
            f"vitrel.export.load_program('{p}') gives the program and its preprocessing (torch.export.load(path) the "
            f"program; .module() runs it), predict.py ckpt_path={p} runs it on images{then}"
        )
    if p.name == CONFIG_NAME and folder:
        raise CheckpointError(
            f"{p} is an export folder's configuration, not its weights: load the folder, {folder} (or "
            f"timm.create_model('local-dir:{p.parent}', pretrained=True)), or give predict.py / eval.py "
            f"ckpt_path={p.parent}"
        )
    raise CheckpointError(f"{p} is a JSON file, not weights: give the checkpoint (.ckpt) or the export folder")


def stored_config(path: str | os.PathLike) -> dict[str, Any] | None:
    """The ``vitrel_cfg`` stored with weights at ``path`` (None if there is none), without the weights
    when it can (``config.json`` or safetensors metadata)."""
    p = _resolve(path)
    if p.suffix == ".safetensors":
        meta = _safetensors_metadata(p)
        if "vitrel_cfg" in meta:
            return _parse_meta(meta["vitrel_cfg"], p)
        cj = p.parent / CONFIG_NAME
        return _cfg_from_config_json(_read_json(cj), cj) if cj.is_file() else None
    ckpt = _torch_load(p, mmap=zipfile.is_zipfile(p))  # only the configuration is read: tensors stay on disk
    try:
        return extract_model_state(ckpt)[0]
    except CheckpointError:
        return timm_bin_config(p)


def timm_bin_config(p: Path) -> dict[str, Any] | None:
    """The ``vitrel_cfg`` of the ``config.json`` beside timm's ``pytorch_model.bin`` (``save_for_hf``'s default
    layout; None for another file, which holds a plain state dict)."""
    cj = p.parent / CONFIG_NAME
    return _cfg_from_config_json(_read_json(cj), cj) if p.name == TIMM_BIN_NAME and cj.is_file() else None


def _parse_meta(text: str, where: Path, key: str = "vitrel_cfg") -> dict[str, Any]:
    try:
        cfg = json.loads(text)
    except ValueError as e:
        raise CheckpointError(f"the {key} metadata of {where} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"the {key} metadata of {where} is not a JSON object")
    return cfg
