"""Naive float64 references written straight from the equations (loops where it is clearer)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from vitrel.pos.schemes.shaw1d import shaw_logits, shaw_values


def coords(h: int, w: int) -> list[tuple[int, int]]:
    return [(r, c) for r in range(h) for c in range(w)]


def coords3(t: int, h: int, w: int) -> list[tuple[int, int, int]]:
    """A video's tubelets t-major, as the layout defines them: ``index = (t * H + h) * W + w``."""
    return [(a, b, c) for a in range(t) for b in range(h) for c in range(w)]


def dense_bias(fn, heads: int, h: int, w: int, prefix: int) -> Tensor:
    """``[heads, N, N]`` with ``fn(head, (ri, ci), (rj, cj))`` between patches and 0 for prefix tokens."""
    return dense_bias_at(fn, heads, coords(h, w), prefix)


def dense_bias_at(fn, heads: int, pts: list[tuple[int, ...]], prefix: int) -> Tensor:
    """:func:`dense_bias` over the patches at ``pts`` (in token order), e.g. a video's :func:`coords3`."""
    n = prefix + len(pts)
    out = torch.zeros(heads, n, n, dtype=torch.float64)
    for hd in range(heads):
        for a, pi in enumerate(pts):
            for b, pj in enumerate(pts):
                out[hd, prefix + a, prefix + b] = fn(hd, pi, pj)
    return out


def reference_attention(attn, x: Tensor, bias: Tensor | None, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Dense multi-head attention with the module's own weights: returns (logits, output).

    ``A = q k^T / sqrt(d) + bias + mask``, ``out = proj(softmax(A) v)``.
    """
    b, n, c = x.shape
    hds, d = attn.num_heads, attn.head_dim
    qkv = x @ attn.qkv.weight.t() + (attn.qkv.bias if attn.qkv.bias is not None else 0)
    qkv = qkv.reshape(b, n, 3, hds, d).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    logits = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(d)
    if bias is not None:
        logits = logits + bias
    if mask is not None:
        logits = logits + mask
    a = torch.softmax(logits, dim=-1)
    out = torch.einsum("bhij,bhjd->bhid", a, v).transpose(1, 2).reshape(b, n, c)
    return logits, out @ attn.proj.weight.t() + attn.proj.bias


def scheme_qkv(attn, x: Tensor, grid=None, state=None) -> tuple[Tensor, Tensor, Tensor]:
    """What the layer ``attn`` attends with, from public pieces only: ``q, k, v [B, heads, N, d]`` projected by
    ``attn.qkv``, then ``q, k`` rotated (``scheme.rotate``) and given the token channels (``scheme.augment``, for
    schemes with ``has_token_terms``) by its scheme, with ``state`` (else its scheme prepared for ``grid``)."""
    b, n, _ = x.shape
    q, k, v = attn.qkv(x).reshape(b, n, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    if state is None:
        state = attn.pos.prepare(grid, attn.num_prefix_tokens, x.device, x.dtype)
    q, k = state.scheme.rotate(q, k, state)
    if state.scheme.has_token_terms:
        q, k = state.scheme.augment(x, q, k, state)
    return q, k, v


def t5_bucket_scalar(rel: int, num_buckets: int, max_distance: int) -> int:
    """T5's bidirectional bucket of one offset ``rel = j - i``, from the paper's rule."""
    n = num_buckets // 2
    ret = n if rel > 0 else 0
    r = abs(rel)
    max_exact = n // 2
    if r < max_exact:
        return ret + r
    val = max_exact + int(math.log(r / max_exact) / math.log(max_distance / max_exact) * (n - max_exact))
    return ret + min(val, n - 1)


def t5_bucket_causal_scalar(rel: int, num_buckets: int, max_distance: int) -> int:
    """T5's one-directional (decoder) bucket of ``rel = j - i``: ``n = -min(rel, 0)``, all buckets for
    the past (T5's ``_relative_position_bucket(bidirectional=False)``)."""
    n = max(-rel, 0)
    max_exact = num_buckets // 2
    if n < max_exact:
        return n
    val = max_exact + int(math.log(n / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact))
    return min(val, num_buckets - 1)


def alibi_slopes_reference(n: int) -> list[float]:
    """ALiBi's ``get_slopes`` (Press et al.'s code; BLOOM's ``build_alibi_tensor``), written out."""

    def power_of_2(k: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(k) - 3)))
        return [start * start**i for i in range(k)]

    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + alibi_slopes_reference(2 * closest)[0::2][: n - closest]


