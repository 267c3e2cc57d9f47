"""Models that leave Python: exported weights, ``torch.export`` programs and ONNX.

``python -m vitrel.export CKPT OUTDIR [--pt2] [--onnx] [--dynamic hw|batch|static]``: a training
checkpoint (or exported weights) -> ``OUTDIR/model.safetensors`` + ``config.json``, and optionally

* ``model.pt2``: a ``torch.export`` program (``torch.export.load``), with the preprocessing in its
  extra file ``vitrel_data_config.json``;
* ``model.onnx``: the same program through the dynamo ONNX exporter (opset 18), for ONNX Runtime.

The weights folder loads with ``vitrel.load_model(OUTDIR)``, ``timm.create_model("local-dir:OUTDIR",
pretrained=True)`` (without ``pretrained=True``, timm builds the architecture with new weights) or
``timm.create_model(<architecture>, pretrained=True, pretrained_cfg_overlay=dict(file=OUTDIR +
"/model.safetensors"))``, and is the layout the Hugging Face Hub expects. ``--attn-impl`` builds the export with
another attention kernel than the checkpoint's (it is recorded in ``config.json``): ``sdpa`` for a model trained
with ``triton`` that is to run on any device, or go to ONNX.

Dynamic sizes (``dynamic=``): ``"hw"`` (default) makes one program for every batch size and every
image height and width that is a multiple of the patch size; ``"batch"`` only the batch; ``"static"``
the example's shape. A Swin model with a scheme that depends on the window's extent (1-D raster
schemes; see ``PositionScheme.depends_on_extent`` and ``docs/export.md``) has no ``"hw"`` program:
:func:`best_dynamic` picks ``"batch"`` for it.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from vitrel.kernels import attn_impls
from vitrel.models.checkpoint import CONFIG_NAME, WEIGHTS_NAME, CheckpointError, load_model, save_pretrained

__all__ = [
    "DYNAMIC",
    "PT2_NAME",
    "ONNX_NAME",
    "DATA_CONFIG_NAME",
    "best_dynamic",
    "dynamic_shapes",
    "example_input",
    "export_program",
    "export_onnx",
    "model_data_config",
    "stored_data_config",
    "save_program",
    "load_program",
    "main",
]

DYNAMIC = ("hw", "batch", "static")
PT2_NAME = "model.pt2"
ONNX_NAME = "model.onnx"
DATA_CONFIG_NAME = "vitrel_data_config.json"
#: the ONNX opset written (ONNX Runtime 1.17+ runs it; Resize with antialias needs >= 18)
ONNX_OPSET = 18
MAX_SIDE = 4096


def _patch(model: nn.Module) -> int:
    return int(model.patch_embed.patch_size)


def best_dynamic(model: nn.Module) -> str:
    """``"hw"`` when one program can serve every size, else ``"batch"`` (Swin with an extent-dependent scheme)."""
    if hasattr(model, "layers"):  # windowed: every block's scheme must depend on offsets only
        for m in model.modules():
            if getattr(m, "depends_on_extent", False) and getattr(m, "kind", "") == "relative":
                return "batch"
    return "hw"


def example_input(model: nn.Module, batch: int = 2, img_size: Any = None) -> Tensor:
    """Random images ``[batch, in_chans, H, W]`` at the model's built size (or ``img_size``)."""
    cfg = getattr(model, "vitrel_cfg", {})
    size = img_size if img_size is not None else cfg.get("img_size", 224)
    h, w = (size, size) if isinstance(size, int) else tuple(size)
    p = next(model.parameters())
    return torch.randn(batch, int(cfg.get("in_chans", 3)), int(h), int(w), device=p.device, dtype=p.dtype)


