"""Start from timm's (pretrained) weights with any position scheme: :func:`from_timm`.

The timm model's architecture is read off the instance (width, depth, heads, patch size, pooling,
tokens, layer scale ...), the matching vitrel model is built with the position scheme asked for,
and every tensor that fits is carried over. Supported sources:

* timm ``VisionTransformer`` (``vit_*``, ``deit_*``; learned absolute embedding): the embedding is
  dropped, or kept with ``abs_pos="ape"`` (its class-token slot folded into the class token, so the
  function is unchanged; resampled when the grid differs). ``pos=None`` means ``abs_pos="ape"`` and
  no relative scheme: the same function as the source.
* timm ``VisionTransformerRelPos`` (``vit_relpos_*``, ``vit_srelpos_*``) -> ``rel2d_cpb`` with ``mode: cr`` (its
  ``RelPosMlp``), or ``rel2d_full`` with ``rel_pos_type="bias"`` (same function; :mod:`~vitrel.models.relpos_import`).
* timm ``SwinTransformer`` (``swin_*``) -> vitrel Swin with ``rel2d_full`` (same function at sizes
  that are a multiple of the window; vitrel masks the padding timm attends to otherwise). One window for all
  stages only: a window per stage (``swin_s3_*``) or ``always_partition=True`` is refused.
* timm ``Beit`` (``beit_*``, ``beitv2_*``) -> ``rel2d_beit``: its table and class-token terms, layer scale, q / v
  biases, mean pooling (same function; :mod:`~vitrel.models.beit_import`).
* timm ``ConVit`` (``convit_*``) -> ``gpsa`` in its GPSA blocks (``pos_depth``), its class token joining after them
  (``prefix_at``), its embedding kept as ``abs_pos="ape"`` (same function; :mod:`~vitrel.models.convit_import`).
* timm ``Eva`` RoPE ViTs (``vit_*_patch16_rope_224`` = axial, ``..._rope_mixed_224``) ->
  ``rope2d_axial`` / ``rope2d_mixed`` (same function); with a reference grid (``ref_feat_shape``: timm's
  ``vit_*_rope_reg*_gap_256``) -> ``rope2d_axial`` scaled by ``factor: grid`` from that grid (same function at
  every size).
* timm DINOv3 (``vit_*_patch16_dinov3*``: normalised coordinates, register tokens, layer scale) ->
  ``rope2d_axial`` with ``coords="normalized"`` (same function); timm's rotate-half (and, for
  ``grid_indexing="xy"``, columns-first) RoPE layout becomes vitrel's by permuting q and k channels
  alike (:func:`~vitrel.models.rope_layout.rope_channel_order`).

With any other target scheme the position parts are freshly initialised and everything else is
carried. A transfer report (carried, converted, newly initialised, dropped) is logged and returned by
:func:`transfer_timm_weights`; nothing is dropped silently.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

import timm
import torch
from timm.layers import LayerScale, RmsNorm
from timm.models import adapt_input_conv
from timm.models.eva import Eva
from timm.models.swin_transformer import SwinTransformer as TimmSwin
from timm.models.swin_transformer_v2 import SwinTransformerV2 as TimmSwinV2
from timm.models.swin_transformer_v2_cr import SwinTransformerV2Cr as TimmSwinV2Cr
from timm.models.vision_transformer import VisionTransformer as TimmViT
from torch import Tensor, nn

from vitrel.layers.norms import same_norm
from vitrel.models.beit_import import Beit, beit_scheme, beit_tensors
from vitrel.models.checkpoint import CheckpointError, load_weights, scheme_name
from vitrel.models.convit_import import ConVit, convit_args, convit_tensors
from vitrel.models.data_config import data_fields, set_data_config
from vitrel.models.naflex_import import NaFlexVit, naflex_abs_pos, naflex_embedding, naflex_tensors
from vitrel.models.registry import build, split_feature_args, with_features
from vitrel.models.relpos_import import VisionTransformerRelPos, relpos_scheme, relpos_tensor
from vitrel.models.rope_layout import permute_qk, rope_channel_order
from vitrel.models.swin_import import swin_args, swin_table, swinv2_reference, warn_swin_padding
from vitrel.models.timm_files import load_timm_file
from vitrel.models.timm_head import head_args
from vitrel.models.timm_mlp import mlp_args, split_packed
from vitrel.models.timm_qkv import qkv_bias_of
from vitrel.models.transfer_report import BUFFER, TransferReport

__all__ = [
    "from_timm",
    "load_timm_file",
    "transfer_timm_weights",
    "timm_to_vitrel_args",
    "source_abs_pos",
    "TransferReport",
    "UnsupportedTimmModel",
]

log = logging.getLogger(__name__)


class UnsupportedTimmModel(ValueError):
    """A timm model that vitrel has no equivalent architecture for (the message says what differs)."""


# ---------------------------------------------------------------------------- architecture
def _family(t: nn.Module) -> str:
    if isinstance(t, VisionTransformerRelPos):
        return "relpos"
    if isinstance(t, NaFlexVit):
        return "naflex"
    if isinstance(t, TimmViT):
        return "vit"
    if isinstance(t, Eva):
        return "eva"
    if isinstance(t, TimmSwin):
        return "swin"
    if isinstance(t, ConVit):
        return "convit"
    if isinstance(t, Beit):
        return "beit"
    if isinstance(t, TimmSwinV2):
        return "swinv2"
    if isinstance(t, TimmSwinV2Cr):
        name = (getattr(t, "pretrained_cfg", None) or {}).get("architecture", type(t).__name__)
        raise UnsupportedTimmModel(
            f"{name} is timm's own Swin V2 (swinv2_cr_*: scaled cosine attention with a post-norm every 6 blocks), "
            f"which vitrel's Swin is not; the authors' Swin V2 (swinv2_*) reads"
        )
    raise UnsupportedTimmModel(
        f"from_timm takes timm VisionTransformer (vit_*, deit_*), VisionTransformerRelPos (vit_relpos_*), "
        f"NaFlexVit (naflexvit_*), Eva RoPE ViTs (vit_*_rope_*), ConVit (convit_*), Beit (beit_*, beitv2_*) and "
        f"SwinTransformer (swin_*, swinv2_*) models, got {type(t).__name__}"
    )


def _refuse(cond: bool, what: str, t: nn.Module) -> None:
    if cond:
        name = (getattr(t, "pretrained_cfg", None) or {}).get("architecture", type(t).__name__)
        raise UnsupportedTimmModel(f"{name}: {what}; vitrel's backbones have no equivalent")


def _patch_args(t: nn.Module) -> dict[str, Any]:
    """The patch embedding's and tokens' arguments of the vitrel ViT for the timm ViT ``t``."""
    pe = t.patch_embed
    _refuse(hasattr(pe, "backbone"), f"a CNN stem before the patch embedding ({type(pe).__name__}, hybrid ViTs)", t)
    _refuse(not isinstance(getattr(pe, "proj", None), nn.Conv2d), "the patch embedding is not one convolution", t)
    _refuse(not isinstance(getattr(pe, "norm", nn.Identity()), nn.Identity), "the patch embedding has a norm", t)
    _refuse(getattr(t, "dist_token", None) is not None, "a distillation token and head (DeiT's distilled models)", t)
    ph, pw = pe.patch_size
    _refuse(ph != pw, f"non-square patches {ph}x{pw}", t)
    h, w = pe.img_size
    if (h % ph or w % pw) and not getattr(pe, "dynamic_img_pad", False):
        whole = h - h % ph if h == w else [h - h % ph, w - w % pw]
        _refuse(True, f"{h}x{w} images are not whole {ph}-px patches, timm's convolution drops the last pixels and "
                f"vitrel refuses such images (build it at timm_kwargs={{'img_size': {whole}}}: the same weights, "
                f"the function on that crop)", t)  # fmt: skip
    return dict(
        img_size=list(pe.img_size),
        patch_size=int(ph),
        in_chans=int(pe.proj.in_channels),
        class_token=getattr(t, "cls_token", None) is not None,
        reg_tokens=int(t.reg_token.shape[1]) if getattr(t, "reg_token", None) is not None else 0,
        dynamic_img_pad=bool(getattr(pe, "dynamic_img_pad", False)),
        patch_bias=pe.proj.bias is not None,  # (CLIP's and the Perception Encoder's have none)
    )


def _vit_common(t: nn.Module, embedding: dict[str, Any]) -> dict[str, Any]:
    """The vitrel ViT's arguments for the timm ViT ``t`` whose patch embedding and tokens ``embedding`` gives."""
    blk = t.blocks[0]
    kind = type(blk).__name__  # (ResPost*: post-norm; Parallel*: parallel branches)
    post = ("ResPostBlock", "ResPostRelPosBlock", "EvaBlockPostNorm")  # (vitrel's post_norm)
    blocks = ("Block", "RelPosBlock", "EvaBlock", *post)
    _refuse(kind not in blocks, f"{kind} blocks (vitrel's are pre-norm or res-post-norm Blocks)", t)
    attn = blk.attn
    pre = getattr(t, "norm_pre", nn.Identity())  # (CLIP's ln_pre: vitrel's pre_norm)
    plain_pre = isinstance(pre, nn.Identity)
    _refuse(not plain_pre and not same_norm(pre, blk.norm1), "a pre-norm other than the blocks'", t)
    qk_norm, attn_norm = (getattr(attn, n, nn.Identity()) for n in ("q_norm", "norm"))  # (vitrel's: the blocks' norm)
    for what, m in (("q/k norms", qk_norm), ("a norm inside attention", attn_norm)):
        _refuse(not isinstance(m, nn.Identity) and not same_norm(m, blk.norm1), f"{what} other than the blocks'", t)
    qkv = getattr(attn, "qkv", None) or getattr(attn, "q_proj", None)  # (EVA-02's separate q / k / v: joined)
    _refuse(qkv is None, "no q / k / v projections vitrel reads", t)
    rms = type(blk.norm1) is RmsNorm  # (sapiens2's: every norm an RmsNorm)
    _refuse(not same_norm(blk.norm1, blk.norm1), "norms other than LayerNorm or timm's RmsNorm", t)
    _refuse(not same_norm(blk.norm2, blk.norm1), "the blocks' two norms of different kinds", t)
    gp = t.global_pool
    _refuse(gp not in ("token", "avg", "max", "avgmax", "map", ""), f"global_pool={gp!r}", t)
    _refuse(type(attn).__name__ == "DiffAttention", "differential attention (DiffAttention)", t)
    has_ls = isinstance(getattr(blk, "ls1", None), LayerScale) or getattr(blk, "gamma_1", None) is not None
    ls2 = isinstance(getattr(blk, "ls2", None), LayerScale) or getattr(blk, "gamma_2", None) is not None
    kv = [int(getattr(b.attn, "num_kv_heads", b.attn.num_heads)) for b in t.blocks]  # (grouped-query: sapiens2's)
    kv_heads = None if set(kv) == {attn.num_heads} else kv[0] if len(set(kv)) == 1 else kv
    mlp = mlp_args(t, blk, lambda cond, what: _refuse(cond, what, t))
    head = head_args(t, mlp["mlp_ratio"], lambda cond, what: _refuse(cond, what, t))
    return dict(
        **embedding,
        num_classes=int(t.num_classes),
        global_pool=gp,
        embed_dim=int(t.embed_dim),
        depth=len(t.blocks),
        num_heads=int(attn.num_heads),
        **mlp,
        qkv_bias=qkv_bias_of(attn),
        init_values=1e-5 if has_ls else None,
        **({"attn_only_layer_scale": True} if has_ls and not ls2 else {}),
        **({"num_kv_heads": kv_heads} if kv_heads is not None else {}),
        pre_norm=not plain_pre,
        **({"post_norm": True} if kind in post else {}),
        **({} if isinstance(qk_norm, nn.Identity) else {"qk_norm": True}),
        **({} if isinstance(attn_norm, nn.Identity) else {"attn_norm": True}),
        **head,
        norm_eps=float(blk.norm1.eps),
        **({"norm_layer": "rmsnorm"} if rms else {}),
    )


