"""Building blocks shared by the backbones: patch embedding, the pre-norm transformer block, and the
helpers around a model's position schemes (their states, absolute embeddings, weight decay).

Pre-norm block (Dosovitskiy et al. 2021), layer scale ``gamma`` (Touvron et al. 2021), ``DropPath`` (Huang 2016)::

    x <- x + DropPath(gamma_1 * Attention(LN(x), grid, mask))
    x <- x + DropPath(gamma_2 * MLP(LN(x)))

Position schemes come in two kinds (``PositionScheme.kind``): ``"absolute"`` ones are applied once to the tokens after
the patch embedding (``scheme.add_to_tokens``; with ``after_block = k``, to block ``k``'s output: CPE's place),
``"relative"`` ones live inside the attention layers, either one per block or one module owned by the model and shared
by all blocks (``pos_share``). The model parses ``pos=`` / ``abs_pos=`` once (:func:`~vitrel.pos.registry.parse_pos`),
builds the schemes and prepares every block's state once per forward, for ``blk(x, pos_state=state)``.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import nullcontext
from typing import Any

import torch
from timm.layers import DropPath, LayerScale, SwiGLU, register_notrace_function, to_2tuple
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from vitrel.kernels import check_choice, resolve
from vitrel.layers.attention import Attention
from vitrel.layers.mlp import make_mlp
from vitrel.layers.norms import make_norm
from vitrel.layout.geometry import Grid, Grid3, as_grid
from vitrel.layout.tokens import TokenLayout
from vitrel.pos.base import PositionScheme, PosState
from vitrel.pos.registry import PosSpec

__all__ = [
    "PatchEmbed",
    "square_patch",
    "TubeletEmbed",
    "clip_grid",
    "Block",
    "BlockImpls",
    "BlockStack",
    "constructor_config",
    "scheme_no_weight_decay",
    "init_weights_",
    "patch_grid",
    "add_abs_pos",
    "prepare_state",
    "prepare_states",
    "with_placement",
]


def constructor_config(cls: type, args: Mapping[str, Any], **normalised: Any) -> dict[str, Any]:
    """What rebuilds a model: its constructor arguments taken from ``args`` (the constructor's
    ``locals()``), ``normalised`` replacing some by their JSON-able forms. Placement arguments
    (``device``, ``dtype``) are not part of the configuration; a position spec is stored in its plain form."""
    names = [n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "device", "dtype")]
    out = {n: normalised[n] if n in normalised else args[n] for n in names}
    return {n: v.plain if isinstance(v, PosSpec) else v for n, v in out.items()}


def check_shared(pos: PositionScheme | None) -> None:
    """Warn when a scheme shared by all blocks (``pos_share=True``) would vary from block to block: the shared one is
    built for no block (LookHere's ``layer_slopes``: every block takes the first slope)."""
    why = None if pos is None else pos.layer_dependence()
    if why:
        warnings.warn(
            f"pos_share=True shares one {pos.name} among the blocks but its {why}: every block takes the first "
            "block's (give one value for all, or pos_share=False)",
            stacklevel=3,
        )


def scheme_no_weight_decay(model: nn.Module) -> set[str]:
    """Full names of the parameters of every scheme in ``model`` matched by its ``no_weight_decay_keys``."""
    out: set[str] = set()
    for mname, m in model.named_modules():
        if not isinstance(m, PositionScheme) or not m.no_weight_decay_keys:
            continue
        for pname, _ in m.named_parameters():
            if any(key in pname for key in m.no_weight_decay_keys):
                out.add(f"{mname}.{pname}" if mname else pname)
    return out


def init_weights_(model: nn.Module) -> None:
    """timm's ViT init: trunc-normal(0.02) Linear weights, zero biases; LayerNorm to (1, 0).

    Modules inside a position scheme keep the scheme's own initialisation; then each scheme initialises the
    projections of the layers it serves (:meth:`~vitrel.pos.base.PositionScheme.init_layer`).
    """
    skip: set[int] = set()
    for m in model.modules():
        if isinstance(m, PositionScheme):
            skip.update(id(s) for s in m.modules())
    for m in model.modules():
        if id(m) in skip:
            continue
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm) and m.elementwise_affine:
            nn.init.ones_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
    for m in model.modules():  # timm's: a SwiGLU's gate starts near zero, its bias at one (after its Linear's init)
        if isinstance(m, SwiGLU):
            m.init_weights()
    for m in model.modules():  # then each scheme's own init of its layers' projections (GPSA's value identity)
        if isinstance(m, Attention) and m.pos is not None:
            m.pos.init_layer(m.qkv)
        shared = getattr(m, "rel_pos", None)  # (a model's or a stage's scheme, for its blocks with pos=SHARED)
        if isinstance(shared, PositionScheme):
            for blk in getattr(m, "blocks", ()):
                if blk.attn.pos is None:
                    shared.init_layer(blk.attn.qkv)


