"""Training framework, in-process: every pos config x both architectures, the config convention,
signals, NaN guard, EMA, compile, evaluation at a larger image size, the pictures."""

from __future__ import annotations

import json
import math
import signal
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import vitrel
from tests.train_helpers import CONF, FAST, TINY_SWIN, TINY_VIDEO, TINY_VIT, PoisonWeights, SendSignal, compose
from vitrel.config import ConfigError
from vitrel.data.base import EpochSampler
from vitrel.train.callbacks import NonFiniteLossError
from vitrel.train.evaluate import evaluate
from vitrel.train.module import ClassifierModule
from vitrel.train.run import check_launch, check_spawn_ema, train

POS_CONFIGS = sorted(p.stem for p in (CONF / "pos").glob("*.yaml"))
SHORT = ["trainer.max_epochs=1", "trainer.limit_train_batches=4", "trainer.limit_val_batches=1"]
SHORT += ["trainer.limit_test_batches=1", "logger=none"]
EMA = ["module/ema=default", "module.ema.decay=0.5", "module.ema.use_warmup=false"]


def test_every_registered_scheme_has_a_config():
    assert set(POS_CONFIGS) == set(vitrel.list_pos()), "conf/pos/ and the registry disagree"


class _FixedLogits(torch.nn.Module):
    """Logits given per batch index (the images are their index): a classifier whose scores are known."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("logits", logits)
        self.w = torch.nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits[x.long()] + self.w


@pytest.mark.parametrize("num_classes", [10, 6, 5, 2])
def test_top5_counted_from_the_logits_and_absent_with_five_classes_or_fewer(num_classes):
    """test/acc5: the share of images whose label is among the 5 highest logits, counted here in float64; with 5
    classes or fewer every label is, so no acc5 (nor acc<n>) is logged."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(40, num_classes, generator=g, dtype=torch.float64)
    labels = torch.randint(num_classes, (40,), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(40), labels), batch_size=16)
    module = ClassifierModule(_FixedLogits(logits.float()), num_classes=num_classes)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    res = trainer.test(module, dataloaders=loader, verbose=False)[0]
    acc = [k for k in res if k.startswith("test/acc")]
    if num_classes <= 5:
        assert acc == ["test/acc1"]
        return
    in_top5 = [labels[i].item() in logits[i].topk(5).indices.tolist() for i in range(40)]
    assert sorted(acc) == ["test/acc1", "test/acc5"]
    assert res["test/acc5"] == pytest.approx(sum(in_top5) / 40, abs=1e-6)
    assert res["test/acc1"] == pytest.approx((logits.argmax(1) == labels).double().mean().item(), abs=1e-6)


@pytest.mark.parametrize("arch", ["vit", "swin"])
@pytest.mark.parametrize("pos", POS_CONFIGS)
def test_fast_dev_run(tmp_path, arch, pos):
    model = TINY_VIT if arch == "vit" else TINY_SWIN
    cfg = compose(tmp_path, [*model, *FAST, f"pos={pos}", "debug=fdr"])
    metrics = train(cfg)
    assert {"test/acc1", "test/acc5", "test/loss", "val/acc1"} <= set(metrics)
    assert all(math.isfinite(v) for v in metrics.values())
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["status"] == "finished" and saved["pos"] == pos and saved["global_step"] == 1


def test_checkpoint_contents_compile_and_reload(tmp_path):
    """compile keeps clean ``model.*`` keys; the checkpoint has ``vitrel_cfg``, loads with weights_only and
    through ``vitrel.load_model``; EMA weights (timm ModelEmaV3) live under ``ema_model.module.*``."""
    cfg = compose(
        tmp_path,
        [*TINY_VIT, *FAST, *SHORT, "pos=rope2d_mixed", "module.compile={backend: eager}", *EMA],
    )
    train(cfg)
    ckpt_file = tmp_path / "checkpoints" / "last.ckpt"
    ckpt = torch.load(ckpt_file, map_location="cpu", weights_only=True)
    keys = list(ckpt["state_dict"])
    assert not any("_orig_mod" in k for k in keys)
    assert any(k.startswith("model.") for k in keys) and any(k.startswith("ema_model.module.") for k in keys)
    assert ckpt["vitrel_cfg"]["architecture"] == "vitrel_vit_tiny_patch4_32"
    assert ckpt["vitrel_cfg"]["pos"]["name"] == "rope2d_mixed"
    live = vitrel.load_model(ckpt_file, use_ema=False)
    ema = vitrel.load_model(ckpt_file, use_ema=True)
    default = vitrel.load_model(ckpt_file)  # (use_ema="auto": the weights the run validated and tested, as eval.py)
    sd = ckpt["state_dict"]
    for k, v in default.state_dict().items():
        torch.testing.assert_close(v, sd[f"ema_model.module.{k}"], rtol=0, atol=0)
    for k, v in live.state_dict().items():
        torch.testing.assert_close(v, sd[f"model.{k}"], rtol=0, atol=0)
        torch.testing.assert_close(ema.state_dict()[k], sd[f"ema_model.module.{k}"], rtol=0, atol=0)
    assert not torch.equal(sd["model.head.weight"], sd["ema_model.module.head.weight"])


