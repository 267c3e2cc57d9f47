"""timm's BEiT (``beit_*``, ``beitv2_*``; Bao et al. 2021, Peng et al. 2022) read as a vitrel ViT, for
:func:`~vitrel.models.timm_import.from_timm`.

timm's ``Beit`` (``timm/models/beit.py``, the authors' microsoft/unilm ``beit`` ported) is a pre-norm ViT with layer
scale, separate q / v biases (k has none), mean pooling under ``fc_norm`` and, in every block (or one shared by all,
``use_shared_rel_pos_bias``), a relative bias: a flat table of ``(2H-1)(2W-1)`` offsets and three class-token rows.
vitrel's ``pos="rel2d_beit"`` computes it: the first rows become the scheme's ``table [2H-1, 2W-1, heads]``, the last
three its ``prefix_terms``, with ``extend="geometric"``: at another ``img_size`` the table resizes as timm's loader
and the authors' fine-tuning resize it. Into another scheme with a ``table`` of that shape (``rel2d_full``) the
offsets carry and the class-token rows are dropped (another function, reported).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from timm.models.beit import Beit
from torch import Tensor

__all__ = ["Beit", "beit_scheme", "beit_tensors"]

#: a BEiT bias table in timm's state dict: a block's or the shared one
_TABLE = re.compile(r"(blocks\.\d+\.attn|rel_pos_bias)\.relative_position_bias_table")


def beit_scheme(t: Beit, refuse) -> tuple[dict[str, Any], dict[str, Any] | str]:
    """The vitrel ViT's arguments BEiT ``t`` adds to a timm ViT's (``pos_share``, ``abs_pos``) and the scheme that
    computes its function. ``refuse(condition, what)`` raises for what vitrel has no equivalent of."""
    attn = t.blocks[0].attn
    own = attn.relative_position_bias_table is not None
    shared = t.rel_pos_bias is not None
    refuse(own and shared, "a relative bias in every block and a shared one added to it")
    refuse(attn.qkv.out_features != 3 * t.embed_dim, "a head width other than embed_dim / num_heads (attn_head_dim)")
    args = {"pos_share": shared, "abs_pos": "ape" if t.pos_embed is not None else None}
    if own or shared:  # (at another img_size its table resizes as timm's BEiT loader and the authors resize it)
        return args, {"name": "rel2d_beit", "extend": "geometric"}
    return args, "none"


def beit_tensors(src: dict[str, Tensor], own: Mapping[str, Tensor]) -> tuple[dict[str, tuple[Tensor, str]], dict]:
    """Take BEiT's bias tables out of ``src`` (timm's state dict): ``{ours: (value, how it was made)}`` for the keys of
    ``own`` (the vitrel model's state dict) and ``{theirs: why}`` for what is dropped."""
    out: dict[str, tuple[Tensor, str]] = {}
    dropped: dict[str, str] = {}
    for k in [k for k in src if _TABLE.fullmatch(k)]:
        flat = src.pop(k)
        where = "rel_pos" if k.startswith("rel_pos_bias.") else k.rsplit(".", 1)[0] + ".pos"
        table, terms = f"{where}.table", f"{where}.prefix_terms"
        if table in own and own[table].dim() == 3 and own[table].numel() == flat[:-3].numel():
            out[table] = (flat[:-3].reshape(own[table].shape), f"{k}[:-3]")
        else:
            dropped[f"{k}[:-3]"] = "BEiT's relative bias between patches (the target scheme has no such table)"
        if terms in own:
            out[terms] = (flat[-3:], f"{k}[-3:]")
        else:
            dropped[f"{k}[-3:]"] = "BEiT's class-token terms (the target scheme has none; rel2d_beit keeps them)"
    return out, dropped
