"""What a new user runs in the first hour on video (docs/video.md) with a first, small video folder: errors that
stop train.py with a traceback or advice that does not work (a clip that does not decode, a class folder without
videos, fewer clips than a batch). eval.py on a folder run: tests/train/test_video_train.py."""

from __future__ import annotations

import json

import pytest

from tests.train_helpers import FAST, compose
from vitrel.train.run import train

SHORT = ["trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1"]
SHORT += ["trainer.limit_test_batches=1", "logger=none"]
# the video recipe's model, one block, with its groups given one by one as docs/video.md lists them
VIDEO_MODEL = ["model=vit_video_tiny_fmnist", "model.embed_dim=16", "model.depth=1", "model.num_heads=2"]
# data=video_folder at 2 frames of 16 x 16, one batch a split
FOLDER = ["data=video_folder", "data.num_frames=2", "data.stride=1", "data.img_size=16", "data.pin_memory=false"]
FOLDER += ["data.batch_size=8", "data.drop_last=false", *VIDEO_MODEL, "pos=rel3d_factored", *FAST[2:]]


@pytest.fixture
def video_tree(tmp_path):
    """A video_folder tree of short lossless clips: train/<a, b>/ two each, val/<a, b>/ one each."""
    pytest.importorskip("av", reason="PyAV not installed: pip install -e '.[video]'")
    from tests.data.test_video import write_video

    for split, n in (("train", 2), ("val", 1)):
        for cls in ("a", "b"):
            for k in range(n):
                write_video(tmp_path / "videos" / split / cls / f"{k}.mkv", 4, hw=(16, 16))
    return tmp_path / "videos"


@pytest.mark.parametrize("workers", [0, 1])
def test_a_clip_that_does_not_decode_is_one_line_naming_it(video_tree, tmp_path, workers):
    """A damaged file among the training clips stops ``python train.py data=video_folder ...`` with the message alone,
    ``train.py: VideoDecodeError: cannot read video <file>: ...`` (as a missing data folder), also when a DataLoader
    worker read it (data=video_folder's default: torch re-raises the worker's error from its text): no traceback."""
    from vitrel.train.user_errors import one_line_errors

    bad = video_tree / "train" / "a" / "2.mkv"
    bad.write_bytes(b"not a video" * 50)
    over = [*FOLDER, f"data.root={video_tree}", f"data.num_workers={workers}", *SHORT]
    with pytest.raises(SystemExit) as stop, one_line_errors("train.py"):
        train(compose(tmp_path / "run", over))
    message = str(stop.value)
    assert message.startswith(f"train.py: VideoDecodeError: cannot read video {bad}: "), message
    assert "; data.on_bad_sample=skip leaves such files out" in message, message
    assert "\n" not in message and "Traceback" not in message


def test_a_train_class_folder_without_videos_is_one_line_naming_it(video_tree, tmp_path):
    """Clips not moved into one of the train class folders (or of another extension): ``train.py`` ends with the
    data set error alone, naming the folder and the extensions it reads, as for a missing folder; no traceback,
    nothing written."""
    from vitrel.train.user_errors import one_line_errors

    for f in (video_tree / "train" / "b").iterdir():
        f.rename(f.with_suffix(".mpg"))
    over = [*FOLDER, f"data.root={video_tree}", "data.num_workers=0", *SHORT]
    with pytest.raises(SystemExit) as stop, one_line_errors("train.py"):
        train(compose(tmp_path / "run", over))
    message = str(stop.value)
    assert message.startswith("train.py: DatasetNotFoundError: video folders not found. "), message
    assert f"{video_tree / 'train'}: Found no valid file for the classes b." in message
    assert "(video files: .mp4, .avi" in message and "Traceback" not in message
    assert "train.py and eval.py: data.root=<the folder holding train/ and val/>" in message
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_folder_smaller_than_a_batch_is_refused_with_advice_that_works(video_tree, tmp_path):
    """A first folder of 4 training clips with train.py's default ``batch_size`` and data=video_folder's
    ``drop_last``: no training batch at all. Refused naming both keys, not ``the schedule needs at least one
    optimizer step``; the advice (``data.batch_size=4``) then trains."""
    over = [*FOLDER, f"data.root={video_tree}", "data.num_workers=0", *SHORT, "data.drop_last=true"]
    over = [o for o in over if not o.startswith("data.batch_size=")]
    with pytest.raises(ValueError, match=r"data.batch_size=\d+ but the training split has 4 clips") as refused:
        train(compose(tmp_path / "a", over))
    assert "Set data.batch_size to at most 4, or data.drop_last=false" in str(refused.value)
    assert not (tmp_path / "a" / "checkpoints").exists()
    metrics = train(compose(tmp_path / "b", [*over, "data.batch_size=4"]))
    assert json.loads((tmp_path / "b" / "metrics.json").read_text())["global_step"] == 1 and "test/acc1" in metrics


