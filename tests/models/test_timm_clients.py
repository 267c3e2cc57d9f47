"""vitrel models under timm's public API as a timm user calls it: ``features_only`` with ``checkpoint_path``, gradient
checkpointing of a ``features_only`` backbone, a shallow ViT's default ``out_indices``, indices a model does not have,
and the permissions of the files vitrel writes."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import stat
import warnings
from unittest import mock

import pytest
import timm
import torch
from timm.utils import ModelEmaV3

import vitrel
import vitrel.models.blocks
import vitrel.models.swin_blocks
from tests.weights import lively
from vitrel.models import CheckpointError, save_pretrained
from vitrel.models.data_config import NoDataConfigWarning
from vitrel.train.ckpt_io import atomic_write
from vitrel.train.module import ClassifierModule

VIT = dict(name="vitrel_vit_tiny_patch4_32", embed_dim=32, depth=4, num_heads=2, num_classes=10)
SWIN = dict(name="vitrel_swin_tiny_patch2_window4_32", embed_dim=16, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4))
SPECS = pytest.mark.parametrize("spec", [VIT, SWIN], ids=["vit", "swin"])


def make(spec: dict, **kw) -> torch.nn.Module:
    spec = dict(spec)
    return timm.create_model(spec.pop("name"), pos="rel2d_full", **{**spec, **kw})


def train_checkpoint(model: torch.nn.Module, path) -> None:
    """A checkpoint as train.py writes it: the Lightning module's state dict (the network under ``model.*``, its EMA
    copy with other weights under ``ema_model.module.*``, the metrics' totals) and ``vitrel_cfg``."""
    module = ClassifierModule(model, ema=functools.partial(ModelEmaV3, decay=0.9))
    with torch.no_grad():
        for p in module.ema_model.parameters():
            p.add_(1.0)  # (not the live weights: those are the ones to load)
    torch.save({"state_dict": module.state_dict(), "vitrel_cfg": model.vitrel_cfg}, path)


# ---------------------------------------------------------------------------- features_only + checkpoint_path
@SPECS
@pytest.mark.parametrize("fmt", ["ckpt", "safetensors"])
@pytest.mark.parametrize("out_indices", [None, (0, 1)], ids=["default", "pruned"])
def test_features_only_loads_checkpoint_path(spec, fmt, out_indices, tmp_path):
    """``timm.create_model(name, features_only=True, checkpoint_path=...)`` with a training checkpoint or an export's
    ``model.safetensors``: the backbone gives the trained network's intermediates (the blocks, norm and head the
    wrapper pruned are left out of the load); weights of another architecture: one ``CheckpointError``."""
    torch.manual_seed(0)
    net = lively(make(spec)).eval()
    if fmt == "ckpt":
        path = tmp_path / "last.ckpt"
        train_checkpoint(net, path)
    else:
        path = save_pretrained(net, tmp_path / "export") / "model.safetensors"
    kw = {} if out_indices is None else dict(out_indices=out_indices)
    torch.manual_seed(1)
    fb = make(spec, features_only=True, checkpoint_path=str(path), **kw).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = net.forward_intermediates(x, indices=fb.out_indices, output_fmt=str(fb.output_fmt.value))[1]
        got = fb(x)
    assert len(got) == len(want) == len(fb.feature_info.channels())
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(CheckpointError, match="do not fit"):
        make(spec, features_only=True, checkpoint_path=str(path), embed_dim=64, **kw)


def test_features_only_load_state_dict_names_keys_as_the_wrapper():
    """The wrapper's own state dict loads back; what does not fit (non-strict) is named under the wrapper's keys."""
    fb = make(VIT, features_only=True)
    assert not any(fb.load_state_dict(fb.state_dict()))
    sd = {k: v for k, v in fb.state_dict().items() if k != "model.cls_token"}
    assert fb.load_state_dict(sd, strict=False).missing_keys == ["model.cls_token"]


