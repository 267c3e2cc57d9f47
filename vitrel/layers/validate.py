"""Checks of the size arguments of the vitrel constructors, with errors that name the argument.

Without them a bad size fails deep inside (``num_heads=0``: ``ZeroDivisionError('integer modulo by
zero')``; ``patch_size=0``: the same in the grid; ``mlp_ratio=-1``: a negative ``nn.Linear`` width).
``VisionTransformer``, ``SwinTransformer`` and ``Attention`` each call one function with their ``locals()``,
first thing in ``__init__``.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "check_attention_args",
    "check_count",
    "ACT_LAYERS",
    "ATTN_POOL_TYPES",
    "MLP_LAYERS",
    "NORM_LAYERS",
    "check_late_prefix",
    "check_num_classes",
    "check_swin_args",
    "check_vit_args",
]


#: the MLPs a ViT block takes (``mlp_layer``: :func:`vitrel.layers.mlp.make_mlp`) and their activations
MLP_LAYERS = ("mlp", "swiglu")
ACT_LAYERS = ("gelu", "gelu_tanh", "quick_gelu")
#: the norms of a ViT's layers (``norm_layer``: :func:`vitrel.layers.norms.make_norm`), timm's names
NORM_LAYERS = ("layernorm", "rmsnorm")
#: ``global_pool="map"``'s pools (``attn_pool_type``): timm's ``AttentionPoolLatent``, V-JEPA 2's attentive pool
ATTN_POOL_TYPES = ("latent", "attentive")


def _kv_heads(args: Mapping[str, Any], heads: int) -> None:
    """``num_kv_heads`` None, or a divisor of ``num_heads`` (each key / value head serves as many query heads); for a
    model also one per block, a list of ``depth``."""
    kv = args.get("num_kv_heads")
    per_block = isinstance(kv, Sequence) and "depth" in args
    if per_block and len(kv) != args["depth"]:
        raise ValueError(f"num_kv_heads lists {len(kv)} values, one per block of depth {args['depth']}")
    for v in kv if per_block else [kv]:
        if v is not None:
            _divisible("num_heads", heads, "num_kv_heads", _positive_int("num_kv_heads", v))


def _norm_layer(value: Any) -> None:
    if value not in NORM_LAYERS:
        raise ValueError(f"norm_layer must be one of {NORM_LAYERS} (timm's names), got {value!r}")


def _int_at_least(name: str, value: Any, least: int) -> int:
    """``value`` as an int >= ``least`` (an int-like, not a bool or a float); else an error naming ``name``."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer >= {least}, got {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer >= {least}, got {value!r} ({type(value).__name__})") from None
    if v < least:
        raise ValueError(f"{name} must be >= {least}, got {v}")
    return v


def _positive_int(name: str, value: Any) -> int:
    """``value`` as an int >= 1 (an int-like, not a bool or a float); else an error naming ``name``."""
    return _int_at_least(name, value, 1)


def check_num_classes(value: Any) -> int:
    """``num_classes`` as an int >= 0 (0: no head, as timm); a negative count, a float or a bool is refused
    (``-1`` and ``False`` built a headless model, ``2.0`` and ``True`` failed inside ``nn.Linear``)."""
    if isinstance(value, bool):
        raise TypeError(f"num_classes must be an integer >= 0 (0 for no head), got {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(
            f"num_classes must be an integer >= 0 (0 for no head), got {value!r} ({type(value).__name__})"
        ) from None
    if v < 0:
        raise ValueError(f"num_classes must be >= 0 (0 for no head), got {v}")
    return v


def check_count(name: str, value: Any) -> int:
    """``value`` as an int >= 0 (``num_prefix_tokens``); else an error naming ``name``."""
    return _int_at_least(name, value, 0)


