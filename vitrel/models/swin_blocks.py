"""The Swin's layers: the (shifted-)window block, the patch embedding and merging of its maps, and a stage.

A layer runs on a batch of maps ``[B, H, W, C]`` of one grid, or on the maps of images of different sizes packed
into one row of tokens ``[1, T, C]`` (each image's map in raster order, one image after another) with their
:class:`~vitrel.layout.tokens.TokenLayout` (:meth:`~vitrel.layout.tokens.TokenLayout.packed`, made once at the model's
entrance): the layout type the ViT's packed tokens and the attention kernels read. Norms and MLPs then run once on
all tokens, windows and patch merging per image on its own grid (:func:`image_maps`), stochastic depth per image
(:func:`per_image`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from timm.layers import register_notrace_function
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from vitrel.kernels import check_choice
from vitrel.layers.attention import SHARED
from vitrel.layout.geometry import Grid, as_grid
from vitrel.layout.tokens import TokenLayout
from vitrel.layout.windows import (
    floor_mod,
    mixed_states,
    stage_window,
    symbolic_map,
    unwindow,
    window_and_shift,
    window_layout,
    window_partition,
    window_positions,
    window_regions,
)
from vitrel.models.blocks import (
    Block,
    BlockImpls,
    PatchEmbed,
    add_abs_pos,
    check_shared,
    drops_weights,
    patch_grid,
    prepare_state,
    prepare_states,
    whole_cells,
)
from vitrel.models.input_size import check_img_size
from vitrel.pos.base import PositionScheme, PosState
from vitrel.pos.cache import NonPersistentBuffers
from vitrel.pos.registry import PosArg, parse_pos

__all__ = [
    "SwinBlock",
    "SwinStage",
    "PatchMerging",
    "MapPatchEmbed",
    "merge_2x2",
    "map_grid",
    "image_maps",
    "pack_maps",
    "per_image",
    "window_attention",
    "mixed_window_attention",
    "stage_state",
    "stage_states",
]


# ---------------------------------------------------------------------------- packed maps
def image_maps(x: Tensor, layout: TokenLayout) -> list[Tensor]:
    """Tokens ``[1, T, C]`` of a packed layout (:meth:`TokenLayout.packed`, no prefix) -> each image's map
    ``[1, h, w, C]`` (views)."""
    chunks = x[0].split(layout.image_sizes)
    return [c.view(1, g.h, g.w, c.shape[-1]) for c, g in zip(chunks, layout.image_grids)]


def pack_maps(maps: Sequence[Tensor]) -> tuple[Tensor, TokenLayout]:
    """Maps ``[1, h_i, w_i, C]`` (one image each) -> their tokens packed ``[1, T, C]`` and that packed layout."""
    grids = [Grid(m.shape[1], m.shape[2]) for m in maps]
    return torch.cat([m.reshape(-1, m.shape[-1]) for m in maps])[None], TokenLayout.packed(grids, 0, maps[0].device)


def per_image(fn: Callable[[Tensor], Tensor], y: Tensor, layout: TokenLayout | None) -> Tensor:
    """``fn`` (a per-sample op such as ``DropPath``) on ``y``: a batch of maps as it is; packed tokens ``[1, T, C]``
    image by image as batches of one (``DropPath`` draws once per image), in one call when ``fn`` is the identity or
    in eval mode."""
    if layout is None or isinstance(fn, nn.Identity) or not getattr(fn, "training", True):
        return fn(y)
    return torch.cat([fn(c[None])[0] for c in y[0].split(layout.image_sizes)])[None]


# ---------------------------------------------------------------------------- window attention
# The window logic of a forward pass: recorded by torch.fx as single calls (it branches on sizes);
# torch.export / torch.compile trace through it. With symbolic sizes the windows take the form
# that is the same program at every size (see :func:`_any_size_window_attention`).
@register_notrace_function
def window_attention(block: SwinBlock, x: Tensor, pos_state: PosState) -> Tensor:
    """``block``'s (shifted-)window attention on the normalised map ``x [B, H, W, C]`` -> ``[B, H, W, C]``."""
    if symbolic_map(x):
        return _any_size_window_attention(block, x, pos_state)
    windows, grid, win, shift, layout = block.windows(x)
    return unwindow(block.attn(windows, mask=layout, pos_state=pos_state), grid, win, shift)


