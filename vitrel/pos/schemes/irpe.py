"""iRPE (Wu et al., ICCV 2021, "Rethinking and Improving Relative Position Encoding for Vision Transformer"):
learned encodings of piecewise-bucketed 2-D offsets, on the queries, keys and values (``irpe``) or as a bias
(``irpe_bias``). As the authors' code computes it: microsoft/Cream, commit 12aed81, ``iRPE/DeiT-with-iRPE/irpe.py``
(buckets, tables) and ``rpe_vision_transformer.py`` (``RPEAttention.forward``: where each term enters).

Offsets ``d = p_i - p_j`` (query minus key: ``dh``, ``dw``). The piecewise index (the paper's Eq. 18) with
``alpha = ratio``, ``beta = 2 ratio``, ``gamma = 8 ratio`` and ``B = int(beta)``::

    g(x) = x                                                                       |x| <= alpha
    g(x) = sign(x) min(B, round(alpha + ln(|x| / alpha) / ln(gamma / alpha) (beta - alpha)))     otherwise

(``round`` half to even, in float32, as the authors' code computes it). The bucket ``b(i, j)`` of a pair of patches
(``method``)::

    product  (g(dh) + B) (2B + 1) + g(dw) + B        (2B + 1)^2 buckets   (the authors' released default)
    euc      g(round(sqrt(dh^2 + dw^2))) + B         2B + 1
    quant    g(dh^2 + dw^2) + B                      2B + 1
    cross    rows g(dh) + B and columns g(dw) + B, a table each, their terms summed

Built with prefix tokens (class, registers), every pair that has one takes one more bucket, learned (the authors'
``skip``); built without, such pairs get zero terms, as in every vitrel scheme.
Per head, ``r`` the encodings (one table for all heads unless ``shared_head: false``)::

    irpe       A_ij  = (q_i . k_j + q_i . r^K[b(i, j)] + k_j . r^Q[b(j, i)]) / sqrt(d)
               out_i = sum_j a_ij (v_j + r^V[b(i, j)])                          (rpe_on: letters of qkv)
    irpe_bias  A_ij  = q_i . k_j / sqrt(d) + t^K[b(i, j)] + t^Q[b(j, i)]         (rpe_on: k, q)

The tables start at zero, as the authors' (``init_std``: a truncated normal instead). They are the authors'
parameters, under their names and shapes (``rpe_k.lookup_table_weight [heads | 1, head_dim, buckets]``, ``rpe_v``'s
``[heads | 1, buckets, head_dim]``, ``lookup_table_bias [heads | 1, buckets]``; cross: ``rpe_k.rp_rows.*``,
``rpe_k.rp_cols.*``). The bucket count is fixed by ``ratio``: any grid runs, far offsets sharing the last buckets.
The attention is the eager one (``attn_impl`` ``shaw``, what ``auto`` picks, or ``eager``), an ``N x N`` gather per
head: the authors' path without their CUDA op.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitrel.device_cache import per_device
from vitrel.layout.geometry import Grid, rel_offsets
from vitrel.pos.base import PositionScheme, PosState
from vitrel.pos.registry import register_pos
from vitrel.pos.tables import check_init_std

__all__ = ["IRPE", "IRPEBias", "Lookup", "bucket_ids", "num_buckets", "piecewise_index"]

METHODS = ("product", "euc", "quant", "cross")
#: what each mode takes in ``rpe_on`` (the authors have no bias on values: "Bias non-transposed RPE does not exist")
ON = {"contextual": "qkv", "bias": "qk"}


def piecewise_index(x: Tensor, alpha: float, beta: float, gamma: float) -> Tensor:
    """The piecewise index ``g(x)`` of integer-valued ``x`` (any shape; the module docstring), long."""
    a = x.abs().to(torch.float32)
    far = alpha + torch.log(a.clamp(min=alpha) / alpha) / math.log(gamma / alpha) * (beta - alpha)
    far = torch.sign(x) * far.round().clamp(max=int(beta))
    return torch.where(a <= alpha, x.to(torch.float32).round(), far).long()


def num_buckets(method: str, ratio: float, prefix: bool) -> int:
    """The buckets of one table: ``(2B + 1)^2`` for ``product``, else ``2B + 1`` (per axis for ``cross``), one more
    for the pairs with a prefix token."""
    side = 2 * int(2 * ratio) + 1
    return (side * side if method == "product" else side) + int(prefix)


@per_device(maxsize=32)
def bucket_ids(method: str, ratio: float, h: int, w: int, num_prefix_tokens: int, device) -> Tensor:
    """``b [N, N]`` (long) of ``method`` (``product``, ``euc``, ``quant``, ``rows``, ``cols``) on an ``H x W`` grid
    behind ``num_prefix_tokens`` prefix tokens: their pairs in the extra last bucket (made once per arguments)."""
    alpha, beta, gamma = ratio, 2 * ratio, 8 * ratio
    big = int(beta)
    dh, dw = rel_offsets(Grid(h, w), device)
    if method == "product":
        ids = (piecewise_index(dh, alpha, beta, gamma) + big) * (2 * big + 1) + piecewise_index(dw, alpha, beta, gamma)
    elif method == "euc":
        ids = piecewise_index((dh * dh + dw * dw).to(torch.float32).sqrt().round(), alpha, beta, gamma)
    elif method == "quant":
        ids = piecewise_index(dh * dh + dw * dw, alpha, beta, gamma)
    else:
        ids = piecewise_index(dh if method == "rows" else dw, alpha, beta, gamma)
    ids = ids + big
    p = num_prefix_tokens
    if p:
        ids = F.pad(ids, (p, 0, p, 0), value=num_buckets(method, ratio, False))
    return ids


class Lookup(nn.Module):
    """One table of encodings, by bucket (the authors' ``iRPE``): ``lookup_table_weight [heads, head_dim, buckets]``
    for a term on queries or keys, ``[heads, buckets, head_dim]`` on values, ``lookup_table_bias [heads, buckets]``
    for a bias (``heads`` 1 when shared)."""

    def __init__(
        self, method: str, ratio: float, heads: int, head_dim: int, mode: str, values: bool, prefix: bool, std
    ) -> None:
        super().__init__()
        self.method, self.ratio = method, ratio
        self.prefix = prefix  # the tables hold a bucket for the prefix tokens' pairs
        nb = num_buckets(method, ratio, prefix)
        shape = (heads, nb) if mode == "bias" else (heads, nb, head_dim) if values else (heads, head_dim, nb)
        table = nn.Parameter(torch.zeros(shape))
        if std is not None:
            nn.init.trunc_normal_(table, std=std)
        setattr(self, "lookup_table_bias" if mode == "bias" else "lookup_table_weight", table)

    def ids(self, grid: Grid, p: int, device: torch.device) -> Tensor:
        return bucket_ids(self.method, self.ratio, grid.h, grid.w, p, device)

    def _table(self, table: Tensor, p: int, axis: int) -> Tensor:
        """``table``, with a zero bucket on ``axis`` (-1 or -2) for the prefix pairs where it has none (built without
        prefix tokens, called with them: zero terms for their pairs, as every vitrel scheme's)."""
        if not p or self.prefix:
            return table
        return F.pad(table, (0, 1) if axis == -1 else (0, 0, 0, 1))

    def logits(self, x: Tensor, grid: Grid, p: int) -> Tensor:
        """``[B, heads, N, N]``: ``x_i . r[b(i, j)]`` (``x`` the queries, or the keys for the term on queries)."""
        lookup = x @ self._table(self.lookup_table_weight, p, -1).to(x.dtype)  # [B, heads, N, buckets]
        ids = self.ids(grid, p, x.device)
        return lookup.gather(-1, ids.expand(*lookup.shape[:-1], ids.shape[-1]))

    def values(self, attn: Tensor, grid: Grid, p: int) -> Tensor:
        """``[B, heads, N, head_dim]``: ``sum_j a_ij r[b(i, j)]``, the attention summed per bucket, times the table."""
        table = self._table(self.lookup_table_weight, p, -2).to(attn.dtype)
        ids = self.ids(grid, p, attn.device)
        per_bucket = attn.new_zeros(*attn.shape[:-1], table.shape[-2])
        per_bucket = per_bucket.scatter_add(-1, ids.expand_as(attn), attn)
        return per_bucket @ table

    def bias(self, grid: Grid, p: int) -> Tensor:
        """``[heads, N, N]``: ``t[b(i, j)]``."""
        ids = self.ids(grid, p, self.lookup_table_bias.device)
        return self._table(self.lookup_table_bias, p, -1)[:, ids]


class Cross(nn.Module):
    """The ``cross`` method: a table for the rows' buckets and one for the columns', their terms summed (the authors'
    ``iRPE_Cross``)."""

    def __init__(self, ratio: float, *args) -> None:
        super().__init__()
        self.rp_rows = Lookup("rows", ratio, *args)
        self.rp_cols = Lookup("cols", ratio, *args)

    def logits(self, x: Tensor, grid: Grid, p: int) -> Tensor:
        return self.rp_rows.logits(x, grid, p) + self.rp_cols.logits(x, grid, p)

    def values(self, attn: Tensor, grid: Grid, p: int) -> Tensor:
        return self.rp_rows.values(attn, grid, p) + self.rp_cols.values(attn, grid, p)

    def bias(self, grid: Grid, p: int) -> Tensor:
        return self.rp_rows.bias(grid, p) + self.rp_cols.bias(grid, p)


class _IRPEBase(PositionScheme):
    mode = "contextual"
    no_weight_decay_keys = ("lookup_table",)

    def __init__(
        self,
        *,
        method: str = "product",
        ratio: float = 1.9,
        rpe_on: str = "k",
        shared_head: bool = True,
        init_std: float | None = None,
        **kw,
    ) -> None:
        super().__init__(**kw)
        if method not in METHODS:
            raise ValueError(f"{self.name}: method must be one of {', '.join(METHODS)}, got {method!r}")
        if not ratio >= 1.0:  # (beta = 2 ratio >= 2: at least the offsets -2..2 apart; the authors' are 1.9 to 33)
            raise ValueError(f"{self.name}: ratio must be >= 1 (alpha = ratio, beta = 2 ratio), got {ratio}")
        on = str(rpe_on)
        takes = ON[self.mode]
        if not on or any(c not in takes for c in on) or len(set(on)) != len(on):
            more = " (the authors' bias mode has no term on values: use pos=irpe)" if "v" in on else ""
            raise ValueError(f"{self.name}: rpe_on must be letters of {takes!r}, each once, got {on!r}{more}")
        std = None if init_std is None else check_init_std(self.name, init_std)
        self.method, self.ratio, self.rpe_on, self.shared_head = method, float(ratio), on, bool(shared_head)
        heads = 1 if shared_head else self.num_heads
        prefix = self.num_prefix_tokens > 0
        for t in on:
            args = (heads, self.head_dim, self.mode, t == "v", prefix, std)
            table = Cross(self.ratio, *args) if method == "cross" else Lookup(method, self.ratio, *args)
            setattr(self, f"rpe_{t}", table)

    def extra_repr(self) -> str:
        opts = f"method={self.method}, ratio={self.ratio}, rpe_on={self.rpe_on}, shared_head={self.shared_head}"
        return f"{super().extra_repr()}, {opts}"


@register_pos("irpe")
class IRPE(_IRPEBase):
    """iRPE's contextual mode: encodings on the queries, keys and values named by ``rpe_on`` (the module docstring)."""

    family = "content"
    has_content_terms = True

    @property
    def content_terms(self) -> frozenset[str]:
        hooks = {"k": "content_logits", "q": "content_key_logits", "v": "content_values"}
        return frozenset(hooks[t] for t in self.rpe_on)

    def content_logits(self, q: Tensor, state: PosState) -> Tensor | None:
        """Unscaled ``q_i . r^K[b(i, j)]`` (``rpe_on`` with ``k``)."""
        if "k" not in self.rpe_on:
            return None
        return self.rpe_k.logits(q, state.grid, state.num_prefix_tokens)

    def content_key_logits(self, k: Tensor, state: PosState) -> Tensor | None:
        """Unscaled ``k_j . r^Q[b(j, i)]`` at ``(i, j)`` (``rpe_on`` with ``q``)."""
        if "q" not in self.rpe_on:
            return None
        return self.rpe_q.logits(k, state.grid, state.num_prefix_tokens).transpose(-2, -1)

    def content_values(self, attn: Tensor, state: PosState) -> Tensor | None:
        """``sum_j a_ij r^V[b(i, j)]`` (``rpe_on`` with ``v``)."""
        if "v" not in self.rpe_on:
            return None
        return self.rpe_v.values(attn, state.grid, state.num_prefix_tokens)


@register_pos("irpe_bias")
class IRPEBias(_IRPEBase):
    """iRPE's bias mode: ``t^K[b(i, j)] + t^Q[b(j, i)]`` added to the scaled logits (``rpe_on``: ``k``, ``q``)."""

    mode = "bias"
    family = "learned bias"
    has_bias = True

    def bias(self, grid: Grid, num_prefix_tokens: int = 0) -> Tensor:
        out = self.rpe_k.bias(grid, num_prefix_tokens) if "k" in self.rpe_on else 0
        if "q" in self.rpe_on:
            out = out + self.rpe_q.bias(grid, num_prefix_tokens).transpose(-2, -1)
        return out
