"""Loading and exporting vitrel weights, safely.

Two on-disk formats:

* training checkpoints (``.ckpt``, Lightning's ``torch.save`` dict; see :func:`extract_model_state`),
* exported weights: ``model.safetensors`` + ``config.json`` in a directory (the layout timm's
  ``local-dir:`` route and the Hugging Face Hub expect), or a lone ``.safetensors`` whose metadata
  holds the configuration under ``"vitrel_cfg"``.

Every model carries ``model.vitrel_cfg`` (architecture + constructor arguments); it is stored with
the weights, so :func:`load_model` rebuilds the right architecture and position scheme by itself. The
preprocessing of the data a model was trained on (its *data config*: timm's ``input_size``, ``mean``, ``std``,
``interpolation``, ``crop_pct``, ``crop_mode``, and the class names) is stored too (a training checkpoint's
``hyper_parameters["data_config"]``, an export's ``pretrained_cfg``); :func:`load_model` puts it into the model's
``pretrained_cfg``, where ``timm.data.resolve_data_config(model=model)`` finds it.

Safety: pickles are only ever read with ``torch.load(..., weights_only=True)``, which refuses any
global that is not a tensor/container type (a pickle that would call ``os.system`` is refused before
anything runs). Every failure - a pickled object, a truncated or corrupt file, weights of another
architecture - raises :class:`CheckpointError` with the reason.
"""

from __future__ import annotations

import json
import os
import pickle
import pickletools
import re
import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import timm
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from timm.models import filter_pretrained_cfg
from torch import Tensor, nn

from vitrel.models.registry import MODEL_ARGS, build, build_from_cfg