def timm_to_vitrel_args(t: nn.Module) -> tuple[str, dict[str, Any], dict[str, Any] | str]:
    """``(vitrel architecture, constructor arguments, the scheme that computes the source's function)``."""
    fam = _family(t)
    if fam in ("swin", "swinv2"):
        args, native = swin_args(t, fam == "swinv2", lambda cond, what: _refuse(cond, what, t))
        return "vitrel_swin_tiny_patch4_window7_224", args, native
    if fam == "convit":
        _refuse(t.local_up_to_layer >= len(t.blocks), "a class token that never joins (local_up_to_layer >= depth)", t)
        args, native = convit_args(t)
        return _vit_arch(args), args, native
    if fam == "naflex":
        args = _vit_common(t, naflex_embedding(t, lambda cond, what: _refuse(cond, what, t)))
        return _vit_arch(args), args, "__ape__" if naflex_abs_pos(t) is not None else "none"
    args = _vit_common(t, _patch_args(t))
    if fam == "beit":
        more, native = beit_scheme(t, lambda cond, what: _refuse(cond, what, t))
        return _vit_arch(args), {**args, **more}, native
    if fam == "relpos":
        args["pos_share"], native = relpos_scheme(t, lambda cond, what: _refuse(cond, what, t))
        return _vit_arch(args), args, native
    if fam == "eva":
        args["abs_pos"] = "ape" if getattr(t, "pos_embed", None) is not None else None  # (EVA-02: both)
        rope = getattr(t, "rope", None)
        if rope is None:  # (EVA-01: the absolute embedding alone, kept as abs_pos="ape")
            return _vit_arch(args), args, "none"
        mixed = bool(getattr(t, "rope_mixed", False))
        native: dict[str, Any] | str
        if mixed:
            _refuse(rope.grid_indexing != "xy", "RoPE-Mixed with 'ij' coordinates", t)
            native = {"name": "rope2d_mixed", "base": float(rope.temperature)}
        elif type(rope).__name__ == "RotaryEmbeddingDinoV3":
            ok = (
                rope.temperature is not None
                and rope.min_period is None
                and rope.normalize_coords == "separate"
                and not rope.grid_offset
            )
            aug = {"shift": rope.shift_coords, "jitter": rope.jitter_coords, "rescale": rope.rescale_coords}
            native = (
                {"name": "rope2d_axial", "base": float(rope.temperature), "coords": "normalized", **aug}
                if ok
                else "__none__"
            )
        else:
            ok = (
                type(rope).__name__ == "RotaryEmbeddingCat"
                and not rope.in_pixels
                and not rope.linear_bands
                and getattr(rope, "grid_type", "index") == "index"
            )
            native = {"name": "rope2d_axial", "base": float(rope.temperature)} if ok else "__none__"
            if ok and rope.grid_offset:  # (the Perception Encoder's: the class token before the grid)
                native["grid_offset"] = float(rope.grid_offset)
            if ok and rope.ref_feat_shape is not None:  # EVA's rule, i * ref / feat at any grid (_eva_reference)
                native["scaling"] = {"rope_type": "linear", "factor": "grid"}
        return _vit_arch(args), args, native
    return _vit_arch(args), args, "__ape__" if getattr(t, "pos_embed", None) is not None else "none"


