"""``timm.create_model(name, checkpoint_path=<train.py .ckpt>)`` loads the live ``model.*`` weights (timm hands over the
state dict only, not the run's ``ema_eval``): of a run with an EMA copy, not the weights ``eval.py`` and ``predict.py``
score. That is said in one warning, naming the routes that load the tested weights; a run without one loads quietly."""

from __future__ import annotations

import warnings

import pytest
import timm
import torch

import vitrel  # noqa: F401  (registers the models with timm)

TINY = dict(embed_dim=16, depth=1, num_heads=2, num_classes=3, img_size=16, pos="rel2d_factored")
NAME = "vitrel_vit_tiny_patch4_32"


def _ckpt(tmp_path, ema: bool):
    torch.manual_seed(0)
    net = timm.create_model(NAME, **TINY)
    sd = {f"model.{k}": v for k, v in net.state_dict().items()}
    if ema:
        sd |= {f"ema_model.module.{k}": v + 1 for k, v in net.state_dict().items()}
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": sd, "vitrel_cfg": net.vitrel_cfg, "hyper_parameters": {"ema_eval": True}}, path)
    return net, path


def test_checkpoint_path_of_an_ema_run_warns_that_it_loads_the_live_weights(tmp_path):
    """Was: the live weights, silently; on this file they differ from the EMA copy ``vitrel.load_model`` loads."""
    net, path = _ckpt(tmp_path, ema=True)
    with pytest.warns(UserWarning, match=r"live weights \(model\.\*\) .* EMA copy.*vitrel\.load_model") as said:
        m = timm.create_model(NAME, checkpoint_path=str(path), **TINY)
    assert said[0].filename == __file__  # (the user's line, not timm's)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert torch.equal(m.eval()(x), net.eval()(x))  # (what it loads is unchanged: timm's route, the live weights)
        assert not torch.equal(m(x), vitrel.load_model(path).eval()(x))


def test_checkpoint_path_of_a_run_without_ema_is_quiet(tmp_path):
    _, path = _ckpt(tmp_path, ema=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        timm.create_model(NAME, checkpoint_path=str(path), **TINY)
