"""Under SLURM, Lightning's requeue checkpoints (``hpc_ckpt_<n>.ckpt``, saved on ``SIGUSR1`` in the run folder) are
among the run folder's own checkpoints: a requeued job resumes the newest of them and ``last.ckpt`` (by global step),
through vitrel's resume checks, and a run that starts over (``resume=false``) is not seeded from them."""

from __future__ import annotations

import shutil

import lightning as L
import pytest
import torch

from tests.train_helpers import FAST, TINY_VIT, SendSignal, compose
from vitrel.config import ConfigError
from vitrel.models.checkpoint import CheckpointError
from vitrel.train.resume import newest_checkpoint
from vitrel.train.run import train

OVER = [*TINY_VIT, *FAST, "trainer.limit_train_batches=3", "trainer.limit_val_batches=1", "logger=none", "test=false"]
SLURM = {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "1", "SLURM_JOB_NAME": "vitrel", "SLURM_PROCID": "0"}


class StartStep(L.Callback):
    """The global step the fit started at (that of the checkpoint it loaded)."""

    step: int | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.step = trainer.global_step


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    """``last.ckpt`` of one run at steps 3 and 6 (epochs 1 and 2), without SLURM."""
    run = tmp_path_factory.mktemp("source")
    out = {}
    for epochs in (1, 2):
        train(compose(run, [*OVER, f"trainer.max_epochs={epochs}"]))
        out[3 * epochs] = tmp_path_factory.mktemp(f"step{3 * epochs}") / "last.ckpt"
        shutil.copy(run / "checkpoints" / "last.ckpt", out[3 * epochs])
    return out


def _folder(path, last=None, hpc=None):
    """A run folder holding ``last`` as its ``last.ckpt`` and ``hpc`` as ``hpc_ckpt_1.ckpt`` (either may be None)."""
    (path / "checkpoints").mkdir(parents=True)
    if last is not None:
        shutil.copy(last, path / "checkpoints" / "last.ckpt")
    if hpc is not None:
        shutil.copy(hpc, path / "hpc_ckpt_1.ckpt")
    return path


def _fit(path, over, monkeypatch) -> int:
    for k, v in SLURM.items():
        monkeypatch.setenv(k, v)
    start = StartStep()
    train(compose(path, [*OVER, *over]), callbacks=[start])
    return start.step


def test_a_requeued_job_resumes_the_newest_of_last_and_the_requeue_checkpoint(steps, tmp_path, monkeypatch):
    """``last.ckpt`` at step 3, Lightning's ``hpc_ckpt_1.ckpt`` at step 6 (``SIGUSR1`` came after the epoch's save):
    the requeued job (``resume=auto``) resumed ``last.ckpt`` and trained steps 4-6 again, since vitrel passed it to
    the fit and Lightning then looks at no requeue file. Now the newest: step 6; with ``last.ckpt`` the newer, it; at
    the same step ``last.ckpt``, then the requeue file of the highest number."""
    assert _fit(_folder(tmp_path / "a", last=steps[3], hpc=steps[6]), ["trainer.max_epochs=3"], monkeypatch) == 6
    assert _fit(_folder(tmp_path / "b", last=steps[6], hpc=steps[3]), ["trainer.max_epochs=3"], monkeypatch) == 6
    assert _fit(_folder(tmp_path / "c", hpc=steps[3]), ["trainer.max_epochs=2"], monkeypatch) == 3
    tie = _folder(tmp_path / "d", last=steps[6], hpc=steps[6])
    shutil.copy(steps[6], tie / "hpc_ckpt_2.ckpt")
    assert newest_checkpoint(tie / "checkpoints" / "last.ckpt", tie) == tie / "checkpoints" / "last.ckpt"
    (tie / "checkpoints" / "last.ckpt").unlink()
    assert newest_checkpoint(tie / "checkpoints" / "last.ckpt", tie) == tie / "hpc_ckpt_2.ckpt"  # (as Lightning)


def test_a_run_started_over_is_not_seeded_from_a_requeue_checkpoint(steps, tmp_path, monkeypatch):
    """``resume=false`` in a folder with an ``hpc_ckpt_1.ckpt`` (step 3): vitrel passed no checkpoint, so Lightning
    loaded the requeue file, and the run that was to start over continued at step 3. Now it starts at 0, and the
    file is removed (logged), so that a later requeue does not resume the abandoned run from it."""
    run = _folder(tmp_path / "a", hpc=steps[3])
    assert _fit(run, ["trainer.max_epochs=2", "resume=false"], monkeypatch) == 0
    assert not list(run.glob("hpc_ckpt_*.ckpt"))


def test_a_requeue_checkpoint_passes_the_resume_checks(steps, tmp_path, monkeypatch):
    """An ``hpc_ckpt_1.ckpt`` of another model (a folder run again with ``model.depth=1``): Lightning loaded it with
    none of vitrel's resume checks, and its strict load failed (``Unexpected key(s)``). Now the check that refuses
    any other checkpoint of another model: a ``CheckpointError`` naming the key."""
    run = _folder(tmp_path / "a", hpc=steps[3])
    with pytest.raises(CheckpointError, match=r"hpc_ckpt_1.ckpt holds another model than the one configured \(depth"):
        _fit(run, ["trainer.max_epochs=2", "model.depth=1"], monkeypatch)


