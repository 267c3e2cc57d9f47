"""Checkpoints: save / load through every route with identical outputs, resizing at another image
size, head reset, and refusal (CheckpointError, no code run) of anything unsafe or mismatched."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch

import vitrel
import vitrel.pos.tables
from vitrel import CheckpointError
from vitrel.models.checkpoint import extract_model_state, read_checkpoint, save_pretrained

VIT = "vitrel_vit_tiny_patch4_32"
SWIN = "vitrel_swin_tiny_patch2_window4_32"
SMALL = {
    VIT: dict(depth=2, embed_dim=32, num_heads=2),
    SWIN: dict(embed_dim=16, depths=(2, 2, 1, 1), num_heads=(1, 2, 2, 4)),
}


def _model(name: str = VIT, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    m = vitrel.create_model(name, **{**SMALL[name], **kw})
    with torch.no_grad():  # position parameters away from their init, so a lost table would show
        for n, p in m.named_parameters():
            if "pos" in n:
                p.add_(torch.randn_like(p) * 0.5)
    return m.eval()


def _lightning_ckpt(model: torch.nn.Module, path: Path, prefix: str = "model.", ema: torch.nn.Module | None = None):
    """The layout of a vitrel training checkpoint (see ``extract_model_state``)."""
    sd = {prefix + k: v for k, v in model.state_dict().items()}
    sd["criterion.weight"] = torch.ones(3)
    if ema is not None:
        sd.update({"ema_model." + k: v for k, v in ema.state_dict().items()})
    torch.save(
        {
            "epoch": 1,
            "global_step": 10,
            "pytorch-lightning_version": "2.6.6",
            "state_dict": sd,
            "optimizer_states": [{"state": {}, "param_groups": [{"lr": 1e-3}]}],
            "hyper_parameters": {"lr": 1e-3, "label_smoothing": 0.1},
            "vitrel_cfg": model.vitrel_cfg,
        },
        path,
    )
    return path


def _same(a: torch.nn.Module, b: torch.nn.Module, size: int = 32) -> None:
    x = torch.randn(2, a.patch_embed.proj.in_channels, size, size)
    a.eval(), b.eval()
    with torch.no_grad():
        torch.testing.assert_close(b(x), a(x), rtol=0, atol=0)


# ---------------------------------------------------------------------------- round trips
@pytest.mark.parametrize(
    "name,kw",
    [
        (VIT, dict(pos="rel2d_full", reg_tokens=2, abs_pos="ape", num_classes=7)),
        (VIT, dict(pos={"name": "rel2d_bucket", "num_buckets": 8, "max_distance": 16}, pos_share=True)),
        (SWIN, dict(pos="rel2d_factored", abs_pos="sincos2d", num_classes=4)),
    ],
)
def test_save_load_every_route_identical(tmp_path, name, kw):
    m = _model(name, **kw)
    ckpt = _lightning_ckpt(m, tmp_path / "last.ckpt")
    _same(m, vitrel.load_model(ckpt))
    _same(m, vitrel.create_model(name, checkpoint_path=ckpt))  # config from the checkpoint
    # torch.compile'd module in the training module: keys model._orig_mod.*
    _same(m, vitrel.load_model(_lightning_ckpt(m, tmp_path / "compiled.ckpt", prefix="model._orig_mod.")))

    out = vitrel.export_model(ckpt, tmp_path / "export")
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert config["architecture"] == name and config["num_classes"] == m.num_classes
    _same(m, vitrel.load_model(out))
    _same(m, vitrel.load_model(out / "model.safetensors"))
    # a lone .safetensors: the configuration is in its metadata
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "w.safetensors").write_bytes((out / "model.safetensors").read_bytes())
    _same(m, vitrel.load_model(lone / "w.safetensors"))

    # timm's local-weights routes, without re-typing the configuration
    t = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(out / "model.safetensors")))
    _same(m, t)
    _same(m, timm.create_model(f"local-dir:{out}", pretrained=True))
    _same(m, timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(ckpt))))  # a .ckpt too


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        (dict(pos="rope2d_axial"), r"pos=rope2d_axial \(trained with alibi2d\)"),
        (dict(num_heads=4), r"num_heads=4 \(trained with 2\)"),
        (dict(pos_share=True), r"pos_share=True \(trained with False\)"),
        (dict(act_layer="quick_gelu"), r"act_layer='quick_gelu' \(trained with 'gelu'\)"),
        (dict(post_norm=True), r"post_norm=True \(trained with False\)"),
    ],
)
def test_an_override_the_weights_fit_but_that_changes_the_function_warns(tmp_path, kw, says):
    """``load_model(path, pos=<another parameter-free scheme>)``, ``num_heads=``...: the weights load (their shapes
    fit) into another function, which was silent (a wrong answer for whoever meant the trained model); one warning
    now names each such argument with the trained value. An override that keeps the function (``attn_impl``, a
    training setting) or the stored scheme's options (``pos={"name": "alibi2d"}``) does not warn."""
    import warnings

    m = _model(pos="alibi2d").eval()
    save_pretrained(m, tmp_path)
    with pytest.warns(UserWarning, match=f"{says}: the weights fit, but this model computes another function"):
        vitrel.load_model(tmp_path, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for same in (dict(attn_impl="eager"), dict(drop_path_rate=0.1), dict(pos={"name": "alibi2d"}), {}):
            vitrel.load_model(tmp_path, **same)


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        (dict(global_pool="token"), r"global_pool='token' \(trained with 'avg'\)"),
        (dict(embed_dim=64), r"embed_dim=64 \(trained with 32\)"),
    ],
)
def test_an_override_the_weights_do_not_fit_names_the_trained_value(tmp_path, kw, says):
    """``load_model(path, global_pool="token")`` of a model trained with ``avg``: the weights do not fit (``fc_norm``
    against ``norm``), and the error listed the missing and unexpected keys alone; it now names the argument with
    the trained value, as a scheme given in place of the trained one is named."""
    m = _model(global_pool="avg").eval()
    assert m.vitrel_cfg["embed_dim"] == 32
    save_pretrained(m, tmp_path)
    with pytest.raises(CheckpointError, match=rf"do not fit the model built with {says} \(the weights"):
        vitrel.load_model(tmp_path, **kw)


