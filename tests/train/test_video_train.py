"""Training on video: clips through train.py, eval.py and predict.py, mixup per clip, the video / image pairing
refused at once, and the checkpoint a video run writes (predict.py on video_folder runs: test_video_predict.py)."""

from __future__ import annotations

import csv
import functools
import json
import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from timm.data import Mixup

import vitrel
from tests.train_helpers import FAST, TINY_CLIPS, TINY_VIDEO, TINY_VIT, compose
from vitrel.data.moving_fmnist import MovingFMNISTDataModule
from vitrel.inference import mean_softmax_log
from vitrel.models.data_config import data_config_for
from vitrel.train.mixing import mix_clips
from vitrel.train.run import train

SHORT = ["trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1"]
SHORT += ["trainer.limit_test_batches=1", "logger=none"]


def test_video_run_writes_a_checkpoint_that_loads_as_the_video_model(video_sweep):
    m = json.loads((video_sweep / "metrics.json").read_text())
    assert (
        m["status"] == "finished" and m["data"] == "moving_fmnist" and m["model"] == "vitrel_vit_video_tiny_patch4_32"
    )
    assert 0.0 <= m["metrics"]["test/acc1"] <= 1.0 and math.isfinite(m["metrics"]["test/loss"])
    ckpt_file = video_sweep / "checkpoints" / "last.ckpt"
    ckpt = torch.load(ckpt_file, map_location="cpu", weights_only=True)
    cfg = ckpt["vitrel_cfg"]
    assert (cfg["architecture"], cfg["num_frames"], cfg["tubelet_size"], cfg["patch_size"]) == (
        "vitrel_vit_video_tiny_patch4_32", 8, 1, 16,
    )  # fmt: skip
    dm = MovingFMNISTDataModule(train_images=32, test_images=16)
    stored = ckpt["hyper_parameters"]["data_config"]
    assert stored["num_frames"] == 8 and stored["input_size"] == [1, 32, 32]
    assert stored["mean"] == pytest.approx(dm.mean) and stored["class_names"] == ["forward", "backward"]
    model = vitrel.load_model(ckpt_file).eval()
    assert data_config_for(ckpt_file, model)["num_frames"] == 8
    x, _ = next(iter(torch.utils.data.DataLoader(dm.make_dataset("test"), batch_size=4)))
    with torch.no_grad():
        torch.testing.assert_close(model(x), model(x.clone()))
        assert model(x).shape == (4, 2)


def test_eval_scores_a_video_checkpoint_at_twice_the_frames(video_sweep, tmp_path, capsys, caplog):
    from vitrel.train.evaluate import evaluate

    ckpt = video_sweep / "checkpoints" / "last.ckpt"
    over = [f"ckpt_path={ckpt}", *TINY_CLIPS, "data.num_frames=16", *FAST[:1], *FAST[2:4]]
    caplog.set_level("INFO", logger="vitrel.train.per_class")
    metrics = evaluate(compose(tmp_path, over, config_name="eval"))
    res = json.loads((tmp_path / "eval_metrics.json").read_text())
    assert res["grid"] == [16, 2, 2] and res["num_images"] == 32
    assert "per_class.csv (32 videos)" in caplog.text, caplog.text  # (eval.py's split wrapper: "images")
    said = capsys.readouterr().out
    assert "at 16 frames of img_size 32 (grid 16x2x2)" in said and "(32 videos)" in said, said  # (not "images")
    assert 0.0 <= metrics["test/acc1"] <= 1.0


