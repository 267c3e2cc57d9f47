"""Video Vision Transformer (ViViT's joint space-time attention, VideoMAE's backbone) with any position scheme.

A clip ``[B, C, T, H, W]`` is cut into ``tubelet_size x patch_size x patch_size`` tubelets, a ``T' x H' x W'`` grid
(:class:`~vitrel.layout.geometry.Grid3`), embedded by a 3-D convolution; every block attends over all tokens::

    x_0 = [cls?, E(tubelet_1), ..., E(tubelet_T'H'W')]   tokens t-major: index (t H' + h) W' + w (+ absolute embedding)
    x_l = Block_l(x_{l-1}, grid)                         pre-norm, attention with the scheme on the video grid
    y   = head(fc_norm(mean of the tubelet tokens))      (or the class token, global_pool="token")

With ``num_segments = K > 1`` (V-JEPA 2's ``ClipAggregation``, their evaluations' protocol) an input holds ``K``
clips of ``T`` frames joined along time, ``[B, C, K T, H, W]``: each clip is encoded alone (no attention, no
position, between them), and their tokens are joined, segment 0's first, before the pool::

    z_k = norm(x_L(clip_k)),   k = 0 .. K-1          each [B, T'H'W', C]
    y   = head(pool([z_0, ..., z_{K-1}]))            the pool sees K T'H'W' tokens (a (K T', H', W') grid)

The defaults are VideoMAE's: no class token, mean pooling, ``fc_norm`` after pooling. The grid is taken from the
clip at forward time, so a model runs at any number of frames (a multiple of ``tubelet_size``) and any frame size (a
multiple of ``patch_size``); ``num_frames`` and ``img_size`` only size learned tables and absolute embeddings.

The blocks, their shared or per-block schemes (``pos_share``) and the block loop are the image ViT's
(:mod:`vitrel.models.blocks`). A 2-D scheme (``rel2d_full``, ``rope2d_axial``...) refuses the video grid by name;
use a 3-D one (``rel3d_full``, ``rope3d_axial``...) or ``none``.
"""

from __future__ import annotations

from typing import Any

import torch
from timm.layers import to_2tuple
from torch import Tensor, nn

from vitrel.layers.validate import check_vit_args
from vitrel.layout.geometry import Grid3
from vitrel.models.backbone import ViTBody
from vitrel.models.blocks import TubeletEmbed, constructor_config, with_placement
from vitrel.models.input_size import set_clip_input_size
from vitrel.models.timm_surface import TimmSurface
from vitrel.models.video_features import CLIP_GETTER_ONLY, ClipFeatureGetterNet
from vitrel.pos.registry import PosArg, parse_pos, split_pos

__all__ = ["VideoVisionTransformer"]


