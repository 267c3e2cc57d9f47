"""Swin-style windowed Vision Transformer (Liu et al., 2021) with any position scheme.

Four stages; each but the first starts with a 2x2 patch merging (``[B, H, W, C] -> [B, H/2, W/2, 2C]``),
then blocks that attend inside non-overlapping ``M x M`` windows, every second block on windows
shifted by ``M // 2`` (a cyclic roll of the map)::

    x <- x + DropPath(W-MSA(LN x))   or   SW-MSA (shifted windows, masked)
    x <- x + DropPath(MLP(LN x))

The position scheme sees the *window's* grid: one bias per window grid, shared by all windows (and by
all blocks of a stage with ``pos_share=True``: the stage owns the scheme, prepares its state once per
forward and passes it to its blocks).

The blocks, stages, patch embedding and merging are in :mod:`vitrel.models.swin_blocks`; the windows, their
shift and mask, and the window attention itself in :mod:`vitrel.layout.windows`. Images of different sizes
(a list, or a NaFlex dict of full grids) are read once at the entrance (:func:`~vitrel.models.naflex.read_input`)
and run as packed maps on a :class:`~vitrel.layout.tokens.TokenLayout`, the ViT's layout type.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
from timm.layers import to_2tuple
from torch import Tensor, nn

from vitrel.layers.validate import check_swin_args
from vitrel.layout.geometry import Grid
from vitrel.layout.tokens import TokenLayout
from vitrel.layout.windows import shifted_window_mask, window_and_shift, window_partition, window_reverse
from vitrel.models.backbone import SwinBody, warn_video_scheme
from vitrel.models.blocks import add_abs_pos, constructor_config, with_placement
from vitrel.models.input_size import check_grid_sizes, check_same_patch, rebuild_position_schemes
from vitrel.models.naflex import ModelInput, NaFlexBatch, check_images, embed_patches, read_input
from vitrel.models.swin_blocks import (
    MapPatchEmbed,
    PatchMerging,
    SwinBlock,
    SwinStage,
    image_maps,
    map_grid,
    pack_maps,
)
from vitrel.models.timm_surface import TimmSurface
from vitrel.pos.registry import PosArg, parse_pos, split_pos

__all__ = [
    "SwinTransformer",
    "MixedMaps",
    "SwinBlock",
    "SwinStage",
    "PatchMerging",
    "MapPatchEmbed",
    "window_partition",
    "window_reverse",
    "window_and_shift",
    "shifted_window_mask",
]


class MixedMaps(NamedTuple):
    """What :meth:`SwinTransformer.forward_features` gives for images of different sizes: the final maps packed,
    ``tokens [T, C]`` (each image's map in raster order, one image after another), on their packed
    :class:`~vitrel.layout.tokens.TokenLayout` (``layout.image_grids``: each image's final grid)."""

    tokens: Tensor
    layout: TokenLayout

    @property
    def grids(self) -> tuple[Grid, ...]:
        """Each image's final grid."""
        return self.layout.image_grids

    def maps(self) -> list[Tensor]:
        """Each image's map ``[1, h, w, C]`` (views of the tokens)."""
        return image_maps(self.tokens[None], self.layout)


class SwinTransformer(SwinBody, TimmSurface, nn.Module):
    """Swin Transformer with a pluggable position scheme (see the module docstring; timm's surface:
    :class:`~vitrel.models.timm_surface.TimmSurface`).

    Args:
        img_size: image size the model is built for (sizes window tables / absolute embeddings).
        patch_size, in_chans, num_classes, embed_dim, depths, num_heads, window_size, mlp_ratio,
            qkv_bias, drop_rate, proj_drop_rate, attn_drop_rate, drop_path_rate: as timm's Swin.
        global_pool: ``"avg"``, ``"max"``, ``"avgmax"`` (half the sum of the two, timm's) over the final map, or ``""``
            (features ``[B, H, W, C]`` straight to the head).
        post_norm, cosine_attn: Swin V2's blocks (Liu et al. 2022; timm's ``SwinTransformerV2``): each residual branch
            normalised after it and patch merging after its reduction (res-post-norm); scaled cosine attention
            (:class:`~vitrel.layers.attention.Attention`'s ``cosine``). With ``pos="rel2d_cpb"``, Swin V2.
        pos: position scheme (name or config) of the window attention; an absolute scheme means that
            embedding (at the input, on the patch grid) and no relative scheme.
        abs_pos: an absolute scheme added to the relative one (Swin's ``ape``).
        pos_share: one relative scheme per stage shared by its blocks (True), or one per block.
        attn_impl: attention kernel, ``auto`` or a registered one (:func:`vitrel.kernels.list_kernels`; what each
            does and when to pick it: docs/gpu.md).
        dynamic_img_size, strict_img_size: timm's input-size arguments (None: not given). The model reads the
            grid from the input, so by default any size runs; ``strict_img_size=True`` refuses inputs other
            than ``img_size`` (see :mod:`vitrel.models.input_size`).
        device, dtype: where and in what dtype the parameters are made (keyword-only; ``device="meta"``
            allocates nothing: then ``to_empty(device=...)`` and load weights). Not part of ``vitrel_cfg``.
    """

    trunk = "layers"
    intermediate_fmts = ("NCHW", "NHWC")
    global_pools = ("avg", "max", "avgmax", "")  # timm's Swin head's (less catavgmax, which doubles the features)

    @with_placement
    def __init__(
        self,
        img_size: int | tuple[int, int] = 224,
        patch_size: int = 4,
        in_chans: int = 3,
        num_classes: int = 1000,
        global_pool: str = "avg",
        embed_dim: int = 96,
        depths: Sequence[int] = (2, 2, 6, 2),
        num_heads: Sequence[int] = (3, 6, 12, 24),
        window_size: int | tuple[int, int] = 7,
        mlp_ratio: float = 4.0,
        qkv_bias: bool | str = True,
        post_norm: bool = False,
        cosine_attn: bool = False,
        pos: PosArg = "rel2d_full",
        abs_pos: PosArg = None,
        pos_share: bool = False,
        attn_impl: str = "auto",
        drop_rate: float = 0.0,
        pos_drop_rate: float = 0.0,
        proj_drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.1,
        norm_eps: float = 1e-5,
        dynamic_img_size: bool | None = None,
        strict_img_size: bool | None = None,
    ) -> None:
        super().__init__()
        check_swin_args(locals())  # sizes checked first, errors name the argument
        self.check_global_pool(global_pool)
        depths, num_heads = [int(d) for d in depths], [int(h) for h in num_heads]
        if len(depths) != len(num_heads) or not depths:
            raise ValueError(f"depths {depths} and num_heads {num_heads} must be non-empty and of equal length")
        pos, abs_pos = parse_pos(pos), parse_pos(abs_pos)  # the one parse of the position specs
        warn_video_scheme(type(self).__name__, pos=pos, abs_pos=abs_pos)  # a video scheme runs as one frame
        img_size, window = to_2tuple(img_size), to_2tuple(window_size)
        self.vitrel_cfg = constructor_config(
            SwinTransformer, locals(), img_size=list(img_size), window_size=list(window)
        )
        rel, absolute = split_pos(pos, abs_pos)
        n_stages = len(depths)
        dims = [int(embed_dim * 2**i) for i in range(n_stages)]
        for d, hd in zip(dims, num_heads):
            if d % hd:
                raise ValueError(f"stage width {d} is not divisible by its {hd} heads")
        self.num_classes = num_classes
        self.init_surface(in_chans, img_size, global_pool, dynamic_img_size, strict_img_size)
        self.embed_dim = embed_dim
        self.num_features = self.head_hidden_size = dims[-1]
        self.num_prefix_tokens = 0
        self.window_size = window

        self.patch_embed = MapPatchEmbed(
            patch_size,
            in_chans,
            dims[0],
            norm_layer=lambda d: nn.LayerNorm(d, eps=norm_eps),
            img_size=img_size,
            strict_img_size=self.strict_img_size,
        )
        self.grid = self.patch_embed.grid_for(img_size)
        self._ref_window, self._ref_grid = window, self.grid  # set_input_size scales the window from these (timm's)
        self.init_stages(SwinStage, rel, absolute, window, dims, locals())
        self.output_fmt = "NHWC"  # of forward_features, as timm's Swin
        self.init_weights(needs_reset=False)  # the modules initialised themselves (timm's)

    # ---------------------------------------------------------------------------- timm surface
    def set_input_size(
        self,
        img_size: int | tuple[int, int] | None = None,
        patch_size: Any = None,
        window_size: int | tuple[int, int] | None = None,
        window_ratio: int | None = None,
        always_partition: bool | None = None,
    ) -> None:
        """timm's ``set_input_size``: the model is now built for ``img_size`` and ``window_size``.

        Without ``window_size`` / ``window_ratio`` the window scales with the patch grid (timm's rule,
        ``max(1, window * new_grid // ref_grid)`` per side, from the window and patch grid the model was built with
        or last given a ``window_size`` / ``window_ratio``), so calling at the current size changes nothing and a
        size there and back gives the window back; ``window_ratio``: the window is the patch grid divided by it.
        Window tables and absolute embeddings are resized as loading at that size does; ``vitrel_cfg`` follows.
        vitrel's Swin has one window for all stages (a per-stage list is a ``ValueError``), cannot change the patch
        size and always shrinks the window to a smaller stage grid (``always_partition=True`` is a ``ValueError``).
        """
        check_same_patch(self, patch_size)
        if always_partition:
            raise ValueError("vitrel's Swin always shrinks the window to a smaller grid (always_partition=False)")
        if window_size is not None and not (
            isinstance(window_size, int) or (len(window_size) == 2 and all(isinstance(w, int) for w in window_size))
        ):
            raise ValueError(f"window_size must be an int or (h, w) (one window for all stages), got {window_size}")
        if window_ratio is not None and not (isinstance(window_ratio, int) and window_ratio >= 1):
            raise ValueError(f"window_ratio must be an int >= 1 (one window for all stages), got {window_ratio}")
        size = to_2tuple(img_size) if img_size is not None else self.img_size
        grid = self.patch_embed.grid_for(size)
        if window_size is not None:
            window = to_2tuple(window_size)
        elif window_ratio is not None:
            window = (max(1, grid.h // window_ratio), max(1, grid.w // window_ratio))
        else:
            window = tuple(max(1, w * g // r) for w, g, r in zip(self._ref_window, grid, self._ref_grid))
        fresh = rebuild_position_schemes(self, img_size=size, window_size=window)
        if window_size is not None or window_ratio is not None:  # an explicit window: the new reference (timm's)
            self._ref_window, self._ref_grid = window, grid
        self.img_size, self.grid, self.window_size = fresh.img_size, fresh.grid, fresh.window_size
        self.patch_embed.img_size = fresh.patch_embed.img_size
        for stage, new_stage in zip(self.layers, fresh.layers):
            stage.build_grid, stage.window_size = new_stage.build_grid, new_stage.window_size
            for blk, new_blk in zip(stage.blocks, new_stage.blocks):
                blk.build_grid, blk.window_size = new_blk.build_grid, new_blk.window_size
                blk.window_regions = new_blk.window_regions

    # ---------------------------------------------------------------------------- forward
    def read_input(self, x: Tensor | Sequence[Tensor] | Mapping[str, Tensor]) -> ModelInput:
        """The entrance: the input's form decided once (:func:`~vitrel.models.naflex.read_input`)."""
        return read_input(x, self.patch_embed.proj)

    def embed(self, x: Tensor) -> Tensor:
        """Images ``[B, C, H, W]`` -> patch map ``[B, H', W', C]`` (with the absolute embedding, if any)."""
        return self.pos_drop(self._add_abs_pos(self.patch_embed(x)))

    def _add_abs_pos(self, x: Tensor) -> Tensor:
        return x if self.abs_pos is None else add_abs_pos(self.abs_pos, x, map_grid(x), 0)

    def embed_packed(self, nb: NaFlexBatch) -> tuple[Tensor, TokenLayout]:
        """Images of different sizes (:meth:`read_input`'s batch; every image a full grid) -> each image's patch map
        (with the absolute embedding, if any) packed ``[1, T, C]``, and that packed layout (its tokens in any order,
        put in their places)."""
        pe, p = self.patch_embed, self.patch_embed.patch_size[0]
        valid = nb.image >= 0
        image, coords = nb.image[valid], nb.coords[valid]
        counts = torch.bincount(image, minlength=nb.num_images).tolist()
        for i, (g, n) in enumerate(zip(nb.image_grids, counts)):
            if n != g.n:
                raise ValueError(
                    f"Swin needs every image's full grid; token dropping is for the ViT: image {i} of the NaFlex "
                    f"batch has {n} of the {g.h} x {g.w} patches its coordinates span"
                )
        if pe.strict_img_size:
            check_grid_sizes(nb.image_grids, p, pe.img_size)
        sizes = torch.tensor([g.n for g in nb.image_grids], device=image.device)
        widths = torch.tensor([g.w for g in nb.image_grids], device=image.device)
        start = torch.cumsum(sizes, 0) - sizes
        dest = start[image] + coords[:, 0] * widths[image] + coords[:, 1]  # each token's raster place in its image
        tokens = pe.norm(embed_patches(pe.proj, nb.patches)[valid])
        tokens = tokens.new_empty(tokens.shape).index_copy_(0, dest, tokens)
        layout = TokenLayout.packed(nb.image_grids, 0, tokens.device)
        x, layout = pack_maps([self._add_abs_pos(m) for m in image_maps(tokens[None], layout)])
        return self.pos_drop(x), layout

    def forward_features(self, x: Tensor | Sequence[Tensor] | Mapping[str, Tensor]) -> Tensor | MixedMaps:
        """Images -> normalised feature map ``[B, H'', W'', C]`` (NHWC, as timm's Swin). Images of different sizes
        (a list of ``[C, H_i, W_i]``, or timm's NaFlex dict with every image a full grid) -> their maps packed
        (:class:`MixedMaps`: ``.maps()`` gives each image's ``[1, H_i'', W_i'', C]``), each as the image alone."""
        inp = self.read_input(x)
        return self._grid_features(inp.images) if inp.batch is None else self._packed_features(inp.batch)

    def _grid_features(self, x: Tensor) -> Tensor:
        x = self.embed(x)
        for stage in self.layers:
            x = stage(x)
        return self.norm(x)

    def _packed_features(self, nb: NaFlexBatch) -> MixedMaps:
        x, layout = self.embed_packed(nb)
        for stage in self.layers:
            x, layout = stage(x, layout), stage.output_layout(layout)
        return MixedMaps(self.norm(x)[0], layout)

    def pool(self, x: Tensor | MixedMaps) -> Tensor:
        """Maps ``[B, H, W, C]`` -> ``[B, C]`` (``global_pool``); :class:`MixedMaps` -> one row per image, in image
        order."""
        if isinstance(x, MixedMaps):  # the exit's packed form (forward_features), not the input's
            if not self.global_pool:
                raise ValueError(
                    "images of different sizes need a global_pool ('avg', 'max' or 'avgmax': one row per image); for "
                    "their feature maps call forward_features (MixedMaps.maps())"
                )
            return torch.cat([self.pool(m) for m in x.maps()])
        if self.global_pool == "max":
            return x.amax(dim=(1, 2))
        if self.global_pool == "avgmax":
            return 0.5 * (x.mean(dim=(1, 2)) + x.amax(dim=(1, 2)))
        return x.mean(dim=(1, 2)) if self.global_pool == "avg" else x

    def forward(self, x: Tensor | Sequence[Tensor] | Mapping[str, Tensor]) -> Tensor:
        """Images ``[B, C, H, W]`` -> logits ``[B, classes]``; a list of images ``[C, H_i, W_i]`` of different sizes,
        or timm's NaFlex dict (every image a full grid) -> ``[num_images, classes]``, each row what the image gets
        alone (see ``docs/swin.md``)."""
        return self.forward_head(self.forward_features(x))

    # ---------------------------------------------------------------------------- intermediates (timm)
    def forward_intermediates(
        self,
        x: Tensor,
        indices: int | list[int] | None = None,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ) -> list[Tensor] | tuple[Tensor, list[Tensor]]:
        """timm's ``forward_intermediates``: the output maps of the stages in ``indices`` (the last ``n``
        for an int, all for None) as ``NCHW`` (or ``NHWC``), and the final normalised map ``[B, H, W, C]``.

        ``norm`` applies the final norm to the last stage's map (the only one it is sized for);
        ``stop_early`` skips the stages after the last one asked for.
        """
        check_images(x, "the Swin's forward_intermediates")
        take, stages = self.intermediate_indices(indices, output_fmt, stop_early)
        return self.stage_intermediates(self.embed(x), take, stages, norm, output_fmt == "NCHW", intermediates_only)

    # ---------------------------------------------------------------------------- seams (viz, registry)
    @torch.no_grad()
    def attention_maps(self, x: Tensor, block: int = -1, stage: int = 0) -> Tensor:
        """``[B, heads, H, W]``: the attention each position of stage ``stage``'s grid receives in its block
        ``block``, averaged over all queries (the windows put together: ``SwinBlock.dense_attention``). What
        ``vitrel.viz.attention_maps`` draws (in eval mode) for any backbone with this method."""
        if not -len(self.layers) <= stage < len(self.layers):
            raise ValueError(f"stage {stage} out of range for {len(self.layers)} stages")
        check_images(x, "attention_maps")
        x, stg = self.embed(x), self.layers[stage]
        for s in self.layers[: stage % len(self.layers)]:
            x = s(x)
        x = stg.downsample(x)
        pos_state, n = stg.position_state(x), len(stg.blocks)
        if not -n <= block < n:
            raise ValueError(f"block {block} out of range for {n} blocks")
        for blk in stg.blocks[: block % n]:
            x = blk(x, pos_state=pos_state)
        dense = stg.blocks[block % n].dense_attention(x, pos_state)  # [B, heads, HW, HW]
        return dense.mean(2).reshape(*dense.shape[:2], x.shape[1], x.shape[2])

    @classmethod
    def feature_defaults(cls, args: dict[str, Any]) -> dict[str, Any]:
        """What ``vitrel.models.registry`` reads of a backbone built with constructor ``args`` (see
        ``VisionTransformer.feature_defaults``): the final map pooled ``img / patch / 2^(stages-1)`` per side
        (patch merging pads odd sides), maps ``NHWC`` as timm's Swin, the stages a ``Sequential``."""
        img, patch = to_2tuple(args.get("img_size", 224)), to_2tuple(args.get("patch_size", 4))
        side = [-(-int(s) // int(p)) for s, p in zip(img, patch)]  # rows, columns: img_size may be a pair
        for _ in range(len(args.get("depths", (2, 2, 6, 2))) - 1):
            side = [-(-s // 2) for s in side]
        absolute = split_pos(parse_pos(args.get("pos", "rel2d_full")), parse_pos(args.get("abs_pos")))[1]
        why = "skips its absolute position embedding (the model adds it)" if absolute is not None else None
        return dict(pool_size=tuple(side), output_fmt="NHWC", module_fmt="NHWC", no_flatten=why)
