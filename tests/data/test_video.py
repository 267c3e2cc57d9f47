"""vitrel.data.video and vitrel.data.moving_fmnist: clips the tests encode themselves (PyAV: H.264, MPEG-4, VP9,
lossless FFV1), decoded frame by frame against what was written; the clip sampling's indices; one augmentation per
clip; the errors; Moving Fashion-MNIST's determinism and its reversal property; the DataModules' batches."""

from __future__ import annotations

import hashlib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra.utils import instantiate

from vitrel.data import DatasetNotFoundError
from vitrel.data.datasets import DatasetIntegrityError
from vitrel.data.moving_fmnist import ORIENTATIONS, MovingFMNISTDataModule
from vitrel.data.video import (
    ClipTransform,
    VideoClips,
    VideoDecodeError,
    VideoFolderDataModule,
    clip_indices,
    random_start,
    uniform_starts,
)

try:
    import av
except ImportError:  # the "video" extra (in "dev"); Moving Fashion-MNIST needs no decoder
    av = None
needs_av = pytest.mark.skipif(av is None, reason="PyAV not installed: pip install -e '.[video]'")

CONF = Path(__file__).resolve().parents[2] / "conf"
LEVEL = 12  # frame i is painted with brightness 8 + LEVEL * i (up to 20 frames)


def frame_values(n: int) -> np.ndarray:
    return 8 + LEVEL * np.arange(n)


def write_video(path: Path, n: int, codec: str = "ffv1", pix_fmt: str = "gray", hw=(32, 48)) -> Path:
    """``n`` frames of ``hw`` grey pixels, frame ``i`` at brightness ``frame_values(n)[i]`` except for a bright
    3 x 5 block in the top-left corner (so an orientation or flip mistake shows)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    images = [np.full(hw, v, np.uint8) for v in frame_values(n)]
    for img in images:
        img[:3, :5] = 250
    return _encode(path, images, codec, pix_fmt, "gray")


def _encode(path: Path, images, codec: str, pix_fmt: str, fmt: str, turn=None) -> Path:
    """``images`` (``[H, W]`` or ``[H, W, 3]`` uint8, PyAV's ``fmt``) coded with ``codec`` into ``path``; ``turn``:
    ``stream.set_display_rotation``'s ``(rotation, hflip, vflip)``, a display matrix (None: none written)."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=25)
        stream.height, stream.width = images[0].shape[:2]
        stream.pix_fmt = pix_fmt
        if turn is not None:
            stream.set_display_rotation(turn[0], hflip=turn[1], vflip=turn[2])
        for img in images:
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format=fmt)):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def frame_ids(clip: torch.Tensor) -> list[int]:
    """The index of each decoded frame, from its brightness away from the corner block (uint8 [T, 3, H, W])."""
    levels = clip[:, :, 8:, 8:].double().mean((1, 2, 3)).numpy()
    return np.rint((levels - 8) / LEVEL).astype(int).tolist()


def data_config(name: str, **overrides):
    from hydra import compose, initialize_config_dir

    import vitrel.config  # noqa: F401 - the schemas the configs extend

    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=[f"data={name}"] + [f"data.{k}={v}" for k, v in overrides.items()]).data
    return cfg


@needs_av
# ------------------------------------------------------------------------------------------------ decoding
@pytest.mark.parametrize(
    "name, codec, pix_fmt, tol",
    [
        ("lossless.mkv", "ffv1", "gray", 0),  # Matroska states no frame count: counted from the packets
        ("lossless.avi", "ffv1", "yuv420p", 1),  # (grey -> limited-range YUV -> RGB rounds by 1)
        ("h264.mp4", "libx264", "yuv420p", 4),
        ("mpeg4.mp4", "mpeg4", "yuv420p", 6),
        ("vp9.webm", "libvpx-vp9", "yuv420p", 6),
    ],
)
def test_decoded_frames_are_the_written_ones_in_order(tmp_path, name, codec, pix_fmt, tol):
    path = write_video(tmp_path / name, 9, codec, pix_fmt)
    clip, label = VideoClips([(str(path), 3)], num_frames=9, stride=1)[0]
    assert clip.dtype == torch.uint8 and clip.shape == (9, 3, 32, 48) and label == 3  # [T, C, H, W], H x W kept
    want = torch.from_numpy(frame_values(9).astype(np.float64))
    body = clip[:, :, 8:, 8:].double()
    assert (body - want[:, None, None, None]).abs().max() <= tol, (body.amin((1, 2, 3)), want)
    corner = clip[:, :, :3, :5].double()  # the bright block stays top-left (lossy codecs blur its edge)
    assert (corner - 250).abs().max() <= tol if codec == "ffv1" else (corner.mean((1, 2, 3)) > want + 100).all()
    assert frame_ids(clip) == list(range(9))


