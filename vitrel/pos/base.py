"""The position-scheme protocol, its registry and the per-forward position state.

A position scheme is an ``nn.Module`` that the attention module calls through a few hooks, each
a no-op by default, so the attention module never knows a scheme by name:

* ``bias(grid, num_prefix_tokens) -> [heads, N, N] | None``: an additive logit term that depends
  only on the two tokens' positions (Swin tables, factored tables, CPB, buckets, ALiBi).
* ``rotation(grid, num_prefix_tokens, device, dtype) -> (cos, sin) | None`` and
  ``rotate(q, k, state) -> (q, k)``: a rotation of queries and keys (RoPE); the default ``rotate`` turns the
  interleaved pairs by ``rotation``'s ``(cos, sin)``.
* ``content_logits(q, state) -> [B, heads, N, N] | None`` and
  ``content_values(attn, state) -> [B, heads, N, head_dim] | None``: the content-aware terms of Shaw
  et al., ``q_i . r^K_{ij}`` and ``sum_j a_ij r^V_{ij}``; ``content_key_logits(k, state)``, a term of the keys'
  content, ``k_j . r^Q_{ji}`` (iRPE on queries).
* ``attend(q, k, v, mask, scale, state, dropout_p=0.0) -> out``: the fused forward. The default runs
  the state's ``kernel`` (:mod:`vitrel.kernels`: the bias in SDPA's float mask, folded,
  FlexAttention, or the one eager path for schemes with content terms); a scheme may override it with
  its own fast path.
* ``mix(attn, mask, state) -> attn``: the attention weights ``[B, heads, N, N]`` after the softmax, mixed with a
  distribution of the scheme's own before they weigh the values (GPSA's gated positional attention;
  ``mixes_weights``: the eager kernel's). ``mask`` is the additive mask the softmax had (a layout's images included).
* ``add_to_tokens(x, grid, num_prefix_tokens) -> x``: absolute schemes add their embedding to the
  tokens once (``kind == "absolute"``), at the input of the network or, with ``after_block = k``, after block
  ``k`` (CPE); ``add_to_layout(x, layout)`` the same on packed or dropped tokens.
* ``augment(x, q, k, state) -> (q', k')``: for a term computed from the layer's input
  tokens ``x`` (PaPE's parabolas), channels appended to the (rotated) queries and keys, so that
  ``q'_i . k'_j = q_i . k_j + term_ij`` (``has_token_terms``; the attention layer calls it after
  ``rotate``, so ``attend`` and the eager logits see ``q'`` and ``k'``).

**Position state.** ``prepare(grid, num_prefix_tokens, device, dtype, kernel) -> PosState`` computes what
depends on the grid alone (RoPE's cos/sin, the position inputs the kernel reads) once; the attention layer
chooses the kernel (:func:`vitrel.kernels.resolve`) and hands it over, so a scheme never picks one. The state
carries the grid and prefix count it was prepared for, so the hooks that run in the forward (``rotate``,
``augment``, ``content_*``, ``attend``) take the state alone. A model whose blocks share one scheme calls it
once per forward and passes the state to every block (``blk(x, grid, pos_state=state)``), as timm passes
``shared_rel_pos`` and DINOv3 its RoPE ``(sin, cos)``; an attention layer with a scheme of its own prepares it
itself. Nothing is stored on the modules during a forward.

**Capabilities** are declared, not inferred: ``kind`` (``"relative"`` / ``"absolute"``),
``family`` (see :data:`FAMILIES`), ``has_bias``, ``has_rotation``, ``has_content_terms``,
``has_token_terms`` and ``mixes_weights``.

**Offsets.** One sign convention everywhere: the offset of query ``i`` to key ``j`` is
``d_ij = p_i - p_j`` (``dh_ij = row_i - row_j``, ``dw_ij = col_i - col_j``; ``p = row * W + col``
for the 1-D schemes), as in Swin's relative index.

Token layout everywhere: ``num_prefix_tokens`` class/register tokens first, then the ``H x W``
patch tokens in raster order. Prefix tokens carry no position: every relative term between a
prefix token and any other token is zero and RoPE leaves them unrotated.

Adding a scheme is one file in ``vitrel/pos/schemes/`` with a class decorated by ``@register_pos(name)``
(:mod:`vitrel.pos.registry`), one YAML file in ``conf/pos/``, one test file and a row in the README's table
(docs/schemes.md). The grid geometry lives
in :mod:`vitrel.layout.geometry`, the attention kernels in :mod:`vitrel.kernels` (a layer above: this package
imports none).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NamedTuple, Protocol

import torch
from torch import Tensor, nn

from vitrel.layout.geometry import Grid, Grid3, as_grid, as_grid3, check_tokens, expand_offset_table, grid_str
from vitrel.layout.tokens import TokenLayout, gather_pairs, gather_tokens, segment_mask
from vitrel.pos.rotation import apply_rope

__all__ = ["FAMILIES", "KernelLike", "PositionScheme", "PosState"]


#: The families of :attr:`PositionScheme.family`, in display order.
FAMILIES = ("none", "absolute", "learned bias", "fixed bias", "rotary", "content", "content bias", "gated")


class KernelLike(Protocol):
    """What a scheme reads of an attention kernel (a class of :mod:`vitrel.kernels`, whose ``Kernel`` base has these
    members): its name, the position inputs it reads and builds, what it refuses, whether it takes token layouts,
    and how it attends a state."""

    name: str
    reads: frozenset[str]
    takes_layout: bool

    def refuses(self, scheme: PositionScheme) -> str | None: ...

    def inputs(self, scheme: PositionScheme, grid: Grid, num_prefix_tokens: int) -> dict[str, Any]: ...

    def layout_inputs(self, scheme: PositionScheme, layout: TokenLayout, mask: Tensor) -> dict[str, Any]: ...

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, state: PosState, dropout_p: float
    ) -> Tensor: ...


#: The hooks whose first argument is a grid.
GRID_HOOKS = ("bias", "offset_table", "bias_factors", "rotation")


def _plain_grid(hook: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(hook)
    def run(self: PositionScheme, grid: Any, *args: Any, **kwargs: Any) -> Any:
        return hook(self, self.check_grid(grid) if type(grid) in (tuple, list, int) else grid, *args, **kwargs)

    return run


class PositionScheme(nn.Module):
    """Base class and protocol of every position scheme (see the module docstring).

    Subclasses take ``num_heads, head_dim, grid, num_prefix_tokens, embed_dim`` plus their own
    keyword options, override the hooks they need and declare their capabilities.
    """

    name: ClassVar[str] = "base"
    #: ``"relative"`` (acts inside attention) or ``"absolute"`` (adds an embedding to the tokens)
    kind: ClassVar[str] = "relative"
    #: one of :data:`FAMILIES`
    family: ClassVar[str] = "none"
    #: ``bias`` returns a tensor
    has_bias: ClassVar[bool] = False
    #: ``rotate`` rotates queries and keys
    has_rotation: ClassVar[bool] = False
    #: ``rotate`` applies ``state.rope`` as the default ``rotate`` and the fused rotation of ``attn_impl="triton"``
    #: read it (``(cos, sin)`` of interleaved pairs; also ``(cos, sin, P)``, ``(R,)``: ``vitrel.kernels.triton.rope``),
    #: so such a kernel may apply it in its place; a scheme that keeps the default ``rotate`` needs not declare it
    standard_rotation: ClassVar[bool] = False
    #: ``content_logits`` / ``content_values`` / ``content_key_logits`` return tensors (Shaw, iRPE)
    has_content_terms: ClassVar[bool] = False
    #: ``augment`` appends channels computed from the layer's input tokens to q and k (PaPE)
    has_token_terms: ClassVar[bool] = False
    #: ``mix`` mixes the attention weights with a distribution of the scheme's own (GPSA's gated positional
    #: attention): no single softmax computes it, so only the eager kernel runs the scheme
    mixes_weights: ClassVar[bool] = False
    #: prefix tokens have a position of their own (PaPE's class token at the origin): pairs with a prefix
    #: token get a position term, so they are not translation invariant
    prefix_positioned: ClassVar[bool] = False
    #: takes ``causal=`` (a causal ``Attention`` passes ``causal=True``)
    causal_aware: ClassVar[bool] = False
    #: the terms between two patches depend on the grid's extent, not only on their offsets (or, for
    #: RoPE, their row and column): raster-order 1-D schemes (``p = row * W + col``), normalised coordinates
    depends_on_extent: ClassVar[bool] = False
    #: the function at a call's grid is chosen by comparing that grid with the built one (a table resized only on
    #: a larger grid, a RoPE factor ``max(1, L' / L)``): a ``torch.export`` program of a ViT traced at one grid
    #: holds only at the sizes of that branch, so ``vitrel.export.best_dynamic`` gives it ``"batch"``
    size_branches: ClassVar[bool] = False
    #: a ``relative`` scheme whose patch<->patch terms depend on the offset only approximately (LieRE's
    #: non-commuting generators); the translation test measures, and documents, the violation instead
    exactly_relative: ClassVar[bool] = True
    #: ``bias_factors`` returns ``(u, w)`` with ``bias = u @ w^T`` (``attn_impl="fold"``)
    has_bias_factors: ClassVar[bool] = False
    #: ``offset_table`` returns ``T [heads, 2H-1, 2W-1]``, the bias by offset (``attn_impl="flex"``)
    has_offset_table: ClassVar[bool] = False
    #: the offset table has ``-inf`` entries (keys outside a head's view, LookHere): flex gets a block mask
    #: from them, so the kernel skips the blocks no query of a block can see
    has_masked_offsets: ClassVar[bool] = False
    #: the grids the scheme reads: 2 (images, ``(H, W)``), 3 (video, ``(T, H, W)``; an image grid is one frame) or
    #: None (any, as given: ``none`` reads no position, ``ape`` builds a table for either)
    grid_dims: ClassVar[int | None] = 2
    #: ``add_to_tokens`` reads the tokens (CPE's convolution), not their positions alone: the scheme has no
    #: embedding of its own to draw, and ``add_to_layout`` must see the tokens
    embeds_content: ClassVar[bool] = False
    #: an absolute scheme's place in a ViT: None adds it at the input, ``k`` to block ``k``'s output (an instance
    #: attribute for a scheme with the option, CPE's)
    after_block: int | None = None
    #: Parameter-name fragments that must get no weight decay.
    no_weight_decay_keys: ClassVar[tuple[str, ...]] = ()
    #: Old option names still read from older configs (``old -> new``; ``tables.take_renamed``).
    renamed_options: ClassVar[dict[str, str]] = {}

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        grid: Grid,
        num_prefix_tokens: int = 0,
        embed_dim: int | None = None,
        layer: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        if num_heads < 1 or head_dim < 1:
            raise ValueError(f"num_heads and head_dim must be positive, got {num_heads}, {head_dim}")
        if num_prefix_tokens < 0:  # (a negative count cropped the patches' bias rows instead)
            raise ValueError(f"num_prefix_tokens must be >= 0, got {num_prefix_tokens}")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.grid = self.check_grid(grid)
        self.num_prefix_tokens = num_prefix_tokens
        self.embed_dim = embed_dim if embed_dim is not None else num_heads * head_dim
        # (index, number of layers) of the block this scheme serves; None for a scheme shared by all blocks
        self.layer = None if layer is None else (int(layer[0]), int(layer[1]))

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """The hooks that take a grid first (:data:`GRID_HOOKS`) also take it as a user writes it, ``(7, 7)``:
        a plain tuple, list or int becomes the scheme's grid (:meth:`check_grid`); the model's ``Grid``, ``Grid3``
        and ``TokenLayout`` pass as they are."""
        super().__init_subclass__(**kwargs)
        for name in GRID_HOOKS:
            if name in cls.__dict__:
                setattr(cls, name, _plain_grid(cls.__dict__[name]))

    def layer_dependence(self) -> str | None:
        """What makes the scheme's terms differ from block to block (the ``layer`` it is built for), as a phrase;
        None when nothing does. One scheme shared by all blocks (``pos_share=True``) is built for none."""
        return None

    @classmethod
    def check_grid(cls, grid: Any) -> Grid | Grid3:
        """``grid`` as the scheme reads it (:attr:`grid_dims`): a video grid given to an image scheme is refused,
        naming the schemes that take one; an image grid given to a video scheme is one frame."""
        g = as_grid(grid)
        if cls.grid_dims == 3:
            return as_grid3(g)
        if cls.grid_dims == 2 and isinstance(g, Grid3):
            video = sorted(c.name for c in _subclasses(PositionScheme) if c.grid_dims in (3, None) and c.name != "base")
            raise ValueError(
                f"pos={cls.name!r} takes image grids (H, W), not the video grid {grid_str(g)}: use a scheme that "
                f"takes (T, H, W): {', '.join(video)}"
            )
        return g

    # ----------------------------------------------------------------- hooks (no-op defaults)
    def bias(self, grid: Grid, num_prefix_tokens: int = 0) -> Tensor | None:
        """Additive logit term ``[heads, N, N]`` (N = prefix + H*W), or None."""
        return None

    def offset_table(self, grid: Grid) -> Tensor | None:
        """``T [heads, 2H-1, 2W-1]`` with ``bias[h, i, j] = T[h, dh_ij + H - 1, dw_ij + W - 1]`` for patch pairs
        (``d = p_i - p_j``; pairs with a prefix token get 0), or None: the bias read by offset, so a kernel
        (FlexAttention's ``score_mod``) needs no ``N x N`` tensor. Declared by ``has_offset_table``. A video scheme's
        (``grid_dims == 3``) is ``T [heads, 2T-1, 2H-1, 2W-1]``, read at ``(dt + T - 1, dh + H - 1, dw + W - 1)``."""
        return None

    def bias_factors(self, grid: Grid, num_prefix_tokens: int = 0) -> tuple[Tensor, Tensor] | None:
        """``(u, w)``, each ``[heads, N, r]``, with ``bias = u @ w^T`` exactly (a bias of rank ``r``), or None.

        ``attn_impl="fold"`` appends ``u / scale`` to the queries and ``w`` to the keys, so attention needs
        no bias mask: ``[q, u/s] . [k, w] * s = q . k * s + u . w``."""
        return None

    def draw(self) -> Tensor | None:
        """A forward's random draw (DINOv3's coordinate augmentation), shared by its images and blocks; or None."""
        return None

    def rotation(
        self, grid: Grid, num_prefix_tokens: int, device: torch.device | None, dtype: torch.dtype | None, draw=None
    ) -> tuple[Tensor, Tensor] | None:
        """RoPE's ``(cos, sin)`` for ``grid`` (what ``rotate`` applies), or None; ``draw``: :meth:`draw`'s."""
        return None

    def rotate(self, q: Tensor, k: Tensor, state: PosState) -> tuple[Tensor, Tensor]:
        """``q, k [B, heads, N, d]`` rotated by the state's ``rope`` (``has_rotation``), or ``(q, k)`` without one. The
        default turns the interleaved pairs ``(x_2t, x_2t+1)`` by ``rotation``'s ``(cos, sin)``, each ``[N, d/2]`` or
        ``[heads, N, d/2]`` (:func:`~vitrel.pos.rotation.apply_rope`); a scheme with another rotation overrides it."""
        if state.rope is None:
            return q, k
        if len(state.rope) != 2:
            raise ValueError(
                f"{self.name}: the default rotate() applies rotation()'s (cos, sin), got {len(state.rope)} tensors: "
                "define rotate() for another rotation"
            )
        cos, sin = (t.to(q.device) for t in state.rope)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    @classmethod
    def fusable_rotation(cls) -> bool:
        """Whether a kernel that applies ``state.rope`` itself (``fused_rotation``) computes this scheme's ``rotate``:
        the default ``rotate``, or one declared ``standard_rotation``."""
        return cls.has_rotation and (cls.standard_rotation or cls.rotate is PositionScheme.rotate)

    @classmethod
    def defines(cls, hook: str) -> bool:
        """Whether the class overrides ``hook`` (a method of :class:`PositionScheme`: ``"content_key_logits"``, ...)."""
        return getattr(cls, hook) is not getattr(PositionScheme, hook)

    @property
    def content_terms(self) -> frozenset[str]:
        """Which of ``content_logits`` / ``content_key_logits`` / ``content_values`` return tensors: by default those
        the class defines; a scheme whose options turn a term off names fewer (packed batches skip the others)."""
        return frozenset(h for h in ("content_logits", "content_key_logits", "content_values") if self.defines(h))

    def content_logits(self, q: Tensor, state: PosState) -> Tensor | None:
        """Unscaled content-position logits ``[B, heads, N, N]`` (added to ``q k^T``), or None."""
        return None

    def content_values(self, attn: Tensor, state: PosState) -> Tensor | None:
        """Extra output ``[B, heads, N, head_dim]`` from attention probabilities, or None."""
        return None

    def content_key_logits(self, k: Tensor, state: PosState) -> Tensor | None:
        """Unscaled logits ``[B, heads, N, N]`` from the keys' content (added to ``q k^T``; entry ``(i, j)`` a function
        of ``k_j`` and the pair's positions), or None."""
        return None

    def mix(self, attn: Tensor, mask: Tensor | None, state: PosState) -> Tensor:
        """``attn [B, heads, N, N]`` (the softmax's weights under ``mask``) mixed with the scheme's own weights
        (``mixes_weights``), or as it is."""
        return attn

    def init_layer(self, qkv: nn.Linear) -> None:
        """Initialise the ``qkv`` projection (rows q, k, v) of a layer the scheme serves, over timm's ViT init (the
        layer calls it when built, the models' init after theirs): by default nothing; GPSA's makes v the identity."""

    def add_to_tokens(self, x: Tensor, grid: Grid, num_prefix_tokens: int = 0) -> Tensor:
        """``x [B, P + N, C]`` with the embedding added to its patch tokens (``kind == "absolute"``); ``x`` as it is
        by default."""
        return x

    def add_to_layout(self, x: Tensor, layout: TokenLayout) -> Tensor:
        """:meth:`add_to_tokens` on tokens ``[B, N, C]`` laid out by ``layout``: each token gets its own image's
        embedding at that image's grid (resampled as NaFlex does). The default computes ``add_to_tokens`` of zeros on
        each distinct grid, which holds for an embedding of the positions alone; a scheme that reads the tokens
        (``embeds_content``) overrides it."""
        p = layout.num_prefix_tokens
        embs = [self.add_to_tokens(x.new_zeros(1, p + g.n, x.shape[-1]), g, p)[0] for g in layout.grids]
        return x + gather_tokens(embs, layout.to(x.device), axis=0)[:, 0]

    def augment(self, x: Tensor, q: Tensor, k: Tensor, state: PosState) -> tuple[Tensor, Tensor]:
        """``x [B, N, C]`` (the attention layer's input), ``q, k [B, heads, N, d]`` -> ``(q', k')`` with channels
        appended (``has_token_terms``), or ``(q, k)``."""
        return q, k

    # ------------------------------------------------------------------------ position state
    def prepare(
        self,
        grid: Any,
        num_prefix_tokens: int = 0,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        kernel: KernelLike | None = None,
        draw: Tensor | None = None,
    ) -> PosState:
        """What depends on the grid alone, computed once: RoPE's cos/sin (``rotation``) and the position inputs
        ``kernel`` reads (:mod:`vitrel.kernels`: the dense bias, its factors, the offset table, ...).

        ``device`` / ``dtype`` are those of the tokens the state will be used with. ``kernel`` is the attention kernel
        the state is for, a class of :mod:`vitrel.kernels` (``vitrel.kernels.get_kernel(name)``, or what
        :func:`vitrel.kernels.resolve` chooses for ``attn_impl``); a kernel that cannot run the scheme raises here. With
        None the state holds the dense bias (what ``sdpa``, ``eager`` and ``shaw`` read) and no kernel: the attention
        layer it is given to binds it to its own (:meth:`bind`). ``grid``: a grid or a
        :class:`~vitrel.layout.tokens.TokenLayout`. ``draw``: the forward's random draw (:meth:`draw`).
        """
        self.check_kernel(kernel)
        draw = self.draw() if draw is None else draw  # (one for the forward: every image of a layout too)
        if isinstance(grid, TokenLayout):
            return self._prepare_layout(grid, device, dtype, kernel, draw=draw)
        grid, p = self.check_grid(grid), num_prefix_tokens
        rope = self.rotation(grid, p, device, dtype, *([draw] if draw is not None else []))  # (own schemes: no draw)
        return PosState(self, grid, p, rope=rope, kernel=kernel, **self.kernel_inputs(kernel, grid, p))

    def check_kernel(self, kernel: KernelLike | None) -> None:
        if kernel is None:
            return
        why = kernel.refuses(self)
        if why is not None:
            raise ValueError(why)

    def kernel_inputs(self, kernel: KernelLike | None, grid: Grid, p: int) -> dict[str, Any]:
        """The state's fields ``kernel`` reads on a full grid; the dense bias without a kernel. A bias or offset table
        of another shape than the protocol's is a ``ValueError`` naming the hook (it would fail deep inside a kernel,
        or broadcast)."""
        fields = {"bias": self.bias(grid, p)} if kernel is None else kernel.inputs(self, grid, p)
        n = p + grid.n
        _check_shape(self, "bias", fields.get("bias"), (n, n), "N = prefix + patches: pad_prefix adds the prefix's")
        axes = (1, *grid) if self.grid_dims == 3 and len(grid) == 2 else tuple(grid)  # (an image: one frame)
        _check_shape(self, "offset_table", fields.get("table"), tuple(2 * s - 1 for s in axes), "2s-1 offsets an axis")
        if not torch.is_grad_enabled():  # (a parameter's view made so has no grad_fn: torch's module hooks assert)
            fields = {k: v.detach() if isinstance(v, Tensor) and v.requires_grad else v for k, v in fields.items()}
        return fields

    def layout_bias(self, layout: TokenLayout, mask: Tensor) -> Tensor:
        """The dense bias ``[B, heads | 1, N, N]`` of tokens laid out by ``layout``: each image's bias gathered at its
        tokens' pairs plus ``mask``, the layout's block-diagonal float mask (only the mask for a scheme without bias).
        """
        if not self.has_bias:
            return mask
        bias = gather_pairs([self.bias(g, layout.num_prefix_tokens) for g in layout.grids], layout)
        return bias.to(mask.dtype) + mask

    def bind(
        self,
        state: PosState,
        kernel: KernelLike,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> PosState:
        """``state`` (this scheme's) for ``kernel``: as it is when it was prepared for it, or when it holds the dense
        bias and ``kernel`` reads that alone; else its kernel inputs built anew for tokens of ``device`` / ``dtype``
        (its rotation kept)."""
        if state.kernel is kernel:
            return state
        self.check_kernel(kernel)
        dense = state.kernel is None or state.kernel.reads <= {"bias"}
        if dense and kernel.reads <= {"bias"}:
            return state._replace(kernel=kernel)
        if state.layout is not None:
            return self._prepare_layout(state.layout, device, dtype, kernel, state.rope)
        cleared = dict.fromkeys(("bias", "factors", "table", "block_mask"))
        fields = self.kernel_inputs(kernel, state.grid, state.num_prefix_tokens)
        return state._replace(kernel=kernel, **{**cleared, **fields})

    def rotation_axes(self, rope: tuple[Tensor, ...]) -> tuple[int | None, ...]:
        """The token axis of each tensor of ``rotation``'s result (None: a tensor with no token axis, e.g. STRING's
        basis), for :func:`~vitrel.layout.tokens.gather_tokens`. Default: every tensor ``[..., N, x]``."""
        return (-2,) * len(rope)

    def _prepare_layout(
        self,
        layout: TokenLayout,
        device: torch.device | None,
        dtype: torch.dtype | None,
        kernel: KernelLike | None,
        rope: tuple[Tensor, ...] | None = None,
        draw: Tensor | None = None,
    ) -> PosState:
        """The state for tokens laid out by ``layout`` (packed images, dropped tokens; :mod:`vitrel.layout.tokens`):
        each distinct image grid prepared as a forward on that grid alone prepares it, each token reading its own
        image's terms, and tokens of different images masked from each other (``rope``: the rotation, when known)."""
        if self.grid_dims == 3:
            raise ValueError(
                f"pos={self.name!r} takes full video grids (T, H, W): token layouts (NaFlex dicts, packed or "
                "token-dropped images) are not supported for video schemes"
            )
        if kernel is not None and not kernel.takes_layout:
            raise ValueError(
                f"attn_impl={kernel.name!r} does not take packed or token-dropped layouts (NaFlex dicts, lists of "
                "images of different sizes): use attn_impl='sdpa' or 'flex' for them"
            )
        p = layout.num_prefix_tokens
        layout = layout.to(device)
        grids = layout.grids
        extent = Grid(max(g.h for g in grids), max(g.w for g in grids))
        mask = segment_mask(layout, dtype or torch.float32)
        given = [draw] if draw is not None else []  # (a scheme of one's own need not take it)
        rots = [self.rotation(g, p, device, dtype, *given) for g in grids] if rope is None else [None]
        if rots[0] is not None:
            axes = self.rotation_axes(rots[0])
            rope = tuple(
                rots[0][i] if ax is None else gather_tokens([r[i] for r in rots], layout, ax)
                for i, ax in enumerate(axes)
            )
        grid_states: tuple[PosState, ...] = ()
        if self.has_content_terms:  # Shaw's terms: computed per image on its own grid (vitrel.layout.tokens.regrid_*)
            grid_states = tuple(PosState(self, g, p) for g in grids)
        fields = (
            {"bias": self.layout_bias(layout, mask)} if kernel is None else kernel.layout_inputs(self, layout, mask)
        )
        grid = fields.pop("grid", extent)  # (a kernel may lay the images out on another extent: flex's tables)
        return PosState(self, grid, p, rope=rope, kernel=kernel, layout=layout, grid_states=grid_states, **fields)

    @classmethod
    def prepare_many(
        cls,
        schemes: Sequence[PositionScheme],
        grid: Any,
        num_prefix_tokens: int = 0,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        kernel: KernelLike | None = None,
    ) -> list[PosState]:
        """The states of several schemes of this class (a model's blocks, each with its own parameters) for
        one forward and one ``kernel``: ``[s.prepare(...) for s in schemes]``. A class whose states are cheaper
        computed together overrides it (RoPE-Mixed: every block's angles in one product, as RoPE-ViT)."""
        return [s.prepare(grid, num_prefix_tokens, device, dtype, kernel) for s in schemes]

    @staticmethod
    def prepare_all(
        schemes: Sequence[PositionScheme],
        grid: Any,
        num_prefix_tokens: int = 0,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        kernels: Sequence[KernelLike | None] | None = None,
    ) -> list[PosState]:
        """The states of a model's blocks' own schemes for one forward (a grid or a ``TokenLayout``), ``kernels[i]``
        block ``i``'s kernel (None: :meth:`prepare`'s dense states): runs of a class and kernel by ``prepare_many``."""
        kernels = [None] * len(schemes) if kernels is None else list(kernels)
        if len(kernels) != len(schemes):
            raise ValueError(f"{len(schemes)} schemes and {len(kernels)} kernels")
        states: list[PosState] = []
        i = 0
        while i < len(schemes):
            j = i + 1
            while j < len(schemes) and type(schemes[j]) is type(schemes[i]) and kernels[j] is kernels[i]:
                j += 1
            states += type(schemes[i]).prepare_many(schemes[i:j], grid, num_prefix_tokens, device, dtype, kernels[i])
            i = j
        return states

    # ------------------------------------------------------------------------ attention
    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, state: PosState, dropout_p=0.0
    ) -> Tensor:
        """Fused attention ``dropout(softmax(q k^T * scale + bias + mask)) v`` for ``[B, heads, N, d]`` inputs.

        ``mask`` is an additive float mask broadcastable to ``[B, heads, N, N]`` (window shift mask, causal
        mask) or None. ``q`` and ``k`` are already rotated. ``state`` (from :meth:`prepare`) carries the bias
        and the grid; the kernel is the state's (:mod:`vitrel.kernels`).
        """
        if state.kernel is None:
            raise ValueError(
                "this position state was prepared without a kernel: prepare it with one "
                "(scheme.prepare(..., kernel=vitrel.kernels.get_kernel('sdpa'))), or give it to an Attention layer"
            )
        return state.kernel.attend(q, k, v, mask, scale, state, dropout_p)

    def state_from(self, state: dict[str, Tensor], stored: PositionScheme) -> dict[str, Tensor]:
        """``state``, the weights of ``stored`` (this scheme built at the size they were saved at), made ready for this
        scheme's load at its own size: as it is by default (learned tables carry their extent in their shape and
        resize as they load); a table whose shape does not tell its grid (``ape``'s flat one) is resampled here."""
        return state

    @classmethod
    def legacy_options(cls, options: dict[str, Any], written_format: int = 1) -> dict[str, Any]:
        """The options that reproduce what a scheme config written under ``vitrel_format``
        ``written_format`` meant (1: vitrel 0.1, which wrote none) where a default or an option's meaning
        changed since; ``vitrel.models.registry`` applies it to stored configs older than its ``FORMAT``. Before
        format 7 a negative ``init_std`` was taken (refused since): it is dropped, the stored weights replace the
        initial values it set."""
        std = options.get("init_std")
        if written_format < 7 and isinstance(std, (int, float)) and std < 0:
            return {k: v for k, v in options.items() if k != "init_std"}
        return options

    def extra_repr(self) -> str:
        return f"name={self.name}, heads={self.num_heads}, grid={tuple(self.grid)}"