def test_export_cli(tmp_path, capsys):
    m = _model(SWIN, pos="rel2d_full")
    ckpt = _lightning_ckpt(m, tmp_path / "a.ckpt")
    r = subprocess.run(
        [sys.executable, "-m", "vitrel.export", str(ckpt), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stderr
    _same(m, vitrel.load_model(tmp_path / "out"))
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(ckpt.read_bytes()[:1000])
    from vitrel.export import main

    assert main([str(bad), str(tmp_path / "o2")]) == 2
    assert "error:" in capsys.readouterr().err and not (tmp_path / "o2").exists()


def test_real_lightning_checkpoint(tmp_path):
    """A checkpoint written by Lightning's Trainer, with the config stored by ``on_save_checkpoint``."""
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self, model):
            super().__init__()
            self.save_hyperparameters(ignore=["model"])
            self.model = model

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.model(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def on_save_checkpoint(self, checkpoint):
            checkpoint["vitrel_cfg"] = self.model.vitrel_cfg

    m = _model(VIT, pos="rope2d_mixed").train()
    data = torch.utils.data.TensorDataset(torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,)))
    trainer = L.Trainer(
        max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(Module(m), torch.utils.data.DataLoader(data, batch_size=4))
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    _same(m, vitrel.load_model(tmp_path / "last.ckpt"))


def test_ema_weights(tmp_path):
    m = _model(VIT, pos="rel2d_full")
    ema = _model(VIT, pos="rel2d_full")
    with torch.no_grad():
        for p in ema.parameters():
            p.mul_(0.5)
    ckpt = _lightning_ckpt(m, tmp_path / "e.ckpt", ema=ema)
    _same(m, vitrel.load_model(ckpt, use_ema=False))
    _same(ema, vitrel.load_model(ckpt, use_ema=True))
    _same(ema, vitrel.load_model(ckpt))  # "auto": the EMA weights a run with EMA validated and tested with
    _same(m, vitrel.load_model(_lightning_ckpt(m, tmp_path / "n.ckpt")))  # "auto" without EMA weights
    with pytest.raises(CheckpointError, match="no EMA"):
        vitrel.load_model(_lightning_ckpt(m, tmp_path / "n.ckpt"), use_ema=True)


def test_checkpoint_has_ema_reads_keys_not_tensors(tmp_path, monkeypatch):
    """``checkpoint_has_ema`` (eval / predict / export with ``ema=auto``, before the weights are loaded) leaves a zip
    checkpoint's tensors on disk (a second full read of a large checkpoint otherwise); a legacy (non-zip) file and
    a file without EMA weights are answered too."""
    from vitrel.models import checkpoint

    sd = {"model.w": torch.ones(3), "ema_model.module.w": torch.ones(3)}
    zipped, legacy, plain = tmp_path / "z.ckpt", tmp_path / "l.ckpt", tmp_path / "p.ckpt"
    torch.save({"state_dict": sd}, zipped)
    torch.save({"state_dict": sd}, legacy, _use_new_zipfile_serialization=False)
    torch.save({"state_dict": {"model.w": torch.ones(3)}}, plain)
    calls, load = [], torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **kw: calls.append(kw.get("mmap")) or load(*a, **kw))
    assert [checkpoint.checkpoint_has_ema(p) for p in (zipped, legacy, plain)] == [True, True, False]
    assert calls == [True, False, True]  # tensors mapped, not read (a legacy file cannot be mapped)
    # ema=auto: the EMA weights where the run validated with them (ema_eval; not stored before: the default, True)
    raw = tmp_path / "raw.ckpt"
    torch.save({"state_dict": sd, "hyper_parameters": {"ema_eval": False}}, raw)
    assert [checkpoint.checkpoint_scores_ema(p) for p in (zipped, legacy, plain, raw)] == [True, True, False, False]


