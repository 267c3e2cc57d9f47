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
default: the pooled features), on the mean of the normalised tokens (``global_pool="avg"``, ``fc_norm=False``).
``probe=`` reads one of their attentive probes (``ssv2-vitl-16x2x3.pt``, ...: ``{"classifiers": [...]}``, their
``AttentiveClassifier``) into the head: V-JEPA 2's attentive pool (``global_pool="map"``,
``attn_pool_type="attentive"``) and its linear layer, so the model is their classifier of a clip. The model saves and
loads as any vitrel model (``vitrel.models.save_pretrained``, ``vitrel.load_model``).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor, nn

from vitrel.models.checkpoint import CheckpointError
from vitrel.models.registry import build, split_feature_args, with_features
from vitrel.models.video_weights import read_checkpoint, set_clip_preprocessing, video_vit_sizes, weights_under

__all__ = ["RELEASED", "RELEASED_PROBES", "VJEPA2_URL", "from_vjepa2", "vjepa2_probe_state_dict", "vjepa2_state_dict"]

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

#: their released attentive probes (README, "Evaluation Attentive Probes"): ``name -> (file under evals/, encoder,
#: num_frames, num_segments, frame_stride)``, their inference configs' (``configs/inference``: ``frames_per_clip``,
#: ``num_segments``, ``frame_step``; every one with 3 views a segment, ``num_views_per_segment``, and probes of 16
#: heads, ``classifier.num_heads``, and 4 blocks)
RELEASED_PROBES = {
    "ssv2_vit_large": ("ssv2-vitl-16x2x3", "vit_large", 16, 2, 4),
    "diving48_vit_large": ("diving48-vitl-256", "vit_large", 32, 4, 2),
    "ssv2_vit_giant_384": ("ssv2-vitg-384-64x2x3", "vit_giant_384", 64, 2, 2),
    "diving48_vit_giant_384": ("diving48-vitg-384-32x4x3", "vit_giant_384", 32, 4, 2),
}
#: their evaluation's spatial views of a segment (``num_views_per_segment``; ``EvalVideoTransform``: the shorter side
#: resized to the crop, 3 crops along the longer)
PROBE_VIEWS = 3
#: their probes' heads (every inference config's ``classifier.num_heads``; the weights do not say)
PROBE_HEADS = 16


def vjepa2_probe_state_dict(src: str | os.PathLike | dict[str, Any], index: int = 0) -> dict[str, Tensor]:
    """An attentive probe's state dict (their ``AttentiveClassifier``: ``pooler.*``, ``linear.*``) from a V-JEPA 2
    probe checkpoint (a path or the loaded dict): entry ``index`` of its ``"classifiers"`` (their evaluation saves one
    per optimisation setting; the released files one), or the state dict itself; ``module.`` prefixes removed."""
    src = read_checkpoint(src, "V-JEPA 2", f"a V-JEPA 2 probe, e.g. evals/ssv2-vitl-16x2x3.pt from {VJEPA2_URL}")
    if "classifiers" in src:
        heads = src["classifiers"]
        if not 0 <= index < len(heads):
            raise CheckpointError(f"the checkpoint holds {len(heads)} classifiers, no index {index}")
        src = heads[index]
    sd = {k.replace("module.", ""): v for k, v in src.items()}
    need = ("pooler.query_tokens", "pooler.cross_attention_block.norm1.weight", "linear.weight")
    if not all(k in sd for k in need):
        raise CheckpointError(
            f"not a V-JEPA 2 attentive probe with a complete cross-attention block: it lacks "
            f"{[k for k in need if k not in sd]} (their AttentiveClassifier's keys)"
        )
    return sd


def _probe_args(sd: dict[str, Tensor], embed_dim: int, heads: int) -> dict[str, Any]:
    """The head's model arguments read from a probe's weights (``heads``: theirs are not in the weights)."""
    width = sd["pooler.query_tokens"].shape[-1]
    if width != embed_dim:
        raise CheckpointError(f"the probe is {width} wide, the encoder {embed_dim}")
    blocks = {int(k.split(".")[2]) for k in sd if k.startswith("pooler.blocks.")}
    return dict(
        global_pool="map",
        attn_pool_type="attentive",
        attn_pool_depth=1 + len(blocks),
        attn_pool_num_heads=heads,
        attn_pool_mlp_ratio=sd["pooler.cross_attention_block.mlp.fc1.weight"].shape[0] / embed_dim,
        num_classes=sd["linear.weight"].shape[0],
    )


def vjepa2_state_dict(src: str | os.PathLike | dict[str, Any], key: str | None = None) -> dict[str, Tensor]:
    """The encoder's state dict from a V-JEPA 2 checkpoint (a path, or the loaded dict): the entry ``key``
    (default ``"target_encoder"``, the EMA encoder their evaluations read, else ``"encoder"``), or the state dict
    itself, with their ``module.`` and ``backbone.`` prefixes removed."""
    src = read_checkpoint(src, "V-JEPA 2", f"a V-JEPA 2 checkpoint, e.g. vitl.pt from {VJEPA2_URL}")
    src = weights_under(src, key, ("target_encoder", "encoder"))
    sd = {k.replace("module.", "").replace("backbone.", ""): v for k, v in src.items()}
    if "patch_embed.proj.weight" not in sd or not all(isinstance(v, Tensor) for v in sd.values()):
        raise CheckpointError(
            "not a V-JEPA 2 encoder: no patch_embed.proj.weight among its tensors (give key= for the entry holding "
            "the encoder, e.g. 'encoder' or 'target_encoder')"
        )
    return sd