def _write_oriented(path: Path, rotation: int, hflip: bool, vflip: bool) -> Path:
    """Four frames with a bright block top-left, H.264 in MP4, with a display matrix (None: none written)."""
    images = [np.full((32, 48, 3), 20 + 30 * i, np.uint8) for i in range(4)]
    for img in images:
        img[:6, :10] = 250
    turn = None if rotation is None else (rotation, hflip, vflip)
    return _encode(path, images, "libx264", "yuv420p", "rgb24", turn)


@needs_av
@pytest.mark.skipif(
    av is None or not hasattr(av.video.stream.VideoStream, "set_display_rotation"), reason="PyAV writes no matrix"
)
@pytest.mark.parametrize(
    "rotation, hflip, vflip, upright",  # upright: what ffmpeg's autorotation (and a player) shows, on [H, W, ...]
    [
        (-90, False, False, lambda x: np.rot90(x, -1)),  # a phone held upright: transpose=clock
        (90, False, False, lambda x: np.rot90(x, 1)),  # transpose=cclock
        (180, False, False, lambda x: x[::-1, ::-1]),  # hflip, vflip
        (0, True, False, lambda x: x[:, ::-1]),  # hflip (a mirrored front camera)
        (0, False, True, lambda x: x[::-1]),  # vflip
        (90, True, False, lambda x: np.rot90(x, -1)[::-1]),  # transpose=clock_flip
    ],
)
def test_frames_are_turned_upright_by_the_display_matrix(tmp_path, rotation, hflip, vflip, upright):
    """Phones store portrait video as landscape frames plus a display matrix; players and ffmpeg turn the frames
    by it, and so must the clips (else a portrait video trains and predicts on its side)."""
    plain = _write_oriented(tmp_path / "plain.mp4", None, False, False)  # the same frames, the same bytes coded
    turned = _write_oriented(tmp_path / "turned.mp4", rotation, hflip, vflip)
    raw = VideoClips([(str(plain), 0)], num_frames=4, stride=1)[0][0].permute(2, 3, 0, 1).numpy()  # [H, W, T, C]
    clip = VideoClips([(str(turned), 0)], num_frames=4, stride=1)[0][0]
    want = torch.from_numpy(np.ascontiguousarray(upright(raw))).permute(2, 3, 0, 1)
    assert clip.shape == want.shape and torch.equal(clip, want)


# ------------------------------------------------------------------------------------------------ sampling
def test_clip_indices_and_padding():
    assert clip_indices(20, 4, 3, 5).tolist() == [5, 8, 11, 14]
    assert clip_indices(5, 4, 2, 0).tolist() == [0, 2, 4, 4]  # a short video repeats its last frame
    assert clip_indices(1, 3, 1, 0).tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="start=5"):
        clip_indices(5, 2, 1, 5)


def test_uniform_starts_are_evenly_spaced_and_random_starts_cover_the_range():
    # span (4 - 1) * 3 + 1 = 10 frames of 20: starts 0 .. 10
    assert uniform_starts(20, 4, 3, 3) == [0, 5, 10]
    assert uniform_starts(20, 4, 3, 4) == [0, 3, 6, 10]
    assert uniform_starts(20, 4, 3, 1) == [5]  # one clip: the centre
    assert uniform_starts(6, 4, 3, 3) == [0, 0, 0]  # shorter than the span
    g = torch.Generator().manual_seed(0)
    starts = Counter(random_start(20, 4, 3, generator=g) for _ in range(2000))
    assert sorted(starts) == list(range(11)) and min(starts.values()) > 120  # uniform over 0 .. 10
    assert {random_start(6, 4, 3) for _ in range(20)} == {0}