__all__ = [
    "CheckpointError",
    "extract_model_state",
    "clean_state_dict",
    "read_checkpoint",
    "read_weights",
    "check_checkpoint",
    "checkpoint_has_ema",
    "stored_config",
    "stored_data_config",
    "model_data_config",
    "data_config_for",
    "load_weights",
    "load_model",
    "save_pretrained",
    "export_model",
    "WEIGHTS_NAME",
    "CONFIG_NAME",
]

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
_EMA_PREFIXES = ("ema_model.", "model_ema.", "ema.")
_STRIP = ("_orig_mod.", "module.")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded: unsafe, truncated/corrupt, or not matching the model."""


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
    if use_ema:
        prefix = next((p for p in _EMA_PREFIXES if any(k.startswith(p) for k in sd)), None)
        if prefix is None:
            raise CheckpointError(f"use_ema=True but the checkpoint holds no EMA weights (prefixes {_EMA_PREFIXES})")
        state = clean_state_dict(sd, prefix)
    else:
        state = clean_state_dict(sd)
    return dict(cfg), state


def _preview(keys: list, n: int = 8) -> str:
    s = ", ".join(map(str, keys[:n]))
    return s + (f", ... ({len(keys)} in all)" if len(keys) > n else "")


# ---------------------------------------------------------------------------- reading files
def _torch_load(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(_unpickling_error(path, str(e))) from None
    except (RuntimeError, EOFError, OSError, ValueError, KeyError, AttributeError, TypeError, SafetensorError) as e:
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


def _resolve(path: str | os.PathLike) -> Path:
    p = Path(path)
    if p.is_dir():
        w = p / WEIGHTS_NAME
        if w.is_file():
            return w
        cands = sorted(p.glob("*.safetensors")) or sorted(p.glob("*.ckpt"))
        cands = cands or sorted(p.glob("*.bin")) or sorted(p.glob("*.pth")) or sorted(p.glob("*.pt"))
        if len(cands) != 1:
            raise CheckpointError(f"{p} has no {WEIGHTS_NAME} (and no single .safetensors / .ckpt / .bin / .pth file)")
        return cands[0]
    if not p.is_file():
        raise CheckpointError(f"no such checkpoint: {p}")
    return p


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
    ckpt = _torch_load(p)
    try:
        return extract_model_state(ckpt)[0]
    except CheckpointError:
        return None


def _parse_meta(text: str, where: Path, key: str = "vitrel_cfg") -> dict[str, Any]:
    try:
        cfg = json.loads(text)
    except ValueError as e:
        raise CheckpointError(f"the {key} metadata of {where} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"the {key} metadata of {where} is not a JSON object")
    return cfg


# ---------------------------------------------------------------------------- data configs
#: timm's ``pretrained_cfg`` fields of the preprocessing (a data config also holds ``class_names``)
DATA_FIELDS = ("input_size", "mean", "std", "interpolation", "crop_pct", "crop_mode")


def _data_fields(src: Mapping[str, Any]) -> dict[str, Any]:
    """The data-config fields of ``src`` (a stored data config or a ``pretrained_cfg``: ``label_names`` are the class
    names; ``img_size``, the side or ``[H, W]``, as written by hand before ``input_size``)."""
    out = {k: src[k] for k in (*DATA_FIELDS, "img_size") if src.get(k) is not None}
    names = src.get("class_names") or src.get("label_names")
    if names:
        out["class_names"] = [str(n) for n in names]
    return out


def stored_data_config(path: str | os.PathLike) -> dict[str, Any] | None:
    """The data config stored with the weights at ``path``, None when there is none.

    A training checkpoint: ``hyper_parameters["data_config"]`` (what ``vitrel.train`` writes), or Lightning's
    ``datamodule_hyper_parameters`` when they hold the statistics. An export: its safetensors metadata
    ``"data_config"``, else the ``pretrained_cfg`` of the ``config.json`` beside it (timm's fields, ``label_names``
    as the class names).
    """
    p = _resolve(path)
    if p.suffix == ".safetensors":
        meta = _safetensors_metadata(p)
        if "data_config" in meta:
            return _data_fields(_parse_meta(meta["data_config"], p, "data_config")) or None
        cj = p.parent / CONFIG_NAME
        if not cj.is_file():
            return None
        pcfg = _read_json(cj).get("pretrained_cfg")
        return (_data_fields(pcfg) or None) if isinstance(pcfg, Mapping) and "mean" in pcfg else None
    try:
        ckpt = torch.load(p, map_location="cpu", weights_only=True, mmap=True)  # tensors stay on disk
    except Exception:  # noqa: BLE001 - an unreadable file is reported by the weights' reader, with its reason
        return None
    if not isinstance(ckpt, Mapping):
        return None
    hp = ckpt.get("hyper_parameters")
    hp = hp if isinstance(hp, Mapping) else {}
    for cand in (hp.get("data_config"), hp.get("data"), ckpt.get("datamodule_hyper_parameters")):
        if isinstance(cand, Mapping) and any(k in cand for k in ("mean", "std", "input_size", "img_size")):
            return _data_fields(cand)
    return None


def model_data_config(model: nn.Module, stored: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The preprocessing of ``model``: ``input_size``, ``mean``, ``std``, ``interpolation``, ``crop_pct``,
    ``crop_mode`` (and ``class_names`` when known), as timm's data config.

    ``stored`` (a data config stored with the weights) wins over the model's ``pretrained_cfg`` (where
    :func:`load_model` put the stored one already); the input size and channels are the model's (``vitrel_cfg``).
    Means and standard deviations of another channel count are averaged to the model's channels (a grey model
    with the RGB statistics of its architecture's defaults).
    """
    src = {**_data_fields(getattr(model, "pretrained_cfg", None) or {}), **_data_fields(stored or {})}
    cfg = getattr(model, "vitrel_cfg", None) or {}
    in_chans = int(cfg.get("in_chans", src.get("input_size", (3,))[0]))
    size = cfg.get("img_size", src.get("input_size", (3, 224, 224))[1:])
    h, w = (size, size) if isinstance(size, int) else tuple(size)
    out = {
        "input_size": [in_chans, int(h), int(w)],
        "mean": [float(v) for v in src.get("mean", (0.5,) * in_chans)],
        "std": [float(v) for v in src.get("std", (0.5,) * in_chans)],
        "interpolation": str(src.get("interpolation", "bicubic")),
        "crop_pct": float(src.get("crop_pct", 1.0)),
        "crop_mode": str(src.get("crop_mode", "center")),
    }
    for key in ("mean", "std"):
        if len(out[key]) != in_chans:
            out[key] = [sum(out[key]) / len(out[key])] * in_chans
    if src.get("class_names"):
        out["class_names"] = list(src["class_names"])
    return out


