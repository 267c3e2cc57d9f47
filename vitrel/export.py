"""Models that leave Python: exported weights, ``torch.export`` programs and ONNX.

``python -m vitrel.export CKPT OUTDIR [--pt2] [--onnx] [--dynamic hw|batch|static] [--ema auto|true|false]``: a training
checkpoint (or exported weights) of an image or a video model -> ``OUTDIR/model.safetensors`` + ``config.json`` (its
``"ema"``: whether the weights are the run's EMA copy or its trained ones, which ``eval.py`` reports), and optionally

* ``model.pt2``: a ``torch.export`` program (``torch.export.load``), with the preprocessing in its
  extra file ``vitrel_data_config.json``;
* ``model.onnx``: the same program through the dynamo ONNX exporter (opset 18), for ONNX Runtime, with the same
  preprocessing and the weights taken (``ema`` / ``trained``) in its metadata (:data:`ONNX_DATA_CONFIG_KEY`,
  :data:`ONNX_WEIGHTS_KEY`).

The weights folder loads with ``vitrel.load_model(OUTDIR)``, ``timm.create_model("local-dir:OUTDIR",
pretrained=True)`` (without ``pretrained=True``, timm builds the architecture with new weights) or
``timm.create_model(<architecture>, pretrained=True, pretrained_cfg_overlay=dict(file=OUTDIR +
"/model.safetensors"))``, and is the layout the Hugging Face Hub expects. ``--attn-impl`` builds the export with
another attention kernel than the checkpoint's (it is recorded in ``config.json``): ``sdpa`` for a model trained
with ``triton`` that is to run on any device, or go to ONNX.

Dynamic sizes (``dynamic=``): ``"hw"`` (default) makes one program for every batch size and every
image height and width that is a multiple of the patch size (a ViT with ``dynamic_img_pad=True``: of any size, padded
in the program; a video model: every clip, its frames a multiple of the tubelet size too); ``"batch"`` only the
batch; ``"static"`` the example's shape. A video model's programs take clips ``[B, C, T, H, W]`` (the ONNX input is
named ``clips``; ``--num-frames`` sets the example clip's length). A Swin model with a scheme that depends on the
window's extent (1-D raster schemes; see ``PositionScheme.depends_on_extent`` and ``docs/export.md``), and a ViT
whose scheme compares the grid with the built one (``PositionScheme.size_branches``), have no ``"hw"`` program:
:func:`best_dynamic` picks ``"batch"`` for them.
A model with ``attn_impl="flex"`` exports with static shapes only (torch.export cannot trace FlexAttention's block
masks at symbolic sizes), and not to ONNX (no operator): :func:`best_dynamic` picks ``"static"``; ``--attn-impl
sdpa`` exports the same weights at every size.

Programs are traced in eval mode without gradients (export is not training). Every refusal (an attention kernel
ONNX has no operator for, sizes a model cannot serve, a missing ``onnx`` package, a trace that fails) comes before
anything is written: the command traces first, then writes the weights, ``config.json`` and the programs; the
programs an earlier export left in the folder that this one does not write are removed (and named).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from vitrel.export_sizes import SizeCheckedProgram, describe_sizes, program_input_shape, program_input_sizes
from vitrel.kernels import attn_impls
from vitrel.models.checkpoint import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    CheckpointError,
    data_config_for,
    load_model,
    model_data_config,
    save_pretrained,
    stored_data_config,
    weights_ema,
)
from vitrel.models.run_record import naflex_export_note

__all__ = [
    "DYNAMIC",
    "PT2_NAME",
    "ONNX_NAME",
    "DATA_CONFIG_NAME",
    "ONNX_DATA_CONFIG_KEY",
    "ONNX_WEIGHTS_KEY",
    "best_dynamic",
    "dynamic_shapes",
    "example_input",
    "export_program",
    "export_onnx",
    "onnx_program",
    "check_exportable",
    "model_data_config",
    "stored_data_config",
    "save_program",
    "program_bytes",
    "load_program",
    "program_input_shape",
    "program_input_sizes",
    "program_data_config",
    "SizeCheckedProgram",
    "describe_sizes",
    "main",
]

DYNAMIC = ("hw", "batch", "static")
PT2_NAME = "model.pt2"
ONNX_NAME = "model.onnx"
DATA_CONFIG_NAME = "vitrel_data_config.json"
#: the ONNX model's metadata (``metadata_props``; ONNX Runtime's ``get_modelmeta().custom_metadata_map``): the
#: preprocessing (JSON, the ``.pt2``'s :data:`DATA_CONFIG_NAME`), and which weights ``python -m vitrel.export`` took
ONNX_DATA_CONFIG_KEY = "vitrel_data_config"
ONNX_WEIGHTS_KEY = "vitrel_weights"
#: the ONNX opset written (ONNX Runtime 1.17+ runs it; Resize with antialias needs >= 18)
ONNX_OPSET = 18
#: the program files an export writes beside the weights (an earlier export's: removed; ONNX's external data too)
_PROGRAMS = (PT2_NAME, ONNX_NAME, f"{ONNX_NAME}.data")
MAX_SIDE = 4096
MAX_FRAMES = 1024


def _network(model: nn.Module) -> nn.Module:
    """The vitrel network of ``model``: itself, or the one inside timm's ``features_only`` wrapper (the getter's
    ``.model``, the hook wrapper's body; the fx / list / dict wrappers' rebuilt network: the wrapper itself)."""
    return next((m for m in model.modules() if getattr(m, "vitrel_cfg", None) is not None), model)


def _embed(model: nn.Module) -> nn.Module:
    """The patch embedding of ``model`` (or of the network inside a ``features_only`` wrapper)."""
    return next(m for m in model.modules() if hasattr(m, "patch_embed")).patch_embed


def _patch(model: nn.Module) -> int:
    embed = _embed(model)  # (timm's fx wrapper rebuilds it as a plain module: its convolution's stride)
    patch = getattr(embed, "patch_size", None) or embed.proj.stride  # (timm's (p, p); a video model's int)
    return int(patch if isinstance(patch, int) else patch[-1])


def _map_pooled(model: nn.Module) -> bool:
    """Whether the model pools through timm's ``AttentionPoolLatent`` (``global_pool="map"``): traced without
    size-oblivious sizes (its expanded latent refuses batch 1 otherwise), so its program takes 2 patches or more."""
    return getattr(_network(model), "attn_pool", None) is not None


def _pads(model: nn.Module) -> bool:
    """A ViT built with timm's ``dynamic_img_pad=True`` (it zero-pads images of any side to whole patches) whose
    ``"hw"`` program takes every side, padding in the program. Not with timm's ``AttentionPoolLatent``
    (``global_pool="map"``): at sides in pixels its padded grid leaves a guard torch cannot prove (``g % (4 g) != 0``),
    and traced size-obliviously its latent refuses batch 1; its program takes whole patches, as without padding."""
    return bool(getattr(_embed(model), "dynamic_img_pad", False)) and not _map_pooled(model)


def _frames(model: nn.Module) -> int | None:
    """A video model's clip length (``vitrel_cfg["num_frames"]``); None for an image model."""
    frames = (getattr(_network(model), "vitrel_cfg", None) or {}).get("num_frames")
    return None if frames is None else int(frames)