def test_eval_scores_a_video_checkpoint_at_the_clip_length_it_was_trained_at(tmp_path, caplog):
    """A run trained on 4-frame clips, scored by eval.py without data.num_frames: at 4 frames (the data group's
    default, 8, would rebuild the model for 8), saying so; data.num_frames on the command line still wins."""
    from vitrel.train.evaluate import evaluate

    caplog.set_level("INFO", logger="lightning.pytorch")  # (rank_zero_info's)
    run = tmp_path / "run"
    train(compose(run, [*TINY_VIDEO, "pos=rel3d_factored", "data.num_frames=4", "trainer.max_epochs=1", "logger=none"]))
    ckpt = run / "checkpoints" / "last.ckpt"
    assert vitrel.load_model(ckpt).vitrel_cfg["num_frames"] == 4
    for given, frames in (([], 4), (["data.num_frames=6"], 6)):
        out = tmp_path / f"eval{frames}"
        evaluate(compose(out, [f"ckpt_path={ckpt}", *TINY_CLIPS, *given, *FAST[:1], *FAST[2:4]], config_name="eval"))
        assert json.loads((out / "eval_metrics.json").read_text())["grid"][0] == frames, given
    assert "data.num_frames=4: the clip length last.ckpt was trained at" in caplog.text


def test_eval_refuses_images_for_a_video_checkpoint(video_sweep, tmp_path):
    from vitrel.train.evaluate import evaluate

    ckpt = video_sweep / "checkpoints" / "last.ckpt"
    # (the data to give eval.py, not train.py's advice to pick another model: eval.py has no model=); without
    # data=, the run's data is named first; with data=fashion_mnist given, the images themselves are refused
    said = r"score it on the data it was trained on, data=moving_fmnist \(its run's .*config.yaml\)$"
    for given, why in (([], r"trained on data=moving_fmnist, but eval.py scores data=fashion_mnist unless told: "),
                       (["data=fashion_mnist"], r"gives images .* is a video model .*: ")):  # fmt: skip
        cfg = compose(tmp_path, [f"ckpt_path={ckpt}", *given, *FAST[:1], *FAST[2:4]], config_name="eval")
        with pytest.raises(ValueError, match=why + said):
            evaluate(cfg)
    assert not (tmp_path / "eval_metrics.json").exists()


def test_predict_scores_grey_video_files_with_the_moving_fmnist_checkpoint(video_sweep, tmp_path):
    """predict.py (in-process) on lossless grey video files with the recipe's 1-channel model: the frames made grey as
    images are (PIL's ``convert("L")``), the centre clip of 8 consecutive frames (``frame_stride`` 1, one clip: what
    train.py stores for Moving Fashion-MNIST), against the frames write_video wrote, by hand in float64. An image
    folder is refused naming what the model takes, before the CSV is written."""
    pytest.importorskip("av", reason="PyAV not installed: pip install -e '.[video]'")
    from PIL import Image

    from tests.data.test_video import frame_values, write_video
    from vitrel.train.predict import run_predict

    ckpt = video_sweep / "checkpoints" / "last.ckpt"
    dc = torch.load(ckpt, weights_only=True)["hyper_parameters"]["data_config"]
    assert (dc["num_frames"], dc["frame_stride"], dc["clips_per_video"]) == (8, 1, 1)
    lengths = {"a.mkv": 12, "b.mkv": 8}
    for name, n in lengths.items():
        write_video(tmp_path / "clips" / name, n, hw=(32, 32))  # FFV1, grey: lossless
    out = tmp_path / "predictions.csv"
    (tmp_path / "images").mkdir()
    Image.new("L", (32, 32)).save(tmp_path / "images" / "a.png")
    args = [f"ckpt_path={ckpt}", f"results_file={out}", "progress_bar=false", "topk=2"]
    with pytest.raises(ValueError, match=r"holds images .* is a video model: it takes clips of 8 frames"):
        run_predict(compose(tmp_path / "run", [*args, f"input={tmp_path / 'images'}"], config_name="predict"))
    assert not out.exists()
    run_predict(compose(tmp_path / "run", [*args, f"input={tmp_path / 'clips'}"], config_name="predict"))
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["filename"] for r in rows] == list(lengths)
    model = vitrel.load_model(ckpt).double().eval()
    for r, n in zip(rows, lengths.values(), strict=True):
        start = (n - 8) // 2
        frames = np.repeat(frame_values(n)[start : start + 8, None, None], 32, 1).repeat(32, 2).astype(np.float64)
        frames[:, :3, :5] = 250  # (write_video's corner block)
        clip = (torch.from_numpy(frames) / 255 - dc["mean"][0]) / dc["std"][0]
        with torch.no_grad():
            want = model(clip[None, None]).softmax(-1)[0]
        got = torch.tensor([float(r["prob_0"]), float(r["prob_1"])], dtype=torch.float64)
        torch.testing.assert_close(got, want.sort(descending=True).values, rtol=0, atol=1e-5)
        assert r["label_0"] == ["forward", "backward"][int(want.argmax())]


