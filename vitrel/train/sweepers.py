"""What a sweep's sweeper is and does, read from the Hydra config: Hydra's basic sweeper (:data:`BASIC_SWEEPER`,
whose jobs are known before they run: :func:`planned_jobs`) or a search sweeper such as Optuna's, which picks its
jobs from their returned values. A search of the seed, or one whose best trial is picked on the test split, is refused
or warned about as the sweep starts (:func:`check_search`); :func:`optuna_best` names the job of an Optuna study's
best trial for the summary (:class:`~vitrel.train.hydra_callbacks.SweepSummary`)."""

from __future__ import annotations

import itertools
import logging
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from vitrel.config import ConfigError, data_val_fraction

__all__ = [
    "BASIC_SWEEPER",
    "better",
    "check_direction",
    "check_search",
    "is_seed",
    "optuna_best",
    "picked_on_test",
    "planned_jobs",
    "searched_seed",
]

log = logging.getLogger(__name__)

#: the ``_target_`` of Hydra's own sweeper (``hydra/sweeper=basic``), whose jobs are known before they run
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def planned_jobs(config: DictConfig) -> list[list[str]] | None:
    """Each job's overrides, in job-number order, as Hydra's basic sweeper will run them (its ``params`` and the
    command line's sweep overrides, their product); None for another sweeper (its jobs are not known in advance) or
    job folders not named by job number (``hydra.sweep.subdir``)."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    sweeper = config.hydra.get("sweeper") or {}
    subdir = OmegaConf.to_container(config.hydra.sweep, resolve=False).get("subdir")
    if sweeper.get("_target_") != BASIC_SWEEPER or subdir != "${hydra.job.num}":
        return None
    args = [f"{k}={v}" for k, v in (sweeper.get("params") or {}).items()]
    args += [str(o) for o in config.hydra.overrides.task]
    loader = GlobalHydra.instance().config_loader() if GlobalHydra.instance().is_initialized() else None
    choices: dict[str, list[str]] = {}  # the basic sweeper's rule: a key's last override wins, keys in first order
    for o in OverridesParser.create(config_loader=loader).parse_overrides(args):
        key = o.get_key_element()
        if o.is_sweep_override() and not o.is_discrete_sweep():
            raise ValueError(f"{key}: the basic sweeper takes discrete sweeps only")
        values = o.sweep_string_iterator() if o.is_sweep_override() else [o.get_value_element_as_str()]
        choices[key] = [f"{key}={v}" for v in values]
    return [list(job) for job in itertools.product(*choices.values())]


def _searching(config: DictConfig) -> bool:
    """Whether the sweep's sweeper picks its jobs from their returned values (Optuna's, any but Hydra's basic one)."""
    target = (config.hydra.get("sweeper") or {}).get("_target_")
    return bool(target) and target != BASIC_SWEEPER


def searched_seed(config: DictConfig) -> str | None:
    """The ``seed`` sweep (as written: ``seed=0,1,2``) of a search sweeper's sweep (:func:`_searching`), from the
    command line or ``hydra.sweeper.params``; None without one. Optuna's sweeper makes any such list a categorical
    search dimension: its best trial would be the luckiest seed, not a setting's mean over seeds."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if not _searching(config):
        return None
    args = [f"{k}={v}" for k, v in (config.hydra.sweeper.get("params") or {}).items()]
    args += [str(o) for o in config.hydra.overrides.task]
    try:
        parsed = OverridesParser.create().parse_overrides(args)
    except Exception:  # noqa: BLE001  (Hydra refuses such an override itself, with its own message)
        return None
    return next((a for a, o in zip(args, parsed) if is_seed(o.get_key_element()) and o.is_sweep_override()), None)


def picked_on_test(config: DictConfig) -> str | None:
    """Why a search sweeper's best trial (:func:`_searching`) is picked on the test split: ``optimized_metric`` is a
    ``test/`` metric, or a ``val/`` one with ``data.val_fraction=0`` (the data modules then validate on the test
    split); None otherwise."""
    target = str(config.get("optimized_metric") or "")
    if not _searching(config) or not target:
        return None
    if target.startswith("test/"):
        return f"optimized_metric={target} is a test split score"
    data = config.get("data") or {}
    if target.startswith("val/") and "val_fraction" in data and not data_val_fraction(data):
        return f"optimized_metric={target} with data.val_fraction=0, which validates on the test split"
    return None


def _sweeper_name(config: DictConfig) -> str:
    """The sweeper's class name, less ``Sweeper`` (``Optuna``)."""
    target = str((config.hydra.get("sweeper") or {}).get("_target_", ""))
    return target.rsplit(".", 1)[-1].removesuffix("Sweeper") or "sweep's"


def is_seed(override: str) -> bool:
    """Whether ``override`` (``seed=1``, ``+seed=1``, or its key) sets the run's ``seed``."""
    return override.split("=", 1)[0].lstrip("+~") == "seed"