def shaw_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    rel_k: Tensor,
    rel_v: Tensor,
    *,
    causal: bool = False,
    clip_distance: int | None = None,
    q_offset: int | None = None,
    scale: float | None = None,
    attn_mask: Tensor | None = None,
) -> Tensor:
    """Shaw attention through the skew trick (``shaw_logits`` / ``shaw_values``) for ``q [..., n_q, d]``,
    ``k, v [..., n_k, d]``, tables ``[2K+1, d]``.

    ``A_ij = (q_i . k_j + q_i . r^K[r_ij]) * scale + attn_mask_ij`` (``-inf`` for ``j > i + o`` when
    ``causal``), ``out_i = sum_j softmax_j(A)_ij (v_j + r^V[r_ij])``, ``r_ij = clip(j - i - o, -K, K)``,
    ``o = q_offset`` (default ``n_k - n_q`` if causal else 0), ``scale`` default ``d ** -0.5``.
    ``attn_mask``: optional additive float mask broadcastable to ``[..., n_q, n_k]``.
    """
    n_q, d = q.shape[-2:]
    n_k = k.shape[-2]
    if k.shape[-1] != d or v.shape[-2] != n_k:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} do not match")
    if rel_k.shape[-1] != d or rel_v.shape[-1] != v.shape[-1]:
        raise ValueError(f"tables {tuple(rel_k.shape)}, {tuple(rel_v.shape)} do not match head dims {d}, {v.shape[-1]}")
    if q_offset is None:
        q_offset = n_k - n_q if causal else 0
    if causal and q_offset < 0:
        raise ValueError(f"causal attention needs q_offset >= 0 (queries after the first key), got {q_offset}")
    if scale is None:
        scale = d**-0.5
    logits = q @ k.transpose(-2, -1) + shaw_logits(
        q, rel_k, n_k, q_offset=q_offset, causal=causal, clip_distance=clip_distance
    )
    logits = logits * scale
    if attn_mask is not None:
        logits = logits + attn_mask.to(logits.dtype)
    if causal:
        future = torch.arange(n_k, device=q.device)[None, :] > torch.arange(n_q, device=q.device)[:, None] + q_offset
        logits = logits.masked_fill(future, float("-inf"))
    attn = logits.softmax(dim=-1)
    return attn @ v + shaw_values(attn, rel_v, q_offset=q_offset, causal=causal, clip_distance=clip_distance)


def _heads_attend(q: Tensor, k: Tensor, v: Tensor, heads: int) -> Tensor:
    """Softmax attention per head of ``q [m, C]`` to ``k, v [n, C]`` (heads of ``C / heads`` channels), concatenated."""
    out = []
    for h in range(heads):
        s = slice(h * q.shape[1] // heads, (h + 1) * q.shape[1] // heads)
        a = (q[:, s] @ k[:, s].T / math.sqrt(s.stop - s.start)).softmax(-1)
        out.append(a @ v[:, s])
    return torch.cat(out, dim=1)


def naive_attentive_pool(ap, x: Tensor) -> Tensor:
    """V-JEPA 2's attentive pool (``ap``: :class:`~vitrel.layers.AttentivePool`) of one image's tokens ``x [n, C]``,
    from their equations: each self-attention block ``x + proj(attn(LN1 x))``, ``x + mlp(LN2 x)``; then the query
    ``q + attn(q, LN1 x)`` (no output projection) and ``q + mlp(LN2 q)`` -> ``[C]``."""
    heads = ap.num_heads
    for b in ap.blocks:
        q, k, v = b.attn.qkv(b.norm1(x)).chunk(3, dim=-1)
        x = x + b.attn.proj(_heads_attend(q, k, v, heads))
        x = x + b.mlp(b.norm2(x))
    c, q = ap.cross_attention_block, ap.query_tokens[0]
    k, v = c.xattn.kv(c.norm1(x)).chunk(2, dim=-1)
    q = q + _heads_attend(c.xattn.q(q), k, v, heads)
    return (q + c.mlp(c.norm2(q)))[0]


def autocast_param_errors(attn, grid: tuple[int, int], dtype: torch.dtype = torch.float16) -> dict[str, float]:
    """Each scheme parameter's gradient of ``<attn(x), g>`` under CPU autocast in ``dtype``, against the same layer in
    float64: ``|grad - grad64| / |grad64|`` by name (one random ``x`` with a prefix token; the caller seeds)."""
    import copy

    a64 = copy.deepcopy(attn).double()
    x = torch.randn(2, 1 + grid[0] * grid[1], attn.qkv.in_features)
    g = torch.randn(*x.shape, dtype=torch.float64)
    (a64(x.double(), grid) * g).sum().backward()
    with torch.autocast("cpu", dtype=dtype):
        out = attn(x, grid)
    (out.double() * g).sum().backward()
    ref = dict(a64.pos.named_parameters())
    return {
        n: ((p.grad.double() - ref[n].grad).norm() / ref[n].grad.norm()).item() for n, p in attn.pos.named_parameters()
    }


def naive_pool(m, tokens: Tensor) -> Tensor:
    """One image's patch tokens ``[n, C]`` pooled as timm's ViT head with ``m.global_pool`` (``max``: the max,
    ``avgmax``: half the sum of mean and max, ``map``: ``m.attn_pool``'s latent query attending to them, written out)
    -> ``[C]``."""
    if m.global_pool == "max":
        return tokens.amax(0)
    if m.global_pool == "avgmax":
        return 0.5 * (tokens.mean(0) + tokens.amax(0))
    assert m.global_pool == "map", m.global_pool
    ap = m.attn_pool
    if hasattr(ap, "cross_attention_block"):
        return naive_attentive_pool(ap, tokens)
    heads, d = ap.num_heads, tokens.shape[1] // ap.num_heads
    q = ap.q(ap.latent[0]).view(heads, 1, d)  # one latent query
    k, v = ap.kv(tokens).view(-1, 2, heads, d).permute(1, 2, 0, 3)  # [heads, n, d] each
    att = (q @ k.transpose(-1, -2) / math.sqrt(d)).softmax(-1)
    y = ap.proj((att @ v).reshape(1, heads * d))
    return (y + ap.mlp(ap.norm(y)))[0]
