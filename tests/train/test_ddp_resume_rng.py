"""Under DDP each rank resumes its own RNG states: ranks whose streams parted (drop-path over a NaFlex batch's rows,
which differ by rank) draw after a mid-epoch resume what they would have drawn uninterrupted. Before, a checkpoint
held rank 0's states only and every rank took them: a NaFlex run with ``model.drop_path_rate=0.1`` under
``trainer.devices=2``, killed at step 30 and resumed (``bench/kill_resume.sh``), ended with weights up to 12 away from
the uninterrupted run's.

Two gloo processes run :class:`ExactResume`'s checkpoint hooks as Lightning calls them (``state_dict`` and
``on_save_checkpoint`` on every rank, rank 0's dict written; ``load_state_dict`` on every rank, the states put back
as the first resumed batch starts)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import torch

from tests.preloaded import run_ranks
from vitrel.train.exact_resume import ExactResume


def _rank(rank: int, port: int, ckpt: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        trainer = SimpleNamespace(world_size=2, global_rank=rank)  # what the hooks read of Lightning's Trainer
        torch.manual_seed(0)
        torch.rand(10 + 7 * rank)  # the ranks' streams part: different amounts drawn before the checkpoint
        saving = ExactResume()
        checkpoint = {"callbacks": {saving.state_key: saving.state_dict()}}
        saving.on_save_checkpoint(trainer, None, checkpoint)
        uninterrupted = torch.rand(5)
        if rank == 0:
            torch.save(checkpoint, ckpt)
        torch.distributed.barrier()

        torch.manual_seed(1234)  # a new process: any state
        resumed = ExactResume()
        resumed.load_state_dict(torch.load(ckpt, weights_only=True)["callbacks"][resumed.state_key])
        resumed.on_train_batch_start(trainer, None, None, 0)
        torch.save({"uninterrupted": uninterrupted, "resumed": torch.rand(5)}, f"{out}.{rank}")
    finally:
        torch.distributed.destroy_process_group()


def test_each_ddp_rank_resumes_its_own_rng_states(tmp_path: Path):
    ckpt, out = tmp_path / "last.ckpt", tmp_path / "draws.pt"
    run_ranks(_rank, str(ckpt), str(out))
    for rank in (0, 1):
        draws = torch.load(f"{out}.{rank}")
        assert torch.equal(draws["resumed"], draws["uninterrupted"]), rank
    held = torch.load(ckpt, weights_only=True)["callbacks"]
    assert len(next(iter(held.values()))["rng_ranks"]) == 2


def test_ranks_resuming_rank_0s_states_only_part_again():
    """A checkpoint with rank 0's RNG states only (written by one process, resumed on two at an epoch's end): rank 0
    takes them, rank 1 a stream of its own from ``(seed, rank, step)``, the same on every resume of that checkpoint."""
    torch.manual_seed(3)
    state = ExactResume(seed=7).state_dict()  # what one process's checkpoint holds (no rng_ranks)
    draws = []
    for rank in (0, 1, 1):
        torch.manual_seed(99)  # the state before the resume is of no account
        resumed = ExactResume(seed=7)
        resumed.load_state_dict(state)
        resumed.on_train_batch_start(SimpleNamespace(world_size=2, global_rank=rank, global_step=40), None, None, 0)
        draws.append(torch.rand(5))
    torch.set_rng_state(state["rng"]["torch"])
    assert torch.equal(draws[0], torch.rand(5)), "rank 0 did not resume the checkpoint's states"
    assert not torch.equal(draws[1], draws[0]), "rank 1 resumed rank 0's stream"
    assert torch.equal(draws[1], draws[2]), "rank 1's stream is not the same on each resume"