def check_search(config: DictConfig) -> None:
    """As a sweep starts: refuse a search sweeper's search of the seed (:func:`searched_seed`), its ``direction``
    against ``optimized_metric`` (:func:`check_direction`), or the SLURM launcher without a number of devices (its
    jobs' size; OmegaConf's interpolation error otherwise), with a one-line error (``SystemExit``: Hydra turns a
    callback's ``Exception`` into a warning), and warn when its best trial is picked
    on the test split (:func:`picked_on_test`)."""
    if seed := searched_seed(config):
        raise SystemExit(
            f"{Path(sys.argv[0]).name}: ConfigError: {seed}: the {_sweeper_name(config)} sweeper would search the "
            "seed as a hyperparameter and report the luckiest one as its best trial; search with one seed, then "
            "run the chosen values over seeds (-m ... seed=0,1,2) for their mean"
        )
    launcher = str((config.hydra.get("launcher") or {}).get("_target_", ""))
    devices = (config.get("trainer") or {}).get("devices")
    if launcher.endswith("SlurmLauncher") and not isinstance(devices, int):
        raise SystemExit(
            f"{Path(sys.argv[0]).name}: ConfigError: hydra/launcher=slurm sizes every job from trainer.devices (its "
            f"tasks and GPUs per node), which is {devices!r}: give the sweep a number, e.g. trainer.devices=8"
        )
    target, direction = config.get("optimized_metric"), (config.hydra.get("sweeper") or {}).get("direction")
    if target and direction is not None:  # (each job checks it too: a traceback per job under -m)
        try:
            check_direction(str(target), direction)
        except ConfigError as e:
            raise SystemExit(f"{Path(sys.argv[0]).name}: ConfigError: {e}") from None
    if why := picked_on_test(config):
        log.warning("sweep: %s: the best trial is chosen on the test split, so its test/* overestimate new data; "
                    "search on a held-out validation split (data.val_fraction=0.1)", why)  # fmt: skip


def check_direction(target: str, direction: Any) -> None:
    """A sweeper's single ``direction`` (Optuna's ``maximize`` / ``minimize``; its default is ``minimize``) that goes
    against ``optimized_metric`` (an accuracy minimised, a loss maximised: the search would seek the worst runs) is a
    :class:`~vitrel.config.ConfigError`, before the run trains. Several directions, or a metric of neither kind: not
    checked."""
    if isinstance(direction, (list, tuple, ListConfig)):
        return
    direction = str(getattr(direction, "name", direction)).lower()
    want = {"max": "maximize", "min": "minimize"}.get(better(target))
    if want is not None and direction in ("maximize", "minimize") and direction != want:
        raise ConfigError(
            f"optimized_metric={target} with the sweeper's direction {direction}: the search would seek the worst "
            f"runs; set hydra.sweeper.direction={want} (Optuna's default is minimize)"
        )


def better(metric: str | None) -> str | None:
    """``max`` for an accuracy, ``min`` for a loss (``val/acc1``, ``test/loss_epoch``), None for a metric of neither
    kind (or none)."""
    name = str(metric).rsplit("/", 1)[-1].removesuffix("_step").removesuffix("_epoch")
    return "max" if name.startswith("acc") else "min" if name == "loss" and metric is not None else None


def optuna_best(config: DictConfig, sweep_dir: Path, rows: list[dict[str, Any]], common: list[str]) -> str | None:
    """The best trial of the sweep's Optuna study, as Hydra's Optuna sweeper wrote it to the sweep folder's
    ``optimization_results.yaml`` as the sweep ended, named by its job (``rows`` and ``common``:
    :func:`~vitrel.train.sweep_table.summary_rows`'); None for another sweeper, a study of several objectives, or no
    job of its values."""
    sweeper = config.hydra.get("sweeper") or {}
    path = sweep_dir / "optimization_results.yaml"
    if "optuna" not in str(sweeper.get("_target_", "")).lower() or not path.exists():
        return None
    result = OmegaConf.to_container(OmegaConf.load(path))
    if not isinstance(result, dict) or "best_params" not in result:
        return None
    params = [f"{k}={v}" for k, v in result["best_params"].items()]
    job = next((r["job"] for r in rows if set(params) <= {*r["overrides"].split(), *common}), None)
    if job is None:
        return None
    direction = getattr(sweeper.get("direction"), "name", sweeper.get("direction"))
    line = (
        f"Optuna's best trial ({direction} {config.get('optimized_metric')}): job {job}, {result['best_value']:.4f}, "
        + (" ".join(params) or "(no parameters)")
    )
    if why := picked_on_test(config):
        line += (f"\nchosen on the test split ({why}): job {job}'s test/* overestimate new data; search on a "
                 "held-out validation split (data.val_fraction=0.1)")  # fmt: skip
    return line
