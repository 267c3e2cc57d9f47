"""The position-scheme protocol, its registry and the per-forward position state.

A position scheme is an ``nn.Module`` that the attention module calls through a few hooks, each
a no-op by default, so the attention module never knows a scheme by name:

* ``bias(grid, num_prefix_tokens) -> [heads, N, N] | None``: an additive logit term that depends
  only on the two tokens' positions (Swin tables, factored tables, CPB, buckets, ALiBi).
* ``rotation(grid, num_prefix_tokens, device, dtype) -> (cos, sin) | None`` and
  ``rotate(q, k, grid, num_prefix_tokens, state=None) -> (q, k)``: a rotation of queries and keys (RoPE).
* ``content_logits(q, grid, num_prefix_tokens) -> [B, heads, N, N] | None`` and
  ``content_values(attn, grid, num_prefix_tokens) -> [B, heads, N, head_dim] | None``: the
  content-aware terms of Shaw et al., ``q_i . r^K_{ij}`` and ``sum_j a_ij r^V_{ij}``.
* ``attend(q, k, v, mask, scale, grid, num_prefix_tokens, state=None, dropout_p=0.0) -> out``: the
  fused forward. The default puts ``bias`` into the float mask of
  ``F.scaled_dot_product_attention`` (or runs the one eager path, :func:`attend_eager`, for
  schemes with content terms); a scheme may override it with its own fast path.
* ``add_to_tokens(x, grid, num_prefix_tokens) -> x``: absolute schemes add their embedding to the
  tokens once, at the input of the network (``kind == "absolute"``).
* ``augment(x, q, k, grid, num_prefix_tokens) -> (q', k')``: for a term computed from the layer's input
  tokens ``x`` (PaPE's parabolas), channels appended to the (rotated) queries and keys, so that
  ``q'_i . k'_j = q_i . k_j + term_ij`` (``has_token_terms``; the attention layer calls it after
  ``rotate``, so ``attend`` and the eager logits see ``q'`` and ``k'``).

**Position state.** ``prepare(grid, num_prefix_tokens, device, dtype) -> PosState`` computes what
depends on the grid alone (the bias, RoPE's cos/sin) once. A model whose blocks share one scheme
calls it once per forward and passes the state to every block (``blk(x, grid, pos_state=state)``),
as timm passes ``shared_rel_pos`` and DINOv3 its RoPE ``(sin, cos)``; an attention layer with a
scheme of its own prepares it itself. Nothing is stored on the modules during a forward.

**Capabilities** are declared, not inferred: ``kind`` (``"relative"`` / ``"absolute"``),
``family`` (see :data:`FAMILIES`), ``has_bias``, ``has_rotation``, ``has_content_terms`` and
``has_token_terms``.

**Offsets.** One sign convention everywhere: the offset of query ``i`` to key ``j`` is
``d_ij = p_i - p_j`` (``dh_ij = row_i - row_j``, ``dw_ij = col_i - col_j``; ``p = row * W + col``
for the 1-D schemes), as in Swin's relative index.

Token layout everywhere: ``num_prefix_tokens`` class/register tokens first, then the ``H x W``
patch tokens in raster order. Prefix tokens carry no position: every relative term between a
prefix token and any other token is zero and RoPE leaves them unrotated.

Adding a scheme is one file in ``vitrel/pos/`` with a class decorated by ``@register_pos(name)``,
one YAML file in ``conf/pos/`` and one test file.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import and_masks, create_block_mask, flex_attention

ATTN_IMPLS = ("auto", "sdpa", "flex", "fold", "eager")

__all__ = [
    "ATTN_IMPLS",
    "attend_flex",
    "attend_folded",
    "expand_offset_table",
    "offset_block_mask",
    "with_causal_blocks",
    "offset_grid",
    "axis_offsets",
    "axis_factors",
    "Grid",
    "PositionScheme",
    "register_pos",
    "build_pos",
    "list_pos",
    "get_pos_class",
    "as_grid",
    "check_tokens",
    "PosState",
    "FAMILIES",
    "merge_masks",
    "eager_logits",
    "attend_eager",
    "UnknownSchemeError",
]


class Grid(NamedTuple):
    """Height and width of a patch grid, in patches."""

    h: int
    w: int

    @property
    def n(self) -> int:
        return self.h * self.w


def as_grid(grid: Any) -> Grid:
    """``int`` (square), ``(h, w)`` or ``Grid`` -> ``Grid``, with a clear error otherwise."""
    if isinstance(grid, Grid):
        return grid
    if isinstance(grid, int):
        g = Grid(grid, grid)
    else:
        try:
            h, w = grid
        except (TypeError, ValueError):
            raise ValueError(f"grid must be an int or a pair (H, W), got {grid!r}") from None
        g = Grid(int(h), int(w))
    if g.h < 1 or g.w < 1:
        raise ValueError(f"grid must have positive sides, got {tuple(g)}")
    return g


def check_tokens(n_tokens: int, grid: Grid, num_prefix_tokens: int) -> None:
    """Raise if ``n_tokens`` is not ``num_prefix_tokens + H * W``."""
    if n_tokens != num_prefix_tokens + grid.n:
        raise ValueError(
            f"grid {grid.h}x{grid.w} with {num_prefix_tokens} prefix token(s) needs "
            f"{num_prefix_tokens + grid.n} tokens, but the input has {n_tokens}"
        )


class UnknownSchemeError(ValueError):
    """A position scheme name that is not registered."""


_REGISTRY: dict[str, type[PositionScheme]] = {}


def register_pos(name: str) -> Callable[[type[PositionScheme]], type[PositionScheme]]:
    """Class decorator: make a scheme buildable as ``build_pos(name, ...)`` and ``pos=name``."""

    def deco(cls: type[PositionScheme]) -> type[PositionScheme]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"position scheme {name!r} is registered twice")
        _REGISTRY[name] = cls
        cls.name = name
        return cls

    return deco


def list_pos(kind: str | None = None) -> list[str]:
    """Names of all registered schemes (optionally only ``"relative"`` or ``"absolute"`` ones)."""
    return sorted(n for n, c in _REGISTRY.items() if kind is None or c.kind == kind)


def get_pos_class(name: str) -> type[PositionScheme]:
    if name not in _REGISTRY:
        raise UnknownSchemeError(f"unknown position scheme {name!r}; known schemes: {', '.join(list_pos())}")
    return _REGISTRY[name]


def build_pos(
    pos: str | dict | PositionScheme | None,
    *,
    num_heads: int,
    head_dim: int,
    grid: Any,
    num_prefix_tokens: int = 0,
    embed_dim: int | None = None,
    **overrides: Any,
) -> PositionScheme:
    """Build a scheme from a name, a config dict (``{"name": ..., **kwargs}``) or pass a module through.

    ``grid`` is the grid the scheme is built for (it sizes learned tables); every scheme still
    runs on any grid at call time.
    """
    if isinstance(pos, PositionScheme):
        return pos
    if pos is None:
        pos = "none"
    if isinstance(pos, str):
        name, kwargs = pos, {}
    elif isinstance(pos, dict) or hasattr(pos, "items"):
        kwargs = dict(pos.items())
        kwargs.pop("_target_", None)
        name = kwargs.pop("name", None)
        if name is None:
            raise ValueError(f"a position config needs a 'name' key, got {dict(pos)}")
    else:
        raise TypeError(f"pos must be a scheme name, a config dict or a PositionScheme, got {type(pos)}")
    cls = get_pos_class(name)
    unknown = sorted(set(kwargs) - scheme_options(cls))
    if unknown:
        raise ValueError(
            f"position scheme {name!r} has no option(s) {unknown}; its options: {sorted(scheme_options(cls))}"
        )
    kwargs.update(overrides)
    return cls(
        num_heads=num_heads,
        head_dim=head_dim,
        grid=as_grid(grid),
        num_prefix_tokens=num_prefix_tokens,
        embed_dim=embed_dim if embed_dim is not None else num_heads * head_dim,
        **kwargs,
    )


def scheme_options(cls: type[PositionScheme]) -> set[str]:
    """The keyword options a scheme class takes (its constructors' along the MRO, minus the sizes every
    scheme gets from the model)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or klass is nn.Module or klass is object:
            continue
        for p in inspect.signature(init).parameters.values():
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self":
                names.add(p.name)
    return (names | set(cls.renamed_options)) - {"num_heads", "head_dim", "grid", "num_prefix_tokens", "embed_dim"}