@pytest.mark.parametrize("moved", [False, True])
def test_eval_scores_a_1_channel_video_checkpoint_on_grey_video_files(video_sweep, tmp_path, moved):
    """eval.py ``data=video_folder`` with the recipe's 1-channel model (in its run folder, and moved out of it): the
    frames made grey as predict.py makes them, ``data.in_chans=1`` taken from the model. Was: ``ConfigError: ...
    takes 1-channel images but VideoFolderDataModule gives 3``, after taking ``data.mean=[0.0718,0.0718,0.0718]``.
    Moved (no run record), the statistics stored with it: the loss is the model's on the frames by hand."""
    pytest.importorskip("av", reason="PyAV not installed: pip install -e '.[video]'")
    import shutil

    from tests.data.test_video import frame_values, write_video
    from vitrel.train.evaluate import evaluate

    ckpt = video_sweep / "checkpoints" / "last.ckpt"
    if moved:
        ckpt = shutil.copy(ckpt, tmp_path / "last.ckpt")
    lengths = {"forward": 12, "backward": 8}  # (class 0, class 1: the run's class order)
    for split in ("train", "val"):
        for i, (name, n) in enumerate(lengths.items()):
            write_video(tmp_path / "videos" / split / f"{i}_{name}" / "a.mkv", n, hw=(32, 32))  # FFV1, grey
    over = [f"ckpt_path={ckpt}", "data=video_folder", f"data.root={tmp_path / 'videos'}", "data.batch_size=2"]
    metrics = evaluate(compose(tmp_path / "eval", [*over, *FAST[:1], *FAST[2:4]], config_name="eval"))
    res = json.loads((tmp_path / "eval" / "eval_metrics.json").read_text())
    assert res["data_from_run"]["in_chans"] == 1 and res["num_images"] == 2
    if not moved:  # (other data than the run's: its own statistics, ImageNet's averaged for one channel)
        assert res["data_from_run"].get("mean") is None
        return
    with pytest.raises(ValueError, match=r"takes 1-channel clips but VideoFolderDataModule gives 3 "
                       r"\(data=video_folder\): give data.in_chans=1 \(or leave it out"):  # fmt: skip
        evaluate(compose(tmp_path / "rgb", [*over, "data.in_chans=3", *FAST[:1], *FAST[2:4]], config_name="eval"))
    shutil.copytree(tmp_path / "videos", tmp_path / "three")
    write_video(tmp_path / "three" / "train" / "2_other" / "a.mkv", 8, hw=(32, 32))
    with pytest.raises(ValueError, match=r"classifies 2 classes but VideoFolderDataModule has 3 \(data=video_folder\): "
                       r"score it on the data it was trained on, data=<that data set>$"):  # fmt: skip
        three = [*over, f"data.root={tmp_path / 'three'}", *FAST[:1], *FAST[2:4]]  # (data= given: not the default's)
        evaluate(compose(tmp_path / "three_eval", three, config_name="eval"))
    dc = torch.load(ckpt, weights_only=True)["hyper_parameters"]["data_config"]
    assert res["data_from_run"]["mean"] == pytest.approx(dc["mean"]) and len(dc["mean"]) == 1
    model = vitrel.load_model(ckpt).double().eval()
    clips = []
    for n in lengths.values():
        start = (n - 8) // 2  # (the centre clip of 8 consecutive frames: frame_stride 1, one clip)
        frames = np.repeat(frame_values(n)[start : start + 8, None, None], 32, 1).repeat(32, 2).astype(np.float64)
        frames[:, :3, :5] = 250  # (write_video's corner block)
        clips.append((torch.from_numpy(frames) / 255 - dc["mean"][0]) / dc["std"][0])
    with torch.no_grad():
        want = F.cross_entropy(model(torch.stack(clips)[:, None]), torch.tensor([0, 1]))
    assert metrics["test/loss"] == pytest.approx(float(want), abs=1e-5)


