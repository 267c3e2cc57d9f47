"""The errors about the user's files, sizes and machine that end a run with their message alone
(:func:`one_line_errors`, around ``train.py``, ``eval.py`` and ``predict.py``'s tasks)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hydra.errors import InstantiationException

import vitrel
from vitrel.config import ConfigError
from vitrel.data.datasets import DatasetIntegrityError, DatasetNotFoundError, SplitMismatchError, SplitTooSmallError
from vitrel.data.memory import MemoryBudgetError
from vitrel.data.shards import ShardCountError, ShardSplitError
from vitrel.kernels.registry import KernelDeviceError
from vitrel.models.ckpt_files import CheckpointError
from vitrel.models.input_size import InputSizeError
from vitrel.train.callbacks import NonFiniteLossError, ResumePositionError
from vitrel.train.data_contract import TargetError
from vitrel.train.rundir import RunFolderBusy
from vitrel.train.utils import AcceleratorUnavailableError, is_multirun

__all__ = ["one_line_errors"]


@contextmanager
def one_line_errors(script: str) -> Iterator[None]:
    """Errors about the user's files, sizes and machine (an unreadable or mismatched checkpoint, a missing or altered
    data set, a busy run folder, a data set over the memory budget or too small for its batch, images the model cannot
    cut into patches, a resume with another validation split, or mid-epoch with another batch size or number of
    processes, a GPU trainer on a machine without one, an attention kernel that cannot run there, a non-finite
    training loss) end a single run
    with their message alone, ``<script>: <message>`` (exit code 1), as ``predict.py`` does: the message says what to
    do, a traceback adds nothing. Hydra's ``InstantiationException`` around one of them, or around a ``ValueError``
    vitrel's own code raised (a bad data, model or scheme setting: ``data.batch_size=0``, ``model.num_heads=5``,
    ``pos.fov=60``), is unwrapped: ``<script>: data: ValueError: <message>`` (the config key, then the error). Under
    ``-m`` they are raised, so that the job fails as Hydra's jobs fail and the sweep goes on."""
    user_errors = (
        CheckpointError,
        DatasetNotFoundError,
        DatasetIntegrityError,
        SplitMismatchError,
        SplitTooSmallError,
        RunFolderBusy,
        MemoryBudgetError,
        ResumePositionError,
        AcceleratorUnavailableError,
        ConfigError,
        NonFiniteLossError,
        TargetError,
        ShardCountError,
        ShardSplitError,
        KernelDeviceError,
    )
    try:
        yield
    except (*user_errors, InputSizeError) as e:
        if is_multirun():
            raise
        raise SystemExit(f"{script}: {type(e).__name__}: {e}") from None
    except InstantiationException as e:
        cause = e.__cause__
        while isinstance(cause, InstantiationException):  # (one per nested _target_)
            cause = cause.__cause__
        if is_multirun() or not (isinstance(cause, user_errors) or _raised_by_vitrel(cause)):
            raise
        key = next((line[len("full_key: ") :] for line in str(e).splitlines() if line.startswith("full_key: ")), "")
        raise SystemExit(f"{script}: {key + ': ' if key else ''}{type(cause).__name__}: {cause}") from None


def _raised_by_vitrel(error: BaseException | None) -> bool:
    """Whether ``error`` is a ``ValueError`` raised by vitrel's own code (a data module, a model or a position scheme
    refusing a setting), not by a library it called (numpy on a damaged file, torch: there the traceback says
    more)."""
    if not isinstance(error, ValueError) or error.__traceback__ is None:
        return False
    tb = error.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    return Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(Path(vitrel.__file__).resolve().parent)
