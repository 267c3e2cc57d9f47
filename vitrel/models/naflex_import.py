"""timm's NaFlexVit (``naflexvit_*``) read as a vitrel ViT, for :func:`~vitrel.models.timm_import.from_timm`.

timm's ``NaFlexVit`` (``timm/models/naflexvit.py``) is a pre-norm ViT whose embedding module ``embeds`` holds the
patch projection (a ``Linear`` on flattened ``(P, P, C)`` patches by default: vitrel's convolution with its weight
permuted), the class and register tokens and a learned absolute embedding on a grid of its own
(``pos_embed_grid_size``, 16 x 16 or C-RADIO's 128 x 128), resampled to each image's grid as its ``pos_embed_*``
options say. vitrel's ``ape`` takes the same options (``table_grid``, ``interp_mode``, ``antialias``,
``align_corners``, ``ar_preserving``) and ``ape_factored`` is its ``pos_embed="factorized"``: the same function on
every grid, on image tensors and on NaFlex batches. The model is built at the pretrained input size; the blocks, norms,
pools and head are timm ViT's and read as they do.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from timm.models.naflexvit import NaFlexVit
from torch import Tensor, nn

from vitrel.pos.schemes.absolute import INTERP_MODES, RESAMPLE_DEFAULTS

__all__ = ["NaFlexVit", "naflex_abs_pos", "naflex_embedding", "naflex_tensors"]


def naflex_abs_pos(t: NaFlexVit) -> dict[str, Any] | None:
    """The vitrel scheme computing the absolute embedding of ``t``, None for none."""
    e = t.embeds
    grid = [int(v) for v in e.pos_embed_grid_size] if e.pos_embed_grid_size is not None else None
    if e.pos_embed_type == "factorized":
        return {"name": "ape_factored", "table_grid": grid, "ar_preserving": bool(e.pos_embed_ar_preserving)}
    if e.pos_embed_type != "learned":
        return None
    opts = {
        "interp_mode": e.pos_embed_interp_mode,
        "antialias": bool(e.pos_embed_antialias),
        "align_corners": bool(e.pos_embed_align_corners),
        "ar_preserving": bool(e.pos_embed_ar_preserving),
    }
    return {"name": "ape", "table_grid": grid, **{k: v for k, v in opts.items() if RESAMPLE_DEFAULTS[k] != v}}


def naflex_embedding(t: NaFlexVit, refuse: Callable[[bool, str], None]) -> dict[str, Any]:
    """The patch embedding's and tokens' arguments of the vitrel ViT for ``t`` (``img_size``: the pretrained input
    size, else the embedding's grid). ``refuse(condition, what)`` raises for what vitrel has no equivalent of."""
    e = t.embeds
    refuse(t.rope is not None, "NaFlexVit with RoPE (vitrel's RoPE schemes are not checked against it)")
    refuse(e.norm_input is not None, "a norm of the patches before their projection")
    refuse(not isinstance(e.norm, nn.Identity), "the patch embedding has a norm")
    refuse(e.pos_embed_use_grid_sample, "the position embedding read by grid_sample (pos_embed_use_grid_sample)")
    refuse(e.pos_embed_interp_mode not in INTERP_MODES, f"{e.pos_embed_interp_mode} resampling")
    ph, pw = e.patch_size
    refuse(ph != pw, f"non-square patches {ph}x{pw}")
    size = (getattr(t, "pretrained_cfg", None) or {}).get("input_size")
    if size is not None:
        img = [int(size[-2]), int(size[-1])]
    elif e.pos_embed_grid_size is not None:
        img = [int(g) * ph for g in e.pos_embed_grid_size]
    else:
        img = [224, 224]
    refuse(img[0] % ph or img[1] % pw, f"a {img[0]}x{img[1]} input size of no whole {ph}-px patches")
    args = {
        "img_size": img,
        "patch_size": int(ph),
        "in_chans": int(e.in_chans),
        "class_token": e.cls_token is not None,
        "reg_tokens": int(e.num_reg_tokens),
        "dynamic_img_pad": bool(e.dynamic_img_pad),
        "patch_bias": e.proj.bias is not None,
    }
    return args


def naflex_tensors(
    src: dict[str, Tensor], own: Mapping[str, Tensor], t: NaFlexVit
) -> tuple[dict[str, tuple[Tensor, str]], dict[str, str]]:
    """Take the embedding module's tensors out of ``src`` (timm's state dict): ``{ours: (value, how it was made)}`` for
    the keys of ``own`` (the vitrel model's state dict) and ``{theirs: why}`` for what is dropped."""
    out: dict[str, tuple[Tensor, str]] = {}
    dropped: dict[str, str] = {}
    e = t.embeds
    for k in [k for k in src if k.startswith("embeds.")]:
        v, name = src.pop(k), k.removeprefix("embeds.")
        if name == "proj.weight":
            p, c = e.patch_size[0], e.in_chans
            if v.dim() == 2:  # (a Linear on flattened (P, P, C) patches, or (C, P, P) without channels_last)
                v = v.view(-1, p, p, c).permute(0, 3, 1, 2) if e.channels_last else v.view(-1, c, p, p)
            out["patch_embed.proj.weight"] = (v, f"{k} as a {p}x{p} convolution")
        elif name == "proj.bias":
            out["patch_embed.proj.bias"] = (v, k)
        elif name in ("cls_token", "reg_token"):
            out[name] = (v, k)
        elif name in ("pos_embed", "pos_embed_y", "pos_embed_x"):
            ours = f"abs_pos.{name}"
            if ours in own:
                out[ours] = (v.flatten(1, 2) if name == "pos_embed" else v, k)
            else:
                dropped[k] = "absolute embedding (the target has no such table; pos=None keeps it)"
        else:
            dropped[k] = "no counterpart in the vitrel model"
    return out, dropped