def test_mixup_cutmix_trains(tmp_path):
    over = [*TINY_VIT, *FAST, *SHORT, "module/mixup=default", "module.mixup.mixup_alpha=0.5", "data.drop_last=true"]
    metrics = train(compose(tmp_path, over))
    assert math.isfinite(metrics["train/loss_epoch"])


def test_mixup_loss_is_timms_soft_target_cross_entropy():
    """The loss of a mixed batch (CutMix or Mixup, smoothed targets) is timm's ``SoftTargetCrossEntropy``, the loss
    timm's ``train.py`` takes with its ``Mixup``, on the logits in float32 as the module scores them."""
    import functools

    from timm.data import Mixup
    from timm.loss import SoftTargetCrossEntropy

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 5)).double()
    mixup = functools.partial(Mixup, mixup_alpha=0.8, cutmix_alpha=1.0)
    module = ClassifierModule(model, num_classes=5, label_smoothing=0.1, mixup=mixup)
    x, y = torch.randn(4, 3, 4, 4, dtype=torch.float64), torch.tensor([0, 3, 1, 4])
    for seed in range(4):  # (numpy draws Mixup's lambda and its choice of CutMix)
        np.random.seed(seed)
        with pytest.warns(UserWarning, match="self.log"):  # (no trainer to log to)
            loss = module.training_step((x.clone(), y), 0)
        np.random.seed(seed)
        mixed, target = module.mixup_fn(x.clone(), y)
        want = SoftTargetCrossEntropy()(model(mixed).float(), target)
        torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)


def test_every_object_node_has_a_target(tmp_path):
    """One convention: data, model, module (and its optimizer, scheduler, mixup, EMA), trainer, every
    callback and logger are built from a ``_target_``; checkpoint folders come by interpolation."""
    cfg = compose(tmp_path, ["module/mixup=default", "module/ema=default", "logger=[wandb,csv,tensorboard]"])
    for node in (cfg.data, cfg.model, cfg.module, cfg.module.optimizer, cfg.module.scheduler, cfg.module.mixup):
        assert "_target_" in node
    assert "_target_" in cfg.module.ema and "_target_" in cfg.trainer
    assert cfg.module.optimizer._partial_ and cfg.module.scheduler._partial_
    assert all("_target_" in c for c in cfg.callbacks.values()) and set(cfg.logger) == {"wandb", "csv", "tensorboard"}
    assert all("_target_" in c for c in cfg.logger.values())
    assert cfg.callbacks.last_checkpoint.dirpath == f"{tmp_path}/checkpoints"
    assert cfg.model.pos == cfg.pos and "_target_" not in cfg.pos  # a plain spec handed to the model


def test_built_objects_follow_the_config(tmp_path):
    from hydra.utils import instantiate
    from timm.data import Mixup
    from timm.utils import ModelEmaV3

    from vitrel.train.run import build_model

    over = ["module/mixup=default", "module/ema=default", "module.optimizer.lr=0.01", "+model.num_classes=7"]
    cfg = compose(tmp_path, [*TINY_VIT, *over, "module.optimizer.weight_decay=0.2"])
    dm = instantiate(cfg.data)
    model = build_model(cfg.model, dm)
    assert model.num_classes == 7 and model.vitrel_cfg["in_chans"] == 1  # set in the node / from the data
    assert tuple(model.vitrel_cfg["img_size"]) == (28, 28)
    module = instantiate(cfg.module, model=model, num_classes=7)
    assert isinstance(module.mixup_fn, Mixup) and module.mixup_fn.num_classes == 7
    assert module.mixup_fn.label_smoothing == cfg.module.label_smoothing
    assert isinstance(module.ema_model, ModelEmaV3) and module.ema_model.decay == cfg.module.ema.decay
    assert not any(p.requires_grad for p in module.ema_model.parameters())
    opt = module.make_optimizer(params=[torch.nn.Parameter(torch.zeros(2, 2))])
    assert type(opt) is torch.optim.AdamW and opt.defaults["lr"] == 0.01 and opt.defaults["weight_decay"] == 0.2


