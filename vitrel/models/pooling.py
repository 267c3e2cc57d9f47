"""timm's ViT pools on every input form vitrel's ViTs take: one grid of images, a token layout (lists of images,
NaFlex dicts, packed rows) and timm's NaFlexVit ``patch_valid`` form.

The pools reduce an image's patch tokens (``"avg"``, ``"max"``, ``"avgmax"``, ``"map"``: timm's
``AttentionPoolLatent``) or take its class token (``"token"``). With ``include_prefix`` (timm's
``pool_include_prefix``; timm's EVA attention pool, the Perception Encoder's) the reductions take the image's prefix
tokens (class, registers) with its patches.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from vitrel.layout.tokens import TokenLayout

__all__ = ["pool_tokens", "image_rows", "pool_images", "pool_valid"]

REDUCTIONS = ("avg", "max", "avgmax", "map")


def pool_tokens(x: Tensor, how: str, valid: Tensor | None = None, attn_pool: nn.Module | None = None) -> Tensor:
    """timm's reductions of tokens ``x [B, N, C]`` (``valid [B, N]``: the tokens to pool, as timm's
    ``global_pool_naflex``; None: all) -> ``[B, C]``: ``"avg"`` their mean, ``"max"`` their max (a token not valid
    never wins), ``"avgmax"`` half the sum of the two, ``"map"`` ``attn_pool`` (timm's ``AttentionPoolLatent``) with
    its latent query attending to the valid tokens only (timm's NaFlexVit mask)."""
    if how == "map":
        if attn_pool is None:
            raise ValueError("global_pool='map' pools with the model's attn_pool, which it has not")
        if valid is None:
            return attn_pool(x)
        mask = torch.zeros(valid.shape, dtype=x.dtype, device=x.device).masked_fill(~valid, torch.finfo(x.dtype).min)
        return attn_pool(x, attn_mask=mask[:, None, None, :])  # [B, 1 head, 1 query, N keys]
    if how not in REDUCTIONS:
        raise ValueError(f"pooling tokens is 'avg', 'max', 'avgmax' or 'map', got {how!r}")
    if valid is None:
        avg, top = x.mean(dim=1), x.amax(dim=1)
    else:
        w = valid.to(x.dtype)[..., None]
        avg = (x * w).sum(1) / w.sum(1).clamp(min=1)
        top = torch.where(valid[..., None], x, torch.finfo(x.dtype).min).amax(dim=1)
    return avg if how == "avg" else top if how == "max" else 0.5 * (avg + top)


def image_rows(x: Tensor, layout: TokenLayout, include_prefix: bool = False) -> tuple[Tensor, Tensor]:
    """Each image's own patch tokens of ``x [B, N, C]`` on ``layout`` (``include_prefix``: its prefix tokens first),
    one row per image: ``[num_images, L, C]`` at their place in the image's sequence (``L``: the most patches of any
    image's grid, plus the prefix) and ``[num_images, L]`` (bool, a slot holds a token). Shapes of the layout's grids
    alone (one graph under compile); exact (each slot receives one token, or none: zeros)."""
    p = layout.num_prefix_tokens
    n = max(g.h * g.w for g in layout.image_grids) + (p if include_prefix else 0)
    take = (layout.valid if include_prefix else layout.is_patch).flatten()
    spare = layout.num_images * n  # where the other tokens go (exact zeros, dropped)
    at = layout.index.flatten() - (0 if include_prefix else p)  # (the prefix at 0 .. P - 1, the patches after)
    slot = torch.where(take, layout.image.flatten() * n + at, spare)
    feats = torch.where(take[:, None], x.flatten(0, 1), 0)
    rows = x.new_zeros(spare + 1, x.shape[-1]).index_add_(0, slot, feats)[:-1]
    valid = x.new_zeros(spare + 1).index_add_(0, slot, take.to(x.dtype))[:-1] > 0
    return rows.view(layout.num_images, n, -1), valid.view(layout.num_images, n)


def pool_images(
    x: Tensor, layout: TokenLayout, how: str, attn_pool: nn.Module | None = None, include_prefix: bool = False
) -> Tensor:
    """One row per image (``[num_images, C]``, row-major over rows and segments) from tokens ``x [B, N, C]``:
    ``"token"`` its class token (prefix slot 0), ``"avg"`` the mean of its patch tokens, ``"max"`` / ``"avgmax"`` /
    ``"map"`` (:func:`pool_tokens`) of its own patch tokens only (:func:`image_rows`); ``include_prefix``: the
    reductions take its prefix tokens too."""
    # shapes of the layout's sizes alone (no boolean indexing, whose size is the data's): one graph under compile
    if how == "token":
        cls = (layout.valid & ~layout.is_patch & (layout.index == 0)).flatten()
        at = torch.argsort((~cls).to(torch.int8), stable=True)[: layout.num_images]  # row-major order = image order
        return x.flatten(0, 1)[at]
    if how == "avg" and not include_prefix:
        patch = layout.is_patch.flatten()
        image = torch.where(patch, layout.image.flatten(), 0)
        feats = torch.where(patch[:, None], x.flatten(0, 1), 0)  # other tokens add exact zeros
        out = x.new_zeros(layout.num_images, x.shape[-1]).index_add_(0, image, feats)
        count = x.new_zeros(layout.num_images).index_add_(0, image, patch.to(x.dtype)).clamp(min=1)
        return out / count[:, None]
    if how in REDUCTIONS:
        rows, valid = image_rows(x, layout, include_prefix)
        return pool_tokens(rows, how, valid, attn_pool)
    raise ValueError(f"pooling per image is 'token', 'avg', 'max', 'avgmax' or 'map', got {how!r}")


def pool_valid(
    x: Tensor,
    patch_valid: Tensor,
    how: str,
    num_prefix_tokens: int,
    attn_pool: nn.Module | None = None,
    include_prefix: bool = False,
) -> Tensor:
    """timm's NaFlexVit pooling (``global_pool_naflex``, ``attn_pool`` with its mask) for vitrel's pools: tokens
    ``x [B, P + N, C]`` with ``patch_valid [B, N]`` (the patch slots holding a patch) -> ``[B, C]``: ``"token"`` the
    class token, ``"avg"`` / ``"max"`` / ``"avgmax"`` / ``"map"`` of the valid patches (:func:`pool_tokens`; with
    ``include_prefix`` and the prefix tokens); ``""`` the tokens as they are."""
    p = num_prefix_tokens
    b, n = x.shape[0], x.shape[1] - p
    if tuple(patch_valid.shape) != (b, n):
        raise ValueError(
            f"patch_valid must be [B, N - P] = [{b}, {n}] for tokens {tuple(x.shape)} with {p} prefix token(s) (the "
            f"patch slots, as forward_features returns it), got {tuple(patch_valid.shape)}"
        )
    if how in REDUCTIONS:
        if include_prefix:
            valid = torch.cat([patch_valid.new_ones(b, p), patch_valid], dim=1)
            return pool_tokens(x, how, valid, attn_pool)
        return pool_tokens(x[:, p:], how, patch_valid, attn_pool)
    return x[:, 0] if how == "token" else x