def data_config_for(path: str | os.PathLike, model: nn.Module) -> dict[str, Any]:
    """:func:`model_data_config` of ``model`` loaded from ``path``, with one warning, naming the statistics used,
    when ``path`` stores no data config (a checkpoint written before vitrel stored one, or by hand): they are then
    the architecture's defaults, which need not be the training data's."""
    stored = stored_data_config(path)
    out = model_data_config(model, stored)
    if stored is None:
        stats = ", ".join(f"{k} {out[k]}" for k in ("mean", "std", "interpolation", "crop_pct"))
        warnings.warn(
            f"{path} stores no data config (the preprocessing of its training data; checkpoints of vitrel.train "
            f"store it in hyper_parameters['data_config']): images are normalised with {stats}, the architecture's "
            "defaults, which need not be the statistics the model was trained with",
            stacklevel=2,
        )
    return out


def pretrained_cfg_fields(data_config: Mapping[str, Any]) -> dict[str, Any]:
    """A data config as timm's ``pretrained_cfg`` fields (tuples; the class names as ``label_names``)."""
    out = {k: tuple(v) if isinstance(v, list) else v for k, v in data_config.items() if k in DATA_FIELDS}
    if data_config.get("class_names"):
        out["label_names"] = tuple(data_config["class_names"])
    return out


def _set_data_config(model: nn.Module, data_config: Mapping[str, Any]) -> None:
    """Put a data config into ``model.pretrained_cfg`` (:func:`pretrained_cfg_fields`)."""
    pcfg = {
        **dict(getattr(model, "pretrained_cfg", None) or {}),
        **pretrained_cfg_fields(model_data_config(model, data_config)),
    }
    model.pretrained_cfg = model.default_cfg = pcfg  # (timm keeps both names)


def _load_safetensors(p: Path) -> dict[str, Tensor]:
    try:
        return load_file(str(p), device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {p}: truncated or not a safetensors file ({e})") from None


def _plain_state(obj: Any, p: Path, use_ema: bool) -> dict[str, Tensor]:
    """The weights of a torch file without a vitrel configuration: a plain state dict, or a dict with
    ``state_dict`` (Lightning, timm's train script; ``state_dict_ema`` with ``use_ema``) or ``model`` (DeiT)."""
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"{p} holds a {type(obj).__name__}, not a state dict")
    if use_ema:
        if isinstance(obj.get("state_dict_ema"), Mapping):
            return clean_state_dict(obj["state_dict_ema"])
        return extract_model_state(obj, use_ema=True)[1] if isinstance(obj.get("state_dict"), Mapping) else {}
    for key in ("state_dict", "model"):
        if isinstance(obj.get(key), Mapping):
            return clean_state_dict(obj[key])
    return clean_state_dict(obj)