def test_clips_that_are_not_whole_tubelets_are_one_line_naming_data_num_frames(tmp_path):
    """``data.num_frames=7`` with tubelets of 2 failed inside Hydra's instantiation of the model ("7 frames are not
    a positive multiple of the tubelet size 2", no config key): one line from train.py naming ``data.num_frames``
    and the multiples either side, before anything is written; the advice runs."""
    import re

    from vitrel.train.user_errors import one_line_errors

    base = ["data=moving_fmnist", "data.train_images=8", "data.test_images=8", *VIDEO_MODEL, "model.tubelet_size=2"]
    base += ["pos=rel3d_factored", *FAST[2:], *SHORT]
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as said, one_line_errors("train.py"):
        train(compose(run, [*base, "data.num_frames=7"]))
    assert str(said.value) == (
        "train.py: InputSizeError: MovingFMNISTDataModule's clips, 7 frames (data.num_frames), are not a whole "
        "number of the 2-frame tubelets of vitrel_vit_video_tiny_patch4_32 (model.tubelet_size): set "
        "data.num_frames=8 or 6"
    )
    assert not run.exists() or not any(run.iterdir())
    advice = re.search(r"(data\.num_frames=\d+)", str(said.value).split("set ")[1]).group(1)
    train(compose(tmp_path / "ok", [*base, advice]))
    assert json.loads((tmp_path / "ok" / "metrics.json").read_text())["status"] == "finished"


def test_a_video_model_with_an_image_scheme_is_one_line_naming_the_video_schemes(tmp_path):
    """``train.py data=moving_fmnist model=<a video model>`` without ``pos=`` (train.yaml's default, an image scheme)
    failed in Hydra's instantiation of the model, a stack of "Error executing job" / "Error in call to target"
    lines: one line from train.py naming the scheme, the model and the ``pos=`` that take clips, before anything is
    written (also for ``pos=rel2d_full`` given); the advice runs."""
    from vitrel.train.user_errors import one_line_errors

    base = ["data=moving_fmnist", "data.train_images=8", "data.test_images=8", *VIDEO_MODEL, *FAST[2:], *SHORT]
    for i, pos in enumerate([[], ["pos=rel2d_full"]]):
        run = tmp_path / f"run{i}"
        with pytest.raises(SystemExit) as said, one_line_errors("train.py"):
            train(compose(run, [*base, *pos]))
        name = pos[0].split("=")[1] if pos else compose(tmp_path / "c", base).pos.name
        assert str(said.value) == (
            f"train.py: ConfigError: pos={name} takes image grids (H, W), but vitrel_vit_video_tiny_patch4_32 "
            "attends over a clip's (T, H, W): set pos= one that takes clips: alibi3d, ape, none, rel3d_factored, "
            "rel3d_full, rope3d_axial, rope3d_mixed, rope3d_vjepa2, sincos1d, sincos3d"
        )
        assert not run.exists() or not any(run.iterdir())
    train(compose(tmp_path / "ok", [*base, "pos=rope3d_axial"]))
    assert json.loads((tmp_path / "ok" / "metrics.json").read_text())["status"] == "finished"


def test_the_video_recipe_takes_a_video_folder(video_tree, tmp_path):
    """``experiment=video data=video_folder``, the recipe on one's own clips as docs/video.md names both, stopped at
    composition on "Key 'train_images' not in 'VideoFolderDataConfig'": the recipe's Moving Fashion-MNIST sizes
    are conf/experiment_data/video_moving_fmnist.yaml's, taken only with that data. The folder trains; the recipe
    alone keeps its sizes."""
    own = compose(tmp_path / "recipe", ["experiment=video"]).data
    assert (own.train_images, own.test_images, own.val_fraction, own.num_workers) == (4000, 500, 0.1, 0)
    over = ["experiment=video", "data=video_folder", f"data.root={video_tree}", "data.num_frames=2", "data.stride=1"]
    over += ["data.img_size=16", "data.pin_memory=false", "data.batch_size=4", "data.num_workers=0"]
    over += ["model.embed_dim=16", "model.depth=1", "model.num_heads=2", *FAST[2:], *SHORT]
    cfg = compose(tmp_path / "run", over)
    assert cfg.data.val_fraction == 0.0 and cfg.module.optimizer.lr == 2.0e-3 and cfg.pos.name == "rel3d_full"
    metrics = train(cfg)
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["status"] == "finished"
    assert "test/acc1" in metrics


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-n", "0"]))


