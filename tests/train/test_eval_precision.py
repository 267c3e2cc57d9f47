"""The precision ``eval.py`` scores in is Lightning's ``trainer.precision``: the autocast the model's forward sees, and
at the default (32-true) the results of a float32 forward."""

from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate

import vitrel
from tests.train_helpers import EVAL_PICTURES_OFF, FAST, TINY_VIT, compose
from vitrel.train.evaluate import evaluate
from vitrel.train.run import train


def _seen(model: torch.nn.Module, log: list) -> torch.nn.Module:
    """``model``, noting in ``log`` the autocast dtype each forward of a batch runs under (None: off); not the forward
    of one image that counts ``gflops`` for ``eval_metrics.json``, after the test."""

    def hook(module, args):
        if args[0].shape[0] > 1:
            log.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)

    model.register_forward_pre_hook(hook)
    return model


def test_eval_py_scores_in_the_trainers_precision(tmp_path, monkeypatch):
    run = ["trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "logger=none"]
    train(compose(tmp_path / "run", [*TINY_VIT, *FAST, *run, "test=false"]))
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    log, load = [], vitrel.load_model
    monkeypatch.setattr(vitrel, "load_model", lambda *a, **k: _seen(load(*a, **k), log))
    over = [f"ckpt_path={ckpt}", *FAST[:1], *FAST[2:4], *EVAL_PICTURES_OFF, "trainer.limit_test_batches=1"]
    default = evaluate(compose(tmp_path / "e32", over, config_name="eval"))
    assert log and set(log) == {None}
    log.clear()
    evaluate(compose(tmp_path / "ebf16", [*over, "trainer.precision=bf16-mixed"], config_name="eval"))
    assert log and set(log) == {torch.bfloat16}
    model = load(ckpt).eval()  # the default: a float32 forward, as by hand
    dm = instantiate(compose(tmp_path / "e32", over, config_name="eval").data)
    dm.setup("test")
    x, y = next(iter(dm.test_dataloader()))
    with torch.no_grad():
        acc = (model(x).argmax(-1) == y).float().mean().item()
    assert default["test/acc1"] == pytest.approx(acc, abs=1e-6)


def test_eval_py_applies_matmul_precision_on_cuda_machines(tmp_path, monkeypatch):
    """``eval.py matmul_precision=...`` sets ``torch.set_float32_matmul_precision`` before the forward, as ``train.py``
    does (CUDA machines only: a CPU's float32 matmuls stay exact), rather than being a key nothing reads."""
    run = ["trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "logger=none"]
    train(compose(tmp_path / "run", [*TINY_VIT, *FAST, *run, "test=false"]))
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    seen, load = [], vitrel.load_model

    def watched(*a, **k):
        model = load(*a, **k)
        model.register_forward_pre_hook(lambda m, args: seen.append(torch.get_float32_matmul_precision()))
        return model

    monkeypatch.setattr(vitrel, "load_model", watched)
    over = [f"ckpt_path={ckpt}", *FAST[:4], "trainer.limit_test_batches=1", "matmul_precision=medium"]
    cfg = compose(tmp_path / "eval", over, config_name="eval")
    before = torch.get_float32_matmul_precision()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # (the trainer stays on the CPU: FAST)
    try:
        evaluate(cfg)
    finally:
        torch.set_float32_matmul_precision(before)
    assert seen and set(seen) == {"medium"}