@pytest.fixture(scope="module")
def long_video(tmp_path_factory) -> Path:
    return write_video(tmp_path_factory.mktemp("v") / "twenty.mkv", 20)


@needs_av
def test_uniform_clips_decode_the_specified_frames(long_video):
    ds = VideoClips([(str(long_video), 0)], num_frames=4, stride=3, sampling="uniform", clips_per_video=3)
    assert len(ds) == 1  # one sample per video: its 3 clips, uint8 [K, T, 3, H, W] without a transform
    clips, label = ds[0]
    assert clips.dtype == torch.uint8 and clips.shape == (3, 4, 3, 32, 48) and label == 0
    assert [frame_ids(c) for c in clips] == [[0, 3, 6, 9], [5, 8, 11, 14], [10, 13, 16, 19]]


@needs_av
def test_random_clips_are_strided_runs_from_random_starts(long_video):
    ds = VideoClips([(str(long_video), 0)], num_frames=4, stride=3, sampling="random")
    torch.manual_seed(0)
    seen = [frame_ids(ds[0][0]) for _ in range(30)]
    assert all(ids == list(range(ids[0], ids[0] + 10, 3)) and 0 <= ids[0] <= 10 for ids in seen)
    assert len({ids[0] for ids in seen}) >= 6  # fresh starts
    torch.manual_seed(0)
    assert [frame_ids(ds[0][0]) for _ in range(30)] == seen  # seeded by torch's generator


@needs_av
def test_a_short_video_is_padded_with_its_last_frame(tmp_path):
    path = write_video(tmp_path / "five.mkv", 5)
    for sampling in ("uniform", "random"):
        clip = VideoClips([(str(path), 0)], num_frames=4, stride=2, sampling=sampling)[0][0]
        assert frame_ids(clip) == [0, 2, 4, 4]


@needs_av
def test_a_stream_shorter_than_its_header_is_sampled_from_what_decodes(long_video, monkeypatch):
    import vitrel.data.video.clips as clips

    monkeypatch.setattr(clips, "count_frames", lambda path: 26)  # the container overstates: 26 frames, 20 decode
    ds = VideoClips([(str(long_video), 0)], num_frames=4, stride=3, clips_per_video=2)
    with pytest.warns(UserWarning, match="twenty.mkv: the container states 26 frames but 20 decode"):
        assert frame_ids(ds[0][0][1]) == [10, 13, 16, 19]  # the last clip of 20 frames (of 26: frames 16 .. 25)


# ------------------------------------------------------------------------------------------------ transforms
def test_training_augmentation_is_one_draw_per_clip():
    """Identical frames stay identical after the random resized crop and flip; the draws do vary."""
    torch.manual_seed(0)
    frame = torch.randint(0, 256, (1, 3, 40, 50), dtype=torch.uint8)
    clip = frame.expand(6, -1, -1, -1).contiguous()
    tf = ClipTransform(24, (0.5, 0.4, 0.3), (0.2, 0.25, 0.3), train=True, scale=(0.2, 1.0), hflip=0.5)
    outs = [tf(clip) for _ in range(8)]
    for out in outs:
        assert out.shape == (3, 6, 24, 24) and out.dtype == torch.float32
        assert all(torch.equal(out[:, 0], out[:, t]) for t in range(1, 6))
    assert len({hashlib.sha1(o.numpy().tobytes()).hexdigest() for o in outs}) == 8


