"""Global-attention Vision Transformer (Dosovitskiy et al., 2021) with any position scheme.

For an image cut into an ``H x W`` grid of patches, with ``P`` prefix tokens (class token and
``reg_tokens`` registers, Darcet et al. 2024) ahead of the patch tokens::

    x_0    = [cls, reg_1..reg_R, E(patch_1), ..., E(patch_HW)]  (+ absolute embedding of the patches)
    x_l    = Block_l(x_{l-1}, grid)                             pre-norm, attention with the scheme
                                                                (+ CPE's convolution after its block, ``after_block``)
    y      = head(pool(LN(x_L)))                                pool: class token, or mean / max / attention of patches

The grid is taken from the input image at forward time, so a model runs at any image size that is
a multiple of the patch size (any size with ``dynamic_img_pad=True``, timm's: zero-padded on the right and bottom
to whole patches); ``img_size`` only sizes learned tables and absolute embeddings.

With ``pos_share=True`` one relative scheme (``model.rel_pos``) serves every block: its state (bias,
RoPE cos/sin) is prepared once per forward and passed to every block; with ``pos_share=False``
every block has its own scheme.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from timm.layers import to_2tuple
from torch import Tensor, nn

from vitrel.layers.validate import check_vit_args
from vitrel.layout.geometry import Grid
from vitrel.layout.tokens import TokenLayout
from vitrel.models.backbone import ViTBody, warn_video_scheme
from vitrel.models.blocks import (
    PatchEmbed,
    constructor_config,
    with_placement,
)
from vitrel.models.input_size import check_grid_sizes, check_img_size, check_same_patch, rebuild_position_schemes
from vitrel.models.naflex import (
    LatePrefix,
    LayoutFeatures,
    ModelInput,
    check_images,
    check_token_drop,
    drop_tokens,
    embed_patches,
    grid_batch,
    input_form,
    layout_features,
    read_input,
    token_drop_keep_max,
    token_drop_rates,
    with_prefix,
)
from vitrel.models.pooling import pool_images, pool_valid
from vitrel.models.timm_surface import TimmSurface, refuse_layout_mask
from vitrel.pos.registry import PosArg, parse_pos, split_pos

__all__ = ["VisionTransformer"]


class VisionTransformer(ViTBody, TimmSurface, nn.Module):
    """ViT with a pluggable position scheme (timm's surface: :class:`~vitrel.models.timm_surface.TimmSurface`).

    Args:
        img_size: image size the model is built for (sizes learned tables / absolute embeddings).
        patch_size, in_chans, num_classes, embed_dim, depth, num_heads, mlp_ratio, qkv_bias: as timm (``qkv_bias``
            also ``"qv"``: no key bias, :class:`~vitrel.Attention`).
        num_kv_heads: grouped-query attention, ``k`` and ``v`` of this many heads each serving ``num_heads /
            num_kv_heads`` query heads (timm's EVA's, sapiens2's; :class:`~vitrel.layers.Attention`); None: all. A list:
            each block's.
        global_pool: timm's ViT's: ``"token"`` (class token), ``"avg"`` / ``"max"`` / ``"avgmax"`` (mean, max, half
            their sum) of the patch tokens, ``"map"`` (timm's ``AttentionPoolLatent`` over the patch tokens, SigLIP's;
            ``attn_pool``) or ``""`` (none). Every input form pools each image's own patch tokens.
        mlp_layer: the blocks' MLP, ``"mlp"`` (timm's ``Mlp``, GELU) or ``"swiglu"`` (timm's ``SwiGLU``,
            ``fc2(SiLU(fc1_g x) * fc1_x x)``: DINOv3's ViT-H+ and 7B), ``int(embed_dim * mlp_ratio)`` hidden features.
        mlp_norm: a LayerNorm of the MLP's hidden features before ``fc2`` (timm's ``scale_mlp``, EVA-02's sub-LN).
        act_layer: the MLP's activation (and the attention pool's), as timm names it: ``"gelu"``, ``"gelu_tanh"``
            (SigLIP's) or ``"quick_gelu"`` (OpenAI CLIP's); a SwiGLU's is SiLU.
        class_token: prepend a class token.
        reg_tokens: number of register tokens after the class token.
        init_values: layer-scale init (None: no layer scale); ``attn_only_layer_scale``: on the attention branch only
            (timm's EVA's, sapiens2's).
        fc_norm: norm after pooling instead of before (None: True for ``"avg"``, ``"max"``, ``"avgmax"``, as timm).
        pre_norm: a LayerNorm of the input tokens before block 0, after the absolute embedding (timm's ``norm_pre``,
            CLIP's ``ln_pre``).
        patch_bias: a bias in the patch projection (False: CLIP's and the Perception Encoder's, timm's with
            ``pre_norm``).
        head_init_scale: the new head's initial weight times this, its bias zero (timm's EVA's and ConvNeXt's
            ``head_init_scale``; VideoMAE's ``init_scale`` 0.001); 1: timm's ViT init.
        post_norm: the blocks normalise each residual branch after it, ``x + LN(Attn x)`` (timm's ``ResPostBlock``,
            Swin V2's res-post-norm).
        qk_norm, attn_norm: the attention's LayerNorms of ``q`` and ``k`` per head (timm's ``qk_norm``) and of its
            output (timm's ``scale_attn_norm``, EVA-02 CLIP's and BEiT-3's); :class:`~vitrel.layers.Attention`.
        final_norm: the LayerNorm after the blocks (``norm``, or ``fc_norm`` after pooling); False: none (timm's
            ``final_norm``; the Perception Encoder's spatial and language towers).
        attn_pool_num_heads, attn_pool_mlp_ratio: the attention pool's heads and MLP ratio (``global_pool="map"``;
            None: ``num_heads``, ``mlp_ratio``, as timm's ViT; timm's EVA names: the Perception Encoder's pool has 8
            heads, its ViT-G's MLP ratio 4 under blocks of 5.83).
        attn_pool_type: ``"latent"`` (timm's ``AttentionPoolLatent``) or ``"attentive"`` (V-JEPA 2's attentive probe's
            pool, :class:`~vitrel.layers.AttentivePool`: ``attn_pool_depth - 1`` self-attention blocks, then a query
            that keeps its residual; its own LayerNorms, epsilon 1e-5), for ``global_pool="map"``.
        attn_pool_depth: the attentive pool's blocks, its cross-attention block included (their ``num_probe_blocks``).
        pool_include_prefix: the pools (``"avg"``, ``"max"``, ``"avgmax"``, ``"map"``) take the prefix tokens with the
            patches (timm's; timm's EVA attention pool, the Perception Encoder's), on every input form.
        pos: position scheme (name or config). An absolute scheme (``"ape"``, ``"sincos2d"``) means
            that embedding and no relative scheme.
        abs_pos: an absolute scheme added to the relative one.
        pos_share: one relative scheme shared by all blocks (True) or one per block (False).
        pos_depth: the relative scheme in the first ``pos_depth`` blocks only, the others attending by content alone
            (None: every block). ConViT's models: GPSA in the first 10 of 12 blocks.
        prefix_at: the prefix tokens (class token, registers) join the patch tokens before block ``prefix_at``, the
            blocks before it attending over the patch tokens alone (0: from the input). ConViT's class token joins
            after its GPSA blocks (``prefix_at=10``); only blocks before it may carry a relative scheme
            (``pos_depth <= prefix_at``). Intermediates of those blocks have no prefix tokens.
        token_drop: NaViT's token dropping in training: the fraction of each image's patch tokens dropped (the kept
            ones keep their coordinates), or ``(low, high)`` to draw each image's fraction uniformly; 0: none.
        attn_impl: attention kernel, ``auto`` or a registered one (:func:`vitrel.kernels.list_kernels`; what each
            does and when to pick it: docs/gpu.md).
        drop_rate, pos_drop_rate, proj_drop_rate, attn_drop_rate, drop_path_rate: dropouts / stochastic depth.
        norm_layer: every norm of the model, ``"layernorm"`` or ``"rmsnorm"`` (timm's ``RmsNorm``, no mean removed and
            no bias: sapiens2's); :mod:`vitrel.layers.norms`.
        norm_eps: the norms' epsilon.
        dynamic_img_size, strict_img_size: timm's input-size arguments (None: not given). The model reads the
            grid from the input, so by default any size runs; ``strict_img_size=True`` (or
            ``dynamic_img_size=False`` alone, timm's ViT default) refuses inputs other than ``img_size``
            (see :mod:`vitrel.models.input_size`).
        dynamic_img_pad: timm's: images (and each image of a list) whose sides are not multiples of ``patch_size``
            are zero-padded on the right and bottom to the next multiple, the grid ``ceil(H / p) x ceil(W / p)``
            (the relative positions, and ``forward_intermediates``' maps, of the padded grid); without it they are
            refused. A NaFlex dict holds patches already. ``img_size`` is then any size (its grid rounded up).
        device, dtype: where and in what dtype the parameters are made (keyword-only; ``device="meta"``
            allocates nothing: then ``to_empty(device=...)`` and load weights). Not part of ``vitrel_cfg``.
    """

    intermediate_fmts = ("NCHW", "NLC")

    @with_placement
    def __init__(
        self,
        img_size: int | tuple[int, int] = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        global_pool: str = "token",
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        num_kv_heads: int | list[int] | None = None,
        mlp_ratio: float = 4.0,
        mlp_layer: str = "mlp",
        mlp_norm: bool = False,
        act_layer: str = "gelu",
        qkv_bias: bool | str = True,
        class_token: bool = True,
        reg_tokens: int = 0,
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
        pos: PosArg = "rel2d_full",
        abs_pos: PosArg = None,
        pos_share: bool = False,
        pos_depth: int | None = None,
        prefix_at: int = 0,
        token_drop: float | tuple[float, float] = 0.0,
        attn_impl: str = "auto",
        drop_rate: float = 0.0,
        pos_drop_rate: float = 0.0,
        proj_drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        norm_layer: str = "layernorm",
        norm_eps: float = 1e-6,
        dynamic_img_size: bool | None = None,
        strict_img_size: bool | None = None,
        dynamic_img_pad: bool = False,
        patch_bias: bool = True,
        head_init_scale: float = 1.0,
    ) -> None:
        super().__init__()
        check_vit_args(locals())  # sizes checked first, errors name the argument
        TimmSurface.check_global_pool(self, global_pool)  # (the pools; the class token's rule below)
        if global_pool == "token" and not class_token:
            raise ValueError("global_pool='token' needs class_token=True")
        if reg_tokens < 0:
            raise ValueError(f"reg_tokens must be >= 0, got {reg_tokens}")
        pos, abs_pos = parse_pos(pos), parse_pos(abs_pos)  # the one parse of the position specs
        warn_video_scheme(type(self).__name__, pos=pos, abs_pos=abs_pos)  # a video scheme runs as one frame
        img_size = to_2tuple(img_size)
        token_drop = check_token_drop(token_drop)
        self.vitrel_cfg = constructor_config(VisionTransformer, locals(), img_size=list(img_size))
        self.token_drop = token_drop
        rel, absolute = split_pos(pos, abs_pos)
        self.num_classes = num_classes
        self.init_surface(in_chans, img_size, global_pool, dynamic_img_size, strict_img_size)
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        self.num_prefix_tokens = (1 if class_token else 0) + reg_tokens
        self.num_reg_tokens = reg_tokens
        self.has_class_token = class_token
        self.no_embed_class = True  # timm's: an absolute embedding covers the patch tokens only (pos_embed [1, N, C])
        self.grad_checkpointing = False
        self._attn_impl = attn_impl

        self.patch_embed = PatchEmbed(patch_size, in_chans, embed_dim, dynamic_img_pad=dynamic_img_pad, bias=patch_bias)
        self.patch_embed.strict_img_size = self.strict_img_size  # timm's: its builder reads it (fixed_input_size)
        self.patch_embed.img_size = img_size
        self.grid = self.patch_embed.grid_for(img_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if class_token else None
        self.reg_token = nn.Parameter(torch.zeros(1, reg_tokens, embed_dim)) if reg_tokens else None
        self.init_body(rel, absolute, locals())
        self.init_weights(needs_reset=False)  # the modules initialised themselves (timm's)

    # ---------------------------------------------------------------------------- timm surface
    @property
    def pos_embed(self) -> nn.Parameter | None:
        """timm's ``pos_embed``: the learned absolute embedding ``[1, H'W', C]`` of ``pos="ape"`` or ``abs_pos="ape"``,
        the same Parameter as ``abs_pos.pos_embed`` (its state-dict key). It covers the patch tokens only, as timm's
        with ``no_embed_class=True``. None without one (relative schemes; ``sincos2d``, computed from the grid), as
        timm's ``pos_embed="none"``. Edit it in place; :meth:`set_input_size` resamples it to another size."""
        return getattr(self.abs_pos, "pos_embed", None) if self.abs_pos is not None else None

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "pos_embed":  # (nn.Module would register a second Parameter, or say the property has no setter)
            raise AttributeError(
                "pos_embed is the model's abs_pos.pos_embed and cannot be replaced: edit it in place "
                "(with torch.no_grad(): model.pos_embed.copy_(new)), or change the image size with "
                "model.set_input_size(img_size=...), which resamples it"
            )
        super().__setattr__(name, value)

    def set_input_size(self, img_size: int | tuple[int, int] | None = None, patch_size: Any = None) -> None:
        """timm's ``set_input_size``: the model is now built for ``img_size`` (learned tables and absolute
        embeddings resized as loading at that size does; ``vitrel_cfg`` follows). Changing the patch size
        is not supported (a ``ValueError``)."""
        check_same_patch(self, patch_size)
        if img_size is None:
            return
        fresh = rebuild_position_schemes(self, img_size=to_2tuple(img_size))
        self.img_size, self.grid = fresh.img_size, fresh.grid
        self.patch_embed.img_size = fresh.patch_embed.img_size

    # ---------------------------------------------------------------------------- forward
    def embed(self, x: Tensor) -> tuple[Tensor, Grid]:
        """Images ``[B, C, H, W]`` -> input tokens ``[B, P + H'W', C]`` (with absolute position; no prefix tokens with
        ``prefix_at``: they join later) and grid."""
        if self.strict_img_size:
            check_img_size(x, self.img_size)
        x, grid = self.patch_embed(x)
        x = self.input_abs_pos(x if self.prefix_at else self.add_prefix(x), grid)
        return self.norm_pre(self.pos_drop(x)), grid

    def read_input(self, x: Tensor | Mapping[str, Tensor] | Sequence[Tensor]) -> ModelInput:
        """The entrance: the input's form decided once (:func:`~vitrel.models.naflex.read_input`)."""
        if self.strict_img_size and self.patch_embed.dynamic_img_pad and input_form(x) == "list":
            for img in x:  # (each image as given: padded, its patches would span a larger one)
                if isinstance(img, Tensor):
                    check_img_size(img, self.img_size)
        return read_input(x, self.patch_embed.proj, self.patch_embed.dynamic_img_pad)

    def _uses_layout(self, inp: ModelInput) -> bool:
        """The input takes the token-layout path (not one full grid per batch)."""
        return inp.batch is not None or (self.training and bool(self.token_drop))

    def embed_tokens(self, x: ModelInput) -> tuple[Tensor, TokenLayout, Tensor, LatePrefix | None]:
        """The general input (:meth:`read_input`'s): timm's NaFlex dict (packed with ``segment_ids``), a list of images
        of any sizes, or images whose tokens are dropped (``token_drop`` in training) -> tokens ``[B, N', C]`` with each
        image's prefix tokens ahead of its patches (:func:`~vitrel.models.naflex.with_prefix`), their layout, where
        each input patch token went (``[B, N]``), and with ``prefix_at`` (the tokens then have no prefix) where the
        prefix tokens join (:class:`~vitrel.models.naflex.LatePrefix`)."""
        pe = self.patch_embed
        if x.batch is None:
            if self.strict_img_size:
                check_img_size(x.images, self.img_size)
            tokens, grid = pe(x.images)
            batch = grid_batch(tokens, grid)
        else:
            if self.strict_img_size:
                check_grid_sizes(x.batch.image_grids, pe.patch_size[0], self.img_size, pad=pe.dynamic_img_pad)
            batch = x.batch._replace(patches=pe.norm(embed_patches(pe.proj, x.batch.patches)))
        if self.training and self.token_drop:
            rates = token_drop_rates(self.token_drop, batch.num_images, batch.patches.device)
            # images with a range of rates: rows of the length the lowest rate keeps (one shape per size under
            # torch.compile); one rate keeps as many tokens of every image (no padding, forward_features' tensor)
            ranged = x.batch is None and isinstance(self.token_drop, list)
            length = token_drop_keep_max(self.token_drop, batch.patches.shape[1], rates.dtype) if ranged else None
            batch = drop_tokens(batch, rates, length=length)
        prefix = [t[0] for t in (self.cls_token, self.reg_token) if t is not None]
        x, layout, dest = with_prefix(batch.patches, batch, torch.cat(prefix) if prefix else None)
        late = None
        if self.prefix_at:  # (the patch tokens alone until then)
            late = LatePrefix(x, layout, dest)
            x, layout, dest = with_prefix(batch.patches, batch, None)
        return self.norm_pre(self.pos_drop(self.input_abs_pos(x, layout))), layout, dest, late

    def forward_layout(self, x: Any, depth: int | None = None) -> tuple[Tensor, TokenLayout, Tensor, list[Tensor]]:
        """The input (any form, :meth:`read_input`) on the token-layout path: :meth:`embed_tokens`, then the blocks (the
        first ``depth``) on the layout: the final normalised tokens, the layout, where each input token went, and
        every block's output."""
        return self._forward_layout(self.read_input(x), depth)

    def _forward_layout(
        self, inp: ModelInput, depth: int | None = None
    ) -> tuple[Tensor, TokenLayout, Tensor, list[Tensor]]:
        x, layout, dest, late = self.embed_tokens(inp)
        joined = None if late is None else late.layout
        outs = list(self.run_blocks(x, layout, self.position_states(layout, x, depth, joined), depth, join=late))
        if late is not None and len(outs) > self.prefix_at:
            layout, dest = late.layout, late.dest
        return self.norm(outs[-1] if outs else x), layout, dest, outs

    def forward_features(
        self,
        x: Tensor | Mapping[str, Tensor] | Sequence[Tensor],
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
    ) -> Tensor | LayoutFeatures:
        """Images -> normalised tokens ``[B, P + H'W', C]`` (a tensor, as timm's ViT). A token layout -- a NaFlex dict,
        a list of images, or images whose tokens are dropped (``token_drop``, training) by a range of rates -> timm's
        NaFlexVit dict (:class:`~vitrel.models.naflex.LayoutFeatures`): ``patches [B, N', C]`` (each image's prefix
        tokens ahead of its patches, :meth:`embed_tokens`), ``patch_valid`` (not for a packed dict) and ``layout``;
        :meth:`forward_head` takes it whole and pools each image's own tokens. Images with one ``token_drop`` rate
        keep a tensor (every image keeps as many tokens: no padding). ``attn_mask`` / ``is_causal``: timm's, for images
        (:func:`~vitrel.models.timm_surface.timm_attn_mask`: added to every block's logits with the position bias)."""
        inp = self.read_input(x)
        if not self._uses_layout(inp):
            return self.grid_features(inp.images, attn_mask, is_causal)
        refuse_layout_mask(attn_mask, is_causal)
        feats, layout, _, _ = self._forward_layout(inp)
        return self._layout_features(x, inp, feats, layout)

    def _layout_features(self, x: Any, inp: ModelInput, feats: Tensor, layout: TokenLayout) -> Tensor | LayoutFeatures:
        """:meth:`forward_features`' answer for tokens ``feats`` on the layout of input ``x`` (``inp``, read)."""
        if inp.batch is None and not isinstance(self.token_drop, list):  # images, one drop rate: no padding
            return feats
        return layout_features(feats, layout, packed=isinstance(x, Mapping) and x.get("segment_ids") is not None)

    def forward_head(
        self,
        patches: Tensor | Mapping[str, Any],
        pre_logits: bool = False,
        patch_valid: Tensor | None = None,
        layout: TokenLayout | None = None,
    ) -> Tensor:
        """Features -> logits (``pre_logits``: the pooled, ``fc_norm``-ed features). ``patches``: the tokens of
        :meth:`forward_features` or its dict whole (``forward_head(f)`` or timm's ``forward_head(**f)``): one row per
        image. timm's NaFlexVit form ``forward_head(f['patches'], patch_valid=f['patch_valid'])`` pools a padded batch
        (one image per row) over its valid patches. A bare tensor pools every row as one image."""
        if isinstance(patches, Mapping):
            if patch_valid is not None or layout is not None:
                raise ValueError(
                    "forward_head takes forward_features' dict whole (it holds the layout and patch_valid) or its "
                    "'patches' with patch_valid=..., not both"
                )
            patches, patch_valid, layout = patches["patches"], patches.get("patch_valid"), patches.get("layout")
        if layout is not None:
            pool = (self.global_pool, self.attn_pool, self.pool_include_prefix)
            x = pool_images(patches, layout, *pool) if self.global_pool else patches
        elif patch_valid is not None:
            p = self.num_prefix_tokens
            x = pool_valid(patches, patch_valid.bool(), self.global_pool, p, self.attn_pool, self.pool_include_prefix)
        else:
            x = self.pool(patches)
        x = self.head_drop(self.fc_norm(x))
        return x if pre_logits else self.head(x)

    def forward(
        self,
        x: Tensor | Mapping[str, Tensor] | Sequence[Tensor],
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
    ) -> Tensor:
        """Images ``[B, C, H, W]`` -> logits ``[B, classes]``; a NaFlex dict (packed or padded) or a list of images of
        any sizes -> one row of logits per image, ``[num_images, classes]`` (row-major over rows and segments).
        ``attn_mask`` / ``is_causal``: timm's (:meth:`forward_features`)."""
        inp = self.read_input(x)
        if not self._uses_layout(inp):
            return self.forward_head(self.grid_features(inp.images, attn_mask, is_causal))
        refuse_layout_mask(attn_mask, is_causal)
        feats, layout, _, _ = self._forward_layout(inp)
        return self.forward_head(feats, layout=layout)  # (each image's own tokens pooled)

    # ---------------------------------------------------------------------------- intermediates (timm)
    def forward_intermediates(
        self,
        x: Tensor,
        indices: int | list[int] | None = None,
        return_prefix_tokens: bool = False,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
        output_dict: bool = False,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
    ) -> list[Tensor] | tuple[Any, list[Tensor]] | dict[str, Any]:
        """timm's ``forward_intermediates``: the outputs of the blocks in ``indices`` (the last ``n`` for an
        int, all for None, negative indices from the end) and the final features (:meth:`forward_features`').

        ``output_fmt``: ``"NCHW"`` (patch tokens as ``[B, C, H', W']``) or ``"NLC"`` (``[B, H'W', C]``);
        prefix tokens are dropped (``return_prefix_tokens=True``: pairs ``(patches, prefix [B, P, C])``).
        ``norm`` applies the final norm to each intermediate; ``stop_early`` skips the blocks after the
        last one asked for; ``intermediates_only`` returns the list alone. ``output_dict`` (timm's NaFlexVit):
        a dict of ``image_intermediates``, ``image_features`` (unless ``intermediates_only``), and for a token layout
        the returned tokens' ``patch_coord``, ``patch_valid`` and ``segment_ids`` (the NaFlex dict's keys).

        A token layout (a NaFlex dict, a list of images) gives ``"NLC"`` at the input's patch positions. ``token_drop``
        (in training) drops tokens for ``"NLC"`` only, which are then the kept tokens, not the input's positions:
        that takes ``output_dict=True`` (their coordinates), as timm's NaFlexVit with patch dropout. ``"NCHW"`` maps of
        an image batch (a ``features_only`` backbone's output) are always the full grid. ``attn_mask`` / ``is_causal``:
        timm's, for images (:meth:`forward_features`).
        """
        take, blocks = self.intermediate_indices(indices, output_fmt, stop_early)
        # token dropping (training) applies to tokens (NLC); a map of an image batch (NCHW, what a features_only
        # backbone returns) needs every token: the full grid
        inp = self.read_input(x)
        if inp.batch is not None or (self._uses_layout(inp) and output_fmt == "NLC"):
            if return_prefix_tokens and self.num_prefix_tokens:
                raise ValueError(
                    "return_prefix_tokens=True takes a batch of whole images: the intermediates of a NaFlex dict, a "
                    "list of images or dropped tokens (token_drop, training) are the patch tokens at the input's "
                    "positions (output_fmt='NLC'), with no prefix tokens"
                )
            if output_fmt != "NLC":
                raise ValueError("a NaFlex dict or a list of images has no common patch grid: use output_fmt='NLC'")
            if self.training and self.token_drop and not output_dict:
                raise ValueError(
                    "forward_intermediates in training with token_drop returns the kept tokens, not the input's "
                    "positions: pass output_dict=True for them with their 'patch_coord', 'patch_valid' and "
                    "'segment_ids' (or call model.eval() for every token)"
                )
            refuse_layout_mask(attn_mask, is_causal)
            return self._intermediates_layout(x, inp, take, len(blocks), norm, intermediates_only, output_dict)
        out = self.grid_intermediates(
            inp.images, take, len(blocks), norm, output_fmt, return_prefix_tokens, intermediates_only,
            attn_mask, is_causal,
        )  # fmt: skip
        if not output_dict:
            return out
        feats = out if intermediates_only else out[1]
        res: dict[str, Any] = {"image_intermediates": feats}
        if return_prefix_tokens and self.num_prefix_tokens:
            res = {"image_intermediates": [f for f, _ in feats], "image_intermediates_prefix": [p for _, p in feats]}
        if not intermediates_only:
            res["image_features"] = out[0]
        return res

    def get_intermediate_layers(
        self,
        x: Tensor,
        n: int | Sequence[int] = 1,
        reshape: bool = False,
        return_prefix_tokens: bool = False,
        norm: bool = False,
    ) -> list[Tensor] | list[tuple[Tensor, Tensor]]:
        """timm's (and DINO's) ``get_intermediate_layers``: the outputs of the last ``n`` blocks (or of the blocks
        ``n`` lists), patch tokens ``[B, H'W', C]`` (``reshape``: maps ``[B, C, H', W']``); ``norm`` applies the final
        norm; ``return_prefix_tokens``: pairs ``(patches, prefix [B, P, C])``. :meth:`forward_intermediates` with
        ``intermediates_only=True``, as timm's."""
        idx = list(n) if isinstance(n, Sequence) else n
        fmt = "NCHW" if reshape else "NLC"
        return self.forward_intermediates(
            x, idx, return_prefix_tokens=return_prefix_tokens, norm=norm, output_fmt=fmt, intermediates_only=True
        )

    def _intermediates_layout(
        self,
        x: Any,
        inp: ModelInput,
        take: list[int],
        depth: int,
        norm: bool,
        intermediates_only: bool,
        output_dict: bool,
    ) -> list[Tensor] | tuple[Any, list[Tensor]] | dict[str, Any]:
        """``forward_intermediates`` on a token layout: each intermediate ``[B, N, C]`` at the patch positions of the
        input (after token dropping: of the kept tokens; padding positions hold padding tokens)."""
        final, layout, dest, outs = self._forward_layout(inp, depth)
        idx = dest[..., None].expand(-1, -1, final.shape[-1])
        feats = [self.norm(outs[i]) if norm else outs[i] for i in take]
        feats = [y if i < self.prefix_at else y.gather(1, idx) for i, y in zip(take, feats)]  # (before: in place)
        fin = self._layout_features(x, inp, final, layout)
        if not output_dict:
            return feats if intermediates_only else (fin, feats)
        segment = layout.segment.gather(1, dest)
        res: dict[str, Any] = {
            "image_intermediates": feats,
            "patch_coord": layout.coords.gather(1, dest[..., None].expand(-1, -1, 2)),
            "patch_valid": segment >= 0,
            "segment_ids": segment,
        }
        if not intermediates_only:
            res["image_features"] = fin
        return res

    # ---------------------------------------------------------------------------- seams (viz, registry)
    @torch.no_grad()
    def attention_maps(self, x: Tensor, block: int = -1, stage: int = 0) -> Tensor:
        """``[B, heads, H', W']``: attention over the patch grid in block ``block`` (``stage``: 0, the only
        one): the class token's row, or without a class token (so in the blocks before ``prefix_at``) the attention
        each patch receives averaged over the patch queries. What ``vitrel.viz.attention_maps`` draws (in eval mode)
        for any backbone with this method."""
        n = len(self.blocks)
        if stage not in (0, -1) or not -n <= block < n:
            raise ValueError(f"stage {stage} / block {block} out of range for 1 stage of {n} blocks")
        check_images(x, "attention_maps")
        x, grid = self.embed(x)
        states = self.position_states(grid, x, block % n + 1)
        for y in self.run_blocks(x, grid, states, block % n):
            x = y
        blk, x = self.blocks[block % n], self.block_input(x, block % n)
        a = blk.attn.attention_map(blk.attn_input(x), pos_state=states[-1])  # [B, heads, N, N]
        p = self.prefix_in(block % n)
        m = a[:, :, 0, p:] if self.has_class_token and p else a[:, :, p:, p:].mean(2)
        return m.reshape(a.shape[0], a.shape[1], grid.h, grid.w)

    @classmethod
    def feature_defaults(cls, args: dict[str, Any]) -> dict[str, Any]:
        """What ``vitrel.models.registry`` reads of a backbone built with constructor ``args``: timm's
        ``pool_size`` (None: tokens), ``output_fmt`` (of ``forward_intermediates``), ``module_fmt`` (of the maps
        its modules return, which timm's hook / fx wrappers hand on as they are; None: tokens) and
        ``no_flatten`` (why timm's list / dict wrappers cannot run its children in turn; None: they can)."""
        why = "the ViT's do not allow (its blocks take the patch grid)"
        return dict(pool_size=None, output_fmt="NCHW", module_fmt=None, no_flatten=why)