def test_sigterm_saves_checkpoint_then_exits(tmp_path):
    cfg = compose(tmp_path, [*TINY_VIT, *FAST, *SHORT, "trainer.limit_train_batches=10"])
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exc:
        train(cfg, callbacks=[SendSignal(at_step=3, signum=signal.SIGTERM)])
    assert exc.value.code == 128 + signal.SIGTERM
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 4  # saved at the end of the batch during which the signal came
    assert signal.getsignal(signal.SIGTERM) == before  # handlers restored


def test_sigterm_calls_the_handler_installed_before_the_run(tmp_path):
    """A SIGTERM handler of the caller's, installed before ``train()``, is called when SIGTERM comes (as the signal
    comes, before the checkpoint), as Lightning's own handler would; the run still saves and exits."""
    cfg = compose(tmp_path, [*TINY_VIT, *FAST, *SHORT, "trainer.limit_train_batches=10"])
    calls = []

    def callers(signum, frame):
        calls.append((signum, (tmp_path / "checkpoints" / "last.ckpt").exists()))

    before = signal.signal(signal.SIGTERM, callers)
    try:
        with pytest.raises(SystemExit) as exc:
            train(cfg, callbacks=[SendSignal(at_step=3, signum=signal.SIGTERM)])
        assert signal.getsignal(signal.SIGTERM) == callers  # put back
    finally:
        signal.signal(signal.SIGTERM, before)
    assert calls == [(signal.SIGTERM, False)] and exc.value.code == 128 + signal.SIGTERM
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 4


def test_sigusr2_saves_checkpoint_then_hands_over_to_the_previous_handler(tmp_path):
    """submitit signals a time-out with SIGUSR2 and requeues in its handler: it runs after the save."""
    cfg = compose(tmp_path, [*TINY_VIT, *FAST, *SHORT, "trainer.limit_train_batches=10"])
    calls = []

    def submitit_like(signum, frame):
        calls.append((signum, (tmp_path / "checkpoints" / "last.ckpt").exists()))

    before = signal.signal(signal.SIGUSR2, submitit_like)
    try:
        with pytest.raises(SystemExit) as exc:
            train(cfg, callbacks=[SendSignal(at_step=2, signum=signal.SIGUSR2)])
        assert signal.getsignal(signal.SIGUSR2) == submitit_like
    finally:
        signal.signal(signal.SIGUSR2, before)
    assert calls == [(signal.SIGUSR2, True)] and exc.value.code == 128 + signal.SIGUSR2
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 3


def test_nan_loss_stops_with_clear_message_and_keeps_good_checkpoint(tmp_path):
    cfg = compose(
        tmp_path,
        [
            *TINY_VIT,
            *FAST,
            *SHORT,
            "trainer.limit_train_batches=10",
            "callbacks.last_checkpoint.every_n_train_steps=2",
        ],
    )
    with pytest.raises(NonFiniteLossError, match=r"non-finite training loss .* global step 5.*last good checkpoint"):
        train(cfg, callbacks=[PoisonWeights(at_step=5)])
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 4
    assert all(torch.isfinite(v).all() for v in ckpt["state_dict"].values() if v.is_floating_point())


def test_a_learning_rate_that_diverges_stops_train_py_with_one_line(tmp_path):
    """``module.optimizer.lr=1e3``: the loss turns NaN within a few steps and train.py stops there with the NaN
    guard's message alone (what happened, the advice to lower the rate), no traceback, no epoch logging nan."""
    from vitrel.train.user_errors import one_line_errors

    over = [*TINY_VIT, *FAST, *SHORT, "trainer.limit_train_batches=40", "module.optimizer.lr=1e3"]
    over += ["module.scheduler=null"]
    with pytest.raises(SystemExit) as stop, one_line_errors("train.py"):
        train(compose(tmp_path, over))
    message = str(stop.value)
    assert message.startswith("train.py: NonFiniteLossError: non-finite training loss (nan) in epoch 1"), message
    assert "Try a lower module.optimizer.lr" in message and "\n" not in message


def test_16_true_with_adamw_eps_0_in_float16_is_refused_before_step_1(tmp_path):
    """``trainer.precision=16-true`` (float16 weights and AdamW state) with AdamW's default eps=1e-8, 0 in float16:
    the loss was NaN at step 1 (m / (0 + 0) where a gradient's square underflows) and the NaN guard explained it after
    the fact. It is now refused before the first step, naming 16-mixed and an eps float16 holds; with that eps the
    run trains (60 steps: train loss 2.125, 2.107 in 32-true)."""
    run = [*TINY_VIT, *FAST, *SHORT, "trainer.precision=16-true", "test=false"]
    with pytest.raises(ConfigError, match=r"AdamW's eps=1e-08 rounds to 0 in float16.*16-mixed") as stop:
        train(compose(tmp_path, run))
    assert str(stop.value).endswith("module.optimizer.eps=0.0001"), stop.value
    assert not list(tmp_path.rglob("*.ckpt"))
    metrics = train(compose(tmp_path / "eps", [*run, "module.optimizer.eps=1e-4"]))
    assert math.isfinite(metrics["train/loss"]), metrics