def test_evaluation_transform_is_resize_centre_crop_normalise():
    """Against the frames resized one by one in float64 (shorter side to floor(24 / 0.75) = 32, the centre
    24 x 24), normalised, at [:, t]."""
    import torchvision.transforms.functional as TF

    torch.manual_seed(1)
    clip = torch.randint(0, 256, (3, 3, 40, 60), dtype=torch.uint8)
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    out = ClipTransform(24, mean, std, crop_pct=0.75)(clip)
    assert out.shape == (3, 3, 24, 24)
    for t in range(3):
        ref = TF.center_crop(TF.resize(clip[t].double(), [32], antialias=True), [24, 24]).round() / 255
        ref = (ref - torch.tensor(mean, dtype=torch.float64)[:, None, None]) / torch.tensor(std)[:, None, None]
        assert (out[:, t].double() - ref).abs().max() < 1e-2 / 0.2  # (uint8 rounding of the resized frame)
    same = torch.randint(0, 256, (2, 1, 24, 24), dtype=torch.uint8)
    exact = ClipTransform(24, (0.25,), (0.5,))(same)  # native size: no resampling at all
    assert torch.equal(exact, ((same.float() / 255 - 0.25) / 0.5).permute(1, 0, 2, 3))


def test_spatial_crops_are_pytorchvideos_uniform_crops():
    """3 crops start as PyTorchVideo's ``uniform_crop`` (spatial_idx 0, 1, 2: offset 0, ``ceil((L - size) / 2)``,
    ``L - size``) along the longer side, centred on the shorter (``round((S - size) / 2)``); each view is its pixels
    exactly (a clip already at the scaled size, crop_pct 1: no resampling along the width the crops cut)."""
    import math

    from vitrel.data.video.transforms import crop_starts

    for length in (16, 17, 27, 40):
        offsets = [0, math.ceil((length - 16) / 2), length - 16]
        assert crop_starts(length, 16, 3) == offsets, length
    assert crop_starts(27, 16, 1) == [round(11 / 2)] and crop_starts(26, 16, 5) == [0, 3, 5, 8, 10]
    clip = torch.randint(0, 256, (2, 1, 16, 27), dtype=torch.uint8)  # [T, C, H, W], landscape
    views = ClipTransform(16, (0.0,), (1.0,), crops=3)(clip)
    assert views.shape == (3, 1, 2, 16, 16)
    for v, left in zip(views, (0, 6, 11), strict=True):
        torch.testing.assert_close(v, (clip[..., left : left + 16].float() / 255).permute(1, 0, 2, 3))
    tall = ClipTransform(16, (0.0,), (1.0,), crops=3)(clip.transpose(-1, -2))  # portrait: crops down its height
    torch.testing.assert_close(tall[2], (clip.transpose(-1, -2)[..., 11:27, :].float() / 255).permute(1, 0, 2, 3))
    with pytest.raises(ValueError, match="spatial_crops must be an integer >= 1"):
        ClipTransform(16, (0.0,), (1.0,), crops=0)


# ------------------------------------------------------------------------------------------------ errors
@needs_av
def test_a_damaged_file_or_one_without_video_is_named(tmp_path):
    junk = tmp_path / "broken.mp4"
    junk.write_bytes(b"not a video" * 50)
    with pytest.raises(VideoDecodeError, match="broken.mp4"):
        VideoClips([(str(junk), 0)], num_frames=2)[0]
    cut = tmp_path / "cut.mp4"
    whole = write_video(tmp_path / "whole.mp4", 8, "libx264", "yuv420p").read_bytes()
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(VideoDecodeError, match="cut.mp4"):
        VideoClips([(str(cut), 0)], num_frames=2)[0]
    audio = tmp_path / "audio_only.mkv"
    with av.open(str(audio), "w") as c:
        s = c.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        for p in [*s.encode(frame), *s.encode()]:
            c.mux(p)
    with pytest.raises(VideoDecodeError, match=r"audio_only.mkv: it has no video stream \(streams: audio\)"):
        VideoClips([(str(audio), 0)], num_frames=2)[0]