def mixed_window_attention(block: SwinBlock, maps: Sequence[Tensor], states: dict[Grid, PosState]) -> Tensor:
    """``block``'s (shifted-)window attention on the normalised maps ``[1, h_i, w_i, C]`` of images of different sizes
    -> their tokens packed ``[1, T, C]`` (each image's map in raster order, one image after another).

    Each image is windowed on its own grid exactly as alone (``block.windows``: its window, shift, padding and the
    windows' layout); the windows of all images with the same window grid (all of them unless a window shrinks to a
    small image's grid) go through the attention as one batch, on one layout of those windows (each window keeps its
    regions); then each image's windows are put back on its grid (:func:`unwindow`). ``states``: the block's scheme
    state per window grid (:func:`mixed_states`)."""
    parts = [block.windows(m) for m in maps]  # (windows, grid, win, shift, layout) per image
    groups: dict[Grid, list[int]] = {}
    for i, part in enumerate(parts):
        groups.setdefault(Grid(*part[2]), []).append(i)
    out: dict[int, Tensor] = {}
    for win, idx in groups.items():
        windows = torch.cat([parts[i][0] for i in idx])
        layouts = [parts[i][4] for i in idx]
        layout = None
        if any(lay is not None for lay in layouts):  # images without regions: one region (0) per window
            n = windows.shape[1]
            regions = [
                windows.new_zeros(parts[i][0].shape[0], n, dtype=torch.long) if lay is None else lay.segment
                for i, lay in zip(idx, layouts)
            ]
            layout = window_layout(torch.cat(regions), win)
        res = block.attn(windows, mask=layout, pos_state=states[win])
        for i, r in zip(idx, res.split([parts[i][0].shape[0] for i in idx])):
            _, grid, _, shift, _ = parts[i]
            out[i] = unwindow(r, grid, win, shift).reshape(-1, r.shape[-1])
    return torch.cat([out[i] for i in range(len(parts))])[None]


