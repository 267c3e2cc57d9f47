"""The W&B logger of the training runs (``conf/logger/wandb.yaml`` targets :func:`wandb_logger`).

Lightning's ``WandbLogger`` plus what a sweep on a cluster needs: the mode is picked from the
environment (``auto``), a run folder keeps one W&B run across resumes and requeues (its id is kept in
``<run folder>/wandb_run_id``), and the jobs of a ``-m`` sweep share a group named after the sweep.
"""

from __future__ import annotations

import netrc
import os
import secrets
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from vitrel.train.utils import hydra_config, is_multirun

__all__ = ["wandb_logger", "wandb_mode"]


def _wandb_key_available() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return host is not None and netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_mode(requested: str = "auto") -> str:
    """``auto``: ``$WANDB_MODE`` if set, else ``online`` with an API key (env or netrc), else ``offline``."""
    if requested not in ("auto", "online", "offline", "disabled"):
        raise ValueError(f"logger.wandb.mode must be auto, online, offline or disabled, got {requested!r}")
    if requested != "auto":
        return requested
    env = os.environ.get("WANDB_MODE")
    if env:
        return "offline" if env == "dryrun" else env
    return "online" if _wandb_key_available() else "offline"


def wandb_logger(
    save_dir: str,
    project: str = "vitrel",
    name: str | None = None,
    group: str | None = None,
    id: str | None = None,
    mode: str = "auto",
    log_model: bool = True,
    task_name: str = "train",
    **kwargs: Any,
) -> WandbLogger:
    """A ``WandbLogger`` writing under ``save_dir`` (the run folder).

    ``name`` defaults to the run folder's name (under ``-m``: ``<sweep>/<job>:<overrides>``), ``group``
    under ``-m`` to ``<task_name>-<sweep folder>``; ``id`` to the one kept in ``save_dir/wandb_run_id``
    (a new one is written there), so a resumed run continues its W&B run. ``log_model`` applies online
    only (artifacts need a server). Other keyword arguments go to ``WandbLogger`` (``entity``, ``tags``).
    """
    run_dir = Path(save_dir)
    mode = wandb_mode(mode)
    if is_multirun():
        hc = hydra_config()
        sweep = Path(str(hc.sweep.dir)).name
        group = group or f"{task_name}-{sweep}"
        name = name or f"{sweep}/{hc.job.num}:{hc.job.override_dirname or 'defaults'}"
    name = name or run_dir.name
    id_file = run_dir / "wandb_run_id"
    run_id = id or (id_file.read_text().strip() if id_file.exists() else None)
    if run_id is None:
        run_id = secrets.token_hex(4)
        if rank_zero_only.rank == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
            id_file.write_text(run_id)
    return WandbLogger(
        save_dir=str(run_dir),
        project=project,
        name=name,
        group=group,
        id=run_id,
        resume="allow",
        mode=mode,
        log_model=log_model if mode == "online" else False,
        **kwargs,
    )