# ---------------------------------------------------------------------------- gradient checkpointing
@SPECS
def test_features_only_grad_checkpointing(spec):
    """``set_grad_checkpointing`` on a ``features_only`` backbone (timm's clients call it): every block runs under
    ``torch.utils.checkpoint``, and the gradients are those without it."""
    torch.manual_seed(0)
    plain = lively(make(spec, features_only=True)).train()
    ckpt = make(spec, features_only=True).train()
    ckpt.load_state_dict(plain.state_dict())
    ckpt.set_grad_checkpointing(True)
    x = torch.randn(2, 3, 32, 32)
    grads = []
    for model in (plain, ckpt):
        with contextlib.ExitStack() as stack:
            calls = [
                stack.enter_context(mock.patch.object(mod, "checkpoint", wraps=mod.checkpoint))
                for mod in (vitrel.models.blocks, vitrel.models.swin_blocks)
            ]
            torch.manual_seed(2)  # (the same drop-path draws)
            sum(o.square().mean() for o in model(x)).backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        n_blocks = sum(1 for n, _ in model.named_modules() if n.count(".blocks.") == 1 and n.split(".")[-1].isdigit())
        assert sum(c.call_count for c in calls) == (n_blocks if model is ckpt else 0)
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], msg=n)


# ---------------------------------------------------------------------------- out_indices / indices
def test_shallow_vit_features_only_default_out_indices():
    """timm's ViT default is the last 3 blocks; a ViT of fewer blocks gives all of them (timm: an assertion), and
    indices it does not have are one ``ValueError`` naming the range (features_only and forward_intermediates)."""
    fb = make(VIT, depth=2, features_only=True).eval()
    assert fb.feature_info.out_indices == (0, 1)
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        want = fb.model.forward_intermediates(x, indices=2, intermediates_only=True)
        assert [torch.equal(a, b) for a, b in zip(fb(x), want)] == [True, True]
    assert make(VIT, depth=5, features_only=True).feature_info.out_indices == (2, 3, 4)
    with pytest.raises(ValueError, match="2 blocks: give the last k"):
        make(VIT, depth=2, features_only=True, out_indices=3)
    with pytest.raises(ValueError, match="4 stages"):
        make(SWIN, features_only=True, out_indices=(0, 4))
    with pytest.raises(ValueError, match="2 blocks"):
        make(VIT, depth=2).forward_intermediates(x, indices=[2])
    with pytest.raises(ValueError, match=r"list of indices from -2 to 1$"):  # (not timm's "index -1 ..." of its own)
        make(VIT, depth=2, features_only=True, out_indices=(-3,))


# ---------------------------------------------------------------------------- file permissions
@contextlib.contextmanager
def umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_written_weights_follow_the_umask(mask, tmp_path):
    """``model.safetensors`` (safetensors writes 0600), the trainer's checkpoints (a ``mkstemp`` file renamed) and
    the study's position file get the permissions of any file the user writes: 0666 less the umask."""
    from vitrel.study.runs import save_pos

    want = 0o666 & ~mask
    with umask(mask):
        out = save_pretrained(make(VIT), tmp_path / "export")
        atomic_write(tmp_path / "last.ckpt", lambda f: torch.save({}, f))
        save_pos(tmp_path / "pos.safetensors", "vit", make(VIT))
        (tmp_path / "plain.txt").write_text("")
    for p in (out / "model.safetensors", out / "config.json", tmp_path / "last.ckpt", tmp_path / "pos.safetensors"):
        assert stat.S_IMODE(p.stat().st_mode) == want == stat.S_IMODE((tmp_path / "plain.txt").stat().st_mode), p