def _positive_ints(name: str, value: Any) -> list[int]:
    """A non-empty sequence of ints >= 1 (``depths``, ``num_heads`` of Swin's stages)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise ValueError(f"{name} must be a non-empty list of integers >= 1, got {value!r}")
    return [_positive_int(f"{name}[{i}]", v) for i, v in enumerate(value)]


def _pair(name: str, value: Any) -> tuple[int, int]:
    """An int or an (h, w) pair, each >= 1."""
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        if len(value) != 2:
            raise ValueError(f"{name} must be an integer or an (h, w) pair, got {value!r}")
        return _positive_int(f"{name}[0]", value[0]), _positive_int(f"{name}[1]", value[1])
    v = _positive_int(name, value)
    return v, v


def _mlp_ratio(value: Any, name: str = "mlp_ratio") -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a number > 0, got {value!r}")


#: the dropout and stochastic-depth rates of the models' constructors (a probability each; drop_path_rate the last
#: block's, linear from 0 over the blocks as timm's)
RATES = ("drop_rate", "pos_drop_rate", "proj_drop_rate", "attn_drop_rate", "drop_path_rate")


def _rates(args: Mapping[str, Any], names: Sequence[str] = RATES) -> None:
    """Each rate of ``names`` that ``args`` has: a number in [0, 1] (``drop_path_rate=2`` built a model whose first
    training step failed inside timm's ``drop_path``, ``attn_drop=1.5`` one whose first forward failed in SDPA)."""
    for name in names:
        v = args.get(name)
        if name in args and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1):
            raise ValueError(f"{name} must be a number in [0, 1], got {v!r}")


def _divisible(width_name: str, width: int, heads_name: str, heads: int) -> None:
    if width % heads:
        raise ValueError(f"{width_name} {width} is not divisible by {heads_name} {heads}")


def _image_fits(img_size: Any, patch_size: int, hint: str = "") -> None:
    h, w = _pair("img_size", img_size)
    if h % patch_size or w % patch_size:
        # the wording of the grid's own check (vitrel.models.blocks), plus the arguments' names
        raise ValueError(
            f"image size {h}x{w} is not a positive multiple of the patch size {patch_size} (img_size, patch_size)"
            + hint
        )


def check_attention_args(args: Mapping[str, Any]) -> None:
    """``Attention(dim, num_heads, ...)`` (its ``locals()``): both >= 1, ``dim`` divisible by ``num_heads``, the
    dropout rates in [0, 1]."""
    dim, heads = _positive_int("dim", args["dim"]), _positive_int("num_heads", args["num_heads"])
    _divisible("dim", dim, "num_heads", heads)
    _kv_heads(args, heads)
    _rates(args, ("attn_drop", "proj_drop"))
    _norm_layer(args["norm_layer"])
    if args["qkv_bias"] not in (True, False, "qv") or not isinstance(args["qkv_bias"], (bool, str)):
        raise ValueError(f"qkv_bias must be true, false or 'qv' (no key bias), got {args['qkv_bias']!r}")
    check_count("num_prefix_tokens", args.get("num_prefix_tokens", 0))  # (negative: the patches' bias rows cropped)


