"""V-JEPA 2's video encoders (Assran et al. 2025; facebookresearch/vjepa2) as vitrel video ViTs.

:func:`from_vjepa2` reads the authors' released checkpoints (``vitl.pt``, ``vith.pt``, ``vitg.pt``, ``vitg-384.pt``,
``vjepa2-ac-vitg.pt``: ``{"encoder": ..., "target_encoder": ..., "predictor": ...}``, keys under ``module.backbone.``)
into a :class:`~vitrel.models.video_vit.VideoVisionTransformer` (architecture ``vitrel_vit_video_base_patch16_224``
with their sizes) that computes their encoder's function: tubelets of 2 x 16 x 16, pre-norm blocks with GELU MLPs,
no class token, the final LayerNorm on every token, and with the default ``pos="rope3d_vjepa2"`` the rotation the
checkpoints were trained with (their ``rotate_queries_or_keys``, which the authors keep unfixed for these weights;
:mod:`vitrel.pos.schemes.rope3d_vjepa2`). Their parameter names are vitrel's; the stored ``pos_embed`` (a fixed
sin-cos table the RoPE encoders never add) is left out. The weights do not say whether an encoder was trained
with RoPE (their ``use_rope``; every released V-JEPA 2 encoder was): this reads RoPE encoders.

Another ``pos`` starts a model of that scheme from their weights (``rope3d_axial``: the rotation they document as
the fix; ``rel3d_factored``, ...): a different function, to fine-tune. The head is new (``num_classes``; 0 by
default: the pooled features), on the mean of the normalised tokens (``global_pool="avg"``, ``fc_norm=False``);
``global_pool="map"`` pools with timm's attention pool, which comes close to V-JEPA 2's attentive probe. The model
saves and loads as any vitrel model (``vitrel.models.save_pretrained``, ``vitrel.load_model``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torch import Tensor, nn

from vitrel.models.checkpoint import CheckpointError
from vitrel.models.data_config import set_data_config
from vitrel.models.registry import build, split_feature_args, with_features

__all__ = ["RELEASED", "VJEPA2_URL", "from_vjepa2", "vjepa2_state_dict"]

#: where the authors host their checkpoints (their ``src/hub/backbones.py``)
VJEPA2_URL = "https://dl.fbaipublicfiles.com/vjepa2"

#: the released encoders: ``name -> (file, embed_dim, num_heads, img_size)`` (their ``ARCH_NAME_MAP`` and
#: ``vision_transformer.py``: ViT-L and ViT-H with 16 heads, ViT-g their ``vit_giant_xformers``, 22)
RELEASED = {
    "vit_large": ("vitl", 1024, 16, 256),
    "vit_huge": ("vith", 1280, 16, 256),
    "vit_giant": ("vitg", 1408, 22, 256),
    "vit_giant_384": ("vitg-384", 1408, 22, 384),
    "vit_ac_giant": ("vjepa2-ac-vitg", 1408, 22, 256),
}


def vjepa2_state_dict(src: str | os.PathLike | dict[str, Any], key: str | None = None) -> dict[str, Tensor]:
    """The encoder's state dict from a V-JEPA 2 checkpoint (a path, or the loaded dict): the entry ``key``
    (default ``"target_encoder"``, the EMA encoder their evaluations read, else ``"encoder"``), or the state dict
    itself, with their ``module.`` and ``backbone.`` prefixes removed."""
    if isinstance(src, (str, os.PathLike)):
        p = Path(src)
        if not p.is_file():
            raise CheckpointError(f"no such file: {p} (a V-JEPA 2 checkpoint, e.g. vitl.pt from {VJEPA2_URL})")
        src = torch.load(p, map_location="cpu", weights_only=True)
    if not isinstance(src, dict):
        raise CheckpointError(f"a V-JEPA 2 checkpoint is a dict, got {type(src).__name__}")
    if key is None:
        key = next((k for k in ("target_encoder", "encoder") if k in src), None)
    if key is not None:
        if key not in src:
            raise CheckpointError(f"the checkpoint has no {key!r} (it holds {sorted(src)[:6]})")
        src = src[key]
    sd = {k.replace("module.", "").replace("backbone.", ""): v for k, v in src.items()}
    if "patch_embed.proj.weight" not in sd or not all(isinstance(v, Tensor) for v in sd.values()):
        raise CheckpointError(
            "not a V-JEPA 2 encoder: no patch_embed.proj.weight among its tensors (give key= for the entry holding "
            "the encoder, e.g. 'encoder' or 'target_encoder')"
        )
    return sd


def _architecture(sd: dict[str, Tensor], num_heads: int | None) -> dict[str, Any]:
    """The encoder's constructor arguments read from its weights (``num_heads`` from :data:`RELEASED` by width)."""
    w = sd["patch_embed.proj.weight"]
    if w.dim() != 5:
        raise CheckpointError(f"a V-JEPA 2 video encoder has a 3-D patch embedding, got weight {tuple(w.shape)}")
    embed_dim, in_chans, tubelet, patch = w.shape[0], w.shape[1], w.shape[2], w.shape[3]
    depth = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks."))
    if "blocks.0.mlp.fc3.weight" in sd:
        raise CheckpointError("this encoder has SwiGLU MLPs (their use_silu=True), which from_vjepa2 does not read")
    hidden = sd["blocks.0.mlp.fc1.weight"].shape[0]
    if num_heads is None:
        widths = {dim: heads for _, dim, heads, _ in RELEASED.values()}
        if embed_dim not in widths:
            raise CheckpointError(
                f"width {embed_dim} is none of the released encoders' ({sorted(widths)}): give num_heads="
            )
        num_heads = widths[embed_dim]
    return dict(
        embed_dim=embed_dim,
        in_chans=in_chans,
        tubelet_size=tubelet,
        patch_size=patch,
        depth=depth,
        num_heads=num_heads,
        mlp_ratio=hidden / embed_dim,
        qkv_bias="blocks.0.attn.qkv.bias" in sd,
    )


