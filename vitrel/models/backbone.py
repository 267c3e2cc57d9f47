"""What the image and the video backbones share, written once: :class:`ViTBody` (the global-attention ViT over one
token grid: :class:`~vitrel.models.VisionTransformer` and :class:`~vitrel.models.VideoVisionTransformer`) and
:class:`SwinBody` (the stage stack: :class:`~vitrel.models.SwinTransformer` and
:class:`~vitrel.models.SwinTransformer3D`).

A grid is an image's ``(H, W)`` or a video's ``(T, H, W)``; maps are channels-last (``[B, *grid, C]``) and
``forward_intermediates`` gives them channels-first (``NCHW`` / ``NCTHW``) unless asked for tokens (``NLC``) or the
channels-last form (``NHWC`` / ``NTHWC``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from timm.layers import AttentionPoolLatent, calculate_drop_path_rates
from torch import Tensor, nn

from vitrel.kernels import check_choice
from vitrel.layers.attention import SHARED
from vitrel.layers.attentive_pool import AttentivePool
from vitrel.layers.mlp import ACTIVATIONS
from vitrel.layers.norms import make_norm
from vitrel.layers.validate import check_late_prefix
from vitrel.models.blocks import Block, BlockStack, check_shared, record_attn_impl
from vitrel.models.pooling import pool_tokens
from vitrel.models.timm_surface import timm_attn_mask
from vitrel.pos.registry import PosSpec, image_scheme

__all__ = ["ViTBody", "SwinBody", "channels_first", "warn_video_scheme"]

_logger = logging.getLogger(__name__)
torch.fx.wrap("timm_attn_mask")  # one call in a torch.fx graph (timm's attn_mask / is_causal are placeholders there)


def warn_video_scheme(model: str, **specs: PosSpec | None) -> None:
    """An image model (``model``, its class name) built with a video scheme (``grid_dims == 3``) as ``pos`` or
    ``abs_pos`` (the keywords: the specs as given) runs it on one frame (T = 1), what the scheme gives the time axis
    (its table, frequencies or channels) never used: a warning naming the image scheme to use instead, once, when the
    model is built (timm's convention, a logged warning). Not an error: image and video co-training, or an image model
    to start a video one from, runs a video scheme on one frame on purpose."""
    for key, spec in specs.items():
        if spec is None or spec.cls.grid_dims != 3:
            continue
        image = image_scheme(spec.cls)
        instead = f"{key}={image}" if image else "a 2-D scheme"
        _logger.warning(
            f"{key}={spec.name} is a video scheme (grids T x H x W): {model} takes images, so it runs as one frame "
            f"(T = 1) and what it gives the time axis is never used. For images use {instead}; keep {spec.name} "
            "for image and video co-training, or to start a video model from this one."
        )


def make_attn_pool(args: Mapping[str, Any], dim: int, heads: int, norm: Any) -> nn.Module:
    """``global_pool="map"``'s pool: timm's ``AttentionPoolLatent`` (``attn_pool_type="latent"``, with the model's
    norm and activation) or V-JEPA 2's attentive pool (``"attentive"``: :class:`~vitrel.layers.AttentivePool`, its
    ``attn_pool_depth`` blocks); ``attn_pool_num_heads`` and ``attn_pool_mlp_ratio`` (None: the blocks') either's."""
    num_heads, mlp_ratio = args["attn_pool_num_heads"] or heads, args["attn_pool_mlp_ratio"] or args["mlp_ratio"]
    if args["attn_pool_type"] == "attentive":
        return AttentivePool(dim, num_heads, mlp_ratio, depth=args["attn_pool_depth"])
    act = ACTIVATIONS[args["act_layer"]]
    return AttentionPoolLatent(dim, num_heads=num_heads, mlp_ratio=mlp_ratio, norm_layer=norm, act_layer=act)


def channels_first(x: Tensor) -> Tensor:
    """A channels-last map ``[B, *grid, C]`` -> ``[B, C, *grid]``."""
    return x.movedim(-1, 1).contiguous()


class ViTBody(BlockStack):
    """The ViT after its embedding (the model sets ``patch_embed``, ``grid``, ``num_prefix_tokens``, ``cls_token``
    and ``reg_token`` (None or absent: none), has ``embed(x) -> (tokens, grid)``, then calls :meth:`init_body`): the
    blocks, the final norms and head, the prefix tokens' init, pooling, the intermediates and pruning."""

    global_pools = ("token", "avg", "max", "avgmax", "map", "")  # timm's ViT's
    no_weight_decay_params = ("cls_token", "reg_token")
    cls_token: nn.Parameter | None
    attn_pool: nn.Module | None
    global_pool: str
    vitrel_cfg: dict[str, Any]

    def init_body(self, rel: PosSpec | None, absolute: PosSpec | None, args: Mapping[str, Any]) -> None:
        """From the constructor's arguments ``args`` (its ``locals()``), in this order: the absolute embedding (if any)
        and its dropout, ``rel_pos`` (the scheme the blocks share, ``pos_share``), the ``depth`` blocks, timm's
        ``feature_info``, the norms (``fc_norm`` after pooling: None means for ``"avg"``, ``"max"`` and ``"avgmax"``, as
        timm), ``attn_pool`` (``global_pool="map"``: timm's ``AttentionPoolLatent``, built as timm's ViT builds it) and
        the head.
        Schemes are built for the model's ``grid`` and prefix tokens; a block's own also gets its (index, depth)."""
        embed_dim, heads, depth, impl = args["embed_dim"], args["num_heads"], args["depth"], args["attn_impl"]
        pos_depth = depth if args.get("pos_depth") is None else args["pos_depth"]
        check_late_prefix(args.get("prefix_at", 0), pos_depth, depth, self.num_prefix_tokens, rel.name)
        self.prefix_at = args.get("prefix_at", 0)  # (0: the prefix tokens from the input)
        make_pos = functools.partial(
            PosSpec.build,
            num_heads=heads,
            head_dim=embed_dim // heads,
            grid=self.grid,
            num_prefix_tokens=self.prefix_in(0),
            embed_dim=embed_dim,
        )
        self.abs_pos = make_pos(absolute) if absolute is not None else None
        after = None if self.abs_pos is None else self.abs_pos.after_block
        if after is not None and after >= depth:
            raise ValueError(
                f"{self.abs_pos.name} goes after block {after} (after_block={after}), but the model has {depth} blocks "
                f"(0 to {depth - 1})"
            )
        self.pos_drop = nn.Dropout(args["pos_drop_rate"])
        if args["pre_norm"] and self.prefix_at:
            raise ValueError(
                "pre_norm normalises the tokens before block 0, prefix_at lets the prefix join later: give one"
            )
        norm = make_norm(args["norm_layer"], args["norm_eps"])  # (every norm of the model's: LayerNorm or RmsNorm)
        # timm's pre_norm (CLIP's ln_pre): a norm of the input tokens, after the absolute embedding
        self.norm_pre = norm(embed_dim) if args["pre_norm"] else nn.Identity()
        self.rel_pos = make_pos(rel) if args["pos_share"] else None
        check_shared(self.rel_pos)
        check_choice(impl, self.rel_pos)  # (the blocks check their own schemes)
        dpr = calculate_drop_path_rates(args["drop_path_rate"], depth)
        kv_heads = args["num_kv_heads"]  # (one for every block, or one each)
        self.blocks = nn.ModuleList(
            [
                Block(
                    embed_dim,
                    heads,
                    pos=(SHARED if args["pos_share"] else make_pos(rel, layer=(i, depth))) if i < pos_depth else "none",
                    grid=self.grid,
                    num_prefix_tokens=self.prefix_in(i),
                    mlp_ratio=args["mlp_ratio"],
                    qkv_bias=args["qkv_bias"],
                    init_values=args["init_values"],
                    proj_drop=args["proj_drop_rate"],
                    attn_drop=args["attn_drop_rate"],
                    drop_path=dpr[i],
                    norm_eps=args["norm_eps"],
                    attn_impl=impl,
                    mlp_layer=args["mlp_layer"],
                    mlp_norm=args["mlp_norm"],
                    act_layer=args["act_layer"],
                    post_norm=args["post_norm"],
                    qk_norm=args["qk_norm"],
                    attn_norm=args["attn_norm"],
                    norm_layer=args["norm_layer"],
                    num_kv_heads=kv_heads[i] if isinstance(kv_heads, Sequence) else kv_heads,
                    attn_only_layer_scale=args["attn_only_layer_scale"],
                )
                for i in range(depth)
            ]
        )
        # timm's feature metadata: one feature per block, at the patch stride
        patch = args["patch_size"]
        self.feature_info = [dict(module=f"blocks.{i}", num_chs=embed_dim, reduction=patch) for i in range(depth)]
        fc_norm = args["fc_norm"]
        use_fc_norm = args["global_pool"] in ("avg", "max", "avgmax") if fc_norm is None else fc_norm
        final = args["final_norm"]  # (timm's final_norm=False: neither norm)
        self.norm = norm(embed_dim) if final and not use_fc_norm else nn.Identity()
        self.attn_pool = make_attn_pool(args, embed_dim, heads, norm) if args["global_pool"] == "map" else None
        self.fc_norm = norm(embed_dim) if final and use_fc_norm else nn.Identity()
        self.pool_include_prefix = args["pool_include_prefix"]  # timm's (False: the pools reduce the patch tokens)
        self.head_drop = nn.Dropout(args["drop_rate"])
        self.head = nn.Linear(embed_dim, args["num_classes"]) if args["num_classes"] > 0 else nn.Identity()

    def init_weights(self, mode: str = "", needs_reset: bool = True) -> None:
        super().init_weights(mode, needs_reset)  # type: ignore[misc]
        if needs_reset:  # (copied from a model built afresh, tokens included)
            return
        for tok in (self.cls_token, getattr(self, "reg_token", None)):
            if tok is not None:
                nn.init.normal_(tok, std=1e-6)

    # ---------------------------------------------------------------------------- timm surface
    def check_global_pool(self, global_pool: str) -> None:
        super().check_global_pool(global_pool)  # type: ignore[misc]
        if global_pool == "token" and self.cls_token is None:
            raise ValueError("global_pool='token' needs a class token")
        if global_pool == "map" and self.attn_pool is None:
            raise ValueError(
                "global_pool='map' needs the attention pool (attn_pool) built with the model: create the model with "
                "global_pool='map' (timm's reset_classifier cannot add one either)"
            )

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """timm's: a new head (:meth:`TimmSurface.reset_classifier`); another ``global_pool`` than ``"map"`` removes
        the attention pool, which cannot be added (``global_pool="map"`` needs a model built with it)."""
        super().reset_classifier(num_classes, global_pool)  # type: ignore[misc]
        if global_pool not in (None, "map"):
            self.attn_pool = None

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        return dict(
            stem=r"^cls_token|^reg_token|^abs_pos|^rel_pos|^patch_embed",
            blocks=[(r"^blocks\.(\d+)", None), (r"^norm", (99999,))],  # (timm's: the final norm with the last block)
        )

    def pool(self, x: Tensor) -> Tensor:
        """Tokens ``[B, P + N, C]`` -> ``[B, C]`` as timm's ViT: the class token, or the patch tokens reduced
        (``"avg"``, ``"max"``, ``"avgmax"``, ``"map"``: :func:`~vitrel.models.pooling.pool_tokens`; the prefix tokens
        too with ``pool_include_prefix``); ``""``: as they are."""
        if self.global_pool == "token":
            return x[:, 0]
        p = 0 if self.pool_include_prefix else self.num_prefix_tokens
        if self.global_pool == "avg":
            return x[:, p:].mean(dim=1)
        if self.global_pool:
            return pool_tokens(x[:, p:], self.global_pool, attn_pool=self.attn_pool)
        return x

    def pooled(self, x: Tensor) -> Tensor:
        return self.fc_norm(self.pool(x))

    # ---------------------------------------------------------------------------- forward
    def grid_features(self, x: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
        """Inputs of one grid -> normalised tokens ``[B, P + N, C]``: the embedding, the blocks (their states
        prepared once per forward; timm's ``attn_mask`` / ``is_causal``:
        :func:`~vitrel.models.timm_surface.timm_attn_mask`), the final norm."""
        x, grid = self.embed(x)  # type: ignore[attr-defined]
        mask = timm_attn_mask(attn_mask, is_causal, x, self.vitrel_cfg["num_heads"])
        for y in self.run_blocks(x, grid, self.position_states(grid, x), mask=mask):
            x = y
        return self.norm(x)

    def grid_intermediates(
        self,
        x: Tensor,
        take: list[int],
        depth: int,
        norm: bool,
        output_fmt: str,
        return_prefix_tokens: bool,
        intermediates_only: bool,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
    ) -> list[Any] | tuple[Tensor, list[Any]]:
        """``forward_intermediates`` on inputs of one grid: the outputs of blocks ``take`` of the first ``depth``
        (normalised with ``norm``), patch tokens as maps ``[B, C, *grid]`` (``NCHW`` / ``NCTHW``), ``[B, *grid, C]``
        (``NHWC`` / ``NTHWC``) or tokens (``NLC``), paired with the prefix tokens if asked; and the final normalised
        tokens. ``attn_mask`` / ``is_causal``: as :meth:`grid_features`'."""
        x, grid = self.embed(x)  # type: ignore[attr-defined]
        mask = timm_attn_mask(attn_mask, is_causal, x, self.vitrel_cfg["num_heads"])
        feats, prefix = [], []  # (before prefix_at the prefix tokens have not joined: [B, 0, C])
        for i, y in enumerate(self.run_blocks(x, grid, self.position_states(grid, x, depth), depth, mask)):
            x = y
            if i in take:
                y, p = self.norm(x) if norm else x, self.prefix_in(i)
                feats.append(y[:, p:])
                prefix.append(y[:, :p])
        # channels first by transposing the tokens before the reshape: a reshape of the sliced tokens to the grid
        # makes torch.export assume a batch (and sides) of at least 2, so a program would refuse a single image
        if output_fmt.startswith("NC"):
            feats = [y.transpose(1, 2).reshape(y.shape[0], y.shape[-1], *grid) for y in feats]
        elif output_fmt != "NLC":
            feats = [y.reshape(y.shape[0], *grid, y.shape[-1]) for y in feats]
        if return_prefix_tokens and self.num_prefix_tokens:
            feats = list(zip(feats, prefix))
        if intermediates_only:
            return feats
        return self.norm(x), feats

    def prune_intermediate_layers(
        self, indices: int | list[int] = 1, prune_norm: bool = False, prune_head: bool = True
    ) -> list[int]:
        """timm's ``prune_intermediate_layers``: drop the blocks after the last of ``indices`` (and the final
        norm / the head if asked); returns the absolute indices kept."""
        take, _ = self.prune_trunk(indices)  # type: ignore[attr-defined]
        self.vitrel_cfg["depth"] = len(self.blocks)
        if self.prefix_at and self.prefix_at >= len(self.blocks):  # no block left to join: no prefix (timm's ConViT)
            self.cls_token = self.reg_token = None
            self.num_prefix_tokens, self.num_reg_tokens, self.has_class_token, self.prefix_at = 0, 0, False, 0
            self.vitrel_cfg.update(class_token=False, reg_tokens=0, prefix_at=0)
            prune_head = prune_head or self.global_pool == "token"
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.fc_norm = nn.Identity()
            self.reset_classifier(0, "")  # type: ignore[attr-defined]
        return take


class SwinBody:
    """The Swin's stage stack ``layers`` (each stage with ``grad_checkpointing``), its final ``norm`` and head:
    gradient checkpointing, timm's layer groups, the stage intermediates and pruning (image and video Swin)."""

    layers: nn.Sequential
    norm: nn.Module
    vitrel_cfg: dict[str, Any]
    feature_info: list[dict[str, Any]]

    def init_stages(
        self, stage_cls: type[nn.Module], rel: PosSpec | None, absolute: PosSpec | None, window: tuple[int, ...],
        dims: list[int], args: Mapping[str, Any],
    ) -> None:  # fmt: skip
        """From the constructor's arguments ``args`` (its ``locals()``), in this order: the absolute embedding (if any,
        on the patch grid ``grid``; one placed after a block, CPE's, goes to every stage instead) and its dropout, the
        stages (``stage_cls``: each but the first merging 2 x 2
        patches in space, widths ``dims``), timm's ``feature_info``, the final norm and the head."""
        depths, heads, eps = args["depths"], args["num_heads"], args["norm_eps"]
        self._attn_impl = args["attn_impl"]
        self.abs_pos = (
            absolute.build(num_heads=heads[0], head_dim=dims[0] // heads[0], grid=self.grid)
            if absolute is not None
            else None
        )
        placed = None  # an absolute scheme placed after a block (CPE): one in every stage, at its width (Twins')
        if self.abs_pos is not None and self.abs_pos.after_block is not None:
            placed, self.abs_pos = absolute, None
        self.pos_drop = nn.Dropout(args["pos_drop_rate"])
        dpr = calculate_drop_path_rates(args["drop_path_rate"], sum(depths))
        stages, g = [], self.grid
        for i in range(len(depths)):
            if i > 0:
                g = g._replace(h=(g.h + 1) // 2, w=(g.w + 1) // 2)  # (patch merging pads odd sides)
            stages.append(
                stage_cls(
                    dims[i - 1] if i > 0 else dims[0],
                    dims[i],
                    depths[i],
                    heads[i],
                    window,
                    build_grid=g,
                    downsample=i > 0,
                    pos=rel,
                    abs_pos=placed,
                    pos_share=args["pos_share"],
                    mlp_ratio=args["mlp_ratio"],
                    qkv_bias=args["qkv_bias"],
                    proj_drop=args["proj_drop_rate"],
                    attn_drop=args["attn_drop_rate"],
                    drop_path=dpr[sum(depths[:i]) : sum(depths[: i + 1])],
                    layers=(sum(depths[:i]), sum(depths)),
                    norm_eps=eps,
                    attn_impl=args["attn_impl"],
                    post_norm=args.get("post_norm", False),  # (Swin V2's blocks; the Video Swin has neither)
                    cosine_attn=args.get("cosine_attn", False),
                )
            )
        self.layers = nn.Sequential(*stages)  # as timm's Swin (its FeatureDictNet flattens a Sequential)
        patch = args["patch_size"]
        self.feature_info = [
            dict(num_chs=dims[i], reduction=patch * 2**i, module=f"layers.{i}") for i in range(len(depths))
        ]
        self.norm = nn.LayerNorm(dims[-1], eps=eps)
        self.head_drop = nn.Dropout(args["drop_rate"])
        self.head = nn.Linear(dims[-1], args["num_classes"]) if args["num_classes"] > 0 else nn.Identity()

    @property
    def attn_impl(self) -> str:
        """The model's kernel: setting it sets every stage's (:class:`~vitrel.models.blocks.BlockImpls`), every layer
        checked before any is changed, as the ViT's."""
        return self._attn_impl

    @attn_impl.setter
    def attn_impl(self, impl: str) -> None:
        for stage in self.layers:  # every stage checked before any is changed
            stage.check_attn_impl(impl)
        for stage in self.layers:
            stage.attn_impl = impl
        self._attn_impl = impl
        record_attn_impl(self, impl)

    @property
    def num_layers(self) -> int:
        """timm's Swin's ``num_layers``: the number of stages (after pruning, those kept)."""
        return len(self.layers)

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        for stage in self.layers:
            stage.grad_checkpointing = enable

    @property
    def grad_checkpointing(self) -> bool:
        return any(s.grad_checkpointing for s in self.layers)

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        return dict(
            stem=r"^patch_embed|^abs_pos",
            blocks=r"^layers\.(\d+)"
            if coarse
            else [
                (r"^layers\.(\d+)\.(?:downsample|rel_pos|abs_pos)", (0,)),  # (a stage's own schemes: its first group)
                (r"^layers\.(\d+)\.\w+\.(\d+)", None),
                (r"^norm", (99999,)),
            ],
        )

    def stage_intermediates(
        self, x: Tensor, take: list[int], stages: nn.Module, norm: bool, to_channels_first: bool,
        intermediates_only: bool,
    ) -> list[Tensor] | tuple[Tensor, list[Tensor]]:  # fmt: skip
        """``forward_intermediates`` from the embedded map ``x``: the output maps of stages ``take`` (channels-first
        if asked), ``norm`` applying the final norm to the last stage's (the only one it is sized for), and the final
        normalised map when every stage ran."""
        last = len(self.layers) - 1
        feats = []
        for i, stage in enumerate(stages):
            x = stage(x)
            if i in take:
                y = self.norm(x) if norm and i == last else x
                feats.append(channels_first(y) if to_channels_first else y)
        if intermediates_only:
            return feats
        if len(stages) == len(self.layers):
            x = self.norm(x)  # the final norm is sized for (and applied to) the last stage only
        return x, feats

    def prune_intermediate_layers(
        self, indices: int | list[int] = 1, prune_norm: bool = False, prune_head: bool = True
    ) -> list[int]:
        """timm's ``prune_intermediate_layers``: drop the stages after the last of ``indices`` (the final norm
        and the head go with them, or when asked); returns the absolute indices kept."""
        n = len(self.layers)
        take, max_index = self.prune_trunk(indices)  # type: ignore[attr-defined]
        prune_end = max_index < n - 1
        if prune_norm or prune_end:
            self.norm = nn.Identity()
        for key in ("depths", "num_heads"):
            self.vitrel_cfg[key] = list(self.vitrel_cfg[key])[: max_index + 1]
        if prune_end:
            self.num_features = self.head_hidden_size = self.feature_info[max_index]["num_chs"]
        if prune_head or prune_end:
            self.reset_classifier(0, "")  # type: ignore[attr-defined]
        return take