def test_extract_model_state_contract():
    m = _model(VIT, pos="rel2d_full")
    sd = {"model." + k: v for k, v in m.state_dict().items()}
    cfg, state = extract_model_state({"state_dict": sd, "hyper_parameters": {"vitrel_cfg": m.vitrel_cfg}})
    assert cfg == m.vitrel_cfg and state.keys() == m.state_dict().keys()
    cfg2, state2 = extract_model_state({"state_dict": m.state_dict(), "vitrel_cfg": m.vitrel_cfg})  # plain
    assert cfg2 == m.vitrel_cfg and state2.keys() == m.state_dict().keys()
    with pytest.raises(CheckpointError, match="no model configuration"):
        extract_model_state({"state_dict": sd})
    with pytest.raises(CheckpointError, match="state_dict"):
        extract_model_state({"vitrel_cfg": m.vitrel_cfg})


# ---------------------------------------------------------------------------- other sizes, other heads
def _train_step(m: torch.nn.Module, size: int = 32) -> None:
    m.train()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    loss = torch.nn.functional.cross_entropy(m(torch.randn(4, 3, size, size)), torch.randint(0, m.num_classes, (4,)))
    loss.backward()
    opt.step()
    m.eval()


@pytest.mark.parametrize("name", [VIT, SWIN])
def test_train_at_32_load_at_48(tmp_path, monkeypatch, name):
    monkeypatch.setattr(vitrel.pos.tables, "_WARNED", set())
    m = _model(name, pos="rel2d_full", abs_pos="ape")
    _train_step(m)
    ckpt = _lightning_ckpt(m, tmp_path / "t.ckpt")
    with pytest.warns(UserWarning, match="resized relative-position table"):
        big = vitrel.load_model(ckpt, img_size=48)
    assert big.vitrel_cfg["img_size"] == [48, 48]
    old, new = m.state_dict(), big.state_dict()
    grown = [k for k in old if k.endswith("pos.table") and old[k].shape != new[k].shape]
    assert grown, "some table must have grown"
    for k in grown:
        a, b = old[k], new[k]
        assert b.shape[0] > a.shape[0] and b.shape[1] > a.shape[1]
        dh, dw = (b.shape[0] - a.shape[0]) // 2, (b.shape[1] - a.shape[1]) // 2
        # every offset seen at 32 keeps its value exactly
        torch.testing.assert_close(b[dh : dh + a.shape[0], dw : dw + a.shape[1]], a, rtol=0, atol=0)
    assert new["abs_pos.pos_embed"].shape[1] == (48 // m.patch_embed.patch_size[0]) ** 2
    for k in old:  # everything else loads unchanged
        if k not in grown and "pos_embed" not in k:
            torch.testing.assert_close(new[k], old[k], rtol=0, atol=0)
    y = big(torch.randn(2, 3, 48, 48))
    assert y.shape == (2, 10) and torch.isfinite(y).all()
    # the model at 32 also runs at 48 without reloading: the bias of offsets it knows is the same
    if name == VIT:
        t_old = m.blocks[0].attn.pos.bias(vitrel.Grid(8, 8))
        t_new = big.blocks[0].attn.pos.bias(vitrel.Grid(8, 8))
        torch.testing.assert_close(t_new, t_old, rtol=0, atol=0)


def test_scheme_options_given_on_load_keep_the_stored_ones(tmp_path):
    """``load_model(path, pos={...})`` (``eval.py +model_overrides.pos.scaling=...``) with the stored scheme's options
    changes those and keeps the rest: a model trained with ``base: 10``, columns first, scored with RoPE scaling keeps
    them (it reset them to the defaults, silently: other logits at the trained size, where ``factor: auto`` is 1).
    Another scheme, or a name alone, replaces the spec."""
    m = _model(VIT, pos={"name": "rope2d_axial", "base": 10.0, "order": "columns_first"})
    ckpt = _lightning_ckpt(m, tmp_path / "t.ckpt")
    scaling = {"rope_type": "linear", "factor": "auto"}
    x = torch.randn(2, 3, 32, 32)
    for pos in ({"scaling": scaling}, {"name": "rope2d_axial", "scaling": scaling}):
        scaled = vitrel.load_model(ckpt, pos=pos).eval()
        assert scaled.vitrel_cfg["pos"] == {"name": "rope2d_axial", "base": 10.0, "order": "columns_first", **pos}
        with torch.no_grad():
            torch.testing.assert_close(scaled(x), m(x), rtol=0, atol=0)
    assert vitrel.load_model(ckpt, pos="rope2d_axial").vitrel_cfg["pos"] == "rope2d_axial"
    with pytest.raises(CheckpointError, match="missing keys: .*pos.freqs"):
        vitrel.load_model(ckpt, pos={"name": "rope2d_mixed", "base": 10.0})


def test_other_num_classes_resets_head(tmp_path):
    m = _model(VIT, pos="rel2d_full", num_classes=10)
    ckpt = _lightning_ckpt(m, tmp_path / "h.ckpt")
    with pytest.warns(UserWarning, match="head is reset"):
        r = vitrel.load_model(ckpt, num_classes=5)
    assert r.num_classes == 5 and r.head.weight.shape == (5, 32)
    a, b = m.state_dict(), r.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a if not k.startswith("head."))
    with torch.no_grad():
        x = torch.randn(2, 3, 32, 32)
        torch.testing.assert_close(r.forward_head(r.forward_features(x), pre_logits=True),
                                   m.forward_head(m.forward_features(x), pre_logits=True))  # fmt: skip
    # timm's route resets the head the same way
    out = vitrel.export_model(ckpt, tmp_path / "x")
    t = timm.create_model(
        VIT, pretrained=True, pretrained_cfg_overlay=dict(file=str(out / "model.safetensors")), num_classes=3
    )
    assert t.num_classes == 3 and torch.equal(t.blocks[0].attn.qkv.weight, m.blocks[0].attn.qkv.weight)


