"""The randomness of a run by rank: under DDP the draws of the training step (drop-path masks, token-drop choices,
dropout, mixup's lambda) differ from rank to rank while rank 0 keeps the stream it had; the epoch's order is shared
(each image once over the ranks); one process is bitwise repeatable for a seed, with workers.

Two gloo CPU ranks of ``train()``, forked from the preloaded server (tests/preloaded.py), as in tests/train/test_ddp.py.
"""

from __future__ import annotations

import os
import random
from collections import Counter
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch

from tests.preloaded import run_ranks
from tests.train_helpers import FAST, TINY_VIT, SaveWeights, compose
from vitrel.layout.geometry import Grid
from vitrel.models.naflex import drop_tokens, grid_batch, token_drop_rates
from vitrel.train.run import train

pytestmark = pytest.mark.slow

# every random op of the model and module on: drop-path (stochastic depth), token dropping, dropout, mixup/cutmix
RANDOM = ["model.drop_path_rate=0.5", "model.token_drop=0.5", "+model.drop_rate=0.1"]
RANDOM += ["module/mixup=default", "data.drop_last=true"]  # (mixup: an even batch)
RUN = [*TINY_VIT, *FAST, "data.batch_size=8", "trainer.max_epochs=1", "trainer.limit_train_batches=3"]
RUN += ["trainer.limit_val_batches=0", "test=false", "logger=none", "callbacks.model_checkpoint=null"]
RUN += ["callbacks.last_checkpoint=null", *RANDOM]
DDP = ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true"]


