"""Training framework in processes of its own (sweeps: tests/train/test_sweep_summary.py): 2-process DDP through
``python train.py`` against 1 process, a run SIGKILLed mid-epoch (``train()`` in a process of its own) then resumed,
bad configs as ``python train.py`` prints them."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from tests.train_helpers import (
    TINY_VIT,
    SaveWeights,
    compose,
    run_script_forked,
    start_hanging_run,
)
from vitrel.train.run import train

pytestmark = pytest.mark.slow

SMALL = [*TINY_VIT, "data.num_workers=0", "trainer.accelerator=cpu", "callbacks.pos_images=null"]


# the memory loader with its batch augmentation on (drawn per position of the epoch's order), the workers
# loader without (its random augmentation runs in worker processes, per worker)
LOADERS = {
    "memory": ["data.loader=memory", "data.augment=true", "data.batch_augment.re_prob=0.5"],
    "workers": ["data.loader=workers"],
}


@pytest.mark.parametrize("loader", list(LOADERS))
def test_ddp_two_processes_equal_one_process(tmp_path, loader):
    """2 CPU processes (gloo), per-rank batch 8, end with identical weights on both ranks and the
    weights of 1 process with batch 16 on the same data order (and, memory loader, augmentation)."""
    common = [*SMALL, *LOADERS[loader], "trainer.max_epochs=1", "trainer.limit_train_batches=4"]
    common += ["trainer.limit_val_batches=1"]
    common += ["test=false", "logger=none", "progress_bar=none", "callbacks.last_checkpoint=null"]
    common += ["callbacks.model_checkpoint=null", "pos=rel2d_factored"]
    ddp = tmp_path / "ddp"
    args = [*common, "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true"]
    args += ["data.batch_size=8", f"hydra.run.dir={tmp_path / 'ddp_run'}"]
    args += [f"+callbacks.dump={{_target_: train_helpers.SaveWeights, dir: '{ddp}'}}"]
    r = run_script_forked("train.py", args, cwd=tmp_path)  # rank 0; Lightning starts rank 1 as `python train.py`
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    single = tmp_path / "single"
    train(compose(tmp_path / "single_run", [*common, "data.batch_size=16"]), callbacks=[SaveWeights(str(single))])

    w0, w1 = (torch.load(ddp / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    w = torch.load(single / "rank0.pt", weights_only=True)
    init = torch.load(single / "start_rank0.pt", weights_only=True)
    assert set(w0) == set(w1) == set(w)
    for k in w:
        assert torch.equal(w0[k], w1[k]), f"ranks differ on {k}"
        torch.testing.assert_close(w0[k], w[k], rtol=1e-4, atol=1e-5, msg=f"DDP and 1 process differ on {k}")
    # training moved the weights (a check on a few; with class-token pooling, for instance, the last
    # block's relative tables get no gradient: prefix tokens carry no relative term)
    changed = {k for k, v in w.items() if not torch.equal(init[k], v)}
    assert {"head.weight", "blocks.0.attn.pos.table_h", "blocks.0.attn.qkv.weight"} <= changed, "nothing trained"


@pytest.mark.parametrize("loader", list(LOADERS))
def test_sigkill_mid_epoch_then_resume_equals_uninterrupted(tmp_path, loader):
    # dropout (torch RNG) and mixup (numpy RNG) make the RNG state part of what must be restored; the
    # memory loader's augmentation must come back from (seed, epoch)
    common = [*SMALL, *LOADERS[loader], "data.batch_size=32", "data.drop_last=true", "trainer.max_epochs=2"]
    common += ["trainer.limit_train_batches=6", "trainer.limit_val_batches=2", "trainer.limit_test_batches=2"]
    common += ["callbacks.last_checkpoint.every_n_train_steps=4", "logger=none", "progress_bar=none"]
    common += ["+model.proj_drop_rate=0.1", "module/mixup=default", "module.mixup.mixup_alpha=0.5"]
    common += ["module.mixup.cutmix_alpha=0.0"]

    killed = tmp_path / "killed"
    marker = tmp_path / "hanging"
    proc = start_hanging_run(compose(killed, common), marker, at_step=8)
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == -signal.SIGKILL
    last = torch.load(killed / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert last["global_step"] == 8 and last["epoch"] == 1  # mid-epoch: 2 of epoch 1's 6 batches done

    resumed = train(compose(killed, [*common, "ckpt_path=last"]), callbacks=[SaveWeights(str(tmp_path / "w_res"))])
    straight = train(compose(tmp_path / "straight", common), callbacks=[SaveWeights(str(tmp_path / "w_str"))])
    for k in ("test/acc1", "test/loss", "val/loss", "val/acc1"):
        assert resumed[k] == pytest.approx(straight[k], rel=1e-5, abs=1e-6), k
    w_res = torch.load(tmp_path / "w_res" / "rank0.pt", weights_only=True)
    w_str = torch.load(tmp_path / "w_str" / "rank0.pt", weights_only=True)
    for k in w_str:
        torch.testing.assert_close(w_res[k], w_str[k], rtol=1e-5, atol=1e-6, msg=f"resumed run differs on {k}")
    assert json.loads((killed / "metrics.json").read_text())["global_step"] == 12


def test_bad_configs_fail_with_clear_messages(tmp_path):
    """A composition error and an error of the run, as train.py prints them; one more error of the run in-process
    (what Hydra prints of it is the same code path as the data root's)."""
    base = [*SMALL, "logger=none", "trainer.max_epochs=1", "trainer.limit_train_batches=1"]
    cases = {
        "unknown option": (["pos=no_such_scheme"], ["Could not find 'pos/no_such_scheme'", "rel2d_factored"]),
        "data root": (
            ["data=cifar10", f"data.root={tmp_path / 'nowhere'}", "data.download=false"],
            ["not found", str(tmp_path / "nowhere")],
        ),
    }
    for name, (extra, expected) in cases.items():
        r = run_script_forked(
            "train.py", [*base, *extra, f"hydra.run.dir={tmp_path / name.replace(' ', '_')}"], tmp_path
        )
        out = r.stdout + r.stderr
        assert r.returncode != 0, f"{name}: should fail\n{out[-2000:]}"
        for said in expected:
            assert said in out, f"{name}: {said!r} missing from the output:\n{out[-3000:]}"
    from vitrel.models.input_size import InputSizeError  # raised before the model is built, saying what to set

    with pytest.raises(InputSizeError, match=r"30x30 \(data.img_size\), are not a whole number of the 4x4 patches"):
        train(compose(tmp_path / "patch", [*base, "data.img_size=30"]))