def dynamic_shapes(model: nn.Module, dynamic: str = "hw", max_side: int = MAX_SIDE) -> tuple | None:
    """``torch.export`` dynamic shapes of a model's image input: batch and/or height/width in patches."""
    if dynamic not in DYNAMIC:
        raise ValueError(f"dynamic must be one of {DYNAMIC}, got {dynamic!r}")
    if dynamic == "static":
        return None
    dims: dict[int, Any] = {0: torch.export.Dim("batch", min=1, max=1 << 16)}
    if dynamic == "hw":
        p = _patch(model)
        n = max(1, max_side // p)
        dims[2] = p * torch.export.Dim("grid_h", min=1, max=n)
        dims[3] = p * torch.export.Dim("grid_w", min=1, max=n)
    return (dims,)


def export_program(
    model: nn.Module, example: Tensor | None = None, dynamic: str = "hw", max_side: int = MAX_SIDE
) -> torch.export.ExportedProgram:
    """``torch.export`` of ``model`` (in eval mode) on images ``example`` with the ``dynamic`` sizes.

    Sizes that can be 1 (a single window, a grid of one patch) are traced size-obliviously, so the
    program does not assume a side of at least 2 (torch's default for symbolic sizes); the model is
    left as it was (a forward pass changes nothing on it).
    """
    if dynamic == "hw" and best_dynamic(model) != "hw":
        raise ValueError(
            "this Swin model's position scheme depends on the window's extent (a 1-D raster order): one program "
            "cannot serve every resolution (docs/export.md); export with dynamic='batch' or 'static'"
        )
    was_training = model.training
    model.eval()
    x = example if example is not None else example_input(model)
    import torch.fx.experimental._config as fx_config

    try:
        with fx_config.patch(backed_size_oblivious=True), warnings.catch_warnings():
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
) -> Path:
    """``model`` -> ONNX file ``path`` via :func:`export_program` and the dynamo exporter (input ``images``,
    output ``logits``); needs ``pip install vitrel[export]`` (onnx, onnxscript). A model whose attention kernel is
    a vitrel custom op (``attn_impl="triton"``) is refused: ONNX has no such operator; the same weights built with
    ``attn_impl="sdpa"`` compute the same function (``vitrel.load_model(path, attn_impl="sdpa")``)."""
    from vitrel.kernels import get_kernel

    impl = getattr(model, "vitrel_cfg", {}).get("attn_impl", "auto")
    if not get_kernel(impl).onnx:
        raise ValueError(
            f"attn_impl={impl!r} runs a vitrel custom op that ONNX has no operator for: export the same weights "
            "built with attn_impl='sdpa' (python -m vitrel.export CKPT OUT --onnx --attn-impl sdpa, "
            "vitrel.load_model(path, attn_impl='sdpa'), or "
            "vitrel.create_model(..., attn_impl='sdpa') and load_state_dict), which compute the same function"
        )
    ep = export_program(model, example, dynamic, max_side)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        onnx_program = torch.onnx.export(
            ep, input_names=["images"], output_names=["logits"], opset_version=opset, dynamo=True, verbose=False
        )
    onnx_program.save(str(path))
    return path


def model_data_config(model: nn.Module, stored: dict[str, Any] | None = None) -> dict[str, Any]:
    """The preprocessing of ``model``: ``input_size``, ``mean``, ``std``, ``interpolation``, ``crop_pct`` (and
    ``class_names`` when known).

    ``stored`` (a training checkpoint's data configuration, when it has one) wins over the model's
    ``pretrained_cfg``; the input size and channels are the model's (``vitrel_cfg``). Means and standard
    deviations of another channel count are averaged to the model's channels (a grey model fed the RGB
    statistics of its architecture's default config).
    """
    pcfg = dict(getattr(model, "pretrained_cfg", None) or {})
    cfg = getattr(model, "vitrel_cfg", {})
    stored = dict(stored or {})
    in_chans = int(cfg.get("in_chans", 3))
    size = stored.get("img_size", cfg.get("img_size", pcfg.get("input_size", (3, 224, 224))[1:]))
    h, w = (size, size) if isinstance(size, int) else tuple(size)
    out = {
        "input_size": [in_chans, int(h), int(w)],
        "mean": list(stored.get("mean", pcfg.get("mean", (0.5,) * in_chans))),
        "std": list(stored.get("std", pcfg.get("std", (0.5,) * in_chans))),
        "interpolation": str(stored.get("interpolation", pcfg.get("interpolation", "bicubic"))),
        "crop_pct": float(stored.get("crop_pct", pcfg.get("crop_pct", 1.0))),
    }
    for key in ("mean", "std"):
        if len(out[key]) != in_chans:
            out[key] = [sum(out[key]) / len(out[key])] * in_chans
    names = stored.get("class_names", pcfg.get("class_names"))
    if names:
        out["class_names"] = [str(n) for n in names]
    return out


