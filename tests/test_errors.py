"""Clear errors for bad inputs (issue 20): integer weights, impossible model sizes, damaged or unsafe
checkpoint files, damaged ``.pt2`` programs. Each message names what is wrong (the key, the argument,
the file) and none suggests ``weights_only=False``."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from safetensors.torch import load_file, save_file

import vitrel
from vitrel import Attention, CheckpointError
from vitrel.models.checkpoint import WEIGHTS_NAME, save_pretrained

VIT = "vitrel_vit_tiny_patch4_32"
SWIN = "vitrel_swin_tiny_patch2_window4_32"
TINY = dict(embed_dim=16, depth=1, num_heads=2, img_size=8, num_classes=3)


def _exported(tmp_path, dtype: torch.dtype | None, model: torch.nn.Module | None = None) -> str:
    """A tiny ViT's export folder, every floating tensor converted to ``dtype`` (None: as it is)."""
    out = tmp_path / f"export_{dtype}"
    save_pretrained(model or vitrel.create_model(VIT, **TINY), out)
    if dtype is not None:
        f = out / WEIGHTS_NAME
        from safetensors import safe_open

        with safe_open(str(f), framework="pt") as h:
            meta = h.metadata()
        sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in load_file(str(f)).items()}
        save_file(sd, str(f), metadata=meta)
    return str(out)


# ------------------------------------------------------------------------------ item 5: weight dtypes
def test_integer_weights_are_refused_naming_the_key(tmp_path):
    with pytest.raises(CheckpointError, match=r"not floating point: .*(cls_token|blocks\.0\.).*int32"):
        vitrel.load_model(_exported(tmp_path, torch.int32))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_every_float_precision_loads(tmp_path, dtype):
    ref = vitrel.create_model(VIT, **TINY)
    m = vitrel.load_model(_exported(tmp_path, dtype, ref))
    w, w_ref = m.blocks[0].attn.qkv.weight, ref.blocks[0].attn.qkv.weight
    assert w.dtype == torch.float32 and torch.allclose(w, w_ref.to(dtype).float())


# ------------------------------------------------------------------------------ item 7: model sizes
@pytest.mark.parametrize(
    "arch, kwargs, named",
    [
        (VIT, dict(num_heads=0), "num_heads must be >= 1"),
        (VIT, dict(num_heads=3), "embed_dim 16 is not divisible by num_heads 3"),
        (VIT, dict(patch_size=0), "patch_size must be >= 1"),
        (VIT, dict(embed_dim=0), "embed_dim must be >= 1"),
        (VIT, dict(depth=0), "depth must be >= 1"),
        (VIT, dict(mlp_ratio=0.0), "mlp_ratio must be a number > 0"),
        (
            VIT,
            dict(img_size=10),
            r"image size 10x10 is not a positive multiple of the patch size 4 \(img_size, patch_size\)",
        ),
        (VIT, dict(num_heads=2.0), "num_heads must be an integer"),
        (SWIN, dict(window_size=0), "window_size must be >= 1"),
        (SWIN, dict(depths=[1, 1], num_heads=[2, 0]), r"num_heads\[1\] must be >= 1"),
        (SWIN, dict(depths=[1, 1], num_heads=[2, 3]), r"stage 1's width\) 32 is not divisible by num_heads\[1\] 3"),
        (SWIN, dict(depths=[1], num_heads=[2, 2]), "one entry per stage"),
        (SWIN, dict(patch_size=0), "patch_size must be >= 1"),
        (VIT, dict(in_chans=0), "in_chans must be >= 1, got 0"),  # built a model no image fits
        (VIT, dict(in_chans=True), "in_chans must be an integer >= 1, got True"),  # built a 1-channel model
        (SWIN, dict(in_chans=0), "in_chans must be >= 1, got 0"),
        (SWIN, dict(in_chans=-1), "in_chans must be >= 1, got -1"),  # torch's "negative dimension -1: [16, -1, 4, 4]"
        (SWIN, dict(in_chans=3.0), r"in_chans must be an integer >= 1, got 3.0 \(float\)"),
        (VIT, dict(num_classes=-1), r"num_classes must be >= 0 \(0 for no head\), got -1"),  # built a headless model
        (VIT, dict(num_classes=False), "num_classes must be an integer >= 0 .*got False"),  # the same
        (VIT, dict(num_classes=10.0), r"num_classes must be an integer >= 0 .*got 10.0 \(float\)"),  # torch's empty()
        (SWIN, dict(num_classes=-5), r"num_classes must be >= 0 \(0 for no head\), got -5"),
        (SWIN, dict(num_classes=True), "num_classes must be an integer >= 0 .*got True"),
        # a rate out of [0, 1]: the first training step failed inside timm's drop_path (a negative keep probability)
        (VIT, dict(drop_path_rate=2), r"drop_path_rate must be a number in \[0, 1\], got 2"),
        (VIT, dict(attn_drop_rate=-0.1), r"attn_drop_rate must be a number in \[0, 1\], got -0.1"),
        (VIT, dict(pos_drop_rate="0.1"), r"pos_drop_rate must be a number in \[0, 1\], got '0.1'"),
        (SWIN, dict(drop_rate=1.5), r"drop_rate must be a number in \[0, 1\], got 1.5"),
        (SWIN, dict(proj_drop_rate=True), r"proj_drop_rate must be a number in \[0, 1\], got True"),
        ("vitrel_vit_video_tiny_patch4_32", dict(drop_path_rate=1.01), r"drop_path_rate must be a number in \[0, 1\]"),
        ("vitrel_swin3d_tiny_patch122_window444_32", dict(drop_path_rate=-1), "drop_path_rate must be a number in"),
    ],
)
def test_impossible_sizes_name_the_argument(arch, kwargs, named):
    vit = "_vit_" in arch  # (the image or the video ViT)
    base = dict(TINY) if vit else dict(embed_dim=16, depths=[1, 1], num_heads=[2, 2], img_size=8)
    with pytest.raises((ValueError, TypeError), match=named):
        vitrel.create_model(arch, **{**base, **kwargs})