def test_pretrained_cfg_num_classes_is_the_stored_heads(tmp_path):
    """``load_model`` of a 7-class checkpoint gave ``pretrained_cfg["num_classes"]`` the architecture's default (10
    here; 1000 for a fine-tune of timm's ``vit_*_224``) beside 7 class names, where timm's ``pretrained_cfg_overlay``
    route gives the stored head's 7, as timm's convention has it (the weights' classes, also under a reset head)."""
    m = _model(VIT, pos="rel2d_full", num_classes=7)
    ckpt = _lightning_ckpt(m, tmp_path / "c.ckpt")
    t = timm.create_model(VIT, pretrained=True, pretrained_cfg_overlay=dict(file=str(ckpt)), **SMALL[VIT])
    assert vitrel.load_model(ckpt).pretrained_cfg["num_classes"] == t.pretrained_cfg["num_classes"] == 7
    with pytest.warns(UserWarning, match="head is reset"):
        assert vitrel.load_model(ckpt, num_classes=5).pretrained_cfg["num_classes"] == 7


def test_a_headless_model_gets_a_new_head(tmp_path):
    """Weights without a head (``num_classes=0``: a backbone, timm's DINOv3) loaded with ``num_classes=5`` failed
    with "the weights do not fit this architecture: missing keys: head.weight, head.bias"; the head is new, as for
    a head of another size."""
    m = _model(VIT, pos="rel2d_full", num_classes=0)
    ckpt = _lightning_ckpt(m, tmp_path / "b.ckpt")
    with pytest.warns(UserWarning, match="head is reset"):
        r = vitrel.load_model(ckpt, num_classes=5)
    assert r.num_classes == 5 and torch.equal(r.blocks[0].attn.qkv.weight, m.blocks[0].attn.qkv.weight)
    t = timm.create_model("vit_small_patch16_224", img_size=32, patch_size=8, depth=1, embed_dim=32, num_heads=2,
                          num_classes=0)  # fmt: skip
    r = vitrel.from_timm(t, num_classes=5)
    assert r.num_classes == 5 and torch.equal(r.blocks[0].attn.qkv.weight, t.blocks[0].attn.qkv.weight)


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_overlay_file_plain_state_dict_keeps_its_head(tmp_path, suffix):
    """``pretrained=True, pretrained_cfg_overlay=dict(file=<plain state dict>)`` with the file's ``num_classes`` (7,
    not the architecture's default 10) dropped the file's head (timm drops it when ``num_classes`` differs from
    ``pretrained_cfg``'s) and loaded the rest non-strictly: other logits, no error, and another scheme's weights
    loaded too. The file's head gives ``pretrained_cfg``'s ``num_classes``, and the model's when none is given (it
    was the architecture's 10, the file's head dropped without a word)."""
    from safetensors.torch import save_file

    m = _model(VIT, pos="rel2d_cpb", num_classes=7)
    with torch.no_grad():
        m.head.bias.add_(torch.randn(7))
    f = tmp_path / f"w{suffix}"
    save_file(m.state_dict(), f) if suffix == ".safetensors" else torch.save(m.state_dict(), f)
    load = dict(pretrained=True, pretrained_cfg_overlay=dict(file=str(f)), **SMALL[VIT])
    t = timm.create_model(VIT, pos="rel2d_cpb", num_classes=7, **load).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(t(x), m(x))
    assert t.pretrained_cfg["num_classes"] == 7
    t = timm.create_model(VIT, pos="rel2d_cpb", **load).eval()  # no num_classes: the file's, not the default 10
    with torch.no_grad():
        torch.testing.assert_close(t(x), m(x))
    with pytest.raises(CheckpointError, match="do not fit"):  # another scheme: strict, as with checkpoint_path=
        timm.create_model(VIT, pos="rel2d_full", num_classes=7, **load)
    t = timm.create_model(VIT, pos="rel2d_cpb", num_classes=3, **load)  # another head: reset, as timm resets it
    assert t.num_classes == 3 and torch.equal(t.blocks[0].attn.qkv.weight, m.blocks[0].attn.qkv.weight)


