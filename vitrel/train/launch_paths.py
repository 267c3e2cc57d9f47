"""Paths a user gives are relative to the folder a script was launched from, Hydra's convention
(``hydra.utils.to_absolute_path``: ``hydra.runtime.cwd``), so that under ``hydra.job.chdir=true`` (the job runs in its
output folder) a script reads and writes the files it does under ``false``, in single runs and ``-m`` jobs alike.

:func:`launch_paths` makes those keys' relative values absolute in the job's config; ``train()``, ``evaluate()`` and
``run_predict()`` call it first. Outside Hydra (a config composed in Python) the base is the
current folder, as for any relative path.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hydra.utils import to_absolute_path
from omegaconf import DictConfig, OmegaConf

__all__ = ["launch_paths", "launch_path", "recorded_launch_folder", "TRAIN_PATHS", "EVAL_PATHS", "PREDICT_PATHS"]

#: keys naming files or folders; ``group.*.key``: that key of each entry of the group, ``group.*``: each of its values.
#: ``paths.*`` first: the keys that interpolate them (``data.root: ${paths.data_dir}``) then resolve to absolute paths
#: and stay interpolations
TRAIN_PATHS = ("paths.*", "ckpt_path", "data.root", "data.path", "model.path", "model.init_file",
               "trainer.default_root_dir", "callbacks.*.dirpath", "logger.*.save_dir")  # fmt: skip
EVAL_PATHS = ("paths.*", "ckpt_path", "data.root", "data.path", "trainer.default_root_dir")
PREDICT_PATHS = ("paths.*", "ckpt_path", "input", "results_file", "class_names")
#: values that name no file: ``ckpt_path=last``, URLs and ids (``s3://``, ``https://``, ``hf-hub:``, ``pipe:``)
_NOT_A_PATH = re.compile(r"^(last|[A-Za-z][\w+.-]+:.*)$")


def launch_path(value: Any, base: str | Path | None = None) -> Any:
    """``value`` made absolute against the launch folder (:func:`hydra.utils.to_absolute_path`; ``base``: another
    run's, :func:`recorded_launch_folder`) when it is a relative path; an absolute path, ``~/...``, ``last``, a URL or
    id (``s3://``, ``hf-hub:``), or no string: as given."""
    if not isinstance(value, str) or not value or _NOT_A_PATH.match(value) or Path(value).expanduser().is_absolute():
        return value
    return to_absolute_path(value) if base is None else str(Path(base) / value)


def recorded_launch_folder(record: Path) -> Path | None:
    """The folder the run of the Hydra record ``record`` (``<run>/.hydra/config.yaml``) was launched from, its relative
    paths' base: ``hydra.runtime.cwd`` of the ``hydra.yaml`` beside it; None without one."""
    hydra_yaml = Path(record).parent / "hydra.yaml"
    if not hydra_yaml.is_file():
        return None
    cwd = OmegaConf.select(OmegaConf.load(hydra_yaml), "hydra.runtime.cwd", default=None, throw_on_missing=False)
    return Path(cwd) if isinstance(cwd, str) and Path(cwd).is_absolute() else None


def launch_paths(cfg: Any, keys: Iterable[str]) -> None:
    """Each of ``keys`` whose value in ``cfg`` is a relative path (:func:`launch_path`) set to it made absolute against
    the launch folder; absolute values (``${hydra:runtime.output_dir}`` and other interpolations that resolve to one
    among them) stay as they are, interpolations too. A ``cfg`` that is no ``DictConfig`` is left as it is."""
    if not isinstance(cfg, DictConfig):
        return
    for key in _expand(cfg, keys):
        value = OmegaConf.select(cfg, key, throw_on_missing=False)
        if launch_path(value) != value:
            OmegaConf.update(cfg, key, launch_path(value), merge=False)


def _expand(cfg: DictConfig, keys: Iterable[str]) -> list[str]:
    """``keys`` with each ``*`` replaced by the names of the entries of the group before it that ``cfg`` has."""
    found = []
    for key in keys:
        group, star, rest = key.partition(".*")
        if not star:
            found.append(key)
            continue
        node = OmegaConf.select(cfg, group, throw_on_missing=False)
        if isinstance(node, DictConfig):
            found += [f"{group}.{name}{rest}" for name in node if isinstance(node[name], DictConfig) or not rest]
    return found