def test_a_flip_over_classes_that_tell_left_from_right_is_refused_naming_hflip(tmp_path):
    """Something-Something v2 (its official files) with data=video_list's default flip, 0.5: a flipped "Pushing
    something from left to right" clip shows "... from right to left" under its own label. ``train.py`` stops with
    one line naming the pair and ``data.augment_kwargs.hflip=0``, before a batch is made; with it, the run trains."""
    pytest.importorskip("av", reason="PyAV not installed: pip install -e '.[video]'")
    from tests.data.test_video_lists import ssv2
    from vitrel.train.user_errors import one_line_errors

    pushing = ["Pushing [something] from left to right", "Pushing [something] from right to left"]
    holding = "Holding [something] next to [something]"
    ssv2(tmp_path / "ssv2", [("1", pushing[0]), ("2", pushing[1]), ("3", holding)], [("4", holding)])
    data = ["data=video_list", f"data.root={tmp_path / 'ssv2'}", "data.video_dir=videos"]
    data += ["data.train_list=something-something-v2-train.json"]
    data += ["data.val_list=something-something-v2-validation.json"]
    data += ["data.labels_file=something-something-v2-labels.json", "data.num_frames=2", "data.stride=1"]
    data += ["data.img_size=16", "data.batch_size=3", "data.pin_memory=false", "data.num_workers=0"]
    over = [*data, *VIDEO_MODEL, "pos=rel3d_factored", *FAST[2:], *SHORT]
    with pytest.raises(SystemExit) as stop, one_line_errors("train.py"):
        train(compose(tmp_path / "a", over))
    message = str(stop.value)
    assert message.startswith("train.py: ConfigError: data.augment_kwargs.hflip=0.5 flips training samples"), message
    assert "('Pushing something from left to right' / 'Pushing something from right to left')" in message, message
    assert message.endswith("Set data.augment_kwargs.hflip=0 (as V-JEPA 2 and VideoMAE train Something-Something v2)")
    assert not (tmp_path / "a" / "checkpoints").exists()
    train(compose(tmp_path / "b", [*over, "data.augment_kwargs.hflip=0"]))
    assert json.loads((tmp_path / "b" / "metrics.json").read_text())["global_step"] == 1


def test_mirrored_classes_and_which_flip_a_data_module_trains_with():
    from vitrel.data.fashion_mnist import FashionMNISTDataModule as Fmnist
    from vitrel.train.data_contract import mirrored_classes

    names = ["Turn left ahead", "Turn RIGHT ahead", "Keep right", "Keep left", "Stop", "leftover right", "left"]
    assert mirrored_classes(names) == [("Turn left ahead", "Turn RIGHT ahead"), ("Keep right", "Keep left")]
    assert mirrored_classes(["Pushing something from left to right"]) == []  # (its pair absent: nothing to confuse)
    # folder names (an audit's: flips were let through for them): snake_case and CamelCase words, not inside a word
    folders = ["swipe_left", "swipe_right", "TurnLeft", "TurnRight", "bright", "upright", "copyleft", "copyright"]
    assert mirrored_classes(folders) == [("swipe_left", "swipe_right"), ("TurnLeft", "TurnRight")]
    # folders numbered to sort them (the audit's 10_left_arrow / 11_right_arrow); a number inside a name still counts
    numbered = ["10_left_arrow", "11_right_arrow", "03 - Swipe Left", "04 - Swipe Right", "lane2_left", "lane3_right"]
    assert mirrored_classes(numbered) == [("10_left_arrow", "11_right_arrow"), ("03 - Swipe Left", "04 - Swipe Right")]
    assert Fmnist(loader="memory", augment=True).train_flip == ("data.batch_augment.hflip", 0.5)
    assert Fmnist(loader="workers", augment=True).train_flip == ("data.augment_kwargs.hflip", 0.5)
    assert Fmnist(loader="workers", augment=True, augment_kwargs={"hflip": 0.2}).train_flip[1] == 0.2
    assert Fmnist(loader="memory", augment=False).train_flip[1] == 0.0