#: The families of :attr:`PositionScheme.family`, in display order.
FAMILIES = ("none", "absolute", "learned bias", "fixed bias", "rotary", "content", "content bias")


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
    #: ``content_logits`` / ``content_values`` return tensors (Shaw)
    has_content_terms: ClassVar[bool] = False
    #: ``augment`` appends channels computed from the layer's input tokens to q and k (PaPE)
    has_token_terms: ClassVar[bool] = False
    #: prefix tokens have a position of their own (PaPE's class token at the origin): pairs with a prefix
    #: token get a position term, so they are not translation invariant
    prefix_positioned: ClassVar[bool] = False
    #: takes ``causal=`` (a causal ``Attention`` passes ``causal=True``)
    causal_aware: ClassVar[bool] = False
    #: the terms between two patches depend on the grid's extent, not only on their offsets (or, for
    #: RoPE, their row and column): raster-order 1-D schemes (``p = row * W + col``), normalised coordinates
    depends_on_extent: ClassVar[bool] = False
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
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.grid = as_grid(grid)
        self.num_prefix_tokens = num_prefix_tokens
        self.embed_dim = embed_dim if embed_dim is not None else num_heads * head_dim
        # (index, number of layers) of the block this scheme serves; None for a scheme shared by all blocks
        self.layer = None if layer is None else (int(layer[0]), int(layer[1]))

    # ----------------------------------------------------------------- hooks (no-op defaults)
    def bias(self, grid: Grid, num_prefix_tokens: int = 0) -> Tensor | None:
        """Additive logit term ``[heads, N, N]`` (N = prefix + H*W), or None."""
        return None

    def offset_table(self, grid: Grid) -> Tensor | None:
        """``T [heads, 2H-1, 2W-1]`` with ``bias[h, i, j] = T[h, dh_ij + H - 1, dw_ij + W - 1]`` for patch pairs
        (``d = p_i - p_j``; pairs with a prefix token get 0), or None: the bias read by offset, so a kernel
        (FlexAttention's ``score_mod``) needs no ``N x N`` tensor. Declared by ``has_offset_table``."""
        return None

    def bias_factors(self, grid: Grid, num_prefix_tokens: int = 0) -> tuple[Tensor, Tensor] | None:
        """``(u, w)``, each ``[heads, N, r]``, with ``bias = u @ w^T`` exactly (a bias of rank ``r``), or None.

        ``attn_impl="fold"`` appends ``u / scale`` to the queries and ``w`` to the keys, so attention needs
        no bias mask: ``[q, u/s] . [k, w] * s = q . k * s + u . w``."""
        return None

    def rotation(
        self, grid: Grid, num_prefix_tokens: int, device: torch.device | None, dtype: torch.dtype | None
    ) -> tuple[Tensor, Tensor] | None:
        """RoPE's ``(cos, sin)`` for ``grid`` (what ``rotate`` applies), or None."""
        return None

    def rotate(
        self, q: Tensor, k: Tensor, grid: Grid, num_prefix_tokens: int = 0, state: PosState | None = None
    ) -> tuple[Tensor, Tensor]:
        return q, k

    def content_logits(self, q: Tensor, grid: Grid, num_prefix_tokens: int = 0) -> Tensor | None:
        """Unscaled content-position logits ``[B, heads, N, N]`` (added to ``q k^T``), or None."""
        return None

    def content_values(self, attn: Tensor, grid: Grid, num_prefix_tokens: int = 0) -> Tensor | None:
        """Extra output ``[B, heads, N, head_dim]`` from attention probabilities, or None."""
        return None

    def add_to_tokens(self, x: Tensor, grid: Grid, num_prefix_tokens: int = 0) -> Tensor:
        return x

    def augment(self, x: Tensor, q: Tensor, k: Tensor, grid: Grid, num_prefix_tokens: int = 0) -> tuple[Tensor, Tensor]:
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
        impl: str = "auto",
    ) -> PosState:
        """What depends on the grid alone, computed once: the bias (or, with ``impl="fold"``, its factors)
        and RoPE's cos/sin (``rotation``).

        ``device`` / ``dtype`` are those of the tokens the state will be used with; ``impl`` is the
        attention implementation (:data:`ATTN_IMPLS`) :meth:`attend` will run.
        """
        if impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl must be one of {ATTN_IMPLS}, got {impl!r}")
        grid = as_grid(grid)
        p = num_prefix_tokens
        rope = self.rotation(grid, p, device, dtype)
        if impl == "flex":
            if self.has_content_terms or (self.has_bias and not self.has_offset_table):
                raise ValueError(
                    f"attn_impl='flex' reads the bias by offset in FlexAttention's score_mod; {self.name} has no "
                    "such table (every relative bias scheme but Shaw's content terms does): use attn_impl='sdpa'"
                )
            table = self.offset_table(grid) if self.has_bias else None
            blocks = offset_block_mask(table, grid, p) if self.has_masked_offsets else None
            return PosState(self, grid, p, rope=rope, table=table, block_mask=blocks, impl=impl)
        if impl == "fold":
            if not self.has_bias_factors:
                raise ValueError(
                    f"attn_impl='fold' folds a bias that factors into the queries and keys; {self.name} has no such "
                    "bias (the factored tables rel2d_factored and rel2d_bucket do): use attn_impl='sdpa' or 'auto'"
                )
            return PosState(self, grid, p, rope=rope, factors=self.bias_factors(grid, p), impl=impl)
        return PosState(self, grid, p, bias=self.bias(grid, p), rope=rope, impl=impl)

    @classmethod
    def prepare_many(
        cls,
        schemes: Sequence[PositionScheme],
        grid: Any,
        num_prefix_tokens: int = 0,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        impl: str = "auto",
    ) -> list[PosState]:
        """The states of several schemes of this class (a model's blocks, each with its own parameters) for
        one forward: ``[s.prepare(...) for s in schemes]``. A class whose states are cheaper computed
        together overrides it (RoPE-Mixed: every block's angles in one product, as RoPE-ViT)."""
        return [s.prepare(grid, num_prefix_tokens, device, dtype, impl) for s in schemes]

    # ------------------------------------------------------------------------ attention
    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | None,
        scale: float,
        grid: Grid,
        num_prefix_tokens: int = 0,
        state: PosState | None = None,
        dropout_p: float = 0.0,
    ) -> Tensor:
        """Fused attention ``dropout(softmax(q k^T * scale + bias + mask)) v`` for ``[B, heads, N, d]`` inputs.

        ``mask`` is an additive float mask broadcastable to ``[B, heads, N, N]`` (window shift
        mask, causal mask) or None. ``q`` and ``k`` are already rotated. ``state`` (from
        :meth:`prepare`) carries the bias; without it the bias is computed here.
        """
        if state is not None and state.impl == "flex":
            return attend_flex(q, k, v, mask, scale, state.table, grid, num_prefix_tokens, dropout_p, state.block_mask)
        if state is not None and state.factors is not None:
            return attend_folded(q, k, v, mask, scale, state.factors, dropout_p)
        b = state.bias if state is not None else self.bias(grid, num_prefix_tokens)
        m = merge_masks(b, mask, q.dtype)
        if m is not None and not isinstance(q.shape[0], int):  # symbolic batch (torch.export): SDPA's
            m = m.expand(q.shape[0], *m.shape[1:])  # broadcast of a batch-1 mask would assume B != 1
        if self.has_content_terms or (state is not None and state.impl == "eager"):
            return attend_eager(self, q, k, v, m, scale, grid, num_prefix_tokens, dropout_p)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=dropout_p, scale=scale)

    @classmethod
    def legacy_options(cls, options: dict[str, Any], written_format: int = 1) -> dict[str, Any]:
        """The options that reproduce what a scheme config written under ``vitrel_format``
        ``written_format`` meant (1: vitrel 0.1, which wrote none) where a default or an option's meaning
        changed since; ``vitrel.models.registry`` applies it to stored configs older than its ``FORMAT``."""
        return options

    def extra_repr(self) -> str:
        return f"name={self.name}, heads={self.num_heads}, grid={tuple(self.grid)}"