def _check_shape(scheme: PositionScheme, hook: str, t: Any, tail: tuple, how: str) -> None:
    """``t``, what ``scheme``'s ``hook`` returned, is ``[heads | 1, *tail]`` (not checked where a size is symbolic:
    comparing would pin a ``torch.export`` program to the example's)."""
    if not isinstance(t, Tensor) or not all(isinstance(s, int) for s in (*t.shape, *tail)):
        return
    if t.dim() != 1 + len(tail) or t.shape[0] not in (1, scheme.num_heads) or tuple(t.shape[1:]) != tail:
        want = ", ".join(map(str, (scheme.num_heads, *tail)))
        raise ValueError(f"{scheme.name}: {hook}() returned {tuple(t.shape)}, expected [{want}] (heads first; {how})")


def _subclasses(cls: type) -> list[type]:
    out = []
    for c in cls.__subclasses__():
        out += [c, *_subclasses(c)]
    return out


class PosState(NamedTuple):
    """A scheme's grid-dependent tensors for one forward (see :meth:`PositionScheme.prepare`).

    ``scheme`` is the scheme that made it (its hooks apply the state); ``bias`` the additive term
    ``[heads, N, N]`` or None; ``rope`` RoPE's ``(cos, sin)`` or None; ``kernel`` the attention kernel it was
    prepared for (a class of :mod:`vitrel.kernels`; None: the dense bias, not bound to a kernel yet).
    """

    scheme: PositionScheme
    grid: Grid
    num_prefix_tokens: int
    bias: Tensor | None = None
    rope: tuple[Tensor, Tensor] | None = None
    #: ``(u, w)`` of a folded bias (``impl="fold"``; then ``bias`` is None)
    factors: tuple[Tensor, Tensor] | None = None
    kernel: Any = None
    #: the bias by offset ``[heads, 2H-1, 2W-1]`` (``impl="flex"``; then ``bias`` is None)
    table: Tensor | None = None
    #: FlexAttention's ``BlockMask`` of the table's ``-inf`` entries (``has_masked_offsets``), or None
    block_mask: Any = None
    #: the tokens' layout (packed images, dropped tokens; :mod:`vitrel.layout.tokens`), None for a full grid. Then
    #: ``grid`` is the largest image extent, ``bias`` ``[B, heads | 1, N, N]`` holds the block-diagonal mask of the
    #: images, per-token tensors (``rope``, ``factors``) have a batch axis, ``table`` one table per distinct grid
    layout: TokenLayout | None = None
    #: the scheme prepared on each of ``layout.grids`` (the content terms computed per image; Shaw)
    grid_states: tuple[PosState, ...] = ()
    #: causal attention, done by the kernel itself (``impl="triton"``: blocks above the diagonal skipped)
    causal: bool = False

    @property
    def impl(self) -> str:
        """The name of the state's kernel (``"auto"`` when it has none yet)."""
        return "auto" if self.kernel is None else self.kernel.name

    def check_tokens(self, n_tokens: int) -> None:
        """Raise if the state was not prepared for ``n_tokens`` tokens."""
        if self.layout is None:
            check_tokens(n_tokens, self.grid, self.num_prefix_tokens)
        elif n_tokens != self.layout.num_tokens:
            raise ValueError(f"the position state's layout has {self.layout.num_tokens} tokens, the input {n_tokens}")

    def full_bias(self) -> Tensor | None:
        """The additive term ``[heads, N, N]``, multiplied out of the factors when folded, expanded from
        the offset table for flex."""
        if self.layout is not None and self.table is not None:
            raise ValueError("the full bias of a flex state on a token layout: prepare it with impl='sdpa' instead")
        if self.factors is not None:
            u, w = self.factors
            uw = u @ w.transpose(-2, -1)
            return uw if self.bias is None else uw + self.bias
        if self.table is not None:
            return expand_offset_table(self.table, self.grid, self.num_prefix_tokens)
        return self.bias
