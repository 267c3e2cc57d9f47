"""timm's relative-position ViTs (``vit_relpos_*``, ``vit_srelpos_*``; timm's own ``VisionTransformerRelPos``) read
as a vitrel ViT, for :func:`~vitrel.models.timm_import.from_timm`.

Their bias is one of two modules of ``timm.layers.pos_embed_rel``, in every block or one shared by all
(``shared_rel_pos``), zero for the prefix tokens: ``RelPosBias``, a flat table of the ``(2H-1)(2W-1)`` offsets
(vitrel's ``rel2d_full``, the table reshaped), or ``RelPosMlp`` in its ``cr`` mode, an MLP over the offsets'
``sign(d) ln(1 + |d|)`` (vitrel's ``rel2d_cpb`` with ``mode: cr``, the same layers: ``fc1``, ``fc2`` as ``mlp.0``,
``mlp.3``). timm trains them with weight decay on the MLP's matrices, which the import keeps
(``mlp_weight_decay: true``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from timm.models.vision_transformer_relpos import VisionTransformerRelPos
from torch import Tensor

__all__ = ["VisionTransformerRelPos", "relpos_scheme", "relpos_tensor"]


def relpos_scheme(t: VisionTransformerRelPos, refuse) -> tuple[bool, dict[str, Any] | str]:
    """``pos_share`` and the scheme that computes ``t``'s bias (``"__none__"``: none does). ``refuse(condition,
    what)`` raises for what vitrel has no equivalent of."""
    rp = t.blocks[0].attn.rel_pos
    refuse(rp is None and getattr(t, "shared_rel_pos", None) is None, "no relative position module")
    rp = rp if rp is not None else t.shared_rel_pos
    share = getattr(t, "shared_rel_pos", None) is not None
    if getattr(rp, "mode", None) == "cr":
        mlp = {"hidden_dim": rp.mlp.fc1.out_features, "mlp_drop": rp.mlp.drop1.p, "mlp_weight_decay": True}
        return share, {"name": "rel2d_cpb", "mode": "cr", **mlp}
    gh, gw = t.patch_embed.grid_size
    table = getattr(rp, "relative_position_bias_table", None)
    flat = table is not None and table.dim() == 2 and table.shape[0] == (2 * gh - 1) * (2 * gw - 1)
    return share, "rel2d_full" if flat else "__none__"


def relpos_tensor(key: str, v: Tensor, own: Mapping[str, Tensor]) -> tuple[str, Tensor] | None:
    """Where timm's relative-position tensor ``key`` goes in the vitrel model's state dict ``own`` (None: nowhere, the
    target scheme is another)."""
    ours = key.replace(".attn.rel_pos.", ".attn.pos.").replace("shared_rel_pos.", "rel_pos.")
    if ".mlp.fc" in key:  # (RelPosMlp: into rel2d_cpb's mode cr only, whose mlp.3 no other scheme has)
        ours = ours.replace(".mlp.fc1.", ".mlp.0.").replace(".mlp.fc2.", ".mlp.3.")
        cr = ours.rsplit(".mlp.", 1)[0] + ".mlp.3.weight" in own
        return (ours, v) if cr and ours in own and own[ours].shape == v.shape else None
    ours = ours.replace(".relative_position_bias_table", ".table")  # a flat table -> rel2d_full's [2H-1, 2W-1, heads]
    return (ours, v.reshape(own[ours].shape)) if ours in own and own[ours].numel() == v.numel() else None