class PosState(NamedTuple):
    """A scheme's grid-dependent tensors for one forward (see :meth:`PositionScheme.prepare`).

    ``scheme`` is the scheme that made it (its hooks apply the state); ``bias`` the additive term
    ``[heads, N, N]`` or None; ``rope`` RoPE's ``(cos, sin)`` or None; ``impl`` the attention
    implementation it was prepared for.
    """

    scheme: PositionScheme
    grid: Grid
    num_prefix_tokens: int
    bias: Tensor | None = None
    rope: tuple[Tensor, Tensor] | None = None
    #: ``(u, w)`` of a folded bias (``impl="fold"``; then ``bias`` is None)
    factors: tuple[Tensor, Tensor] | None = None
    impl: str = "auto"
    #: the bias by offset ``[heads, 2H-1, 2W-1]`` (``impl="flex"``; then ``bias`` is None)
    table: Tensor | None = None
    #: FlexAttention's ``BlockMask`` of the table's ``-inf`` entries (``has_masked_offsets``), or None
    block_mask: Any = None

    def full_bias(self) -> Tensor | None:
        """The additive term ``[heads, N, N]``, multiplied out of the factors when folded, expanded from
        the offset table for flex."""
        if self.factors is not None:
            u, w = self.factors
            return u @ w.transpose(-2, -1)
        if self.table is not None:
            return expand_offset_table(self.table, self.grid, self.num_prefix_tokens)
        return self.bias