@needs_av
def test_folder_errors_name_the_folder(tmp_path):
    with pytest.raises(DatasetNotFoundError, match="No folder"):
        _ = VideoFolderDataModule(root=tmp_path).num_classes
    (tmp_path / "train" / "jump").mkdir(parents=True)
    (tmp_path / "val").mkdir()
    write_video(tmp_path / "train" / "run" / "a.mkv", 3)
    with pytest.raises(DatasetNotFoundError, match=r"val has no class folders"):
        _ = VideoFolderDataModule(root=tmp_path).num_classes
    assert VideoFolderDataModule(root=tmp_path, num_classes=5).num_classes == 5  # (a model built before the data)
    write_video(tmp_path / "val" / "run" / "b.mkv", 3)
    dm = VideoFolderDataModule(root=tmp_path, num_workers=0)
    with pytest.raises(FileNotFoundError, match=r"train.*jump.*video files: \.mp4"):
        dm.setup("fit")
    write_video(tmp_path / "val" / "swim" / "b.mkv", 3)
    # a data set error (train.py and eval.py print its line alone, no traceback), still a ValueError
    with pytest.raises(DatasetIntegrityError, match=r"class folders not in .*\['swim'\]") as e:
        _ = VideoFolderDataModule(root=tmp_path).num_classes
    assert isinstance(e.value, ValueError)
    with pytest.raises(ValueError, match="image options"):
        VideoFolderDataModule(root=tmp_path, canvas_size=64)


# ------------------------------------------------------------------------------------------------ modules
@pytest.fixture(scope="module")
def video_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("videos")
    for split, per_class in (("train", 3), ("val", 2)):
        for c, cls in enumerate(("archery", "bowling")):
            for k in range(per_class):  # lengths 7 .. 11: with num_frames=4, stride=2 (span 7) some padding-free
                write_video(root / split / cls / f"{cls}_{k}.avi", 7 + 2 * k + c, "ffv1", "yuv420p", hw=(30, 40))
    return root


@needs_av
def test_video_folder_config_gives_clip_batches(video_root):
    """data=video_folder as train.py composes it: batches [B, C, T, H, W], the classes from the folders."""
    cfg = data_config(
        "video_folder", root=video_root, num_frames=4, stride=2, clips_per_video=2, img_size=16, batch_size=2
    )
    cfg.num_workers, cfg.pin_memory = 0, False
    dm = instantiate(cfg)
    assert type(dm) is VideoFolderDataModule and dm.name == "video_folder"
    assert (dm.num_classes, dm.class_names, dm.input_size) == (2, ["archery", "bowling"], (3, 4, 16, 16))
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (2, 3, 4, 16, 16) and x.dtype == torch.float32 and set(y.tolist()) <= {0, 1}
    val = dm.dataset("val")  # a sample per video: its 2 clips
    assert len(val) == 4 and [val[i][1] for i in range(4)] == [0, 0, 1, 1]
    xs = torch.cat([b[0] for b in dm.val_dataloader()])
    assert xs.shape == (4, 2, 3, 4, 16, 16)  # [videos, K, C, T, H, W]
    raw = VideoClips(dm.raw_dataset("val"), 4, stride=2, clips_per_video=2)  # undecorated: check the frames
    assert [frame_ids(c) for c in raw[0][0]] == [[0, 2, 4, 6], [0, 2, 4, 6]]  # 7 frames: both clips at 0
    assert [frame_ids(c) for c in raw[3][0]] == [[0, 2, 4, 6], [3, 5, 7, 9]]  # 10 frames: starts 0, 3
    longer = dm.make_dataset("test", num_frames=6)
    assert longer[0][0].shape == (2, 3, 6, 16, 16)
    one = instantiate(data_config("video_folder", root=video_root, num_frames=4, stride=2, img_size=16))
    one.setup("validate")  # one clip per video (the default): the clip itself, as training's
    assert len(one.dataset("val")) == 4 and one.dataset("val")[3][0].shape == (3, 4, 16, 16)