def from_vjepa2(
    src: str | os.PathLike | dict[str, Any] | None = None,
    name: str | None = None,
    *,
    key: str | None = None,
    pos: Any = "rope3d_vjepa2",
    num_classes: int = 0,
    num_heads: int | None = None,
    img_size: int | None = None,
    num_frames: int = 16,
    **kwargs: Any,
) -> nn.Module:
    """A vitrel video ViT holding a V-JEPA 2 encoder's weights (the module docstring).

    Args:
        src: the checkpoint (a path or the loaded dict); None downloads ``name``'s from :data:`VJEPA2_URL` (needs a
            network; torch's hub cache).
        name: one of :data:`RELEASED` (``vit_large``, ``vit_huge``, ``vit_giant``, ``vit_giant_384``,
            ``vit_ac_giant``): its heads and image size. Without it they come from the weights' width.
        key: the checkpoint's entry holding the encoder (default ``"target_encoder"``, else ``"encoder"``).
        pos: the position scheme (``"rope3d_vjepa2"``: their function).
        num_classes: a new head's classes (0: none, the pooled features).
        num_heads: the heads, for an encoder not among :data:`RELEASED`.
        img_size, num_frames: the frame size and clip length the model is built for (default ``name``'s size, or 256,
            and 16 frames, their evaluations' clips); any clip runs.
        **kwargs: other :class:`~vitrel.models.video_vit.VideoVisionTransformer` arguments (``global_pool``,
            ``drop_path_rate``, ``attn_impl``, ...); ``features_only=True`` (``out_indices``, ...): timm's backbone of
            the network (:func:`~vitrel.models.registry.with_features`).
    """
    kwargs, feature_args = split_feature_args(kwargs)
    if name is not None and name not in RELEASED:
        raise ValueError(f"{name!r} is not one of V-JEPA 2's released encoders: {', '.join(RELEASED)}")
    if src is None:
        if name is None:
            raise ValueError(f"give the checkpoint (a path or its dict), or name= one of {', '.join(RELEASED)}")
        src = torch.hub.load_state_dict_from_url(f"{VJEPA2_URL}/{RELEASED[name][0]}.pt", map_location="cpu")
    sd = vjepa2_state_dict(src, key)
    arch = _architecture(sd, num_heads if num_heads is not None else RELEASED[name][2] if name else None)
    if name is not None and arch["embed_dim"] != RELEASED[name][1]:
        raise CheckpointError(f"the weights are {arch['embed_dim']} wide, {name}'s are {RELEASED[name][1]}")
    side = img_size or (RELEASED[name][3] if name else 256)
    args = dict(global_pool="avg", fc_norm=False, class_token=False, norm_eps=1e-6, **kwargs)
    dtype = next((v.dtype for v in sd.values() if v.is_floating_point()), torch.float32)  # (the file's precision)
    model = build(  # (a registered architecture: save_pretrained and load_model rebuild it from its vitrel_cfg)
        "vitrel_vit_video_base_patch16_224",
        img_size=side, num_frames=num_frames, num_classes=num_classes, pos=pos, **arch, **args, dtype=dtype,
    )  # fmt: skip
    got = model.load_state_dict({k: v for k, v in sd.items() if k != "pos_embed"}, strict=False)
    fresh = ("head.", "fc_norm.", "attn_pool.", "rel_pos.", "abs_pos.")  # (a new head; another scheme's parameters)
    missing = sorted(k for k in got.missing_keys if not k.startswith(fresh) and ".attn.pos." not in k)
    unexpected = sorted(got.unexpected_keys)
    if missing or unexpected:
        raise CheckpointError(f"the V-JEPA 2 encoder does not fit: missing {missing[:5]}, unexpected {unexpected[:5]}")
    set_data_config(
        model,
        dict(
            mean=IMAGENET_DEFAULT_MEAN,
            std=IMAGENET_DEFAULT_STD,
            input_size=(arch["in_chans"], side, side),
            interpolation="bilinear",
            crop_pct=224 / 256,  # their single-view evaluation: short side to 256/224 of the crop, centre crop
            num_frames=num_frames,
        ),
    )
    return with_features(model, feature_args)
