"""Video Swin Transformer (Liu et al., 2022) with any position scheme.

A clip ``[B, C, T, H, W]`` is cut into ``tubelet_size x patch_size x patch_size`` tubelets (Video Swin-T: 2 x 4 x 4),
giving the map ``[B, T', H', W', C]``; four stages, each but the first starting with a 2 x 2 patch merging in space
(frames kept: ``[B, T, H, W, C] -> [B, T, H/2, W/2, 2C]``), then blocks attending inside ``Wt x Wh x Ww`` windows,
every second block on windows shifted by half a window along each axis (a cyclic roll, masked)::

    x <- x + DropPath(3D W-MSA(LN x))   or   3D SW-MSA (shifted windows, masked)
    x <- x + DropPath(MLP(LN x))

The windows, their shift and mask are :mod:`vitrel.layout.windows3d` (the authors' ``get_window_size`` and
``compute_mask``, padding masked out as in vitrel's 2-D Swin). The position scheme sees the window's grid
``(Wt, Wh, Ww)``: one scheme state per stage and forward, shared by its windows (and by its blocks with
``pos_share=True``). Any clip size runs: a window no smaller than the stage's grid shrinks to it, per axis; at
symbolic sizes (``torch.export`` with dynamic frames, height and width) the same function is one program
(:func:`any_size_window_attention3`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from timm.layers import register_notrace_function, to_2tuple
from torch import Tensor, nn

from vitrel.layers.validate import check_swin_args
from vitrel.layout.geometry import Grid3
from vitrel.layout.windows import floor_mod
from vitrel.layout.windows3d import Window3, unwindow3, window_and_shift3, windows3
from vitrel.models.backbone import SwinBody
from vitrel.models.blocks import (
    Block,
    TubeletEmbed,
    add_abs_pos,
    constructor_config,
    drops_weights,
    prepare_state,
    prepare_states,
    with_placement,
)
from vitrel.models.input_size import set_clip_input_size
from vitrel.models.swin_blocks import PatchMerging, SwinStage
from vitrel.models.timm_surface import TimmSurface
from vitrel.models.video_features import CLIP_GETTER_ONLY, ClipFeatureGetterNet
from vitrel.pos.base import PosState
from vitrel.pos.registry import PosArg, parse_pos, split_pos

__all__ = ["SwinTransformer3D", "Swin3DBlock", "Swin3DStage", "SpacePatchMerging"]


def _triple(name: str, value: int | Sequence[int]) -> Window3:
    sides = (value,) * 3 if isinstance(value, int) else tuple(int(v) for v in value)
    if len(sides) != 3 or min(sides) < 1:
        raise ValueError(f"{name} must be an int or (t, h, w) of positive ints, got {value!r}")
    return sides  # type: ignore[return-value]


@register_notrace_function
def map_grid3(x: Tensor) -> Grid3:
    """The grid of a map ``[B, T, H, W, C]``."""
    return Grid3(x.shape[1], x.shape[2], x.shape[3])


def symbolic_map3(x: Tensor) -> bool:
    """The map's frames, height or width is symbolic (``torch.export`` / ``torch.compile`` with dynamic sizes)."""
    return not all(isinstance(s, int) for s in x.shape[1:4])


@register_notrace_function
def window_grid3(x: Tensor, window: Window3) -> Grid3:
    """The window grid of the map ``x [B, T, H, W, C]``: the window, shrunk per axis to a smaller side; the full window
    when the sizes are symbolic (:func:`any_size_window_attention3`)."""
    if symbolic_map3(x):
        return Grid3(*window)
    return Grid3(*window_and_shift3(map_grid3(x), window, False)[0])


def _on_axis(v: Tensor, axis: int) -> Tensor:
    """``v [n, m]`` (window, slot of one axis) viewed on the window order ``[nT, nH, nW, Wt, Wh, Ww]``."""
    shape = [1] * 6
    shape[axis], shape[3 + axis] = v.shape
    return v.view(shape)