def _segments(model: nn.Module) -> int:
    """The clips a video model's input joins along time (``num_segments``; 1 for others)."""
    return int((getattr(_network(model), "vitrel_cfg", None) or {}).get("num_segments", 1))


def _kernels(model: nn.Module) -> set[str]:
    """The attention kernels a model names: its own ``attn_impl`` and its stages' and layers' (``vitrel_cfg``'s
    when none is set on a module)."""
    found = {m.attn_impl for m in model.modules() if isinstance(getattr(m, "attn_impl", None), str)}
    return found or {str((getattr(_network(model), "vitrel_cfg", None) or {}).get("attn_impl", "auto"))}


def _extent_dependent(model: nn.Module) -> bool:
    """A Swin (windowed) model with a scheme that depends on the window's extent (not on offsets only); a
    ``features_only`` wrapper's network counts (its stages, in whichever wrapper)."""
    from vitrel.models.swin_blocks import SwinStage

    return any(isinstance(m, SwinStage) for m in model.modules()) and any(
        getattr(m, "depends_on_extent", False) and getattr(m, "kind", "") == "relative" for m in model.modules()
    )


def _size_branching(model: nn.Module) -> list[str]:
    """The schemes of a model without windows whose function is chosen by comparing the call's grid with the built
    one (``PositionScheme.size_branches``: ``extend: interpolate`` tables, RoPE ``scaling.factor: auto``): a program
    traced at one grid holds only at the sizes of the branch it took, and ONNX keeps no check of that. A Swin's
    program always calls its schemes on whole windows, so they take one branch at every size."""
    from vitrel.models.swin_blocks import SwinStage

    if any(isinstance(m, SwinStage) for m in model.modules()):
        return []
    return sorted({m.name for m in model.modules() if getattr(m, "size_branches", False)})


