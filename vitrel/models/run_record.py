"""What the ``train.py`` run that wrote a checkpoint recorded in its folder, as ``eval.py`` and ``predict.py`` read
it: the record itself (:func:`run_record`, ``<run>/.hydra/config.yaml``), how a NaFlex run scored its images
(:func:`naflex_of_run`), how its evaluation resized images (:func:`resize_of_run`), and the warning for scoring such
a run at the fixed size its model was only built at (:func:`nominal_size_warning`)."""

from __future__ import annotations

import importlib
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omegaconf import DictConfig

__all__ = [
    "NAFLEX_RUN_KEYS",
    "PredictSettingsError",
    "loader_used",
    "naflex_export_note",
    "naflex_of_run",
    "naflex_over_budget",
    "nominal_size_warning",
    "resize_of_run",
    "run_record",
]


class PredictSettingsError(ValueError):
    """A prediction setting that cannot be honoured (a count out of range, an override the model file cannot take,
    inputs the model does not read, a run record that does not resolve): the message names it and what to give
    instead. Defined here, below ``vitrel.export`` and ``vitrel.inference`` (which re-exports it)."""


def run_record(ckpt: Path) -> tuple[Path, DictConfig | None]:
    """The record of the train.py run that wrote ``ckpt``, ``<run>/.hydra/config.yaml`` (as Hydra saves it: not
    resolved), and its config; None without one."""
    from omegaconf import OmegaConf  # (here: reading a model file needs no omegaconf)

    path = ckpt.parent.parent / ".hydra" / "config.yaml"
    return path, OmegaConf.load(path) if path.is_file() else None


def loader_used(value: Any, data_cfg: Any) -> str | None:
    """A ``data.loader`` value as the data module of ``data_cfg`` uses it (null: the data set's ``default_loader``,
    read from the class its ``_target_`` names); None where that cannot be told."""
    if value is None and data_cfg.get("_target_"):
        module, _, name = str(data_cfg.get("_target_")).rpartition(".")
        try:
            value = getattr(getattr(importlib.import_module(module), name, None), "default_loader", None)
        except ImportError:  # (a data module of the user's own, not importable here: cannot be told)
            return None
    return None if value is None else str(value)


def resize_of_run(ckpt_path: str | Path) -> tuple[str | None, str]:
    """``("tensor", record)`` when the ``train.py`` run that wrote ``ckpt_path`` (a ``.ckpt`` in
    ``<run>/checkpoints/``) loaded its data with the memory loader (its record's ``data.loader``; null: the data set's
    default), whose evaluation resized normalised tensors with torchvision, as a checkpoint's data config says with
    ``resize: tensor`` since 2026-12-03; ``(None, "")`` for another loader, a record that does not resolve here, or
    no record (a checkpoint moved out of its run folder)."""
    p = Path(ckpt_path)
    record, run = run_record(p) if p.suffix == ".ckpt" else (p, None)
    if run is None:
        return None, ""
    from omegaconf.errors import OmegaConfBaseException

    try:
        data = run.get("data")
        # (no data.loader at all: a run from before the memory loader, 2026-11-23, whose data came through workers)
        loader = loader_used(data.get("loader"), data) if data and "loader" in data else None
    except OmegaConfBaseException:
        return None, ""
    return ("tensor", str(record)) if loader == "memory" else (None, "")


#: the data keys of a NaFlex run that decide how its images are scored, and their defaults (data.fashion_mnist's)
NAFLEX_RUN_KEYS = {"packing": None, "seq_len": None, "max_tokens": None, "eval_max_ratio": 1.0}