@pytest.mark.parametrize("name", [VIT, SWIN, "vitrel_vit_video_tiny_patch4_32"])
def test_other_in_chans_adapts_the_patch_embedding(tmp_path, name):
    """``load_model(path, in_chans=3)`` of a grey model (``model=from_checkpoint`` on RGB data takes the data's
    channels) failed with "the weights do not fit this architecture". The patch embedding is adapted as timm adapts
    pretrained weights (``adapt_input_conv``: repeated and scaled, or summed for one channel), so a grey image given
    as three equal channels scores as before, both ways."""
    video = "video" in name
    kw = dict(depth=1, embed_dim=32, num_heads=2) if video else {}
    for stored, wanted in ((1, 3), (3, 1)):
        torch.manual_seed(0)
        m = (vitrel.create_model(name, in_chans=stored, **kw) if video else _model(name, in_chans=stored)).eval()
        ckpt = _lightning_ckpt(m, tmp_path / f"c{stored}.ckpt")
        with pytest.warns(UserWarning, match=f"patch embedding adapted from {stored} to {wanted} input channels"):
            r = vitrel.load_model(ckpt, in_chans=wanted).eval()
        grey = torch.randn(2, 1, *((m.vitrel_cfg["num_frames"],) if video else ()), 32, 32)
        with torch.no_grad():
            torch.testing.assert_close(r(grey.expand(-1, wanted, *grey.shape[2:])),
                                       m(grey.expand(-1, stored, *grey.shape[2:])))  # fmt: skip