def read_weights(path: str | os.PathLike, use_ema: bool = False) -> tuple[dict[str, Any] | None, dict[str, Tensor]]:
    """``(vitrel_cfg or None, state_dict)`` from a ``.ckpt``, a ``.safetensors`` file (configuration in its
    metadata or a ``config.json`` beside it), a torch file (``.pth``, ``.bin``, ``.pt``) or an export
    directory. The configuration is None for a plain state dict (timm's ``checkpoint_path`` files)."""
    p = _resolve(path)
    if p.suffix == ".safetensors":
        meta = _safetensors_metadata(p)
        cfg = None
        if "vitrel_cfg" in meta:
            cfg = _parse_meta(meta["vitrel_cfg"], p)
        elif (p.parent / CONFIG_NAME).is_file():
            cfg = _cfg_from_config_json(_read_json(p.parent / CONFIG_NAME), p.parent / CONFIG_NAME)
        if use_ema:
            raise CheckpointError(f"{p} holds exported weights only; use_ema applies to training checkpoints")
        return cfg, clean_state_dict(_load_safetensors(p), prefix="")
    obj = _torch_load(p)
    try:
        return extract_model_state(obj, use_ema=use_ema)
    except CheckpointError:
        if isinstance(obj, Mapping) and ("vitrel_cfg" in obj or "hyper_parameters" in obj):
            raise
    sd = _plain_state(obj, p, use_ema)
    if not sd:
        raise CheckpointError(f"{p} holds no EMA weights" if use_ema else f"{p} holds no weights")
    return None, sd


def read_checkpoint(path: str | os.PathLike, use_ema: bool = False) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """``(vitrel_cfg, state_dict)`` of a file that carries its configuration (see :func:`read_weights`)."""
    cfg, sd = read_weights(path, use_ema=use_ema)
    if cfg is None:
        raise CheckpointError(
            f"{path} carries no configuration (a plain state dict: no 'vitrel_cfg' and no {CONFIG_NAME} beside it); "
            "build the model from arguments and load it: vitrel.create_model(<architecture>, pos=..., "
            "num_classes=..., checkpoint_path=...)"
        )
    return cfg, sd


def check_checkpoint(path: str | os.PathLike) -> Path:
    """Raise :class:`CheckpointError` unless ``path`` is a readable, safe training checkpoint (``.ckpt``);
    called before Lightning reads a file given as ``ckpt_path=`` (Lightning's own errors on a truncated
    or foreign file are raw ``RuntimeError`` exceptions)."""
    p = _resolve(path)
    if p.suffix == ".safetensors":
        _safetensors_metadata(p)  # a clear error when truncated
        raise CheckpointError(
            f"{p} holds exported weights, not a Lightning training checkpoint (.ckpt) to resume; "
            "load them with vitrel.load_model / vitrel.create_model(..., checkpoint_path=...)"
        )
    obj = _torch_load(p)
    if not isinstance(obj, Mapping) or "state_dict" not in obj:
        raise CheckpointError(f"{p} is not a Lightning training checkpoint (no 'state_dict'; keys: {_keys(obj)})")
    extract_model_state(obj)
    return p


def checkpoint_has_ema(path: str | os.PathLike) -> bool:
    """Whether a training checkpoint holds EMA weights (read safely; False for exported weights)."""
    p = _resolve(path)
    if p.suffix == ".safetensors":
        return False
    obj = _torch_load(p)
    sd = obj.get("state_dict", {}) if isinstance(obj, Mapping) else {}
    return isinstance(sd, Mapping) and any(k.startswith(_EMA_PREFIXES) for k in sd)


def _keys(obj: Any) -> str:
    return _preview(list(obj)) if isinstance(obj, Mapping) else type(obj).__name__