def check_vit_args(args: Mapping[str, Any]) -> None:
    """``VisionTransformer``'s sizes (its ``locals()``): positive, ``embed_dim`` divisible by ``num_heads``, the
    rates in [0, 1], the image a whole number of patches (or padded to one: ``dynamic_img_pad``)."""
    patch = _positive_int("patch_size", args["patch_size"])
    _positive_int("in_chans", args["in_chans"])
    check_num_classes(args["num_classes"])
    dim, heads = _positive_int("embed_dim", args["embed_dim"]), _positive_int("num_heads", args["num_heads"])
    _divisible("embed_dim", dim, "num_heads", heads)
    _kv_heads(args, heads)
    _positive_int("depth", args["depth"])
    _mlp_ratio(args["mlp_ratio"])
    if args["mlp_layer"] not in MLP_LAYERS:
        raise ValueError(
            f"mlp_layer must be 'mlp' (timm's Mlp, GELU) or 'swiglu' (timm's SwiGLU), got {args['mlp_layer']!r}"
        )
    if args["act_layer"] not in ACT_LAYERS:
        raise ValueError(f"act_layer must be one of {ACT_LAYERS} (timm's names), got {args['act_layer']!r}")
    if args["act_layer"] != "gelu" and args["mlp_layer"] == "swiglu":
        raise ValueError(f"act_layer={args['act_layer']!r} is an Mlp's; mlp_layer='swiglu' gates with SiLU")
    _norm_layer(args["norm_layer"])
    flags = ("mlp_norm", "pre_norm", "post_norm", "qk_norm", "attn_norm", "final_norm", "pool_include_prefix",
             "attn_only_layer_scale", "patch_bias")  # fmt: skip
    for flag in flags:
        if not isinstance(args[flag], bool):
            raise ValueError(f"{flag} must be true or false, got {args[flag]!r}")
    if args["attn_pool_num_heads"] is not None:
        pool = _positive_int("attn_pool_num_heads", args["attn_pool_num_heads"])
        _divisible("embed_dim", dim, "attn_pool_num_heads", pool)
    if args["attn_pool_mlp_ratio"] is not None:
        _mlp_ratio(args["attn_pool_mlp_ratio"], "attn_pool_mlp_ratio")
    if args["attn_pool_type"] not in ATTN_POOL_TYPES:
        raise ValueError(f"attn_pool_type must be one of {ATTN_POOL_TYPES}, got {args['attn_pool_type']!r}")
    depth = _positive_int("attn_pool_depth", args["attn_pool_depth"])
    if depth != 1 and args["attn_pool_type"] != "attentive":
        raise ValueError(f"attn_pool_depth={depth} is the attentive pool's (attn_pool_type='attentive')")
    _rates(args)
    scale = args.get("head_init_scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0.0 <= scale < float("inf"):
        raise ValueError(f"head_init_scale must be a finite number >= 0, got {scale!r}")
    if args.get("dynamic_img_pad"):
        _pair("img_size", args["img_size"])  # (padded to whole patches, as the images)
    else:
        _image_fits(args["img_size"], patch, "; give img_size in whole patches, or dynamic_img_pad=True to zero-pad")


def check_swin_args(args: Mapping[str, Any]) -> None:
    """``SwinTransformer``'s sizes (its ``locals()``): positive, one head count per stage, each stage's
    width (``embed_dim`` doubled per stage) divisible by its heads, the rates in [0, 1], the image a whole number of
    patches."""
    patch = _positive_int("patch_size", args["patch_size"])
    _positive_int("in_chans", args["in_chans"])
    check_num_classes(args["num_classes"])
    dim = _positive_int("embed_dim", args["embed_dim"])
    depths, heads = _positive_ints("depths", args["depths"]), _positive_ints("num_heads", args["num_heads"])
    if len(depths) != len(heads):
        raise ValueError(f"depths {depths} and num_heads {heads} must have one entry per stage")
    for i, h in enumerate(heads):
        _divisible(f"embed_dim * 2**{i} (stage {i}'s width)", dim * 2**i, f"num_heads[{i}]", h)
    _pair("window_size", args["window_size"])
    _mlp_ratio(args["mlp_ratio"])
    for flag in ("post_norm", "cosine_attn"):  # (the 2-D Swin's: the Video Swin has neither)
        if not isinstance(args.get(flag, False), bool):
            raise ValueError(f"{flag} must be true or false, got {args[flag]!r}")
    _rates(args)
    _image_fits(args["img_size"], patch)


def check_late_prefix(prefix_at: Any, pos_depth: Any, depth: int, num_prefix_tokens: int, rel: str) -> None:
    """A ViT's ``pos_depth`` (its first ``pos_depth`` blocks carry the relative scheme ``rel``) and ``prefix_at`` (its
    ``num_prefix_tokens`` prefix tokens join before block ``prefix_at``; 0: at the input), for ``depth`` blocks: the
    prefix joins before some block, and only blocks before it carry a relative scheme (ConViT's layout)."""
    pos_depth = _int_at_least("pos_depth", pos_depth, 0)
    if pos_depth > depth:
        raise ValueError(f"pos_depth must be at most depth ({depth}), got {pos_depth}")
    if not _int_at_least("prefix_at", prefix_at, 0):
        return
    if not num_prefix_tokens:
        raise ValueError(f"prefix_at={prefix_at} places the prefix tokens, but the model has none (class_token=False)")
    if prefix_at >= depth:
        raise ValueError(f"prefix_at must be below depth ({depth}): the prefix tokens join before block prefix_at")
    if pos_depth > prefix_at and rel != "none":
        raise ValueError(
            f"prefix_at={prefix_at} with pos_depth={pos_depth}: only the blocks before the prefix tokens join carry "
            f"the relative scheme ({rel}); give pos_depth <= prefix_at (ConViT's convit_* models: both 10)"
        )