def _any_size_window_attention(block: SwinBlock, x: Tensor, pos_state: PosState) -> Tensor:
    """Window attention as one program for every map size (used when the sizes are symbolic).

    The eager rule (the window shrinks to a grid smaller than it, no shift then; :func:`window_and_shift`)
    is written without branching on sizes: the window is always ``M x M``, the map is padded to multiples
    of ``M`` and the padding is masked, and the shift (``M // 2`` where the grid exceeds the window, else 0)
    is a tensor that indexes the rows and columns instead of a ``roll``. Every token then attends to
    exactly the tokens it attends to eagerly, with the same offsets, so every scheme whose terms depend
    on the offsets (or, for RoPE, on the row and column) alone gives the eager result. A scheme whose
    terms depend on the window's extent (``PositionScheme.depends_on_extent``: raster-order 1-D
    schemes, RoPE on normalised coordinates) would not, and is refused.
    """
    st_scheme = pos_state.scheme
    if st_scheme.depends_on_extent:
        raise NotImplementedError(
            f"{st_scheme.name} depends on the window's extent, which Swin shrinks to a smaller grid (timm's "
            "rule); an exported Swin with this scheme cannot serve every resolution: export with static "
            "height and width (dynamic batch works). See docs/export.md."
        )
    b, h, w, c = x.shape
    (wh, ww), dev = block.window_size, x.device
    nh, nw = (h + wh - 1) // wh, (w + ww - 1) // ww  # windows per axis, the map padded to nh wh x nw ww
    hp, wp = nh * wh, nw * ww
    if block.shifted:  # M // 2 where the grid exceeds the window, else 0
        sh = torch.where(torch.scalar_tensor(h, dtype=torch.long, device=dev) > wh, wh // 2, 0)
        sw = torch.where(torch.scalar_tensor(w, dtype=torch.long, device=dev) > ww, ww // 2, 0)
    else:
        sh = sw = torch.zeros((), dtype=torch.long, device=dev)
    # every (window, slot) in window order [nh, nw, wh, ww]: rolled-map row / column ...
    rr = torch.arange(nh, device=dev)[:, None, None, None] * wh + torch.arange(wh, device=dev)[None, None, :, None]
    rc = torch.arange(nw, device=dev)[None, :, None, None] * ww + torch.arange(ww, device=dev)[None, None, None, :]
    # ... and the row / column of the padded map it shows (the roll by -shift, as an index)
    ir, ic = floor_mod(rr + sh, hp), floor_mod(rc + sw, wp)
    x = F.pad(x, (0, 0, 0, wp - w, 0, hp - h)).flatten(1, 2)
    windows = x.index_select(1, (ir * wp + ic).reshape(-1)).view(b * nh * nw, wh * ww, c)
    # labels as shifted_window_mask: 2 padding, 1 wrapped around, 0 otherwise; -inf between labels that differ
    lab_r = torch.where(ir >= h, 2, (rr >= hp - sh).long())
    lab_c = torch.where(ic >= w, 2, (rc >= wp - sw).long())
    lab = (lab_r * 3 + lab_c).reshape(nh * nw, wh * ww)
    mask = torch.zeros((), device=dev).masked_fill(lab[:, :, None] != lab[:, None, :], float("-inf"))
    out = block.attn(windows, mask=mask, pos_state=pos_state)  # [B nW, n, C]
    # image position (r, c) sits at rolled (r - shift) mod hp: gather the H x W positions back
    r2 = floor_mod(torch.arange(h, device=dev) - sh, hp)
    c2 = floor_mod(torch.arange(w, device=dev) - sw, wp)
    slot = ((r2 // wh)[:, None] * nw + (c2 // ww)[None, :]) * (wh * ww) + (r2 % wh)[:, None] * ww + (c2 % ww)[None, :]
    return out.reshape(b, nh * nw * wh * ww, c).index_select(1, slot.reshape(-1)).view(b, h, w, c)


@register_notrace_function
def stage_state(
    scheme: PositionScheme, x: Tensor, window: tuple[int, int], impl: str = "auto", dropout: bool = False
) -> PosState:
    """A stage's shared scheme state for the windows of the map ``x [B, H, W, C]``, for the kernel of ``attn_impl``
    ``impl`` (``dropout``: the attention drops weights)."""
    return prepare_state(scheme, stage_window(x, window), 0, x, impl, dropout)


@register_notrace_function
def stage_states(
    schemes: list[PositionScheme], x: Tensor, window: tuple[int, int], impls: list[str], dropout: bool = False
) -> list[PosState]:
    """The states of a stage's blocks' own schemes for the windows of the map ``x``, ``impls[i]`` block ``i``'s
    ``attn_impl``, prepared together (``prepare_states``: RoPE-Mixed computes every block's cos/sin in one product)."""
    return prepare_states(schemes, stage_window(x, window), 0, x, impls, dropout)


# ---------------------------------------------------------------------------- modules
class SwinBlock(NonPersistentBuffers, Block):
    """(Shifted-)window attention block: :class:`~vitrel.models.blocks.Block` (pre-norm attention and MLP, layer
    scale, stochastic depth; its ``forward(x, grid, mask, pos_state)``) with the attention inside the windows
    (``kwargs``: the block's other arguments, ``mlp_ratio``, ``qkv_bias``, ``init_values``, ``proj_drop``,
    ``attn_drop``, ``drop_path``, ``layer``, ``attn_impl``).

    ``window_regions`` (a non-persistent buffer ``[nW, n]``, None when not needed) holds the region ids of the
    windows of the grid the block is built for (:func:`~vitrel.layout.windows.window_regions`; remade by
    ``init_non_persistent_buffers()``, see :class:`~vitrel.pos.cache.NonPersistentBuffers`); another grid computes
    them in the forward pass.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        window_size: tuple[int, int],
        shifted: bool,
        pos: PosArg = "rel2d_full",
        build_grid: tuple[int, int] = (7, 7),
        norm_eps: float = 1e-5,
        **kwargs: Any,
    ) -> None:
        build_grid = as_grid(build_grid)
        win, _ = window_and_shift(build_grid, window_size, shifted)
        super().__init__(dim, num_heads, pos=pos, grid=win, num_prefix_tokens=0, norm_eps=norm_eps, **kwargs)
        self.window_size = window_size
        self.shifted = shifted
        self.build_grid = build_grid
        self.init_non_persistent_buffers()

    def _init_buffers(self) -> None:
        """``window_regions``: the region ids of the built grid's windows (None when nothing needs masking)."""
        like = self._like("window_regions")
        win, shift = window_and_shift(self.build_grid, self.window_size, self.shifted)
        regions = window_regions(self.build_grid, win, shift, like.get("device"))
        self.register_buffer("window_regions", regions, persistent=False)

    def windows(self, x: Tensor) -> tuple[Tensor, Grid, tuple[int, int], tuple[int, int], TokenLayout | None]:
        """The block's windows of a normalised map ``x [B, H, W, C]``: (windows ``[B nW, n, C]`` of the map padded to
        multiples of the window and rolled by ``-shift``, the map's grid, the window, the shift, the windows'
        :class:`~vitrel.layout.tokens.TokenLayout` (:meth:`~vitrel.layout.tokens.TokenLayout.windows`, their regions:
        the attention's mask) or None where nothing is masked); :func:`~vitrel.layout.windows.unwindow` puts
        them back."""
        _, h, w, _ = x.shape
        grid = Grid(h, w)
        win, shift = window_and_shift(grid, self.window_size, self.shifted)
        ph, pw = (-h) % win[0], (-w) % win[1]
        if ph or pw:
            x = F.pad(x, (0, 0, 0, pw, 0, ph))
        if any(shift):
            x = torch.roll(x, shifts=(-shift[0], -shift[1]), dims=(1, 2))
        if grid == self.build_grid:
            regions = self.window_regions
        else:
            regions = window_regions(grid, win, shift, x.device)
        return window_partition(x, win), grid, win, shift, window_layout(regions, win)

    def _state(self, x: Tensor, layout: TokenLayout | None, pos_state: Any) -> Any:
        """``pos_state`` (what the stage passes), or this block's own scheme prepared for the windows of ``x``: one
        state, or on packed maps one per window grid (each prepared as for one image alone)."""
        if pos_state is not None:
            return pos_state
        if layout is not None:
            return mixed_states(functools.partial(self._state, layout=None, pos_state=None), image_maps(x, layout),
                                self.window_size)  # fmt: skip
        if self.attn.pos is None:
            raise ValueError("this block uses its stage's shared scheme: pass pos_state=stage.position_state(x)")
        return stage_state(self.attn.pos, x, self.window_size, self.attn.attn_impl, self.attn.drops_weights)

    def forward(self, x: Tensor, grid: Any = None, mask: Tensor | None = None, pos_state: Any = None) -> Tensor:
        """``Block.forward``: ``x + DP(ls1(W-MSA(LN x))) ; x + DP(ls2(MLP(LN x)))`` (``post_norm``: ``LN(W-MSA x)``,
        ``LN(MLP x)``).

        ``x``: maps ``[B, H, W, C]`` (``grid`` None, or their grid), or packed maps ``[1, T, C]`` with ``grid`` their
        :class:`~vitrel.layout.tokens.TokenLayout` (:meth:`~vitrel.layout.tokens.TokenLayout.packed`). ``pos_state``:
        the state of the block's scheme for the windows of ``x``, prepared by its stage once per forward (else
        prepared here): one state, or for packed maps one per window grid (``SwinStage.position_states``). ``mask``: the
        windows make their own (shifted-window and padding) masks, so None."""
        if mask is not None:
            raise ValueError("a Swin block makes its windows' masks (shifted windows, padding): pass mask=None")
        layout = grid if isinstance(grid, TokenLayout) else None
        if grid is not None and layout is None and Grid(*grid) != map_grid(x):
            raise ValueError(f"the map {tuple(x.shape)} is not on the grid {tuple(grid)} given")
        st = self._state(x, layout, pos_state)
        xn = self.attn_input(x)
        attn = (
            window_attention(self, xn, st)
            if layout is None
            else mixed_window_attention(self, image_maps(xn, layout), st)
        )
        x = x + per_image(self.drop_path1, self.ls1(self.norm1(attn) if self.post_norm else attn), layout)
        x = x + per_image(self.drop_path2, self.ls2(self.branch(self.norm2, self.mlp, x)), layout)
        return x

    @torch.no_grad()
    def dense_attention(self, x: Tensor, pos_state: PosState | None = None) -> Tensor:
        """Attention probabilities of this block as a dense ``[B, heads, H W, H W]`` map over the
        (un-rolled, un-padded) image positions; pairs in different windows get 0."""
        b, h, w, _ = x.shape
        windows, grid, win, shift, layout = self.windows(self.attn_input(x))
        probs = self.attn.attention_map(windows, mask=layout, pos_state=self._state(x, None, pos_state))
        pos = window_positions(h, w, win, shift)  # [nW, n]
        nw, n = pos.shape
        heads = probs.shape[1]
        probs = probs.view(b, nw, heads, n, n)  # [B, nW, heads, n, n]
        dense = torch.zeros(b, heads, h * w, h * w, dtype=probs.dtype, device=probs.device)
        for k in range(nw):
            valid = pos[k] >= 0
            idx = pos[k][valid].to(probs.device)
            p = probs[:, k][:, :, valid][:, :, :, valid]
            dense[:, :, idx[:, None], idx[None, :]] = p
        return dense


class MapPatchEmbed(PatchEmbed):
    """The Swin's patch embedding: images -> the map ``[B, H', W', C]`` alone (its grid is its shape), so
    the Swin's children run one after the other (timm's ``FeatureListNet`` / ``FeatureDictNet``).

    ``img_size``: the size the model is built for (timm's); ``strict_img_size``: the only input size accepted (see
    :mod:`vitrel.models.input_size`; timm's builder reads it for ``fixed_input_size``).
    """

    pad_hint = ""  # (timm's Swin takes no dynamic_img_pad)

    def __init__(self, *args: Any, img_size: Any = None, strict_img_size: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, flatten=False, **kwargs)
        self.img_size = None if img_size is None else tuple(img_size)
        self.strict_img_size = bool(strict_img_size)

    def forward(self, x: Tensor) -> Tensor:  # type: ignore[override]
        # written here, not via super(): torch.fx wraps the notrace functions a module's own forward calls
        if self.strict_img_size:
            check_img_size(x, self.img_size)
        grid = patch_grid(x, self.patch_size[0], self.proj.in_channels)  # the layout / size checks
        return self.norm(self.proj(whole_cells(x, grid, self.patch_size)).permute(0, 2, 3, 1))


@register_notrace_function
def map_grid(x: Tensor) -> Grid:
    """The grid of a map ``[B, H, W, C]``."""
    return Grid(x.shape[1], x.shape[2])


class PatchMerging(nn.Module):
    """2x2 neighbouring patches -> one: ``[B, H, W, C] -> LN -> Linear(4C, out)`` (odd sides padded); ``post_norm``:
    ``Linear(4C, out) -> LN`` (Swin V2's)."""

    def __init__(self, dim: int, out_dim: int | None = None, norm_eps: float = 1e-5, post_norm: bool = False) -> None:
        super().__init__()
        self.dim = dim
        self.out_dim = out_dim or 2 * dim
        self.post_norm = post_norm
        self.norm = nn.LayerNorm(self.out_dim if post_norm else 4 * dim, eps=norm_eps)
        self.reduction = nn.Linear(4 * dim, self.out_dim, bias=False)

    def forward(self, x: Tensor, layout: TokenLayout | None = None) -> Tensor:
        """Maps ``[B, H, W, C]`` -> ``[B, ceil(H/2), ceil(W/2), out]``; packed maps ``[1, T, C]`` on ``layout`` -> the
        merged maps packed on :meth:`merged_layout` (each image merged on its own grid, one LN + Linear on all)."""
        merged = merge_2x2(x) if layout is None else pack_maps([merge_2x2(m) for m in image_maps(x, layout)])[0]
        return self.norm(self.reduction(merged)) if self.post_norm else self.reduction(self.norm(merged))

    @staticmethod
    def merged_layout(layout: TokenLayout) -> TokenLayout:
        """The packed layout of the merged maps of images on ``layout``."""
        return TokenLayout.packed([Grid((g.h + 1) // 2, (g.w + 1) // 2) for g in layout.image_grids], 0,
                                  layout.segment.device)  # fmt: skip


@register_notrace_function
def merge_2x2(x: Tensor) -> Tensor:
    """``[B, H, W, C]`` -> ``[B, ceil(H/2), ceil(W/2), 4C]`` (odd sides zero-padded), timm's channel order."""
    b, h, w, c = x.shape
    x = F.pad(x, (0, 0, 0, w % 2, 0, h % 2))
    h, w = x.shape[1], x.shape[2]
    return x.reshape(b, h // 2, 2, w // 2, 2, c).permute(0, 1, 3, 4, 2, 5).flatten(3)


class SwinStage(BlockImpls, nn.Module):
    """Optional patch merging, then ``depth`` blocks alternating plain and shifted windows; ``abs_pos``: an absolute
    scheme placed after a block (CPE's ``after_block``), the stage's own at its width, added to that block's output
    (Twins' PEG after the first block of every stage).

    ``block_cls``, ``merge_cls`` and ``window_and_shift`` are the window geometry's (the Video Swin's stage sets its
    3-D ones)."""

    block_cls: type[nn.Module] = SwinBlock
    merge_cls: type[nn.Module] = PatchMerging
    window_and_shift = staticmethod(window_and_shift)

    def __init__(
        self,
        dim: int,
        out_dim: int,
        depth: int,
        num_heads: int,
        window_size: tuple[int, int],
        build_grid: Grid,
        downsample: bool,
        pos: PosArg = "rel2d_full",
        abs_pos: PosArg = None,
        pos_share: bool = False,
        mlp_ratio: float = 4.0,
        qkv_bias: bool | str = True,
        proj_drop: float = 0.0,
        attn_drop: float = 0.0,
        drop_path: Sequence[float] = (),
        norm_eps: float = 1e-5,
        layers: tuple[int, int] | None = None,
        attn_impl: str = "auto",
        post_norm: bool = False,
        cosine_attn: bool = False,
    ) -> None:
        super().__init__()
        absolute = parse_pos(abs_pos)
        self.abs_pos = (
            absolute.build(num_heads=num_heads, head_dim=out_dim // num_heads, grid=build_grid, embed_dim=out_dim)
            if absolute is not None
            else None
        )
        after = None if self.abs_pos is None else self.abs_pos.after_block
        if self.abs_pos is not None and (after is None or after >= depth):
            raise ValueError(
                f"a Swin stage adds {self.abs_pos.name} after one of its blocks (after_block={after}): give an index "
                f"below its {depth} blocks (every stage's depth), or None for the model's input"
            )
        self.grad_checkpointing = False
        self._attn_impl = attn_impl
        self.merges = downsample
        self.downsample = self.merge_cls(dim, out_dim, norm_eps, post_norm) if downsample else nn.Identity()
        if not downsample and dim != out_dim:
            raise ValueError(f"a stage without downsampling keeps its width, got {dim} -> {out_dim}")
        self.build_grid = build_grid
        self.window_size = window_size
        win, _ = self.window_and_shift(build_grid, window_size, False)
        pos = parse_pos(pos)
        make_pos = functools.partial(pos.build, num_heads=num_heads, head_dim=out_dim // num_heads, grid=win)
        self.rel_pos = make_pos() if pos_share else None
        check_shared(self.rel_pos)
        check_choice(attn_impl, self.rel_pos)  # (the blocks check their own schemes)
        self.blocks = nn.ModuleList(
            [
                self.block_cls(
                    out_dim,
                    num_heads,
                    window_size,
                    shifted=i % 2 == 1,
                    pos=SHARED if pos_share else make_pos(layer=None if layers is None else (layers[0] + i, layers[1])),
                    build_grid=build_grid,
                    mlp_ratio=mlp_ratio,
                    qkv_bias=qkv_bias,
                    proj_drop=proj_drop,
                    attn_drop=attn_drop,
                    drop_path=drop_path[i] if len(drop_path) else 0.0,
                    norm_eps=norm_eps,
                    attn_impl=attn_impl,
                    post_norm=post_norm,
                    cosine_attn=cosine_attn,
                )
                for i in range(depth)
            ]
        )

    def position_state(self, x: Tensor) -> PosState | None:
        """The shared scheme's state for the windows of the map ``x [B, H, W, C]`` (None without ``pos_share``)."""
        if self.rel_pos is None:
            return None
        return stage_state(self.rel_pos, x, self.window_size, self.attn_impl, drops_weights(self.blocks))

    def position_states(
        self, x: Tensor, layout: TokenLayout | None = None
    ) -> list[PosState] | list[dict[Grid, PosState]]:
        """Each block's state for the windows of the maps ``x [B, H, W, C]``, once per forward: the shared
        scheme's for every block, or the blocks' own schemes prepared together. Packed maps ``[1, T, C]`` on
        ``layout``: each block's states per window grid, each prepared as for one image alone."""
        if layout is not None:
            per_window = mixed_states(self.position_states, image_maps(x, layout), self.window_size)
            return [{win: states[i] for win, states in per_window.items()} for i in range(len(self.blocks))]
        st = self.position_state(x)
        if st is not None:
            return [st] * len(self.blocks)
        schemes = [blk.attn.pos for blk in self.blocks]
        impls = [blk.attn.attn_impl for blk in self.blocks]  # (one set on a built layer honoured)
        return stage_states(schemes, x, self.window_size, impls, drops_weights(self.blocks))

    def output_layout(self, layout: TokenLayout | None) -> TokenLayout | None:
        """The layout of this stage's output for packed maps on ``layout`` (None: a batch of maps)."""
        return PatchMerging.merged_layout(layout) if layout is not None and self.merges else layout

    def forward(self, x: Tensor, layout: TokenLayout | None = None) -> Tensor:
        """Maps ``[B, H, W, C]`` -> the stage's maps; packed maps ``[1, T, C]`` on ``layout`` -> packed on
        :meth:`output_layout`."""
        if self.merges:
            x = self.downsample(x, layout)
        layout = self.output_layout(layout)
        states = self.position_states(x, layout)  # once per forward, handed to the blocks
        ckpt = self.grad_checkpointing and torch.is_grad_enabled() and not torch.jit.is_scripting()
        after = None if self.abs_pos is None else self.abs_pos.after_block
        for i, blk in enumerate(self.blocks):
            st = states[i]
            x = checkpoint(blk, x, layout, None, st, use_reentrant=False) if ckpt else blk(x, layout, pos_state=st)
            if i == after:
                x = add_abs_pos(self.abs_pos, x, map_grid(x) if layout is None else layout, 0)
        return x