def _architecture(sd: dict[str, Tensor], num_heads: int | None) -> dict[str, Any]:
    """The encoder's constructor arguments read from its weights (``num_heads`` from :data:`RELEASED` by width)."""
    if "blocks.0.mlp.fc3.weight" in sd:
        raise CheckpointError("this encoder has SwiGLU MLPs (their use_silu=True), which from_vjepa2 does not read")
    heads = {dim: h for _, dim, h, _ in RELEASED.values()}
    sizes = video_vit_sizes(sd, heads, num_heads, "V-JEPA 2's released encoders")
    return sizes | dict(qkv_bias="blocks.0.attn.qkv.bias" in sd)


def from_vjepa2(
    src: str | os.PathLike | dict[str, Any] | None = None,
    name: str | None = None,
    *,
    key: str | None = None,
    pos: Any = "rope3d_vjepa2",
    num_classes: int = 0,
    num_heads: int | None = None,
    img_size: int | None = None,
    num_frames: int | None = None,
    probe: str | os.PathLike | dict[str, Any] | None = None,
    probe_index: int = 0,
    probe_heads: int = PROBE_HEADS,
    num_segments: int | None = None,
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
            and 16 frames, their evaluations' clips, or a released probe's); any clip runs.
        probe: an attentive probe (a path or its loaded dict; or one of :data:`RELEASED_PROBES`, downloaded, which
            also names the encoder): the head, V-JEPA 2's attentive pool and linear layer (the module docstring);
            ``num_classes`` and ``global_pool`` come from it.
        probe_index: the entry of the probe file's ``"classifiers"`` to read.
        probe_heads: the probe's heads, which its weights do not hold (16 in every released probe).
        num_segments: clips joined into an input, encoded alone and pooled together (their ``ClipAggregation``;
            default 1, or a released probe's: 2 for SSv2, 4 for Diving-48). A released probe also stores its
            evaluation's clips in the model's data config (``frame_stride``, ``num_segments``, 3 ``spatial_crops``,
            ``crop_pct`` 1.0), which ``eval.py`` and ``predict.py`` take.
        **kwargs: other :class:`~vitrel.models.video_vit.VideoVisionTransformer` arguments (``global_pool``,
            ``drop_path_rate``, ``attn_impl``, ...); ``features_only=True`` (``out_indices``, ...): timm's backbone of
            the network (:func:`~vitrel.models.registry.with_features`).
    """
    kwargs, feature_args = split_feature_args(kwargs)
    protocol: dict[str, Any] = {}  # (a released probe's evaluation clips)
    if isinstance(probe, str) and probe in RELEASED_PROBES:
        file, encoder, frames, segments, stride = RELEASED_PROBES[probe]
        name, num_frames = name or encoder, num_frames or frames
        num_segments = num_segments or segments
        protocol = dict(frame_stride=stride, clips_per_video=1, spatial_crops=PROBE_VIEWS, crop_pct=1.0)
        probe = torch.hub.load_state_dict_from_url(f"{VJEPA2_URL}/evals/{file}.pt", map_location="cpu")
    head = vjepa2_probe_state_dict(probe, probe_index) if probe is not None else {}
    if head and (num_classes or "global_pool" in kwargs):
        raise ValueError("probe= gives the head (its classes and pool): leave num_classes and global_pool out")
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
    side, num_frames = img_size or (RELEASED[name][3] if name else 256), num_frames or 16
    if head:
        kwargs.update(_probe_args(head, arch["embed_dim"], probe_heads))
        num_classes = kwargs.pop("num_classes")
        sd = sd | {k.replace("pooler.", "attn_pool.", 1).replace("linear.", "head.", 1): v for k, v in head.items()}
    args = dict(global_pool="avg", fc_norm=False, class_token=False, norm_eps=1e-6, num_segments=num_segments or 1)
    args |= kwargs
    dtype = next((v.dtype for v in sd.values() if v.is_floating_point()), torch.float32)  # (the file's precision)
    model = build(  # (a registered architecture: save_pretrained and load_model rebuild it from its vitrel_cfg)
        "vitrel_vit_video_base_patch16_224",
        img_size=side, num_frames=num_frames, num_classes=num_classes, pos=pos, **arch, **args, dtype=dtype,
    )  # fmt: skip
    got = model.load_state_dict({k: v for k, v in sd.items() if k != "pos_embed"}, strict=False)
    fresh = ("rel_pos.", "abs_pos.") + (() if head else ("head.", "fc_norm.", "attn_pool."))  # (a new head; ...)
    missing = sorted(k for k in got.missing_keys if not k.startswith(fresh) and ".attn.pos." not in k)
    unexpected = sorted(got.unexpected_keys)
    if missing or unexpected:
        raise CheckpointError(f"the V-JEPA 2 encoder does not fit: missing {missing[:5]}, unexpected {unexpected[:5]}")
    # (their single-view evaluation: the short side to 256/224 of the crop, the centre crop)
    config = {"crop_pct": 224 / 256, "num_segments": args["num_segments"]} | protocol  # (a probe's: its clips)
    set_clip_preprocessing(model, side, num_frames, **config)
    return with_features(model, feature_args)