def test_the_layer_refuses_a_negative_prefix_and_names_what_a_kernel_lacks():
    """``Attention(..., num_prefix_tokens=-1)`` built, and its bias was the patches' with the first row and column
    cropped; Shaw's refusals by flex / triton / fold said "has no such table" of nothing named."""
    for build in (
        lambda: Attention(32, 2, pos="rel2d_full", grid=(3, 4), num_prefix_tokens=-1),
        lambda: vitrel.build_pos("rel2d_full", num_heads=2, head_dim=16, grid=(3, 4), num_prefix_tokens=-2),
    ):
        with pytest.raises(ValueError, match="num_prefix_tokens must be >= 0, got -"):
            build()
    with pytest.raises(ValueError, match="attn_impl='fold': shaw2d_full has no bias to fold .its content terms"):
        Attention(32, 2, pos="shaw2d_full", grid=(2, 2), attn_impl="fold")
    with pytest.raises(ValueError, match="attn_impl='flex': shaw2d_full has no offset table to read"):
        Attention(32, 2, pos="shaw2d_full", grid=(2, 2), attn_impl="flex")


@pytest.mark.parametrize("arch", [VIT, SWIN])
def test_num_classes_zero_is_no_head_and_reset_classifier_is_checked(arch):
    base = dict(TINY) if arch == VIT else dict(embed_dim=16, depths=[1, 1], num_heads=[2, 2], img_size=8)
    base.pop("depth", None) if arch == SWIN else None
    m = vitrel.create_model(arch, **{**base, "num_classes": 0})  # timm's headless model stays allowed
    assert isinstance(m.head, torch.nn.Identity) and m(torch.randn(1, 3, 8, 8)).shape == (1, m.num_features)
    with pytest.raises(ValueError, match=r"num_classes must be >= 0 \(0 for no head\), got -1"):
        m.reset_classifier(-1)
    assert m.num_classes == 0 and m.vitrel_cfg["num_classes"] == 0  # left as it was