@pytest.mark.parametrize("eps, note", [("1e-4", ""), ("1e-6", "; the optimizer's eps=1e-06 is small in float16")])
def test_16_true_diverging_gets_advice_for_16_true(tmp_path, eps, note):
    """The NaN guard's advice under 16-true names 16-true and its alternatives, not "bf16-mixed instead of 16-mixed",
    a precision the run did not use; and an eps below 1e-4, which float16 holds but which NaN'd a tiny run within 7
    steps (1e-6; 1e-7: 3 steps), as too small."""
    run = [*TINY_VIT, *FAST, *SHORT, "trainer.precision=16-true", f"module.optimizer.eps={eps}", "test=false"]
    with pytest.raises(NonFiniteLossError) as stop:
        train(compose(tmp_path, run), callbacks=[PoisonWeights(at_step=1)])
    message = str(stop.value)
    assert (
        "trainer.precision=16-mixed, bf16-mixed or bf16-true instead of 16-true (float16 weights and optimizer "
        f"state){note}" in message
    ), message
    assert "instead of 16-mixed" not in message
    assert ("module.optimizer.eps=0.0001 trains" in message) == bool(note)


@pytest.mark.parametrize(
    "precision, advice",
    [("bf16-true", ", or trainer.precision=bf16-mixed instead of bf16-true (float32 weights)."), ("32-true", ".")],
)
def test_nan_advice_names_only_the_precision_in_use(tmp_path, precision, advice):
    run = [*TINY_VIT, *FAST, *SHORT, f"trainer.precision={precision}", "test=false"]
    with pytest.raises(NonFiniteLossError) as stop:
        train(compose(tmp_path, run), callbacks=[PoisonWeights(at_step=1)])
    assert str(stop.value).endswith(f"Try a lower module.optimizer.lr or clipping (trainer.gradient_clip_val){advice}")


def test_ckpt_path_last_without_checkpoint_is_a_clear_error(tmp_path):
    """A missing ``ckpt_path`` (``last`` in a new folder, or a file that is not there) is a ``CheckpointError``, which
    ``train.py`` prints as one line, as ``eval.py`` does (a FileNotFoundError came with Hydra's traceback)."""
    from vitrel.models.checkpoint import CheckpointError

    cfg = compose(tmp_path, [*TINY_VIT, *FAST, *SHORT, "ckpt_path=last"])
    with pytest.raises(CheckpointError, match="ckpt_path=last: there is no .*last.ckpt"):
        train(cfg)
    cfg = compose(tmp_path, [*TINY_VIT, *FAST, *SHORT, f"ckpt_path={tmp_path / 'gone.ckpt'}"])
    with pytest.raises(CheckpointError, match=r"gone.ckpt: no such file or folder$"):
        train(cfg)
    # Lightning's words other than last are paths here: said so, with what to give (train.py, eval.py)
    said = r"best: no such file or folder \(Lightning's ckpt_path='best' is not taken: give a file, e.g. <run>/"
    with pytest.raises(CheckpointError, match=said):
        train(compose(tmp_path, [*TINY_VIT, *FAST, *SHORT, f"ckpt_path={tmp_path / 'best'}"]))
    with pytest.raises(CheckpointError, match=said):
        evaluate(compose(tmp_path / "eval", [f"ckpt_path={tmp_path / 'best'}"], "eval"))


def test_truncated_last_checkpoint_is_a_clear_error(tmp_path):
    from vitrel.models.checkpoint import CheckpointError

    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.ckpt").write_bytes(b"PK\x03\x04 cut short")
    with pytest.raises(CheckpointError, match="last.ckpt"):
        train(compose(tmp_path, [*TINY_VIT, *FAST, *SHORT]))  # resume=auto picks it up