def naflex_of_run(ckpt_path: str | Path, run_rec: tuple[Path, Any] | None = None) -> tuple[dict[str, Any], str]:
    """``(settings, record)``: how the ``train.py`` run that wrote ``ckpt_path`` (a ``.ckpt`` in
    ``<run>/checkpoints/``) scored images when it trained with ``data.packing``: its ``data.packing`` (``"pack"`` /
    ``"pad"``), ``data.seq_len``, ``data.max_tokens`` (null: ``seq_len``) and ``data.eval_max_ratio``, from its folder's
    ``.hydra/config.yaml`` (the record ``eval.py`` reads), and that record's path. ``({}, "")`` for a run without
    packing and for a model without its run record (moved, an export, a ``.pt2``). ``run_rec``: that record as
    :func:`run_record` read it already (read here when None)."""
    p = Path(ckpt_path)
    record, run = run_rec if run_rec is not None else run_record(p) if p.suffix == ".ckpt" else (p, None)
    data = run.get("data") if run is not None else None
    if not data:
        return {}, ""
    from omegaconf.errors import OmegaConfBaseException

    from vitrel.data.packing import parse_packing  # here: vitrel.data imports Lightning, `import vitrel` need not

    out = {}
    for key, default in NAFLEX_RUN_KEYS.items():
        try:
            out[key] = data.get(key, default)
        except OmegaConfBaseException as e:
            why = str(e).splitlines()[0]
            fix = f"give {key}=<the run's>" if key in ("seq_len", "max_tokens") else "give seq_len=null (fixed size)"
            raise PredictSettingsError(f"data.{key} of {record} does not resolve here ({why}): {fix}") from e
    out["packing"] = parse_packing(out["packing"])
    if out["packing"] is None:
        return {}, ""
    out["max_tokens"] = out["max_tokens"] if out["max_tokens"] is not None else out["seq_len"]
    return out, str(record)


def naflex_over_budget(
    ckpt_path: str | Path, patches: int, run_rec: tuple[Path, Any] | None = None
) -> tuple[dict[str, Any], str] | None:
    """:func:`naflex_of_run`'s ``(settings, record)`` when that run trained on NaFlex batches and ``patches`` is more
    than its ``max_tokens`` (a fixed size its training never fed the model); None otherwise, and for a run record that
    does not resolve here (predict.py says so when it reads it)."""
    try:
        run, record = naflex_of_run(ckpt_path, run_rec)
    except PredictSettingsError:
        return None
    return (run, record) if run and patches > run["max_tokens"] else None


def nominal_size_warning(
    ckpt_path: str | Path, side: int, patch: int, fix: str, key: str, run_rec: tuple[Path, Any] | None = None
) -> str | None:
    """The warning for scoring ``ckpt_path`` on fixed ``side x side`` images (patches of ``patch`` px) when its run
    trained on NaFlex batches (:func:`naflex_of_run`) and that grid holds more patches than the run's ``max_tokens``:
    the size its model was built at (the data group's ``img_size``), which training never fed it. ``fix``: the
    other way, ``key``: the size to give; ``run_rec``: the run record, if read already. None otherwise (a run without
    packing, no run record, a size within the budget)."""
    n = (side // patch) ** 2
    over = naflex_over_budget(ckpt_path, n, run_rec)
    if over is None:
        return None
    run, record = over
    fits = math.isqrt(run["max_tokens"]) * patch
    return (
        f"{Path(ckpt_path).name}'s run trained on NaFlex batches (data.packing={run['packing']}, at most "
        f"{run['max_tokens']} patches an image; {record}): the fixed size {side}x{side} ({n} patches of {patch} px) is "
        f"the size its model was built at, not one it trained at: {fix}, or give {key}=<n> (at most {fits} for a "
        "square within its budget)"
    )


def naflex_export_note(ckpt: str | Path, hw: Any, patch: int) -> str | None:
    """The warning for exporting a ``.ckpt`` whose run trained and tested on NaFlex batches (``data.packing``, each
    image at its own size within ``data.max_tokens`` patches) when the recorded fixed size ``hw`` (patches of
    ``patch`` px) holds more patches than that: the export's preprocessing scores every image at a size its training
    never fed it. None otherwise."""
    if Path(ckpt).suffix != ".ckpt":
        return None
    (h, w), n = hw, (hw[0] // patch) * (hw[1] // patch)
    try:
        over = naflex_over_budget(ckpt, n)
    except ValueError:  # (a packing setting that does not parse: predict.py says so when it reads it)
        return None
    if over is None:
        return None
    run, record = over
    return (
        f"{Path(ckpt).name}'s run trained and tested on NaFlex batches (data.packing={run['packing']}: each image at "
        f"its own size, at most {run['max_tokens']} patches; {record}); the export records fixed {h}x{w} images "
        f"({n} patches of {patch} px), its model's built size, which training never fed it: predict.py on the .ckpt "
        "scores images as the run did; a dynamic=hw program takes each image at its own size (docs/export.md)"
    )