# ---------------------------------------------------------------------------- loading into a model
def load_weights(model: nn.Module, state_dict: Mapping[str, Tensor], num_classes_stored: int | None = None) -> None:
    """Load ``state_dict`` into ``model`` strictly, with two adaptations and clear errors otherwise.

    * learned relative tables and absolute embeddings of another grid are resized by the schemes as
      they load (with a warning);
    * a head for another number of classes (``num_classes_stored`` != ``model.num_classes``) is
      dropped: the model keeps its freshly initialised head (with a warning).

    Missing or unexpected keys, shapes that do not match and cannot be resized, or integer weights where
    the model has floating ones raise :class:`CheckpointError`.
    """
    sd = dict(state_dict)
    expected = model.state_dict()
    reset_head: list[str] = []
    if num_classes_stored is not None and num_classes_stored != getattr(model, "num_classes", None):
        reset_head = [k for k in list(sd) if k.startswith("head.")]
        for k in reset_head:
            del sd[k]
        warnings.warn(
            f"checkpoint head has {num_classes_stored} classes, the model {model.num_classes}: the head is reset",
            stacklevel=3,
        )
    missing = [k for k in expected if k not in sd and not (reset_head and k.startswith("head."))]
    unexpected = [k for k in sd if k not in expected]
    if missing or unexpected:
        raise CheckpointError(
            "the weights do not fit this architecture (another model?): "
            + (f"missing keys: {_preview(missing)}. " if missing else "")
            + (f"unexpected keys: {_preview(unexpected)}." if unexpected else "")
        )
    _check_dtypes(sd, expected)
    try:
        nn.Module.load_state_dict(model, sd, strict=not reset_head)  # (torch's errors, not timm's route's advice)
    except (RuntimeError, ValueError) as e:
        raise CheckpointError(f"the weights do not fit this architecture: {e}") from None


def _check_dtypes(sd: Mapping[str, Tensor], expected: Mapping[str, Tensor]) -> None:
    """Refuse integer / bool weights where the model has floating ones: ``load_state_dict`` would cast
    them silently (a checkpoint rewritten as int32 scores at chance). Any floating precision loads
    (float16, bfloat16, float32, float64), as timm's loaders allow."""
    bad = [
        f"{k} ({sd[k].dtype}, the model's is {expected[k].dtype})"
        for k in expected
        if k in sd and expected[k].is_floating_point() and not sd[k].is_floating_point()
    ]
    if bad:
        raise CheckpointError(
            f"the weights are not floating point: {_preview(bad, 4)}; "
            "a damaged or wrongly converted file? (float16, bfloat16, float32 and float64 weights load)"
        )


def load_model(
    path: str | os.PathLike,
    architecture: str | None = None,
    use_ema: bool = False,
    **overrides: Any,
) -> nn.Module:
    """Rebuild the model stored at ``path`` and load its weights.

    ``path``: a training checkpoint (``.ckpt``), a ``.safetensors`` file (configuration in its metadata
    or in a ``config.json`` beside it), a torch file or an export directory. The architecture and every
    constructor argument (position scheme included) come from the stored ``vitrel_cfg``; ``overrides``
    replace some, e.g. ``img_size=48`` (learned tables / absolute embeddings are resized, with a
    warning) or ``num_classes=5`` (the head is reset). ``architecture``, when given, must match the
    stored one. A plain state dict (no stored configuration, timm's ``checkpoint_path`` convention) is
    loaded into ``architecture`` built from ``overrides``. Raises :class:`CheckpointError` for anything
    that cannot be loaded safely and exactly. The model comes back in training mode, as from
    ``create_model``; call ``.eval()`` for inference. The data config stored with the weights (the preprocessing
    of the training data, see the module docstring) is in the model's ``pretrained_cfg``; without one it holds the
    architecture's defaults.
    """
    cfg, sd = read_weights(path, use_ema=use_ema)
    if cfg is None:  # a plain state dict: the model is what the arguments say (timm's checkpoint_path)
        if architecture is None:
            read_checkpoint(path)  # raises: no configuration and no architecture to build
        try:
            model = build(architecture, **overrides)
        except (TypeError, ValueError, KeyError) as e:
            raise CheckpointError(f"cannot build {architecture} from the arguments given: {e}") from None
        head = sd.get("head.weight")
        n = getattr(model, "num_classes", None)
        if isinstance(head, Tensor) and head.dim() == 2 and n is not None and head.shape[0] != n:
            raise CheckpointError(
                f"{path}: the head has {head.shape[0]} classes, the model {n}; give num_classes={head.shape[0]}"
            )
        load_weights(model, sd)
        return model
    arch = cfg.get("architecture")
    if arch not in MODEL_ARGS:
        raise CheckpointError(
            f"{path} was written for the architecture {arch!r}, which vitrel does not know"
            + ("; timm weights load with vitrel.from_timm(...)" if arch in timm.list_models() else "")
        )
    if architecture is not None and architecture != arch:
        raise CheckpointError(f"{path} holds a {arch} model, not {architecture}")
    try:
        model = build_from_cfg(cfg, **overrides)
    except (TypeError, ValueError, KeyError) as e:
        raise CheckpointError(f"cannot rebuild {arch} from the configuration stored in {path}: {e}") from None
    load_weights(model, sd, num_classes_stored=cfg.get("num_classes"))
    data_config = stored_data_config(path)
    if data_config is not None:
        if model.num_classes != cfg.get("num_classes"):  # a new head: the stored names are another head's
            data_config.pop("class_names", None)
        _set_data_config(model, data_config)
    return model