def _step(path) -> int:
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)["global_step"]


def test_a_requeued_job_started_from_a_file_continues_its_own_checkpoints(steps, tmp_path, monkeypatch, caplog):
    """``ckpt_path=<file of step 3>`` (to continue an earlier run in a new folder), stopped at step 5 (``last.ckpt``),
    then requeued with the same command in the same folder: it started from the file again, at step 3, and the steps
    the run had trained were lost. Now it continues the folder's newest checkpoint of that start (step 5: its
    ``last.ckpt``, or a requeue file); ``resume=false`` still starts from the file and drops the requeue files."""
    run, start = tmp_path / "run", [f"ckpt_path={steps[3]}", "trainer.max_epochs=3"]
    for k, v in SLURM.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit):  # (SIGTERM: last.ckpt saved at the end of step 5)
        train(compose(run, [*OVER, *start]), callbacks=[SendSignal(at_step=4)])
    stopped = shutil.copy(run / "checkpoints" / "last.ckpt", tmp_path / "stopped.ckpt")
    assert _step(stopped) == 5
    caplog.set_level("INFO", logger="lightning.pytorch")  # (rank_zero_info's)
    assert _fit(run, start, monkeypatch) == 5
    said = f"resume=auto: continuing from {run / 'checkpoints' / 'last.ckpt'}, which this folder's run wrote after "
    assert caplog.text.count(said + f"starting from ckpt_path={steps[3]} (resume=false starts from") == 1
    last = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True, mmap=True)
    assert last["global_step"] == 9 and last["vitrel_start_ckpt"] == str(steps[3].resolve())  # (carried over)
    shutil.copy(stopped, run / "hpc_ckpt_1.ckpt")
    assert _fit(run, [*start, "resume=false"], monkeypatch) == 3 and not list(run.glob("hpc_ckpt_*.ckpt"))
    assert _fit(_folder(tmp_path / "hpc", hpc=stopped), start, monkeypatch) == 5  # (a SIGUSR1 requeue's file)


def test_a_folder_of_another_start_is_not_mixed_with_a_file_given(steps, tmp_path, monkeypatch):
    """A folder holding another run's ``last.ckpt`` (step 6, started without ``ckpt_path``) given
    ``ckpt_path=<file of step 3>``: it started from the file and wrote its checkpoints over the other run's. Now a
    ``ConfigError`` saying what to give: ``resume=false`` starts from the file; the folder's own file named as
    ``ckpt_path`` goes on from it, as before."""
    run = _folder(tmp_path / "a", last=steps[6])
    with pytest.raises(ConfigError, match=r"holds another run's checkpoints \(.*last.ckpt, of a run started without"):
        _fit(run, [f"ckpt_path={steps[3]}", "trainer.max_epochs=3"], monkeypatch)
    own = [f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}", "trainer.max_epochs=3"]
    assert _fit(run, own, monkeypatch) == 6
    assert _fit(run, [f"ckpt_path={steps[3]}", "trainer.max_epochs=2", "resume=false"], monkeypatch) == 3


class SaveAsRequeue(L.Callback):
    """Save ``path`` where Lightning's ``SIGUSR1`` handler may: at the start of training step ``at_step`` (its batch
    drawn, not trained) or after the first batch of the validation at step ``at_step`` (the rest not run)."""

    def __init__(self, path, at_step: int, during: str) -> None:
        self.path, self.at_step, self.during = path, at_step, during

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.during == "step" and trainer.global_step == self.at_step:
            trainer.save_checkpoint(self.path)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if self.during == "validation" and not trainer.sanity_checking and trainer.global_step == self.at_step:
            trainer.save_checkpoint(self.path) if batch_idx == 0 else None


@pytest.mark.parametrize("during", ["step", "validation"])
def test_a_requeue_checkpoint_saved_within_a_step_or_a_validation_is_passed_over(
    steps, tmp_path, monkeypatch, during, caplog
):
    """Lightning's requeue file saved mid-validation (step 6; ``last.ckpt`` at step 3): resumed from it, the schedule
    went back an epoch and that validation never ran (an audit: test top-1 0.323 against 0.302 uninterrupted); saved
    at a step's start, that step's batch was skipped. Such a file is passed over, with a warning, for ``last.ckpt``;
    vitrel's own save at a step's end is taken (the first test)."""
    over = [o for o in OVER if not o.startswith("trainer.limit_val_batches")] + ["trainer.limit_val_batches=2"]
    hpc = tmp_path / f"{during}.ckpt"
    at = 4 if during == "step" else 6
    train(compose(tmp_path / "src", [*over, "trainer.max_epochs=2"]), callbacks=[SaveAsRequeue(hpc, at, during)])
    assert _step(hpc) == at
    run = _folder(tmp_path / "a", last=steps[3], hpc=hpc)
    with pytest.warns(UserWarning, match=rf"hpc_ckpt_1.ckpt, Lightning's SLURM requeue checkpoint of step {at}, was "
                      rf"saved during a {'training step' if during == 'step' else 'validation'}.* passed over for "
                      rf".*last.ckpt \(step 3\)"):  # fmt: skip
        assert _fit(run, ["trainer.max_epochs=3"], monkeypatch) == 3