# ---------------------------------------------------------------------------- refusals
class _Evil:
    def __init__(self, sentinel: str):
        self.sentinel = sentinel

    def __reduce__(self):
        return (os.system, (f"touch {self.sentinel}",))


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_run_folder_loads_the_checkpoint_its_test_scored(tmp_path, caplog):
    """``vitrel.load_model(<run folder>)`` (or its ``checkpoints/``) was refused with a line naming ``last.ckpt``: it
    loads ``last.ckpt``, the final weights train.py's own test scored (not the best-epoch file), and says so in one
    line; without ``last.ckpt``, the one ``best-epoch*.ckpt``. An export folder and a folder of one weights file load
    as before; a folder of several is one error naming them."""
    caplog.set_level("INFO", logger="vitrel.models.ckpt_files")
    last_m, best_m = _model(VIT, pos="rel2d_full"), _model(VIT, pos="rel2d_full")
    with torch.no_grad():
        best_m.head.weight.add_(1.0)  # (another epoch's weights)
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    ckpts.mkdir(parents=True)
    _lightning_ckpt(last_m, ckpts / "last.ckpt")
    _lightning_ckpt(best_m, ckpts / "best-epoch000.ckpt")
    for folder, name in ((run, "checkpoints/last.ckpt"), (ckpts, "last.ckpt")):
        caplog.clear()
        assert _same_weights(vitrel.load_model(folder), last_m)
        said = [r.getMessage() for r in caplog.records if "train.py run folder" in r.getMessage()]
        assert said == [
            f"{folder} is a train.py run folder: taking {name}, the run's final weights, which its own test scored; "
            "best-epoch000.ckpt: the best validation epoch's, give it for that"
        ]
    (ckpts / "last.ckpt").unlink()
    caplog.clear()
    assert _same_weights(vitrel.load_model(run), best_m)
    said = f"{run} is a train.py run folder: taking checkpoints/best-epoch000.ckpt, the best validation epoch's; no "
    assert said + "last.ckpt (the final weights the run's test scored) is there" in caplog.text
    _lightning_ckpt(best_m, ckpts / "best-epoch001.ckpt")
    with pytest.raises(CheckpointError, match=r"no last.ckpt and 2 best-epoch files: best-epoch000.ckpt, best-ep"):
        vitrel.load_model(run)
    plain = tmp_path / "plain"
    plain.mkdir()
    _lightning_ckpt(last_m, plain / "a.ckpt")
    assert _same_weights(vitrel.load_model(plain), last_m)  # (a folder of one weights file)
    _lightning_ckpt(best_m, plain / "b.ckpt")
    with pytest.raises(CheckpointError, match=r"2 candidates: a.ckpt, b.ckpt: give one"):
        vitrel.load_model(plain)


def test_malicious_pickle_is_refused(tmp_path):
    sentinel = tmp_path / "pwned"
    m = _model(VIT, pos="rel2d_full")
    payload = {"state_dict": {"model." + k: v for k, v in m.state_dict().items()}, "vitrel_cfg": m.vitrel_cfg}
    payload["callbacks"] = _Evil(str(sentinel))
    # the check is real: an unrestricted unpickler would run the payload
    with open(tmp_path / "probe.pkl", "wb") as f:
        pickle.dump(_Evil(str(tmp_path / "probe")), f)
    with open(tmp_path / "probe.pkl", "rb") as f:
        pickle.load(f)  # noqa: S301 - deliberately unsafe, on our own probe
    assert (tmp_path / "probe").exists()

    torch.save(payload, tmp_path / "evil.ckpt")  # zip format
    with open(tmp_path / "evil_legacy.ckpt", "wb") as f:  # bare pickle
        pickle.dump(payload, f)
    for path in (tmp_path / "evil.ckpt", tmp_path / "evil_legacy.ckpt"):
        with pytest.raises(CheckpointError, match="refused"):
            vitrel.load_model(path)
        with pytest.raises(CheckpointError):
            vitrel.export_model(path, tmp_path / "out")
        with pytest.raises(CheckpointError):
            vitrel.create_model(VIT, checkpoint_path=path)
    assert not sentinel.exists()