def test_eval_at_larger_image_size(tmp_path, capsys):
    from vitrel.train.evaluate import evaluate

    run = tmp_path / "run"
    train(compose(run, [*TINY_VIT, *FAST, *SHORT, "pos=rel2d_full", "trainer.limit_train_batches=8"]))
    ckpt = run / "checkpoints" / "last.ckpt"
    out = tmp_path / "eval"
    over = [f"ckpt_path={ckpt}", "data.img_size=44", "data.num_workers=0", "trainer.accelerator=cpu"]
    over += ["trainer.limit_test_batches=4", "progress_bar=none"]
    metrics = evaluate(compose(out, over, config_name="eval"))
    res = json.loads((out / "eval_metrics.json").read_text())
    assert res["img_size"] == 44 and res["grid"] == [11, 11] and res["precision"] == "32-true"
    assert (res["num_images"], res["split_images"]) == (4 * 64, 2000)  # scored: 4 batches of 64 (limit_test_batches)
    assert "test (256 of its 2000 images: trainer.limit_test_batches)" in capsys.readouterr().out
    assert 0.0 <= metrics["test/acc1"] <= 1.0 and math.isfinite(metrics["test/loss"])
    # the resized model keeps the offsets it was trained with
    trained = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]["model.blocks.0.attn.pos.table"]
    big = vitrel.load_model(ckpt, img_size=44).blocks[0].attn.pos.table
    assert big.shape[:2] == (21, 21) and trained.shape[:2] == (13, 13)
    torch.testing.assert_close(big[4:17, 4:17], trained)


def test_default_run_validates_on_a_split_held_out_of_train(tmp_path):
    """val/acc1 is the final weights' accuracy on the default data config's held-out 10 % of the train file (seeded by
    data.seed), counted here in float64 from the raw images: not on the test split."""
    from vitrel.data import fashion_mnist as fm
    from vitrel.data.base import seeded_split

    over = [*TINY_VIT, *FAST, "trainer.max_epochs=1", "trainer.limit_train_batches=8", "logger=none"]
    cfg = compose(tmp_path, [*over, "data.eval_batch_size=250", "trainer.limit_test_batches=2"])
    assert cfg.data.val_fraction == 0.1 and cfg.data.seed == 0
    metrics = train(cfg)
    model = vitrel.load_model(tmp_path / "checkpoints" / "last.ckpt").double().eval()  # the weights validated last
    x, y = fm.load_embedded_subset("train")
    train_idx, val_idx = seeded_split(len(y), 0.1, 0)
    assert len(val_idx) == 1000 and not set(val_idx) & set(train_idx)
    images = (torch.from_numpy(x[val_idx]).double()[:, None] / 255 - fm.MEAN) / fm.STD
    with torch.no_grad():
        acc = (model(images).argmax(-1) == torch.from_numpy(y[val_idx].astype(np.int64))).double().mean().item()
    assert metrics["val/acc1"] == pytest.approx(acc, abs=1e-6)
    assert metrics["val/acc1"] != metrics["test/acc1"]


def test_epoch_sampler_ranks_partition_the_single_process_order():
    data = list(range(40))
    one = list(EpochSampler(data, shuffle=True, seed=3))
    two = [list(EpochSampler(data, shuffle=True, seed=3, num_replicas=2, rank=r)) for r in (0, 1)]
    assert sorted(one) == data
    assert [x for pair in zip(*two) for x in pair] == one  # rank r takes order[r::2]
    s = EpochSampler(data, shuffle=True, seed=3)
    s.set_epoch(1)
    assert list(s) != one
    s.skip = 16
    s.set_epoch(0)
    assert list(s) == one[16:] and list(s) == one  # skip applies to the next iteration only


def test_resumable_loader_continues_the_epoch_where_it_stopped():
    from vitrel.data.base import ResumableDataLoader

    data = list(range(40))

    def loader():
        return ResumableDataLoader(data, batch_size=4, sampler=EpochSampler(data, shuffle=True, seed=5))

    full = loader()
    full.sampler.set_epoch(1)
    whole = [b.tolist() for b in full]
    first = loader()
    first.sampler.set_epoch(1)
    it = iter(first)
    done = [next(it).tolist() for _ in range(3)]
    state = first.state_dict()
    assert state == {"epoch": 1, "batches": 3, "batch_size": 4, "num_replicas": 1} and done == whole[:3]
    resumed = loader()
    resumed.load_state_dict(state)
    resumed.sampler.set_epoch(1)  # as Lightning does at the start of the (resumed) epoch
    assert [b.tolist() for b in resumed] == whole[3:] and resumed.state_dict()["batches"] == 10
    assert [b.tolist() for b in resumed] == whole  # the next iteration of the epoch is whole again
    later = loader()
    later.load_state_dict({"epoch": 0, "batches": 10})  # saved at the end of epoch 0
    later.sampler.set_epoch(1)
    assert [b.tolist() for b in later] == whole


