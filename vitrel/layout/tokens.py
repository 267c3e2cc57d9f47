"""Token layouts: position from token coordinates, for packed, padded and token-dropped sequences.

A full ``H x W`` grid per batch (prefix tokens, then the patches in raster order) is the fast special case every
scheme computes directly. The general case is a :class:`TokenLayout`: each row of ``[B, N]`` tokens holds one or
more images (NaViT's packing), each token knows the image it belongs to (``segment``), its patch's ``(row, col)`` in
that image and that image's grid; tokens of an image may be any subset of its grid (token dropping) in any order,
and rows may end in padding.

Every scheme gets the layout's terms **exactly as each image gets them alone at its own size**, with no change to
the scheme: the state is prepared once per distinct image grid (``PositionScheme.prepare``, what a forward on that
grid computes) and each token reads its own image's state at its index in that image's full sequence
(:func:`gather_tokens` for per-token tensors: RoPE's cos/sin, a folded bias's factors, absolute embeddings;
:func:`gather_pairs` for per-pair tensors: the bias). Tokens of different images never attend to each other: the
:func:`segment_mask` (a block-diagonal float mask for SDPA and the eager path; a document mask in FlexAttention's
``BlockMask``, where whole blocks across images are skipped). Padding tokens attend to padding only, so their rows
stay finite and no valid token reads them.

A mask gives a foreign key weight 0, but ``0 * NaN`` is NaN (and ``inf - inf`` too): a masked-off key or value
that is not finite still poisons every query of its row. So the model's entrance zeroes the padding patches
(:func:`~vitrel.models.naflex.parse_naflex`), and attention on a layout first runs :func:`isolate_images`: an image
whose queries, keys or values hold a non-finite number has them replaced by zeros before any kernel reads them (so
no other image of its row can read them), and its output is set to NaN afterwards (:func:`poison`), as that image
alone would give. Images with finite values are untouched: the kernels compute exactly what they computed before.

Index convention: a token's ``index`` is its position in its image's own sequence as the full-grid path lays it
out: prefix token ``k`` -> ``k``; patch ``(r, c)`` of an ``h x w`` image -> ``P + r * w + c``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from vitrel.device_cache import per_device
from vitrel.layout.geometry import Grid

__all__ = ["TokenLayout", "gather_tokens", "gather_pairs", "segment_mask", "stack_tables", "isolate_images", "poison"]


class TokenLayout(NamedTuple):
    """Where each token of a ``[B, N]`` batch sits: its image and its place in that image.

    * ``segment [B, N]`` (long): the 0-based index of the token's image within its row; ``-1`` for padding.
    * ``coords [B, N, 2]`` (long): ``(row, col)`` of a patch token in its image; ``-1`` for prefix and padding tokens.
    * ``index [B, N]`` (long): the token's index in its image's full sequence (see the module docstring); 0 for padding.
    * ``group [B, N]`` (long): the token's image grid, as an index into ``grids``; 0 for padding.
    * ``grids``: the distinct image grids of the batch.
    * ``image [B, N]`` (long): the token's image in the whole batch (row-major over rows and segments); -1 for padding.
    * ``image_grids``: the grid of each image of the batch, in that order.
    * ``num_prefix_tokens``: class / register tokens at the start of every image.
    """

    segment: Tensor
    coords: Tensor
    index: Tensor
    group: Tensor
    grids: tuple[Grid, ...]
    image: Tensor
    image_grids: tuple[Grid, ...]
    num_prefix_tokens: int

    @property
    def num_tokens(self) -> int:
        return self.segment.shape[1]

    @property
    def num_images(self) -> int:
        return len(self.image_grids)

    @property
    def valid(self) -> Tensor:
        """``[B, N]`` bool: the token belongs to an image (not padding)."""
        return self.segment >= 0

    @property
    def is_patch(self) -> Tensor:
        """``[B, N]`` bool: a patch token (not a prefix token, not padding)."""
        return self.coords[..., 0] >= 0

    def to(self, device: torch.device | str | None) -> TokenLayout:
        move = {k: getattr(self, k).to(device) for k in ("segment", "coords", "index", "group", "image")}
        return self._replace(**move)

    @classmethod
    def build(
        cls, segment: Tensor, coords: Tensor, image: Tensor, image_grids: Sequence[Grid], num_prefix_tokens: int
    ) -> TokenLayout:
        """The layout of tokens with ``segment [B, N]`` (-1: padding), ``coords [B, N, 2]`` (``(row, col)``; a prefix
        token has ``(-1, k)`` for prefix slot ``k``), ``image [B, N]`` (the token's image in the batch, -1 for padding)
        and each image's grid. Checked by the callers (:mod:`vitrel.models.naflex`); this only derives indices."""
        image_grids = tuple(Grid(int(h), int(w)) for h, w in image_grids)
        grids = tuple(dict.fromkeys(image_grids))
        p = num_prefix_tokens
        valid = segment >= 0
        img = image.clamp(min=0)
        hw = torch.tensor([tuple(g) for g in image_grids] or [(1, 1)], dtype=torch.long, device=segment.device)
        gid = torch.tensor([grids.index(g) for g in image_grids] or [0], dtype=torch.long, device=segment.device)
        w_img = hw[img, 1]
        r, c = coords[..., 0], coords[..., 1]
        prefix = r < 0
        index = torch.where(prefix, c, p + r * w_img + c)
        index = torch.where(valid, index, torch.zeros_like(index))
        group = torch.where(valid, gid[img], torch.zeros_like(index))
        coords = torch.where((valid & ~prefix)[..., None], coords, torch.full_like(coords, -1))
        image = torch.where(valid, image, torch.full_like(image, -1))
        return cls(segment, coords, index, group, grids, image, image_grids, p)

    @classmethod
    def from_grid(cls, grid: Grid, num_prefix_tokens: int, batch: int = 1, device=None) -> TokenLayout:
        """The layout of the full-grid case: ``batch`` rows, one ``grid`` image each (tests, references)."""
        n = grid.h * grid.w
        p = torch.arange(n, device=device)
        rc = torch.stack([p // grid.w, p % grid.w], -1)
        slots = torch.arange(num_prefix_tokens, device=device)
        pre = torch.stack([torch.full_like(slots, -1), slots], -1)
        coords = torch.cat([pre, rc]).expand(batch, -1, -1)
        segment = torch.zeros(batch, n + num_prefix_tokens, dtype=torch.long, device=device)
        image = torch.arange(batch, device=device)[:, None].expand_as(segment)
        return cls.build(segment, coords, image, [grid] * batch, num_prefix_tokens)

    @classmethod
    def packed(cls, image_grids: Sequence[Grid], num_prefix_tokens: int = 0, device=None) -> TokenLayout:
        """One row holding the images one after another, each in its full sequence order (prefix tokens, then the
        patches in raster order), no padding: the layout of the Swin's maps of images of different sizes, where
        image ``i``'s tokens are the ``i``-th slice of :attr:`image_sizes`."""
        p = num_prefix_tokens
        parts = [cls.from_grid(Grid(*g), p, 1, device) for g in image_grids]
        coords = torch.cat([t.coords for t in parts], 1)
        coords[:, :, 1] = torch.where(coords[:, :, 0] < 0, torch.cat([t.index for t in parts], 1), coords[:, :, 1])
        image = torch.cat([torch.full_like(t.segment, i) for i, t in enumerate(parts)], 1)
        return cls.build(image, coords, image, image_grids, p)

    @classmethod
    def windows(cls, regions: Tensor, window: Grid, num_regions: int) -> TokenLayout:
        """The layout of a batch of windows (Swin's): row ``w`` is window ``w``, the full sequence of the ``window``
        grid (raster order, no prefix), split into the regions ``regions [nW, n]`` (ids in ``[0, num_regions)``; a
        shifted window's parts from different sides of the map's seam, and its padding). Each region is an image of
        the window's grid with the other regions' tokens dropped (image ``w * num_regions + id``; an id a window does
        not hold is an image with no token), so a token attends to its own region only, at the offsets it has in the
        map. A batch of ``k nW`` windows (``k`` maps) reads row ``b mod nW``. Device work only (no host sync); the
        kernels that read a window's regions natively (``Kernel.window_layouts``) take ``segment``, the others the
        float mask :func:`segment_mask` lowers it to."""
        nw, n = regions.shape
        coords, index, group, first = _window_tokens(nw, window.h, window.w, num_regions, regions.device)
        images = (Grid(*window),) * (nw * num_regions)
        return cls(regions, coords, index, group, (Grid(*window),), first + regions, images, 0)

    @property
    def image_sizes(self) -> list[int]:
        """Tokens of each image's full sequence (``P + h w``), in image order."""
        return [self.num_prefix_tokens + g.h * g.w for g in self.image_grids]


@per_device(maxsize=32)
def _window_tokens(nw: int, wh: int, ww: int, num_regions: int, device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """What :meth:`TokenLayout.windows` reads of ``nw`` windows of ``wh x ww`` tokens besides their regions: the
    tokens' coordinates ``[nW, n, 2]``, indices and groups ``[nW, n]``, and each window's first image id ``[nW, 1]``
    (made once per arguments: every shifted Swin block asks for them at every call)."""
    t = torch.arange(wh * ww, device=device)
    coords = torch.stack([t // ww, t % ww], -1).expand(nw, wh * ww, 2)
    first = torch.arange(nw, device=device)[:, None] * num_regions
    return coords, t.expand(nw, wh * ww), torch.zeros(nw, wh * ww, dtype=torch.long, device=device), first


def gather_tokens(per_grid: Sequence[Tensor], layout: TokenLayout, axis: int = -2) -> Tensor:
    """Per-token tensors, one per distinct grid (``per_grid[g]`` has its image's ``P + h w`` tokens on ``axis``, e.g.
    RoPE's ``cos [N, d]`` or ``[heads, N, d]``) -> one tensor for the layout's tokens, shaped to broadcast against
    ``[B, heads, N, ...]``: ``[B, 1 | heads, N, ...]`` (a batch axis in front; a head axis of 1 when there was none).
    Padding tokens read their image-0 token 0."""
    nmax = max(t.shape[axis] for t in per_grid)
    moved = [torch.movedim(t, axis, 0) for t in per_grid]  # [n_g, *lead, *rest]
    stack = torch.stack([F.pad(t, (0, 0) * (t.dim() - 1) + (0, nmax - t.shape[0])) for t in moved])
    flat = stack.flatten(0, 1)  # [G * nmax, ...]
    out = flat[(layout.group * nmax + layout.index)]  # [B, N, *lead, *rest]
    lead = (axis % per_grid[0].dim()) if axis < 0 else axis
    if lead == 0:
        return out[:, None]  # [B, 1, N, ...]
    return torch.movedim(out, 1, 1 + lead)  # [B, *lead, N, ...]


def gather_pairs(per_grid: Sequence[Tensor], layout: TokenLayout) -> Tensor:
    """Per-pair terms, one ``[heads, n_g, n_g]`` per distinct grid (a scheme's bias for that image alone) -> the
    layout's ``[B, heads, N, N]``: ``out[b, h, i, j] = T_{g_i}[h, index_i, index_j]``. Pairs across images read
    something (``segment_mask`` masks them)."""
    nmax = max(t.shape[-1] for t in per_grid)
    stack = torch.stack([F.pad(t, (0, nmax - t.shape[-1], 0, nmax - t.shape[-2])) for t in per_grid])
    heads = stack.shape[1]
    flat = stack.transpose(0, 1).reshape(heads, -1)  # [heads, G * nmax * nmax]
    row = layout.group * nmax + layout.index  # [B, N]
    idx = row[:, :, None] * nmax + layout.index[:, None, :]  # [B, N, N]
    return flat[:, idx].transpose(0, 1)  # [B, heads, N, N]


def segment_mask(layout: TokenLayout, dtype: torch.dtype) -> Tensor:
    """``[B, 1, N, N]`` float: 0 where query and key belong to the same image (padding: to padding), ``-inf``
    elsewhere: the block-diagonal mask of a packed batch."""
    same = layout.segment[:, :, None] == layout.segment[:, None, :]
    return torch.zeros(same.shape, dtype=dtype, device=same.device).masked_fill(~same, float("-inf"))[:, None]


def isolate_images(layout: TokenLayout, *tensors: Tensor) -> tuple[list[Tensor], Tensor]:
    """Tensors ``[B, heads, N, d]`` of the layout's tokens (queries, keys, values) with every token of a *poisoned*
    image (one of its tokens holds a non-finite number in any of them) replaced by zeros, and that ``[B, 1, N, 1]``
    mask of the poisoned images' tokens (each row's padding counts as one more image). No host sync: the flags are
    reduced per (row, segment) on the device. The kernels' masks then keep every image to itself whatever the
    others held; :func:`poison` marks the poisoned images' outputs."""
    b, n = layout.segment.shape
    bad = torch.zeros(b, n, dtype=torch.bool, device=tensors[0].device)
    for t in tensors:
        bad = bad | ~torch.isfinite(t).all(dim=-1).all(dim=1)
    slot = (layout.segment + 1).to(bad.device)  # 0: padding, 1 + s: the row's image s
    per_image = torch.zeros(b, n + 1, dtype=torch.uint8, device=bad.device).scatter_reduce(
        1, slot, bad.to(torch.uint8), "amax"
    )
    bad = per_image.gather(1, slot).bool()[:, None, :, None]
    return [t.masked_fill(bad, 0) for t in tensors], bad


def poison(out: Tensor, bad: Tensor) -> Tensor:
    """``out [B, heads, N, d]`` with the tokens of the images :func:`isolate_images` found poisoned set to NaN."""
    return out.masked_fill(bad, float("nan"))


def stack_tables(per_grid: Sequence[Tensor]) -> tuple[Tensor, Grid]:
    """Offset tables ``[heads, 2h-1, 2w-1]`` of each distinct grid -> ``[G, heads, 2H-1, 2W-1]`` centred in the
    largest extent ``(H, W)`` (offset ``d`` at ``d + H - 1``), and that extent."""
    hmax = max((t.shape[-2] + 1) // 2 for t in per_grid)
    wmax = max((t.shape[-1] + 1) // 2 for t in per_grid)
    out = []
    for t in per_grid:
        dh, dw = hmax - (t.shape[-2] + 1) // 2, wmax - (t.shape[-1] + 1) // 2
        out.append(F.pad(t, (dw, dw, dh, dh)))
    return torch.stack(out), Grid(hmax, wmax)


def valid_of(layout: TokenLayout, like: Tensor) -> Tensor:
    """``layout.valid`` as a ``[B, N, 1, 1]`` multiplier of ``like``'s dtype."""
    return layout.valid[:, :, None, None].to(like.dtype)