class RecordDraws(L.Callback):
    """Each training step's random draws on this rank, saved to ``<dir>/rank<r>.pt`` at the end of training: the RNG
    states at the batch's start (torch, numpy, python), each drop-path module's kept samples (a forward hook: a row of
    its output all zero is a dropped sample), the patches token dropping keeps (``drop_tokens`` on the batch's grid
    from a copy of the torch state: its draw is the step's first) and mixup's ``(lambda, cutmix)`` (timm's draw, the
    numpy state put back after it)."""

    def __init__(self, dir: str) -> None:
        self.dir, self.steps, self._hooks = dir, [], []

    def on_train_start(self, trainer, pl_module) -> None:
        for name, m in pl_module.model.named_modules():
            if type(m).__name__ == "DropPath":
                self._hooks.append(m.register_forward_hook(self._keep(name)))

    def _keep(self, name: str):
        def hook(module, args, out) -> None:
            if module.training:
                self.steps[-1]["drop_path"][name] = out.flatten(1).ne(0).any(1)

        return hook

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        model, x = pl_module.model, batch[0]
        g = torch.Generator().set_state(torch.get_rng_state())
        p = model.patch_embed.patch_size[0]
        grid = Grid(x.shape[-2] // p, x.shape[-1] // p)
        tokens = grid_batch(x.new_zeros(x.shape[0], grid.h * grid.w, 1), grid)
        kept = drop_tokens(tokens, token_drop_rates(model.token_drop, x.shape[0]), generator=g).coords
        state = np.random.get_state()
        lam, cutmix = pl_module.mixup_fn._params_per_batch()
        np.random.set_state(state)
        self.steps.append(
            {
                "torch": torch.get_rng_state(),
                "numpy": torch.from_numpy(state[1].astype(np.int64)),
                "python": torch.tensor(random.getstate()[1], dtype=torch.int64),
                "token_drop": kept,
                "mixup": torch.tensor([float(lam), float(cutmix)], dtype=torch.float64),
                "drop_path": {},
            }
        )

    def on_train_end(self, trainer, pl_module) -> None:
        for h in self._hooks:
            h.remove()
        Path(self.dir).mkdir(parents=True, exist_ok=True)
        torch.save(self.steps, Path(self.dir) / f"rank{trainer.global_rank}.pt")


def _rank(rank: int, port: int, cfg, callbacks: list) -> None:
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0")
    os.environ.update(LOCAL_RANK=str(rank))
    rank_zero_only.rank = rank
    train(cfg, callbacks=callbacks)


def _fresh_states(seed: int) -> dict:
    """The RNG states ``seed_everything(seed)`` gives (Lightning's DDP strategy seeds so again when the ranks join)."""
    saved = torch.get_rng_state(), np.random.get_state(), random.getstate()
    L.seed_everything(seed, verbose=False)
    out = {"torch": torch.get_rng_state(), "numpy": torch.from_numpy(np.random.get_state()[1].astype(np.int64))}
    out["python"] = torch.tensor(random.getstate()[1], dtype=torch.int64)
    torch.set_rng_state(saved[0]), np.random.set_state(saved[1]), random.setstate(saved[2])
    return out


def test_ddp_ranks_draw_apart_and_rank_0_keeps_its_stream(tmp_path):
    """2 gloo ranks with drop-path, token dropping, dropout and mixup, 3 steps: at every step the ranks' RNG states,
    drop-path masks, token-drop choices and mixup lambdas differ; rank 0 starts training from the states
    ``seed_everything(seed)`` gives, as before ranks were seeded apart (the stream of a one-process run is untouched:
    rank 0 and one process are never reseeded)."""
    run_ranks(_rank, compose(tmp_path / "ddp", [*RUN, *DDP]), [RecordDraws(str(tmp_path / "draws"))])
    r0, r1 = (torch.load(tmp_path / f"draws/rank{r}.pt", weights_only=True) for r in (0, 1))
    assert len(r0) == len(r1) == 3
    fresh = _fresh_states(0)
    for key in ("torch", "numpy", "python"):
        assert torch.equal(r0[0][key], fresh[key]), f"rank 0's {key} RNG state was reseeded"
    for step, (a, b) in enumerate(zip(r0, r1)):
        for key in ("torch", "numpy", "python", "token_drop", "mixup"):
            assert not torch.equal(a[key], b[key]), f"step {step}: ranks 0 and 1 drew the same {key}"
        assert a["drop_path"].keys() == b["drop_path"].keys() != set()
        masks = [torch.stack(list(s["drop_path"].values())) for s in (a, b)]
        assert not torch.equal(*masks), f"step {step}: both ranks dropped the same paths"


class RecordImages(L.Callback):
    """Every image of the training batches of this rank (its pixels' bytes), saved to ``<dir>/rank<r>.pt``."""

    def __init__(self, dir: str) -> None:
        self.dir, self.images = dir, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.images += [x.numpy().tobytes() for x in batch[0]]

    def on_train_end(self, trainer, pl_module) -> None:
        Path(self.dir).mkdir(parents=True, exist_ok=True)
        torch.save(self.images, Path(self.dir) / f"rank{trainer.global_rank}.pt")


@pytest.mark.parametrize("loader", ["memory", "workers"])
def test_ddp_epoch_shows_each_image_once_over_the_ranks(tmp_path, loader):
    """2 gloo ranks (seeded apart), 2 batches each: the images the two ranks trained on are those of one process's
    first 4 batches, each once (the epoch's order seeded alike on every rank, rank r taking ``order[r::2]``; a whole
    epoch shows the same, at 50x this test's images; batches of 50)."""
    run = [*TINY_VIT, *FAST, f"data.loader={loader}", "data.batch_size=50", "trainer.max_epochs=1"]
    ddp, one = ["trainer.limit_train_batches=2", *DDP], ["trainer.limit_train_batches=4"]
    run += ["trainer.limit_val_batches=0", "test=false", "logger=none", "callbacks.model_checkpoint=null"]
    run += ["callbacks.last_checkpoint=null", "model.drop_path_rate=0.5"]
    run_ranks(_rank, compose(tmp_path / "ddp", [*run, *ddp]), [RecordImages(str(tmp_path / "ddp_images"))])
    train(compose(tmp_path / "one", [*run, *one]), callbacks=[RecordImages(str(tmp_path / "one_images"))])
    r0, r1, one = (torch.load(tmp_path / p, weights_only=False) for p in ("ddp_images/rank0.pt", "ddp_images/rank1.pt",
                                                                          "one_images/rank0.pt"))  # fmt: skip
    assert len(one) == 200 and len(r0) == len(r1) == 100
    seen, epoch = Counter(r0 + r1), Counter(one)
    twice, missed = sum((seen - epoch).values()), sum((epoch - seen).values())
    assert twice == missed == 0, f"the ranks trained on {twice} images twice and missed {missed} of one process's"


def _weights(tmp_path: Path, name: str, seed: int) -> dict:
    run = [*RUN, f"seed={seed}", "data.loader=workers", "data.num_workers=2", "data.augment=true", "logger=csv"]
    train(compose(tmp_path / name, run), callbacks=[SaveWeights(str(tmp_path / f"{name}_weights"))])
    return torch.load(tmp_path / f"{name}_weights" / "rank0.pt", weights_only=True)


def test_one_process_same_seed_same_weights_with_workers(tmp_path):
    """One process, 2 workers with random augmentation, every random op of the model and mixup, 3 steps: the same
    seed twice gives bitwise the same weights, another seed other weights; the run's logged config holds its seed."""
    a, b, c = _weights(tmp_path, "a", 5), _weights(tmp_path, "b", 5), _weights(tmp_path, "c", 6)
    assert all(torch.equal(a[k], b[k]) for k in a), "the same seed gave other weights"
    assert not all(torch.equal(a[k], c[k]) for k in a), "another seed gave the same weights"
    from omegaconf import OmegaConf

    assert OmegaConf.load(next((tmp_path / "c").rglob("hparams.yaml"))).seed == 6