# ---------------------------------------------------------------------------- timm's save_for_hf / push_to_hf_hub
@SPECS
def test_timm_save_for_hf_records_every_argument(spec, tmp_path):
    """timm's ``save_for_hf`` (``push_to_hf_hub``'s writer) stores ``timm.models.get_model_args(model)`` as
    ``config.json``'s ``model_args`` (``vitrel.load_model`` reads the folder too). A model built by vitrel (not
    through ``timm.create_model``, which records the keyword arguments it was given) and changed since
    (``reset_classifier``; a Swin's ``set_input_size`` with a new window) gets every constructor argument as it is
    now, so ``local-dir:`` (and ``hf-hub:``) rebuild the same function: here a scheme option that leaves the
    weights' shapes alone (``extend: interpolate``) and changes what a larger grid computes."""
    from timm.models import save_for_hf

    spec = dict(spec)
    name = spec.pop("name")
    torch.manual_seed(0)
    model = lively(vitrel.create_model(name, pos={"name": "rel2d_full", "extend": "interpolate"}, **spec)).eval()
    model.reset_classifier(3)
    if "depths" in spec:
        model.set_input_size(img_size=32, window_size=8)
    save_for_hf(model, tmp_path / "hf")  # (timm's default: pytorch_model.bin, which vitrel.load_model also reads)
    x = torch.randn(2, 3, 64, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoDataConfigWarning)  # the config.json's pretrained_cfg is read too
        ours = vitrel.load_model(tmp_path / "hf").eval()
    for back in (timm.create_model(f"local-dir:{tmp_path / 'hf'}", pretrained=True).eval(), ours):
        assert back.vitrel_cfg == model.vitrel_cfg
        assert back.pretrained_cfg["mean"] == model.pretrained_cfg["mean"]
        with torch.no_grad():
            torch.testing.assert_close(back(x), model(x), rtol=0, atol=0)


@SPECS
def test_timm_save_for_hf_after_set_input_size_stores_the_new_input_size(spec, tmp_path):
    """Was: ``set_input_size(48)`` on a model built at 32 left ``pretrained_cfg["input_size"]`` at 32, so
    ``timm.data.resolve_data_config(model=m)`` fed it 32-px images and ``save_for_hf`` stored 32 beside
    ``model_args`` ``img_size`` 48, which every route then read as a model of 48 trained on 32-px images. The model's
    ``pretrained_cfg`` follows, as ``vitrel.load_model(..., img_size=48)`` builds it, and so does the Swin's
    ``pool_size``; a call at the size it has leaves it alone (here the 28-px images a model of 32 was trained on).
    """
    from timm.models import save_for_hf

    from vitrel.models.data_config import set_data_config

    model = make(spec)
    set_data_config(model, dict(input_size=[3, 28, 28]), built_at=32)  # (train.py on 28-px data, img_size 32)
    model.set_input_size(img_size=32)
    assert model.pretrained_cfg["input_size"] == (3, 28, 28)
    save_for_hf(model, tmp_path / "hf32")
    rebuilt = vitrel.load_model(tmp_path / "hf32", img_size=48)
    model.set_input_size(img_size=48)
    assert model.pretrained_cfg["input_size"] == rebuilt.pretrained_cfg["input_size"] == (3, 48, 48)
    assert model.pretrained_cfg["pool_size"] == ((3, 3) if "depths" in spec else None)  # (48 / 2 / 2^3, as timm's)
    assert timm.data.resolve_data_config(model=model)["input_size"] == (3, 48, 48)
    save_for_hf(model, tmp_path / "hf")
    back = (timm.create_model(f"local-dir:{tmp_path / 'hf'}", pretrained=True), vitrel.load_model(tmp_path / "hf"))
    for m in back:
        assert m.pretrained_cfg["input_size"] == (3, 48, 48), type(m)


# ---------------------------------------------------------------------------- the stored preprocessing, every route
ROUTE_FIELDS = ("input_size", "mean", "std", "interpolation", "crop_pct", "label_names")