def source_abs_pos(t: nn.Module) -> str | dict[str, Any]:
    """The absolute scheme computing the learned embedding of the timm model ``t`` (what ``pos=None`` keeps as
    ``abs_pos``): ``"ape"``, or for a NaFlexVit ``ape`` / ``ape_factored`` with its table's grid and options."""
    spec = naflex_abs_pos(t) if isinstance(t, NaFlexVit) else None
    return spec if spec is not None else "ape"


def _vit_arch(args: dict[str, Any]) -> str:
    size = {192: "tiny", 384: "small", 768: "base"}.get(args["embed_dim"], "base")
    return f"vitrel_vit_{size}_patch16_224"


# ---------------------------------------------------------------------------- weights
def transfer_timm_weights(t: nn.Module, ours: nn.Module) -> TransferReport:
    """Load every tensor of the timm model ``t`` that fits into the vitrel model ``ours`` (strictly checked:
    a tensor of ours that is neither loaded nor a position part or new head raises)."""
    fam = _family(t)
    src = {k: v for k, v in t.state_dict().items()}
    own = ours.state_dict()
    rep = TransferReport()
    out: dict[str, Tensor] = {}

    def put(ours_key: str, theirs_key: str, value: Tensor) -> None:
        out[ours_key] = value
        if ours_key == theirs_key and value is src.get(theirs_key):
            rep.carried.append(ours_key)
        else:
            rep.converted[ours_key] = theirs_key
        src.pop(theirs_key, None)

    has_ape = getattr(ours, "abs_pos", None) is not None and ours.abs_pos.name == "ape"
    take = {"convit": convit_tensors, "beit": beit_tensors, "naflex": lambda s, o: naflex_tensors(s, o, t)}.get(fam)
    if take is not None:
        converted, why = take(src, own)
        out.update((k, v) for k, (v, _) in converted.items())
        rep.converted.update((k, how) for k, (_, how) in converted.items())
        rep.dropped.update(why)
    order = rope_channel_order(t) if fam == "eva" else None
    for k in list(src):
        if k not in src:  # taken with another tensor (EVA's v_bias with its q_bias)
            continue
        v = src[k]
        if k.endswith(("relative_position_index", "attn_mask", "rel_pos.relative_position_index")):
            rep.dropped[k] = BUFFER
            src.pop(k)
            continue
        if fam in ("vit", "convit", "beit", "eva") and k == "pos_embed":  # (ConViT's covers the patch tokens only)
            npt = 0 if fam == "convit" or getattr(t, "no_embed_class", False) else t.num_prefix_tokens
            if has_ape:
                put("abs_pos.pos_embed", k, v[:, npt:])
                if npt:
                    # timm adds pos_embed's prefix slots to the prefix tokens: fold them in (same function)
                    nc = 1 if t.cls_token is not None else 0
                    for name, slots in (("cls_token", slice(0, nc)), ("reg_token", slice(nc, npt))):
                        if getattr(t, name, None) is not None:
                            out[name] = src.pop(name, out.get(name)) + v[:, slots]
                            rep.converted[name] = f"{name} + pos_embed[:, {slots.start}:{slots.stop}]"
                            if name in rep.carried:
                                rep.carried.remove(name)
            else:
                rep.dropped[k] = "absolute embedding (the target has none; abs_pos='ape' keeps it)"
                src.pop(k)
            continue
        key = k
        target = None
        if fam in ("swin", "swinv2"):
            key = key.replace("head.fc.", "head.")
            if key.endswith("attn.relative_position_bias_table"):
                target = key.replace("attn.relative_position_bias_table", "attn.pos.table")
            if ".attn.cpb_mlp." in key:  # Swin V2's CPB: rel2d_cpb's MLP, the same layers
                if key.replace(".attn.cpb_mlp.", ".attn.pos.mlp.") in own:
                    put(key.replace(".attn.cpb_mlp.", ".attn.pos.mlp."), k, v)
                else:
                    rep.dropped[k] = "Swin V2's continuous position bias (the target scheme is not rel2d_cpb)"
                    src.pop(k)
                continue
        if fam == "relpos" and (".attn.rel_pos." in key or key.startswith("shared_rel_pos.")):
            placed = relpos_tensor(key, v, own)
            if placed is not None:
                put(placed[0], k, placed[1])
            else:
                rep.dropped[k] = "relative-position parameters of timm's (the target scheme is another)"
                src.pop(k)
            continue
        if target is not None:  # Swin V1's flat bias table -> rel2d_full's (resized to another window as it loads)
            table = swin_table(t, k, v, own.get(target)) if target != key else None
            if table is not None:
                put(target, k, table)
            else:
                rep.dropped[k] = "relative-position parameters of timm's (not a rel2d_full table of this scheme)"
                src.pop(k)
            continue
        if fam in ("eva", "beit", "swinv2"):
            key = key.replace(".gamma_1", ".ls1.gamma").replace(".gamma_2", ".ls2.gamma")
            blk = key.rpartition(".attn.")[0]
            if key.endswith((".attn.q_bias", ".attn.q_proj.bias")) and f"{blk}.attn.q_bias" in own:
                # qkv_bias="qv": q's and v's biases as they are, no key bias
                v_key = f"{blk}.attn.{'v_bias' if key.endswith('q_bias') else 'v_proj.bias'}"
                if order is not None:
                    v = v.view(t.get_submodule(blk + ".attn").num_heads, -1)[:, order].flatten()
                put(f"{blk}.attn.q_bias", k, v)
                put(f"{blk}.attn.v_bias", v_key, src[v_key])
                continue
            if key.endswith((".attn.q_bias", ".attn.q_proj.weight", ".attn.q_proj.bias")):
                # EVA's separate q / v biases (k's a zero buffer) or q / k / v projections (EVA-02's; k without bias)
                blk, _, name = key.rpartition(".attn.")
                theirs = {"q_bias": ("k_bias", "v_bias")}.get(name) or tuple(name.replace("q_", f"{x}_") for x in "kv")
                k_part = src.pop(f"{blk}.attn.{theirs[0]}", None)
                if k_part is None:  # (a buffer, or no k bias at all)
                    k_part = getattr(t.get_submodule(blk + ".attn"), "k_bias", None)
                    k_part = torch.zeros_like(v) if k_part is None else k_part.to(v)
                v = torch.cat((v, k_part, src.pop(f"{blk}.attn.{theirs[1]}")))
                if order is not None:
                    a = t.get_submodule(blk + ".attn")
                    v = permute_qk(v, order, a.num_heads, getattr(a, "num_kv_heads", None))
                ours_key = f"{blk}.attn.qkv.{'bias' if name.endswith('bias') else 'weight'}"
                out[ours_key] = v
                rep.converted[ours_key] = f"cat({k}, {blk}.attn.{theirs[0]}, {blk}.attn.{theirs[1]})"
                src.pop(k)
                continue
            if order is not None and key.endswith((".attn.qkv.weight", ".attn.qkv.bias")):
                put(key, k, permute_qk(v, order, t.blocks[0].attn.num_heads))  # timm's RoPE layout -> ours
                continue
            if ".attn.q_norm." in key or ".attn.k_norm." in key:  # (qk_norm's channels move with q's and k's)
                put(key, k, v if order is None else v[order])
                continue
            if key == "rope.freqs":
                if all(f"blocks.{i}.attn.pos.freqs" in own for i in range(len(t.blocks))) and v.shape[1] == len(
                    t.blocks
                ):
                    for i in range(len(t.blocks)):
                        out[f"blocks.{i}.attn.pos.freqs"] = v[:, i]
                        rep.converted[f"blocks.{i}.attn.pos.freqs"] = f"rope.freqs[:, {i}]"
                    src.pop(k)
                else:
                    rep.dropped[k] = "RoPE-Mixed frequencies (the target scheme is not per-block rope2d_mixed)"
                    src.pop(k)
                continue
        halves = split_packed(key, v, own, t)  # (a packed SwiGLU's fc1: the value rows, then the gate's)
        if halves is not None:
            for part, (ours_key, value) in zip(("[:h]", "[h:]"), halves.items()):
                out[ours_key] = value
                rep.converted[ours_key] = f"{k}{part}"
            src.pop(k)
            continue
        if key in own and own[key].shape == v.shape:
            put(key, k, v)
        elif key in own:
            raise UnsupportedTimmModel(f"{k}: shape {tuple(v.shape)} does not fit {key} {tuple(own[key].shape)}")
    for k in list(src):
        rep.dropped[k] = "no counterpart in the vitrel model"
    if fam == "eva":
        _eva_reference(t, ours, out, rep)
    if fam == "swinv2":
        rep.converted.update(swinv2_reference(t, own, out))
    pos_parts = (".abs_pos.", ".rel_pos.", ".attn.pos.")
    missing = [k for k in own if k not in out]
    bad = [k for k in missing if not (any(p in "." + k for p in pos_parts) or k.startswith("head."))]
    if bad:
        raise UnsupportedTimmModel(f"the timm model gives no value for {bad[:8]} ({len(bad)} in all)")
    rep.initialised = missing
    orphans = [k for k, why in rep.dropped.items() if why == "no counterpart in the vitrel model"]
    if orphans:
        raise UnsupportedTimmModel(f"timm tensors with no place in the vitrel model: {orphans[:8]} ({len(orphans)})")
    with torch.no_grad():
        res = ours.load_state_dict(out, strict=False)
    assert not res.unexpected_keys, res.unexpected_keys
    return rep