@needs_av
def test_training_without_augmentation_takes_one_view_whatever_the_evaluations_crops(video_root):
    """``data.augment=false`` with ``data.spatial_crops=3`` (the V-JEPA 2 / VideoMAE recipes' crops) made every training
    sample the 3 evaluation views stacked, ``[3, C, T, H, W]``, and the first step failed with a traceback: training
    takes one clip, resized and centre-cropped; evaluation keeps its 3 crops."""
    cfg = data_config("video_folder", root=video_root, num_frames=4, stride=2, img_size=16, batch_size=2)
    cfg.num_workers, cfg.pin_memory, cfg.augment, cfg.spatial_crops = 0, False, False, 3
    dm = instantiate(cfg)
    assert dm.make_dataset("train", training=True)[0][0].shape == (3, 4, 16, 16)
    assert next(iter(dm.train_dataloader()))[0].shape == (2, 3, 4, 16, 16)
    assert dm.make_dataset("val")[0][0].shape == (3, 3, 4, 16, 16)  # [crops, C, T, H, W]


@needs_av
@pytest.mark.parametrize("crops", [1, 3])
def test_a_videos_sample_is_its_clips_decoded_and_transformed_by_hand(video_root, crops):
    """data=video_folder with 2 clips per video: sample i of val is video i's 2 uniform clips, each frame decoded
    with PyAV, picked by the sampling equations (module docstring of vitrel/data/video/clips.py), resized (shorter
    side to floor(16 / 0.8) = 20, bicubic), centre-cropped to 16 x 16 and normalised in float64, by hand. With
    ``spatial_crops=3`` each clip gives 3 views: of the 20 x 26 frames, the columns 0, 5 and 10 onwards
    (``ceil(i (26 - 16) / 2)``), the rows 2 onwards (centred), clip 0's views first."""
    import torchvision.transforms.functional as TF
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

    cfg = data_config("video_folder", root=video_root, num_frames=4, stride=2, clips_per_video=2, img_size=16)
    cfg.crop_pct, cfg.interpolation, cfg.spatial_crops = 0.8, "bicubic", crops
    val = instantiate(cfg).make_dataset("val")
    mean = torch.tensor(IMAGENET_DEFAULT_MEAN, dtype=torch.float64)[:, None, None]
    std = torch.tensor(IMAGENET_DEFAULT_STD, dtype=torch.float64)[:, None, None]
    paths = sorted((video_root / "val").rglob("*.avi"))
    assert len(val) == len(paths) == 4
    for i, path in enumerate(paths):
        with av.open(str(path)) as container:
            decoded = [
                torch.from_numpy(f.to_ndarray(format="rgb24")).permute(2, 0, 1) for f in container.decode(video=0)
            ]
        n = len(decoded)
        delta = max(n - 7, 0)  # span (4 - 1) * 2 + 1
        want = []
        for s in (0, delta):  # K = 2: the first clip at the start, the last at the end
            frames = [decoded[min(s + 2 * t, n - 1)] for t in range(4)]
            frames = [TF.resize(f, [20], TF.InterpolationMode.BICUBIC, antialias=True) for f in frames]
            assert frames[0].shape[-2:] == (20, 26)
            for left in [5] if crops == 1 else [0, 5, 10]:  # (one: the centre crop, round((26 - 16) / 2))
                view = [f[:, 2:18, left : left + 16] for f in frames]
                want.append(torch.stack([(f.double() / 255 - mean) / std for f in view], 1))  # [C, T, H, W]
        clips, label = val[i]
        assert clips.shape == (2 * crops, 3, 4, 16, 16) and clips.dtype == torch.float32
        assert label == int(path.parent.name == "bowling")
        torch.testing.assert_close(clips.double(), torch.stack(want), rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------------------ moving FMNIST
def small_fmnist(**kwargs) -> MovingFMNISTDataModule:
    kwargs = {"train_images": 60, "test_images": 40, "num_workers": 0, "batch_size": 8, **kwargs}
    return MovingFMNISTDataModule(**kwargs)


def clips_of(ds) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*(ds[i] for i in range(len(ds))), strict=True)
    return torch.stack(xs), torch.tensor(ys)


