"""One's own image folders hold images of every PIL mode, and the files other tools leave there. Each is read as the
picture it shows (timm's ``convert("RGB")`` where that is right), or refused in one line naming the file: never a
silently black, white or colour-inverted tensor, and never macOS's metadata files counted as images."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

from tests.data.test_datamodules import make_imagenet_tree
from vitrel.data import ImageNetDataModule
from vitrel.data.datasets import BadSampleError, ClassFoldersMismatchError, load_rgb
from vitrel.data.image_files import ImageFiles
from vitrel.inference import eval_transform

MEAN, STD = torch.tensor(IMAGENET_DEFAULT_MEAN)[:, None, None], torch.tensor(IMAGENET_DEFAULT_STD)[:, None, None]


def predict_transform(channels: int = 3):
    """``predict.py``'s transform of a model taking ``channels``-channel 16 px images, normalised as ImageNet."""
    mean, std = (IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD) if channels == 3 else ((0.5,), (0.5,))
    cfg = {"input_size": (channels, 16, 16), "mean": mean, "std": std, "crop_pct": 1.0, "interpolation": "bicubic"}
    return eval_transform(cfg)


def pixels(x: torch.Tensor) -> list[float]:
    """The mean 0-255 value of each channel of a normalised (ImageNet) tensor ``[3, H, W]``."""
    return ((x * STD + MEAN) * 255).mean((1, 2)).round().tolist()


def float_image(value: float) -> Image.Image:
    return Image.fromarray(np.full((16, 16), value, np.float32), mode="F")


def test_a_float_image_on_a_0_1_scale_is_refused_not_read_black(tmp_path):
    """A float TIFF of values 0-1 (microscopy, a normalised export) went through PIL's ``convert`` as 0-255: a black
    tensor (mean pixel 0.0 for an image of 0.5 everywhere), in training, ``predict.py`` and the shards writer alike.
    It has no agreed scale, as a float image outside 0-255 has none: refused, naming its range; a float image of
    0-255 values is still read (mean 128)."""
    float_image(0.5).save(tmp_path / "half.tif")
    float_image(128.0).save(tmp_path / "f255.tif")
    with pytest.raises(ValueError, match=r"floating-point image \(PIL mode F\) with values 0.5 to 0.5: .* black image"):
        load_rgb(str(tmp_path / "half.tif"))
    assert np.asarray(load_rgb(str(tmp_path / "f255.tif"))).mean() == 128
    Image.fromarray(np.zeros((4, 4), np.float32), mode="F").save(tmp_path / "zero.tif")
    assert np.asarray(load_rgb(str(tmp_path / "zero.tif"))).max() == 0  # (black on either scale)

    files = ImageFiles([tmp_path / "half.tif", tmp_path / "f255.tif"], predict_transform())
    assert files[0][1] is None and "values 0.5 to 0.5" in files[0][2]  # (predict.py: skipped, the reason logged)
    assert pixels(files[1][1]) == [128, 128, 128]

    make_imagenet_tree(tmp_path / "tree", per_class=1)
    float_image(0.5).save(tmp_path / "tree" / "train" / "n0002" / "half.tif")
    dm = ImageNetDataModule(root=tmp_path / "tree", img_size=16, augment=False, batch_size=4, num_workers=0)
    dm.setup("fit")
    ds = dm.dataset("train")
    with pytest.raises(BadSampleError, match=r"cannot read \S+half.tif \(ValueError: a floating-point image"):
        [ds[i] for i in range(len(ds))]


def test_the_shards_writer_names_a_file_it_cannot_re_encode(tmp_path):
    """The writer re-encodes formats other than JPEG/PNG/WebP as PNG: a float 0-1 TIFF was stored black; refused
    now, and any file it cannot re-encode is one line naming it, not a traceback."""
    from vitrel.data.shards import main

    make_imagenet_tree(tmp_path / "tree", per_class=1)
    bad = tmp_path / "tree" / "train" / "n0001" / "half.tif"
    float_image(0.5).save(bad)
    with pytest.raises(SystemExit) as stop:
        main(["write-wds", str(tmp_path / "tree"), str(tmp_path / "wds")])
    assert str(stop.value).startswith(f"python -m vitrel.data.shards: BadSampleError: cannot re-encode {bad} as PNG")
    assert "0-1 or 0-255" in str(stop.value)