def _eva_reference(t: nn.Module, ours: nn.Module, out: dict[str, Tensor], rep: TransferReport) -> None:
    """timm's ``ref_feat_shape`` (EVA's RoPE positions ``i * ref / feat``) as the ``ref_grid`` of each RoPE scheme of
    ``ours`` scaled by ``factor: grid``, the grid that rule measures from."""
    ref = getattr(getattr(t, "rope", None), "ref_feat_shape", None)
    if ref is None:
        return
    for name, mod in ours.named_modules():
        if getattr(getattr(mod, "scaling", None), "factor", None) == "grid" and mod.keeps_reference:
            out[f"{name}.ref_grid"] = torch.tensor([int(v) for v in ref])
            rep.converted[f"{name}.ref_grid"] = "rope.ref_feat_shape"


# ---------------------------------------------------------------------------- entry point
def _create_timm(name: str, pretrained: bool, timm_kwargs: dict[str, Any]) -> nn.Module:
    """``timm.create_model``; weights that cannot be fetched (no network, no cached copy: the Hub's
    ``LocalEntryNotFoundError``, a failed URL) are a :class:`CheckpointError` saying how to give them as a file."""
    try:
        return timm.create_model(name, pretrained=pretrained, **timm_kwargs)
    except OSError as e:  # the Hub's errors, urllib's URLError and a refused connection are OSErrors
        if not pretrained:
            raise
        why = str(e).strip().split(". ")[0].rstrip(".")  # (the first sentence)
        raise CheckpointError(
            f"cannot fetch timm's pretrained weights of {name} ({type(e).__name__}: {why}). Without a network, "
            f"give them as a file: model.init_file=<file or folder> (train.py), checkpoint_path= (vitrel.from_timm), "
            f"e.g. the model.safetensors of {name} from a machine with one (timm.create_model('{name}', "
            "pretrained=True) fills its Hugging Face cache, HF_HOME)"
        ) from e