def test_moving_fmnist_is_the_same_bytes_from_the_same_seed():
    a, b, c = (clips_of(small_fmnist(seed=s).raw_dataset("test")) for s in (0, 0, 1))
    assert a[0].dtype == torch.uint8 and a[0].shape == (80, 8, 1, 32, 32)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_moving_fmnist_frames_follow_the_stated_motion():
    """Every clip against the equation, written out pixel by pixel: frame_t[y, x] = canvas[(y - y_t) mod S,
    (x - x_t) mod S], (y_t, x_t) = p + t v (forward), p + (T - 1 - t) v (backward)."""
    dm = small_fmnist(train_images=6, speeds=[1, 3], size=20, object_size=9, num_frames=5)
    raw = dm.raw_dataset("train")
    steps = {ORIENTATIONS[o] for o in (0, 45, 90, 135)}
    for i in range(len(raw)):
        clip, label = raw[i]
        vy, vx, y0, x0 = (int(v) for v in raw.motions[i // 2])
        speed = max(abs(vy), abs(vx))
        assert speed in (1, 3) and (vy // speed, vx // speed) in steps and label == i % 2
        obj = raw.objects[i // 2]
        for t in range(5):
            s = t if label == 0 else 4 - t
            yt, xt = y0 + s * vy, x0 + s * vx
            want = np.zeros((20, 20), np.uint8)
            for y in range(20):
                for x in range(20):
                    oy, ox = (y - yt) % 20, (x - xt) % 20
                    want[y, x] = obj[oy, ox] if oy < 9 and ox < 9 else 0
            assert np.array_equal(clip[t, 0].numpy(), want), (i, t)


def test_a_frame_order_blind_model_is_at_chance_on_moving_fmnist():
    """Clips grouped by their multiset of frames (what a model without temporal position sees): every group
    holds as many forward as backward clips, so any function of the frame set is right on exactly half of
    every split; and each clip's reversal is in its split under the other label."""
    dm = small_fmnist(val_fraction=0.25)
    for split in ("train", "val", "test"):
        x, y = clips_of(dm.raw_dataset(split))
        groups: dict[tuple, Counter] = {}
        for clip, label in zip(x, y.tolist(), strict=True):
            key = tuple(sorted(hashlib.sha1(f.numpy().tobytes()).hexdigest() for f in clip))
            groups.setdefault(key, Counter())[label] += 1
        assert all(c[0] == c[1] for c in groups.values()), split
        assert (y == 0).sum() == (y == 1).sum() > 0
        for i in range(0, len(x), 2):  # pairs stay together (the val split holds out whole pairs)
            assert torch.equal(x[i + 1], x[i].flip(0)) and (y[i], y[i + 1]) == (0, 1), (split, i)
        assert any(not torch.equal(x[i], x[i].flip(0)) for i in range(len(x)))  # (not a static canvas)


def test_moving_fmnist_config_gives_clip_batches_and_exact_statistics():
    cfg = data_config("moving_fmnist", train_images=30, test_images=10, batch_size=6)
    dm = instantiate(cfg)
    assert type(dm) is MovingFMNISTDataModule and dm.input_size == (1, 8, 32, 32) and dm.num_classes == 2
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (6, 1, 8, 32, 32) and x.dtype == torch.float32 and y.shape == (6,)
    pixels = clips_of(dm.raw_dataset("train"))[0].double() / 255
    assert abs(dm.mean[0] - pixels.mean().item()) < 1e-12 and abs(dm.std[0] - pixels.std(correction=0).item()) < 1e-9
    normalised = torch.cat([b[0] for b in dm.test_dataloader()])
    raw = clips_of(dm.raw_dataset("test"))[0].double() / 255
    assert torch.allclose(normalised.double(), ((raw - dm.mean[0]) / dm.std[0]).permute(0, 2, 1, 3, 4), atol=1e-6)
    longer = dm.make_dataset("test", num_frames=16)
    assert longer[1][0].shape == (1, 16, 32, 32) and torch.equal(longer[1][0], longer[0][0].flip(1))
    with pytest.raises(ValueError, match="takes no augment"):
        MovingFMNISTDataModule(augment=True)
    with pytest.raises(ValueError, match="speeds must be"):
        MovingFMNISTDataModule(speeds=[16])
