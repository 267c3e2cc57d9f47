"""predict.py on a video checkpoint written by train.py: the clip sampling stored with it, the CSV's probabilities
against clips decoded and transformed by hand (1 and 2 clips per video), skipped files, the errors."""

from __future__ import annotations

import csv
import math
import shutil
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import vitrel
from tests.data.test_video import write_video
from tests.train_helpers import FAST, compose, run_script_forked
from vitrel.inference import NoVideosError, load_predictor, predict_folder
from vitrel.models.checkpoint import checkpoint_has_ema, checkpoint_scores_ema
from vitrel.train.predict import run_predict
from vitrel.train.run import train

av = pytest.importorskip("av", reason="PyAV not installed: pip install -e '.[video]'")

CLASSES = ("archery", "bowling")
# data=video_folder with the video ViT, tiny: 4 frames of 16 x 16, 4 training steps at a high learning rate
TINY = ["data=video_folder", "data.num_frames=4", "data.img_size=16", "data.crop_pct=0.875"]
TINY += ["data.interpolation=bicubic", "data.pin_memory=false", "model=vitrel_vit_video_tiny_patch4_32"]
TINY += ["pos=rel3d_factored", "+model.embed_dim=16", "+model.depth=1", "+model.num_heads=2", *FAST]
TINY += ["data.batch_size=2", "trainer.max_epochs=2", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1"]
TINY += ["module.optimizer.lr=0.01", "module.scheduler.warmup_epochs=0", "logger=none", "test=false"]


def class_videos(root: Path, frames: Callable[[int, int], int]) -> Path:
    """``root/{train,val}/<class>/<class>_<k>.avi``, ``k`` 0 and 1: lossless 30 x 40 clips of ``frames(c, k)`` frames
    (``c``: the class index), each frame its own brightness."""
    for split in ("train", "val"):
        for c, cls in enumerate(CLASSES):
            for k in range(2):
                write_video(root / split / cls / f"{cls}_{k}.avi", frames(c, k), "ffv1", "yuv420p", hw=(30, 40))
    return root


@pytest.fixture(scope="module")
def videos(tmp_path_factory) -> Path:
    """Class folders of clips of 6 to 16 frames (:func:`class_videos`)."""
    return class_videos(tmp_path_factory.mktemp("videos"), lambda c, k: 6 + 8 * k + 2 * c)


@pytest.fixture(scope="module")
def runs(videos, tmp_path_factory) -> dict[int, Path]:
    """``last.ckpt`` of ``python train.py data=video_folder ...`` (in-process) with 1 clip per video (stride 3) and
    with 2 (stride 2, EMA weights kept)."""
    out = {}
    for clips, stride, ema in ((1, 3, []), (2, 2, ["module/ema=default"])):
        run = tmp_path_factory.mktemp(f"run{clips}")
        over = [*TINY, f"data.root={videos}", f"data.stride={stride}", f"data.clips_per_video={clips}"]
        over += ema
        train(compose(run, over))
        out[clips] = run / "checkpoints" / "last.ckpt"
    return out


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _predict(ckpt: Path, input_dir: Path, out: Path, *extra: str) -> dict:
    args = [f"ckpt_path={ckpt}", f"input={input_dir}", f"results_file={out}", "progress_bar=false", *extra]
    return run_predict(compose(out.parent / "run", args, config_name="predict"))


def reference_probs(
    ckpt: Path,
    path: Path,
    frames: int,
    stride: int,
    clips: int,
    use_ema: bool | None = None,
    crops: int = 1,
    **overrides,
) -> torch.Tensor:
    """softmax(model(clip)) averaged over the clips, by hand in float64: every frame decoded with PyAV, the clips'
    frames picked by vitrel/data/video/clips.py's equations, each frame resized (shorter side to floor(16 / 0.875)),
    centre-cropped to 16 x 16 (``crops=3``: the 18 x 24 frames' columns 0, 4 and 8 onwards, rows 1 onwards) and
    normalised with the training data's ImageNet statistics; the model's EMA weights when the checkpoint has them
    (``use_ema``), rebuilt with ``overrides``."""
    import torchvision.transforms.functional as TF
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

    with av.open(str(path)) as container:
        decoded = [torch.from_numpy(f.to_ndarray(format="rgb24")).permute(2, 0, 1) for f in container.decode(video=0)]
    n = len(decoded)
    delta = max(n - ((frames - 1) * stride + 1), 0)
    starts = [delta // 2] if clips == 1 else [k * delta // (clips - 1) for k in range(clips)]
    mean = torch.tensor(IMAGENET_DEFAULT_MEAN, dtype=torch.float64)[:, None, None]
    std = torch.tensor(IMAGENET_DEFAULT_STD, dtype=torch.float64)[:, None, None]
    ema = checkpoint_scores_ema(ckpt) if use_ema is None else use_ema  # (predict.py's ema=auto)
    model = vitrel.load_model(ckpt, use_ema=ema, **overrides).double().eval()
    probs = []
    for s in starts:
        picked = [decoded[min(s + t * stride, n - 1)] for t in range(frames)]
        resized = [TF.resize(f, [math.floor(16 / 0.875)], TF.InterpolationMode.BICUBIC, antialias=True) for f in picked]
        for view in [[TF.center_crop(f, [16, 16]) for f in resized]] if crops == 1 else [
            [f[:, 1:17, left : left + 16] for f in resized] for left in (0, 4, 8)
        ]:  # fmt: skip
            clip = torch.stack([(f.double() / 255 - mean) / std for f in view], 1)
            with torch.no_grad():
                probs.append(model(clip[None]).softmax(-1)[0])
    return torch.stack(probs).mean(0)


def test_train_py_stores_the_evaluation_clips(runs):
    for clips, stride in ((1, 3), (2, 2)):
        dc = torch.load(runs[clips], weights_only=True)["hyper_parameters"]["data_config"]
        assert (dc["num_frames"], dc["frame_stride"], dc["clips_per_video"]) == (4, stride, clips)
        assert dc["input_size"] == [3, 16, 16] and dc["class_names"] == list(CLASSES)
        pcfg = vitrel.load_model(runs[clips]).pretrained_cfg  # where load_model puts the data config
        assert (pcfg["frame_stride"], pcfg["clips_per_video"]) == (stride, clips)


@pytest.mark.parametrize("clips", [1, 2])
def test_predict_py_equals_softmax_of_clips_decoded_by_hand(runs, videos, tmp_path, clips):
    """predict.py's configuration and run (in-process) on a tree of class folders: each video's probabilities are
    the mean over its stored evaluation clips of softmax(model(clip)), clips made by hand (reference_probs)."""
    ckpt, stride = runs[clips], {1: 3, 2: 2}[clips]
    out = tmp_path / "pred.csv"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = _predict(ckpt, videos / "val", out, "topk=2", "batch_size=3")
    assert not [w for w in caught if "stores no" in str(w.message)]
    assert (summary["videos"], summary["found"], summary["skipped"]) == (4, 4, 0)
    rows = _rows(out)
    names = [f"{c}/{c}_{k}.avi" for c in CLASSES for k in range(2)]
    assert [r["filename"] for r in rows] == names
    for r in rows:
        want = reference_probs(ckpt, videos / "val" / r["filename"], 4, stride, clips)
        top_p, top_i = want.topk(2)
        assert [int(r["index_0"]), int(r["index_1"])] == top_i.tolist()
        got = torch.tensor([float(r["prob_0"]), float(r["prob_1"])], dtype=torch.float64)
        torch.testing.assert_close(got, top_p, rtol=0, atol=1e-5)
        assert [r["label_0"], r["label_1"]] == [CLASSES[i] for i in top_i]  # the stored class names


def test_predict_py_scores_the_spatial_crops_the_run_stored(runs, videos, tmp_path):
    """A run tested with ``data.spatial_crops=3`` (its stored data config): predict.py's probabilities are the mean of
    softmax over each video's 2 clips x 3 crops, by hand; without the crops (the centre one) they differ."""
    ckpt = torch.load(runs[2], weights_only=True)
    ckpt["hyper_parameters"]["data_config"]["spatial_crops"] = 3
    torch.save(ckpt, path := tmp_path / "crops.ckpt")
    res = predict_folder(load_predictor(path), videos / "val", topk=2, progress=False)
    for r in res.rows[::2]:  # (2 of the 4 videos)
        want = reference_probs(path, videos / "val" / r["filename"], 4, 2, 2, crops=3)
        assert [r["index_0"], r["index_1"]] == want.topk(2).indices.tolist()
        got = torch.tensor([r["prob_0"], r["prob_1"]], dtype=torch.float64)
        torch.testing.assert_close(got, want.topk(2).values, rtol=0, atol=1e-5)
        centre = reference_probs(path, videos / "val" / r["filename"], 4, 2, 2)
        assert (want - centre).abs().max() > 3e-5  # (3x the tolerance above: the crops are what is compared)


def test_old_checkpoint_warns_once_and_labels_with_indices(runs, videos, tmp_path):
    """A video checkpoint without the clip sampling (written before vitrel stored it) nor class names: one warning
    naming data=video_folder's defaults (stride 4, one clip), the probabilities of those clips, the class indices as
    labels (the input's class folders are not taken as names: their order need not be the trained one)."""
    old = torch.load(runs[2], weights_only=True)
    for key in ("frame_stride", "clips_per_video", "class_names"):
        del old["hyper_parameters"]["data_config"][key]
    path = tmp_path / "old.ckpt"
    torch.save(old, path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = predict_folder(load_predictor(path), videos / "val", topk=1, progress=False)
    said = [str(w.message) for w in caught if "stores no clip sampling" in str(w.message)]
    assert len(said) == 1 and "frame_stride 4, clips_per_video 1" in said[0], said
    for r in res.rows:
        want = reference_probs(path, videos / "val" / r["filename"], 4, 4, 1)
        assert r["index"] == int(want.argmax()) and abs(r["prob"] - float(want.max())) < 1e-5
        assert r["label"] == str(r["index"])


def test_predict_script_on_a_folder_of_videos_skips_what_does_not_decode(runs, videos, tmp_path):
    """``python predict.py`` (the one subprocess): a flat folder of .avi files, a damaged .mp4 (skipped, counted,
    named) and a text file (not a video: ignored)."""
    flat = tmp_path / "clips"
    flat.mkdir()
    for f in sorted((videos / "val").rglob("*.avi"))[:3]:
        shutil.copy(f, flat / f.name)
    (flat / "broken.mp4").write_bytes(b"not a video" * 50)
    (flat / "notes.txt").write_text("not a video")
    out = tmp_path / "pred.csv"
    args = [f"ckpt_path={runs[2]}", f"input={flat}", f"results_file={out}", "topk=1", f"hydra.run.dir={tmp_path}"]
    r = run_script_forked("predict.py", args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "predicted 3 of 4 video(s), skipped 1 unreadable file(s)" in r.stdout
    assert "skipped broken.mp4: cannot read video" in r.stdout and "broken.mp4" not in r.stderr  # (one logged line)
    rows = _rows(out)
    assert [row["filename"] for row in rows] == ["archery_0.avi", "archery_1.avi", "bowling_0.avi"]
    assert all(row["label"] in CLASSES for row in rows)


def test_wrong_kind_of_folder_is_one_error_before_anything_is_written(runs, videos, tmp_path):
    """Images for a video model, videos for an image model, a folder of neither: one error each, no CSV."""
    from PIL import Image

    from vitrel.models.checkpoint import save_pretrained

    images, empty = tmp_path / "images", tmp_path / "empty"
    images.mkdir(), empty.mkdir()
    Image.new("RGB", (16, 16)).save(images / "a.png")
    (empty / "notes.txt").write_text("nothing")
    image_model = tmp_path / "image_model"
    save_pretrained(vitrel.create_model("vitrel_vit_tiny_patch4_32", embed_dim=16, depth=1, num_heads=2), image_model)
    out = tmp_path / "pred.csv"
    with pytest.raises(ValueError, match=r"holds images .* is a video model: it takes clips of 4 frames from video"):
        _predict(runs[1], images, out)
    with pytest.raises(ValueError, match=r"holds videos .* is an image model: it takes image files"):
        _predict(image_model, videos / "val", out)
    with pytest.raises(NoVideosError, match=r"no videos in .*\.mp4, \.avi"):
        predict_folder(load_predictor(runs[1]), empty, progress=False)
    with pytest.raises(FileNotFoundError, match=r"no images or videos in .*\.png, .*\.mp4, \.avi"):
        _predict(runs[1], empty, out)  # (predict.py: before the model loads)
    for images_only in ("seq_len=64", "apply_exif_orientation=true"):
        with pytest.raises(ValueError, match="seq_len / max_tokens / apply_exif_orientation are for images"):
            _predict(runs[1], videos / "val", out, images_only)
    with pytest.raises(ValueError, match=r"a.png is an image and .* is a video model: it takes clips of 4 frames"):
        _predict(runs[1], images / "a.png", out)  # (one file of the other kind)
    assert not out.exists()


def test_one_video_file_is_its_row_of_the_folder(runs, videos):
    """``input=<one video>``: its row of the folder's, named by its file name (was: "input must be a folder")."""
    p = load_predictor(runs[2])
    folder = predict_folder(p, videos / "val", topk=2, progress=False).rows
    one = predict_folder(p, videos / "val" / "bowling" / "bowling_1.avi", topk=2, progress=False).rows
    assert one == [{**r, "filename": "bowling_1.avi"} for r in folder if r["filename"] == "bowling/bowling_1.avi"]


def test_without_pyav_a_video_model_is_one_error_naming_pip_install(runs, videos, monkeypatch):
    p = load_predictor(runs[1])
    monkeypatch.setitem(sys.modules, "av", None)  # (import av fails, as without PyAV)
    with pytest.raises(ImportError, match=r"decodes videos with PyAV: pip install av"):
        predict_folder(p, videos / "val", progress=False)


def test_ema_and_model_overrides_as_for_images(runs, videos, tmp_path):
    """The run with 2 clips kept EMA weights: ``ema=false`` scores the trained weights instead (another CSV);
    ``+model_overrides.num_frames=8`` rebuilds the model for clips of 8 frames (learned tables resized on load, as
    eval.py's data.num_frames) and predict.py samples clips of 8."""
    ckpt = runs[2]
    assert checkpoint_has_ema(ckpt)
    _predict(ckpt, videos / "val", tmp_path / "ema.csv")
    _predict(ckpt, videos / "val", tmp_path / "raw.csv", "ema=false")
    _predict(ckpt, videos / "val", tmp_path / "t8.csv", "+model_overrides.num_frames=8")
    ema, raw, t8 = (_rows(tmp_path / f"{name}.csv") for name in ("ema", "raw", "t8"))
    for r_ema, r_raw, r_t8 in zip(ema, raw, t8, strict=True):
        path = videos / "val" / r_ema["filename"]
        for r, want in (
            (r_ema, reference_probs(ckpt, path, 4, 2, 2, use_ema=True)),
            (r_raw, reference_probs(ckpt, path, 4, 2, 2, use_ema=False)),
            (r_t8, reference_probs(ckpt, path, 8, 2, 2, use_ema=True, num_frames=8)),
        ):
            assert int(r["index_0"]) == int(want.argmax()) and abs(float(r["prob_0"]) - float(want.max())) < 1e-5
    assert [r["prob_0"] for r in ema] != [r["prob_0"] for r in raw]  # (the EMA weights are other weights)


def test_an_export_folder_and_its_program_keep_the_clip_sampling(runs, videos, tmp_path):
    """``python -m vitrel.export CKPT OUT --pt2`` of the run with 2 clips (EMA weights): the export folder and the
    ``.pt2`` program give the checkpoint's CSV rows (the export's ``--ema auto``, as predict's ``ema=auto``: the EMA
    weights), with no warning (the clip sampling travels in their data configs)."""
    from vitrel.export import main as export_main

    assert export_main([str(runs[2]), str(tmp_path / "export"), "--pt2"]) == 0
    ref = predict_folder(load_predictor(runs[2]), videos / "val", topk=2, batch_size=3, progress=False).rows
    for src in (tmp_path / "export", tmp_path / "export" / "model.pt2"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            p = load_predictor(src)
            rows = predict_folder(p, videos / "val", topk=2, batch_size=3, progress=False).rows
        assert not [w for w in caught if "stores no" in str(w.message)], src
        assert (p.data_config["frame_stride"], p.data_config["clips_per_video"]) == (2, 2)
        assert [r["index_0"] for r in rows] == [r["index_0"] for r in ref] and rows[0]["label_0"] in CLASSES
        assert max(abs(a["prob_0"] - b["prob_0"]) for a, b in zip(rows, ref, strict=True)) < 1e-5, src
    for flag, ema in ((["--ema"], True), (["--ema", "false"], False)):  # (a bare --ema: as before, the EMA weights)
        assert export_main([str(runs[2]), str(tmp_path / f"export_{ema}"), *flag]) == 0
        got = vitrel.load_model(tmp_path / f"export_{ema}").state_dict()
        want = vitrel.load_model(runs[2], use_ema=ema).state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want), flag


def test_predict_names_a_video_far_shorter_than_a_clip(runs, tmp_path, caplog):
    """A clip of 4 frames 3 apart spans 10 frames: predict.py names a video of fewer than half of them (2 frames) in
    the warning train.py and eval.py give (``warn_short_video``), and passes a 6-frame one in silence."""
    import logging

    write_video(tmp_path / "in" / "short.avi", 2, "ffv1", "yuv420p", hw=(30, 40))
    write_video(tmp_path / "in" / "long.avi", 6, "ffv1", "yuv420p", hw=(30, 40))
    with caplog.at_level(logging.WARNING):
        res = predict_folder(load_predictor(runs[1]), tmp_path / "in", topk=1, progress=False)
    assert len(res.rows) == 2
    line = f"{tmp_path / 'in' / 'short.avi'} has 2 frame(s), fewer than half the 10 a clip of 4 frames 3 apart spans"
    assert caplog.text.count(line) == 1, caplog.text
    assert "long.avi" not in caplog.text


def test_the_clip_sampling_warning_names_the_caller_not_vitrel(videos, tmp_path):
    """Weights without the clip sampling (``save_pretrained`` of a model built in Python): its one warning was
    attributed to ``vitrel/inference.py`` (``return _predict_videos(...)``), a line of vitrel's; now to the line that
    called ``predict_folder``, as the table-resize warning is (``vitrel.caller.caller_stacklevel``)."""
    from vitrel.models.checkpoint import save_pretrained

    m = vitrel.create_model("vitrel_vit_video_tiny_patch4_32", embed_dim=16, depth=1, num_heads=2, img_size=16)
    p = load_predictor(save_pretrained(m, tmp_path / "weights"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        predict_folder(p, videos / "val", topk=1, progress=False)
    said = [w for w in caught if "stores no clip sampling" in str(w.message)]
    assert len(said) == 1 and said[0].filename == __file__, [(w.filename, w.lineno) for w in said]


def test_an_export_through_timms_local_dir_and_saved_again_keeps_the_clip_sampling(runs, videos, tmp_path):
    """``vitrel.export``'s folder through ``timm.create_model("local-dir:...")`` lost the clip sampling (it was in the
    weights' metadata only, which that route does not read): the model saved again held none, and eval.py scored it
    on data=video_folder's default clips (stride 4, 1 clip) without a word. ``config.json``'s ``pretrained_cfg``
    carries it now; the folder saved again gives the checkpoint's predictions with no warning."""
    import timm

    from vitrel.export import main as export_main

    assert export_main([str(runs[2]), str(tmp_path / "export")]) == 0
    model = timm.create_model(f"local-dir:{tmp_path / 'export'}", pretrained=True)
    assert (model.pretrained_cfg["frame_stride"], model.pretrained_cfg["clips_per_video"]) == (2, 2)
    vitrel.models.save_pretrained(model, tmp_path / "again")
    ref = predict_folder(load_predictor(runs[2]), videos / "val", topk=1, progress=False).rows
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = predict_folder(load_predictor(tmp_path / "again"), videos / "val", topk=1, progress=False).rows
    assert not [w for w in caught if "stores no" in str(w.message)]
    assert max(abs(a["prob"] - b["prob"]) for a, b in zip(rows, ref, strict=True)) < 1e-5


def test_eval_py_names_the_clips_it_takes_for_a_checkpoint_without_them(runs, videos, tmp_path, caplog):
    """eval.py of a video checkpoint that stores no clip sampling (written before vitrel stored it, or a model saved
    by other means) sampled data=video_folder's default clips silently, as predict.py warns: it says so now, naming
    the settings to give."""
    from vitrel.train.evaluate import evaluate

    old = torch.load(runs[2], weights_only=True)
    for key in ("frame_stride", "clips_per_video"):
        del old["hyper_parameters"]["data_config"][key]
    torch.save(old, tmp_path / "old.ckpt")
    args = [f"ckpt_path={tmp_path / 'old.ckpt'}", "data=video_folder", f"data.root={videos}", "data.num_workers=0"]
    with caplog.at_level("WARNING"):
        evaluate(compose(tmp_path / "eval", [*args, "progress_bar=false"], config_name="eval"))
    said = [r.getMessage() for r in caplog.records if "stores no clip sampling" in r.getMessage()]
    assert len(said) == 1 and "data.stride=4, data.clips_per_video=1" in said[0], said