@pytest.mark.parametrize("loader", ["memory", "workers"])
def test_exact_resume_makes_the_datamodule_loader_resumable(tmp_path, loader):
    from vitrel.data.base import ResumableDataLoader
    from vitrel.data.memory import MemoryLoader

    seen = {}

    class Look(L.Callback):
        def on_train_start(self, trainer, pl_module):
            seen["loader"] = trainer.train_dataloader

    over = [*TINY_VIT, *FAST, *SHORT, "trainer.limit_train_batches=2", "callbacks.model_checkpoint=null"]
    over += [f"data.loader={loader}", "seed=4"]
    train(compose(tmp_path, over), callbacks=[Look()])
    dl = seen["loader"]
    kind = MemoryLoader if loader == "memory" else ResumableDataLoader
    assert isinstance(dl, kind) and dl.sampler.seed == 4 and dl.state_dict()["batches"] == 2
    train(compose(tmp_path / "off", [*over, "callbacks.exact_resume=null"]), callbacks=[Look()])
    if loader == "workers":
        assert type(seen["loader"]) is torch.utils.data.DataLoader
    else:  # the memory loader is always seeded: by data.seed without ExactResume
        assert isinstance(seen["loader"], MemoryLoader) and seen["loader"].sampler.seed == 0


# ------------------------------------------------------------------------------------------ pictures
@pytest.mark.parametrize("video", [False, True, "wandb_disabled"], ids=["image", "video", "wandb_disabled"])
def test_pos_images_written_without_image_logger(tmp_path, video, monkeypatch):
    """Each block's position picture at every epoch's end, as PNGs in the run folder; for a video model's 3-D
    scheme too (its picture failed the run at the end of training); under ``WANDB_MODE=disabled`` too (W&B's no-op
    run took them, and the log said them logged)."""
    base = [*TINY_VIDEO, "pos=rel3d_factored"] if video is True else [*TINY_VIT, *FAST, "pos=rel2d_factored"]
    over = [*base, *SHORT, "callbacks.pos_images.every_n_epochs=1"]
    if video == "wandb_disabled":
        monkeypatch.setenv("WANDB_MODE", "disabled")
        over.append("logger=wandb")
    train(compose(tmp_path, [o for o in over if o != "callbacks.pos_images=null"]))
    pngs = sorted(p.name for p in (tmp_path / "pos_images").glob("*.png"))
    assert pngs == [f"blocks_{i}_attn_pos_step0000004.png" for i in range(1 if video is True else 2)]


def test_pos_images_of_gpsa_and_cpe_do_not_end_the_run(tmp_path):
    """A run with ``pos=gpsa`` (or ``cpe``) failed at training's end: their schemes refused the picture. GPSA's shows
    the attention each head gives the centre query by position; CPE's convolution has none and is left out."""
    over = [*TINY_VIT, *FAST, *SHORT, "pos=gpsa", "+model.abs_pos=cpe", "callbacks.pos_images.every_n_epochs=1"]
    train(compose(tmp_path, [o for o in over if o != "callbacks.pos_images=null"]))
    pngs = sorted(p.name for p in (tmp_path / "pos_images").glob("*.png"))
    assert pngs == [f"blocks_{i}_attn_pos_step0000004.png" for i in range(2)]


@pytest.mark.parametrize("data", sorted(p.stem for p in (CONF / "data").glob("*.yaml")))
def test_each_data_group_trains_at_its_own_batch_size(tmp_path, data):
    """``data=<group>`` trains at the group's ``batch_size`` (eval.py's too): the default recipe's 64 is
    Fashion-MNIST's, not laid over every group (data=video_folder trained 64 videos a batch, not its file's 8)."""
    own = compose(tmp_path / "eval", [f"data={data}"], config_name="eval").data.batch_size
    assert compose(tmp_path / "train", [f"data={data}"]).data.batch_size == own
    assert own == {"fashion_mnist": 64, "video_folder": 8, "cifar10": 128}.get(data, own)


def test_default_config_is_the_documented_recipe(tmp_path):
    cfg = compose(tmp_path, [])
    assert cfg.model.name == "vitrel_vit_tiny_patch4_32" and cfg.pos.name == "rel2d_factored"
    assert cfg.module.optimizer.lr == 2e-3 and cfg.module.scheduler.warmup_epochs == 0.25
    assert cfg.data.batch_size == 64 and cfg.trainer.max_epochs == 10 and cfg.data.loader == "memory"
    assert not cfg.data.augment
    assert cfg.module.label_smoothing == 0.1 and cfg.module.mixup is None and cfg.module.ema is None
    assert cfg.data.name == "fashion_mnist" and cfg.data.subset == "embedded"
    assert "wandb" in cfg.logger and cfg.logger.wandb.mode == "auto"
    assert cfg.callbacks.last_checkpoint is not None and cfg.callbacks.model_checkpoint.monitor == "val/acc1"
    assert Path(CONF / "hydra" / "launcher" / "slurm.yaml").exists()
    quick = compose(tmp_path, ["experiment=fmnist_quick"])  # the same recipe, spelled out
    for key in ("data", "model", "module", "pos"):
        assert quick[key] == cfg[key], key
    assert quick.trainer.max_epochs == cfg.trainer.max_epochs and quick.trainer.accelerator == "cpu"


