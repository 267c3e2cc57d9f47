"""Which video stream of a file vitrel reads: libavformat's choice (``av_find_best_stream``, ffplay's), not the
first video stream, which can be a cover or preview still stored before the video (a Matroska track); and
not an audio file's cover art, the only video stream there."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from vitrel.data.video import VideoClips
from vitrel.data.video.clips import VideoDecodeError, count_frames, read_clip

av = pytest.importorskip("av", reason="PyAV not installed: pip install -e '.[video]'")

LEVEL = 12  # frame i of the video painted at brightness 8 + LEVEL * i


def write_still_then_video(path: Path, frames: int = 12, hw=(32, 48)) -> Path:
    """Stream 0: one 16 x 16 white still (MJPEG); stream 1: ``frames`` grey frames of ``hw``, frame ``i`` at
    brightness ``8 + LEVEL * i`` (lossless FFV1)."""
    with av.open(str(path), "w") as c:
        still = c.add_stream("mjpeg", rate=1)
        still.width, still.height, still.pix_fmt = 16, 16, "yuvj420p"
        video = c.add_stream("ffv1", rate=25)
        video.height, video.width = hw
        video.pix_fmt = "gray"
        for p in [*still.encode(av.VideoFrame.from_ndarray(np.full((16, 16, 3), 255, np.uint8), "rgb24"))]:
            c.mux(p)
        for p in still.encode():
            c.mux(p)
        for i in range(frames):
            for p in video.encode(av.VideoFrame.from_ndarray(np.full(hw, 8 + LEVEL * i, np.uint8), "gray")):
                c.mux(p)
        for p in video.encode():
            c.mux(p)
    with av.open(str(path)) as c:  # (the layout this test is about: the still first)
        assert [s.codec_context.name for s in c.streams.video] == ["mjpeg", "ffv1"]
        assert c.streams.best("video").index == 1
    return path


def test_the_video_is_read_not_a_still_stored_before_it(tmp_path):
    path = write_still_then_video(tmp_path / "cover_first.mkv")
    assert count_frames(path) == 12  # (was 1: the still's)
    clip = read_clip(path, lambda n: [0, 3, 6, 9, 11])
    assert tuple(clip.shape) == (5, 3, 32, 48)  # (was [1, 3, 16, 16], the still repeated)
    levels = clip.double().mean((1, 2, 3)).numpy()
    assert np.rint((levels - 8) / LEVEL).astype(int).tolist() == [0, 3, 6, 9, 11]
    x, _ = VideoClips([(str(path), 0)], num_frames=4, stride=3)[0]  # the centre clip of the 12 frames
    assert tuple(x.shape) == (4, 3, 32, 48)
    assert np.rint((x.double().mean((1, 2, 3)).numpy() - 8) / LEVEL).astype(int).tolist() == [1, 4, 7, 10]


def write_song_with_cover(path: Path) -> Path:
    """An MP4 holding AAC audio and a 32 x 32 cover picture (an attached-picture video stream), as a music download;
    no video."""
    with av.open(str(path), "w") as c:
        audio = c.add_stream("aac", rate=44100)
        cover = c.add_stream("mjpeg")
        cover.width, cover.height, cover.pix_fmt = 32, 32, "yuvj420p"
        cover.disposition = av.stream.Disposition.attached_pic
        picture = av.VideoFrame.from_ndarray(np.full((32, 32, 3), 100, np.uint8), "rgb24").reformat(format="yuvj420p")
        for p in [*cover.encode(picture), *cover.encode()]:
            c.mux(p)
        sound = av.AudioFrame.from_ndarray(np.zeros((1, 1024 * 20), np.float32), format="fltp", layout="mono")
        sound.sample_rate = 44100
        for p in [*audio.encode(sound), *audio.encode()]:
            c.mux(p)
    return path


def test_an_audio_file_with_cover_art_is_not_a_one_frame_video(tmp_path):
    """Before, its cover was read as a video of one frame, every clip that picture repeated."""
    path = write_song_with_cover(tmp_path / "song.mp4")
    for read in (count_frames, lambda p: read_clip(p, lambda n: [0])):
        with pytest.raises(VideoDecodeError, match="only an attached picture") as e:
            read(path)
        assert str(e.value) == (
            f"cannot read video {path}: it holds no video, only an attached picture (an audio file's cover art)"
        )