def test_video_model_with_image_data_is_refused_before_anything_is_built(tmp_path):
    video = ["model=vit_video_tiny_fmnist", "model.embed_dim=16", "model.depth=1", "model.num_heads=2"]
    cfg = compose(tmp_path, [*video, *FAST, *SHORT])  # the default data: Fashion-MNIST images
    with pytest.raises(ValueError, match=r"gives images .* is a video model .*model=vit_tiny_fmnist"):
        train(cfg)
    assert not (tmp_path / "checkpoints").exists()


def test_mixup_and_cutmix_train_on_clips(tmp_path):
    over = [*TINY_VIDEO, *SHORT, "pos=none", "module/mixup=default", "data.drop_last=true"]
    metrics = train(compose(tmp_path, over))
    assert math.isfinite(metrics["train/loss_epoch"])


def test_image_model_with_video_data_is_refused_before_anything_is_built(tmp_path):
    cfg = compose(tmp_path, [*TINY_VIT, *FAST, *SHORT, *TINY_CLIPS])
    with pytest.raises(ValueError, match=r"gives clips \[B, C, T, H, W\].*is an image model.*model=vitrel_vit_video"):
        train(cfg)
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.json").exists()


@pytest.mark.parametrize("mode", ["batch", "pair", "elem"])
def test_cutmix_pastes_one_box_on_every_frame_of_a_clip(mode):
    """Each frame of the mixed clips is what timm's image CutMix makes of that frame alone (the same draw): one box,
    the same for all the clip's frames and all its time steps mixed."""
    b, c, t, h, w = 4, 2, 3, 16, 16
    x = torch.randn(b, c, t, h, w, generator=torch.Generator().manual_seed(0))
    y = torch.arange(b)
    make = functools.partial(Mixup, mixup_alpha=0.0, cutmix_alpha=1.0, mode=mode, num_classes=b)
    np.random.seed(3)
    mixed, target = mix_clips(make(), x.clone(), y)
    assert mixed.shape == x.shape
    changed = (mixed != x).any(dim=1)  # [B, T, H, W]
    assert changed.any(), "the draw pasted nothing: the test would not see a wrong box"
    for k in range(t):
        np.random.seed(3)
        frame, frame_target = make()(x[:, :, k].clone(), y)  # timm on images: the reference
        torch.testing.assert_close(mixed[:, :, k], frame, rtol=0, atol=0)
        torch.testing.assert_close(target, frame_target, rtol=0, atol=0)
        assert torch.equal(changed[:, k], changed[:, 0])