def _refuse_before_weights(name: str, timm_kwargs: dict[str, Any]) -> None:
    """Raise :class:`UnsupportedTimmModel` for an architecture ``from_timm`` refuses before its weights are fetched or
    read: the timm model built on the meta device (no weights, no memory) and read as :func:`timm_to_vitrel_args`
    reads it. An architecture that does not build there is read after its weights, as before."""
    try:
        with torch.device("meta"):
            t = timm.create_model(name, pretrained=False, **timm_kwargs)
    except Exception:  # (the weighted build below raises its own error, or reads the model)
        return
    timm_to_vitrel_args(t)


def from_timm(
    model_or_name: nn.Module | str,
    pos: str | dict | None = None,
    *,
    pretrained: bool = True,
    checkpoint_path: str | os.PathLike | None = None,
    timm_kwargs: dict[str, Any] | None = None,
    **kwargs: Any,
) -> nn.Module:
    """A vitrel model with the weights of a timm model and the position scheme ``pos``.

    Args:
        model_or_name: a timm model instance, or a timm model name (``"swin_tiny_patch4_window7_224"``,
            a ``.tag`` allowed). With a name, the weights come from ``checkpoint_path`` when given
            (:func:`load_timm_file`), else through timm's hub / cache (``pretrained``; a network or a
            filled cache is needed).
        pos: the position scheme (name or config). None: the scheme that computes the source's
            function (``rel2d_full`` for relpos ViTs and Swin, ``rope2d_*`` for RoPE ViTs, the learned
            absolute embedding kept as ``abs_pos="ape"`` for plain ViTs).
        pretrained: with a name and no file, load timm's pretrained weights (False: timm's random init).
        checkpoint_path: a local file or folder in timm's on-disk formats (offline machines).
        timm_kwargs: arguments for ``timm.create_model`` (the source's architecture, e.g. ``img_size``).
        **kwargs: vitrel constructor arguments (``num_classes`` resets the head, ``img_size`` resizes
            tables and the absolute embedding, ``in_chans`` adapts the patch embedding as timm does,
            ``abs_pos="ape"`` keeps a ViT's embedding (a NaFlexVit's with its table grid and options),
            ``drop_path_rate`` ...); ``features_only=True`` (with
            ``out_indices``, ``output_fmt``): the model as timm's ``features_only`` backbone (:func:`with_features`).

    Logs the transfer report (logger ``vitrel.models.timm_import``); :func:`transfer_timm_weights`
    returns it.
    """
    timm_kwargs = dict(timm_kwargs or {})
    kwargs, feature_args = split_feature_args(kwargs)
    if feature_args.get("features_only"):  # the whole network with the weights, then its backbone (timm's wrapper)
        whole = from_timm(
            model_or_name,
            pos,
            pretrained=pretrained,
            checkpoint_path=checkpoint_path,
            timm_kwargs=timm_kwargs,
            **kwargs,
        )
        return with_features(whole, feature_args)
    if isinstance(model_or_name, nn.Module):
        if checkpoint_path is not None:
            raise ValueError(
                "from_timm got a timm model instance and checkpoint_path: the instance's weights would be used and the "
                "file ignored; give the model's name with checkpoint_path (and its arguments as timm_kwargs=), or load "
                "the file into the instance first"
            )
        t = model_or_name
    else:
        _refuse_before_weights(model_or_name, timm_kwargs)
        if checkpoint_path is not None:
            t = load_timm_file(model_or_name, checkpoint_path, **timm_kwargs)
        else:
            t = _create_timm(model_or_name, pretrained, timm_kwargs)
    arch, args, native = timm_to_vitrel_args(t)
    if pos is None:
        if native == "__none__":
            raise UnsupportedTimmModel(
                "vitrel has no scheme equal to this timm model's position encoding; give pos=... (its position "
                "parameters are then dropped and the scheme's are initialised)"
            )
        if native == "__ape__":
            pos = "none"
            kwargs.setdefault("abs_pos", source_abs_pos(t))
        else:
            pos = native
    src_abs = source_abs_pos(t)  # (abs_pos="ape" keeps a NaFlexVit's embedding as it computes it, as a ViT's)
    if isinstance(src_abs, dict) and kwargs.get("abs_pos") == src_abs["name"]:
        kwargs["abs_pos"] = src_abs
    later = {k: kwargs.pop(k) for k in ("img_size", "num_classes", "in_chans") if kwargs.get(k) is not None}
    args.update(kwargs)
    ours = build(arch, pos=pos, **args)
    ref = next(t.parameters())
    ours = ours.to(device=ref.device, dtype=ref.dtype).train(t.training)
    rep = transfer_timm_weights(t, ours)
    if any(later.get(k) != args.get(k) for k in later):
        ours = _rebuild(ours, arch, pos, args, later)
        if ours.num_classes != t.num_classes:  # the head was reset: say so in the report, not "carried"
            _report_new_head(rep, [k for k in ours.state_dict() if k.startswith("head.")])
    src_cfg = dict(getattr(t, "pretrained_cfg", None) or {})
    if ours.num_classes != t.num_classes:  # a new head: not the source's class names
        src_cfg.pop("label_names", None)
    set_data_config(ours, data_fields(src_cfg))  # the source's preprocessing, at the model's input size
    name = src_cfg.get("architecture", type(t).__name__)
    if isinstance(t, (TimmSwin, TimmSwinV2)):
        warn_swin_padding(t, name)
    log.info(f"from_timm({name}) -> {arch} pos={pos}: {rep.summary()}")
    lost = rep.lost_position_warning(name, str(scheme_name(pos)))
    if lost:
        warnings.warn(lost, stacklevel=2)
    return ours


def _report_new_head(rep: TransferReport, keys: list[str]) -> None:
    """Move a reset head's tensors from carried / converted to newly initialised."""
    rep.carried = [k for k in rep.carried if k not in keys]
    for k in keys:
        rep.converted.pop(k, None)
    rep.initialised += [k for k in keys if k not in rep.initialised]


def _rebuild(ours: nn.Module, arch: str, pos: Any, args: dict, changes: dict[str, Any]) -> nn.Module:
    """The same weights in a model of another input size / number of classes / input channels (tables
    and absolute embeddings resized, head reset, patch embedding adapted with timm's ``adapt_input_conv``)."""
    new = build(arch, pos=pos, **{**args, **changes}).to(next(ours.parameters()).dtype).train(ours.training)
    sd = ours.state_dict()
    if changes.get("in_chans", args["in_chans"]) != args["in_chans"]:
        sd["patch_embed.proj.weight"] = adapt_input_conv(changes["in_chans"], sd["patch_embed.proj.weight"])
    load_weights(new, sd, num_classes_stored=ours.num_classes)
    return new
