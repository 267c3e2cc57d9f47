"""A first video folder of one's own (``data=video_folder data.root=...``) with what such folders hold: a file that
does not decode, a video of one frame, and (image folders too) a class folder that is a broken link. The file that
does not decode stops the run with one line naming it and ``data.on_bad_sample=skip``, or, skipped, is named and
counted (as the image folders' bad files: tests/data/test_bad_files.py); a video far shorter than a clip and a
broken class link are each named in one warning."""

from __future__ import annotations

import logging
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from tests.data.test_bad_files import batches, lightning_passes, stopping_line
from tests.data.test_datamodules import make_imagenet_tree
from tests.data.test_video import needs_av, write_video
from vitrel.data import ImageNetDataModule
from vitrel.data.video import VideoClips, VideoFolderDataModule
from vitrel.data.video.clips import VideoDecodeError, read_clip

WIDTH = {0: 16, 1: 24}  # class a's videos are 16 pixels wide, class b's 24: a clip's class shows in its shape


def video_tree(root: Path) -> Path:
    """train/a/{0,1,2}.mkv, train/b/{0,1}.mkv, val/<a, b>/0.mkv; train/a/2.mkv does not decode (sorted, the
    next file after it is train/b/0.mkv)."""
    for split, per_class in (("train", {"a": 3, "b": 2}), ("val", {"a": 1, "b": 1})):
        for c, (cls, n) in enumerate(per_class.items()):
            for k in range(n):
                write_video(root / split / cls / f"{k}.mkv", 5, hw=(16, WIDTH[c]))
    (root / "train" / "a" / "2.mkv").write_bytes(b"not a video" * 50)
    return root / "train" / "a" / "2.mkv"


def module(root: Path, **kwargs) -> VideoFolderDataModule:
    kwargs = {"num_frames": 2, "stride": 1, "img_size": 16, "augment": False, "batch_size": 2, "num_workers": 0,
              "pin_memory": False, "drop_last": False, **kwargs}  # fmt: skip
    dm = VideoFolderDataModule(root=root, **kwargs)
    dm.setup("fit")
    return dm


@needs_av
@pytest.mark.parametrize("workers", [0, 1])
def test_an_undecodable_video_is_one_line_naming_it_and_the_option_that_skips(tmp_path, workers):
    bad = video_tree(tmp_path)
    message = stopping_line(module(tmp_path, num_workers=workers))
    assert message.startswith(f"train.py: VideoDecodeError: cannot read video {bad}: "), message
    assert "; data.on_bad_sample=skip leaves such files out" in message, message
    assert "\n" not in message and "Traceback" not in message
    with pytest.raises(ValueError, match="on_bad_sample must be one of"):
        VideoFolderDataModule(root=tmp_path, on_bad_sample="ignore")