def best_dynamic(model: nn.Module) -> str:
    """``"hw"`` when one program can serve every size, else ``"batch"`` (Swin with an extent-dependent scheme; a ViT
    whose scheme branches on the grid's size), or ``"static"`` (``attn_impl="flex"``: FlexAttention traces at fixed
    sizes only)."""
    if "flex" in _kernels(model):
        return "static"
    return "batch" if _extent_dependent(model) or _size_branching(model) else "hw"


def check_exportable(model: nn.Module, dynamic: str = "hw", onnx: bool = False, pt2: bool = False) -> None:
    """Refuse, with the reason and what to do instead, an export that cannot be made: ``dynamic`` sizes the model
    cannot serve in one program, (``onnx``) an attention kernel ONNX has no operator for or a missing ``onnx``
    / ``onnxscript`` package, (``pt2``) a program ``torch.export.save`` cannot write (FlexAttention's). Called before
    anything is traced or written; the same rules for image and video models."""
    from vitrel.kernels import get_kernel

    if dynamic not in DYNAMIC:
        raise ValueError(f"dynamic must be one of {DYNAMIC}, got {dynamic!r}")
    kernels = _kernels(model)
    if onnx:
        bad = sorted(k for k in kernels if not get_kernel(k).onnx)
        if bad:
            raise ValueError(
                f"attn_impl={bad[0]!r} runs a kernel that ONNX has no operator for (a vitrel custom op, or "
                "FlexAttention): export the same weights built with attn_impl='sdpa' (python -m vitrel.export CKPT "
                "OUT --onnx --attn-impl sdpa, vitrel.load_model(path, attn_impl='sdpa'), or "
                "vitrel.create_model(..., attn_impl='sdpa') and load_state_dict), which compute the same function"
            )
        import importlib.util

        missing = [m for m in ("onnx", "onnxscript") if importlib.util.find_spec(m) is None]
        if missing:
            raise ImportError(f"ONNX export needs {' and '.join(missing)}: pip install 'vitrel[export]'")
    if pt2 and "flex" in kernels:
        raise ValueError(
            "attn_impl='flex' programs cannot be saved as .pt2 (torch.export.save cannot serialise FlexAttention's "
            "score and mask functions): build the export with attn_impl='sdpa' (--attn-impl sdpa), which computes the "
            "same function; in Python, vitrel.export.export_program(model, dynamic='static') traces it in memory"
        )
    if dynamic != "static" and "flex" in kernels:
        raise ValueError(
            f"attn_impl='flex' exports with static shapes only (torch.export cannot trace FlexAttention's block masks "
            f"at symbolic sizes), not dynamic={dynamic!r}: export with dynamic='static' (--dynamic static: the "
            "example's batch and image size), or build the export with attn_impl='sdpa' (--attn-impl sdpa), which "
            "computes the same function at every size"
        )
    if dynamic == "hw" and _extent_dependent(model):
        raise ValueError(
            "this Swin model's position scheme depends on the window's extent (a 1-D raster order): one program "
            "cannot serve every resolution (docs/export.md); export with dynamic='batch' or 'static'"
        )
    if dynamic == "hw" and _size_branching(model):
        raise ValueError(
            f"{', '.join(_size_branching(model))} here compares the image's grid with the built one (extend: "
            "interpolate, or RoPE scaling.factor: auto): a program traced at one size would hold only on one side of "
            "that comparison (docs/export.md); export with dynamic='batch' or 'static' (one program per resolution)"
        )


