"""VideoMAE's video ViTs (Tong et al. 2022; MCG-NJU/VideoMAE) as vitrel video ViTs.

:func:`from_videomae` reads the authors' checkpoints (``checkpoint.pth``: ``{"model": ...}`` or DeepSpeed's
``{"module": ...}``; a pre-training checkpoint's encoder under ``encoder.``, its decoder left out, as their
``run_class_finetuning.py`` reads them) into a :class:`~vitrel.models.video_vit.VideoVisionTransformer` (architecture
``vitrel_vit_video_base_patch16_224`` with their sizes) that computes their ``modeling_finetune.VisionTransformer``'s
function: tubelets of 2 x 16 x 16, pre-norm blocks with a query and a value bias (``qkv_bias="qv"``, their
``q_bias`` / ``v_bias``) and LayerNorms of eps 1e-6, no class token, the mean of the tokens through ``fc_norm``
(their ``use_mean_pooling``; no final norm) and the linear head, and with the default ``pos="sincos1d"`` their fixed
1-D sinusoid over the tokens in raster order (:mod:`vitrel.pos.schemes.absolute`), which the checkpoints do not
store. A layer scale (their ``init_values`` > 0: ``gamma_1``, ``gamma_2``) is read as vitrel's ``ls1`` / ``ls2``.

A fine-tuned checkpoint brings its head (``num_classes`` from its weights; another ``num_classes`` starts a new one).
A pre-training checkpoint gives the model their fine-tuning starts from: the encoder, a new ``fc_norm`` and head, and
the encoder's final norm left out (their fine-tuning model has none: it pools with ``fc_norm``). Another ``pos``
starts a model of that scheme from their weights (``rel3d_full``, ``rope3d_axial``, ...: a different function, to
fine-tune; ``abs_pos="sincos1d"`` keeps their table beside it). Their released models (MODEL_ZOO.md: ViT-S, -B,
-L, -H on Kinetics-400 and Something-Something v2) are on cloud drives, not at a URL this can download from: give
the file. VideoMAE V2's (OpenGVLab/VideoMAEv2: ViT-g/14 and the ViT-S / -B distilled from it, the same modules)
read the same way; their cosine attention (``cos_attn``, off in their released models) is refused.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from vitrel.models.checkpoint import CheckpointError
from vitrel.models.registry import build, split_feature_args, with_features
from vitrel.models.video_weights import read_checkpoint, set_clip_preprocessing, video_vit_sizes, weights_under

__all__ = ["VIDEOMAE_SIZES", "from_videomae", "videomae_state_dict"]

#: their architectures (``modeling_finetune.py``): ``name -> (embed_dim, num_heads)``; ViT-H has 16 heads of 80,
#: VideoMAE V2's ViT-g (OpenGVLab/VideoMAEv2, ``vit_giant_patch14_224``) 16 of 88
VIDEOMAE_SIZES = {
    "vit_small": (384, 6), "vit_base": (768, 12), "vit_large": (1024, 16), "vit_huge": (1280, 16),
    "vit_giant": (1408, 16),
}  # fmt: skip
#: what a pre-training checkpoint holds besides the encoder (their ``PretrainVisionTransformer``)
_PRETRAINING = ("decoder.", "encoder_to_decoder.", "mask_token")


def videomae_state_dict(src: str | os.PathLike | dict[str, Any], key: str | None = None) -> dict[str, Tensor]:
    """The network's state dict in the authors' names from a VideoMAE checkpoint (a path, or the loaded dict): the
    entry ``key`` (default ``"model"``, else ``"module"``: their ``--model_key model|module``), or the state dict
    itself; their ``backbone.`` and ``encoder.`` prefixes removed and a pre-training checkpoint's decoder left out.
    Hugging Face's port (a ``save_pretrained`` folder, its ``.safetensors`` / ``.bin``, ``"hf-hub:<repo>"``) is
    read too (:func:`_from_hf_names`)."""
    return _read(src, key)[0]


def _read(src: str | os.PathLike | dict[str, Any], key: str | None) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """:func:`videomae_state_dict` and the Hugging Face ``config.json`` beside the weights (``{}`` without one)."""
    config: dict[str, Any] = {}
    if isinstance(src, str) and src.startswith("hf-hub:"):  # (a download: timm's prefix)
        from huggingface_hub import snapshot_download

        src = snapshot_download(src[len("hf-hub:") :], allow_patterns=["*.json", "*.safetensors", "*.bin"])
    if isinstance(src, (str, os.PathLike)) and (Path(src).is_dir() or Path(src).suffix in (".safetensors", ".bin")):
        src, config = _hf_files(Path(src))
    src = read_checkpoint(src, "VideoMAE", "a VideoMAE checkpoint, e.g. checkpoint.pth")
    src = weights_under(src, key, ("model", "module"))
    sd = {}
    for k, v in _from_hf_names(src).items():  # (Hugging Face's names first: its blocks are under "encoder.layer.")
        if k.startswith(_PRETRAINING):
            continue
        for prefix in ("backbone.", "encoder."):  # (their run_class_finetuning.py's)
            k = k[len(prefix) :] if k.startswith(prefix) else k
        sd[k] = v
    if "patch_embed.proj.weight" not in sd or not all(isinstance(v, Tensor) for v in sd.values()):
        raise CheckpointError("not a VideoMAE network: no patch_embed.proj.weight among its tensors")
    if "blocks.0.attn.scale" in sd:
        raise CheckpointError(
            "the network has cosine attention (VideoMAE V2's cos_attn=True: a learned blocks.<i>.attn.scale), which "
            "from_videomae does not read"
        )
    if "pos_embed" in sd:
        raise CheckpointError(
            "the checkpoint holds a learned pos_embed (their use_learnable_pos_emb=True), which from_videomae does not "
            "read: their released models add the fixed sinusoid (pos='sincos1d')"
        )
    return sd, config


def _hf_files(path: Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """A Hugging Face ``save_pretrained`` folder (or its weights file): the weights, and ``config.json``."""
    folder = path if path.is_dir() else path.parent
    files = [path] if path.is_file() else [folder / n for n in ("model.safetensors", "pytorch_model.bin")]
    found = next((f for f in files if f.is_file()), None)
    if found is None:
        raise CheckpointError(f"no model.safetensors or pytorch_model.bin in {folder} (a Hugging Face VideoMAE folder)")
    if found.suffix == ".safetensors":
        from safetensors.torch import load_file

        sd = load_file(found)
    else:
        sd = torch.load(found, map_location="cpu", weights_only=True)
    config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
    return sd, config


def _from_hf_names(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """Hugging Face transformers' VideoMAE names (``VideoMAEModel``, ``...ForVideoClassification``,
    ``...ForPreTraining``: ``videomae.encoder.layer.<i>.attention.attention.query`` ...) as the authors' (the inverse
    of their ``convert_videomae_to_pytorch.py``): the separate query, key and value weights joined into ``qkv``, the
    query and value biases (``query.bias`` / ``q_bias``) as ``q_bias`` / ``v_bias`` (a pre-training model's decoder
    keeps its ``decoder.`` prefix, left out by the caller). Other state dicts are returned as they are."""
    if not any(k.startswith(("videomae.", "embeddings.patch_embeddings.")) for k in sd):
        return sd
    renames = [
        ("embeddings.patch_embeddings.projection.", "patch_embed.proj."), ("encoder.layer.", "blocks."),
        ("attention.attention.query.bias", "attn.q_bias"), ("attention.attention.q_bias", "attn.q_bias"),
        ("attention.attention.value.bias", "attn.v_bias"), ("attention.attention.v_bias", "attn.v_bias"),
        ("attention.output.dense.", "attn.proj."), ("intermediate.dense.", "mlp.fc1."), ("output.dense.", "mlp.fc2."),
        ("layernorm_before.", "norm1."), ("layernorm_after.", "norm2."), ("classifier.", "head."),
    ]  # fmt: skip
    out: dict[str, Tensor] = {}
    for k, v in sd.items():
        k = k.removeprefix("videomae.")
        for old, new in renames:
            k = k.replace(old, new)
        out["norm." + k[len("layernorm.") :] if k.startswith("layernorm.") else k] = v
    for qk in [k for k in out if k.endswith(".attention.attention.query.weight")]:
        block = qk[: -len("attention.attention.query.weight")]
        parts = [out.pop(f"{block}attention.attention.{n}.weight") for n in ("query", "key", "value")]
        out[f"{block}attn.qkv.weight"] = torch.cat(parts)
    return out


def _architecture(sd: dict[str, Tensor], num_heads: int | None) -> dict[str, Any]:
    """The constructor arguments read from the weights (``num_heads`` from :data:`VIDEOMAE_SIZES` by width)."""
    heads = {dim: h for dim, h in VIDEOMAE_SIZES.values()}
    return video_vit_sizes(sd, heads, num_heads, "VideoMAE's networks") | dict(
        qkv_bias="qv" if "blocks.0.attn.q_bias" in sd else False,
        init_values=1.0 if "blocks.0.ls1.gamma" in sd else None,  # (their gamma_1: the values are the file's)
    )


def _vitrel_names(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """Their parameter names as vitrel's: the layer scale ``gamma_1`` / ``gamma_2`` as ``ls1.gamma`` / ``ls2.gamma``."""
    return {k.replace(".gamma_1", ".ls1.gamma").replace(".gamma_2", ".ls2.gamma"): v for k, v in sd.items()}


