"""Model factory: named architectures, ``vitrel.create_model`` and registration in timm's registry.

Every architecture is registered with timm on ``import vitrel``, so both of these work::

    vitrel.create_model("vitrel_swin_tiny_patch4_window7_224", pos="rel2d_factored")
    timm.create_model("vitrel_vit_small_patch16_224", pos="rope2d_mixed", num_classes=10)

timm's local-weights routes load our exported weights (``model.safetensors`` + ``config.json``, see
``vitrel.export_model``)::

    timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=".../model.safetensors"))
    timm.create_model("local-dir:/path/to/export")

With the ``file`` route the architecture's stored arguments (position scheme, size, classes ...) are
read from the ``config.json`` beside the weights (or the safetensors metadata) and used as defaults,
so they need not be typed again; explicit keyword arguments still win.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from typing import Any

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from torch import nn

from vitrel.models.swin import SwinTransformer
from vitrel.models.vit import VisionTransformer

__all__ = ["create_model", "list_models", "model_class", "MODEL_ARGS", "default_cfgs", "build_from_cfg"]

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
}


def _cfg(name: str, **kwargs: Any) -> dict[str, Any]:
    _, args = MODEL_ARGS[name]
    size = args.get("img_size", 224)
    small = size == 32
    return {
        "url": "",
        "num_classes": args.get("num_classes", 1000),
        "input_size": (3, size, size),
        "pool_size": None,
        "crop_pct": 1.0 if small else 0.9,
        "interpolation": "bicubic",
        "fixed_input_size": False,
        "mean": CIFAR_MEAN if small else IMAGENET_DEFAULT_MEAN,
        "std": CIFAR_STD if small else IMAGENET_DEFAULT_STD,
        "first_conv": "patch_embed.proj",
        "classifier": "head",
        "license": "apache-2.0",
        **kwargs,
    }


default_cfgs = generate_default_cfgs({name: _cfg(name) for name in MODEL_ARGS})


def model_class(name: str) -> type[nn.Module]:
    if name not in MODEL_ARGS:
        raise ValueError(f"unknown vitrel model {name!r}; known: {', '.join(list_models())}")
    return MODEL_ARGS[name][0]


def list_models(pattern: str = "*") -> list[str]:
    """Names of the vitrel architectures matching a shell-style ``pattern``."""
    return sorted(n for n in MODEL_ARGS if fnmatch.fnmatch(n, pattern))


def _strip_prefixes(state_dict: dict, model: nn.Module) -> dict:
    """timm ``pretrained_filter_fn``: accept a Lightning / torch.compile state dict (``model.``,
    ``_orig_mod.`` prefixes) as well as a plain one; tables and absolute embeddings resize themselves
    when they load (see ``vitrel.pos.tables.ResizeOnLoad``)."""
    from vitrel.models.checkpoint import clean_state_dict

    return clean_state_dict(state_dict)


def _build(name: str, pretrained: bool = False, **kwargs: Any) -> nn.Module:
    """Build ``name`` through timm's ``build_model_with_cfg`` (sets ``pretrained_cfg``, loads
    ``pretrained_cfg_overlay=dict(file=...)`` weights)."""
    cls, defaults = MODEL_ARGS[name]
    overlay = dict(kwargs.pop("pretrained_cfg_overlay", None) or {})
    pretrained_cfg = kwargs.pop("pretrained_cfg", None)
    pretrained_model_args = kwargs.pop("pretrained_model_args", None)
    cache_dir = kwargs.pop("cache_dir", None)
    if pretrained and overlay.get("file"):
        from vitrel.models.checkpoint import stored_config

        stored = stored_config(overlay["file"])
        if stored is not None:
            arch = stored.get("architecture")
            if arch is not None and arch != name:
                from vitrel.models.checkpoint import CheckpointError

                raise CheckpointError(f"{overlay['file']} holds a {arch} model, not {name}")
            for k, v in stored.items():
                if k != "architecture":
                    kwargs.setdefault(k, v)
            if "num_classes" in stored:
                overlay.setdefault("num_classes", stored["num_classes"])
    args = {**defaults, **kwargs}
    model = build_model_with_cfg(
        cls,
        name,
        pretrained,
        pretrained_cfg=pretrained_cfg,
        pretrained_cfg_overlay=overlay or None,
        pretrained_filter_fn=_strip_prefixes,
        pretrained_model_args=pretrained_model_args,
        cache_dir=cache_dir,
        **args,
    )
    model.vitrel_cfg = {"architecture": name, **model.vitrel_cfg}
    return model


def _make_entrypoint(name: str) -> Callable[..., nn.Module]:
    def entry(pretrained: bool = False, **kwargs: Any) -> nn.Module:
        return _build(name, pretrained=pretrained, **kwargs)

    entry.__name__ = name
    entry.__qualname__ = name
    entry.__module__ = __name__
    entry.__doc__ = f"vitrel {name} ({MODEL_ARGS[name][0].__name__}); any position scheme via ``pos=``."
    return entry


for _name in MODEL_ARGS:
    globals()[_name] = register_model(_make_entrypoint(_name))


def create_model(
    name: str,
    pretrained: bool = False,
    checkpoint_path: str | None = None,
    pos: str | dict | None = None,
    num_classes: int | None = None,
    img_size: int | tuple[int, int] | None = None,
    in_chans: int | None = None,
    **kwargs: Any,
) -> nn.Module:
    """Build a vitrel model by name (timm-style).

    Args:
        name: one of :func:`list_models`.
        pretrained: load weights through timm's pretrained machinery (needs
            ``pretrained_cfg_overlay=dict(file=...)``; there are no hosted weights).
        checkpoint_path: a training checkpoint (``.ckpt``) or exported weights (``.safetensors`` or an
            export directory) to load after construction. The configuration stored with it gives the
            defaults (position scheme, sizes...); the arguments given here override them. Tables and
            absolute embeddings are resized to ``img_size``; a different ``num_classes`` resets the head.
        pos: position scheme name or config dict (``{"name": ..., **options}``).
        num_classes, img_size, in_chans: as timm; None keeps the architecture's default.
        **kwargs: any other constructor argument (``depth``, ``pos_share``, ``abs_pos``...).
    """
    if name not in MODEL_ARGS:
        raise ValueError(f"unknown vitrel model {name!r}; known: {', '.join(list_models())}")
    given = dict(kwargs)
    for k, v in (("pos", pos), ("num_classes", num_classes), ("img_size", img_size), ("in_chans", in_chans)):
        if v is not None:
            given[k] = v
    if checkpoint_path is not None:
        from vitrel.models.checkpoint import load_model

        if pretrained:
            raise ValueError("give either pretrained=True (timm's route) or checkpoint_path, not both")
        return load_model(checkpoint_path, architecture=name, **given)
    return _build(name, pretrained=pretrained, **given)


def build_from_cfg(cfg: dict[str, Any], **overrides: Any) -> nn.Module:
    """Rebuild a model from its ``vitrel_cfg`` (architecture + constructor arguments), with overrides."""
    cfg = dict(cfg)
    name = cfg.pop("architecture", None)
    if name is None:
        raise ValueError("vitrel_cfg has no 'architecture'")
    if name not in MODEL_ARGS:
        raise ValueError(f"unknown vitrel model {name!r} in vitrel_cfg; known: {', '.join(list_models())}")
    cfg.update(overrides)
    return _build(name, **cfg)
