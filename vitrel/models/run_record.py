"""What the ``train.py`` run that wrote a checkpoint recorded in its folder, as ``eval.py`` and ``predict.py`` read
it: the record itself (:func:`run_record`, ``<run>/.hydra/config.yaml``), how a NaFlex run scored its images
(:func:`naflex_of_run`), and the warning for scoring such a run at the fixed size its model was only built at
(:func:`nominal_size_warning`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vitrel.data.packing import parse_packing

if TYPE_CHECKING:
    from omegaconf import DictConfig

__all__ = [
    "NAFLEX_RUN_KEYS",
    "PredictSettingsError",
    "naflex_of_run",
    "naflex_over_budget",
    "nominal_size_warning",
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