def from_videomae(
    src: str | os.PathLike | dict[str, Any],
    name: str | None = None,
    *,
    key: str | None = None,
    pos: Any = "sincos1d",
    num_classes: int | None = None,
    num_heads: int | None = None,
    img_size: int | None = None,
    num_frames: int | None = None,
    **kwargs: Any,
) -> nn.Module:
    """A vitrel video ViT holding a VideoMAE network's weights (the module docstring).

    Args:
        src: the checkpoint (a path or the loaded dict), or Hugging Face's port of it (a ``save_pretrained`` folder,
            its weights file, or ``"hf-hub:<repo>"``, e.g. ``"hf-hub:MCG-NJU/videomae-base-finetuned-kinetics"``,
            downloaded: needs a network), whose ``config.json`` gives the heads and the sizes. Its norms are read
            with the authors' eps (1e-6; the port's are 1e-12 in the blocks and 1e-5 in ``fc_norm``).
        name: one of :data:`VIDEOMAE_SIZES` (``vit_small`` ... ``vit_huge``), checked against the weights' width;
            without it the heads come from the width.
        key: the checkpoint's entry holding the network (default ``"model"``, else ``"module"``).
        pos: the position scheme (``"sincos1d"``: their function).
        num_classes: the head's classes (default: a fine-tuned checkpoint's; 0 for a pre-training checkpoint, the
            pooled features); another count than the checkpoint's starts a new head.
        num_heads: the heads, for a width not among :data:`VIDEOMAE_SIZES`.
        img_size, num_frames: the frame size and clip length the model is built for (default a Hugging Face
            config's, else their 224 and 16); any clip of whole tubelets runs.
        **kwargs: other :class:`~vitrel.models.video_vit.VideoVisionTransformer` arguments (``drop_path_rate``,
            ``abs_pos``, ``attn_impl``, ...); ``features_only=True`` (``out_indices``, ...): timm's backbone of the
            network (:func:`~vitrel.models.registry.with_features`).
    """
    kwargs, feature_args = split_feature_args(kwargs)
    if name is not None and name not in VIDEOMAE_SIZES:
        raise ValueError(f"{name!r} is not one of VideoMAE's sizes: {', '.join(VIDEOMAE_SIZES)}")
    sd, config = _read(src, key)  # (config: Hugging Face's config.json, or {})
    sd = _vitrel_names(sd)
    heads = num_heads or (VIDEOMAE_SIZES[name][1] if name else config.get("num_attention_heads"))
    arch = _architecture(sd, heads)
    if name is not None and arch["embed_dim"] != VIDEOMAE_SIZES[name][0]:
        raise CheckpointError(f"the weights are {arch['embed_dim']} wide, VideoMAE's {name} {VIDEOMAE_SIZES[name][0]}")
    stored = sd["head.weight"].shape[0] if "head.weight" in sd else 0
    if stored and "norm.weight" in sd:
        raise CheckpointError(
            "the network pools its first token through a final norm (their use_mean_pooling=False), which "
            "from_videomae does not read: their released models pool the mean through fc_norm"
        )
    num_classes = stored if num_classes is None else int(num_classes)
    drop = ("norm.",) + (("head.",) if num_classes != stored else ())  # (a pre-training encoder's norm; a new head)
    sd = {k: v for k, v in sd.items() if not k.startswith(drop)}
    # (the authors' eps, 1e-6, also for Hugging Face's port of their weights, whose norms take 1e-12 in the blocks
    # and 1e-5 in fc_norm: the function the weights were trained as)
    args = dict(global_pool="avg", fc_norm=True, final_norm=True, class_token=False, norm_eps=1e-6) | kwargs
    img_size, num_frames = img_size or config.get("image_size", 224), num_frames or config.get("num_frames", 16)
    dtype = next((v.dtype for v in sd.values() if v.is_floating_point()), torch.float32)  # (the file's precision)
    model = build(  # (a registered architecture: save_pretrained and load_model rebuild it from its vitrel_cfg)
        "vitrel_vit_video_base_patch16_224",
        img_size=img_size, num_frames=num_frames, num_classes=num_classes, pos=pos, **arch, **args, dtype=dtype,
    )  # fmt: skip
    got = model.load_state_dict(sd, strict=False)
    fresh = ("rel_pos.", "abs_pos.", "head.", "fc_norm.")  # (a scheme's own parameters; a new head)
    missing = sorted(k for k in got.missing_keys if not k.startswith(fresh) and ".attn.pos." not in k)
    if missing or got.unexpected_keys:
        raise CheckpointError(
            f"the VideoMAE network does not fit: missing {missing[:5]}, unexpected {sorted(got.unexpected_keys)[:5]}"
        )
    # (their evaluation: the shorter side resized to the crop, short_side_size 224, and crops of it)
    set_clip_preprocessing(model, img_size, num_frames, crop_pct=1.0)
    return with_features(model, feature_args)
