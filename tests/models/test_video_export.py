"""``python -m vitrel.export CKPT OUT --pt2 --onnx`` for video models: a checkpoint written by train.py
(``experiment=video``, the video ViT) and a Video Swin's weights, through the command in-process; the ``.pt2``
program and the ONNX model against the eager model at the traced clip and at other frame counts and frame sizes;
the data config in the program; predict.py refusing the program; the refusals, before anything is written."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import timm
import torch
from omegaconf import OmegaConf

import vitrel
from tests.weights import lively
from vitrel.export import PT2_NAME, best_dynamic, check_exportable, load_program, main
from vitrel.models.checkpoint import save_pretrained

#: the command writes ONNX where its packages are installed (else --onnx is refused), ONNX Runtime checks it
ONNX = all(importlib.util.find_spec(m) is not None for m in ("onnx", "onnxscript"))
pytestmark = pytest.mark.usefixtures("one_torchlib_registry")  # (tests/conftest.py: its exports)


def exported(ckpt: Path, out: Path, *args: str) -> Path:
    """``python -m vitrel.export ckpt out --pt2 [--onnx] args`` in-process; it succeeds."""
    assert main([str(ckpt), str(out), "--pt2", *(["--onnx"] if ONNX else []), *args]) == 0
    return out


def assert_programs_match(model: torch.nn.Module, out: Path, shapes: list[tuple[int, ...]]) -> None:
    """The ``.pt2`` program and (where ONNX Runtime is installed) the ONNX model in ``out`` equal ``model`` (eager) on
    random clips of each shape."""
    ep, _ = load_program(out / PT2_NAME)
    sess = None
    if ONNX and importlib.util.find_spec("onnxruntime") is not None:
        import onnxruntime

        sess = onnxruntime.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
        assert [i.name for i in sess.get_inputs()] == ["clips"]
    g = torch.Generator().manual_seed(2)
    for shape in shapes:
        x = torch.randn(*shape, generator=g)
        with torch.no_grad():
            ref = model(x)
            torch.testing.assert_close(ep.module()(x), ref, rtol=1e-5, atol=1e-5)
        if sess is not None:
            (onnx_out,) = sess.run(None, {"clips": x.numpy()})
            torch.testing.assert_close(torch.from_numpy(onnx_out), ref, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------- a train.py checkpoint (video ViT)
@pytest.fixture(scope="module")
def trained_export(video_sweep, tmp_path_factory) -> Path:
    """The export folder of the tiny ``experiment=video`` run's ``last.ckpt`` (8 frames of 32 x 32, tubelet 1,
    patch 16)."""
    return exported(video_sweep / "checkpoints" / "last.ckpt", tmp_path_factory.mktemp("video_export") / "out")


def test_trained_video_model_exports_one_program_for_every_clip(video_sweep, trained_export):
    """The program (and ONNX model) of a train.py checkpoint: the traced clip, another batch, fewer and more frames,
    other (non-square) frame sizes; the program carries the run's data config, clip length included."""
    model = vitrel.load_model(video_sweep / "checkpoints" / "last.ckpt").eval()
    assert best_dynamic(model) == "hw"
    assert_programs_match(model, trained_export, [(2, 1, 8, 32, 32), (3, 1, 3, 48, 16), (1, 1, 12, 16, 32)])
    _, data_config = load_program(trained_export / PT2_NAME)
    assert data_config["num_frames"] == 8 and data_config["input_size"] == [1, 32, 32]
    loaded = vitrel.load_model(trained_export).eval()
    assert data_config["mean"] == pytest.approx(loaded.pretrained_cfg["mean"])
    # timm's own route to the folder (its config.json's pretrained_cfg holds timm's fields only)
    via_timm = timm.create_model(f"local-dir:{trained_export}", pretrained=True).eval()
    x = torch.randn(2, 1, 8, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(via_timm(x), loaded(x), rtol=0, atol=0)


def test_timms_save_for_hf_of_a_trained_video_model_reloads_through_timm(video_sweep, tmp_path):
    """``timm.models.save_for_hf`` of the run's model writes its clip sampling (``num_frames``, ``frame_stride``,
    ``clips_per_video`` ...: not timm's fields) into ``config.json``'s ``pretrained_cfg``; timm's ``local-dir:`` route
    raised ``TypeError`` on them. It now loads the same function with the same clip sampling."""
    from timm.models import save_for_hf

    from vitrel.models.data_config import CLIP_FIELDS

    model = vitrel.load_model(video_sweep / "checkpoints" / "last.ckpt").eval()
    keys = ("num_frames", *CLIP_FIELDS, "input_size", "mean")
    assert {"num_frames", "frame_stride", "clips_per_video"} <= set(model.pretrained_cfg)
    save_for_hf(model, tmp_path / "hf", safe_serialization=True)
    back = timm.create_model(f"local-dir:{tmp_path / 'hf'}", pretrained=True).eval()
    assert {k: back.pretrained_cfg.get(k) for k in keys} == {k: model.pretrained_cfg.get(k) for k in keys}
    x = torch.randn(2, 1, 8, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(back(x), model(x), rtol=0, atol=0)


def test_predict_on_images_refuses_a_video_program(trained_export, tmp_path):
    """A video model's ``.pt2`` carries its clip length: predict.py given a folder of images for it is one error naming
    what the model takes, before anything is written (videos: tests/train/test_video_predict.py)."""
    from PIL import Image

    from vitrel.train.predict import run_predict

    (tmp_path / "images").mkdir()
    Image.new("L", (32, 32)).save(tmp_path / "images" / "a.png")
    out = tmp_path / "predictions.csv"
    cfg = OmegaConf.create(dict(ckpt_path=str(trained_export / PT2_NAME), input=str(tmp_path / "images"),
                                results_file=str(out), device="cpu"))  # fmt: skip
    with pytest.raises(ValueError, match=r"holds images .* is a video model: it takes clips of 8 frames"):
        run_predict(cfg)
    assert not out.exists()


# ---------------------------------------------------------------------------- the Video Swin
def video_swin() -> torch.nn.Module:
    """A one-stage Video Swin (a plain and a shifted block; window 4 x 4 x 4, tubelets 1 x 2 x 2; the space-only
    patch merging of later stages is the 2-D Swin's, exported at symbolic sides in test_export.py) built for 4 frames
    of 16 x 16, with :func:`tests.weights.lively` weights (under timm's init a wrong window, shift or mask would
    hardly show in the logits)."""
    torch.manual_seed(0)
    m = vitrel.create_model(
        "vitrel_swin3d_tiny_patch122_window444_32", embed_dim=16, depths=(2,), num_heads=(2,), img_size=16,
        num_frames=4, num_classes=3,
    )  # fmt: skip
    return lively(m).eval()


def test_video_swin_exports_one_program_for_every_clip(tmp_path, capsys):
    """Symbolic batch, frames, height and width: at the traced clip (grid 4 x 8 x 8: windows 4 x 4 x 4, the shifted
    block shifted in space only) and at clips whose grid is padded to whole windows and shifted on all three axes
    (6 x 6 x 10), and whose window shrinks in frames and height, padded and shifted in width (2 x 3 x 5)."""
    m = video_swin()
    assert best_dynamic(m) == "hw"
    out = exported(save_pretrained(m, tmp_path / "weights"), tmp_path / "out")
    said = capsys.readouterr().out
    assert "note:" not in said
    # progress before the long steps (a ViT-B's trace and conversion take ~30 s), then what was written
    steps = [
        "tracing the model with torch.export (dynamic=hw, frames too) ...",  # (a clip program: frames are dynamic too)
        "converting the program to ONNX (opset 18) ...",
    ]
    lines = [ln.split(" ")[0] for ln in said.splitlines()]
    assert said.splitlines()[: 1 + ONNX] == steps[: 1 + ONNX] and lines[1 + ONNX :] == ["wrote"] * (2 + ONNX)
    assert_programs_match(m, out, [(2, 1, 4, 16, 16), (3, 1, 6, 12, 20), (1, 1, 2, 6, 10)])
    assert load_program(out / PT2_NAME)[1]["num_frames"] == 4


def test_video_swin_with_an_extent_scheme_gets_a_batch_program(monkeypatch):
    """A Video Swin whose scheme depends on the window's extent (none of the 3-D schemes does today: one is made so
    here) gets no every-size program: ``best_dynamic`` picks ``"batch"``, ``"hw"`` is refused."""
    m = video_swin()
    monkeypatch.setattr(vitrel.pos.get_pos_class("rel3d_full"), "depends_on_extent", True)
    assert best_dynamic(m) == "batch"
    with pytest.raises(ValueError, match="window's extent"):
        check_exportable(m, "hw")


# ---------------------------------------------------------------------------- refusals, before anything is written
def _video_vit_weights(tmp_path: Path, **kw) -> Path:
    m = vitrel.create_model("vitrel_vit_video_tiny_patch16_224", embed_dim=16, depth=1, num_heads=2, img_size=32,
                            num_frames=4, **kw)  # fmt: skip
    return save_pretrained(m, tmp_path / "weights")


@pytest.mark.parametrize(
    ("built", "args", "said"),
    [
        (dict(attn_impl="flex"), ["--pt2"], "cannot be saved as .pt2"),
        (dict(attn_impl="triton", pos="rope3d_axial"), ["--onnx"], "ONNX has no operator"),
        ({}, ["--pt2", "--num-frames", "3"], "num_frames=3 is not a positive multiple of the tubelet size 2"),
    ],
)
def test_video_export_refuses_before_writing(tmp_path, capsys, built, args, said):
    out = tmp_path / "out"
    assert main([str(_video_vit_weights(tmp_path, **built)), str(out), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and said in err and "Traceback" not in err
    assert not out.exists()


def test_num_frames_is_refused_for_an_image_model(tmp_path, capsys):
    m = vitrel.create_model("vitrel_vit_tiny_patch4_32", embed_dim=16, depth=1, num_heads=2)
    out = tmp_path / "out"
    assert main([str(save_pretrained(m, tmp_path / "weights")), str(out), "--pt2", "--num-frames", "4"]) == 2
    assert "is an image model: num_frames is for video models" in capsys.readouterr().err and not out.exists()


def test_a_program_of_one_clip_length_names_it(tmp_path, capsys):
    """A scheme that compares the grid with the built one (``extend: interpolate``) exports a program of one clip
    length: the command says which, and the program as ``predict.py`` loads it refuses another clip length, or frame
    size, in one line naming both and the export that takes it (not torch's ``Guard failed: x.size()[2] == 4``)."""
    from vitrel.inference import load_predictor

    weights = _video_vit_weights(tmp_path, pos={"name": "rel3d_full", "extend": "interpolate"})
    assert main([str(weights), str(tmp_path / "out"), "--pt2"]) == 0
    said = capsys.readouterr().out
    assert "cannot serve every clip size in one program (this one: 4 frames; --num-frames)" in said, said
    program = load_predictor(tmp_path / "out" / PT2_NAME).model
    assert program(torch.randn(2, 3, 4, 32, 32)).shape == (2, 1000)
    with pytest.raises(ValueError, match=r"takes clips of 4 frames .*, got 8: .* export again with --num-frames 8"):
        program(torch.randn(1, 3, 8, 32, 32))
    with pytest.raises(ValueError, match=r"takes 32x32 frames \(a program of one frame size\), got 48x48"):
        program(torch.randn(1, 3, 4, 48, 48))


def test_a_program_of_one_clip_length_records_it(tmp_path):
    """``--num-frames 8 --img-size 48`` for a model built for 4 frames of 32 px whose scheme compares the grid with the
    built one: a program of 8-frame clips of 48 px only, whose data config said the model's 4 frames of 32 px, which
    the program refused. Now it records 8 and 48 (predict.py samples those); a program of every clip (``"hw"``)
    keeps the model's as the default."""
    from vitrel.inference import load_predictor

    one = _video_vit_weights(tmp_path / "one", pos={"name": "rel3d_full", "extend": "interpolate"})
    assert main([str(one), str(tmp_path / "one_out"), "--pt2", "--num-frames", "8", "--img-size", "48"]) == 0
    cfg = load_program(tmp_path / "one_out" / PT2_NAME)[1]
    assert (cfg["num_frames"], cfg["input_size"]) == (8, [3, 48, 48])
    p = load_predictor(tmp_path / "one_out" / PT2_NAME)
    assert p.data_config == cfg
    assert p.model(torch.randn(2, 3, cfg["num_frames"], *cfg["input_size"][1:])).shape == (2, 1000)
    every = _video_vit_weights(tmp_path / "every")
    assert main([str(every), str(tmp_path / "every_out"), "--pt2", "--num-frames", "8", "--img-size", "48"]) == 0
    cfg = load_program(tmp_path / "every_out" / PT2_NAME)[1]
    assert (cfg["num_frames"], cfg["input_size"]) == (4, [3, 32, 32])


def test_a_program_of_every_clip_length_takes_a_num_frames_override(tmp_path):
    """``predict.py ckpt_path=<model.pt2> +model_overrides.num_frames=8`` was refused for every program ("fixed when
    it was exported"), though a program exported for every clip length takes 8 frames. Now the predictor samples
    clips of 8 frames from it (its data config), and the program scores them as the eager model does; a frame count
    the program does not take, and a program of one clip length, are refused naming the frame counts it takes."""
    from vitrel.inference import load_predictor

    weights = _video_vit_weights(tmp_path)
    assert main([str(weights), str(tmp_path / "out"), "--pt2"]) == 0
    p = load_predictor(tmp_path / "out" / PT2_NAME, model_overrides={"num_frames": 8})
    assert p.data_config["num_frames"] == 8
    x = torch.randn(2, 3, 8, 32, 32)
    eager = vitrel.load_model(weights).eval()
    with torch.no_grad():
        torch.testing.assert_close(p.model(x), eager(x), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"takes clips of 2\.\.1024 in steps of 2 frames, not num_frames=3"):
        load_predictor(tmp_path / "out" / PT2_NAME, model_overrides={"num_frames": 3})
    with pytest.raises(ValueError, match=r"torch.export program, fixed .* \['attn_impl'\]"):
        load_predictor(tmp_path / "out" / PT2_NAME, model_overrides={"num_frames": 8, "attn_impl": "sdpa"})
    one = _video_vit_weights(tmp_path / "one", pos={"name": "rel3d_full", "extend": "interpolate"})
    assert main([str(one), str(tmp_path / "one_out"), "--pt2"]) == 0
    assert (
        load_predictor(tmp_path / "one_out" / PT2_NAME, model_overrides={"num_frames": 4}).data_config["num_frames"]
        == 4
    )
    with pytest.raises(
        ValueError, match=r"takes clips of 4 frames, not num_frames=8 \(model_overrides\): .*--num-frames 8"
    ):
        load_predictor(tmp_path / "one_out" / PT2_NAME, model_overrides={"num_frames": 8})