@pytest.mark.parametrize(
    "kw",
    [{}, dict(num_classes=4), dict(img_size=48), dict(in_chans=3), dict(pretrained_cfg_overlay=dict(crop_pct=0.5))],
    ids=["stored", "new_head", "img_size", "in_chans", "overlay"],
)
def test_every_loading_route_puts_the_same_preprocessing_in_pretrained_cfg(kw, tmp_path):
    """The data config stored with an export (a grey model's mean / std, interpolation, crop, class names) reaches
    ``pretrained_cfg`` (what ``timm.data.resolve_data_config(model=m)`` reads) alike on the four loading routes, with
    the same arguments: a new head drops the class names (another head's), ``img_size`` / ``in_chans`` make the
    input size the model's (the statistics follow the channels), a ``pretrained_cfg_overlay`` entry wins. Before,
    ``local-dir:`` kept the stored names and size, the file route refused ``in_chans`` and ``load_model`` /
    ``create_model(checkpoint_path=)`` dropped the overlay."""
    from vitrel.models.data_config import set_data_config

    spec = dict(VIT)
    name = spec.pop("name")
    net = vitrel.create_model(name, pos="rel2d_full", in_chans=1, **spec)
    names = [f"class {i}" for i in range(10)]
    set_data_config(net, dict(mean=[0.3], std=[0.4], interpolation="bilinear", crop_pct=0.8, class_names=names))
    out = save_pretrained(net, tmp_path / "export")
    overlay = kw.get("pretrained_cfg_overlay", {})
    args = {k: v for k, v in kw.items() if k != "pretrained_cfg_overlay"}
    file = dict(file=str(out / "model.safetensors"))
    routes = {
        "load_model": vitrel.load_model(out, **kw),
        "create_model": vitrel.create_model(name, checkpoint_path=str(out), **kw),
        "file": timm.create_model(name, pretrained=True, pretrained_cfg_overlay={**file, **overlay}, **args),
        "local-dir": timm.create_model(f"local-dir:{out}", pretrained=True, **kw),
    }
    chans, side = kw.get("in_chans", 1), kw.get("img_size", 32)
    want = {
        "input_size": (chans, side, side),
        "mean": (0.3,) * chans,
        "std": (0.4,) * chans,
        "interpolation": "bilinear",
        "crop_pct": overlay.get("crop_pct", 0.8),
        "label_names": None if "num_classes" in kw else tuple(names),
    }
    for route, m in routes.items():
        got = {f: tuple(v) if isinstance(v, list) else v for f in ROUTE_FIELDS for v in [m.pretrained_cfg.get(f)]}
        assert got == want, (route, got)
        assert timm.data.resolve_data_config(model=m)["input_size"] == want["input_size"], route


@pytest.mark.parametrize("kw", [{}, dict(img_size=48)], ids=["stored", "img_size"])
def test_every_loading_route_gives_the_swins_pool_size_of_the_built_model(kw, tmp_path):
    """timm's ``pool_size`` (the Swin's final map) on every loading route is the loaded model's own. Before,
    ``vitrel.load_model(export, img_size=48)`` gave ``input_size`` 48 beside the architecture's ``pool_size`` (2, 2)
    of 32-px images (and a run at another size than the architecture's kept the architecture's)."""
    spec = dict(SWIN)
    name = spec.pop("name")
    out = save_pretrained(vitrel.create_model(name, pos="rel2d_full", **spec), tmp_path / "export")
    assert json.loads((out / "config.json").read_text())["pretrained_cfg"]["pool_size"] == [2, 2]  # (it wrote None)
    file = dict(file=str(out / "model.safetensors"))
    routes = {
        "load_model": vitrel.load_model(out, **kw),
        "create_model": vitrel.create_model(name, checkpoint_path=str(out), **kw),
        "file": timm.create_model(name, pretrained=True, pretrained_cfg_overlay=file, **spec, **kw),
        "local-dir": timm.create_model(f"local-dir:{out}", pretrained=True, **kw),
    }
    side = kw.get("img_size", 32)
    for route, m in routes.items():
        with torch.no_grad():
            final = m.forward_features(torch.randn(1, 3, side, side))  # [B, H'', W'', C]
        assert m.pretrained_cfg["input_size"] == (3, side, side), route
        assert tuple(m.pretrained_cfg["pool_size"]) == tuple(final.shape[1:3]) == (side // 16,) * 2, route


def test_timm_weights_given_to_timms_file_route_are_refused_naming_from_timm(tmp_path):
    """A timm ViT's export given to ``timm.create_model("vitrel_...", pretrained=True, pretrained_cfg_overlay=dict(file=
    ...))`` is refused (another architecture), but unlike ``vitrel.create_model(checkpoint_path=)`` the message did
    not say where timm weights load (an audit's): it names ``vitrel.from_timm`` now, as load_model's does."""
    from timm.models import save_for_hf

    from vitrel.models.checkpoint import CheckpointError

    save_for_hf(timm.create_model("vit_tiny_patch16_224", img_size=32, depth=1), str(tmp_path), safe_serialization=True)
    said = (
        r"holds a vit_tiny_patch16_224 model, not vitrel_vit_tiny_patch16_224; timm weights load with vitrel\.from_timm"
    )
    for given in (tmp_path, tmp_path / "model.safetensors"):
        with pytest.raises(CheckpointError, match=said):
            timm.create_model(
                "vitrel_vit_tiny_patch16_224", pretrained=True, pretrained_cfg_overlay=dict(file=str(given))
            )
        with pytest.raises(CheckpointError, match=r"timm weights load with vitrel\.from_timm"):
            vitrel.load_model(given, architecture="vitrel_vit_tiny_patch16_224")


# ---------------------------------------------------------------------------- the EMA copy of a training checkpoint
@pytest.mark.parametrize("ema_eval", [True, False])
def test_timm_file_route_takes_the_weights_load_model_takes(ema_eval, tmp_path):
    """``pretrained_cfg_overlay=dict(file=<.ckpt>)`` of a run with an EMA copy: the weights ``vitrel.load_model``,
    ``eval.py`` and ``predict.py`` score (``use_ema="auto"``: the EMA copy unless the run validated without it,
    ``module.ema_eval=false``). It took the live weights, so the same file scored otherwise through timm."""
    torch.manual_seed(0)
    net = lively(make(VIT)).eval()
    path = tmp_path / "last.ckpt"
    train_checkpoint(net, path)
    ckpt = torch.load(path, weights_only=True)
    torch.save({**ckpt, "hyper_parameters": {"ema_eval": ema_eval}}, path)
    name = VIT["name"]
    ref = vitrel.load_model(path).eval()
    via_timm = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path))).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(via_timm(x), ref(x))
        assert torch.equal(ref(x), net(x)) is (not ema_eval)  # (the EMA copy's weights are not the live ones)


