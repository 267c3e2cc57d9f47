"""timm's ConViT (``convit_tiny`` / ``_small`` / ``_base``; d'Ascoli et al. 2021) read as a vitrel ViT, for
:func:`~vitrel.models.timm_import.from_timm`.

timm's ``ConVit`` (``timm/models/convit.py``, the authors' facebookresearch/convit ported) is a ViT whose first
``local_up_to_layer`` blocks run GPSA (vitrel's ``pos="gpsa"``), the class token joining after them (``prefix_at``)
and the later blocks attending by content alone (``pos_depth``), with a learned absolute embedding of the patch
tokens (``abs_pos="ape"``). The same function in vitrel: each GPSA block's ``qk`` and ``v`` projections become one
``qkv``, ``pos_proj.weight`` and ``gating_param`` the scheme's ``pos_proj`` and ``gating``; ``pos_proj.bias`` is
dropped (a constant per head and query: the softmax over the keys cancels it).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from timm.models.convit import ConVit
from torch import Tensor

from vitrel.models.transfer_report import CANCELLED

__all__ = ["ConVit", "convit_args", "convit_tensors"]

#: a GPSA block's tensor in timm's state dict: block, module, weight / bias
_GPSA = re.compile(r"blocks\.(\d+)\.attn\.(qk|v|pos_proj|gating_param)(?:\.(weight|bias))?")


def convit_args(t: ConVit) -> tuple[dict[str, Any], dict[str, Any]]:
    """The vitrel ViT's constructor arguments for timm's ConViT ``t`` and the scheme that computes its function."""
    local = min(int(t.local_up_to_layer), len(t.blocks))
    blk = t.blocks[0]
    attn = blk.attn
    proj = attn.qk if local else attn.qkv
    args = dict(
        img_size=list(t.patch_embed.img_size),
        patch_size=int(t.patch_embed.patch_size[0]),
        in_chans=int(t.patch_embed.proj.in_channels),
        num_classes=int(t.num_classes),
        global_pool=t.global_pool,
        embed_dim=int(t.embed_dim),
        depth=len(t.blocks),
        num_heads=int(attn.num_heads),
        mlp_ratio=blk.mlp.fc1.out_features / t.embed_dim,
        qkv_bias=proj.bias is not None,
        fc_norm=False,  # (ConViT normalises the tokens, then pools)
        norm_eps=float(blk.norm1.eps),
        abs_pos="ape" if t.use_pos_embed else None,
        pos_depth=local,
        prefix_at=local,
    )
    return args, {"name": "gpsa", "locality_strength": float(t.locality_strength)}


def convit_tensors(src: dict[str, Tensor], own: Mapping[str, Tensor]) -> tuple[dict[str, tuple[Tensor, str]], dict]:
    """Take GPSA's tensors, which vitrel names otherwise, out of ``src`` (timm's state dict): ``{ours: (value, how it
    was made)}`` for the keys of ``own`` (the vitrel model's state dict), and ``{theirs: why}`` for those dropped
    (ConViT's ``pos_embed`` goes as a timm ViT's does)."""
    out: dict[str, tuple[Tensor, str]] = {}
    dropped: dict[str, str] = {}
    for k in [k for k in src if _GPSA.fullmatch(k)]:
        if k not in src:  # (taken with its qk)
            continue
        i, name, kind = _GPSA.fullmatch(k).groups()
        blk = f"blocks.{i}.attn"
        if name == "qk":  # [q; k] rows, then v's: vitrel's qkv
            v = src.pop(f"{blk}.v.{kind}")
            out[f"{blk}.qkv.{kind}"] = (torch.cat([src.pop(k), v]), f"cat({k}, {blk}.v.{kind})")
            continue
        if name == "v":
            raise ValueError(f"{k} has no {blk}.qk.{kind} to join")
        ours = f"{blk}.pos.pos_proj" if name == "pos_proj" else f"{blk}.pos.gating"
        value = src.pop(k)
        if kind == "bias":
            dropped[k] = CANCELLED
        elif ours in own:
            out[ours] = (value, k)
        else:
            dropped[k] = "GPSA's parameters (the model was asked for another scheme than gpsa)"
    return out, dropped
