"""The training side on a checkpoint written by vitrel 0.1.0 (``tests/fixtures/v0_vit_rel2d_factored_ema.ckpt``:
ViT, shared rel2d_factored + ape, EMA weights under ``ema_model.*``; see tests/fixtures/README.md):
``vitrel.load_model``, ``eval.py`` (``evaluate`` and the ``vitrel-eval`` entry point), and resuming it
with today's ``ClassifierModule`` (EMA under ``ema_model.module.*``)."""

from __future__ import annotations

import functools
import json
import math
import subprocess
import sys
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from timm.utils import ModelEmaV3

import vitrel
from tests.train_helpers import compose, script_env
from vitrel.models.checkpoint import checkpoint_has_ema
from vitrel.train.evaluate import evaluate
from vitrel.train.module import ClassifierModule
from vitrel.train.optim import warmup_cosine

FIX = Path(__file__).parents[1] / "fixtures"
CKPT = FIX / "v0_vit_rel2d_factored_ema.ckpt"
EVAL = ["data.num_workers=0", "data.batch_size=64", "trainer.accelerator=cpu", "trainer.limit_test_batches=2"]
EVAL += ["progress_bar=none"]


@pytest.mark.parametrize("use_ema, key", [(False, "logits"), (True, "ema_logits")])
def test_load_model_gives_the_old_outputs(use_ema, key):
    ref = torch.load(FIX / "v0_vit_rel2d_factored_ema_out.pt", weights_only=True)
    model = vitrel.load_model(CKPT, use_ema=use_ema).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ref["x"]), ref[key])


def _accuracy(model: torch.nn.Module, loader, batches: int) -> float:
    right = total = 0
    with torch.no_grad():
        for i, (x, y) in enumerate(loader):
            if i == batches:
                break
            right += int((model(x).argmax(-1) == y).sum())
            total += len(y)
    return right / total


def test_evaluate_reads_the_old_checkpoint_with_its_ema_weights(tmp_path):
    """(It stores no data config: ``eval.py`` normalises with the run's data settings, so ``load_model``'s warning
    that the model's statistics are the architecture's defaults is not given here.)"""
    from vitrel.models.data_config import NoDataConfigWarning

    assert checkpoint_has_ema(CKPT)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metrics = evaluate(compose(tmp_path, [f"ckpt_path={CKPT}", *EVAL], config_name="eval"))
    assert not [w for w in caught if w.category is NoDataConfigWarning]
    res = json.loads((tmp_path / "eval_metrics.json").read_text())
    assert res["ema"] is True and res["img_size"] == 28 and res["grid"] == [7, 7]
    assert math.isfinite(metrics["test/loss"])
    from vitrel.data import FashionMNISTDataModule

    dm = FashionMNISTDataModule(batch_size=64, num_workers=0)
    ema = vitrel.load_model(CKPT, use_ema=True).eval()
    assert metrics["test/acc1"] == pytest.approx(_accuracy(ema, dm.test_dataloader(), 2))


def test_vitrel_eval_entry_point_on_the_old_checkpoint(tmp_path):
    """``vitrel-eval`` (``vitrel.train.cli:eval_main``) with the repository's conf/, at a larger size."""
    args = [f"ckpt_path={CKPT}", *EVAL, "data.img_size=40", "ema=false", f"hydra.run.dir={tmp_path / 'run'}"]
    code = "from vitrel.train.cli import eval_main; eval_main()"
    r = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=tmp_path, env=script_env(), capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "run" / "eval_metrics.json").read_text())
    assert res["ema"] is False and res["grid"] == [10, 10] and 0.0 <= res["metrics"]["test/acc1"] <= 1.0
    assert "task_name: eval" in (tmp_path / "run" / ".hydra" / "config.yaml").read_text()


def _module(ema: bool) -> ClassifierModule:
    cfg = torch.load(CKPT, map_location="cpu", weights_only=True)["vitrel_cfg"]
    from vitrel.models.registry import build_from_cfg

    return ClassifierModule(
        build_from_cfg(dict(cfg)),
        functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.05),
        functools.partial(warmup_cosine),
        ema=functools.partial(ModelEmaV3, decay=0.9) if ema else None,
    )