def test_attention_heads_are_checked():
    with pytest.raises(ValueError, match="num_heads must be >= 1"):
        Attention(16, num_heads=0)
    for kw in ("attn_drop", "proj_drop"):  # (attn_drop=1.5 built a layer whose first forward failed in SDPA)
        with pytest.raises(ValueError, match=rf"{kw} must be a number in \[0, 1\], got 1.5"):
            Attention(16, num_heads=2, **{kw: 1.5})
    Attention(16, num_heads=2, attn_drop=1, proj_drop=0)  # (the bounds are rates)


# ------------------------------------------------------------------------------ item 9: unreadable files
class _RunsCode:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def _bad_checkpoints(tmp_path):
    good = tmp_path / "good.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(64)}}, good)
    (tmp_path / "random.ckpt").write_bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0))
                                           .to(torch.uint8).numpy().tobytes())  # fmt: skip
    (tmp_path / "truncated.ckpt").write_bytes(good.read_bytes()[:300])
    (tmp_path / "text.ckpt").write_text("not a checkpoint\n" * 20)
    torch.save({"x": _RunsCode(str(tmp_path / "ran"))}, tmp_path / "unsafe_zip.ckpt")
    with open(tmp_path / "unsafe_bare.ckpt", "wb") as f:
        pickle.dump({"x": _RunsCode(str(tmp_path / "ran"))}, f)
    return tmp_path


@pytest.mark.parametrize("name", ["random", "truncated", "text"])
def test_a_damaged_file_is_not_called_unsafe(tmp_path, name):
    path = _bad_checkpoints(tmp_path) / f"{name}.ckpt"
    with pytest.raises(CheckpointError) as err:
        vitrel.load_model(path)
    msg = str(err.value)
    assert str(path) in msg and "not a torch checkpoint" in msg, msg
    assert "refused" not in msg and "could run code" not in msg and "weights_only" not in msg, msg


@pytest.mark.parametrize("name", ["unsafe_zip", "unsafe_bare"])
def test_an_unsafe_pickle_is_refused_naming_the_global(tmp_path, name):
    path = _bad_checkpoints(tmp_path) / f"{name}.ckpt"
    with pytest.raises(CheckpointError) as err:
        vitrel.load_model(path)
    msg = str(err.value)
    assert msg.startswith(f"refused to load {path}") and "makedirs" in msg and "could run code" in msg, msg
    assert "weights_only" not in msg, msg
    assert not (tmp_path / "ran").exists()


# ------------------------------------------------------------------------------ item 11: damaged .pt2
class _Double(torch.nn.Module):
    def forward(self, x):
        return 2 * x


@pytest.fixture(scope="module")
def pt2_bytes(tmp_path_factory) -> bytes:
    from vitrel.export import save_program

    path = tmp_path_factory.mktemp("pt2") / "model.pt2"
    save_program(torch.export.export(_Double(), (torch.zeros(1, 3),)), path, {"mean": [0.0]})
    return path.read_bytes()


def test_a_good_pt2_loads(tmp_path, pt2_bytes):
    from vitrel.export import load_program

    (tmp_path / "model.pt2").write_bytes(pt2_bytes)
    ep, data_config = load_program(tmp_path / "model.pt2")
    assert data_config == {"mean": [0.0]} and torch.equal(ep.module()(torch.ones(1, 3)), 2 * torch.ones(1, 3))