def example_input(model: nn.Module, batch: int = 2, img_size: Any = None, num_frames: int | None = None) -> Tensor:
    """Random images ``[batch, in_chans, H, W]`` at the model's built size (or ``img_size``); for a video model, clips
    ``[batch, in_chans, T, H, W]`` of its ``num_frames`` (or ``num_frames``: a positive multiple of the tubelet
    size), ``K T`` frames for a model joining ``K = num_segments`` clips."""
    cfg = getattr(_network(model), "vitrel_cfg", None) or {}
    size = img_size if img_size is not None else cfg.get("img_size", 224)
    h, w = (size, size) if isinstance(size, int) else tuple(size)
    p = next(model.parameters())
    frames, shape = _frames(model), (batch, int(cfg.get("in_chans", 3)), int(h), int(w))
    if frames is None:
        if num_frames is not None:
            raise ValueError(f"{cfg.get('architecture')} is an image model: num_frames is for video models")
    else:
        t, tubelet = int(num_frames if num_frames is not None else frames), int(_embed(model).tubelet_size)
        if t < tubelet or t % tubelet:
            raise ValueError(f"num_frames={t} is not a positive multiple of the tubelet size {tubelet}")
        shape = (*shape[:2], t * _segments(model), *shape[2:])
    return torch.randn(*shape, device=p.device, dtype=p.dtype)