def test_mixup_blends_whole_clips():
    b = 4
    x = torch.randn(b, 1, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    np.random.seed(0)
    mixed, target = mix_clips(
        Mixup(mixup_alpha=1.0, cutmix_alpha=0.0, label_smoothing=0.0, num_classes=b), x.clone(), torch.arange(b)
    )
    lam = float(target[0, 0])  # the first clip keeps lam of its own class
    torch.testing.assert_close(mixed, lam * x + (1 - lam) * x.flip(0))


def test_export_writes_a_video_models_weights_and_refuses_a_bad_clip(video_sweep, tmp_path, capsys):
    from vitrel.export import main as export_main

    ckpt = video_sweep / "checkpoints" / "last.ckpt"
    # a clip the model cannot take is refused before anything is written (its programs: test_video_export.py)
    assert export_main([str(ckpt), str(tmp_path / "prog"), "--pt2", "--num-frames", "0"]) == 2
    assert "not a positive multiple of the tubelet size 1" in capsys.readouterr().err
    assert not (tmp_path / "prog").exists()
    assert export_main([str(ckpt), str(tmp_path / "weights")]) == 0
    model = vitrel.load_model(tmp_path / "weights")
    assert model.vitrel_cfg["num_frames"] == 8 and model.pretrained_cfg["num_frames"] == 8


def test_eval_refuses_a_torch_export_program_naming_the_export_folder(video_sweep, tmp_path):
    """eval.py rebuilds the model from weights: a ``.pt2`` program (which predict.py takes) is refused saying so and
    naming the weights beside it, not called a damaged checkpoint."""
    from vitrel.export import main as export_main
    from vitrel.models import CheckpointError
    from vitrel.train.evaluate import evaluate

    assert export_main([str(video_sweep / "checkpoints" / "last.ckpt"), str(tmp_path / "export"), "--pt2"]) == 0
    prog = tmp_path / "export" / "model.pt2"
    cfg = compose(tmp_path / "eval", [f"ckpt_path={prog}", *TINY_CLIPS, *FAST[:1], *FAST[2:4]], config_name="eval")
    with pytest.raises(CheckpointError, match=r"model\.pt2 is a torch\.export program.*ckpt_path=.*export$"):
        evaluate(cfg)


# ------------------------------------------------------------------------------------------------ multi-view
# data=video_folder with the video ViT, tiny: clips of 4 consecutive frames of 16 x 16 (the videos' size: no resize)
FOLDER = ["data=video_folder", "data.num_frames=4", "data.stride=1", "data.img_size=16", "data.pin_memory=false"]
FOLDER += ["data.num_workers=0", "data.batch_size=3", "trainer.accelerator=cpu", "progress_bar=none"]
# val videos of 5 to 20 frames (frame i at brightness 8 + 12 i): a long video's first and last clips look different
VAL_LENGTHS = {"archery": (20, 5, 14, 17), "bowling": (18, 9, 20)}


@pytest.fixture(scope="module")
def folder_run(tmp_path_factory):
    """``(videos root, last.ckpt)``: train.py (in-process) on lossless grey 16 x 16 videos in class folders, 2
    evaluation clips per video (its validation scores videos), a one-block model, 2 epochs."""
    pytest.importorskip("av", reason="PyAV not installed: pip install -e '.[video]'")
    from tests.data.test_video import write_video

    root = tmp_path_factory.mktemp("videos")
    for c, (cls, lengths) in enumerate(VAL_LENGTHS.items()):
        for k, n in enumerate(lengths):
            write_video(root / "val" / cls / f"{cls}_{k}.mkv", n, hw=(16, 16))
        for k in range(3):
            write_video(root / "train" / cls / f"{cls}_{k}.mkv", 6 + 5 * k + c, hw=(16, 16))
    run = tmp_path_factory.mktemp("folder_run")
    model = ["model=vitrel_vit_video_tiny_patch4_32", "pos=rel3d_factored", "+model.embed_dim=16", "+model.depth=1"]
    over = [*FOLDER, f"data.root={root}", "data.clips_per_video=2", *model, "+model.num_heads=2"]
    over += ["trainer.max_epochs=2", "module.optimizer.lr=0.05", "module.scheduler.warmup_epochs=0", "logger=none"]
    metrics = train(compose(run, [*over, "test=false", "callbacks.pos_images=null"]))
    assert 0.0 <= metrics["val/acc1"] <= 1.0 and math.isfinite(metrics["val/loss"])
    return root, run / "checkpoints" / "last.ckpt"


def clip_probs_by_hand(ckpt, root, clips: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probs [videos, clips, classes], labels [videos])`` in float64 over the val videos (sorted, class folders'
    order): each clip's frames written out by hand (write_video's: brightness 8 + 12 i, the corner block at 250,
    every channel), the clips' starts by docs/video.md's rule (K evenly spaced from the first frame to the last clip
    that fits, the centre one when K = 1), normalised with ImageNet's statistics, softmax of the model in float64."""
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

    from tests.data.test_video import frame_values

    model = vitrel.load_model(ckpt).double().eval()
    mean = torch.tensor(IMAGENET_DEFAULT_MEAN, dtype=torch.float64)[:, None, None, None]
    std = torch.tensor(IMAGENET_DEFAULT_STD, dtype=torch.float64)[:, None, None, None]
    probs, labels = [], []
    for c, lengths in enumerate(VAL_LENGTHS.values()):
        for n in lengths:  # (the files <class>_<k>.mkv sort as listed)
            delta = n - 4
            starts = [delta // 2] if clips == 1 else [k * delta // (clips - 1) for k in range(clips)]
            views = []
            for s in starts:
                frames = np.repeat(frame_values(n)[s : s + 4, None, None], 16, 1).repeat(16, 2).astype(np.float64)
                frames[:, :3, :5] = 250
                clip = (torch.from_numpy(frames)[None].expand(3, -1, -1, -1) / 255 - mean) / std  # [C, T, H, W]
                with torch.no_grad():
                    views.append(model(clip[None]).softmax(-1)[0])
            probs.append(torch.stack(views))
            labels.append(c)
    return torch.stack(probs), torch.tensor(labels)


def test_mean_softmax_log_is_the_log_of_the_clips_mean_softmax():
    """Against the mean of softmax in float64 (video b's clips: rows b * K .. b * K + K - 1), and finite where a
    class's probability underflows float32 in every clip (its logit 200 below the others)."""
    logits = torch.randn(6, 5, generator=torch.Generator().manual_seed(0)) * 4  # 2 videos of 3 clips
    want = logits.double().softmax(-1).reshape(2, 3, 5).mean(1).log()
    torch.testing.assert_close(mean_softmax_log(logits, 3).double(), want, rtol=0, atol=1e-6)
    far = torch.tensor([[0.0, 200.0], [0.0, 201.0]])  # class 0: probability e^-200 (float32's exp underflows)
    got = mean_softmax_log(far, 2)
    assert (
        torch.isfinite(got).all() and abs(got[0, 0].item() - (-200.0 - math.log(2) + math.log(1 + math.e**-1))) < 1e-4
    )


@pytest.mark.parametrize("clips", [2, 1])
def test_eval_py_scores_videos_by_their_clips_mean_softmax(folder_run, tmp_path, clips):
    """eval.py (in-process) on the val videos of a train.py checkpoint: with 2 clips per video, acc1 and loss are the
    video's (argmax and -log of the mean of its clips' softmax, by hand in float64; the per-clip values differ), the
    videos counted; with 1 clip, the centre clip's values, as before multi-view testing."""
    from vitrel.train.evaluate import evaluate

    root, ckpt = folder_run
    over = [f"ckpt_path={ckpt}", *FOLDER, f"data.root={root}", f"data.clips_per_video={clips}", "split=val"]
    metrics = evaluate(compose(tmp_path, over, config_name="eval"))
    res = json.loads((tmp_path / "eval_metrics.json").read_text())
    assert res["num_images"] == res["split_images"] == 7  # videos: 7, in batches of 3 (the last of 1)
    probs, labels = clip_probs_by_hand(ckpt, root, clips)
    video = probs.mean(1)  # [videos, classes]
    want_acc = (video.argmax(-1) == labels).double().mean().item()
    want_loss = -video[torch.arange(7), labels].log().mean().item()
    assert metrics["val/acc1"] == pytest.approx(want_acc, abs=1e-6)  # (a float32 ratio of counts)
    assert metrics["val/loss"] == pytest.approx(want_loss, rel=1e-5)
    assert set(metrics) == {"val/acc1", "val/loss"}  # no top-5 of 2 classes (always 1.0)
    if clips == 2:  # per clip, or with the logits averaged, other numbers: the test sees which one is reported
        per_clip_acc = (probs.argmax(-1) == labels[:, None]).double().mean().item()
        per_clip_loss = -probs[torch.arange(7), :, labels].log().mean().item()
        mean_logits_loss = F.cross_entropy(probs.log().mean(1), labels).item()  # (log-probs: the logits less a shift)
        assert abs(per_clip_acc - want_acc) > 0.05, (per_clip_acc, want_acc)
        # (each other way of scoring: 100 times farther from the loss than the 1e-5 the loss is checked at)
        assert min(abs(per_clip_loss - want_loss), abs(mean_logits_loss - want_loss)) > 1e-3 * want_loss


def test_eval_py_scores_a_folder_run_with_the_clips_its_run_was_tested_on(folder_run, tmp_path, caplog):
    """``python eval.py ckpt_path=<run>/last.ckpt data=video_folder data.root=...`` without ``data.stride`` or
    ``data.clips_per_video``: the run's own evaluation clips (stride 1, 2 clips a video, as it stored them), so the
    score is the run's (by hand in float64), not that of data=video_folder's defaults (stride 4, the centre clip);
    it says so, and eval_metrics.json records the clips. Given on the command line, a key still wins."""
    from vitrel.train.evaluate import evaluate

    caplog.set_level("INFO", logger="lightning.pytorch")  # (rank_zero_info's; a study run in-process quiets it)
    root, ckpt = folder_run
    base = [f"ckpt_path={ckpt}", *[o for o in FOLDER if not o.startswith("data.stride=")], f"data.root={root}"]
    metrics = evaluate(compose(tmp_path / "a", [*base, "split=val"], config_name="eval"))
    probs, labels = clip_probs_by_hand(ckpt, root, 2)
    want_loss = -probs.mean(1)[torch.arange(7), labels].log().mean().item()
    assert metrics["val/loss"] == pytest.approx(want_loss, rel=1e-5)
    res = json.loads((tmp_path / "a" / "eval_metrics.json").read_text())
    assert (res["num_frames"], res["stride"], res["clips_per_video"], res["spatial_crops"]) == (4, 1, 2, 1)
    taken = "data.stride=1 data.clips_per_video=2 data.spatial_crops=1 data.frame_sampling=stride"
    assert f"{taken}: the evaluation clips of last.ckpt's run" in caplog.text
    evaluate(compose(tmp_path / "b", [*base, "split=val", "data.clips_per_video=1"], config_name="eval"))
    res = json.loads((tmp_path / "b" / "eval_metrics.json").read_text())
    assert (res["stride"], res["clips_per_video"]) == (1, 1)
    # 3 spatial crops of each clip: 6 views a video, here the same 3 times (16 x 16 frames at img_size 16)
    over = [*base, "split=val", "data.spatial_crops=3"]
    assert evaluate(compose(tmp_path / "c", over, config_name="eval"))["val/loss"] == pytest.approx(want_loss, rel=1e-5)
    assert json.loads((tmp_path / "c" / "eval_metrics.json").read_text())["spatial_crops"] == 3


def test_eval_warns_when_the_folders_classes_are_not_the_checkpoints(folder_run, tmp_path, caplog):
    """The same videos with one class folder renamed so that it sorts first (bowling -> a_bowling): label 0 is now
    bowling's, the model's output 0 archery's, so the accuracy is 1 - the true one. eval.py says which names differ
    (it scores by index, as the folders sort)."""
    import shutil

    from vitrel.train.evaluate import evaluate

    root, ckpt = folder_run
    moved = tmp_path / "videos"
    shutil.copytree(root, moved)
    for split in ("train", "val"):
        (moved / split / "bowling").rename(moved / split / "a_bowling")
    over = [f"ckpt_path={ckpt}", *FOLDER, f"data.root={moved}", "data.clips_per_video=2"]
    caplog.set_level("WARNING", logger="vitrel.train.evaluate")  # (a log warning: in eval.log too)
    evaluate(compose(tmp_path / "eval", over, config_name="eval"))
    assert re.search(r"class 0 is 'a_bowling' here but 'archery' in last\.ckpt.*by index", caplog.text), caplog.text


def test_the_closing_line_of_a_partly_tested_video_run_counts_videos():
    from vitrel.train.summary import report

    result = {"metrics": {"test/acc1": 0.5}, "test_images": 4, "test_split_images": 12, "fit_s": 3.0, "wall_s": 4.0}
    result |= {"test_limited_by": "trainer.limit_test_batches", "epochs": 1, "global_step": 2, "run_dir": "r"}
    result |= {"last_ckpt": None, "best_ckpt": None}
    line = report(result, None, noun="videos").splitlines()[0]
    assert line.endswith(" on 4 of the 12 test videos (trainer.limit_test_batches)"), line
