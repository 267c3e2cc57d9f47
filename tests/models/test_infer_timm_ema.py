"""``timm.create_model(name, checkpoint_path=<train.py .ckpt>)`` and timm's ``load_checkpoint``: the EMA copy under
``use_ema=True`` (timm's default), as of timm's train script's checkpoints; the live ``model.*`` weights under
``use_ema=False`` or from a checkpoint that stores no ``state_dict_ema`` (written before), said in one warning
naming the routes that load the tested weights; a run without an EMA copy loads quietly."""

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


@pytest.mark.parametrize("ema_eval", [True, False])
def test_timms_load_checkpoint_takes_the_ema_copy_train_py_wrote(tmp_path, ema_eval):
    """A checkpoint ``train.py`` wrote with ``module/ema=default``: timm's ``load_checkpoint(m, path, use_ema=True)``
    (and ``timm.create_model(name, checkpoint_path=path)``, which calls it so) loads the EMA copy, ``use_ema=False``
    the live weights, as of timm's train script's checkpoints; before, both loaded the live ones (timm looks for the
    copy under ``state_dict_ema``). The copy is stored once: the file is no larger. ``vitrel.load_model``'s ``auto``
    still follows the run's ``ema_eval``."""
    from tests.train_helpers import FAST, TINY_VIT, compose
    from vitrel.train.run import train

    run = [*TINY_VIT, *FAST, "trainer.max_steps=3", "trainer.limit_train_batches=3", "trainer.limit_val_batches=1"]
    run += ["logger=none", "test=false", "module/ema=default", "module.ema.decay=0.5", f"module.ema_eval={ema_eval}"]
    train(compose(tmp_path, run))
    path = tmp_path / "checkpoints" / "last.ckpt"
    ckpt = torch.load(path, weights_only=True)
    sd = ckpt["state_dict"]
    live = {k[len("model.") :]: v for k, v in sd.items() if k.startswith("model.")}
    ema = {k[len("ema_model.module.") :]: v for k, v in sd.items() if k.startswith("ema_model.module.")}
    assert not torch.equal(live["head.weight"], ema["head.weight"])
    args = dict(ckpt["vitrel_cfg"])
    name = args.pop("architecture")
    for use_ema, want in ((True, ema), (False, live)):
        m = timm.create_model(name, **args)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (use_ema=False: the warning above, tested there)
            timm.models.load_checkpoint(m, str(path), use_ema=use_ema)
        got = m.state_dict()
        assert all(torch.equal(got[k], v) for k, v in want.items()), use_ema
    default = timm.create_model(name, checkpoint_path=str(path), **args).state_dict()
    assert all(torch.equal(default[k], v) for k, v in ema.items())
    torch.save({k: v for k, v in ckpt.items() if k != "state_dict_ema"}, tmp_path / "without.ckpt")
    assert path.stat().st_size < (tmp_path / "without.ckpt").stat().st_size + 16_384  # (keys, not tensors, added)
    loaded = vitrel.load_model(path).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in (ema if ema_eval else live).items())