@needs_av
@pytest.mark.parametrize("workers", [0, 1])
def test_skip_names_an_undecodable_video_counts_it_and_keeps_every_label(tmp_path, workers, caplog):
    """``on_bad_sample=skip`` in training: every pass yields a sample per file, the bad file's place taken by the
    next video that decodes, with that video's own label; the file is named (in the process that read it), the count
    logged at the end of each epoch."""
    bad = video_tree(tmp_path)
    dm = module(tmp_path, num_workers=workers, on_bad_sample="skip")
    with caplog.at_level(logging.WARNING):
        seen = lightning_passes(dm, epochs=2).seen["train"]
    assert sorted(batches(seen[: len(seen) // 2])[1].tolist()) == [0, 0, 1, 1, 1]  # train/b/0.mkv twice, as itself
    count = "skipped 1 unreadable video file(s) in this pass over train (data.on_bad_sample=skip"
    assert caplog.text.count(count) == 2, caplog.text
    if workers == 0:  # (a worker's own warnings go to its console)
        assert caplog.text.count(f"skipped {bad}: cannot read it") == 1, caplog.text
    raw = dm.make_dataset("train", transform=lambda clip: clip, training=True)  # uint8 [T, 3, H, W], its own width
    samples = [raw[i] for i in range(len(raw))]
    assert [y for _, y in samples] == [0, 0, 1, 1, 1]
    assert all(clip.shape[-1] == WIDTH[y] for clip, y in samples)


@needs_av
@pytest.mark.parametrize("workers", [0, 1])
def test_evaluation_scores_each_video_that_decodes_once(tmp_path, workers, caplog):
    """``on_bad_sample=skip`` in validation and test: val/a/0.mkv does not decode; it is left out, named in one line
    a pass, and the videos that decode are scored once each (the old replacement scored val/a/1.mkv twice)."""
    video_tree(tmp_path)
    write_video(tmp_path / "val" / "a" / "1.mkv", 5, hw=(16, WIDTH[0]))
    (tmp_path / "val" / "a" / "0.mkv").write_bytes(b"not a video" * 50)
    dm = module(tmp_path, num_workers=workers, on_bad_sample="skip", train_dir="val")  # (train/ has its own bad file)
    with caplog.at_level(logging.WARNING):
        rec = lightning_passes(dm, epochs=1, test=True)
    for stage in ("val", "test"):
        assert batches(rec.seen[stage])[1].tolist() == [0, 1]  # val/a/1.mkv, val/b/0.mkv
        line = f"{stage}: 1 unreadable video file(s) left out of 3 in {tmp_path / 'val'} (data.on_bad_sample=skip; "
        assert caplog.text.count(line + "the others each scored once): a/0.mkv") == 1, caplog.text
    assert sorted(batches(rec.seen["train"])[1].tolist()) == [0, 0, 1]  # (training, the same files: a/1.mkv twice)


@needs_av
def test_a_video_far_shorter_than_a_clip_is_named_once(tmp_path, caplog):
    """A clip of 4 frames 2 apart spans 7 frames: a video of fewer than half of them (1 or 3 frames) gives clips
    mostly of its last frame, named in one warning however often it is read; 4 frames pass in silence."""
    videos = [(str(write_video(tmp_path / f"{n}.mkv", n)), 0) for n in (1, 3, 4)]
    ds = VideoClips(videos, num_frames=4, stride=2, sampling="random")
    with caplog.at_level(logging.WARNING, logger="vitrel.data.video.sampling"):
        for _ in range(2):
            for i in range(3):
                assert ds[i][0].shape[0] == 4
    for n in (1, 3):
        line = f"{tmp_path / f'{n}.mkv'} has {n} frame(s), fewer than half the 7 a clip of 4 frames 2 apart spans"
        assert caplog.text.count(line) == 1, caplog.text
    assert "4.mkv" not in caplog.text


@pytest.mark.parametrize("kind", ["image", "video"])
def test_a_class_folder_that_is_a_broken_link_is_named(tmp_path, kind, caplog):
    """A class folder linked to a folder that is gone (an unmounted disk, a moved download) is no class; one
    warning names it, in train/ or val/, rather than a class silently missing."""
    if kind == "image":
        make_imagenet_tree(tmp_path)
        dm, classes = ImageNetDataModule(root=tmp_path), ["n0001", "n0002", "n0003"]
    else:
        pytest.importorskip("av")
        video_tree(tmp_path)
        dm, classes = VideoFolderDataModule(root=tmp_path), ["a", "b"]
    gone = [tmp_path / "train" / "zz_gone", tmp_path / "val" / "zz_gone"]
    for link in gone:
        link.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with caplog.at_level(logging.WARNING, logger="vitrel.data.imagenet"):
        assert dm.classes == classes and dm.num_classes == len(classes)
    for link in gone:
        assert caplog.text.count(f"{link} is a link to {tmp_path / 'elsewhere'}, which does not exist") == 1


def write_resized_video(path: Path) -> Path:
    """Six MJPEG frames in Matroska, 32 x 48 then 40 x 64 from frame 3 (a stream that changes size, as a WebM may):
    the larger frames come from a second encoder, muxed into the one stream."""
    import av

    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mjpeg", rate=25)
        stream.height, stream.width, stream.pix_fmt = 32, 48, "yuvj420p"
        larger = av.CodecContext.create("mjpeg", "w")
        larger.height, larger.width, larger.pix_fmt, larger.time_base = 40, 64, "yuvj420p", Fraction(1, 25)
        for i, (h, w) in enumerate([(32, 48)] * 3 + [(40, 64)] * 3):
            frame = av.VideoFrame.from_ndarray(np.full((h, w, 3), 20 * i, np.uint8), format="rgb24")
            frame = frame.reformat(format="yuvj420p")
            for packet in (stream if w == 48 else larger).encode(frame):
                packet.stream, packet.pts, packet.dts = stream, i, i
                container.mux(packet)
        container.mux(stream.encode())
    return path


@needs_av
def test_a_video_whose_frames_change_size_is_one_line_naming_the_sizes_and_the_re_encode(tmp_path):
    """Before, the frames met in ``np.stack``: "all input arrays must have the same shape", naming no file."""
    path = write_resized_video(tmp_path / "resized.mkv")
    with pytest.raises(VideoDecodeError) as e:
        read_clip(path, lambda n: list(range(n)))
    assert str(e.value) == (
        f"cannot read video {path}: its frames change size (32x48 at frame 0, 40x64 at frame 3); re-encode it at "
        f"one size, e.g. ffmpeg -i {path} -vf scale=48:32 out.mp4"
    )
    assert read_clip(path, lambda n: [3, 5]).shape == (2, 3, 40, 64)  # (a clip within one size reads)
    assert read_clip(path, lambda n: [0, 0, 2]).shape == (3, 3, 32, 48)