def with_placement(init: Callable[..., None]) -> Callable[..., None]:
    """Give a model's ``__init__`` timm's keyword-only ``device=`` / ``dtype=`` arguments.

    The model is built under ``torch.device(device)`` (so ``device="meta"`` allocates nothing) and
    converted to ``dtype`` at the end; neither is passed to ``init`` (so neither lands in ``vitrel_cfg``).
    """

    @functools.wraps(init)
    def wrapper(self: nn.Module, *args: Any, device: Any = None, dtype: torch.dtype | None = None, **kwargs: Any):
        unknown = sorted(set(kwargs) - set(sig.parameters))
        if unknown and not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
            raise TypeError(_unknown_arguments(type(self).__name__, unknown, kwargs, sig))
        with torch.device(device) if device is not None else nullcontext():
            init(self, *args, **kwargs)
        if dtype is not None:
            self.to(dtype=dtype)

    sig = inspect.signature(init)
    extra = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None) for n in ("device", "dtype")]
    wrapper.__signature__ = sig.replace(parameters=[*sig.parameters.values(), *extra])  # type: ignore[attr-defined]
    return wrapper


#: why an argument of one backbone is not one of another (or not a constructor's)
_OTHER_BACKBONE = {
    "grad_checkpointing": "not built in: model.set_grad_checkpointing(); train.py: module.grad_checkpointing=true",
    "token_drop": "NaViT token dropping is the image ViT's (vitrel_vit_*): this model attends over every token",
    "class_token": "the ViT's",
    "reg_tokens": "the ViT's",
    "depth": "the ViT's (the Swin takes depths per stage)",
    "depths": "the Swin's (the ViT takes depth)",
    "window_size": "the Swin's",
    "dynamic_img_pad": "timm's image ViT's (vitrel_vit_*); timm's Swin takes none either",
}


def _unknown_arguments(cls: str, unknown: list[str], kwargs: dict[str, Any], sig: inspect.Signature) -> str:
    """The message for constructor arguments a model does not take, with the value given and, for another backbone's
    argument, whose it is (``experiment=fmnist_naflex model=<a Swin>`` set ``token_drop``)."""
    whose = {k: f" ({_OTHER_BACKBONE[k]})" if k in _OTHER_BACKBONE else "" for k in unknown}
    given = ", ".join(f"{k}={kwargs[k]!r}{whose[k]}" for k in unknown)
    known = ", ".join(n for n in sig.parameters if n != "self")
    return f"{cls} got unexpected argument(s) {given}; its arguments: {known}"