def _trainer(tmp_path: Path) -> L.Trainer:
    quiet = dict.fromkeys(("logger", "enable_checkpointing", "enable_progress_bar", "enable_model_summary"), False)
    return L.Trainer(max_epochs=2, accelerator="cpu", default_root_dir=tmp_path, **quiet)


def _loader():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 1, 28, 28, generator=g), torch.randint(0, 10, (8,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


def test_resume_the_old_checkpoint_with_ema(tmp_path):
    """Its EMA weights (``ema_model.*``) become ``ema_model.module.*``; its optimizer state (decay group
    first) and schedule line up; training goes on from step 2."""
    old = torch.load(CKPT, map_location="cpu", weights_only=True)
    module = _module(ema=True)
    seen = {}

    class Look(L.Callback):
        def on_train_start(self, trainer, pl_module):
            seen["ema"] = {k: v.clone() for k, v in pl_module.ema_model.module.state_dict().items()}
            seen["step"] = trainer.global_step
            seen["exp_avg"] = trainer.optimizers[0].state_dict()["state"][0]["exp_avg"].clone()

    trainer = _trainer(tmp_path)
    trainer.callbacks.append(Look())
    trainer.fit(module, _loader(), ckpt_path=str(CKPT))
    assert seen["step"] == 2 and trainer.global_step == 4
    for k, v in seen["ema"].items():
        torch.testing.assert_close(v, old["state_dict"][f"ema_model.{k}"], rtol=0, atol=0)
    torch.testing.assert_close(seen["exp_avg"], old["optimizer_states"][0]["state"][0]["exp_avg"])
    # the checkpoint written now has today's layout and still loads through vitrel.load_model
    trainer.save_checkpoint(tmp_path / "new.ckpt")
    sd = torch.load(tmp_path / "new.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    assert any(k.startswith("ema_model.module.") for k in sd)
    ema = vitrel.load_model(tmp_path / "new.ckpt", use_ema=True)
    for k, v in ema.state_dict().items():
        torch.testing.assert_close(v, sd[f"ema_model.module.{k}"], rtol=0, atol=0)


def test_resume_the_old_ema_checkpoint_without_ema_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"holds EMA weights .*\(module/ema=default\)"):
        _trainer(tmp_path).fit(_module(ema=False), _loader(), ckpt_path=str(CKPT))


def test_resume_without_ema_weights_starts_the_ema_from_the_checkpoint(tmp_path):
    trainer = _trainer(tmp_path)
    trainer.fit_loop.max_epochs = 1
    trainer.fit(_module(ema=False), _loader())
    trainer.save_checkpoint(tmp_path / "plain.ckpt")
    sd = torch.load(tmp_path / "plain.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    seen = {}

    class Look(L.Callback):
        def on_train_start(self, trainer, pl_module):
            seen.update({k: v.clone() for k, v in pl_module.ema_model.module.state_dict().items()})

    resumed = _trainer(tmp_path)
    resumed.callbacks.append(Look())
    with pytest.warns(UserWarning, match="no EMA weights"):
        resumed.fit(_module(ema=True), _loader(), ckpt_path=str(tmp_path / "plain.ckpt"))
    for k, v in seen.items():
        torch.testing.assert_close(v, sd[f"model.{k}"], rtol=0, atol=0)


def test_fine_tuning_from_the_old_checkpoint_gives_no_data_config_warning(tmp_path):
    """``model=from_checkpoint`` of a checkpoint without a data config: the run normalises with its data's own
    statistics (and its checkpoints store them), so ``load_model``'s warning about the architecture's defaults is not
    given."""
    from tests.train_helpers import FAST
    from vitrel.models.data_config import NoDataConfigWarning
    from vitrel.train.run import train

    short = ["trainer.max_epochs=1", "trainer.limit_train_batches=1", "trainer.limit_val_batches=1"]
    short += ["trainer.limit_test_batches=1", "logger=none"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(compose(tmp_path, ["model=from_checkpoint", f"model.path={CKPT}", *FAST, *short]))
    assert not [w for w in caught if w.category is NoDataConfigWarning]
    assert "data_config" in torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["hyper_parameters"]