def dynamic_shapes(
    model: nn.Module, dynamic: str = "hw", max_side: int = MAX_SIDE, max_frames: int = MAX_FRAMES
) -> tuple | None:
    """``torch.export`` dynamic shapes of a model's input: batch and/or height/width in patches (images ``[B, C, H,
    W]``; in pixels for a ViT with ``dynamic_img_pad=True``, which pads any side); for a video model's clips ``[B, C,
    T, H, W]``, ``"hw"`` makes the frames symbolic too, in tubelets."""
    if dynamic not in DYNAMIC:
        raise ValueError(f"dynamic must be one of {DYNAMIC}, got {dynamic!r}")
    if dynamic == "static":
        return None
    dims: dict[int, Any] = {0: torch.export.Dim("batch", min=1, max=1 << 16)}
    if dynamic == "hw":
        p, h = _patch(model), 2
        if _frames(model) is not None:
            t = int(_embed(model).tubelet_size)
            t *= _segments(model)  # (K clips a sample: a whole number of tubelets each)
            dims[2] = t * torch.export.Dim("grid_t", min=1, max=max(1, max_frames // t))
            h = 3
        if _pads(model):  # (dynamic_img_pad: any side up to max_side, padded to whole patches in the program)
            dims[h], dims[h + 1] = (torch.export.Dim(s, min=1, max=max_side) for s in ("height", "width"))
            return (dims,)
        n = max(1, max_side // p)
        lo = 2 if _map_pooled(model) else 1
        dims[h] = p * torch.export.Dim("grid_h", min=lo, max=n)
        dims[h + 1] = p * torch.export.Dim("grid_w", min=lo, max=n)
    return (dims,)


def export_program(
    model: nn.Module, example: Tensor | None = None, dynamic: str = "hw", max_side: int = MAX_SIDE
) -> torch.export.ExportedProgram:
    """``torch.export`` of ``model`` (in eval mode, without gradients) on images (a video model: clips) ``example``
    with the ``dynamic`` sizes (:func:`check_exportable` first).

    ``"hw"`` needs an example of whole patches (a ``ValueError`` names the nearest sizes otherwise), and takes every
    size of whole patches; a ViT built with ``dynamic_img_pad=True`` takes an example and every side of any size
    (1 to ``max_side`` px), padded to whole patches inside the program as eagerly; with ``global_pool="map"`` its
    program takes whole patches only, as without padding.
    Sizes that can be 1 (a single window, a grid of one patch) are traced size-obliviously (torch assumes 2 or more),
    except through timm's ``AttentionPoolLatent`` (``global_pool="map"``), whose expanded latent then refuses batch 1:
    such a program takes sides of 2 patches or more. The model is left as it was (a forward pass changes nothing).
    """
    check_exportable(model, dynamic)
    x = example if example is not None else example_input(model)
    (h, w), p = x.shape[-2:], _patch(model)
    if dynamic == "hw" and (h % p or w % p) and not _pads(model):  # (torch.export's own error names a Dim, and no fix)
        near = sorted({(max(p, h // p * p), max(p, w // p * p)), (-(-h // p) * p, -(-w // p) * p)})
        sizes = " or ".join(f"{a}x{b} (--img-size {a if a == b else f'{a} {b}'})" for a, b in near)
        pads = " (dynamic_img_pad pads every side in the program, but not into global_pool='map')"
        pads = pads if getattr(_embed(model), "dynamic_img_pad", False) else ""
        raise ValueError(
            f"image size {h}x{w} is not a multiple of the patch size {p}: a dynamic=hw program is traced on images of "
            f"whole patches and then takes every size of whole patches{pads}; trace it at the nearest, {sizes}"
        )
    was_training = model.training
    model.eval()
    import torch.fx.experimental._config as fx_config

    try:
        oblivious = not _map_pooled(model)
        with fx_config.patch(backed_size_oblivious=oblivious), warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore", FutureWarning)
            return torch.export.export(model, (x,), dynamic_shapes=dynamic_shapes(model, dynamic, max_side))
    finally:
        model.train(was_training)


def export_onnx(
    model: nn.Module,
    path: str | Path,
    example: Tensor | None = None,
    dynamic: str = "hw",
    opset: int = ONNX_OPSET,
    max_side: int = MAX_SIDE,
    data_config: dict[str, Any] | None = None,
) -> Path:
    """``model`` -> ONNX file ``path`` (:func:`onnx_program`, then saved)."""
    program = onnx_program(model, example, dynamic, opset, max_side, data_config=data_config)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    program.save(str(path))
    return path


def onnx_program(
    model: nn.Module,
    example: Tensor | None = None,
    dynamic: str = "hw",
    opset: int = ONNX_OPSET,
    max_side: int = MAX_SIDE,
    program: torch.export.ExportedProgram | None = None,
    data_config: dict[str, Any] | None = None,
) -> Any:
    """``model`` as an ONNX program in memory (``torch.onnx.ONNXProgram``; ``.save(path)`` writes it), via
    :func:`export_program` (or its ``program``, already traced) and the dynamo exporter (input ``images``, a video
    model's ``clips``; output ``logits``, a ``features_only`` backbone's ``features_0``, ``features_1`` ...); needs
    ``pip install vitrel[export]`` (onnx, onnxscript). A model whose attention kernel ONNX has no operator for (a
    vitrel custom op, ``attn_impl="triton"``; FlexAttention) is refused: the same weights built with
    ``attn_impl="sdpa"`` compute the same function (``vitrel.load_model(path, attn_impl="sdpa")``). Its metadata
    :data:`ONNX_DATA_CONFIG_KEY` is the preprocessing, ``data_config`` or :func:`model_data_config` of the model, at
    the program's size where it takes one (:func:`program_data_config`)."""
    check_exportable(model, dynamic, onnx=True)
    ep = program if program is not None else export_program(model, example, dynamic, max_side)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        name = "images" if _frames(model) is None else "clips"
        outputs = ["logits"]  # a features_only backbone (timm's wrapper: no head): its maps, in order
        if not hasattr(model, "forward_head"):
            outputs = [f"features_{i}" for i in range(len(ep.graph_signature.user_outputs))]
        onnx = torch.onnx.export(
            ep, input_names=[name], output_names=outputs, opset_version=opset, dynamo=True, verbose=False
        )
    preprocessing = data_config if data_config is not None else model_data_config(_network(model))
    onnx.model.metadata_props[ONNX_DATA_CONFIG_KEY] = json.dumps(program_data_config(ep, preprocessing))
    return onnx


def save_program(ep: torch.export.ExportedProgram, path: str | Path, data_config: dict[str, Any]) -> Path:
    """``torch.export.save`` with the preprocessing as the extra file :data:`DATA_CONFIG_NAME`, at the program's size
    where it takes one (:func:`program_data_config`; serialised in memory first: a program torch cannot serialise
    leaves no file)."""
    data, path = program_bytes(ep, data_config), Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def program_bytes(ep: torch.export.ExportedProgram, data_config: dict[str, Any]) -> bytes:
    """The ``.pt2`` archive of ``ep`` with the preprocessing (:func:`save_program`'s bytes), made in memory."""
    buf = io.BytesIO()
    torch.export.save(ep, buf, extra_files={DATA_CONFIG_NAME: json.dumps(program_data_config(ep, data_config))})
    return buf.getvalue()


def load_program(path: str | Path) -> tuple[torch.export.ExportedProgram, dict[str, Any]]:
    """``(program, data_config)`` of a ``.pt2`` written by :func:`save_program`.

    The archive is checked first (a zip whose members pass their CRC checks, with torch.export's
    ``archive_format`` record), so a truncated, damaged or foreign file is one :class:`CheckpointError`
    naming the file and what is wrong, not ``zipfile.BadZipFile`` after a logged torch traceback."""
    p = Path(path)
    try:
        with zipfile.ZipFile(p) as z:
            damaged = z.testzip()
            names = z.namelist()
    except (zipfile.BadZipFile, OSError, EOFError, zlib.error) as e:
        raise CheckpointError(
            f"cannot read {p}: truncated or not a torch.export program ({type(e).__name__}: {e})"
        ) from None
    if damaged is not None:
        raise CheckpointError(f"cannot read {p}: damaged (its member {damaged} fails the zip CRC check)")
    if not any(n.rsplit("/", 1)[-1] == "archive_format" for n in names):
        raise CheckpointError(
            f"{p} is a zip archive but not a torch.export program (no archive_format record; a torch.save file?)"
        )
    extra = {DATA_CONFIG_NAME: ""}
    try:
        ep = torch.export.load(str(p), extra_files=extra)
    except (RuntimeError, ValueError, KeyError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot load {p} as a torch.export program: {type(e).__name__}: {e}") from None
    if not extra[DATA_CONFIG_NAME]:
        raise CheckpointError(f"{p} has no {DATA_CONFIG_NAME}: write programs with `python -m vitrel.export ... --pt2`")
    return ep, json.loads(extra[DATA_CONFIG_NAME])


def program_data_config(ep: torch.export.ExportedProgram, data_config: dict[str, Any]) -> dict[str, Any]:
    """``data_config`` with the sizes ``ep`` takes where it takes one: the height and width of a program of one image
    size (``"batch"`` / ``"static"``: the traced one, ``--img-size 48``'s 48), a video program's ``num_frames`` of one
    clip length. A program of every size (``"hw"``) keeps the stored size, the trained one, as the default."""
    shape, out = program_input_shape(ep), dict(data_config)
    if len(shape) in (4, 5) and "input_size" in out and None not in shape[-2:]:  # (images [B, C, H, W], or clips)
        out["input_size"] = [*out["input_size"][:-2], *shape[-2:]]
    if len(shape) == 5 and shape[2] is not None and "num_frames" in out:
        out["num_frames"] = shape[2] // int(out.get("num_segments", 1))  # (of one clip)
    return out


#: why :func:`best_dynamic` chose less than ``"hw"`` (the command's note)
_NOT_HW = {
    "batch": "this model's scheme cannot serve every resolution in one program",
    "static": "attn_impl='flex' traces at fixed sizes only",
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vitrel.export", description=__doc__.splitlines()[0])
    ap.add_argument("ckpt", help="training checkpoint (.ckpt) or exported weights")
    ap.add_argument("out_dir", help=f"output directory (gets {WEIGHTS_NAME} and {CONFIG_NAME})")
    ap.add_argument(
        "--ema",
        nargs="?",
        const="true",
        default="auto",
        choices=("auto", "true", "false"),
        help="auto (default; as eval.py and predict.py): the weights the run tested, the EMA copy when the checkpoint "
        "has one unless the run set module.ema_eval=false; --ema / "
        "--ema true: the EMA weights; --ema false: the trained weights",
    )
    ap.add_argument("--pt2", action="store_true", help=f"also write a torch.export program ({PT2_NAME})")
    ap.add_argument("--onnx", action="store_true", help=f"also write an ONNX model ({ONNX_NAME}, opset {ONNX_OPSET})")
    ap.add_argument(
        "--dynamic",
        choices=DYNAMIC,
        default=None,
        help="dynamic sizes of the program: hw (batch, height and width, a video model's frames too; the default "
        "where possible), batch, static",
    )
    ap.add_argument(
        "--img-size", type=int, nargs="+", default=None, help="example image (video: frame) size (default: as trained)"
    )
    ap.add_argument("--num-frames", type=int, default=None, help="a video model's example clip length (default: its)")
    ap.add_argument("--opset", type=int, default=ONNX_OPSET, help="ONNX opset asked of torch (it writes >= 18)")
    ap.add_argument(
        "--attn-impl",
        default=None,
        choices=attn_impls(),
        help="the attention kernel the export is built with and records (default: the checkpoint's): e.g. sdpa for "
        "a model trained with triton that is to run anywhere, and for ONNX",
    )
    args = ap.parse_args(argv)
    out = Path(args.out_dir)
    dynamic = args.dynamic
    try:  # everything that can refuse, the traces included, before anything is written
        kernel = {} if args.attn_impl is None else {"attn_impl": args.attn_impl}
        # the weights taken: an export's own (recorded; another --ema refused), else as eval.py and predict.py
        use_ema = weights_ema(args.ckpt, {"auto": "auto", "true": True, "false": False}[args.ema])
        model = load_model(args.ckpt, use_ema="auto" if use_ema is None else use_ema, **kernel).eval()
        data_config = data_config_for(args.ckpt, model)
        naflex = naflex_export_note(args.ckpt, data_config["input_size"][-2:], _patch(model))
        pt2 = onnx = None
        if args.pt2 or args.onnx:
            dynamic = args.dynamic or best_dynamic(model)
            check_exportable(model, dynamic, onnx=args.onnx, pt2=args.pt2)
            if args.dynamic is None and dynamic != "hw":
                what = _NOT_HW[dynamic]
                frames = model.vitrel_cfg.get("num_frames") if args.num_frames is None else args.num_frames
                if frames is not None:  # a video program of one clip length: say which, and how to get another
                    what = f"{what.replace('resolution', 'clip size')} (this one: {frames} frames; --num-frames)"
                print(f"note: {what}; exporting dynamic={dynamic}")
            size = (args.img_size * 2)[:2] if args.img_size is not None else list(data_config["input_size"][-2:])
            example = example_input(model, img_size=size, num_frames=args.num_frames)
            dyn = f"dynamic={dynamic}" + (", frames too" if dynamic == "hw" and _frames(model) else "")
            print(f"tracing the model with torch.export ({dyn}) ...", flush=True)
            ep = export_program(model, example, dynamic)
            pt2 = program_bytes(ep, data_config) if args.pt2 else None
            if args.onnx:
                print(f"converting the program to ONNX (opset {args.opset}) ...", flush=True)
                onnx = onnx_program(model, example, dynamic, args.opset, program=ep, data_config=data_config)
                if use_ema is not None:  # (weights that do not record it: not said)
                    onnx.model.metadata_props[ONNX_WEIGHTS_KEY] = "ema" if use_ema else "trained"
    except (CheckpointError, ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # a trace or serialisation torch refuses (torch._dynamo's errors are RuntimeErrors)
        first = (str(e).strip().splitlines() or [""])[0]
        print(
            f"error: torch.export could not export the model (dynamic={dynamic}): {type(e).__name__}: {first}\n"
            "try --dynamic static, or --attn-impl sdpa; nothing was written",
            file=sys.stderr,
        )
        return 2
    if naflex:
        print(f"warning: {naflex}", file=sys.stderr)
    # the programs an earlier export wrote here (other options, other weights): removed, not left beside these
    old, written = (
        [n for n in _PROGRAMS if (out / n).is_file()],
        {PT2_NAME: pt2 is not None, ONNX_NAME: onnx is not None},
    )
    for n in old:
        (out / n).unlink()
    gone = [n for n in old if not written.get(n)]
    if gone:
        print(f"removed {', '.join(gone)} of an earlier export to {out}: the folder holds this export's files only")
    save_pretrained(model, out, data_config, ema=use_ema)
    which = {True: "the EMA weights", False: "the trained weights", None: "the weights it holds"}[use_ema]
    print(f"wrote {out / WEIGHTS_NAME} ({which}) and {out / CONFIG_NAME}")
    if pt2 is not None:
        (out / PT2_NAME).write_bytes(pt2)
        print(f"wrote {out / PT2_NAME} (torch.export, {dyn})")
    if onnx is not None:
        onnx.save(str(out / ONNX_NAME))
        opset = int(onnx.model.opset_imports[""])  # (torch writes >= 18: converted down where it can, else 18 kept)
        if opset != args.opset:
            said = f"--opset {args.opset} asked; torch's exporter could not convert to it: the file has opset {opset}"
            print(f"warning: {said}", file=sys.stderr)
        print(f"wrote {out / ONNX_NAME} (ONNX opset {opset}, {dyn})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
