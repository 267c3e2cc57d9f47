"""Bring weights trained with ``rope2d_axial``'s earlier columns-first layout to its rows-first one.

``rope2d_axial`` rotates pairs ``t < d/4`` with the patch's row and pairs ``d/4 + t`` with its column (timm's,
DINOv3's and V-JEPA 2's order). It used to put the columns first (RoPE-ViT's ``compute_axial_cis``), and it has no
stored state, so a checkpoint trained then loads without complaint and computes another function. Swapping the two
halves of each head's query and key channels (a cyclic shift by ``d/2``) turns one layout into the other, exactly:
:func:`swap_rope_axial_halves` does it on a built model after its weights are loaded (a checkpoint whose
``vitrel_cfg`` predates ``vitrel_format`` 5 needs none of this: it loads with ``order: columns_first``)::

    model = vitrel.create_model(..., pos="rope2d_axial")
    model.load_state_dict(old_state_dict)
    vitrel.models.swap_rope_axial_halves(model)   # now computes what it computed when trained

STRING's ``basis`` moves with the channels: ``cayley``'s parameter is permuted on both axes (``P -> S P S^T``);
``circulant``'s is left as it is (a circulant matrix is unchanged by a cyclic shift of its rows and columns).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from vitrel.layers.attention import Attention
from vitrel.pos.base import PositionScheme

__all__ = ["swap_rope_axial_halves", "half_swap_order", "permute_qk", "rope_channel_order"]


def half_swap_order(head_dim: int) -> Tensor:
    """The channel order ``[d/2, ..., d-1, 0, ..., d/2-1]``: the two halves of a head swapped (its own inverse)."""
    return torch.cat((torch.arange(head_dim // 2, head_dim), torch.arange(head_dim // 2)))


def permute_qk(w: Tensor, order: Tensor, heads: int, kv_heads: int | None = None) -> Tensor:
    """A ``qkv`` weight or bias ``[C + 2 C_kv, ...]`` (``C = heads * d``, ``C_kv = kv_heads * d``, ``kv_heads``
    None: ``heads``; q, k, v one after the other, heads in turn) with the ``d`` channels of each head's query and
    key taken in ``order`` (a permutation of ``0 .. d-1``: new channel
    ``i`` is old channel ``order[i]``); the values are unchanged. Permuting q and k alike leaves every ``q . k`` as
    it was, so a RoPE model's weights move from one channel layout to another: timm's to vitrel's
    (:func:`rope_channel_order`), ``rope2d_axial``'s columns-first to rows-first
    (:func:`half_swap_order`). Returns a new tensor."""
    d = order.numel()
    idx = torch.arange(w.shape[0])
    starts = [h * d for h in range(heads + (heads if kv_heads is None else kv_heads))]  # (q's heads, then k's)
    for base in starts:
        idx[base : base + d] = base + order
    return w[idx]


def _axial_attentions(model: nn.Module) -> list[tuple[Attention, PositionScheme]]:
    """Every attention layer rotating with ``rope2d_axial`` and its scheme (its own, or its model's / stage's
    shared ``rel_pos``)."""
    out = []
    for m in model.modules():
        shared = getattr(m, "rel_pos", None)
        if isinstance(shared, PositionScheme) and shared.name == "rope2d_axial":
            out += [(b.attn, shared) for b in getattr(m, "blocks", ())]
        if isinstance(m, Attention) and m.pos is not None and m.pos.name == "rope2d_axial":
            out.append((m, m.pos))
    return out


def swap_rope_axial_halves(model: nn.Module) -> nn.Module:
    """Convert, in place, a model (or one :class:`~vitrel.layers.Attention`) holding weights trained with
    ``rope2d_axial`` in its columns-first layout: the two halves of each head's query and key channels are swapped in
    every ``qkv`` rotating with ``rope2d_axial`` (and its ``qk_norm``), and a ``cayley`` STRING basis with them (module
    docstring).
    Returns ``model``. Raises if no layer of ``model`` rotates with ``rope2d_axial``. Applied twice it undoes itself.
    """
    found = _axial_attentions(model)
    if not found:
        raise ValueError(f"{type(model).__name__} has no attention layer rotating with rope2d_axial: nothing to swap")
    schemes = {id(s): s for _, s in found}
    old = [s for s in schemes.values() if getattr(s, "order", "rows_first") != "rows_first"]
    if old:
        raise ValueError(
            "this model's rope2d_axial already rotates columns first (order='columns_first', as a checkpoint written "
            "before vitrel_format 5 loads): its weights fit it as they are"
        )
    with torch.no_grad():
        for attn, _ in found:
            order = half_swap_order(attn.head_dim)
            for p in (attn.qkv.weight, attn.qkv.bias):
                if p is not None:
                    p.copy_(permute_qk(p, order, attn.num_heads, attn.num_kv_heads))
            if attn.q_bias is not None:  # (qkv_bias="qv": q's bias moves, the key's is zero)
                attn.q_bias.copy_(attn.q_bias.view(attn.num_heads, -1)[:, order].flatten())
            for norm in (attn.q_norm, attn.k_norm):  # (qk_norm's channels move with q's and k's)
                for p in (norm.weight, norm.bias) if norm is not None else ():
                    p.copy_(p[order])
        for s in schemes.values():
            if getattr(s, "basis_kind", "identity") == "cayley":
                order = half_swap_order(s.head_dim)
                s.string.copy_(s.string[:, order][:, :, order])
    return model


def rope_channel_order(t: nn.Module) -> Tensor | None:
    """For a timm RoPE ViT, the channel of timm's head dimension behind each of vitrel's (None: the same).

    vitrel rotates interleaved pairs ``(2u, 2u+1)``, the row angles first (``u < d/4``), then the
    columns; timm lays its angles out by ``grid_indexing`` ('ij': rows first, 'xy': columns first) and
    rotates pairs ``(t, t + d/2)`` when ``rotate_half``, else ``(2t, 2t+1)``. Permuting the channels
    of q and k alike (per head) leaves every ``q . k`` unchanged, so the permuted weights compute the
    same function under vitrel's layout.
    """
    rope = getattr(t, "rope", None)
    if rope is None or getattr(t, "rope_mixed", False):
        return None
    d = t.blocks[0].attn.head_dim
    q = d // 4
    rows_first = rope.grid_indexing == "ij"
    order = []
    for u in range(d // 2):
        row, f = u < q, u % q
        pair = (0 if row == rows_first else q) + f  # timm's pair with the same axis and frequency
        order += [pair, pair + d // 2] if rope.rotate_half else [2 * pair, 2 * pair + 1]
    order_t = torch.tensor(order)
    return None if torch.equal(order_t, torch.arange(d)) else order_t