# ---------------------------------------------------------------------------- export
def save_pretrained(model: nn.Module, out_dir: str | os.PathLike) -> Path:
    """Write ``model.safetensors`` (configuration also in its metadata) and ``config.json``.

    ``config.json`` follows timm's layout (``architecture``, ``num_classes``, ``model_args``,
    ``pretrained_cfg``) plus ``vitrel_cfg``, so ``timm.create_model("local-dir:<out_dir>", pretrained=True)`` and
    ``vitrel.load_model(out_dir)`` both rebuild the model with its weights. The data config (the model's
    :func:`model_data_config`: the training data's when the model came from :func:`load_model` on a checkpoint that
    stores it) is in ``pretrained_cfg`` (timm's fields, the class names as ``label_names``: what
    ``timm.data.resolve_data_config`` reads) and in the weights' metadata (``"data_config"``).
    """
    cfg = getattr(model, "vitrel_cfg", None)
    if not isinstance(cfg, dict) or "architecture" not in cfg:
        raise ValueError("save_pretrained needs a model built by vitrel.create_model (with vitrel_cfg['architecture'])")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg_json = json.dumps(cfg)
    data_config = model_data_config(model)
    tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    meta = {"format": "pt", "vitrel_cfg": cfg_json, "data_config": json.dumps(data_config)}
    save_file(tensors, str(out / WEIGHTS_NAME), metadata=meta)
    pcfg = dict(getattr(model, "pretrained_cfg", None) or {})
    pcfg = filter_pretrained_cfg({k: v for k, v in pcfg.items() if k != "state_dict"}, remove_source=True)
    pcfg.update({k: data_config[k] for k in DATA_FIELDS})
    if data_config.get("class_names"):
        pcfg["label_names"] = data_config["class_names"]
    pcfg.update(num_classes=model.num_classes, fixed_input_size=False, custom_load=False, pool_size=None)
    pcfg.pop("architecture", None)
    config = {
        "architecture": cfg["architecture"],
        "num_classes": model.num_classes,
        "num_features": getattr(model, "num_features", None),
        "global_pool": getattr(model, "global_pool", None),
        "model_args": {k: v for k, v in cfg.items() if k != "architecture"},
        "pretrained_cfg": pcfg,
        "vitrel_cfg": json.loads(cfg_json),
    }
    with open(out / CONFIG_NAME, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return out


def export_model(ckpt_path: str | os.PathLike, out_dir: str | os.PathLike, use_ema: bool = False) -> Path:
    """Training checkpoint -> ``out_dir/model.safetensors`` + ``out_dir/config.json`` (validated by
    rebuilding the model and loading the weights strictly first)."""
    model = load_model(ckpt_path, use_ema=use_ema)
    return save_pretrained(model, out_dir)