class VideoVisionTransformer(ViTBody, TimmSurface, nn.Module):
    """Video ViT with a pluggable position scheme (module docstring; timm's surface:
    :class:`~vitrel.models.timm_surface.TimmSurface`).

    Args:
        img_size: frame size the model is built for; num_frames: clip length it is built for (both size learned
            tables and absolute embeddings only: any clip runs).
        patch_size, tubelet_size: the tubelet's side in pixels and its length in frames (VideoMAE: 16, 2).
        in_chans, num_classes, embed_dim, depth, num_heads, num_kv_heads, mlp_ratio, mlp_layer, mlp_norm, act_layer,
            qkv_bias, init_values, attn_only_layer_scale: as the image ViT.
        global_pool: ``"avg"`` (mean of the tubelet tokens, VideoMAE's), ``"token"`` (class token), ``"max"`` /
            ``"avgmax"`` / ``"map"`` of the tubelet tokens (as the image ViT's) or ``""``.
        class_token: prepend a class token (VideoMAE has none).
        fc_norm: norm after pooling instead of before (None: True for ``"avg"``, ``"max"``, ``"avgmax"``, as timm and
            VideoMAE).
        pre_norm, post_norm, qk_norm, attn_norm, final_norm, attn_pool_num_heads, attn_pool_mlp_ratio,
            attn_pool_type, attn_pool_depth, pool_include_prefix, patch_bias, head_init_scale: as the image ViT's
            (``head_init_scale`` 0.001: VideoMAE's fine-tuning ``init_scale``).
        pos, abs_pos, pos_share, attn_impl: as the image ViT; the scheme sees the video grid ``(T', H', W')``.
        num_segments: clips per input, encoded alone and pooled together (module docstring; ``num_frames``: the
            frames of one); no class token.
        drop_rate, pos_drop_rate, proj_drop_rate, attn_drop_rate, drop_path_rate, norm_layer, norm_eps: as the image
            ViT.
        device, dtype: placement (keyword-only, not part of ``vitrel_cfg``).
    """

    global_pools = ("avg", "token", "max", "avgmax", "map", "")
    intermediate_fmts = ("NCTHW", "NTHWC", "NLC")

    @with_placement
    def __init__(
        self,
        img_size: int | tuple[int, int] = 224,
        num_frames: int = 16,
        patch_size: int = 16,
        tubelet_size: int = 2,
        in_chans: int = 3,
        num_classes: int = 1000,
        global_pool: str = "avg",
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        num_kv_heads: int | list[int] | None = None,
        mlp_ratio: float = 4.0,
        mlp_layer: str = "mlp",
        mlp_norm: bool = False,
        act_layer: str = "gelu",
        qkv_bias: bool | str = True,
        class_token: bool = False,
        init_values: float | None = None,
        attn_only_layer_scale: bool = False,
        fc_norm: bool | None = None,
        pre_norm: bool = False,
        post_norm: bool = False,
        qk_norm: bool = False,
        attn_norm: bool = False,
        final_norm: bool = True,
        attn_pool_num_heads: int | None = None,
        attn_pool_mlp_ratio: float | None = None,
        attn_pool_type: str = "latent",
        attn_pool_depth: int = 1,
        pool_include_prefix: bool = False,
        pos: PosArg = "rel3d_full",
        abs_pos: PosArg = None,
        pos_share: bool = False,
        attn_impl: str = "auto",
        drop_rate: float = 0.0,
        pos_drop_rate: float = 0.0,
        proj_drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        norm_layer: str = "layernorm",
        norm_eps: float = 1e-6,
        patch_bias: bool = True,
        num_segments: int = 1,
        head_init_scale: float = 1.0,
    ) -> None:
        super().__init__()
        check_vit_args(locals())  # sizes checked first, errors name the argument
        TimmSurface.check_global_pool(self, global_pool)  # (the pools; the class token's rule below)
        if global_pool == "token" and not class_token:
            raise ValueError("global_pool='token' needs class_token=True")
        if isinstance(num_segments, bool) or not isinstance(num_segments, int) or num_segments < 1:
            raise ValueError(f"num_segments must be an integer >= 1, got {num_segments!r}")
        if num_segments > 1 and class_token:
            raise ValueError(f"num_segments={num_segments} pools the segments' tubelet tokens: class_token=False")
        pos, abs_pos = parse_pos(pos), parse_pos(abs_pos)
        img_size = to_2tuple(img_size)
        self.vitrel_cfg = constructor_config(VideoVisionTransformer, locals(), img_size=list(img_size))
        rel, absolute = split_pos(pos, abs_pos)
        self.num_classes = num_classes
        self.init_surface(in_chans, img_size, global_pool, None, None)
        self.num_frames, self.num_segments = num_frames, num_segments
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        self.num_prefix_tokens = 1 if class_token else 0
        self.has_class_token = class_token
        self.grad_checkpointing = False
        self._attn_impl = attn_impl

        self.patch_embed = TubeletEmbed(patch_size, tubelet_size, in_chans, embed_dim, bias=patch_bias)
        self.grid = self.patch_embed.grid_for(num_frames, img_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if class_token else None
        self.init_body(rel, absolute, locals())
        for info in self.feature_info:  # timm's reduction: the stride in space (patch_size); in time beside it
            info["time_reduction"] = tubelet_size
        self.init_weights(needs_reset=False)  # the modules initialised themselves (timm's)

    def set_input_size(self, img_size: Any = None, num_frames: int | None = None, patch_size: Any = None) -> None:
        """timm's ``set_input_size`` with clips: built now for ``img_size`` frames and ``num_frames`` per clip
        (:func:`~vitrel.models.input_size.set_clip_input_size`); the patch and tubelet stay."""
        set_clip_input_size(self, img_size, num_frames, patch_size)

    # ---------------------------------------------------------------------------- forward
    def embed(self, x: Tensor) -> tuple[Tensor, Grid3]:
        """Clips ``[B, C, T, H, W]`` -> input tokens ``[B, P + T'H'W', C]`` (with absolute position) and the grid."""
        x, grid = self.patch_embed(x)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.norm_pre(self.pos_drop(self.input_abs_pos(x, grid))), grid

    def forward_features(self, x: Tensor) -> Tensor:
        """Clips ``[B, C, T, H, W]`` -> normalised tokens ``[B, P + T'H'W', C]`` (t-major; ``[B, K T'H'W', C]``, the
        segments' one after the other, with ``num_segments = K``)."""
        return self.join_segments(self.grid_features(self.split_segments(x)))

    def split_segments(self, x: Tensor) -> Tensor:
        """``[B, C, K T, H, W]`` -> the ``K`` segments as a batch ``[B K, C, T, H, W]`` (video b's k-th at b K + k)."""
        k = self.num_segments
        if k == 1:
            return x
        if x.dim() != 5 or x.shape[2] % k:
            raise ValueError(
                f"a model of num_segments={k} takes [B, C, {k} * T, H, W] ({k} clips joined along time), got "
                f"{tuple(x.shape)}"
            )
        return x.unflatten(2, (k, x.shape[2] // k)).transpose(1, 2).flatten(0, 1)

    def join_segments(self, y: Tensor, time_dim: int = 1) -> Tensor:
        """The segments' outputs ``[B K, ...]`` as one per video, joined along ``time_dim`` (of the output without
        its batch: 1 for tokens ``[B, N, C]`` and ``[B, T', H', W', C]``, 2 for ``[B, C, T', H', W']``)."""
        k = self.num_segments
        if k == 1:
            return y
        y = y.unflatten(0, (-1, k))  # [B, K, ...]
        return y.movedim(1, time_dim).flatten(time_dim, time_dim + 1)

    def forward(self, x: Tensor) -> Tensor:
        """Clips ``[B, C, T, H, W]`` -> logits ``[B, classes]``."""
        return self.forward_head(self.forward_features(x))

    # ---------------------------------------------------------------------------- intermediates (timm)
    def forward_intermediates(
        self,
        x: Tensor,
        indices: int | list[int] | None = None,
        return_prefix_tokens: bool = False,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCTHW",
        intermediates_only: bool = False,
    ) -> list[Tensor] | tuple[Tensor, list[Tensor]]:
        """timm's ``forward_intermediates``: the outputs of the blocks in ``indices`` (the last ``n`` for an int, all
        for None, negative indices from the end) and the final normalised tokens.

        ``output_fmt``: ``"NCTHW"`` (tubelet tokens as ``[B, C, T', H', W']``), ``"NTHWC"`` (``[B, T', H', W', C]``)
        or ``"NLC"`` (``[B, T'H'W', C]``); the class token is dropped (``return_prefix_tokens=True``: pairs
        ``(tokens, prefix [B, P, C])``). ``norm`` applies the final norm to each; ``stop_early`` skips the blocks
        after the last one asked for."""
        take, blocks = self.intermediate_indices(indices, output_fmt, stop_early)
        out = self.grid_intermediates(
            self.split_segments(x), take, len(blocks), norm, output_fmt, return_prefix_tokens, intermediates_only
        )
        if self.num_segments == 1:
            return out
        dim = 2 if output_fmt == "NCTHW" else 1  # (the segments one after the other in time, as forward_features)
        feats = [self.join_segments(y, dim) for y in (out if intermediates_only else out[1])]
        return feats if intermediates_only else (self.join_segments(out[0]), feats)

    @classmethod
    def feature_defaults(cls, args: dict[str, Any]) -> dict[str, Any]:
        """What ``vitrel.models.registry`` reads (see ``VisionTransformer.feature_defaults``): ``getter``, the
        ``features_only`` wrapper over ``forward_intermediates`` (maps ``NCTHW`` or ``NTHWC``), and ``getter_only``,
        why timm's other wrappers do not take the model."""
        return dict(pool_size=None, output_fmt="NCTHW", getter=ClipFeatureGetterNet, getter_only=CLIP_GETTER_ONLY)