def merge_masks(bias: Tensor | None, mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """Sum of an optional ``[heads, N, N]`` bias and an optional broadcastable float mask.

    The result is 4-D (``[1, heads, N, N]`` for a bias alone): SDPA's fused CPU kernel takes a
    4-D mask, while a 3-D one sends it down the slow unfused path (1.7x slower at N = 196).
    """
    if bias is not None:
        bias = bias.to(dtype)
        if bias.dim() == 3:
            bias = bias[None]
    if mask is not None:
        mask = mask.to(dtype)
    if bias is None:
        return mask
    if mask is None:
        return bias
    return bias + mask


def attend_folded(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    scale: float,
    factors: tuple[Tensor, Tensor],
    dropout_p: float = 0.0,
) -> Tensor:
    """SDPA over ``[q, u / scale]`` and ``[k, w]``: ``q k^T * scale + u w^T`` without a bias mask (the
    fold of a factored bias, ``attn_impl="fold"``); ``mask`` (windows, causal) still goes in as a mask."""
    u, w = factors
    lead = (q.shape[0], -1, -1, -1)
    q = torch.cat([q, (u.to(q.dtype) / scale).expand(*lead)], dim=-1)
    k = torch.cat([k, w.to(k.dtype).expand(*lead)], dim=-1)
    m = merge_masks(None, mask, q.dtype)
    ev = v.shape[-1]
    # v padded with zeros to the q/k width: SDPA's fused kernels want one head dim (else the math path)
    v = F.pad(v, (0, q.shape[-1] - ev))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=dropout_p, scale=scale)[..., :ev]