# ---------------------------------------------------------------------------- modules
class PatchEmbed(nn.Module):
    """Non-overlapping ``p x p`` patches -> ``C`` channels by a strided convolution (timm's ``PatchEmbed``).

    The grid is read from the input at call time (``H // p, W // p``): ``img_size`` only documents the
    size the model was built for. ``dynamic_img_pad=True`` (timm's): an image whose sides are not multiples of ``p``
    is zero-padded on the right and bottom to the next multiple first (grid ``ceil(H / p) x ceil(W / p)``); without
    it such an image is refused. ``patch_size`` is timm's ``(p, p)`` pair (square patches only: vitrel's position
    schemes and NaFlex patches are square). Returns ``[B, H', W', C]`` (``flatten=False``) or ``[B, H' W', C]``
    and the grid. ``bias=False``: a projection without a bias (timm's with ``pre_norm``: CLIP's, the Perception
    Encoder's).
    """

    #: what the error for an image of no whole patches adds (the Swin's embedding, which cannot pad, says nothing)
    pad_hint = ": build the model with dynamic_img_pad=True to zero-pad it to whole patches (timm's), or resize it"

    def __init__(
        self,
        patch_size: int | tuple[int, int] = 16,
        in_chans: int = 3,
        embed_dim: int = 768,
        norm_layer: type[nn.Module] | None = None,
        flatten: bool = True,
        dynamic_img_pad: bool = False,
        bias: bool = True,
    ) -> None:
        super().__init__()
        self.patch_size = square_patch(patch_size)
        self.flatten = flatten
        self.dynamic_img_pad = bool(dynamic_img_pad)
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=self.patch_size, stride=self.patch_size, bias=bias)
        self.norm = norm_layer(embed_dim) if norm_layer is not None else nn.Identity()
        self.img_size: tuple[int, int] | None = None  # timm's: the size the model is built for (the model sets it)

    @property
    def grid_size(self) -> tuple[int, int] | None:
        """timm's: the patch grid of ``img_size`` (None before the model sets it)."""
        return None if self.img_size is None else self.dynamic_feat_size(self.img_size)

    @property
    def num_patches(self) -> int | None:
        """timm's: the patches of ``img_size``."""
        return None if self.grid_size is None else self.grid_size[0] * self.grid_size[1]

    def feat_ratio(self, as_scalar: bool = True) -> int | tuple[int, int]:
        """timm's: the feature map's stride (``as_scalar=False``: per side)."""
        return max(self.patch_size) if as_scalar else self.patch_size

    def dynamic_feat_size(self, img_size: tuple[int, int]) -> tuple[int, int]:
        """timm's: the grid of images of ``img_size`` (rounded up with ``dynamic_img_pad``, else down)."""
        (h, w), (ph, pw) = img_size, self.patch_size
        return (-(-h // ph), -(-w // pw)) if self.dynamic_img_pad else (h // ph, w // pw)

    def grid_for(self, img_size: tuple[int, int]) -> Grid:
        return _grid_for(img_size, self.patch_size[0], self.dynamic_img_pad, self.pad_hint)

    def forward(self, x: Tensor) -> tuple[Tensor, Grid]:
        p = self.patch_size[0]
        grid = patch_grid(x, p, self.proj.in_channels, self.dynamic_img_pad, self.pad_hint)
        if self.dynamic_img_pad:
            x = pad_to_patches(x, grid, p)
        x = self.proj(whole_cells(x, grid, self.patch_size))  # [B, C, H', W']
        x = x.flatten(2).transpose(1, 2) if self.flatten else x.permute(0, 2, 3, 1)  # [B, H' W', C] or [B, H', W', C]
        return self.norm(x), grid


def square_patch(patch_size: Any) -> tuple[int, int]:
    """timm's ``(p, p)`` of an int or a pair; a non-square pair is refused (vitrel's position schemes, coordinates and
    NaFlex patches take one side)."""
    ph, pw = to_2tuple(patch_size)
    if ph < 1 or pw < 1:
        raise ValueError(f"patch_size must be positive, got {patch_size}")
    if ph != pw:
        raise ValueError(f"patch_size {(ph, pw)}: vitrel's patch embeddings take square patches only (one int)")
    return int(ph), int(pw)


def pad_to_patches(x: Tensor, grid: Grid, p: int) -> Tensor:
    """Images ``x [B, C, H, W]`` zero-padded on the right and bottom to ``grid`` patches of ``p`` (timm's
    ``dynamic_img_pad``)."""
    return F.pad(x, (0, grid.w * p - x.shape[-1], 0, grid.h * p - x.shape[-2]))


class TubeletEmbed(nn.Module):
    """Non-overlapping ``t x p x p`` tubelets of a clip -> ``C`` channels by a strided 3-D convolution (VideoMAE's
    tubelet embedding; ``t = tubelet_size``, ``p = patch_size``).

    Clips ``[B, C, T, H, W]`` (VideoMAE's layout). The grid is read from the clip at call time
    (``Grid3(T // t, H // p, W // p)``). Returns tokens ``[B, T' H' W', C]`` t-major (``index = (t H' + h) W' + w``,
    ``flatten=True``) or the map ``[B, T', H', W', C]``, and the grid. ``bias``: as :class:`PatchEmbed`'s.
    """

    def __init__(
        self,
        patch_size: int = 16,
        tubelet_size: int = 2,
        in_chans: int = 3,
        embed_dim: int = 768,
        norm_layer: type[nn.Module] | Callable[[int], nn.Module] | None = None,
        flatten: bool = True,
        bias: bool = True,
    ) -> None:
        super().__init__()
        if patch_size < 1 or tubelet_size < 1:
            raise ValueError(f"patch_size and tubelet_size must be positive, got {patch_size}, {tubelet_size}")
        self.patch_size, self.tubelet_size = patch_size, tubelet_size
        self.flatten = flatten
        self.strict_img_size = False  # timm's builder reads it (fixed_input_size): any clip size runs
        k = (tubelet_size, patch_size, patch_size)
        self.proj = nn.Conv3d(in_chans, embed_dim, kernel_size=k, stride=k, bias=bias)
        self.norm = norm_layer(embed_dim) if norm_layer is not None else nn.Identity()

    def grid_for(self, num_frames: int, img_size: tuple[int, int]) -> Grid3:
        return _clip_grid_for(num_frames, img_size, self.tubelet_size, self.patch_size)

    def forward(self, x: Tensor) -> tuple[Tensor, Grid3]:
        grid = clip_grid(x, self.tubelet_size, self.patch_size, self.proj.in_channels)
        x = self.proj(whole_cells(x, grid, (self.tubelet_size, self.patch_size, self.patch_size)))
        x = x.flatten(2).transpose(1, 2) if self.flatten else x.permute(0, 2, 3, 4, 1)  # t-major tokens, or the map
        return self.norm(x), grid


@register_notrace_function  # (torch.fx: the grid is a proxy there, and nothing is exported)
def whole_cells(x: Tensor, grid: tuple[int, ...], cells: tuple[int, ...]) -> Tensor:
    """``x [B, C, *sides]`` as it is; under ``torch.export`` split into ``grid`` cells of ``cells`` and merged back,
    so that a runtime that keeps none of the program's guards (ONNX Runtime) refuses sides that are not whole cells
    (a strided convolution would drop the remainder) where eager and the ``.pt2`` refuse them."""
    if not torch.compiler.is_exporting():
        return x
    return x.reshape(*x.shape[:2], *(v for g, c in zip(tuple(grid), cells) for v in (g, c))).reshape(x.shape)


def _clip_grid_for(num_frames: int, img_size: tuple[int, int], t: int, p: int) -> Grid3:
    if num_frames % t or num_frames < t:
        raise ValueError(f"{num_frames} frames are not a positive multiple of the tubelet size {t}")
    g = _grid_for(img_size, p)
    return Grid3(num_frames // t, g.h, g.w)


def _grid_for(img_size: tuple[int, int], p: int, pad: bool = False, hint: str = "") -> Grid:
    """The grid of images of ``img_size`` in patches of ``p``: rounded up with ``pad`` (timm's ``dynamic_img_pad``),
    else the sides must be multiples of ``p`` (an error ending with ``hint``, what to do)."""
    h, w = img_size
    if pad and h >= 1 and w >= 1:
        return Grid((h + p - 1) // p, (w + p - 1) // p)  # (not -(-h // p): ONNX's Div truncates negatives)
    if h % p or w % p or h < p or w < p:
        raise ValueError(f"image size {h}x{w} is not a positive multiple of the patch size {p}{hint}")
    return Grid(h // p, w // p)


# The shape logic of a forward pass lives in a few functions that torch.fx records as single calls
# (timm's ``register_notrace_function``): the grid of an image, an absolute embedding, a scheme's
# state. torch.export / torch.compile trace through them with symbolic sizes.
@register_notrace_function
def patch_grid(x: Tensor, patch_size: int, in_chans: int, pad: bool = False, hint: str = "") -> Grid:
    """The patch grid of images ``x [B, in_chans, H, W]`` (a clear error for another layout or size; ``pad``: sides
    rounded up to whole patches, ``hint``: what the error for a size of no whole patches adds)."""
    if x.dim() != 4 or x.shape[1] != in_chans:
        raise ValueError(f"expected images [B, {in_chans}, H, W], got {tuple(x.shape)}")
    return _grid_for((x.shape[-2], x.shape[-1]), patch_size, pad, hint)


@register_notrace_function
def clip_grid(x: Tensor, tubelet_size: int, patch_size: int, in_chans: int) -> Grid3:
    """The tubelet grid of clips ``x [B, in_chans, T, H, W]`` (a clear error for another layout or size, and for a
    list of images or a NaFlex dict: token layouts are the image models')."""
    if not isinstance(x, Tensor):
        raise ValueError(
            f"a video model takes clips [B, {in_chans}, T, H, W] as one tensor, got a {type(x).__name__}: lists of "
            "images and NaFlex dicts are for the image models (docs/video.md)"
        )
    if x.dim() != 5 or x.shape[1] != in_chans:
        raise ValueError(f"expected clips [B, {in_chans}, T, H, W] (VideoMAE's layout), got {tuple(x.shape)}")
    return _clip_grid_for(x.shape[2], (x.shape[-2], x.shape[-1]), tubelet_size, patch_size)


@register_notrace_function
def add_abs_pos(scheme: PositionScheme, x: Tensor, grid: Grid | TokenLayout, num_prefix_tokens: int) -> Tensor:
    """``scheme.add_to_tokens`` on tokens ``[B, P + H W, C]`` or on a map ``[B, H, W, C]`` (no prefix); on tokens laid
    out by a :class:`~vitrel.layout.tokens.TokenLayout`, each token gets its own image's embedding (resampled to that
    image's grid, as NaFlex does)."""
    if isinstance(grid, TokenLayout):
        return scheme.add_to_layout(x, grid)
    if x.dim() == 4:
        b, h, w, c = x.shape
        return scheme.add_to_tokens(x.reshape(b, h * w, c), grid, 0).view(b, h, w, c)
    return scheme.add_to_tokens(x, grid, num_prefix_tokens)


def drops_weights(blocks) -> bool:
    """Whether any of ``blocks``' attention drops weights in this forward (``auto`` then picks a kernel that does)."""
    return any(blk.attn.drops_weights for blk in blocks)


def _num_tokens(grid: Grid | TokenLayout, num_prefix_tokens: int) -> int:
    return grid.num_tokens if isinstance(grid, TokenLayout) else num_prefix_tokens + as_grid(grid).n


@register_notrace_function
def prepare_state(
    scheme: PositionScheme, grid: Grid, num_prefix_tokens: int, like: Tensor, impl: str = "auto", dropout: bool = False
) -> PosState:
    """``scheme.prepare`` for tokens like ``like`` (their device and dtype) and the kernel of ``attn_impl`` ``impl``
    (:func:`vitrel.kernels.resolve`; ``dropout``: the attention drops weights). ``grid``: a grid or a
    :class:`~vitrel.layout.tokens.TokenLayout`."""
    kernel = resolve(impl, scheme, _num_tokens(grid, num_prefix_tokens), like.device, dropout, like.dtype)
    return scheme.prepare(grid, num_prefix_tokens, like.device, like.dtype, kernel)


@register_notrace_function
def prepare_states(
    schemes: list[PositionScheme], grid: Grid, num_prefix_tokens: int, like: Tensor, impls: list[str],
    dropout: bool = False,
) -> list[PosState]:  # fmt: skip
    """The states of the blocks' own schemes for one forward, ``impls[i]`` block ``i``'s ``attn_impl``
    (:meth:`PositionScheme.prepare_all`: runs of schemes of one class and kernel prepared together, RoPE-Mixed computes
    every block's cos/sin in one product). ``grid``: a grid or a :class:`~vitrel.layout.tokens.TokenLayout`."""
    n = _num_tokens(grid, num_prefix_tokens)
    kernels = [resolve(impl, s, n, like.device, dropout, like.dtype) for s, impl in zip(schemes, impls, strict=True)]
    return PositionScheme.prepare_all(schemes, grid, num_prefix_tokens, like.device, like.dtype, kernels)


class BlockImpls:
    """``attn_impl`` of a module with a ``rel_pos`` (None: no shared scheme) and ``blocks``: setting it checks it
    against every scheme, then sets it on every block's attention (a block's own may then be set apart)."""

    _attn_impl: str

    @property
    def attn_impl(self) -> str:
        return self._attn_impl

    def check_attn_impl(self, impl: str) -> None:
        """Raise unless the shared scheme and every block can run kernel ``impl`` (nothing is changed)."""
        check_choice(impl, self.rel_pos)
        for blk in self.blocks:
            check_choice(impl, blk.attn.pos, blk.attn.attn_drop)

    @attn_impl.setter
    def attn_impl(self, impl: str) -> None:
        self.check_attn_impl(impl)  # every block checked before any is changed
        for blk in self.blocks:
            blk.attn.attn_impl = impl
        self._attn_impl = impl
        record_attn_impl(self, impl)


def record_attn_impl(model: Any, impl: str) -> None:
    """A model's kernel set after it was built, into its configuration (``vitrel_cfg``, what checkpoints and exports
    store and loading rebuilds); a part without one (a Swin stage) records nothing."""
    cfg = getattr(model, "vitrel_cfg", None)
    if isinstance(cfg, dict) and "attn_impl" in cfg:
        cfg["attn_impl"] = impl


class BlockStack(BlockImpls):
    """The block loop of a model whose ``blocks`` all attend over one token grid (the ViT, the video ViT): each
    block's scheme state prepared once per forward (the shared ``rel_pos``'s, or the blocks' own together) and the
    blocks run in turn, checkpointed in training with ``grad_checkpointing``. The model sets ``blocks``, ``rel_pos``,
    ``abs_pos``, ``num_prefix_tokens`` and ``grad_checkpointing``; ``prefix_at > 0`` (ConViT's class token, which
    joins after its GPSA blocks) makes the prefix tokens join before block ``prefix_at``, the blocks before it
    attending over the patch tokens alone."""

    blocks: nn.ModuleList
    rel_pos: PositionScheme | None
    abs_pos: PositionScheme | None
    num_prefix_tokens: int
    grad_checkpointing: bool
    cls_token: nn.Parameter | None  # (and ``reg_token``, the registers, where the model has them)
    prefix_at: int = 0

    def prefix_in(self, i: int) -> int:
        """The number of prefix tokens ahead of the patch tokens in block ``i``'s input and output (0 before
        ``prefix_at``); ``i = 0`` for the embedded input."""
        return self.num_prefix_tokens if i >= self.prefix_at else 0

    def run_blocks(
        self,
        x: Tensor,
        grid: Any,
        states: Any,
        depth: int | None = None,
        mask: Tensor | None = None,
        join: Callable[[Tensor], tuple[Tensor, Any]] | None = None,
    ) -> Iterator[Tensor]:
        """The first ``depth`` blocks (all for None) on ``x`` (on ``grid``: a grid or a token layout) in turn, block
        ``i`` with ``states[i]`` (indexed: under a torch.fx trace ``states`` is one recorded call) and ``mask`` (timm's
        ``attn_mask``), each checkpointed in training with ``grad_checkpointing``; an absolute scheme placed after a
        block (``abs_pos.after_block``, CPE's) added to that block's output; before block ``prefix_at`` (if not 0),
        ``join(x) -> (tokens with the prefix, their grid or layout)`` (default: the prefix tokens put ahead,
        ``add_prefix``). Yields every block's output (with it). The one block loop of the ViTs."""
        ckpt = self.grad_checkpointing and torch.is_grad_enabled() and not torch.jit.is_scripting()
        after = None if self.abs_pos is None else self.abs_pos.after_block
        if self.prefix_at and mask is not None:
            raise ValueError(
                f"timm's attn_mask / is_causal cover one token count, but the prefix tokens join before block "
                f"{self.prefix_at} (prefix_at): give no attn_mask to a model built with prefix_at"
            )
        for i, blk in enumerate(self.blocks[:depth] if depth is not None else self.blocks):
            if i and i == self.prefix_at:
                x, grid = join(x) if join is not None else (self.block_input(x, i), grid)
            st = states[i]
            x = checkpoint(blk, x, None, mask, st, use_reentrant=False) if ckpt else blk(x, None, mask, st)
            if i == after:
                x = add_abs_pos(self.abs_pos, x, grid, self.prefix_in(i))
            yield x

    def block_input(self, x: Tensor, i: int) -> Tensor:
        """Block ``i``'s input on a grid from block ``i - 1``'s output ``x`` (for ``i = 0``: the embedded tokens): the
        prefix tokens put ahead before block ``prefix_at``, as :meth:`run_blocks` does."""
        return self.add_prefix(x) if i and i == self.prefix_at else x

    def add_prefix(self, x: Tensor) -> Tensor:
        """Patch tokens ``[B, N, C]`` -> ``[B, P + N, C]``, the model's prefix tokens (class token, registers) ahead."""
        toks = [t for t in (self.cls_token, getattr(self, "reg_token", None)) if t is not None]
        toks = [t.expand(x.shape[0], -1, -1) for t in toks]
        return torch.cat([*toks, x], dim=1) if toks else x

    def input_abs_pos(self, x: Tensor, grid: Any) -> Tensor:
        """Tokens ``x`` on ``grid`` (a grid or a token layout) with the absolute scheme added if its place is the input
        (``after_block`` None; else :meth:`run_blocks` adds it)."""
        if self.abs_pos is None or self.abs_pos.after_block is not None:
            return x
        return add_abs_pos(self.abs_pos, x, grid, self.prefix_in(0))

    def position_states(
        self, grid: Any, like: Tensor, depth: int | None = None, joined: Any = None
    ) -> list[PosState | None]:
        """The state of each of the first ``depth`` blocks (all for None) for one forward: the shared scheme's state for
        the blocks that share it, the blocks' own schemes prepared together (``prepare_states``). ``grid``: an image or
        video grid, or a :class:`~vitrel.layout.tokens.TokenLayout`; ``joined``: the layout once the prefix tokens
        joined (``prefix_at``; default ``grid``)."""
        blocks = list(self.blocks[:depth] if depth is not None else self.blocks)
        k = self.prefix_at or len(blocks)
        early = self._states(blocks[:k], grid, self.prefix_in(0), like)
        if k >= len(blocks):
            return early
        late = self._states(blocks[k:], grid if joined is None else joined, self.num_prefix_tokens, like)
        return [early[i] for i in range(k)] + [late[i] for i in range(len(blocks) - k)]  # (indexed: torch.fx's too)

    def _states(self, blocks: list[nn.Module], grid: Any, p: int, like: Tensor) -> list[PosState | None]:
        own = [blk.attn for blk in blocks if blk.attn.pos is not None]
        dropout = drops_weights(self.blocks)
        # (an attn_impl set on a built layer honoured)
        states = prepare_states([a.pos for a in own], grid, p, like, [a.attn_impl for a in own], dropout) if own else []
        if len(own) == len(blocks):
            return states  # (one call: one node of a torch.fx trace)
        shared = prepare_state(self.rel_pos, grid, p, like, self.attn_impl, dropout)  # (pos_share's blocks)
        out, j = [], 0
        for blk in blocks:
            out.append(shared if blk.attn.pos is None else states[j])
            j += blk.attn.pos is not None
        return out


class Block(nn.Module):
    """Pre-norm transformer block: ``x + DP(ls1(Attn(LN x))) ; x + DP(ls2(MLP(LN x)))``; ``post_norm``: ``LN(Attn x)``,
    ``LN(MLP x)``. ``pos``: the block's own scheme (a module its model built, or a name or config), or ``"shared"``
    (:data:`~vitrel.layers.SHARED`) when the model owns the scheme and passes its state to ``forward``."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        pos: Any = "none",
        grid: Any = (14, 14),
        num_prefix_tokens: int = 0,
        mlp_ratio: float = 4.0,
        qkv_bias: bool | str = True,
        init_values: float | None = None,
        proj_drop: float = 0.0,
        attn_drop: float = 0.0,
        drop_path: float = 0.0,
        norm_eps: float = 1e-6,
        layer: tuple[int, int] | None = None,
        attn_impl: str = "auto",
        mlp_layer: str = "mlp",
        mlp_norm: bool = False,
        act_layer: str = "gelu",
        post_norm: bool = False,
        cosine_attn: bool = False,
        qk_norm: bool = False,
        attn_norm: bool = False,
        norm_layer: str = "layernorm",
        num_kv_heads: int | None = None,
        attn_only_layer_scale: bool = False,
    ) -> None:
        super().__init__()
        self.post_norm = post_norm  # each branch normalised after it (Swin V2's res-post-norm, timm's ResPostBlock)
        norm = make_norm(norm_layer, norm_eps)
        self.norm1 = norm(dim)
        options = dict(cosine=cosine_attn, qk_norm=qk_norm, attn_norm=attn_norm, norm_layer=norm_layer)
        self.attn = Attention(
            dim,
            num_heads,
            pos=pos,
            grid=as_grid(grid),
            num_prefix_tokens=num_prefix_tokens,
            num_kv_heads=num_kv_heads,
            qkv_bias=qkv_bias,
            attn_drop=attn_drop,
            proj_drop=proj_drop,
            layer=layer,
            attn_impl=attn_impl,
            norm_eps=norm_eps,
            **options,
        )
        self.ls1 = LayerScale(dim, init_values=init_values) if init_values else nn.Identity()
        self.drop_path1 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.norm2 = norm(dim)
        self.mlp = make_mlp(mlp_layer, dim, int(dim * mlp_ratio), proj_drop, norm if mlp_norm else None, act_layer)
        both = init_values and not attn_only_layer_scale  # (timm's EVA: layer scale on the attention branch only)
        self.ls2 = LayerScale(dim, init_values=init_values) if both else nn.Identity()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()

    def forward(
        self, x: Tensor, grid: Any = None, mask: Tensor | None = None, pos_state: PosState | None = None
    ) -> Tensor:
        """``x [B, N, C]`` on ``grid``, or on the grid ``pos_state`` was prepared for (what a model passes)."""
        x = x + self.drop_path1(self.ls1(self.branch(self.norm1, lambda y: self.attn(y, grid, mask, pos_state), x)))
        return x + self.drop_path2(self.ls2(self.branch(self.norm2, self.mlp, x)))

    def branch(self, norm: nn.Module, f: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
        """A residual branch: ``f(norm(x))``, or ``norm(f(x))`` with ``post_norm``."""
        return norm(f(x)) if self.post_norm else f(norm(x))

    def attn_input(self, x: Tensor) -> Tensor:
        """What the attention reads of the block's input ``x``: ``norm1(x)``, or ``x`` with ``post_norm``."""
        return x if self.post_norm else self.norm1(x)