@pytest.mark.parametrize("ema_eval", [True, False])
def test_timm_file_route_loads_the_weights_a_train_py_run_with_ema_scored(ema_eval, tmp_path):
    """``pretrained_cfg_overlay=dict(file=<train.py .ckpt>)`` of a run with ``module/ema=default``, whole and
    ``features_only``: the weights ``vitrel.load_model`` loads. train.py also stores the EMA copy as
    ``state_dict_ema``, which timm's ``load_state_dict`` hands the route instead of the Lightning state dict: the route
    failed ("holds no EMA weights"), and with ``module.ema_eval=false`` would have loaded that copy, not the live
    weights the run scored."""
    from tests.train_helpers import FAST, TINY_VIT, compose
    from vitrel.train.run import train

    run = [*TINY_VIT, *FAST, "trainer.max_steps=3", "trainer.limit_train_batches=3", "trainer.limit_val_batches=1"]
    run += ["logger=none", "test=false", "module/ema=default", "module.ema.decay=0.5", f"module.ema_eval={ema_eval}"]
    train(compose(tmp_path, run))
    path = str(tmp_path / "checkpoints" / "last.ckpt")
    assert "state_dict_ema" in torch.load(path, weights_only=True, mmap=True)
    ref = vitrel.load_model(path).eval()
    name = ref.vitrel_cfg["architecture"]
    via_timm = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=path)).eval()
    features = timm.create_model(
        name, pretrained=True, pretrained_cfg_overlay=dict(file=path), features_only=True, out_indices=(-1,)
    ).eval()
    live = vitrel.load_model(path, use_ema=False).eval()
    x = torch.randn(2, *ref.pretrained_cfg["input_size"])
    with torch.no_grad():
        assert torch.equal(via_timm(x), ref(x))
        assert torch.equal(features(x)[-1], ref.forward_intermediates(x, indices=1, intermediates_only=True)[-1])
        assert torch.equal(ref(x), live(x)) is (not ema_eval)  # (the EMA copy's weights are not the live ones)