def axis_offsets(n: int, device: torch.device | None = None) -> Tensor:
    """The offsets ``-(n-1) .. n-1`` along an axis of ``n`` patches (``[2n-1]``, long): index ``d + n - 1``
    of an offset table holds offset ``d``."""
    return torch.arange(-(n - 1), n, device=device)


def offset_grid(grid: Grid, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    """``(dh, dw)`` over an offset table, each ``[2H-1, 2W-1]`` (long): ``dh[a, b] = a - (H - 1)``,
    ``dw[a, b] = b - (W - 1)``."""
    dh = axis_offsets(grid.h, device)[:, None].expand(-1, 2 * grid.w - 1)
    dw = axis_offsets(grid.w, device)[None, :].expand(2 * grid.h - 1, -1)
    return dh, dw


def expand_offset_table(table: Tensor, grid: Grid, num_prefix_tokens: int = 0) -> Tensor:
    """``T [heads, 2H-1, 2W-1]`` -> the bias ``[heads, N, N]``, ``T[h, dh_ij + H - 1, dw_ij + W - 1]`` for
    patch pairs, 0 for pairs with a prefix token."""
    dh, dw = rel_offsets(grid, table.device)
    return pad_prefix(table[:, dh + grid.h - 1, dw + grid.w - 1], num_prefix_tokens)


@functools.cache
def _compiled_flex() -> Callable[..., Tensor]:
    return torch.compile(flex_attention, dynamic=False)


def _flex_attention(*args: Any, **kwargs: Any) -> Tensor:
    """FlexAttention, compiled (once per shape, lazily) unless the caller is being compiled already."""
    if torch.compiler.is_compiling():
        return flex_attention(*args, **kwargs)
    return _compiled_flex()(*args, **kwargs)


def attend_flex(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    scale: float,
    table: Tensor | None,
    grid: Grid,
    num_prefix_tokens: int = 0,
    dropout_p: float = 0.0,
    block_mask: Any = None,
) -> Tensor:
    """FlexAttention with ``score_mod = score + T[h, dh + H - 1, dw + W - 1] + mask`` (``attn_impl="flex"``):
    the bias is read from the offset table ``T`` (gradients reach it; on CUDA through atomics, so not
    bitwise deterministic), prefix pairs get none; ``mask`` (windows, causal) an additive float mask
    broadcastable to ``[B, heads, N, N]``, read in the same ``score_mod``. No attention dropout; no
    backward on CPU (torch has none there): use ``sdpa`` for those. ``block_mask`` (:func:`offset_block_mask`)
    lets the kernel skip blocks the table masks out entirely."""
    if dropout_p > 0.0:
        raise ValueError("attn_impl='flex' has no attention dropout (FlexAttention has none): use attn_impl='sdpa'")
    needs_grad = q.requires_grad or k.requires_grad or v.requires_grad or (table is not None and table.requires_grad)
    if q.device.type == "cpu" and torch.is_grad_enabled() and needs_grad:
        raise ValueError(
            "attn_impl='flex' cannot train on CPU (torch has no FlexAttention backward there): use attn_impl='sdpa' "
            "on CPU, or flex for inference (torch.no_grad / inference_mode)"
        )
    at, patch = _offset_reader(table, grid, num_prefix_tokens, q.device)
    if mask is not None:
        mask = mask.to(q.dtype)
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    mb, mh = (mask.shape[0] > 1, mask.shape[1] > 1) if mask is not None else (False, False)

    def score_mod(score: Tensor, b: Tensor, h: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
        if table is not None:
            t = at(h, qi, ki)
            score = score + torch.where(patch[qi] & patch[ki], t, torch.zeros_like(t))
        if mask is not None:
            score = score + mask[b if mb else 0, h if mh else 0, qi, ki]
        return score

    return _flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale)


def _offset_reader(
    table: Tensor | None, grid: Grid, num_prefix_tokens: int, device: torch.device
) -> tuple[Callable[[Tensor, Tensor, Tensor], Tensor], Tensor]:
    """``(at, patch)`` for FlexAttention's mods: ``at(h, qi, ki) = T[h, dh + H - 1, dw + W - 1]`` of tokens ``qi``,
    ``ki`` (prefix tokens read offset ``(0, 0)``'s row and column: mask them with ``patch``, ``[P + H W]`` bool)."""
    rows, cols = patch_coords(grid, device)
    p = num_prefix_tokens
    rows, cols = F.pad(rows, (p, 0)), F.pad(cols, (p, 0))

    def at(h: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
        return table[h, rows[qi] - rows[ki] + grid.h - 1, cols[qi] - cols[ki] + grid.w - 1]

    return at, torch.arange(p + grid.n, device=device) >= p


def offset_block_mask(table: Tensor, grid: Grid, num_prefix_tokens: int = 0) -> Any:
    """FlexAttention ``BlockMask`` of the pairs an offset table lets through: ``T[h, dh, dw] > -inf``, and every
    pair with a prefix token (``[heads, N, N]``, no batch dimension)."""
    at, patch = _offset_reader(table, grid, num_prefix_tokens, table.device)

    def mask_mod(b: Tensor, h: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
        return ~(patch[qi] & patch[ki]) | (at(h, qi, ki) > float("-inf"))

    n = num_prefix_tokens + grid.n
    return create_block_mask(mask_mod, None, table.shape[0], n, n, device=table.device)


def _causal(b: Tensor, h: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
    return qi >= ki


def with_causal_blocks(block_mask: Any, heads: int, n: int, device: torch.device) -> Any:
    """The FlexAttention ``BlockMask`` of causal attention over ``n`` tokens (key ``j <= i``), intersected with
    ``block_mask`` (a scheme's, e.g. LookHere's views) if there is one: the kernel skips the blocks above the
    diagonal and masks the diagonal blocks exactly (no float mask is read)."""
    if block_mask is None:
        return create_block_mask(_causal, None, None, n, n, device=device)
    return create_block_mask(and_masks(block_mask.mask_mod, _causal), None, heads, n, n, device=device)


def axis_factors(bh: Tensor, bw: Tensor, grid: Grid, num_prefix_tokens: int, head_dim: int) -> tuple[Tensor, Tensor]:
    """Factors of ``bh[:, row_i, row_j] + bw[:, col_i, col_j]`` (``bh [heads, H, H]``, ``bw [heads, W, W]``):
    ``u_i = [bh[row_i, :], bw[col_i, :]]``, ``w_j = [onehot(row_j), onehot(col_j)]``, rank ``H + W`` padded
    with zeros so that ``head_dim + r`` is a multiple of 8 (what fused kernels want); prefix tokens get zeros."""
    heads = bh.shape[0]
    rows, cols = patch_coords(grid, bh.device)
    u = torch.cat([bh[:, rows, :], bw[:, cols, :]], dim=-1)  # [heads, HW, H + W]
    ar_h, ar_w = torch.arange(grid.h, device=bh.device), torch.arange(grid.w, device=bh.device)
    w = torch.cat([rows[:, None] == ar_h, cols[:, None] == ar_w], dim=-1).to(bh.dtype)  # one-hot, [HW, H + W]
    pad = -(head_dim + grid.h + grid.w) % 8
    u = F.pad(u, (0, pad, num_prefix_tokens, 0))
    w = F.pad(w, (0, pad, num_prefix_tokens, 0)).expand(heads, -1, -1)
    return u, w


def eager_logits(
    scheme: PositionScheme,
    q: Tensor,
    k: Tensor,
    mask: Tensor | None,
    scale: float,
    grid: Grid,
    num_prefix_tokens: int = 0,
) -> Tensor:
    """Pre-softmax logits ``(q k^T + content_logits(q)) * scale + mask``, ``[B, heads, N, N]``.

    ``mask`` already holds the bias (see :func:`merge_masks`).
    """
    logits = q @ k.transpose(-2, -1)
    c = scheme.content_logits(q, grid, num_prefix_tokens)
    if c is not None:
        logits = logits + c
    logits = logits * scale
    return logits if mask is None else logits + mask


def attend_eager(
    scheme: PositionScheme,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    scale: float,
    grid: Grid,
    num_prefix_tokens: int = 0,
    dropout_p: float = 0.0,
) -> Tensor:
    """The one eager attention path: ``a = dropout(softmax(eager_logits))``, ``a v + content_values(a)``."""
    attn = eager_logits(scheme, q, k, mask, scale, grid, num_prefix_tokens).softmax(dim=-1)
    if dropout_p > 0.0:
        attn = F.dropout(attn, dropout_p)
    out = attn @ v
    cv = scheme.content_values(attn, grid, num_prefix_tokens)
    return out if cv is None else out + cv


# ---------------------------------------------------------------------------- shared helpers
def patch_coords(grid: Grid, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    """Row and column index of each patch token in raster order, each ``[H*W]`` (long)."""
    p = torch.arange(grid.h * grid.w, device=device)  # (division, not repeat: exports at any symbolic size)
    r = p // grid.w
    return r, p - r * grid.w


def rel_offsets(grid: Grid, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    """Row and column offsets ``(dh, dw)`` with ``dh[i, j] = row_i - row_j``, each ``[HW, HW]``."""
    r, c = patch_coords(grid, device)
    return r[:, None] - r[None, :], c[:, None] - c[None, :]


def pad_prefix(bias: Tensor, num_prefix_tokens: int) -> Tensor:
    """Zero-pad a ``[..., HW, HW]`` term with ``num_prefix_tokens`` leading rows and columns."""
    if num_prefix_tokens == 0:
        return bias
    p = num_prefix_tokens
    return F.pad(bias, (p, 0, p, 0))


def geometric_slopes(num_heads: int, max_exponent: float = 8.0) -> Tensor:
    """ALiBi slopes ``m_h = 2^(-max_exponent * (h + 1) / num_heads)`` for h = 0..heads-1."""
    return torch.tensor([2.0 ** (-max_exponent * (h + 1) / num_heads) for h in range(num_heads)], dtype=torch.float64)


@register_pos("none")
class NonePos(PositionScheme):
    """No position information: plain attention. ``A_ij = q_i . k_j / sqrt(d)``."""
