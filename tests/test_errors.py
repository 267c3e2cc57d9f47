"""Clear errors for bad inputs (issue 20): integer weights, impossible model sizes, damaged or unsafe
checkpoint files, damaged ``.pt2`` programs. Each message names what is wrong (the key, the argument,
the file) and none suggests ``weights_only=False``."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
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
    ],
)
def test_impossible_sizes_name_the_argument(arch, kwargs, named):
    base = dict(TINY) if arch == VIT else dict(embed_dim=16, depths=[1, 1], num_heads=[2, 2], img_size=8)
    base.pop("depth", None) if arch == SWIN else None
    with pytest.raises((ValueError, TypeError), match=named):
        vitrel.create_model(arch, **{**base, **kwargs})


def test_attention_heads_are_checked():
    with pytest.raises(ValueError, match="num_heads must be >= 1"):
        Attention(16, num_heads=0)


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


def test_predict_py_on_a_truncated_pt2_prints_one_line(tmp_path, pt2_bytes):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    (tmp_path / "model.pt2").write_bytes(pt2_bytes[:1000])
    (tmp_path / "images").mkdir()
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
