"""Under ``trainer=ddp_spawn`` the W&B logger reaches the fit's processes pickled and attaches there to the run the
main process opened: what it logs there (the position-scheme pictures) goes into the run folder's W&B run, not into
a ``./wandb`` of the working directory, outside what ``wandb sync <run folder>/wandb/offline-run-*`` uploads."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

wandb = pytest.importorskip("wandb")


def _log_a_picture(rank: int, pickled: bytes, cwd: str) -> None:
    os.chdir(cwd)  # (a spawned worker starts where the run was launched: not the run folder)
    logger = pickle.loads(pickled)
    logger.log_metrics({"pos/blocks.0": wandb.Image(np.zeros((8, 8, 3), dtype=np.uint8))}, step=1)


def test_a_spawned_process_logs_its_media_into_the_run_folder(tmp_path: Path, monkeypatch):
    from vitrel.train.loggers import wandb_logger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    run, launched = tmp_path / "run", tmp_path / "launched_here"
    launched.mkdir()
    logger = wandb_logger(save_dir=str(run), mode="offline")
    pickled = pickle.dumps(logger)  # (as Lightning's spawn launcher does: the main process opens the run)
    try:
        torch.multiprocessing.start_processes(
            _log_a_picture, args=(pickled, str(launched)), nprocs=1, start_method="spawn"
        )
    finally:
        wandb.finish()
    pictures = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.png"))
    assert pictures and all(p.startswith("run/wandb/offline-run-") for p in pictures), pictures
    assert not (launched / "wandb").exists()


#: a script that stages a picture as the W&B logger does (``wandb.Image`` writes it into wandb's media folder)
_PICTURE = "import numpy as np, wandb\nwandb.Image(np.zeros((8, 8, 3), dtype=np.uint8))\nprint('staged')\n"


def test_forked_scripts_one_after_another_stage_media(tmp_path: Path):
    """Two scripts run one after the other in processes forked from tests/preloaded.py's server (which imported
    wandb, and made its media folder, once): each stages a ``wandb.Image``. The first one's end removed the server's
    media folder (it ran the server's exit functions), so the second failed with FileNotFoundError."""
    from tests.train_helpers import run_script_forked

    script = tmp_path / "picture.py"
    script.write_text(_PICTURE)
    for i in range(2):
        r = run_script_forked(str(script), [], tmp_path)
        assert (r.returncode, r.stdout) == (0, "staged\n"), (i, r.stderr[-2000:])