def save_program(ep: torch.export.ExportedProgram, path: str | Path, data_config: dict[str, Any]) -> Path:
    """``torch.export.save`` with the preprocessing as the extra file :data:`DATA_CONFIG_NAME`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.export.save(ep, str(path), extra_files={DATA_CONFIG_NAME: json.dumps(data_config)})
    return path


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


def _record_data_config(config_json: Path, data_config: dict[str, Any]) -> None:
    """Put the preprocessing into ``config.json``'s ``pretrained_cfg`` (timm's fields; class names as
    ``label_names``), so timm's ``local-dir:`` route and ``predict.py`` use the training data's statistics."""
    cfg = json.loads(config_json.read_text(encoding="utf-8"))
    pcfg = cfg.setdefault("pretrained_cfg", {})
    for key in ("mean", "std", "interpolation", "crop_pct", "input_size"):
        pcfg[key] = data_config[key]
    if data_config.get("class_names"):
        pcfg["label_names"] = data_config["class_names"]
    config_json.write_text(json.dumps(cfg, indent=2), encoding="utf-8")


def _read_json(path: Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def stored_data_config(path: str | Path) -> dict[str, Any] | None:
    """The data configuration stored with a training checkpoint or export folder, if any.

    Training checkpoint: ``hyper_parameters["data_config"]`` (or ``["data"]``), or Lightning's
    ``datamodule_hyper_parameters`` (keys ``img_size``, ``mean``, ``std``, ``interpolation``,
    ``crop_pct``, ``class_names``). Export folder: ``config.json``'s ``pretrained_cfg`` (its
    ``label_names`` as class names).
    """
    p = Path(path)
    if p.is_dir():
        cfg_path = p / "config.json"
        if not cfg_path.is_file():
            return None
        pcfg = dict(_read_json(cfg_path).get("pretrained_cfg") or {})
        out = {k: pcfg[k] for k in ("mean", "std", "interpolation", "crop_pct") if k in pcfg}
        if pcfg.get("label_names"):
            out["class_names"] = list(pcfg["label_names"])
        return out or None
    if p.suffix != ".ckpt":
        return None
    try:
        ckpt = torch.load(p, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - an unreadable file is reported by the model loader with its reason
        return None
    hp = ckpt.get("hyper_parameters") if isinstance(ckpt, dict) else None
    for cand in (
        (hp or {}).get("data_config") if isinstance(hp, dict) else None,
        (hp or {}).get("data") if isinstance(hp, dict) else None,
        ckpt.get("datamodule_hyper_parameters") if isinstance(ckpt, dict) else None,
    ):
        if isinstance(cand, dict) and any(k in cand for k in ("mean", "std", "img_size", "class_names")):
            return {
                k: cand[k] for k in ("img_size", "mean", "std", "interpolation", "crop_pct", "class_names") if k in cand
            }
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vitrel.export", description=__doc__.splitlines()[0])
    ap.add_argument("ckpt", help="training checkpoint (.ckpt) or exported weights")
    ap.add_argument("out_dir", help=f"output directory (gets {WEIGHTS_NAME} and {CONFIG_NAME})")
    ap.add_argument("--ema", action="store_true", help="export the EMA weights of the checkpoint")
    ap.add_argument("--pt2", action="store_true", help=f"also write a torch.export program ({PT2_NAME})")
    ap.add_argument("--onnx", action="store_true", help=f"also write an ONNX model ({ONNX_NAME}, opset {ONNX_OPSET})")
    ap.add_argument(
        "--dynamic",
        choices=DYNAMIC,
        default=None,
        help="dynamic sizes of the program: hw (batch, height and width; the default where possible), batch, static",
    )
    ap.add_argument("--img-size", type=int, nargs="+", default=None, help="example image size (default: the model's)")
    ap.add_argument("--opset", type=int, default=ONNX_OPSET)
    ap.add_argument(
        "--attn-impl",
        default=None,
        choices=attn_impls(),
        help="the attention kernel the export is built with and records (default: the checkpoint's): e.g. sdpa for "
        "a model trained with triton that is to run anywhere, and for ONNX",
    )
    args = ap.parse_args(argv)
    try:
        kernel = {} if args.attn_impl is None else {"attn_impl": args.attn_impl}
        model = load_model(args.ckpt, use_ema=args.ema, **kernel).eval()
        out = save_pretrained(model, args.out_dir)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    data_config = model_data_config(model, stored_data_config(args.ckpt))
    _record_data_config(out / CONFIG_NAME, data_config)
    print(f"wrote {out / WEIGHTS_NAME} and {out / CONFIG_NAME}")
    if not (args.pt2 or args.onnx):
        return 0
    dynamic = args.dynamic or best_dynamic(model)
    if args.dynamic is None and dynamic != "hw":
        print("note: this model's scheme cannot serve every resolution in one program; exporting a dynamic batch")
    size = None if args.img_size is None else (args.img_size * 2)[:2]
    example = example_input(model, img_size=size)
    try:
        if args.pt2:
            path = save_program(export_program(model, example, dynamic), out / PT2_NAME, data_config)
            print(f"wrote {path} (torch.export, dynamic={dynamic})")
        if args.onnx:
            path = export_onnx(model, out / ONNX_NAME, example, dynamic, opset=args.opset)
            print(f"wrote {path} (ONNX opset {args.opset}, dynamic={dynamic})")
    except (ValueError, ImportError, ModuleNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
