"""One run at a time in a run folder.

``train()`` takes ``<run folder>/.vitrel.lock`` before it looks at the folder's checkpoints or opens its
logs, and removes it when it ends. A second ``train.py`` started in a folder whose run is still
going (``resume=auto`` would take the live ``last.ckpt``, the loggers would rewrite its files) stops
with :class:`RunFolderBusy`, which names the other run (pid, host, start time).

The lock file is created with ``O_CREAT | O_EXCL`` (one winner) and holds ``{pid, host, started,
slurm_job_id}``. It is stale, and taken over with a warning, when its process is gone: same host and
no such pid, or the same SLURM job (a requeued job continues in the folder of its killed first
attempt, possibly on another node). A lock of a live run on another host cannot be checked from here:
the error says which file to remove once that run is known to be gone.

``python train.py`` takes the lock before Hydra writes the run folder's ``.hydra/`` record (``config.yaml``,
``overrides.yaml``, ``hydra.yaml``): :class:`~vitrel.train.hydra_callbacks.TakeRunFolder` (``conf/train.yaml``'s
``hydra.callbacks.take_run_folder``); when the folder is busy, Hydra writes no record, so a refused run leaves the
running one's as it was. ``train()`` then holds the same lock again (the lock is re-entrant within a process).

Only the process of global rank 0 takes the lock (:func:`is_launching_process`): the other DDP ranks,
including the processes Lightning re-launches for plain ``ddp``, run in the folder rank 0 owns.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from lightning.pytorch.utilities.rank_zero import rank_zero_only

__all__ = ["RunFolderBusy", "RunLock", "LockOwner", "is_launching_process", "LOCK_NAME"]

LOCK_NAME = ".vitrel.lock"
log = logging.getLogger(__name__)


class RunFolderBusy(RuntimeError):
    """Another run is training in this run folder."""


@dataclass(frozen=True)
class LockOwner:
    pid: int
    host: str
    started: str  # local time, ISO format
    slurm_job_id: str | None = None

    @classmethod
    def this_process(cls) -> LockOwner:
        return cls(
            pid=os.getpid(),
            host=socket.gethostname(),
            started=time.strftime("%Y-%m-%dT%H:%M:%S"),
            slurm_job_id=os.environ.get("SLURM_JOB_ID"),
        )

    def alive(self) -> bool | None:
        """Whether the process still runs: True / False on this host, None (unknown) on another host."""
        if self.host != socket.gethostname():
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # exists, another user's
            return True
        return True

    def describe(self) -> str:
        job = f", SLURM job {self.slurm_job_id}" if self.slurm_job_id else ""
        return f"pid {self.pid} on host {self.host}, started {self.started}{job}"


def is_launching_process() -> bool:
    """True in the process of global rank 0: Lightning's rank (``RANK`` / ``SLURM_PROCID`` /
    ``LOCAL_RANK`` ... as read by ``rank_zero_only.rank``) is 0, and ``NODE_RANK`` is 0 or unset
    (nodes of a multi-node run launched by hand)."""
    return rank_zero_only.rank == 0 and int(os.environ.get("NODE_RANK", "0") or 0) == 0


#: the locks this process holds, by resolved path: (owner, number of holders). A lock taken before Hydra writes the run
#: folder (:class:`~vitrel.train.hydra_callbacks.TakeRunFolder`) is held again by ``train()``, not refused as busy.
_HELD: dict[Path, tuple[LockOwner, int]] = {}


class RunLock:
    """``with RunLock(run_dir): ...`` holds ``<run_dir>/.vitrel.lock`` (see the module docstring). Re-entrant within
    one process: a lock this process already holds is held once more, and removed when its last holder releases it."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self.owner: LockOwner | None = None

    @property
    def _key(self) -> Path:
        return self.path.resolve()

    def read(self) -> LockOwner | None:
        """The owner written in the lock file; None without one (or while it is being written)."""
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except ValueError:  # being written right now, or torn: its owner is unknown
            return None
        return LockOwner(**data)

    def acquire(self) -> None:
        held = _HELD.get(self._key)
        if held is not None and held[0].pid == os.getpid() and self.read() == held[0]:
            _HELD[self._key] = (held[0], held[1] + 1)
            self.owner = held[0]
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = LockOwner.this_process()
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._check_existing(me)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(asdict(me), f)
            self.owner = me
            _HELD[self._key] = (me, 1)
            return
        raise RunFolderBusy(f"could not take {self.path}: another process takes it at the same time")

    def _check_existing(self, me: LockOwner) -> None:
        """Remove a stale lock; raise :class:`RunFolderBusy` for a live (or unknown) one."""
        other = self.read()
        if other is None:
            time.sleep(0.2)  # its writer is between create and write: look again
            other = self.read()
        if other is None:
            raise RunFolderBusy(
                f"{self.path.parent} is locked by {self.path}, whose owner cannot be read; if no run is training "
                f"in this folder, remove {self.path} and start again"
            )
        alive = other.alive()
        same_job = other.slurm_job_id is not None and other.slurm_job_id == me.slurm_job_id
        if alive is False or (same_job and alive is None):
            why = "an earlier attempt of this SLURM job" if same_job else "that process is gone"
            log.warning(f"taking over the stale lock {self.path} of {other.describe()} ({why})")
            self.path.unlink(missing_ok=True)
            return
        where = "still running" if alive else "on another host, so it cannot be checked from here"
        raise RunFolderBusy(
            f"another run is training in {self.path.parent}: {other.describe()} ({where}). Starting here too would "
            "resume from its live last.ckpt and overwrite its logs. Use another folder (hydra.run.dir=...), or wait "
            f"for that run to end; if it is known to be gone, remove {self.path}."
        )

    def release(self) -> None:
        """Give the lock up: the file goes with its last holder in this process, and only while it still names
        this holder (never another process's lock, nor, in a forked child, its parent's)."""
        if self.owner is None or self.owner.pid != os.getpid():
            self.owner = None
            return
        held = _HELD.get(self._key)
        if held is not None and held[0] == self.owner and held[1] > 1:
            _HELD[self._key] = (held[0], held[1] - 1)  # another holder in this process keeps it
            self.owner = None
            return
        _HELD.pop(self._key, None)
        if self.read() == self.owner:
            self.path.unlink(missing_ok=True)
        self.owner = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
