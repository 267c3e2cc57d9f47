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
import re
import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import timm
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from timm.models import adapt_input_conv, filter_pretrained_cfg
from torch import Tensor, nn

from vitrel.caller import caller_stacklevel
from vitrel.models.ckpt_files import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    CheckpointError,
    _cfg_from_config_json,
    _parse_meta,
    _preview,
    _read_json,
    _resolve,
    _safetensors_metadata,
    _torch_load,
    clean_state_dict,
    extract_model_state,
    follow_umask,
    has_ema_keys,
    run_checkpoint,
    stored_config,
    timm_bin_config,
)
from vitrel.models.data_config import (
    TIMM_CFG_FIELDS,
    data_config_for,
    data_fields,
    fit_data_config,
    model_data_config,
    stored_data_config,
    warn_no_data_config,
)
from vitrel.models.registry import MODEL_ARGS, build, build_from_cfg, split_feature_args, with_features
from vitrel.pos.base import PositionScheme
from vitrel.pos.reference import ReferenceGrid, fill_reference_grids

__all__ = [
    "timm_route",
    "CheckpointError",
    "extract_model_state",
    "clean_state_dict",
    "read_checkpoint",
    "read_weights",
    "check_checkpoint",
    "checkpoint_has_ema",
    "checkpoint_scores_ema",
    "exported_ema",
    "weights_ema",
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


def _load_safetensors(p: Path) -> dict[str, Tensor]:
    try:
        return load_file(str(p), device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {p}: truncated or not a safetensors file ({e})") from None


#: the ways to ask for the EMA copy, in each entry point's spelling (said by the errors of a file that has none)
_ASK_EMA = "ema=true of eval.py / predict.py, --ema of python -m vitrel.export, use_ema=True of vitrel.load_model"
_LEAVE_AUTO = "leave it at auto (ema=auto, use_ema='auto'), which loads the weights the run scored"


def _timm_ema_key(obj: Any) -> str | None:
    """The key of the EMA copy in a checkpoint of timm's train script (``state_dict_ema``) or DeiT's (``model_ema``),
    in the order timm's ``load_state_dict`` takes them; None when it has none."""
    for key in ("state_dict_ema", "model_ema"):
        if isinstance(obj, Mapping) and isinstance(obj.get(key), Mapping):
            return key
    return None


def holds_timm_ema(path: str | os.PathLike) -> bool:
    """Whether a torch file holds an EMA copy where timm's train script (or DeiT's) stores one (keys only read)."""
    return _timm_ema_key(_read_keys(path)) is not None


def _plain_state(obj: Any, p: Path, use_ema: bool) -> dict[str, Tensor]:
    """The weights of a torch file without a vitrel configuration: a plain state dict, or a dict with
    ``state_dict`` (Lightning, timm's train script; ``state_dict_ema`` with ``use_ema``) or ``model`` (DeiT)."""
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"{p} holds a {type(obj).__name__}, not a state dict")
    if use_ema:
        key = _timm_ema_key(obj)
        if key is not None:
            return clean_state_dict(obj[key])
        return extract_model_state(obj, use_ema=True)[1] if isinstance(obj.get("state_dict"), Mapping) else {}
    for key in ("state_dict", "model"):
        if isinstance(obj.get(key), Mapping):
            return clean_state_dict(obj[key])
    return clean_state_dict(obj)


def read_weights(
    path: str | os.PathLike, use_ema: bool = False, lazy: bool = False
) -> tuple[dict[str, Any] | None, dict[str, Tensor]]:
    """``(vitrel_cfg or None, state_dict)`` from a ``.ckpt``, a ``.safetensors`` file (configuration in its
    metadata or a ``config.json`` beside it), a torch file (``.pth``, ``.bin``, ``.pt``; timm's ``pytorch_model.bin``
    with the ``config.json`` beside it) or an export
    directory. The configuration is None for a plain state dict (timm's ``checkpoint_path`` files). ``lazy``: the
    tensors of a zip torch file stay on disk (``mmap``), for reading the keys and shapes only."""
    p = _resolve(path)
    if p.suffix == ".safetensors":
        meta = _safetensors_metadata(p)
        cfg = None
        if "vitrel_cfg" in meta:
            cfg = _parse_meta(meta["vitrel_cfg"], p)
        elif (p.parent / CONFIG_NAME).is_file():
            cfg = _cfg_from_config_json(_read_json(p.parent / CONFIG_NAME), p.parent / CONFIG_NAME)
        if use_ema:
            raise CheckpointError(
                f"{p} holds exported weights only, but the EMA copy was asked for ({_ASK_EMA}), which only training "
                f"checkpoints (.ckpt) keep beside the trained weights: {_LEAVE_AUTO}"
            )
        return cfg, clean_state_dict(_load_safetensors(p), prefix="")
    obj = _torch_load(p, mmap=lazy and zipfile.is_zipfile(p))
    if use_ema and isinstance(obj, Mapping) and "vitrel_cfg" in obj and not _holds_ema(obj):
        raise CheckpointError(
            f"{p} holds no EMA copy (its run had no module/ema), but it was asked for ({_ASK_EMA}): {_LEAVE_AUTO}"
        )
    try:
        return extract_model_state(obj, use_ema=use_ema)
    except CheckpointError:
        if isinstance(obj, Mapping) and ("vitrel_cfg" in obj or "hyper_parameters" in obj):
            raise
    sd = _plain_state(obj, p, use_ema)
    if not sd:
        raise CheckpointError(
            f"{p} holds no EMA weights (asked for: {_ASK_EMA})" if use_ema else f"{p} holds no weights"
        )
    return timm_bin_config(p), sd


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


def _read_keys(path: str | os.PathLike) -> Any:
    """A checkpoint as ``torch.load`` reads it safely, its tensors left on disk (``mmap``) when it is a zip file (what
    ``torch.save`` and Lightning write); None for exported weights (safetensors)."""
    p = _resolve(path)
    return None if p.suffix == ".safetensors" else _torch_load(p, mmap=zipfile.is_zipfile(p))


def _holds_ema(obj: Any) -> bool:
    return has_ema_keys(obj.get("state_dict", {}) if isinstance(obj, Mapping) else {})


def checkpoint_has_ema(path: str | os.PathLike) -> bool:
    """Whether a training checkpoint holds EMA weights (read safely; False for exported weights). Only the keys are
    read: the tensors of a zip checkpoint (what ``torch.save`` and Lightning write) stay on disk (``mmap``)."""
    return _holds_ema(_read_keys(path))


def checkpoint_scores_ema(path: str | os.PathLike) -> bool:
    """``ema=auto`` of ``eval.py``, ``predict.py`` and the export: whether the run that wrote a training checkpoint
    validated and tested with its EMA weights, so that they score the weights its own test scored. True when the
    checkpoint holds EMA weights and its module's ``ema_eval`` (``hyper_parameters``; checkpoints that do not store it
    had the default, True) is not False; False for exported weights."""
    return _scores_ema(_read_keys(path))


def exported_ema(path: str | os.PathLike) -> bool | None:
    """Which weights exported weights hold, as :func:`save_pretrained` recorded them (``"ema"`` in the weights'
    metadata and in ``config.json``; ``python -m vitrel.export`` records it): True the EMA copy, False the trained
    weights; None where none is recorded (an export from before vitrel recorded it, a model saved by hand) and for a
    file that is not exported weights."""
    p = _resolve(path)
    said = _safetensors_metadata(p).get("ema") if p.suffix == ".safetensors" else None
    return {"true": True, "false": False}.get(str(said)) if said is not None else None


def weights_ema(path: str | os.PathLike, use_ema: bool | str = "auto", strict: bool = False) -> bool | None:
    """Whether ``use_ema`` (``"auto"``, True, False) at ``path`` scores the EMA copy: of a training checkpoint,
    ``"auto"``'s :func:`checkpoint_scores_ema` or the choice; exported weights hold one set, the one they record
    (:func:`exported_ema`), which ``"auto"`` and that choice take; the other choice is a :class:`CheckpointError`
    naming it, as is True (and, ``strict``, False) where they record none (None then: the weights they hold)."""
    if use_ema not in ("auto", True, False):
        raise ValueError(f"use_ema must be 'auto', True or False, got {use_ema!r}")
    p = _resolve(path)
    if p.suffix != ".safetensors":
        return checkpoint_scores_ema(p) if use_ema == "auto" else bool(use_ema)
    held = exported_ema(p)
    if use_ema == "auto" or use_ema is held or (held is None and use_ema is False and not strict):
        return held
    asked = f"the {'EMA' if use_ema else 'trained'} weights (ema={str(use_ema).lower()})"
    if held is None:
        raise CheckpointError(
            f"{p} does not record whether it holds a run's EMA or trained weights (exported before vitrel recorded "
            f"it, or saved by hand), so it cannot give {asked}: give ema=auto (use_ema='auto') to score the weights "
            "it holds, or export the .ckpt again (python -m vitrel.export CKPT OUT --ema true|false)"
        )
    which = "the EMA weights" if held else "the trained weights"
    raise CheckpointError(
        f"{p} holds {which} only (it records ema: {str(held).lower()}, as does config.json), not {asked}: give "
        "ema=auto (use_ema='auto') to score them, or export the .ckpt again: python -m vitrel.export CKPT OUT --ema "
        f"{str(use_ema).lower()}"
    )


def _scores_ema(obj: Any) -> bool:
    """:func:`checkpoint_scores_ema` of a checkpoint as :func:`_read_keys` read it."""
    hparams = (obj.get("hyper_parameters") if isinstance(obj, Mapping) else None) or {}
    return _holds_ema(obj) and hparams.get("ema_eval", True) is not False


def _keys(obj: Any) -> str:
    return _preview(list(obj)) if isinstance(obj, Mapping) else type(obj).__name__


# ---------------------------------------------------------------------------- loading into a model
# keys of timm's ViT / Swin / EVA (RoPE) / relpos ViT layouts that no vitrel model has
_TIMM_ONLY_KEY = re.compile(
    r"^pos_embed$|^rope\.|relative_position_(bias_table|index)$|\.attn\.rel_pos\.|\.gamma_[12]$"
)


def load_weights(model: nn.Module, state_dict: Mapping[str, Tensor], num_classes_stored: int | None = None) -> None:
    """Load ``state_dict`` into ``model`` strictly, with two adaptations and clear errors otherwise.

    * learned relative tables and absolute embeddings of another grid are resized by the schemes as
      they load (with a warning);
    * a head for another number of classes (``num_classes_stored`` != ``model.num_classes``) is
      dropped: the model keeps its freshly initialised head (with a warning).

    Missing or unexpected keys, shapes that do not match and cannot be resized, or integer weights where
    the model has floating ones raise :class:`CheckpointError`.
    """
    sd = fill_reference_grids(model, state_dict)  # (weights stored without a scheme's training grid: the built one)
    expected = model.state_dict()
    reset_head = num_classes_stored is not None and num_classes_stored != getattr(model, "num_classes", None)
    if reset_head:  # (weights of num_classes=0 have no head to drop)
        for k in [k for k in sd if k.startswith("head.")]:
            del sd[k]
        warnings.warn(
            f"checkpoint head has {num_classes_stored} classes, the model {model.num_classes}: the head is reset",
            stacklevel=caller_stacklevel(),  # (the first frame outside vitrel: not factory.py's load_model call)
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


def _adapt_in_chans(sd: dict[str, Tensor], stored: int | None, wanted: int | None) -> dict[str, Tensor]:
    """The patch embedding of ``stored`` input channels adapted to ``wanted`` (an ``in_chans`` override) with timm's
    ``adapt_input_conv``, as timm loads pretrained weights: repeated and scaled, or summed for one channel (a video
    model's kernel: time and rows as one axis); with a warning."""
    w = sd.get("patch_embed.proj.weight")
    if stored is None or wanted is None or stored == wanted or not isinstance(w, Tensor) or w.dim() not in (4, 5):
        return sd
    flat = adapt_input_conv(wanted, w.reshape(w.shape[0], w.shape[1], w.shape[2], -1), base_chans=stored)
    warnings.warn(  # (attributed to the first frame outside vitrel: load_model's caller, a script, eval.py)
        f"patch embedding adapted from {stored} to {wanted} input channels (timm's adapt_input_conv)",
        stacklevel=caller_stacklevel(),
    )
    return {**sd, "patch_embed.proj.weight": flat.reshape(w.shape[0], wanted, *w.shape[2:])}


def timm_route(arch: Any) -> str:
    """For a refusal of weights stored as timm's ``arch`` (not a vitrel model): where they load instead."""
    timms = isinstance(arch, str) and not arch.startswith("vitrel_") and arch in timm.list_models()
    return "; timm weights load with vitrel.from_timm(...)" if timms else ""


def load_model(
    path: str | os.PathLike,
    architecture: str | None = None,
    use_ema: bool | str = "auto",
    **overrides: Any,
) -> nn.Module:
    """Rebuild the model stored at ``path`` and load its weights.

    ``path``: a training checkpoint (``.ckpt``), a ``.safetensors`` file (configuration in its metadata or in a
    ``config.json`` beside it), a torch file, an export directory or a ``train.py`` run folder (its
    ``checkpoints/last.ckpt``, the weights its test scored; else its ``best-epoch*.ckpt``; logged:
    :func:`~vitrel.models.ckpt_files.run_checkpoint`). The architecture and every constructor argument (position
    scheme included) come from the stored ``vitrel_cfg``; ``overrides`` replace some, e.g. ``img_size=48`` (learned
    tables / absolute embeddings are resized, with a warning), ``num_classes=5`` (the head is reset) or
    ``in_chans=3`` (the patch embedding adapted as timm adapts pretrained weights, with a warning);
    ``pos={"scaling": {...}}`` (a mapping without a name, or with the stored scheme's) changes those options of the
    stored scheme and keeps its others, a name or another scheme replaces it. ``architecture``, when given, must
    match the stored one. A plain state dict (no stored configuration, timm's ``checkpoint_path`` convention) is
    loaded into ``architecture`` built from ``overrides``. Raises :class:`CheckpointError` for anything that cannot
    be loaded safely and exactly. The model comes back in training mode, as from ``create_model``; call ``.eval()``
    for inference. The data config stored with the weights (the preprocessing of the training data, see the module
    docstring) is in the model's ``pretrained_cfg``; without one it holds the architecture's defaults, with a
    :class:`~vitrel.models.data_config.NoDataConfigWarning`. ``features_only=True`` (with ``out_indices``,
    ``output_fmt``): the loaded network as timm's ``features_only`` backbone
    (:func:`~vitrel.models.registry.with_features`).

    ``use_ema``: ``"auto"`` (default) loads the weights the run validated and tested with, as ``eval.py`` and
    ``predict.py`` do: the EMA copy of a training checkpoint of a run with ``module/ema`` (unless it ran with
    ``module.ema_eval=false``) or the EMA copy beside the weights in a checkpoint of timm's train script
    (``state_dict_ema``, as timm's ``load_checkpoint`` takes it), else the trained weights
    (:func:`checkpoint_scores_ema`). ``True``: the EMA copy (an error when there is none); ``False``: the trained ones.
    Exported weights hold one set: ``"auto"`` and the choice they record (:func:`exported_ema`) load it, the other
    choice is refused (:func:`weights_ema`).
    """
    path = run_checkpoint(path)  # a run folder: the checkpoint its test scored, said in one line
    overrides, feature_args = split_feature_args(overrides)
    if feature_args.get("features_only"):  # the whole network loaded, then its backbone (timm's wrapper)
        return with_features(load_model(path, architecture, use_ema, **overrides), feature_args)
    if use_ema not in ("auto", True, False):
        raise ValueError(f"use_ema must be 'auto', True or False, got {use_ema!r}")
    if _resolve(path).suffix == ".safetensors":  # exported weights: one set, the one they record (else refused)
        weights_ema(path, use_ema)
        use_ema = False  # (read_weights reads their one set)
    elif use_ema == "auto":  # (a checkpoint of timm's train script: its EMA copy, as timm's load_checkpoint takes)
        obj = _read_keys(path)  # (read once for both)
        use_ema = _scores_ema(obj) if _holds_ema(obj) else _timm_ema_key(obj) is not None
    cfg, sd = read_weights(path, use_ema=use_ema)
    if cfg is None:  # a plain state dict: the model is what the arguments say (timm's checkpoint_path)
        if architecture is None:
            read_checkpoint(path)  # raises: no configuration and no architecture to build
        try:
            model = build(architecture, **overrides)
        except (TypeError, ValueError, KeyError) as e:
            raise CheckpointError(f"cannot build {architecture} from the arguments given: {e}") from None
        timm_keys = [k for k in sd if _TIMM_ONLY_KEY.search(k)]
        if timm_keys:
            raise CheckpointError(
                f"{path} holds a timm model's weights ({_preview(timm_keys, 2)}), whose layout is not vitrel's: load "
                f"them with vitrel.from_timm('<timm model name>', checkpoint_path='{path}', pos=...) (docs/models.md: "
                "Start from timm's weights)"
            )
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
            f"{path} was written for the architecture {arch!r}, which vitrel does not know" + timm_route(arch)
        )
    if architecture is not None and architecture != arch:
        raise CheckpointError(f"{path} holds a {arch} model, not {architecture}")
    try:
        model = build_from_cfg(cfg, **overrides)
    except (TypeError, ValueError, KeyError) as e:
        raise CheckpointError(f"cannot rebuild {arch} from the configuration stored in {path}: {e}") from None
    sd = _adapt_in_chans(sd, cfg.get("in_chans"), model.vitrel_cfg.get("in_chans"))
    sd = _from_stored_size(model, sd, cfg, overrides)
    try:
        load_weights(model, sd, num_classes_stored=cfg.get("num_classes"))
    except CheckpointError as e:  # (arguments given unlike the stored ones: their parameters are not the weights')
        stored, built = scheme_name(cfg.get("pos")), scheme_name(model.vitrel_cfg.get("pos"))
        if stored != built:
            raise CheckpointError(
                f"{path} was trained with pos={stored}, this model has pos={built}, whose parameters the weights do "
                f"not hold ({e}); leave pos out to load the run's scheme (a mapping without a name changes its options)"
            ) from None
        changed = _changed_args(cfg, model.vitrel_cfg, overrides)
        if not changed:
            raise
        raise CheckpointError(
            f"{path}'s weights do not fit the model built with {', '.join(changed)} ({e}); leave these arguments out "
            "to load the model they were trained in"
        ) from None
    warn_other_function(path, cfg, model.vitrel_cfg, overrides)
    if cfg.get("num_classes") is not None:  # timm's convention (and its overlay route's): the weights' classes
        model.pretrained_cfg = model.default_cfg = {**model.pretrained_cfg, "num_classes": cfg["num_classes"]}
    data_config = stored_data_config(path)
    if data_config is not None:
        overlay = overrides.get("pretrained_cfg_overlay")
        fit_data_config(model, data_config, cfg.get("num_classes"), overlay, cfg.get("img_size"))
    else:
        warn_no_data_config(path, model)
    return model


#: constructor arguments that, given to :func:`load_model` unlike the stored ones, make the weights compute another
#: function (the position scheme by name too); most change shapes and fail to load, the others load silently
_FUNCTION_ARGS = (
    "abs_pos", "act_layer", "attn_pool_depth", "attn_pool_num_heads", "attn_pool_type", "class_token", "depth",
    "depths", "embed_dim", "fc_norm", "global_pool", "init_values", "mlp_ratio", "norm_eps", "norm_layer",
    "num_heads", "num_segments", "patch_bias", "patch_size", "pool_include_prefix", "pos_depth", "pos_share",
    "post_norm", "prefix_at", "qkv_bias", "reg_tokens",
)  # fmt: skip


def warn_other_function(path: Any, stored: Mapping[str, Any], built: Mapping[str, Any], overrides: Mapping) -> None:
    """One warning when ``overrides`` built the loaded model unlike the stored configuration in a way the weights fit
    (``num_heads``, ``global_pool``, another position scheme by name ...): it is not the model they were trained in."""
    changed = _changed_args(stored, built, overrides)
    if changed:
        warnings.warn(
            f"{path} loaded into a model built with {', '.join(changed)}: the weights fit, but this model computes "
            "another function than the one they were trained in; leave these arguments out to rebuild that model",
            stacklevel=caller_stacklevel(),
        )


def _changed_args(stored: Mapping[str, Any], built: Mapping[str, Any], overrides: Mapping) -> list[str]:
    """The :data:`_FUNCTION_ARGS` (and the scheme's name) ``overrides`` built unlike ``stored``: ``"global_pool='token'
    (trained with 'avg')"`` each."""

    def norm(v: Any) -> Any:
        return [norm(x) for x in v] if isinstance(v, (list, tuple)) else v

    changed = [
        f"{k}={built[k]!r} (trained with {stored[k]!r})"
        for k in _FUNCTION_ARGS
        if k in overrides and k in stored and k in built and norm(stored[k]) != norm(built[k])
    ]
    was, now = scheme_name(stored.get("pos")), scheme_name(built.get("pos"))
    if "pos" in overrides and was != now:
        changed.insert(0, f"pos={now} (trained with {was})")
    return changed


def scheme_name(spec: Any) -> str | None:
    """A position scheme's name from its spec as ``vitrel_cfg`` stores it (a name or a mapping with ``name``)."""
    return spec.get("name") if isinstance(spec, Mapping) else spec


def _from_stored_size(model: nn.Module, sd: dict[str, Tensor], cfg: dict[str, Any], overrides: dict) -> dict:
    """Weights loaded at another ``img_size`` / ``window_size`` / ``num_frames`` than stored, read against the
    model rebuilt at the stored size (on the meta device): each scheme's :meth:`~PositionScheme.state_from` (an
    ``ape`` table resampled from its stored grid), and the ``ref_grid`` of a scheme measured from its training grid
    (:mod:`vitrel.pos.reference`) where the weights lack it (written before it was stored, or a ``scaling`` given to
    :func:`load_model`): the scheme's grid at the stored size, not the new one."""
    resized = {k: v for k, v in overrides.items() if k in ("img_size", "window_size", "num_frames")}
    if not resized:
        return sd
    stored = build_from_cfg(cfg, **{k: v for k, v in overrides.items() if k not in resized}, device="meta")
    sd = dict(sd)
    for name, mod in model.named_modules():
        if isinstance(mod, PositionScheme) and name:
            pre = name + "."
            own = {k[len(pre) :]: v for k, v in sd.items() if k.startswith(pre)}
            sd.update({pre + k: v for k, v in mod.state_from(own, stored.get_submodule(name)).items()})
    if not any(isinstance(m, ReferenceGrid) and m.keeps_reference for m in model.modules()):
        return sd
    return fill_reference_grids(model, sd, lambda name: stored.get_submodule(name).ref)


# ---------------------------------------------------------------------------- export
def save_pretrained(
    model: nn.Module, out_dir: str | os.PathLike, data_config: Mapping[str, Any] | None = None, ema: bool | None = None
) -> Path:
    """Write ``model.safetensors`` (configuration also in its metadata) and ``config.json``.

    ``config.json`` follows timm's layout (``architecture``, ``num_classes``, ``model_args``,
    ``pretrained_cfg``) plus ``vitrel_cfg``, so ``timm.create_model("local-dir:<out_dir>", pretrained=True)`` and
    ``vitrel.load_model(out_dir)`` both rebuild the model with its weights. The data config (the model's
    :func:`model_data_config`: the training data's when the model came from :func:`load_model` on a checkpoint that
    stores it) is in ``pretrained_cfg`` (timm's fields, the class names as ``label_names``: what
    ``timm.data.resolve_data_config`` reads) and in the weights' metadata (``"data_config"``); ``data_config``: that
    data config (:func:`data_config_for` of the checkpoint it was loaded from) instead. ``ema``: whether the weights
    are a run's EMA copy (True) or its trained weights (False), recorded as ``"ema"`` in ``config.json`` and the
    weights' metadata (:func:`exported_ema`; ``eval.py`` reports it and refuses the other ``ema=``); None: not recorded.
    """
    cfg = getattr(model, "vitrel_cfg", None)
    if not isinstance(cfg, dict) or "architecture" not in cfg:
        raise ValueError("save_pretrained needs a model built by vitrel.create_model (with vitrel_cfg['architecture'])")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg_json = json.dumps(cfg)
    data_config = dict(data_config) if data_config is not None else model_data_config(model)
    tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    meta = {"format": "pt", "vitrel_cfg": cfg_json, "data_config": json.dumps(data_config)}
    if ema is not None:
        meta["ema"] = "true" if ema else "false"
    save_file(tensors, str(out / WEIGHTS_NAME), metadata=meta)
    follow_umask(out / WEIGHTS_NAME)  # (safetensors writes 0600)
    pcfg = dict(getattr(model, "pretrained_cfg", None) or {})
    pcfg = filter_pretrained_cfg({k: v for k, v in pcfg.items() if k != "state_dict"}, remove_source=True)
    # timm's fields, then vitrel's data fields (a video model's num_frames and clip sampling ...: not timm's, which
    # the registry hands timm's local-dir: route without, and that route's data config reads back)
    pcfg = {k: v for k, v in pcfg.items() if k in TIMM_CFG_FIELDS}
    pcfg.update({k: v for k, v in data_fields(data_config).items() if k != "class_names"})
    if data_config.get("class_names"):
        pcfg["label_names"] = data_config["class_names"]
    pool = type(model).feature_defaults(cfg)["pool_size"]  # (timm's: the final map of the model as built)
    pcfg.update(num_classes=model.num_classes, fixed_input_size=False, custom_load=False, pool_size=pool)
    pcfg.pop("architecture", None)
    config = {
        "architecture": cfg["architecture"],
        "num_classes": model.num_classes,
        "num_features": getattr(model, "num_features", None),
        "global_pool": getattr(model, "global_pool", None),
        "model_args": {k: v for k, v in cfg.items() if k != "architecture"},
        "pretrained_cfg": pcfg,
        "vitrel_cfg": json.loads(cfg_json),
        **({} if ema is None else {"ema": bool(ema)}),
    }
    with open(out / CONFIG_NAME, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return out


def export_model(ckpt_path: str | os.PathLike, out_dir: str | os.PathLike, use_ema: bool | str = "auto") -> Path:
    """Training checkpoint -> ``out_dir/model.safetensors`` + ``out_dir/config.json`` (validated by
    rebuilding the model and loading the weights strictly first), recording which weights it took (``"ema"``)."""
    ema = weights_ema(ckpt_path, use_ema)
    model = load_model(ckpt_path, use_ema="auto" if ema is None else ema)
    return save_pretrained(model, out_dir, ema=ema)