@pytest.mark.parametrize(
    "kind, says",
    [("truncated", "truncated or not a torch.export program"), ("random", "truncated or not a torch.export program"),
     ("flipped", "fails the zip CRC check"), ("torch_save", "not a torch.export program")],
)  # fmt: skip
def test_a_damaged_pt2_is_one_clear_error(tmp_path, pt2_bytes, capfd, kind, says):
    from vitrel.inference import load_predictor

    path = tmp_path / f"{kind}.pt2"
    if kind == "truncated":
        path.write_bytes(pt2_bytes[: len(pt2_bytes) // 2])
    elif kind == "random":
        path.write_bytes(bytes(range(256)) * 8)
    elif kind == "flipped":  # bytes changed inside a member: its CRC no longer matches
        mid = len(pt2_bytes) // 3
        path.write_bytes(pt2_bytes[:mid] + bytes(b ^ 0xFF for b in pt2_bytes[mid : mid + 64]) + pt2_bytes[mid + 64 :])
    else:
        torch.save({"w": torch.zeros(2)}, path)
    with pytest.raises(CheckpointError, match=says) as err:
        load_predictor(path)
    assert str(path) in str(err.value)
    assert "Traceback" not in capfd.readouterr().err  # torch.export.load logs one when it fails itself


def test_an_onnx_file_is_refused_naming_onnx_runtime(tmp_path):
    """An ONNX model given where a PyTorch one is read (predict.py, eval.py, vitrel.load_model) is one error naming
    ONNX Runtime, not the unpickler's complaint about foreign bytes. It said the preprocessing was "in the config.json
    beside it", which has no ``resize`` (a memory-loader run's ``tensor``) and is not there when the file is copied
    alone; it names the file's own metadata key, which holds the whole data config (docs/export.md)."""
    from vitrel.export import ONNX_DATA_CONFIG_KEY
    from vitrel.inference import load_predictor
    from vitrel.models.checkpoint import load_model

    path = tmp_path / "model.onnx"
    path.write_bytes(b"\x08\x08\x12\x07pytorch")  # (an ONNX ModelProto's first fields)
    for load in (load_predictor, load_model):
        with pytest.raises(CheckpointError, match="is an ONNX model, which runs in ONNX Runtime") as err:
            load(path)
        assert str(path) in str(err.value)
        assert f"file's own metadata, key '{ONNX_DATA_CONFIG_KEY}'" in str(err.value)
        assert "config.json" not in str(err.value)


def test_predict_py_on_a_truncated_pt2_prints_one_line(tmp_path, pt2_bytes):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    (tmp_path / "model.pt2").write_bytes(pt2_bytes[:1000])
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "a.png").write_bytes(b"")  # (an empty tree is refused before the model is read)
    cmd = [sys.executable, str(root / "predict.py"), f"ckpt_path={tmp_path / 'model.pt2'}",
           f"input={tmp_path / 'images'}", f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 1
    lines = [ln for ln in res.stderr.splitlines() if ln.strip() and "Warning" not in ln]
    assert lines == [
        f"predict.py: cannot read {tmp_path / 'model.pt2'}: truncated or not a torch.export program "
        "(BadZipFile: File is not a zip file)"
    ], res.stderr


# ---- Bad input on the configuration paths (issue 33, "Raw errors or silent nonsense", items 11 to 21): each is
TINY_MODELS = {
    "vitrel_vit_tiny_patch4_32": dict(embed_dim=32, depth=1, num_heads=2),
    "vitrel_swin_tiny_patch2_window4_32": dict(embed_dim=16, depths=[1, 1], num_heads=[2, 2]),
}


# ------------------------------------------------------------------------------------------ item 19
@pytest.mark.parametrize("name", sorted(TINY_MODELS))
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_reset_classifier_builds_the_head_on_the_models_device_and_dtype(name, device):
    """timm's test_model_default_cfgs: after ``model.to(device, dtype=float64)``, ``reset_classifier(0)`` then
    ``reset_classifier(2)`` gives a head of the model's device and dtype."""
    m = vitrel.create_model(name, num_classes=10, **TINY_MODELS[name])
    m.to(device=device, dtype=torch.float64)
    m.reset_classifier(0)
    assert isinstance(m.get_classifier(), torch.nn.Identity)
    m.reset_classifier(2)
    head = m.get_classifier()
    assert head.weight.dtype == head.bias.dtype == torch.float64
    assert head.weight.device.type == head.bias.device.type == device
    if device == "cpu":
        size = m.vitrel_cfg["img_size"]
        out = m(torch.randn(2, 3, *size, dtype=torch.float64))
        assert out.shape == (2, 2) and out.dtype == torch.float64


# ------------------------------------------------------------------------------------------ item 20
def test_swin_features_only_takes_an_image_size_pair():
    """``img_size=(224, 288)`` with ``features_only=True``: the Swin, as the ViT, takes a pair."""
    kw = dict(img_size=(32, 48), features_only=True, embed_dim=16, depths=[1, 1], num_heads=[2, 2])
    m = vitrel.create_model("vitrel_swin_tiny_patch2_window4_32", **kw)
    feats = m(torch.randn(1, 3, 32, 48))
    assert [tuple(f.shape[1:3]) for f in feats] == [(16, 24), (8, 12)]
    assert vitrel.create_model("vitrel_swin_tiny_patch4_window7_224", img_size=(224, 288), features_only=True)
    swin = vitrel.models.SwinTransformer
    assert swin.feature_defaults({"img_size": (224, 288), "patch_size": 4})["pool_size"] == (7, 9)
    assert swin.feature_defaults({"img_size": 224, "patch_size": 4})["pool_size"] == (7, 7)


# ------------------------------------------------------------------------------------------ items 15, 16
def _rope(scaling: dict, name: str = "rope2d_axial"):
    return vitrel.create_model("vitrel_vit_tiny_patch4_32", pos={"name": name, "scaling": scaling}, **TINY_VIT)


TINY_VIT = TINY_MODELS["vitrel_vit_tiny_patch4_32"]


@pytest.mark.parametrize("name", ["rope1d", "rope2d_axial", "rope2d_mixed"])
@pytest.mark.parametrize(
    "key, value, words",
    [
        ("truncate", "false", "scaling.truncate must be true or false, got 'false'"),
        ("truncate", 0, "scaling.truncate must be true or false, got 0"),
        ("beta_fast", "fast", "scaling.beta_fast must be a finite number, got 'fast'"),
        ("beta_slow", "1", "scaling.beta_slow must be a finite number, got '1'"),
        ("beta_fast", True, "scaling.beta_fast must be a finite number, got True"),
        ("factor", "2", "scaling.factor must be a number >= 1, a list of them, auto or grid; got '2'"),
        ("attention_factor", True, "scaling.attention_factor must be a positive number or null, got True"),
    ],
)
def test_rope_scaling_options_are_typed(name, key, value, words):
    """``truncate: "false"`` (a string) was read as true; ``beta_fast: "fast"`` failed in a float conversion naming
    no key: each is refused, naming the scheme, the option and the value."""
    scaling = {"rope_type": "yarn", "factor": 2.0, key: value}
    with pytest.raises(ValueError, match=f"{name}: " + _re(words)):
        _rope(scaling, name)


def test_rope_scaling_truncate_false_changes_the_frequencies():
    from vitrel.pos.rope_scaling import parse_scaling

    assert parse_scaling({"rope_type": "yarn", "factor": 2, "truncate": False}, 2, "rope2d_axial").truncate is False
    assert parse_scaling({"rope_type": "yarn", "factor": 2}, 2, "rope2d_axial").truncate is True


@pytest.mark.parametrize(
    "spec, words",
    [
        ({"name": "rope2d_mixed", "rotate": "false"}, "option rotate must be true or false, got 'false' (str)"),
        ({"name": "rope2d_axial", "base": "ten"}, "option base must be a number, got 'ten' (str)"),
        ({"name": "rel2d_bucket", "num_buckets": 8.5}, "option num_buckets must be an integer, got 8.5 (float)"),
        ({"name": "rope2d_axial", "scaling": "yarn"}, "option scaling must be a mapping or null, got 'yarn' (str)"),
    ],
)
def test_scheme_options_are_typed(spec, words):
    """Every scheme option is checked against its constructor's annotation when the spec is parsed (before any
    model is built), naming the scheme, the option and the value."""
    from vitrel.pos.registry import parse_pos

    with pytest.raises(ValueError, match=f"position scheme '{spec['name']}': " + _re(words)):
        parse_pos(spec)
    assert parse_pos({"name": "rope2d_axial", "base": 10})  # an int is a number


def _re(text: str) -> str:
    import re

    return re.escape(text)


# ------------------------------------------------------------------------------------------ items 17, 18
@pytest.mark.parametrize("key, value", [("topk", 0), ("topk", -1), ("batch_size", 0), ("num_workers", -1)])
def test_predict_refuses_counts_out_of_range_before_loading(tmp_path, key, value):
    """``predict.py topk=0`` wrote a CSV with only a filename column; ``topk=-1`` failed in torch.topk. Both are
    refused from the composed config, before the checkpoint is read (here there is none)."""
    from tests.train_helpers import compose
    from vitrel.train.predict import run_predict

    cfg = compose(tmp_path, [f"ckpt_path={tmp_path / 'absent.ckpt'}", f"input={tmp_path}", f"{key}={value}"], "predict")
    with pytest.raises(
        ValueError, match=_re(f"{key} must be an integer >= {0 if key == 'num_workers' else 1}, got {value}")
    ):
        run_predict(cfg)
    assert not (tmp_path / "predictions.csv").exists()


def test_predict_folder_refuses_topk_zero(tmp_path):
    from vitrel.inference import Predictor, predict_folder

    model = vitrel.create_model("vitrel_vit_tiny_patch4_32", **TINY_VIT).eval()
    pred = Predictor(model, {"input_size": (3, 32, 32), "mean": (0.5,) * 3, "std": (0.5,) * 3}, "memory")
    for k in (0, -1):
        with pytest.raises(ValueError, match=_re(f"topk must be an integer >= 1, got {k}")):
            predict_folder(pred, tmp_path, topk=k)


# ------------------------------------------------------------------------------------------ items 11 to 14
SHORT = ["trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1"]
SHORT += ["trainer.limit_test_batches=1", "logger=none", "callbacks.model_checkpoint=null", "test=false"]


class _NoBatch(Callback):
    """Fails the test when a training batch starts (the error must come before)."""

    def on_train_batch_start(self, *args):
        raise AssertionError("a training batch was made before the error")


def _train(tmp_path, overrides):
    from tests.train_helpers import FAST, compose
    from vitrel.train.run import train

    return train(compose(tmp_path, [*FAST, *SHORT, *overrides]), callbacks=[_NoBatch()])


def test_train_refuses_a_naflex_patch_size_other_than_the_models(tmp_path):
    """``data.patch_size=8`` on a patch-4 model failed at the first step naming neither key nor value."""
    from tests.train_helpers import TINY_VIT

    with pytest.raises(ValueError) as exc:
        _train(tmp_path, ["experiment=fmnist_naflex", *TINY_VIT, "data.patch_size=8"])
    msg = str(exc.value)
    assert "data.patch_size=8 but the model (vitrel_vit_tiny_patch4_32) has patches of 4" in msg, msg
    assert "set data.patch_size=4" in msg
    assert not (tmp_path / "checkpoints").exists()


def test_train_refuses_size_choices_that_are_not_multiples_of_the_patch(tmp_path):
    """``data.size_choices=[28,30]``: one batch trained, then the second failed naming the size, not the key."""
    from tests.train_helpers import TINY_VIT

    with pytest.raises(ValueError) as exc:
        _train(tmp_path, [*TINY_VIT, "data.size_choices=[28,30]"])
    msg = str(exc.value)
    assert "data.size_choices=[28, 30]: 30 is not a positive multiple of the patch size 4" in msg, msg


def test_size_choices_of_a_strict_model_are_refused():
    from types import SimpleNamespace

    from vitrel.train.data_contract import check_data_fits_model

    m = vitrel.create_model("vitrel_vit_tiny_patch4_32", strict_img_size=True, **TINY_VIT)
    dm = SimpleNamespace(packing=None, patch_size=None, size_choices=(32, 36))
    with pytest.raises(ValueError, match=_re("data.size_choices=[32, 36]: the model takes only its img_size (32, 32)")):
        check_data_fits_model(dm, m)
    check_data_fits_model(SimpleNamespace(packing=None, patch_size=None, size_choices=(32,)), m)


def test_a_kernel_that_cannot_train_on_this_device_is_one_line(tmp_path):
    """``train.py +model.attn_impl=flex`` on CPU ended with Hydra's 160-line traceback around the kernel's message."""
    from tests.train_helpers import FAST, TINY_VIT, compose
    from vitrel.train.run import train
    from vitrel.train.user_errors import one_line_errors

    with pytest.raises(SystemExit) as exc, one_line_errors("train.py"):
        train(compose(tmp_path, [*FAST, *SHORT, *TINY_VIT, "+model.attn_impl=flex"]))
    assert str(exc.value).startswith("train.py: KernelDeviceError: attn_impl='flex' cannot train on CPU"), exc.value


@pytest.mark.parametrize(
    ("data", "said"),
    [
        (dict(packing="pack", patch_size=8, size_choices=None), "data.patch_size=8 but the model"),
        (dict(packing=None, patch_size=None, size_choices=(28, 30)), "data.size_choices=[28, 30]: 30 is not"),
    ],
)
def test_data_the_model_cannot_cut_is_one_line(data, said):
    """``train.py experiment=fmnist_naflex data.patch_size=8`` (or ``data.size_choices`` off the patch) ended with a
    traceback through run.py; it is an ``InputSizeError``, one line as ``data.img_size``'s, naming the key to set."""
    from types import SimpleNamespace

    from vitrel.train.data_contract import check_data_fits_model
    from vitrel.train.user_errors import one_line_errors

    m = vitrel.create_model("vitrel_vit_tiny_patch4_32", **TINY_VIT)
    with pytest.raises(SystemExit) as stop, one_line_errors("train.py"):
        check_data_fits_model(SimpleNamespace(**data), m)
    assert str(stop.value).startswith(f"train.py: InputSizeError: {said}"), stop.value


def test_eval_refuses_a_naflex_patch_size_other_than_the_checkpoints(tmp_path, monkeypatch):
    """``eval.py data.patch_size=8`` on a patch-4 NaFlex checkpoint failed inside trainer.test (evaluate.py had the
    right check, but after it): now refused before scoring."""
    import lightning as L

    from tests.train_helpers import compose
    from vitrel.train.evaluate import evaluate

    m = vitrel.create_model("vitrel_vit_tiny_patch4_32", in_chans=1, img_size=28, num_classes=10, **TINY_VIT)
    ckpt = tmp_path / "naflex.ckpt"
    torch.save({"vitrel_cfg": m.vitrel_cfg, "state_dict": {f"model.{k}": v for k, v in m.state_dict().items()}}, ckpt)

    def no_test(*args, **kwargs):
        raise AssertionError("trainer.test ran before the error")

    monkeypatch.setattr(L.Trainer, "test", no_test)
    over = [f"ckpt_path={ckpt}", "data=fashion_mnist_naflex", "data.patch_size=8", "data.num_workers=0"]
    over += ["trainer.accelerator=cpu", "progress_bar=none"]
    with pytest.raises(ValueError, match=_re(f"data.patch_size=8 but {ckpt} has patches of 4")):
        evaluate(compose(tmp_path / "eval", over, config_name="eval"))


def test_fmnist_naflex_experiment_trains_a_swin(tmp_path):
    """``experiment=fmnist_naflex model=<a Swin>``: TypeError unexpected keyword 'token_drop' (the experiment set
    token_drop: 0.0, a ViT argument); the Swin now trains. token_drop given to a Swin is refused naming it."""
    from tests.train_helpers import FAST, TINY_SWIN, compose
    from vitrel.train.run import train

    seen = []

    class Batches(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(isinstance(batch[0], dict))

    cfg = compose(tmp_path, [*FAST, *SHORT, "experiment=fmnist_naflex", *TINY_SWIN, "+model.patch_size=4"])
    assert "token_drop" not in cfg.model
    metrics = train(cfg, callbacks=[Batches()])
    assert seen == [True, True] and 0.0 <= metrics["val/acc1"] <= 1.0
    for name in ("vitrel_swin_tiny_patch2_window4_32", "vitrel_vit_video_tiny_patch4_32"):
        with pytest.raises(TypeError, match=r"token_drop=0.25 \(NaViT token dropping is the image ViT's"):
            vitrel.create_model(name, token_drop=0.25)


# ------------------------------------------------------------------------------------------ item 21
def test_run_lock_is_reentrant_within_a_process(tmp_path):
    """The lock TakeRunFolder takes before Hydra writes is held again by train() (same process), and goes with its
    last holder; another process's live lock is still refused."""
    from omegaconf import OmegaConf

    from vitrel.train.hydra_callbacks import TakeRunFolder
    from vitrel.train.rundir import LOCK_NAME, RunFolderBusy, RunLock

    cb = TakeRunFolder()
    cb.on_run_start(OmegaConf.create({"hydra": {"run": {"dir": str(tmp_path / "run")}, "output_subdir": ".hydra"}}))
    lock = tmp_path / "run" / LOCK_NAME
    assert lock.exists()
    with RunLock(tmp_path / "run") as inner:
        assert inner.owner == RunLock(tmp_path / "run").read()
    assert lock.exists(), "train()'s release removed the lock its caller still holds"
    cb.on_run_end(OmegaConf.create({}))
    assert not lock.exists()

    # a folder busy when the run starts: Hydra is told to write no record there, and train() refuses the run
    other = tmp_path / "other"
    other.mkdir()
    (other / LOCK_NAME).write_text('{"pid": 1, "host": "elsewhere", "started": "2026-01-01T00:00:00"}')
    config = OmegaConf.create({"hydra": {"run": {"dir": str(other)}, "output_subdir": ".hydra"}})
    TakeRunFolder().on_run_start(config)
    assert config.hydra.output_subdir is None
    with pytest.raises(RunFolderBusy, match="pid 1 on host elsewhere"):
        RunLock(other).acquire()
    # that run ended before train() took the folder: train() writes the record Hydra was kept from writing
    from tests.train_helpers import compose
    from vitrel.train.hydra_callbacks import write_held_back_record

    (other / LOCK_NAME).unlink()
    cfg = compose(other, ["seed=3"])
    write_held_back_record(other, cfg)
    assert OmegaConf.load(other / ".hydra" / "config.yaml").seed == 3
    assert "seed=3" in OmegaConf.load(other / ".hydra" / "overrides.yaml")
    assert (other / ".hydra" / "hydra.yaml").exists()


# A second ``train.py`` in a busy run folder keeps the running run's Hydra record: checked beside the other refusals
# of a busy folder, on the same hanging run, in tests/train/test_resume_safety.py
# (test_second_run_in_a_busy_folder_is_refused_and_a_stale_lock_is_taken_over).


def test_sweep_summary_is_written_as_each_job_ends(tmp_path):
    """``SweepSummary`` writes the summary as each job of a sweep ends (Hydra's sweeper raises after a failed job and
    never ends the sweep): a failed job (a Hydra record, no ``metrics.json``) shows as failed beside a finished one;
    a single run writes none; the sweep's end prints it."""
    import json

    from hydra.types import RunMode
    from omegaconf import OmegaConf

    from vitrel.train.hydra_callbacks import SweepSummary

    sweep = tmp_path / "sweep"
    (sweep / "0").mkdir(parents=True)
    (sweep / "0" / "metrics.json").write_text(
        json.dumps({"overrides": ["+model.attn_impl=sdpa"], "status": "finished", "metrics": {"test/acc1": 0.5}})
    )
    (sweep / "1" / ".hydra").mkdir(parents=True)
    (sweep / "1" / ".hydra" / "overrides.yaml").write_text("- +model.attn_impl=flex\n")
    cb = SweepSummary()
    cb.on_job_end(OmegaConf.create({"hydra": {"mode": RunMode.RUN, "sweep": {"dir": str(sweep)}}}))
    assert not (sweep / "summary.md").exists()
    cb.on_job_end(OmegaConf.create({"hydra": {"mode": RunMode.MULTIRUN, "sweep": {"dir": str(sweep)}}}))
    md = (sweep / "summary.md").read_text()
    assert "Sweep summary (2 jobs" in md and "finished" in md and "failed (no metrics.json)" in md, md
    rows = (sweep / "summary.csv").read_text().splitlines()
    assert len(rows) == 3 and rows[1].startswith("0,+model.attn_impl=sdpa,0.5") and "failed" in rows[2], rows
    files = sorted(p.name for p in sweep.iterdir())
    assert files == ["0", "1", "summary.csv", "summary.md", "summary.png"]  # (no part files left)
