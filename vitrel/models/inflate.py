"""Start a video model from an image checkpoint: the image model's weights *inflated* to the video model.

:func:`inflate_image_model` fills a video ViT (:class:`~vitrel.models.video_vit.VideoVisionTransformer`) from an
image ViT, or a Video Swin (:class:`~vitrel.models.swin3d.SwinTransformer3D`) from an image Swin. Every block,
norm and head tensor is carried as it is (the video models use the image models' module names); what has a
time axis in the video model is inflated:

* the patch embedding, I3D's inflation (Carreira & Zisserman, 2017) of the ``p x p`` kernel ``K`` to a
  ``tubelet_size x p x p`` one: ``"average"`` (default; ``K / tubelet_size`` in every frame, Video Swin's
  ``inflate_weights``) or ``"center"`` (``K`` in the frame ``tubelet_size // 2``, zeros in the others);
* relative tables: ``rel2d_full``'s ``[2H-1, 2W-1, heads]`` repeated over ``dt`` to ``rel3d_full``'s
  ``[2T-1, 2H-1, 2W-1, heads]`` (Video Swin's ``inflate_weights``); ``rel2d_factored`` -> ``rel3d_factored``
  with the time table ``b_t = 0``;
* RoPE, unchanged in space: ``rope2d_axial`` -> ``rope3d_axial`` with ``sections: [0, d/4, d/4]``, the same
  ``base``, ``layout: sectioned``, ``freqs: per_axis`` (both rotate rows then columns, so the ``qkv`` weights are
  carried as they are); ``rope2d_mixed`` -> ``rope3d_mixed`` with ``f^t = 0``, ``f^h = f^y``, ``f^w = f^x``;
* ``pos="none"`` -> ``pos="none"``.

The image model's preprocessing (``mean``, ``std``, ``interpolation``, ``crop_pct``, ``crop_mode``; its class names
with its head) goes into the video model's ``pretrained_cfg``, from the model's ``pretrained_cfg`` or the data config
a checkpoint or export stores, so that a fine-tune or ``predict.py`` normalises frames as the image model saw them.

Anything else is refused before any weight is written: another pairing of schemes (for instance a ``rope3d_axial``
with time sections: its rotation has no image counterpart), absolute embeddings (not inflated), register tokens
(the video ViT has none), a class token on one side only, or tables of another size (build the video model for the
image model's grid or window in space).

**Exactness.** On a clip of identical frames the inflated model computes the image model's function exactly
(float64 equality in ``tests/models/test_inflate.py``) when:

* both inflations (``center`` and ``average``) give each tubelet the embedding the image gives its patch;
* in attention each spatial key then appears once per frame, every copy with the same logit (the schemes above
  depend on ``dh, dw`` only), so the softmax average is the image's. This holds for the ViT **without a class
  token** (VideoMAE's mean pooling), and for the Video Swin with windows over time, shifted in time or padded in
  time: a query's region holds the same frames for every spatial key, and vitrel masks the padding out (the
  authors' Video Swin attends to the zero padding, which would break it).

It is not exact with a class token (it is one key among ``T'`` copies of every patch, so its share of attention
shrinks), nor on clips whose frames differ (the point of a video model), nor once training gives the time axis a
role (``b_t``, ``f^t``, time sections).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from vitrel.models.checkpoint import CheckpointError, checkpoint_scores_ema, read_weights
from vitrel.models.data_config import data_fields, set_data_config, stored_data_config
from vitrel.models.registry import MODEL_ARGS, upgraded_cfg
from vitrel.models.swin import SwinTransformer
from vitrel.models.swin3d import SwinTransformer3D
from vitrel.models.timm_import import from_timm
from vitrel.models.video_vit import VideoVisionTransformer
from vitrel.models.vit import VisionTransformer
from vitrel.pos.base import PositionScheme
from vitrel.pos.registry import parse_pos

__all__ = ["PATCH_INFLATIONS", "COUNTERPARTS", "inflate_image_model", "inflate_state_dict", "inflate_patch_kernel"]

PATCH_INFLATIONS = ("average", "center")
#: video scheme -> the image scheme it is inflated from
COUNTERPARTS = {
    "none": "none",
    "rel3d_full": "rel2d_full",
    "rel3d_factored": "rel2d_factored",
    "rope3d_axial": "rope2d_axial",
    "rope3d_mixed": "rope2d_mixed",
}
_IMAGE_OF = {VideoVisionTransformer: VisionTransformer, SwinTransformer3D: SwinTransformer}


def inflate_patch_kernel(kernel: Tensor, tubelet_size: int, how: str = "average") -> Tensor:
    """An image patch kernel ``[C, in, p, p]`` -> a tubelet kernel ``[C, in, tubelet_size, p, p]``: ``"average"``
    (``K / tubelet_size`` in every frame) or ``"center"`` (``K`` in frame ``tubelet_size // 2``, zeros elsewhere)."""
    if how not in PATCH_INFLATIONS:
        raise ValueError(f"patch_inflation must be one of {PATCH_INFLATIONS}, got {how!r}")
    if how == "average":
        return kernel[:, :, None].repeat(1, 1, tubelet_size, 1, 1) / tubelet_size
    out = kernel.new_zeros(*kernel.shape[:2], tubelet_size, *kernel.shape[2:])
    out[:, :, tubelet_size // 2] = kernel
    return out


def _image_source(image: Any, video_model: nn.Module) -> tuple[dict[str, Tensor], dict[str, Any] | None]:
    """(state dict, vitrel_cfg or None) of the image model given as a model, a file / folder or a state dict; a timm
    model goes through :func:`vitrel.from_timm` with the image counterpart of the video model's scheme."""
    if isinstance(image, nn.Module):
        cfg = getattr(image, "vitrel_cfg", None)
        if cfg is None:  # a timm model: vitrel's image model of it first (its transfer report is logged)
            pos = video_model.vitrel_cfg["pos"]
            name = parse_pos(pos).name
            if name not in COUNTERPARTS:
                raise ValueError(f"inflation takes a video model with pos in {sorted(COUNTERPARTS)}, not {name!r}")
            with warnings.catch_warnings():  # (its absolute embedding is not inflated, as documented: from_timm's
                # warning would offer abs_pos='ape', which inflation refuses)
                warnings.filterwarnings("ignore", "from_timm.*trained position parameters are not carried")
                image = from_timm(image, pos=_image_spec(pos, video_model))
            cfg = image.vitrel_cfg
        return image.state_dict(), dict(cfg)
    if isinstance(image, (str, os.PathLike)):  # the weights its run tested (EMA where it scored them), as load_model
        cfg, sd = read_weights(image, use_ema=checkpoint_scores_ema(image))
        return dict(sd), (None if cfg is None else upgraded_cfg(cfg))  # its scheme specs as they are meant now
    if isinstance(image, Mapping):
        return dict(image), None
    raise TypeError(f"image must be a model, a checkpoint path or a state dict, got {type(image).__name__}")


def _image_spec(video_pos: Any, video_model: nn.Module) -> Any:
    """The image scheme spec whose inflation is the video model's scheme (used for a timm source)."""
    spec = parse_pos(video_pos)
    name = COUNTERPARTS[spec.name]
    if spec.name == "rope3d_axial":
        return {"name": name, "base": float(spec.options.get("base", 10000.0))}
    return name


#: the build arguments an inflated model shares with its image model: each changes a weight's shape, or (pooling,
#: layer norms' eps) the function the weights compute (a missing or extra weight, as of fc_norm, is named later)
_SHARED_ARGS = (
    "embed_dim", "depth", "depths", "num_heads", "mlp_ratio", "mlp_layer", "mlp_norm", "patch_size", "in_chans",
    "class_token", "qkv_bias", "global_pool", "norm_eps", "pre_norm", "act_layer",
    "final_norm", "attn_pool_num_heads", "attn_pool_mlp_ratio", "attn_pool_type", "attn_pool_depth",
    "pool_include_prefix", "post_norm",
    "qk_norm", "attn_norm", "norm_layer", "num_kv_heads", "attn_only_layer_scale", "patch_bias",
)  # fmt: skip


def _check_architecture(video_model: nn.Module, image_cfg: dict[str, Any]) -> None:
    """Refuse a video model not built with the image model's widths, depths, heads, patch, channels and pooling,
    naming each that differs and the ``create_model`` call that builds it (before any scheme's own check)."""
    vcfg = video_model.vitrel_cfg
    differ = {
        k: image_cfg[k]
        for k in _SHARED_ARGS
        if k in image_cfg and k in vcfg and _as_list(image_cfg[k]) != _as_list(vcfg[k])
    }
    if differ:
        said = "; ".join(f"{k} image {image_cfg[k]!r}, video {vcfg[k]!r}" for k in differ)
        args = ", ".join(f"{k}={v!r}" for k, v in {"pos": vcfg["pos"], **differ}.items())
        raise ValueError(
            f"the video model is not built like the image model ({said}): build it with "
            f"vitrel.create_model({vcfg['architecture']!r}, {args}, ...)"
        )


def _as_list(value: Any) -> Any:
    return list(value) if isinstance(value, (list, tuple)) else value


def _check_pairing(video_model: nn.Module, image_cfg: dict[str, Any] | None, image_pos: Any) -> None:
    vcfg = video_model.vitrel_cfg
    if image_cfg is not None:
        _check_architecture(video_model, image_cfg)
    if vcfg.get("abs_pos") is not None or (image_cfg or {}).get("abs_pos") is not None:
        raise ValueError("absolute embeddings (abs_pos) are not inflated: build both models without one")
    vspec = parse_pos(vcfg["pos"])
    if vspec.name not in COUNTERPARTS:
        raise ValueError(
            f"the video model's pos={vspec.name!r} has no image counterpart to inflate from; inflatable: "
            + ", ".join(f"{k} (from {v})" for k, v in COUNTERPARTS.items())
        )
    given = image_pos if image_pos is not None else (image_cfg or {}).get("pos")
    if given is None and vspec.name == "rope3d_axial":
        raise ValueError("a state dict without configuration: give image_pos= (the image model's pos, with its base)")
    if given is not None:
        ispec = parse_pos(given)
        if ispec.name != COUNTERPARTS[vspec.name]:
            raise ValueError(
                f"the image model's pos={ispec.name!r} does not inflate to pos={vspec.name!r}; "
                f"{vspec.name} is inflated from {COUNTERPARTS[vspec.name]}"
            )
        if vspec.name == "rope3d_axial":
            _check_rope_axial(video_model, ispec)
    if image_cfg is not None:
        for key in ("pos_share",):
            if bool(image_cfg.get(key, False)) != bool(vcfg.get(key, False)):
                raise ValueError(f"{key} differs: image {image_cfg.get(key)}, video {vcfg.get(key)}")
        if image_cfg.get("reg_tokens"):
            raise ValueError("the image model has register tokens; the video ViT has none")
        if image_cfg.get("prefix_at") or image_cfg.get("pos_depth") is not None:
            raise ValueError("the image model's layout (pos_depth, prefix_at) is not the video ViT's (every block)")


def _check_rope_axial(video_model: nn.Module, image_spec: Any) -> None:
    """``rope3d_axial`` equals the image's ``rope2d_axial`` in space only as ``sections [0, d/4, d/4]``, sectioned,
    per_axis, at the image's base (``rope2d_axial``'s default base is 100), neither scaled."""
    img_base = float(image_spec.options.get("base", 100.0))
    bad = {k: image_spec.options[k] for k in ("coords", "basis", "scaling", "order") if image_spec.options.get(k) not in
           (None, "index", "identity", "rows_first")}  # fmt: skip
    if bad:
        hint = ""
        if "order" in bad:  # a model from before vitrel_format 5
            hint = (
                ": build the image model with rope2d_axial's rows-first order, load its weights and convert them "
                "with vitrel.models.swap_rope_axial_halves, then inflate that model"
            )
        raise ValueError(f"rope2d_axial with {bad} has no rope3d_axial counterpart{hint}")
    for m in video_model.modules():
        if isinstance(m, PositionScheme) and m.name == "rope3d_axial":
            d = m.head_dim
            want = (0, d // 4, d // 4)
            if (
                tuple(m.sections) != want
                or m.pair_layout != "sectioned"
                or m.freq_rule != "per_axis"
                or float(m.base) != img_base
                or m.scaling is not None
            ):
                raise ValueError(
                    f"rope2d_axial (base {img_base:g}) inflates to rope3d_axial with sections {list(want)}, layout "
                    f"sectioned, freqs per_axis, base {img_base:g} and no scaling; the video model's is sections "
                    f"{list(m.sections)}, layout {m.pair_layout}, freqs {m.freq_rule}, base {float(m.base):g}"
                )


def _scheme_prefixes(model: nn.Module) -> dict[str, PositionScheme]:
    return {name + ".": m for name, m in model.named_modules() if isinstance(m, PositionScheme)}


_SAME_GRID = ": build the video model at the image model's img_size and patch_size (Swin: window_size)"


def _inflate_scheme(scheme: PositionScheme, src: dict[str, Tensor], dst: dict[str, Tensor]) -> dict[str, Tensor]:
    """The video scheme's parameters (``dst``: their current values, by name) from the image scheme's (``src``)."""
    name = scheme.name
    if name == "rel3d_full":
        t2, t3 = src.get("table"), dst["table"]  # [2H-1, 2W-1, heads] and [2T-1, 2H-1, (2W-1) heads]
        want = (t3.shape[1], t3.shape[2] // scheme.num_heads, scheme.num_heads)
        if t2 is None or tuple(t2.shape) != want:
            raise ValueError(
                f"rel3d_full's table {(t3.shape[0], *want)} needs an image table {want} (rel2d_full of the "
                f"same grid or window in space), got {None if t2 is None else tuple(t2.shape)}{_SAME_GRID}"
            )
        return {"table": t2.flatten(1)[None].expand_as(t3).clone()}
    if name == "rel3d_factored":
        out = {}
        for key, value in dst.items():
            if key in ("table_h", "table_w"):
                if key not in src or src[key].shape != value.shape:
                    got = tuple(src[key].shape) if key in src else None
                    raise ValueError(
                        f"rel3d_factored's {key} {tuple(value.shape)} needs rel2d_factored's of that size, got {got}"
                        + _SAME_GRID
                    )
                out[key] = src[key].clone()
            elif key == "table_t":
                out[key] = torch.zeros_like(value)
            else:
                raise ValueError(f"rel3d_factored's parameter {key!r} has no image counterpart")
        return out
    if name == "rope3d_mixed":
        f2, f3 = src.get("freqs"), dst["freqs"]
        if f2 is None or f2.shape[0] != 2 or f2.shape[1:] != f3.shape[1:]:
            got = None if f2 is None else tuple(f2.shape)
            raise ValueError(
                f"rope3d_mixed's freqs {tuple(f3.shape)} need rope2d_mixed's [2, heads, d/2] of that size, got {got}"
            )
        return {"freqs": torch.stack([torch.zeros_like(f2[0]), f2[1], f2[0]])}
    if src or dst:
        raise ValueError(f"{name}: parameters {sorted(dst)} from {sorted(src)} are not inflated")
    return {}


def inflate_state_dict(
    image: Any,
    video_model: nn.Module,
    patch_inflation: str = "average",
    head: bool = True,
    drop: Iterable[str] = (),
    image_pos: Any = None,
) -> dict[str, Tensor]:
    """The video model's state dict from the image model's (:func:`inflate_image_model`'s arguments); the video
    model is not changed. Raises before returning anything for whatever cannot be inflated."""
    if patch_inflation not in PATCH_INFLATIONS:
        raise ValueError(f"patch_inflation must be one of {PATCH_INFLATIONS}, got {patch_inflation!r}")
    image_cls = _IMAGE_OF.get(type(video_model))
    if image_cls is None:
        raise TypeError(
            f"video_model must be a VideoVisionTransformer or a SwinTransformer3D, got {type(video_model).__name__}"
        )
    sd, cfg = _image_source(image, video_model)
    if cfg is not None and cfg.get("architecture"):
        cls = MODEL_ARGS.get(cfg["architecture"], (None,))[0]
        if cls is not image_cls:
            what = f"a {type(video_model).__name__} inflates from a {image_cls.__name__}"
            raise ValueError(f"{what}, not {cfg['architecture']}")
    _check_pairing(video_model, cfg, image_pos)
    drop = set(drop)
    unknown = drop - set(sd)
    if unknown:
        raise ValueError(f"drop names keys the image state dict does not have: {sorted(unknown)}")
    own = video_model.state_dict()
    out: dict[str, Tensor] = {}
    used = set(drop)
    for prefix, scheme in _scheme_prefixes(video_model).items():
        src = {k[len(prefix) :]: v for k, v in sd.items() if k.startswith(prefix)}
        dst = {k[len(prefix) :]: v for k, v in own.items() if k.startswith(prefix)}
        out.update({prefix + k: v for k, v in _inflate_scheme(scheme, src, dst).items()})
        used.update(prefix + k for k in src)
    missing, bad = [], []
    for key, value in own.items():
        if key in out:
            continue
        if not head and key.split(".")[0] in ("head", "fc_norm"):
            out[key] = value
            continue
        if key not in sd:
            missing.append(key)
            continue
        src = sd[key]
        used.add(key)
        if key == "patch_embed.proj.weight":
            src = inflate_patch_kernel(src, value.shape[2], patch_inflation) if src.dim() == 4 else src
        if tuple(src.shape) != tuple(value.shape):
            bad.append(f"{key}: image {tuple(src.shape)}, video {tuple(value.shape)}")
            continue
        out[key] = src.to(value.dtype)
    if not head:
        used.update(k for k in sd if k.split(".")[0] in ("head", "fc_norm"))
    unused = sorted(set(sd) - used)
    problems = []
    if missing:
        problems.append(f"missing from the image weights: {missing[:6]}")
    if bad:
        problems.append("shapes that differ: " + "; ".join(bad[:4]))
    if unused:
        problems.append(f"image weights with no place in the video model: {unused[:6]} (drop= leaves them out)")
    if problems:
        hint = " (a head of another size: head=False keeps the video model's)" if any("head." in b for b in bad) else ""
        raise CheckpointError(f"cannot inflate into {type(video_model).__name__}: " + "; ".join(problems) + hint)
    return out


def inflate_image_model(
    image: Any,
    video_model: nn.Module,
    patch_inflation: str = "average",
    head: bool = True,
    drop: Iterable[str] = (),
    image_pos: Any = None,
) -> nn.Module:
    """Fill ``video_model`` with the inflated weights of an image model (module docstring) and return it.

    Args:
        image: the image model (a vitrel ``VisionTransformer`` / ``SwinTransformer``, or a timm ViT / Swin, converted
            by :func:`vitrel.from_timm` with the image counterpart of the video model's scheme), a vitrel checkpoint
            or export (a path; a training checkpoint gives the weights its run tested, the EMA copy where it scored
            that, as :func:`vitrel.load_model`), or a state dict (vitrel's keys; a timm ViT's state dict has the same
            keys but for ``pos_embed``, which ``drop=("pos_embed",)`` leaves out).
        video_model: a :class:`~vitrel.models.VideoVisionTransformer` or :class:`~vitrel.models.SwinTransformer3D`
            (``vitrel.create_model("vitrel_vit_video_...", pos="rel3d_full", ...)``), built with the image model's
            widths, depths and heads, and the 3-D counterpart of its scheme (:data:`COUNTERPARTS`).
        patch_inflation: ``"average"`` or ``"center"`` (module docstring).
        head: carry the image model's head (and ``fc_norm``); False keeps the video model's (another label set).
        drop: image keys to leave out on purpose (everything else must find its place).
        image_pos: the image model's ``pos`` for a state dict without configuration (checked against the video
            scheme; needed for ``rope3d_axial``, whose base must be the image's).
    """
    sd = inflate_state_dict(image, video_model, patch_inflation, head, drop, image_pos)
    video_model.load_state_dict(sd, strict=True)
    _carry_preprocessing(image, video_model, head)
    return video_model


#: the preprocessing an inflated model keeps from its image model (the input size and clip are the video model's)
_PREPROCESSING = ("mean", "std", "interpolation", "crop_pct", "crop_mode")


def _carry_preprocessing(image: Any, video_model: nn.Module, head: bool) -> None:
    """The image model's normalisation, resize and crop (and its class names, with its head) into
    ``video_model.pretrained_cfg``: a model's ``pretrained_cfg`` (``vitrel.load_model``'s, timm's), a checkpoint's or
    export's stored data config; a bare state dict has none (the video model's stay)."""
    if isinstance(image, nn.Module):
        src = data_fields(getattr(image, "pretrained_cfg", None) or {})
    elif isinstance(image, (str, os.PathLike)):
        src = stored_data_config(image) or {}
    else:
        return
    carried = {k: src[k] for k in _PREPROCESSING if k in src}
    names = src.get("class_names") if head else None  # (head=False: the video model's head, not the image's)
    if carried or names:
        set_data_config(video_model, {**carried, **({"class_names": names} if names else {})})