def test_timm_file_route_takes_a_run_folder_or_an_export_folder_as_load_model_does(tmp_path):
    """``pretrained_cfg_overlay=dict(file=<folder>)`` with a ``train.py`` run folder or an export folder, which
    ``vitrel.load_model`` takes: the route built the model from the folder's stored arguments, then timm's loader
    failed on the folder with a bare ``FileNotFoundError`` (no message). It now loads the file ``load_model`` loads
    there (the run's ``last.ckpt``, the export's ``model.safetensors``), whole and ``features_only``, with its
    preprocessing."""
    from tests.train_helpers import FAST, TINY_VIT, compose
    from vitrel.models import export_model
    from vitrel.train.run import train

    run = [*TINY_VIT, *FAST, "trainer.max_steps=2", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1"]
    train(compose(tmp_path, [*run, "logger=none", "test=false"]))
    exported = export_model(tmp_path / "checkpoints" / "last.ckpt", tmp_path / "export")
    for folder in (tmp_path, tmp_path / "checkpoints", exported):
        ref = vitrel.load_model(folder).eval()
        name = ref.vitrel_cfg["architecture"]
        overlay = dict(file=str(folder))
        m = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay).eval()
        features = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay, features_only=True).eval()
        x = torch.randn(2, *ref.pretrained_cfg["input_size"])
        with torch.no_grad():
            assert torch.equal(m(x), ref(x)), folder
            want = ref.forward_intermediates(x, indices=features.feature_info.out_indices, intermediates_only=True)
            assert all(torch.equal(a, b) for a, b in zip(features(x), want, strict=True)), folder
        assert timm.data.resolve_data_config(model=m) == timm.data.resolve_data_config(model=ref), folder


# a timm source of each family, and the backbone's arguments giving the model's forward_intermediates format
TIMM_SOURCES = {
    "vit": (dict(model_name="vit_tiny_patch16_224", img_size=32, patch_size=4, depth=2), {}),
    "swin": (
        dict(model_name="swin_tiny_patch4_window7_224", img_size=32, patch_size=2, window_size=4, embed_dim=16)
        | dict(depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 1)),
        dict(output_fmt="NCHW"),
    ),
}


@pytest.mark.parametrize("source", list(TIMM_SOURCES))
def test_from_timm_features_only_gives_the_backbone_of_the_converted_weights(source, tmp_path):
    """``vitrel.from_timm(timm_model, pos=..., features_only=True)`` failed after building, with an
    ``UnsupportedTimmModel`` blaming the timm model ("gives no value for ['model.cls_token', ...]": the wrapper's
    keys), then was refused naming a two-step route. It is the backbone of the converted weights: what that route
    (``save_pretrained`` then timm's ``local-dir:`` with ``features_only``) builds, and ``create_model``'s
    ``init_from`` / ``init_file`` the same from a timm file."""
    source_kw, backbone_kw = TIMM_SOURCES[source]
    torch.manual_seed(0)
    t = lively(timm.create_model(**source_kw)).eval()
    m = vitrel.from_timm(t, num_classes=5).eval()  # (pos: the source's own, every weight from the source)
    save_pretrained(m, tmp_path / "backbone")
    route = timm.create_model(f"local-dir:{tmp_path / 'backbone'}", pretrained=True, features_only=True, **backbone_kw)
    ours = vitrel.from_timm(t, features_only=True, **backbone_kw)
    assert "no value for" not in repr(ours)
    torch.save(t.state_dict(), tmp_path / "timm.pth")
    timm_name, timm_kwargs = source_kw["model_name"], {k: v for k, v in source_kw.items() if k != "model_name"}
    from_file = vitrel.create_model(
        "vitrel_vit_tiny_patch4_32",  # (the architecture is the timm file's)
        init_from=f"timm:{timm_name}",
        init_file=str(tmp_path / "timm.pth"),
        timm_kwargs=timm_kwargs,
        features_only=True,
        **backbone_kw,
    )
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = m.forward_intermediates(x, indices=route.feature_info.out_indices, intermediates_only=True)
        for got in (route, ours, from_file):
            assert got.feature_info.out_indices == route.feature_info.out_indices
            assert all(torch.equal(a, b) for a, b in zip(got.eval()(x), want, strict=True))
