"""Inference on a folder of images (of videos for a video model), with timm's ``inference.py`` conventions
(``predict.py`` runs it: :func:`vitrel.train.predict.run_predict`).

A model comes from a training checkpoint (``.ckpt``), an export folder (``model.safetensors`` +
``config.json``, or a folder holding only ``model.pt2``) or a ``torch.export`` program (``.pt2``); its
preprocessing from the data config stored with it (:func:`vitrel.models.checkpoint.stored_data_config`: the
training data's mean, std, interpolation, crop fraction and class names, which ``train.py`` stores in its
checkpoints; an export's ``pretrained_cfg``); the input size and channels are the model's. A checkpoint without
one (written before vitrel stored it, or by hand) is read with its architecture's defaults, with one warning
naming them. Images are read from a flat folder or an ``ImageFolder`` tree (sub-folders of
images), resized (shorter side to ``size / crop_pct``), centre-cropped, normalised, converted to the
model's channels (grey or RGB). A file that cannot be read is skipped, logged in one line and counted. A photo stored
turned (EXIF orientation 2-8) is scored as stored, as the training data sets read it, and counted in one warning;
``apply_exif_orientation`` turns it upright first (:class:`vitrel.data.image_files.ImageFiles`).

With ``seq_len`` (``predict.py seq_len=256``) every image is scored at its own size and aspect ratio instead: timm's
``ResizeToSequence`` (within ``max_tokens`` patches, default ``seq_len``, never enlarged) and ``Patchify``, packed into
rows of ``seq_len`` tokens (:class:`vitrel.data.packing.PackingCollator`), the path of ``data.packing`` in
training; models that take timm's NaFlex dicts only (not ``.pt2`` programs). ``predict.py`` on a ``.ckpt`` whose
``train.py`` run trained with ``data.packing`` scores this way by default, as ``eval.py`` and the run's test did
(:func:`vitrel.models.run_record.naflex_of_run`).

A video model (its data config has ``num_frames``) reads video files instead (:func:`predict_folder`; the extensions
of :data:`vitrel.data.video.VIDEO_EXTENSIONS`, in a folder or in class folders): each video's evaluation clips,
``clips_per_video`` evenly spaced clips of ``num_frames`` frames ``frame_stride`` apart (stored by ``train.py``;
``data=video_folder``'s defaults and one warning for a checkpoint without them), decoded with PyAV, each through
``ClipTransform(train=False)`` with the stored statistics (frames made grey as images are for a 1-channel model); a
video's probabilities are the mean of its clips' softmax (multi-view testing). A file that does not decode is skipped
(one logged line) and counted; a folder holding only images for a video model, or only videos for an image model, is
one error naming what the model takes. The input may be one file (its row named by its file name); the other files of
a folder (not images, or not videos) are passed over and counted (:attr:`PredictResult.passed_over`).

Output rows, as timm's ``inference.py --results-separate-col``: ``filename`` (relative to the input
folder), then for each of the top ``k`` classes, ranks ``i = 0 .. k-1``, ``index_i``, ``label_i`` (the class name when
the checkpoint stores class names, or the ``ImageFolder`` tree has one folder per class; else the index) and ``prob_i``
(softmax probability); with ``topk=1``, timm's unsuffixed ``index``, ``label``, ``prob``. A ``topk`` above the number
of classes gives all of them, with one logged line.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from vitrel.caller import caller_stacklevel
from vitrel.data.input_files import (
    IMG_EXTENSIONS,
    FoundFiles,
    NoImagesError,
    NoVideosError,
    find_files,
    find_images,
    find_videos,
)
from vitrel.models.run_record import PredictSettingsError

__all__ = [
    "IMG_EXTENSIONS",
    "NoImagesError",
    "NoVideosError",
    "PredictSettingsError",
    "Predictor",
    "load_predictor",
    "find_images",
    "find_videos",
    "eval_transform",
    "predict_folder",
    "clip_sampling",
    "check_predict_args",
    "mean_softmax_log",
]

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- models and their preprocessing
@dataclass
class Predictor:
    """A callable model (``nn.Module`` or an exported program's module) with its preprocessing."""

    model: Callable[[Tensor], Tensor]
    data_config: dict[str, Any]
    source: str
    class_names: list[str] | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


def load_predictor(
    path: str | Path,
    device: str | torch.device = "cpu",
    use_ema: str | bool = "auto",
    model_overrides: dict[str, Any] | None = None,
) -> Predictor:
    """The model and preprocessing of a ``.ckpt``, an export folder or a ``.pt2`` program (see the module docstring);
    ``model_overrides``: arguments for :func:`vitrel.load_model` (e.g. ``{"attn_impl": "sdpa"}`` for a model trained
    with ``triton`` on a CPU), not for a ``.pt2`` program, which is fixed: of those, only a video program's
    ``num_frames`` (the clip length sampled), where the program takes it."""
    from vitrel.export import PT2_NAME, SizeCheckedProgram, load_program, program_input_sizes
    from vitrel.models.checkpoint import WEIGHTS_NAME, data_config_for, load_model, weights_ema
    from vitrel.models.ckpt_files import run_checkpoint

    p = Path(path)
    device = torch.device(device)
    if not p.exists():
        raise FileNotFoundError(f"no checkpoint at {p}")
    p = run_checkpoint(p)  # a train.py run folder: the checkpoint its test scored (logged)
    if p.is_dir() and not (p / WEIGHTS_NAME).is_file() and (p / PT2_NAME).is_file():
        p = p / PT2_NAME
    if p.suffix == ".pt2":
        fixed = sorted(k for k in model_overrides or {} if k != "num_frames")
        if fixed:
            raise PredictSettingsError(
                f"{p} is a torch.export program, fixed when it was exported: model_overrides {fixed} apply to a "
                ".ckpt or an export folder (python -m vitrel.export CKPT OUT --pt2 --attn-impl ... exports another "
                "program)"
            )
        ep, data_config = load_program(p)
        data_config = _program_size(p, ep, data_config)
        if (model_overrides or {}).get("num_frames") is not None:
            data_config = _program_frames(p, program_input_sizes(ep), data_config, model_overrides["num_frames"])
        if device.type != "cpu":
            from torch.export.passes import move_to_device_pass

            ep = move_to_device_pass(ep, device)
        module = SizeCheckedProgram(ep.module(), program_input_sizes(ep), str(p))  # torch's Guard failed, named
        return Predictor(module, data_config, str(p), data_config.get("class_names"), device)
    _check_head_kept(p, model_overrides or {})
    ema = weights_ema(p, use_ema)  # (an export folder: the weights it records; the other ema= refused)
    model = load_model(p, use_ema="auto" if ema is None else ema, **(model_overrides or {})).eval().to(device)
    data_config = data_config_for(p, model)
    return Predictor(model, data_config, str(p), data_config.get("class_names"), device)


def _program_size(path: Path, ep: Any, data_config: dict[str, Any]) -> dict[str, Any]:
    """The data config of a ``.pt2`` at the sizes its program takes (:func:`~vitrel.export.program_data_config`, which
    the export stores; applied again for a ``.pt2`` written before it did); a program of a fixed batch (``--dynamic
    static``) is refused: images come in batches of any size."""
    from vitrel.export import program_data_config, program_input_shape

    shape = program_input_shape(ep)
    if shape[0] is not None:
        raise PredictSettingsError(
            f"{path} takes a fixed batch of {shape[0]} (exported with --dynamic static), predict.py batches of any "
            "size: export with --dynamic hw or batch (python -m vitrel.export CKPT OUT --pt2 --dynamic batch)"
        )
    return program_data_config(ep, data_config)


def _program_frames(path: Path, sizes: tuple, data_config: dict[str, Any], frames: Any) -> dict[str, Any]:
    """The data config of a video ``.pt2`` sampling clips of ``frames`` frames (``model_overrides num_frames``), when
    its program takes that clip length (``sizes``: :func:`~vitrel.export.program_input_sizes`, a program exported for
    every clip length takes whole tubelets); else a :class:`PredictSettingsError` naming the lengths it takes."""
    from vitrel.export import describe_sizes

    if "num_frames" not in data_config or len(sizes) != 5:
        raise PredictSettingsError(
            f"{path} is an image model's program: model_overrides num_frames is for video models"
        )
    takes = sizes[2] if isinstance(sizes[2], range) else range(sizes[2], sizes[2] + 1)
    k = int(data_config.get("num_segments", 1))  # (an input joins k clips)
    if type(frames) is not int or frames * k not in takes:
        fix = "give one of those" if len(takes) > 1 else f"export again with --num-frames {frames} (one per length)"
        joined = f" ({k} clips joined)" if k > 1 else ""
        raise PredictSettingsError(
            f"{path} takes clips of {describe_sizes(sizes[2])} frames{joined}, not num_frames={frames} "
            f"(model_overrides): {fix}"
        )
    return {**data_config, "num_frames": frames}


def _check_head_kept(path: Path, model_overrides: dict[str, Any]) -> None:
    """A ``num_classes`` override unlike the stored one would predict with a fresh, untrained head (``load_model``
    resets it for fine-tuning): refused, naming it."""
    from vitrel.models.ckpt_files import stored_config

    n = model_overrides.get("num_classes")
    stored = (stored_config(path) or {}).get("num_classes") if n is not None else None
    if stored is not None and n != stored:
        raise PredictSettingsError(
            f"model_overrides num_classes={n} would replace the trained head of {stored} classes of {path} by an "
            "untrained one: predict.py predicts with the trained head; drop the override (labels are the stored class "
            "names, else class_names=[...], else the indices)"
        )


# ---------------------------------------------------------------------------- images
def eval_transform(data_config: dict[str, Any]) -> Callable[[Any], Tensor]:
    """PIL image -> normalised ``[C, H, W]`` tensor: timm's eval transform (resize shorter side to
    ``size / crop_pct``, centre crop, normalise) after converting to the model's channels (a 16-bit image scaled to
    8 bits: :func:`~vitrel.data.datasets.to_8bit`); for a model trained on a canvas (``canvas_size`` in the data
    config), the image at ``canvas_image_size`` pasted in the middle of it first
    (:func:`~vitrel.data.transforms.canvas_transform`). A memory-loader run's (``resize="tensor"``, no canvas): the
    image normalised, then resized by torchvision as its evaluation did (:func:`~vitrel.data.memory.eval_images`)."""
    from timm.data import create_transform

    from vitrel.data.datasets import to_8bit

    c, h, w = data_config["input_size"]
    mode = "L" if c == 1 else "RGB"
    if data_config.get("resize") == "tensor" and not data_config.get("canvas_size"):
        return _tensor_resize(data_config, mode)  # (timm's PIL transform not built)
    tf = create_transform(
        (c, h, w),
        is_training=False,
        interpolation=data_config.get("interpolation", "bicubic"),
        mean=tuple(data_config["mean"]),
        std=tuple(data_config["std"]),
        crop_pct=data_config.get("crop_pct", 1.0),
        crop_mode=data_config.get("crop_mode", "center"),
    )
    if data_config.get("canvas_size"):  # trained on images pasted into a black canvas: pasted the same way first
        from torchvision.transforms import Compose

        from vitrel.data.transforms import canvas_transform

        side, interp = int(data_config["canvas_image_size"]), data_config.get("interpolation", "bicubic")
        tf = Compose([canvas_transform(side, int(data_config["canvas_size"]), interp), tf])

    def apply(img: Any) -> Tensor:
        return tf(to_8bit(img).convert(mode))  # (a 16-bit image scaled: PIL's convert clips it)

    return apply


def _tensor_resize(data_config: dict[str, Any], mode: str) -> Callable[[Any], Tensor]:
    """PIL image -> normalised ``[C, H, W]`` tensor as a memory-loader run's evaluation made it
    (:func:`~vitrel.data.memory.eval_images`: normalised, then resized by torchvision). An ``input_size`` of another
    height than width (a program exported at ``--img-size 28 36``; the memory loader's are square): normalised, then
    resized by torchvision to ``floor(H / crop_pct) x floor(W / crop_pct)`` and centre-cropped to ``H x W``, as timm's
    eval transform does for an ``(H, W)`` size."""
    import numpy as np
    import torchvision.transforms.functional as TF

    from vitrel.data.augment import normalize
    from vitrel.data.datasets import to_8bit
    from vitrel.data.memory import eval_images, to_uint8_nchw

    (h, w), crop = data_config["input_size"][-2:], float(data_config.get("crop_pct", 1.0))
    mean, std = tuple(data_config["mean"]), tuple(data_config["std"])
    interpolation = str(data_config.get("interpolation", "bicubic"))
    kw = {"mean": mean, "std": std, "img_size": int(w), "crop_pct": crop, "interpolation": interpolation}

    def apply(img: Any) -> Tensor:
        x = to_uint8_nchw(np.array(to_8bit(img).convert(mode))[None])
        if h == w:
            return eval_images(x, **kw)[0]
        x = normalize(x, torch.tensor(mean).view(-1, 1, 1), torch.tensor(std).view(-1, 1, 1))
        scale = [int(math.floor(h / crop)), int(math.floor(w / crop))]
        x = TF.resize(x, scale, interpolation=TF.InterpolationMode(interpolation), antialias=True)
        return TF.center_crop(x, [int(h), int(w)])[0]

    return apply


def naflex_eval_transform(
    data_config: dict[str, Any], patch_size: int, max_tokens: int, eval_max_ratio: float | None = 1.0
) -> Callable[[Any], Any]:
    """PIL image -> timm's NaFlex per-image dict at the image's own aspect ratio within ``max_tokens`` patches (scaled
    by at most ``eval_max_ratio``: 1.0 never enlarges), after converting to the model's channels (16-bit scaled)."""
    from vitrel.data.datasets import to_8bit
    from vitrel.data.packing import naflex_transform

    c = data_config["input_size"][0]
    tf = naflex_transform(
        train=False,
        patch_size=patch_size,
        max_tokens=max_tokens,
        mean=tuple(data_config["mean"]),
        std=tuple(data_config["std"]),
        interpolation=data_config.get("interpolation", "bicubic"),
        eval_max_ratio=eval_max_ratio,
    )
    mode = "L" if c == 1 else "RGB"

    def apply(img: Any) -> Any:
        return tf(to_8bit(img).convert(mode))

    return apply


@dataclass
class PredictResult:
    """CSV rows, the files skipped (name, reason), the number of image files found, the wall time, the other
    files under the input that were passed over (not images, or not videos for a video model), and the photos stored
    turned (name, EXIF orientation)."""

    rows: list[dict[str, Any]]
    skipped: list[tuple[str, str]]
    found: int
    seconds: float
    passed_over: int = 0
    turned: list[tuple[str, int]] = field(default_factory=list)


def predict_folder(
    predictor: Predictor,
    input_dir: str | Path,
    topk: int = 5,
    batch_size: int = 64,
    num_workers: int = 0,
    progress: bool | str = True,
    class_names: list[str] | None = None,
    seq_len: int | None = None,
    max_tokens: int | None = None,
    eval_max_ratio: float | None = 1.0,
    packing: str = "pack",
    apply_exif_orientation: bool = False,
    on_rows: Callable[[list[dict[str, Any]]], None] | None = None,
) -> PredictResult:
    """Top-``k`` classes and probabilities of every image under ``input_dir`` (see the module docstring); with
    ``seq_len``, each image at its own size (NaFlex: ``max_tokens``, ``eval_max_ratio``), in rows as ``packing``
    (``"pack"`` or ``"pad"``, :class:`~vitrel.data.packing.PackingCollator`'s modes). A video model's predictor
    scores the videos under ``input_dir`` instead: their evaluation clips (:func:`clip_sampling`), a video's
    probabilities the mean of its clips' softmax; ``batch_size`` then counts videos (``batch_size * clips_per_video``
    clips per forward). ``apply_exif_orientation``: photos stored turned (EXIF orientation 2-8) are turned upright, as
    a photo viewer shows them, before they are scored; else (the training data sets' way, timm's and torchvision's
    default) scored as stored, and counted in one logged line. ``on_rows(rows)``: each batch's rows, once predicted."""
    check_predict_args(
        topk=topk, batch_size=batch_size, num_workers=num_workers, seq_len=seq_len, max_tokens=max_tokens
    )
    if "num_frames" in predictor.data_config:
        if seq_len is not None or max_tokens is not None or apply_exif_orientation:
            raise PredictSettingsError(
                f"seq_len / max_tokens / apply_exif_orientation are for images; {predictor.source} is a video model: "
                "leave them unset"
            )
    from vitrel.data.image_files import ImageFiles, PackedCollateFiles, collate_files

    root = Path(input_dir)
    if "num_frames" in predictor.data_config:
        return _predict_videos(predictor, root, (topk, batch_size, num_workers), progress, (class_names, on_rows))
    found = _input_files(root, predictor)
    files = found.files
    if seq_len is None:
        if max_tokens is not None:  # (it bounds the patches of an image scored at its own size, which seq_len asks)
            raise PredictSettingsError(
                f"max_tokens={max_tokens} needs seq_len (images at their own sizes, packed): give seq_len=<n> (at "
                f"least {max_tokens}), or leave max_tokens unset for fixed-size images"
            )
        tf, collate = eval_transform(predictor.data_config), collate_files
    else:
        patch = (getattr(predictor.model, "vitrel_cfg", None) or {}).get("patch_size")
        if patch is None:
            raise PredictSettingsError(
                f"seq_len={seq_len}: scoring images at their own sizes needs a vitrel model that takes timm's NaFlex "
                f"dicts (a .ckpt or an export folder); {predictor.source} is not one (an exported .pt2 program takes "
                "fixed-size images): leave seq_len unset"
            )
        max_tokens = int(max_tokens or seq_len)
        if not 1 <= max_tokens <= seq_len:
            raise PredictSettingsError(f"max_tokens={max_tokens} must be in [1, seq_len={seq_len}]")
        tf = naflex_eval_transform(predictor.data_config, int(patch), max_tokens, eval_max_ratio)
        collate = PackedCollateFiles(seq_len, packing)
    loader = torch.utils.data.DataLoader(
        ImageFiles(files, tf, apply_exif_orientation),
        batch_size=batch_size,
        num_workers=num_workers,
        collate_fn=collate,
    )

    def forward(x: Any) -> Tensor:
        if isinstance(x, dict):  # (a packed NaFlex batch)
            x = {k: v.to(predictor.device) if isinstance(v, Tensor) else v for k, v in x.items()}
        return predictor.model(x if isinstance(x, dict) else x.to(predictor.device)).float().softmax(-1)

    res = _score(loader, forward, found, root, class_names or predictor.class_names, topk, progress, on_rows)
    if res.turned:  # (a phone photo: its pixels stored sideways or upside down, its EXIF saying how to show them)
        (n, (name, o)), did = (len(res.turned), res.turned[0]), apply_exif_orientation
        log.warning(
            f"{n} image(s) stored turned, with an EXIF orientation (e.g. {name}: {o}): "
            + (
                "turned upright first (apply_exif_orientation)"
                if did
                else "scored as stored, as the training data sets "
                "read images; apply_exif_orientation=true turns them upright first, as a photo viewer shows them"
            )
        )
    return res


def _score(
    loader: Any,
    forward: Callable[[Any], Tensor],
    found: FoundFiles,
    root: Path,
    names: list[str] | None,
    topk: int,
    progress: bool | str,
    on_rows: Callable[[list[dict[str, Any]]], None] | None = None,
) -> PredictResult:
    """The loop of :func:`predict_folder` (images and videos): ``forward(batch)`` -> probabilities
    ``[B, classes]`` of the batch's files; the files that did not read are logged (one line each) and counted.
    ``progress``: True a tqdm bar, ``"lines"`` a logged line at each tenth of the batches (for logs), False none."""
    from tqdm.auto import tqdm

    files, folders = found.files, found.folders
    rows: list[dict[str, Any]] = []
    skipped: list[tuple[str, str]] = []
    turned: list[tuple[int, int]] = []
    root = root.parent if root.is_file() else root  # (one file given: named by its name)
    t0 = time.perf_counter()
    with torch.inference_mode():
        every = max(1, len(loader) // 10)
        for b, (idx, x, bad, turns) in enumerate(
            tqdm(loader, desc="predict", unit="batch", disable=progress is not True), 1
        ):
            if progress == "lines" and (b % every == 0 or b == len(loader)):
                log.info(f"predict: batch {b}/{len(loader)}")
            for i, err in bad:
                rel = str(files[i].relative_to(root))
                log.warning(f"skipped {rel}: {err}")  # (one line a file; the count is the summary's)
                skipped.append((rel, err))
            turned += turns
            if x is None:
                continue
            probs = forward(x)
            if not rows and topk > probs.shape[-1]:
                n = probs.shape[-1]
                log.warning(f"topk={topk} is more than the model's {n} classes: each row has all {n}")
            if not rows:
                names = _label_names(names, folders, probs.shape[-1])
            new = _top_rows(probs, idx, [str(files[i].relative_to(root)) for i in idx], names, topk)
            rows += [row for _, row in sorted(new, key=lambda ir: ir[0])]  # file order (packing reorders a batch)
            if on_rows is not None:  # (the batch's rows as soon as they are predicted: batches come in file order)
                on_rows(rows[-len(new) :])
    turns = [(str(files[i].relative_to(root)), o) for i, o in sorted(turned)]
    return PredictResult(rows, skipped, len(files), time.perf_counter() - t0, found.others, turns)


def _label_names(names: list[str] | None, folders: list[str] | None, n: int) -> list[str] | None:
    """The class names (given, else stored with the model), one per class of the model's ``n``; else ``None`` (the
    labels are the indices, as timm's ``inference.py`` without a class map). The input's class folders are never
    taken as names: their sorted order need not be the order the model was trained in."""
    if names is not None and len(names) != n:
        raise PredictSettingsError(f"class_names has {len(names)} names; the model has {n} classes")
    if names is None and folders is not None:
        log.warning(
            "the model stores no class names: the labels are the class indices (the input's class folders are not "
            "taken as names: the model's class order is unknown); give class_names=[...] or a file of one name a line"
        )
    return names


def _top_rows(
    probs: Tensor, idx: Sequence[int], filenames: Sequence[str], names: list[str] | None, topk: int
) -> list[tuple[int, dict[str, Any]]]:
    """``(file index, CSV row)`` of each row of ``probs`` ``[B, classes]``: its top ``k`` (timm's columns)."""
    k = min(topk, probs.shape[-1])
    p, c = probs.topk(k, dim=-1)
    p, c = p.cpu().tolist(), c.cpu().tolist()  # one copy a batch (an element read from a GPU tensor syncs it)
    out = []
    for j, (i, name) in enumerate(zip(idx, filenames, strict=True)):
        row: dict[str, Any] = {"filename": name}
        for r in range(k):
            ci = c[j][r]
            sfx = f"_{r}" if k > 1 else ""
            row[f"index{sfx}"] = ci
            row[f"label{sfx}"] = names[ci] if names is not None and ci < len(names) else str(ci)
            row[f"prob{sfx}"] = round(p[j][r], 6)
        out.append((i, row))
    return out


def _input_files(root: Path, predictor: Predictor) -> FoundFiles:
    """The files the predictor's model takes under ``root`` (videos for a video model, else images), in one walk
    (:func:`~vitrel.data.input_files.find_files`); a folder holding only the other kind is one error naming what the
    model takes."""
    from vitrel.data.video.folder import VIDEO_EXTENSIONS

    video = "num_frames" in predictor.data_config
    kinds = [(IMG_EXTENSIONS, "images", NoImagesError), (VIDEO_EXTENSIONS, "videos", NoVideosError)]
    find, other = kinds[::-1] if video else kinds
    try:
        return find_files(root, *find)
    except (NoImagesError, NoVideosError) as missing:
        try:
            found = find_files(root, *other).files
        except (NoImagesError, NoVideosError):
            raise missing from None

        held = f"{root} holds {'images' if video else 'videos'} ({len(found)} files, e.g. {found[0].name}, no others)"
        held = f"{root} is {'an image' if video else 'a video'}" if root.is_file() else held
        if video:
            takes = (
                f"a video model: it takes clips of {predictor.data_config['num_frames']} frames from video files "
                f"({', '.join(VIDEO_EXTENSIONS)}); give a folder of videos, or an image model"
            )
        else:
            takes = f"an image model: it takes image files ({', '.join(IMG_EXTENSIONS)}); give a folder of images"
            takes += ", or a video model (a checkpoint of data=video_folder or data=moving_fmnist)"
        raise PredictSettingsError(f"{held} and {predictor.source} is {takes}") from None


# ---------------------------------------------------------------------------- videos
def clip_sampling(data_config: dict[str, Any], source: str) -> tuple[int, int, int]:
    """``(num_frames, frame_stride, clips_per_video)`` of a video model's data config (the evaluation clips of its
    training data, which ``train.py`` stores). Keys it lacks (a checkpoint written before vitrel stored them) take
    ``data=video_folder``'s defaults, with one warning naming them."""
    import inspect

    from vitrel.data.video.base import VideoFilesDataModule
    from vitrel.models.data_config import CLIP_FIELDS

    params = inspect.signature(VideoFilesDataModule.__init__).parameters
    defaults = {"frame_stride": params["stride"].default, "clips_per_video": params["clips_per_video"].default}
    later = ("spatial_crops", "num_segments", "frame_sampling")  # (before them: 1 crop, 1 clip an input, stride)
    missing = [k for k in CLIP_FIELDS if k not in data_config and k not in later]
    if missing:
        warnings.warn(
            f"{source} stores no clip sampling ({', '.join(missing)}; checkpoints of vitrel.train store it in "
            "hyper_parameters['data_config']): clips are sampled with data=video_folder's defaults, "
            f"{', '.join(f'{k} {defaults[k]}' for k in missing)}, which need not be the model's evaluation clips",
            stacklevel=caller_stacklevel(),  # (the caller of predict_folder: a script, predict.py)
        )
    got = {**defaults, **{k: data_config[k] for k in CLIP_FIELDS if k in data_config}}
    return int(data_config["num_frames"]), int(got["frame_stride"]), int(got["clips_per_video"])


def mean_softmax_log(logits: Tensor, views: int) -> Tensor:
    """Multi-view testing: ``logits [B * views, classes]``, each video's ``views`` rows consecutive ->
    ``log(mean_k softmax(logits_k)) [B, classes]`` in float32 (``logsumexp`` of the log-softmax, less ``log(views)``:
    finite where a class's probability underflows). Its ``exp`` is ``predict.py``'s probabilities of a video;
    ``eval.py``'s loss and accuracy read it."""
    log_p = F.log_softmax(logits.float(), dim=-1).unflatten(0, (-1, views))
    return torch.logsumexp(log_p, dim=1) - math.log(views)


def _predict_videos(
    predictor: Predictor, root: Path, counts: tuple[int, int, int], progress: bool | str, names: tuple[list | None, Any]
) -> PredictResult:
    """:func:`predict_folder` for a video model (``counts``: its ``topk``, ``batch_size``, ``num_workers``; ``names``:
    its ``class_names``, ``on_rows``): every video under ``root`` (a folder or class folders), from its evaluation clips
    (:func:`clip_sampling`: ``clips_per_video`` clips of ``num_frames`` frames ``frame_stride`` apart, evenly spaced),
    or with ``num_segments`` one clip from each of that many parts of the video, joined into each view; with
    ``frame_sampling="spread"`` the frames spread over the video, its ``clips_per_video`` views), each resized,
    centre-cropped (or in its ``spatial_crops`` crops), normalised as in evaluation
    (``ClipTransform(train=False)``, the stored statistics); a video's probabilities are the mean of its views'
    softmax."""
    from vitrel.data.image_files import collate_files
    from vitrel.data.video.clips import VideoFileClips
    from vitrel.data.video.transforms import ClipTransform

    (topk, batch_size, num_workers), (names, on_rows) = counts, names
    dc = predictor.data_config
    c, h, w = dc["input_size"]
    if c not in (1, 3) or h != w:
        raise PredictSettingsError(
            f"{predictor.source} takes clips of {c} x {h} x {w} frames: predict.py reads square 1- or 3-channel clips"
        )
    try:
        import av  # noqa: F401 - the decoder, checked before any file is read
    except ImportError:
        raise ImportError(
            "predict.py decodes videos with PyAV: pip install av (or pip install -e '.[video]')"
        ) from None
    found = _input_files(root, predictor)
    sampling = clip_sampling(dc, predictor.source)
    tf = ClipTransform(
        h, dc["mean"], dc["std"], interpolation=dc["interpolation"], crop_pct=dc["crop_pct"],
        crops=int(dc.get("spatial_crops", 1)),
    )  # fmt: skip
    segments, spread = int(dc.get("num_segments", 1)), str(dc.get("frame_sampling", "stride"))
    loader = torch.utils.data.DataLoader(
        VideoFileClips(found.files, sampling, tf, grey=c == 1, segments=segments, frame_sampling=spread),
        batch_size=batch_size,
        num_workers=num_workers,
        collate_fn=collate_files,
    )

    def forward(x: Tensor) -> Tensor:  # [B, K, C, T, H, W]: the K clips of B videos in one call
        logits = predictor.model(x.flatten(0, 1).to(predictor.device))
        return mean_softmax_log(logits, x.shape[1]).exp()  # multi-view testing: the mean of softmax, as eval.py's

    return _score(loader, forward, found, root, names or predictor.class_names, topk, progress, on_rows)


#: predict's counts and their least values (``seq_len`` / ``max_tokens``: when set)
_LEAST = {"topk": 1, "batch_size": 1, "num_workers": 0, "seq_len": 1, "max_tokens": 1}


def check_predict_args(**args: Any) -> None:
    """Refuse a count out of range (``topk=0`` would write a CSV of file names only, ``topk=-1`` fail in
    ``torch.topk``), naming the key and the value: ``topk``, ``batch_size`` >= 1, ``num_workers`` >= 0, ``seq_len`` /
    ``max_tokens`` >= 1 or None."""
    for key, value in args.items():
        if value is None and key in ("seq_len", "max_tokens"):
            continue
        least = _LEAST[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise PredictSettingsError(f"{key} must be an integer >= {least}, got {value!r}")
