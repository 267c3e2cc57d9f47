"""The end of a timm ViT read as vitrel's, for :func:`~vitrel.models.timm_import.from_timm`: its final norms
(``fc_norm``, ``final_norm``) and its attention pool (``AttentionPoolLatent``: ``attn_pool_num_heads``,
``attn_pool_mlp_ratio``, ``pool_include_prefix``; SigLIP's, and the Perception Encoder's over every token)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from timm.layers import AttentionPoolLatent, SwiGLU
from torch import nn

from vitrel.layers.norms import same_norm

__all__ = ["head_args"]


def _vitrel_attn_pool(t: nn.Module) -> bool:
    """No attention pool, or the ``AttentionPoolLatent`` vitrel's ``global_pool="map"`` builds (timm's ViT's: one
    latent, LayerNorm and the blocks' activation, no position embedding or q/k norm; its heads and MLP ratio are
    ``attn_pool_num_heads`` and ``attn_pool_mlp_ratio``)."""
    ap, blk = getattr(t, "attn_pool", None), t.blocks[0]
    if ap is None or not isinstance(ap, AttentionPoolLatent) or ap.mlp is None:
        return ap is None
    ours = (ap.pos_embed, ap.latent_len, ap.pool, type(ap.q), type(ap.q_norm), type(ap.mlp.act))
    return ours == (None, 1, "token", nn.Linear, nn.Identity, type(blk.mlp.act)) and (
        same_norm(ap.norm, blk.norm1) and None not in (ap.q.bias, ap.kv.bias)
        and not isinstance(blk.mlp, SwiGLU)
    )  # fmt: skip


def head_args(t: nn.Module, mlp_ratio: float, refuse: Callable[[bool, str], None]) -> dict[str, Any]:
    """``fc_norm`` and, where they differ from the defaults, ``final_norm``, ``attn_pool_num_heads``,
    ``attn_pool_mlp_ratio`` and ``pool_include_prefix`` of the timm ViT ``t`` (its blocks' ``mlp_ratio``);
    ``refuse(condition, what)`` raises for what vitrel has no equivalent of."""
    refuse(not _vitrel_attn_pool(t), "attention pooling other than timm's ViT's AttentionPoolLatent ('map')")
    fc_norm = getattr(t, "fc_norm", nn.Identity())
    for m in (t.norm, fc_norm):
        refuse(
            not isinstance(m, nn.Identity) and not same_norm(m, t.blocks[0].norm1), "a final norm unlike the blocks'"
        )
    out: dict[str, Any] = {"fc_norm": not isinstance(fc_norm, nn.Identity)}
    if isinstance(fc_norm, nn.Identity) and isinstance(t.norm, nn.Identity):  # (the Perception Encoder's towers)
        out["final_norm"] = False
    pool = getattr(t, "attn_pool", None)
    # timm's ViT says pool_include_prefix; timm's EVA has none: its attention pool takes every token, its others not
    if getattr(t, "pool_include_prefix", pool is not None and type(t).__name__ == "Eva"):
        out["pool_include_prefix"] = True
    if pool is None:
        return out
    if pool.num_heads != t.blocks[0].attn.num_heads:
        out["attn_pool_num_heads"] = int(pool.num_heads)
    ratio = pool.mlp.fc1.out_features / t.embed_dim
    refuse(int(t.embed_dim * ratio) != pool.mlp.fc1.out_features, "an attention pool MLP width")  # (as vitrel builds)
    if ratio != mlp_ratio:
        out["attn_pool_mlp_ratio"] = ratio
    return out