#: what macOS's AppleDouble file ``._<name>`` holds (copied from a Mac by zip, tar or a network drive): no image
APPLE_DOUBLE = b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        " + bytes(64)


def test_macos_metadata_files_are_passed_over_not_counted_as_images(tmp_path):
    """A folder copied from a Mac holds ``._<name>.jpg`` beside each ``<name>.jpg``: macOS's metadata, with the
    image's extension. Counted as images (9 train samples read as 18), they stopped a run with ``cannot read
    ._n0001_0.JPEG``, or, skipped, were replaced or left out one by one, and predict.py skipped each with a warning:
    they are passed over as ``.DS_Store`` is, by class folders, the shards writer and predict.py."""
    from vitrel.data.shards import folder_samples
    from vitrel.data.video import video_files
    from vitrel.inference import find_images, find_videos

    make_imagenet_tree(tmp_path)
    for f in sorted((tmp_path / "train").rglob("*.JPEG")) + sorted((tmp_path / "val").rglob("*.JPEG")):
        (f.parent / f"._{f.name}").write_bytes(APPLE_DOUBLE)
    (tmp_path / "train" / "n0004").mkdir()  # (a class folder of metadata alone: no images, refused as empty)
    (tmp_path / "train" / "n0004" / "._x.jpg").write_bytes(APPLE_DOUBLE)
    refused = r"no valid file for the classes n0004. Supported extensions are: .png, .jpg"
    with pytest.raises(ClassFoldersMismatchError, match=refused):
        ImageNetDataModule(root=tmp_path, img_size=16, num_workers=0).raw_dataset("train")
    (tmp_path / "train" / "n0004" / "._x.jpg").unlink()
    (tmp_path / "train" / "n0004").rmdir()

    dm = ImageNetDataModule(root=tmp_path, img_size=16, augment=False, batch_size=4, num_workers=0)
    dm.setup("fit")
    assert len(dm.dataset("train")) == 9 and len(dm.dataset("val")) == 6
    assert sum(len(y) for _, y in dm.train_dataloader()) == 9  # (every file read: none stops the run)
    assert len(folder_samples(tmp_path / "train", dm.classes)) == 9
    files, folders = find_images(tmp_path / "val")
    assert len(files) == 6 and folders == ["n0001", "n0002", "n0003"]
    (tmp_path / "videos" / "a").mkdir(parents=True)  # (video class folders: listed, not decoded, here)
    for name in ("clip.mp4", "._clip.mp4"):
        (tmp_path / "videos" / "a" / name).write_bytes(b"\x00" * 64)
    assert [Path(p).name for p, _ in video_files(tmp_path / "videos", ["a"]).samples] == ["clip.mp4"]
    assert [f.name for f in find_videos(tmp_path / "videos")[0]] == ["clip.mp4"]


def test_a_palette_image_with_transparency_reads_as_timm_reads_it_without_pils_warning(tmp_path):
    """A palette PNG whose ``tRNS`` gives several entries an alpha: PIL's ``convert("RGB")`` warned ``Palette images
    with Transparency expressed in bytes should be converted to RGBA images`` (once a loader worker, naming no file,
    asking the user for a conversion that changes no pixel). The pixels are timm's, in RGB and grey, with no warning."""
    import warnings

    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 256, (16, 16), dtype=np.uint8), mode="P")
    img.putpalette(rng.integers(0, 256, 768, dtype=np.uint8).tobytes())
    img.save(tmp_path / "p.png", transparency=bytes(rng.integers(0, 256, 200, dtype=np.uint8)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Image.open(tmp_path / "p.png") as im:
            timm_rgb, timm_grey = np.asarray(im.convert("RGB")), np.asarray(im.convert("L"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(np.asarray(load_rgb(str(tmp_path / "p.png"))), timm_rgb)
        rgb, grey = (ImageFiles([tmp_path / "p.png"], predict_transform(c))[0][1] for c in (3, 1))
    np.testing.assert_allclose(((rgb * STD + MEAN) * 255).numpy(), timm_rgb.transpose(2, 0, 1), atol=1e-3)
    np.testing.assert_allclose(((grey[0] * 0.5 + 0.5) * 255).numpy(), timm_grey, atol=1e-3)