def test_plain_ddp_under_multirun_is_refused_with_the_fix(tmp_path):
    over = [*TINY_VIT, *FAST, "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "logger=none"]
    cfg = compose(tmp_path, over, multirun=True)
    with pytest.raises(ValueError, match="cannot run under -m .* use trainer=ddp_spawn, or hydra/launcher=slurm"):
        train(cfg)
    for strategy in ("ddp_spawn", "ddp_fork", "ddp_notebook"):  # processes started in the job: fine under -m
        check_launch({"strategy": strategy, "devices": 2, "num_nodes": 1})


def test_plain_ddp_under_submitit_local_is_refused_as_under_the_basic_launcher(tmp_path):
    """``-m hydra/launcher=submitit_local trainer=ddp trainer.devices=2`` passed the check (any submitit launcher did),
    but submitit's local jobs are no SLURM tasks: Lightning re-ran the job's command, ``python -m
    submitit.core._submit <folder> hydra.run.dir=...``, whose parser stopped the second rank (``_submit.py: error:
    unrecognized arguments``), and the job ended with no metrics. Only the SLURM launcher starts the ranks itself."""
    over = [*TINY_VIT, *FAST, "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "logger=none"]
    cfg = compose(tmp_path, [*over, "hydra/launcher=submitit_local"], multirun=True)
    with pytest.raises(ValueError, match="cannot run under -m with hydra/launcher=submitit_local"):
        check_launch(cfg.trainer)
    compose(tmp_path, [*over, "hydra/launcher=slurm"], multirun=True)
    check_launch(cfg.trainer)  # (one SLURM task per device: nothing re-launched)


class SaveRequeueCheckpoint(L.Callback):
    """What Lightning's SLURM handler does on SIGUSR1 (``hpc_ckpt_1.ckpt`` in ``default_root_dir``), at step 2."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == 2 and not list(Path(trainer.default_root_dir).glob("hpc_ckpt_*.ckpt")):
            trainer.save_checkpoint(Path(trainer.default_root_dir) / "hpc_ckpt_1.ckpt")


def test_under_slurm_a_requeue_checkpoint_is_not_what_the_test_scores(tmp_path, monkeypatch):
    """Under SLURM with ``--signal=SIGUSR1``, Lightning saves ``hpc_ckpt_<n>.ckpt`` in the run folder and, with
    ``ckpt_path=None``, loads the newest in any ``trainer.test(module)``: a run signalled at step 21 of 80 (requeue
    refused) reported test/acc1 0.2891, the step-21 weights', where the uninterrupted run's was 0.3438. The finished
    fit removes them; the test scores the fitted weights, as outside SLURM."""
    over = [*TINY_VIT, *FAST, "trainer.max_epochs=1", "trainer.limit_train_batches=6", "trainer.limit_val_batches=1"]
    over += ["trainer.limit_test_batches=2", "logger=none", "callbacks.model_checkpoint=null"]
    plain = train(compose(tmp_path / "plain", over))
    for k, v in {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "1", "SLURM_JOB_NAME": "vitrel", "SLURM_PROCID": "0"}.items():
        monkeypatch.setenv(k, v)
    slurm = train(compose(tmp_path / "slurm", over), callbacks=[SaveRequeueCheckpoint()])
    assert slurm["test/loss"] == plain["test/loss"] and slurm["test/acc1"] == plain["test/acc1"], (slurm, plain)
    assert not list((tmp_path / "slurm").glob("hpc_ckpt_*.ckpt"))


def test_ema_under_a_spawning_strategy_is_refused_with_the_ways_that_work(tmp_path):
    """timm's ModelEmaV3 holds a torch.Generator, which PyTorch cannot send to a spawned process
    (pytorch/pytorch#146828): ``trainer=ddp_spawn module/ema=default`` died as each rank started, with
    ``RuntimeError: unable to resize file``. It is refused before anything is built; fork and plain ddp are not."""
    over = [*TINY_VIT, *FAST, "trainer=ddp_spawn", "trainer.accelerator=cpu", "trainer.devices=2", "logger=none"]
    cfg = compose(tmp_path, [*over, "module/ema=default"])
    with pytest.raises(ConfigError, match=r"module.ema cannot go with trainer.strategy=ddp_spawn: .*#146828"):
        train(cfg)
    assert not (tmp_path / "checkpoints").exists()
    spawn = "trainer.strategy={_target_: lightning.pytorch.strategies.DDPStrategy, start_method: spawn}"
    with pytest.raises(ConfigError, match=r"trainer.strategy.start_method=spawn"):
        check_spawn_ema(compose(tmp_path, [*over, "module/ema=default", spawn]))
    for fine in (["module/ema=default", "trainer.strategy=ddp_fork"], ["module/ema=default", "trainer=ddp"], []):
        check_spawn_ema(compose(tmp_path, [*over, *fine]))


def test_slurm_launcher_config_and_sweep_folder_survives_requeue(tmp_path):
    """The submitit launcher pickles the sweep config; a requeued job re-resolves ``hydra.sweep.dir``
    from it. Hydra caches ``${now:}`` in the config, so the folder (and its last.ckpt) is the same."""
    import pickle
    import time

    from hydra import compose as hcompose
    from hydra import initialize_config_dir

    over = ["hydra/launcher=slurm", "trainer=ddp", "trainer.devices=4", "trainer.num_nodes=2"]
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = hcompose("train", overrides=over, return_hydra_config=True)
        launcher = cfg.hydra.launcher
        assert launcher._target_.endswith("SlurmLauncher") and launcher.max_num_timeout > 0
        assert (launcher.tasks_per_node, launcher.gpus_per_node, launcher.nodes) == (4, 4, 2)
        assert "SIGUSR2" in cfg.callbacks.signal_checkpoint.signals and cfg.resume == "auto"
        first = str(cfg.hydra.sweep.dir)
        blob = pickle.dumps(cfg)
        time.sleep(1.1)
        requeued = hcompose("train", overrides=over, return_hydra_config=True)
        OmegaConf.copy_cache(from_config=pickle.loads(blob), to_config=requeued)  # as load_sweep_config does
        assert str(requeued.hydra.sweep.dir) == first


def test_last_checkpoint_mid_epoch_and_at_the_end(tmp_path):
    over = [*TINY_VIT, *FAST, *SHORT, "trainer.max_epochs=2", "callbacks.last_checkpoint.every_n_train_steps=3"]
    seen = []

    class Watch(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            f = tmp_path / "checkpoints" / "last.ckpt"
            if f.exists():
                seen.append(torch.load(f, map_location="cpu", weights_only=True)["global_step"])

    train(compose(tmp_path, over), callbacks=[Watch()])
    assert 3 in seen and 6 in seen  # mid-epoch saves (4 batches an epoch)
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 8  # the end
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert len(names) == 2 and names[0].startswith("best-epoch") and names[1] == "last.ckpt"  # no last-v1


def test_closing_lines_say_accuracy_time_and_where_things_are(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    over = [*TINY_VIT, *FAST, *SHORT, "logger=wandb"]
    train(compose(tmp_path, over))
    lines = capsys.readouterr().out.strip().splitlines()[-5:]
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert lines[0].startswith("test accuracy ") and f"{100 * saved['metrics']['test/acc1']:.2f} %" in lines[0]
    assert lines[1].startswith("training ") and "(1 epoch, 4 steps); whole run" in lines[1]
    assert saved["fit_s"] <= saved["wall_s"]
    assert lines[2] == f"run folder  {tmp_path}"
    assert lines[3].startswith(f"checkpoint  {tmp_path / 'checkpoints' / 'last.ckpt'}  (best val/acc1: ")
    run = next((tmp_path / "wandb").glob("offline-run-*"))
    assert lines[4] == f"W&B run     {run} (offline; upload with: wandb sync {run})"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU")
@pytest.mark.parametrize("attn_impl", ["sdpa", "triton"])
def test_gpu_trainer_fits(tmp_path, attn_impl):
    """``trainer=gpu``: the default recipe's model fits a few steps on the GPU (bf16 mixed precision) with finite
    metrics, through SDPA and through the fused kernel (needs hydra-core on the GPU machine: docs/gpu.md)."""
    over = [*TINY_VIT, "trainer=gpu", "data.num_workers=0", "progress_bar=none", "callbacks.pos_images=null"]
    over += ["trainer.max_epochs=1", "trainer.limit_train_batches=20", "trainer.limit_val_batches=2"]
    over += ["trainer.limit_test_batches=2", "logger=none", f"+model.attn_impl={attn_impl}"]
    metrics = train(compose(tmp_path, over))
    assert all(math.isfinite(v) for v in metrics.values()) and metrics["test/acc1"] >= 0