def any_size_window_attention3(block: Swin3DBlock, x: Tensor, pos_state: PosState) -> Tensor:
    """``block``'s (shifted-)window attention on ``x [B, T, H, W, C]`` as one program for every clip size (used when
    the sizes are symbolic): the 2-D Swin's ``_any_size_window_attention`` on three axes.

    The eager rule (per axis, the window shrinks to a smaller side and that axis is not shifted) is written without
    branching on sizes: the window is always ``Wt x Wh x Ww``, the map is padded to multiples of it and the padding
    masked, and the shift (``W // 2`` where the side exceeds the window, else 0) is a tensor that indexes the map
    instead of a ``roll``. Every token attends to the tokens it attends to eagerly, with the same offsets, so a scheme
    whose terms depend on the offsets alone gives the eager result; one that depends on the window's extent
    (``PositionScheme.depends_on_extent``) would not, and is refused."""
    scheme = pos_state.scheme
    if scheme.depends_on_extent:
        raise NotImplementedError(
            f"{scheme.name} depends on the window's extent, which the Video Swin shrinks to a smaller grid: an "
            "exported Video Swin with this scheme cannot serve every clip size: export with dynamic='batch' or "
            "'static'. See docs/export.md."
        )
    b, c, dev = x.shape[0], x.shape[-1], x.device
    sides, win = x.shape[1:4], block.window_size
    counts = [(g + m - 1) // m for g, m in zip(sides, win)]  # windows per axis, the map padded to counts * win
    padded = [k * m for k, m in zip(counts, win)]
    zero = torch.zeros((), dtype=torch.long, device=dev)
    shifts = [
        torch.where(torch.scalar_tensor(g, dtype=torch.long, device=dev) > m, m // 2, 0) if block.shifted else zero
        for g, m in zip(sides, win)
    ]
    src, labels = [], []  # per axis [windows, slots]: the padded map's index each slot shows, and its label
    for g, m, k, p, s in zip(sides, win, counts, padded, shifts):
        rolled = torch.arange(p, device=dev)
        shown = floor_mod(rolled + s, p)  # the roll by -shift, as an index
        src.append(shown.view(k, m))  # labels as window_regions3: 2 padding, 1 wrapped around, 0 otherwise
        labels.append(torch.where(shown >= g, 2, (rolled >= p - s).long()).view(k, m))
    flat = (_on_axis(src[0], 0) * padded[1] + _on_axis(src[1], 1)) * padded[2] + _on_axis(src[2], 2)
    lab = (_on_axis(labels[0], 0) * 3 + _on_axis(labels[1], 1)) * 3 + _on_axis(labels[2], 2)
    n_win, n = counts[0] * counts[1] * counts[2], win[0] * win[1] * win[2]
    lab = lab.reshape(n_win, n)
    x = F.pad(x, (0, 0, 0, padded[2] - sides[2], 0, padded[1] - sides[1], 0, padded[0] - sides[0])).flatten(1, 3)
    windows = x.index_select(1, flat.reshape(-1)).view(b * n_win, n, c)
    mask = torch.zeros((), device=dev).masked_fill(lab[:, :, None] != lab[:, None, :], float("-inf"))
    out = block.attn(windows, mask=mask, pos_state=pos_state)  # [B nW, n, C]
    # map position g of an axis sits at rolled (g - shift) mod padded: gather the T x H x W positions back
    q = [floor_mod(torch.arange(g, device=dev) - s, p) for g, s, p in zip(sides, shifts, padded)]
    wi, si = [v // m for v, m in zip(q, win)], [v % m for v, m in zip(q, win)]
    t_, h_, w_ = (slice(None), None, None), (None, slice(None), None), (None, None, slice(None))
    window_id = (wi[0][t_] * counts[1] + wi[1][h_]) * counts[2] + wi[2][w_]
    slot = ((window_id * win[0] + si[0][t_]) * win[1] + si[1][h_]) * win[2] + si[2][w_]
    return out.reshape(b, n_win * n, c).index_select(1, slot.reshape(-1)).view(b, *sides, c)


class Swin3DBlock(Block):
    """3-D (shifted-)window attention block: :class:`~vitrel.models.blocks.Block` (pre-norm attention and MLP) with
    the attention inside the windows of the map ``[B, T, H, W, C]`` (:func:`~vitrel.layout.windows3d.windows3`)."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        window_size: Window3,
        shifted: bool,
        pos: PosArg = "rel3d_full",
        build_grid: tuple[int, int, int] = (8, 7, 7),
        norm_eps: float = 1e-5,
        **kwargs: Any,
    ) -> None:
        build_grid = Grid3(*build_grid)
        win, _ = window_and_shift3(build_grid, window_size, shifted)
        super().__init__(dim, num_heads, pos=pos, grid=win, num_prefix_tokens=0, norm_eps=norm_eps, **kwargs)
        self.window_size = window_size
        self.shifted = shifted
        self.build_grid = build_grid

    def window_attention(self, x: Tensor, pos_state: PosState) -> Tensor:
        """The (shifted-)window attention on the normalised map ``x [B, T, H, W, C]`` -> ``[B, T, H, W, C]``."""
        if symbolic_map3(x):
            return any_size_window_attention3(self, x, pos_state)
        windows, grid, win, shift, mask = self.windows(x)
        return unwindow3(self.attn(windows, mask=mask, pos_state=pos_state), grid, win, shift)

    def windows(self, x: Tensor) -> tuple[Tensor, Grid3, Window3, Window3, Tensor | None]:
        """The map ``x [B, T, H, W, C]`` in this block's (shifted) windows, as ``SwinBlock.windows``:
        :func:`~vitrel.layout.windows3d.windows3`'s windows, grid, window, shift and mask."""
        return windows3(x, self.window_size, self.shifted)

    def forward(self, x: Tensor, grid: Any = None, mask: Tensor | None = None, pos_state: Any = None) -> Tensor:
        """``Block.forward`` on the map ``x [B, T, H, W, C]`` (``grid``: None or its grid). ``pos_state``: the block's
        scheme state for the map's windows (what the stage passes; else prepared here). ``mask``: None (the windows
        make their own)."""
        if mask is not None:
            raise ValueError("a Video Swin block makes its windows' masks (shifted windows, padding): pass mask=None")
        if grid is not None and Grid3(*grid) != map_grid3(x):
            raise ValueError(f"the map {tuple(x.shape)} is not on the grid {tuple(grid)} given")
        if pos_state is None:
            if self.attn.pos is None:
                raise ValueError("this block uses its stage's shared scheme: pass pos_state=stage.position_state(x)")
            win = window_grid3(x, self.window_size)
            pos_state = prepare_state(self.attn.pos, win, 0, x, self.attn.attn_impl, self.attn.drops_weights)
        x = x + self.drop_path1(self.ls1(self.branch(self.norm1, lambda y: self.window_attention(y, pos_state), x)))
        return x + self.drop_path2(self.ls2(self.branch(self.norm2, self.mlp, x)))


class SpacePatchMerging(PatchMerging):
    """Video Swin's patch merging: the 2-D Swin's 2 x 2 merging (:class:`~vitrel.models.swin_blocks.PatchMerging`,
    same weights) on every frame, ``[B, T, H, W, C] -> [B, T, ceil(H/2), ceil(W/2), out]``."""

    def forward(self, x: Tensor, layout: None = None) -> Tensor:  # type: ignore[override]
        if layout is not None:
            raise ValueError("the Video Swin takes a batch of clips of one size (no packed layout)")
        b, t = x.shape[0], x.shape[1]
        y = super().forward(x.flatten(0, 1))
        return y.view(b, t, *y.shape[1:])


class Swin3DStage(SwinStage):
    """Optional patch merging (space only), then ``depth`` blocks alternating plain and shifted 3-D windows:
    :class:`~vitrel.models.swin_blocks.SwinStage` with the 3-D window geometry (its arguments, ``window_size`` and
    ``build_grid`` in ``(t, h, w)``), on maps ``[B, T, H, W, C]``."""

    block_cls = Swin3DBlock
    merge_cls = SpacePatchMerging
    window_and_shift = staticmethod(window_and_shift3)

    def position_state(self, x: Tensor) -> PosState | None:
        """The shared scheme's state for the windows of the map ``x [B, T, H, W, C]`` (None without ``pos_share``)."""
        if self.rel_pos is None:
            return None
        win = window_grid3(x, self.window_size)
        return prepare_state(self.rel_pos, win, 0, x, self.attn_impl, drops_weights(self.blocks))

    def position_states(self, x: Tensor, layout: None = None) -> list[PosState]:  # type: ignore[override]
        """Each block's state for the windows of the map ``x``, once per forward: the shared scheme's for every block,
        or the blocks' own schemes prepared together."""
        if layout is not None:
            raise ValueError("the Video Swin takes a batch of clips of one size (no packed layout)")
        st = self.position_state(x)
        if st is not None:
            return [st] * len(self.blocks)
        schemes = [blk.attn.pos for blk in self.blocks]
        impls = [blk.attn.attn_impl for blk in self.blocks]
        win = window_grid3(x, self.window_size)
        return prepare_states(schemes, win, 0, x, impls, drops_weights(self.blocks))


class SwinTransformer3D(SwinBody, TimmSurface, nn.Module):
    """Video Swin Transformer with a pluggable position scheme (module docstring; timm's surface:
    :class:`~vitrel.models.timm_surface.TimmSurface`).

    Args:
        img_size, num_frames: the frame size and clip length the model is built for (size window tables and
            absolute embeddings only: any clip runs).
        patch_size, tubelet_size: the tubelet's side in pixels and its length in frames (Video Swin: 4, 2).
        window_size: ``(Wt, Wh, Ww)`` in tokens (or one int for all three); Video Swin-T on Kinetics: ``(8, 7, 7)``.
        in_chans, num_classes, embed_dim, depths, num_heads, mlp_ratio, qkv_bias: as the image Swin.
        global_pool: ``"avg"`` (mean over frames and space) or ``""`` (features ``[B, T, H, W, C]`` to the head).
        pos, abs_pos, pos_share, attn_impl: as the image Swin; the scheme sees the window grid ``(Wt, Wh, Ww)``.
        drop_rate, pos_drop_rate, proj_drop_rate, attn_drop_rate, drop_path_rate, norm_eps: as the image Swin.
        device, dtype: placement (keyword-only, not part of ``vitrel_cfg``).
    """

    trunk = "layers"
    intermediate_fmts = ("NCTHW", "NTHWC")

    @with_placement
    def __init__(
        self,
        img_size: int | tuple[int, int] = 224,
        num_frames: int = 32,
        patch_size: int = 4,
        tubelet_size: int = 2,
        in_chans: int = 3,
        num_classes: int = 1000,
        global_pool: str = "avg",
        embed_dim: int = 96,
        depths: Sequence[int] = (2, 2, 6, 2),
        num_heads: Sequence[int] = (3, 6, 12, 24),
        window_size: int | Sequence[int] = (8, 7, 7),
        mlp_ratio: float = 4.0,
        qkv_bias: bool | str = True,
        pos: PosArg = "rel3d_full",
        abs_pos: PosArg = None,
        pos_share: bool = False,
        attn_impl: str = "auto",
        drop_rate: float = 0.0,
        pos_drop_rate: float = 0.0,
        proj_drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.1,
        norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        window = _triple("window_size", window_size)
        check_swin_args({**locals(), "window_size": window[1:]})  # sizes checked first, errors name the argument
        if global_pool not in ("", "avg"):
            raise ValueError(f"global_pool must be 'avg' or '', got {global_pool!r}")
        depths, num_heads = [int(d) for d in depths], [int(h) for h in num_heads]
        if len(depths) != len(num_heads) or not depths:
            raise ValueError(f"depths {depths} and num_heads {num_heads} must be non-empty and of equal length")
        pos, abs_pos = parse_pos(pos), parse_pos(abs_pos)
        img_size = to_2tuple(img_size)
        self.vitrel_cfg = constructor_config(
            SwinTransformer3D, locals(), img_size=list(img_size), window_size=list(window)
        )
        rel, absolute = split_pos(pos, abs_pos)
        n_stages = len(depths)
        dims = [int(embed_dim * 2**i) for i in range(n_stages)]
        for d, hd in zip(dims, num_heads):
            if d % hd:
                raise ValueError(f"stage width {d} is not divisible by its {hd} heads")
        self.num_classes = num_classes
        self.init_surface(in_chans, img_size, global_pool, None, None)
        self.num_frames = num_frames
        self.embed_dim = embed_dim
        self.num_features = self.head_hidden_size = dims[-1]
        self.num_prefix_tokens = 0
        self.window_size = window

        self.patch_embed = TubeletEmbed(
            patch_size, tubelet_size, in_chans, dims[0], norm_layer=lambda d: nn.LayerNorm(d, eps=norm_eps),
            flatten=False,
        )  # fmt: skip
        self.grid = self.patch_embed.grid_for(num_frames, img_size)
        self.init_stages(Swin3DStage, rel, absolute, window, dims, locals())
        for info in self.feature_info:  # timm's reduction: the stride in space; in time (no merging) beside it
            info["time_reduction"] = tubelet_size
        self.output_fmt = "NTHWC"
        self.init_weights(needs_reset=False)  # the modules initialised themselves (timm's)

    # ---------------------------------------------------------------------------- timm surface
    # ---------------------------------------------------------------------------- forward
    def embed(self, x: Tensor) -> Tensor:
        """Clips ``[B, C, T, H, W]`` -> the tubelet map ``[B, T', H', W', C]`` (with the absolute embedding, if any)."""
        x, grid = self.patch_embed(x)
        if self.abs_pos is not None:
            b, c = x.shape[0], x.shape[-1]
            x = add_abs_pos(self.abs_pos, x.reshape(b, -1, c), grid, 0).view(x.shape)
        return self.pos_drop(x)

    def set_input_size(
        self, img_size: Any = None, num_frames: int | None = None, patch_size: Any = None, window_size: Any = None
    ) -> None:
        """timm's ``set_input_size`` with clips: built now for ``img_size`` frames and ``num_frames`` per clip
        (:func:`~vitrel.models.input_size.set_clip_input_size`). The window stays, as loading at another size keeps
        it (a window larger than a stage's grid shrinks to it at each call); another ``window_size`` is a
        ``ValueError``: build the model with it."""
        if window_size is not None and list(_triple("window_size", window_size)) != list(self.window_size):
            raise ValueError(
                f"set_input_size keeps the Video Swin's window {tuple(self.window_size)}: build the model with "
                f"window_size={window_size} for another"
            )
        set_clip_input_size(self, img_size, num_frames, patch_size)

    def forward_features(self, x: Tensor) -> Tensor:
        """Clips ``[B, C, T, H, W]`` -> normalised feature map ``[B, T', H'', W'', C]`` (NTHWC)."""
        x = self.embed(x)
        for stage in self.layers:
            x = stage(x)
        return self.norm(x)

    def pool(self, x: Tensor) -> Tensor:
        return x.mean(dim=(1, 2, 3)) if self.global_pool == "avg" else x

    def forward(self, x: Tensor) -> Tensor:
        """Clips ``[B, C, T, H, W]`` -> logits ``[B, classes]``."""
        return self.forward_head(self.forward_features(x))

    # ---------------------------------------------------------------------------- intermediates (timm)
    def forward_intermediates(
        self,
        x: Tensor,
        indices: int | list[int] | None = None,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCTHW",
        intermediates_only: bool = False,
    ) -> list[Tensor] | tuple[Tensor, list[Tensor]]:
        """timm's ``forward_intermediates``: the output maps of the stages in ``indices`` (the last ``n`` for an int,
        all for None) as ``NCTHW`` (or ``NTHWC``), and the final normalised map ``[B, T, H, W, C]``. ``norm`` applies
        the final norm to the last stage's map; ``stop_early`` skips the stages after the last one asked for."""
        take, stages = self.intermediate_indices(indices, output_fmt, stop_early)
        return self.stage_intermediates(self.embed(x), take, stages, norm, output_fmt == "NCTHW", intermediates_only)

    @classmethod
    def feature_defaults(cls, args: dict[str, Any]) -> dict[str, Any]:
        """What ``vitrel.models.registry`` reads (see ``VideoVisionTransformer.feature_defaults``). timm's
        ``pool_size`` is an image map's: None here (the final map is ``[T', H'', W'']``)."""
        return dict(pool_size=None, output_fmt="NCTHW", getter=ClipFeatureGetterNet, getter_only=CLIP_GETTER_ONLY)