def test_pickled_objects_are_refused(tmp_path):
    m = _model(VIT, pos="rel2d_full")
    torch.save({"state_dict": m.state_dict(), "vitrel_cfg": m.vitrel_cfg, "model": m}, tmp_path / "obj.ckpt")
    with pytest.raises(CheckpointError, match="refused"):
        vitrel.load_model(tmp_path / "obj.ckpt")


def test_truncated_files(tmp_path):
    m = _model(VIT, pos="rel2d_full")
    ckpt = _lightning_ckpt(m, tmp_path / "t.ckpt")
    data = ckpt.read_bytes()
    for n in (0, 100, len(data) // 2, len(data) - 10):
        (tmp_path / "cut.ckpt").write_bytes(data[:n])
        with pytest.raises(CheckpointError, match="cannot read"):
            vitrel.load_model(tmp_path / "cut.ckpt")
    out = vitrel.export_model(ckpt, tmp_path / "e")
    st = (out / "model.safetensors").read_bytes()
    for n in (5, 200, len(st) // 2, len(st) - 1):
        (out / "model.safetensors").write_bytes(st[:n])
        with pytest.raises(CheckpointError, match="cannot read"):
            vitrel.load_model(out)
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        vitrel.load_model(tmp_path / "missing.ckpt")


def test_random_bytes_that_break_the_unpickler_are_a_checkpoint_error(tmp_path):
    """Some random bytes (torch's generator, seed 12) make torch's weights-only unpickler raise a bare ``IndexError:
    list index out of range`` rather than an ``UnpicklingError``; it escaped the routes' one ``CheckpointError``
    (``test_bad_files_give_one_clear_error_on_every_route`` failed whenever the global seed drew such bytes)."""
    g = torch.Generator().manual_seed(12)
    path = tmp_path / "random.ckpt"
    path.write_bytes(bytes(torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=g).tolist()))
    with pytest.raises(CheckpointError, match="random.ckpt"):
        vitrel.load_model(path)


def test_weights_of_another_architecture(tmp_path):
    vit, swin = _model(VIT, pos="rel2d_full"), _model(SWIN, pos="rel2d_full")
    # vit configuration, swin weights
    sd = {"model." + k: v for k, v in swin.state_dict().items()}
    torch.save({"state_dict": sd, "vitrel_cfg": vit.vitrel_cfg}, tmp_path / "mix.ckpt")
    with pytest.raises(CheckpointError, match="do not fit.*missing keys"):
        vitrel.load_model(tmp_path / "mix.ckpt")
    # same keys, other widths
    wide = _model(VIT, pos="rel2d_full", embed_dim=48, num_heads=2)
    sd = {"model." + k: v for k, v in wide.state_dict().items()}
    torch.save({"state_dict": sd, "vitrel_cfg": vit.vitrel_cfg}, tmp_path / "wide.ckpt")
    with pytest.raises(CheckpointError, match="size mismatch"):
        vitrel.load_model(tmp_path / "wide.ckpt")
    # another scheme than the stored one
    sd = {"model." + k: v for k, v in _model(VIT, pos="rel2d_factored").state_dict().items()}
    torch.save({"state_dict": sd, "vitrel_cfg": vit.vitrel_cfg}, tmp_path / "pos.ckpt")
    with pytest.raises(CheckpointError, match="do not fit"):
        vitrel.load_model(tmp_path / "pos.ckpt")
    # a checkpoint with no configuration (e.g. a plain timm state dict)
    torch.save(vit.state_dict(), tmp_path / "plain.pth")
    with pytest.raises(CheckpointError, match="carries no configuration.*checkpoint_path"):
        vitrel.load_model(tmp_path / "plain.pth")
    # an architecture we do not know, or not the one asked for
    torch.save({"state_dict": sd, "vitrel_cfg": {**vit.vitrel_cfg, "architecture": "resnet50"}}, tmp_path / "r.ckpt")
    with pytest.raises(CheckpointError, match="does not know"):
        vitrel.load_model(tmp_path / "r.ckpt")
    ok = _lightning_ckpt(vit, tmp_path / "ok.ckpt")
    with pytest.raises(CheckpointError, match="not vitrel_swin"):
        vitrel.create_model(SWIN, checkpoint_path=ok)
    cfg, _ = read_checkpoint(ok)
    assert cfg == vit.vitrel_cfg


def test_the_head_reset_warning_names_the_caller_not_vitrel(tmp_path):
    """``vitrel.create_model(name, checkpoint_path=..., num_classes=5)`` (fine-tuning weights of 10 classes): the
    head-reset warning was attributed to ``vitrel/models/factory.py`` (``return load_model(...)``), a line of vitrel's;
    now to the caller's line, as with ``vitrel.load_model`` itself."""
    import warnings

    from vitrel.models.checkpoint import save_pretrained

    weights = save_pretrained(_model(num_classes=10), tmp_path / "w") / "model.safetensors"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        vitrel.create_model(VIT, checkpoint_path=str(weights), num_classes=5)
        vitrel.load_model(weights.parent, num_classes=5)
    said = [w for w in caught if "the head is reset" in str(w.message)]
    assert [w.filename for w in said] == [__file__] * 2, [(w.filename, w.lineno) for w in said]


@pytest.mark.parametrize("ema_key", ["state_dict_ema", "model_ema"])
def test_timm_train_checkpoint_loads_its_ema_as_timm_does(tmp_path, ema_key):
    """A checkpoint of timm's train script / ``timm.utils.CheckpointSaver`` (``state_dict`` and an EMA copy beside it):
    ``vitrel.create_model(..., checkpoint_path=)`` loads the EMA copy, as ``timm.create_model(..., checkpoint_path=)``
    (timm's ``load_checkpoint(use_ema=True)``); ``load_model(use_ema=False)`` the live weights."""
    kw = dict(SMALL[VIT], pos="rel2d_cpb", num_classes=10)
    live, ema = _model(**kw), _model(**kw)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in ema.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    path = tmp_path / "model_best.pth.tar"
    torch.save({"epoch": 3, "arch": VIT, "state_dict": live.state_dict(), ema_key: ema.state_dict()}, path)
    _same(vitrel.create_model(VIT, checkpoint_path=str(path), **kw), ema)
    _same(timm.create_model(VIT, checkpoint_path=str(path), **kw), ema)  # (timm's own route, the reference)
    _same(vitrel.load_model(path, architecture=VIT, use_ema=False, **kw), live)
    _same(vitrel.load_model(path, architecture=VIT, use_ema=True, **kw), ema)


def test_asking_a_run_without_ema_for_its_ema_copy_names_the_callers_spelling(tmp_path):
    """Was: ``python eval.py ckpt_path=<run without module/ema> ema=true`` said "use_ema=True but the checkpoint
    holds no EMA weights", an argument of ``vitrel.load_model`` the user never gave; an export said "use_ema applies
    to training checkpoints". Each names the spellings and what to do."""
    from tests.train_helpers import FAST, TINY_VIT, compose
    from vitrel.train.evaluate import evaluate
    from vitrel.train.run import train

    run = [*TINY_VIT, *FAST, "trainer.max_steps=1", "trainer.limit_val_batches=1", "logger=none", "test=false"]
    train(compose(tmp_path / "run", run))
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    said = r"ema=true of eval\.py / predict\.py, --ema of python -m vitrel\.export, use_ema=True of vitrel\.load_model"
    over = [f"ckpt_path={ckpt}", "ema=true", "data.num_workers=0", "trainer.accelerator=cpu", "progress_bar=none"]
    with pytest.raises(CheckpointError, match=rf"holds no EMA copy \(its run had no module/ema\).*{said}.*auto"):
        evaluate(compose(tmp_path / "eval", over, config_name="eval"))
    with pytest.raises(CheckpointError, match=rf"holds no EMA copy.*{said}"):
        vitrel.load_model(ckpt, use_ema=True)
    out = save_pretrained(vitrel.load_model(ckpt), tmp_path / "export", ema=False)
    with pytest.raises(CheckpointError, match=r"holds the trained weights only .*ema=true.*give ema=auto"):
        vitrel.load_model(out, use_ema=True)
