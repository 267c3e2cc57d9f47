"""The architecture table and building from it: no file or network I/O here.

``MODEL_ARGS`` maps each vitrel architecture name to its class and constructor arguments;
:func:`build` makes one through timm's ``build_model_with_cfg`` (so it carries timm's
``pretrained_cfg``) and stamps ``model.vitrel_cfg`` with the architecture name, which is all a
checkpoint needs to rebuild it (:func:`build_from_cfg`). Reading and writing weights is
``vitrel.models.checkpoint``; ``vitrel.create_model`` and the timm entry points are
``vitrel.models.factory``.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from typing import Any

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models import (
    FeatureDictNet,
    FeatureGraphNet,
    FeatureHookNet,
    FeatureListNet,
    build_model_with_cfg,
    generate_default_cfgs,
    get_pretrained_cfg,
)
from timm.models._features import FeatureGetterNet
from torch import nn

from vitrel.models.data_config import TIMM_CFG_FIELDS
from vitrel.models.features import FeatureGetter
from vitrel.models.swin import SwinTransformer
from vitrel.models.swin3d import SwinTransformer3D
from vitrel.models.timm_surface import take_indices
from vitrel.models.video_features import ClipFeatureGetterNet
from vitrel.models.video_vit import VideoVisionTransformer
from vitrel.models.vit import VisionTransformer
from vitrel.pos.registry import get_pos_class

#: ``vitrel_cfg["vitrel_format"]`` of the configurations written now (0.1's had none: format 1). 2: ALiBi's
#: reference slopes; 3: LookHere's ``fov`` names the authors' head groups, ``global_slope`` 2; 4: ``liere`` is the
#: LieRE authors' configuration (``preset: liere_authors``; before: ``comrope_baseline``); 5: ``rope2d_axial`` rotates
#: rows first (before: ``order: columns_first``); 6: ``liere``'s ``init_std`` beside another init and LookHere's ``fov``
#: beside ``directions`` are refused (stored specs, where they were ignored, drop them); 7: a learned table's negative
#: ``init_std`` is refused (stored specs drop it: it only set the initial values, which the stored weights replace);
#: 8: ``rel2d_cpb``'s MLP gets no weight decay (before: ``mlp_weight_decay: true``).
FORMAT = 8

__all__ = [
    "MODEL_ARGS", "default_cfgs", "list_models", "check_architecture", "build", "build_from_cfg", "upgraded_cfg",
    "split_feature_args", "with_features",
]  # fmt: skip

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)

# Architecture -> (class, arguments). Sizes as timm's (ViT: tiny 192/3, small 384/6, base 768/12).
MODEL_ARGS: dict[str, tuple[type[nn.Module], dict[str, Any]]] = {
    "vitrel_vit_tiny_patch16_224": (VisionTransformer, dict(patch_size=16, embed_dim=192, depth=12, num_heads=3)),
    "vitrel_vit_small_patch16_224": (VisionTransformer, dict(patch_size=16, embed_dim=384, depth=12, num_heads=6)),
    "vitrel_vit_base_patch16_224": (VisionTransformer, dict(patch_size=16, embed_dim=768, depth=12, num_heads=12)),
    "vitrel_vit_tiny_patch4_32": (
        VisionTransformer,
        dict(img_size=32, patch_size=4, embed_dim=192, depth=12, num_heads=3, num_classes=10),
    ),
    "vitrel_vit_small_patch4_32": (
        VisionTransformer,
        dict(img_size=32, patch_size=4, embed_dim=384, depth=12, num_heads=6, num_classes=10),
    ),
    "vitrel_swin_tiny_patch4_window7_224": (
        SwinTransformer,
        dict(patch_size=4, window_size=7, embed_dim=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24)),
    ),
    "vitrel_swin_small_patch4_window7_224": (
        SwinTransformer,
        dict(patch_size=4, window_size=7, embed_dim=96, depths=(2, 2, 18, 2), num_heads=(3, 6, 12, 24)),
    ),
    "vitrel_swin_base_patch4_window7_224": (
        SwinTransformer,
        dict(patch_size=4, window_size=7, embed_dim=128, depths=(2, 2, 18, 2), num_heads=(4, 8, 16, 32)),
    ),
    # 32x32 inputs: patch 2 -> grids 16, 8, 4, 2 over the stages; window 4 (stage 3 shrinks it to 2)
    "vitrel_swin_tiny_patch2_window4_32": (
        SwinTransformer,
        dict(
            img_size=32,
            patch_size=2,
            window_size=4,
            embed_dim=96,
            depths=(2, 2, 6, 2),
            num_heads=(3, 6, 12, 24),
            num_classes=10,
        ),
    ),
    # video (clips [B, C, T, H, W]). VideoMAE's ViT-S/16 at 16 frames, tubelet 2, with ViT-Ti's width
    "vitrel_vit_video_tiny_patch16_224": (
        VideoVisionTransformer,
        dict(num_frames=16, tubelet_size=2, patch_size=16, embed_dim=192, depth=12, num_heads=3),
    ),
    "vitrel_vit_video_small_patch16_224": (
        VideoVisionTransformer,
        dict(num_frames=16, tubelet_size=2, patch_size=16, embed_dim=384, depth=12, num_heads=6),
    ),
    "vitrel_vit_video_base_patch16_224": (
        VideoVisionTransformer,
        dict(num_frames=16, tubelet_size=2, patch_size=16, embed_dim=768, depth=12, num_heads=12),
    ),
    # Moving Fashion-MNIST's clips (1 x 8 x 32 x 32, 2 classes): one frame per tubelet, so that only the position
    # scheme tells the frames' order (data=moving_fmnist; docs/video.md)
    "vitrel_vit_video_tiny_patch4_32": (
        VideoVisionTransformer,
        dict(
            img_size=32,
            num_frames=8,
            tubelet_size=1,
            patch_size=4,
            in_chans=1,
            embed_dim=192,
            depth=12,
            num_heads=3,
            num_classes=2,
        ),
    ),
    # Video Swin-T (Kinetics: 32 frames, tubelet 2 x 4 x 4, window 8 x 7 x 7)
    "vitrel_swin3d_tiny_patch244_window877_224": (
        SwinTransformer3D,
        dict(
            num_frames=32,
            tubelet_size=2,
            patch_size=4,
            window_size=(8, 7, 7),
            embed_dim=96,
            depths=(2, 2, 6, 2),
            num_heads=(3, 6, 12, 24),
            drop_path_rate=0.1,
        ),
    ),  # fmt: skip
    # Moving Fashion-MNIST (1 x 8 x 32 x 32, 2 classes): one frame per tubelet; grids 8 x 16 x 16 .. 8 x 2 x 2 over
    # the stages, window 4 x 4 x 4 (shifted by 2 in time too; stage 3 shrinks it to 4 x 2 x 2)
    "vitrel_swin3d_tiny_patch122_window444_32": (
        SwinTransformer3D,
        dict(
            img_size=32,
            num_frames=8,
            tubelet_size=1,
            patch_size=2,
            window_size=(4, 4, 4),
            in_chans=1,
            embed_dim=96,
            depths=(2, 2, 6, 2),
            num_heads=(3, 6, 12, 24),
            num_classes=2,
        ),
    ),  # fmt: skip
}


def _cfg(name: str, **kwargs: Any) -> dict[str, Any]:
    """timm's ``pretrained_cfg`` of an architecture. ``pool_size``: the final feature map the model pools, as
    its class says (``feature_defaults``: the Swin's ``img / patch / 2^(stages-1)`` per side, as timm's Swin;
    None for the ViT's tokens, as timm's ViT). ``first_conv`` / ``classifier``: the modules whose ``.weight``
    timm adapts for ``in_chans`` / ``num_classes``."""
    cls, args = MODEL_ARGS[name]
    size = args.get("img_size", 224)
    chans = args.get("in_chans", 3)
    small = size == 32
    pool = cls.feature_defaults(args)["pool_size"]
    mean, std = (CIFAR_MEAN, CIFAR_STD) if small else (IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD)
    if chans != 3:  # (a video data module normalises with its own clips' statistics)
        mean, std = (0.5,) * chans, (0.5,) * chans
    return {
        "url": "",
        "num_classes": args.get("num_classes", 1000),
        "input_size": (chans, size, size),
        "pool_size": pool,
        "crop_pct": 1.0 if small else 0.9,
        "interpolation": "bicubic",
        "fixed_input_size": False,
        "mean": mean,
        "std": std,
        "first_conv": "patch_embed.proj",
        "classifier": "head",
        "license": "apache-2.0",
        **kwargs,
    }


default_cfgs = generate_default_cfgs({name: _cfg(name) for name in MODEL_ARGS})


def list_models(pattern: str = "*") -> list[str]:
    """Names of the vitrel architectures matching a shell-style ``pattern``."""
    return sorted(n for n in MODEL_ARGS if fnmatch.fnmatch(n, pattern))


def check_architecture(name: str) -> str:
    """``name`` if it is a vitrel architecture, else a ``ValueError`` listing the known ones."""
    if name not in MODEL_ARGS:
        raise ValueError(f"unknown vitrel model {name!r}; known: {', '.join(list_models())}")
    return name


def build(
    name: str,
    pretrained: bool = False,
    pretrained_filter_fn: Callable[[dict, nn.Module], dict] | None = None,
    **kwargs: Any,
) -> nn.Module:
    """Build architecture ``name`` with ``kwargs`` over its defaults, through timm's ``build_model_with_cfg``.

    ``pretrained=True`` lets timm load the weights named by ``pretrained_cfg_overlay=dict(file=...)``
    (``vitrel.models.factory`` passes the filter that accepts our checkpoints' key layouts).
    """
    cls, defaults = MODEL_ARGS[check_architecture(name)]
    written = kwargs.pop("vitrel_format", None)  # a stored config's format tag (timm's local-dir route passes
    if written is not None:  # model_args): its scheme specs keep their meaning, as in build_from_cfg
        kwargs = _upgrade(kwargs, int(written))
    overlay = kwargs.pop("pretrained_cfg_overlay", None)
    pretrained_cfg = kwargs.pop("pretrained_cfg", None)
    if isinstance(pretrained_cfg, Mapping):  # (timm's local-dir: / hf-hub: route, a config.json's: save_for_hf wrote
        # the model's own with vitrel's data fields, which timm's PretrainedCfg does not take; the loaded weights'
        # data config puts them back, read from that config.json: vitrel.models.data_config.stored_data_config)
        pretrained_cfg = {k: v for k, v in pretrained_cfg.items() if k in TIMM_CFG_FIELDS}
    pretrained_model_args = kwargs.pop("pretrained_model_args", None)
    cache_dir = kwargs.pop("cache_dir", None)
    features_only = bool(kwargs.get("features_only"))
    if features_only:
        kwargs["feature_cfg"] = _feature_cfg(cls, kwargs, defaults)
    model = build_model_with_cfg(
        cls,
        name,
        pretrained,
        pretrained_cfg=pretrained_cfg,
        pretrained_cfg_overlay=overlay or None,
        pretrained_filter_fn=pretrained_filter_fn,
        pretrained_model_args=pretrained_model_args,
        cache_dir=cache_dir,
        **{**defaults, **kwargs},
    )
    # the network, inside timm's feature wrapper when there is one (getter: .model; hook: its body); fx and
    # the list / dict wrappers rebuild the network from its parts, which then carry no configuration
    net = next((m for m in model.modules() if isinstance(m, cls)), None)
    if net is not None:
        net.vitrel_cfg = {"architecture": name, "vitrel_format": FORMAT, **net.vitrel_cfg}
    return model


_FEATURE_CLS = {FeatureGetterNet: "getter", FeatureHookNet: "hook", FeatureListNet: "list", FeatureDictNet: "dict"}


def _feature_kind(feature_cls: Any) -> str:
    """timm's ``feature_cls`` (a name as timm's builder reads it, or a class) as one of getter | hook |
    list | dict | fx (a ``ValueError`` for anything else)."""
    if isinstance(feature_cls, str):
        kind = "hook" if "hook" in feature_cls.lower() else feature_cls.lower()
        if kind in ("getter", "hook", "list", "dict", "fx"):
            return kind
    elif isinstance(feature_cls, type):
        if issubclass(feature_cls, FeatureGraphNet):
            return "fx"
        for base, kind in _FEATURE_CLS.items():  # FeatureListNet before FeatureDictNet (its base)
            if issubclass(feature_cls, base):
                return kind
    raise ValueError(f"unknown feature_cls {feature_cls!r}: getter, hook, fx, list or dict")


def _feature_cfg(cls: type[nn.Module], kwargs: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """timm's ``feature_cfg`` for ``features_only`` (``out_indices``, ``feature_cls`` and ``output_fmt``
    keyword arguments moved into it).

    Default: vitrel's :class:`~vitrel.models.features.FeatureGetter` (timm's ``FeatureGetterNet`` with
    ``set_grad_checkpointing`` and a ``load_state_dict`` that takes the whole network's weights) over
    ``forward_intermediates`` (every Swin stage; the ViT's last 3 blocks, as timm's ViT, or all of a shallower one;
    ``out_indices`` the model does not have: a ``ValueError``), or the model's own getter
    (``feature_defaults()["getter"]``: the video models' ``ClipFeatureGetterNet``, maps ``NCTHW`` / ``NTHWC``)
    where timm's is asked for by name. Layout, as timm's
    Swin: the model's own ``output_fmt`` (Swin ``NHWC``; the ViT ``NCHW``; video ``NCTHW``) unless ``output_fmt=``
    says otherwise (the getter permutes). ``hook`` / ``fx`` / ``list`` / ``dict`` return the stage outputs as they
    are (Swin: ``NHWC``, so another ``output_fmt`` is refused); ``list`` / ``dict`` run the Swin's children in turn
    (timm's ``flatten_sequential``), which the ViT (blocks take the grid) and a Swin with an absolute embedding
    (added by the model) do not allow; a model whose ``feature_defaults`` says ``getter_only`` refuses all four.
    """
    depths = kwargs.get("depths", defaults.get("depths"))
    n = len(depths) if depths is not None else int(kwargs.get("depth", defaults.get("depth", 3)))
    cfg = {"out_indices": tuple(range(n)) if depths is not None else min(3, n), **(kwargs.get("feature_cfg") or {})}
    for key in ("out_indices", "feature_cls", "output_fmt"):
        if key in kwargs:
            cfg[key] = kwargs.pop(key)
    take_indices(n, cfg["out_indices"], "stages" if depths is not None else "blocks")  # (timm's: an assertion)
    kind = _feature_kind(cfg.setdefault("feature_cls", "getter"))
    seam = cls.feature_defaults({**defaults, **kwargs})
    if kind != "getter" and seam.get("getter_only") is not None:
        raise ValueError(
            f"feature_cls={kind!r} is not available for {cls.__name__}: {seam['getter_only']}; "
            "use feature_cls='getter' (the default)"
        )
    if kind == "getter":
        cfg.setdefault("output_fmt", seam["output_fmt"])
        if isinstance(cfg["feature_cls"], str) or cfg["feature_cls"] is FeatureGetterNet:  # timm's, by name: ours
            cfg["feature_cls"] = seam.get("getter") or FeatureGetter
        if isinstance(cfg["feature_cls"], type) and issubclass(cfg["feature_cls"], ClipFeatureGetterNet):
            cfg["feature_cls"].check_output_fmt(cfg["output_fmt"])  # (before the model is built)
    elif seam["module_fmt"] is not None:
        if cfg.setdefault("output_fmt", seam["module_fmt"]) != seam["module_fmt"]:
            raise ValueError(
                f"feature_cls={kind!r} returns the model's stage maps as they are ({seam['module_fmt']}); "
                f"output_fmt={cfg['output_fmt']!r} needs feature_cls='getter'"
            )
    if kind in ("list", "dict"):
        if seam["no_flatten"] is not None:
            raise ValueError(
                f"feature_cls={kind!r} runs the model's children one after the other, which {seam['no_flatten']}: "
                "use 'getter' (the default), 'hook' or 'fx'"
            )
        cfg.setdefault("flatten_sequential", True)  # as timm's Swin: the stages of a Sequential in turn
    return cfg


#: the keyword arguments of timm's ``features_only`` backbones (``timm.create_model(..., features_only=True, ...)``)
FEATURE_ARGS = ("features_only", "out_indices", "feature_cls", "output_fmt", "feature_cfg")


def split_feature_args(kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``kwargs`` as (the whole network's arguments, the ``features_only`` backbone's :data:`FEATURE_ARGS`), a
    backbone :func:`with_features` cannot build refused here, before any weights are read."""
    features = {k: v for k, v in kwargs.items() if k in FEATURE_ARGS}
    _check_getter(features)
    return {k: v for k, v in kwargs.items() if k not in FEATURE_ARGS}, features


def _check_getter(feature_args: Mapping[str, Any]) -> None:
    """A ``ValueError`` when ``feature_args`` ask for a backbone other than timm's getter (its ``load_state_dict``
    takes the whole network's weights; the other wrappers' do not)."""
    kind = feature_args.get("feature_cls", (feature_args.get("feature_cfg") or {}).get("feature_cls", "getter"))
    if feature_args.get("features_only") and _feature_kind(kind) != "getter":
        raise ValueError(
            f"feature_cls={kind!r}: weights load into the default feature_cls='getter' backbone only (the same "
            "stage maps, from the model's forward_intermediates); leave feature_cls out"
        )


def with_features(model: nn.Module, feature_args: Mapping[str, Any]) -> nn.Module:
    """``model`` (a vitrel network holding its weights) as the ``features_only`` backbone ``feature_args`` ask for
    (:data:`FEATURE_ARGS`; ``model`` itself without ``features_only``): the backbone
    ``timm.create_model(<architecture>, features_only=True, ...)`` builds from the network's ``vitrel_cfg``, holding
    the network's weights (those the backbone keeps), in their dtype and on their device, in the network's training
    mode, with its ``pretrained_cfg``
    (the data config a checkpoint stored) less the keys timm drops for a backbone (the classifier's). Weights go into
    the default ``feature_cls='getter'`` only (its ``load_state_dict`` takes the whole network's): another is
    refused."""
    if not feature_args.get("features_only"):
        return model
    _check_getter(feature_args)
    backbone = build_from_cfg(model.vitrel_cfg, **feature_args)
    ref = next(model.parameters(), None)
    if ref is not None:  # (built in float32 on the CPU: a float64 or bf16 network's weights kept as they are)
        backbone = backbone.to(device=ref.device, dtype=ref.dtype)
    backbone.load_state_dict(model.state_dict())
    dropped = set(get_pretrained_cfg(model.vitrel_cfg["architecture"]).to_dict()) - set(backbone.pretrained_cfg)
    backbone.pretrained_cfg = backbone.default_cfg = {k: v for k, v in model.pretrained_cfg.items() if k not in dropped}
    return backbone.train(model.training)


def _legacy_pos(spec: Any, written_format: int) -> Any:
    """A scheme spec written under ``written_format`` with the options that keep its meaning
    (``PositionScheme.legacy_options``)."""
    if spec is None:
        return None
    options = {"name": spec} if isinstance(spec, str) else dict(spec)
    upgraded = get_pos_class(str(options["name"])).legacy_options(dict(options), written_format)
    return spec if upgraded == options else upgraded


def _upgrade(cfg: dict[str, Any], written_format: int) -> dict[str, Any]:
    """``cfg`` (constructor arguments) written under ``written_format``, its scheme specs upgraded to now."""
    cfg = dict(cfg)
    if written_format < FORMAT:
        for key in ("pos", "abs_pos"):
            if key in cfg:
                cfg[key] = _legacy_pos(cfg[key], written_format)
    return cfg


def upgraded_cfg(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """A stored ``vitrel_cfg`` with its scheme specs as they are meant now (``legacy_options`` of the format it was
    written under) and ``vitrel_format`` set to the current one."""
    cfg = dict(cfg)
    written = int(cfg.pop("vitrel_format", None) or 1)
    return {**_upgrade(cfg, written), "vitrel_format": FORMAT}


def scheme_override(stored: Any, given: Any) -> Any:
    """A scheme override (``pos=`` / ``abs_pos=`` of :func:`build_from_cfg`) onto the stored spec: a mapping without a
    ``name``, or with the stored scheme's, sets the options it gives and keeps the others (a model trained with
    ``base: 10`` keeps it when rebuilt with ``{"scaling": {...}}``); another scheme's, or a name alone, replaces it."""
    if not isinstance(given, Mapping):
        return given
    if isinstance(stored, str):
        stored = {"name": stored}
    if not isinstance(stored, Mapping) or given.get("name", stored.get("name")) != stored.get("name"):
        return given
    return {**stored, **given}


def build_from_cfg(cfg: dict[str, Any], **overrides: Any) -> nn.Module:
    """Rebuild a model from its ``vitrel_cfg`` (architecture + constructor arguments), with overrides.

    A configuration with an older ``vitrel_format`` (none: vitrel 0.1, format 1) gets, in its scheme specs,
    the options that keep their meaning where a default changed since (``legacy_options``; e.g. ALiBi's
    slope rule, LookHere's ``fov``) before the overrides apply. A scheme's options given as a mapping change
    those options of the stored scheme (:func:`scheme_override`).
    """
    cfg = dict(cfg)
    name = cfg.pop("architecture", None)
    if name is None:
        raise ValueError("vitrel_cfg has no 'architecture'")
    if name not in MODEL_ARGS:
        raise ValueError(f"unknown vitrel model {name!r} in vitrel_cfg; known: {', '.join(list_models())}")
    cfg = upgraded_cfg(cfg)
    overrides = {k: scheme_override(cfg.get(k), v) if k in ("pos", "abs_pos") else v for k, v in overrides.items()}
    return build(name, **{**cfg, **overrides})  # (build: vitrel_format current, nothing to upgrade)
