"""Multi-head self-attention that takes any position scheme.

For ``x`` of ``[B, N, C]`` on a grid ``H x W`` with ``P`` prefix tokens (``N = P + H W``)::

    q, k, v = split(x W_qkv)                    per head, [B, heads, N, d]
    q, k    = pos.rotate(q, k)                  (RoPE; identity otherwise; fused for a kernel with fused_rotation)
    q, k    = pos.augment(x, q, k)              (PaPE: channels appended; identity otherwise)
    A       = (q k^T + pos.content_logits(q) + pos.content_key_logits(k)) / sqrt(d) + pos.bias() + mask
    a       = pos.mix(softmax(A))               (GPSA: its positional attention mixed in; identity otherwise)
    out     = a v + pos.content_values(a)

``forward`` runs the scheme's fused path (``PositionScheme.attend``: SDPA with the bias as a
float mask, or the scheme's own kernel; attention dropout goes into the same call); ``logits``
returns ``A`` eagerly for inspection (:func:`~vitrel.kernels.common.eager_logits`, the expression the
eager path of schemes with content terms also uses).

Position state: a layer called with a grid prepares its scheme for it (``attn(x, grid)``); called without one, for
the grid it was built for (``attn(x)``, as timm's ``Block`` calls its ``attn``). A model
prepares every block's state once per forward and passes it instead (``attn(x, pos_state=state)``): the
state carries the grid and prefix count it was prepared for. A layer built with ``pos="shared"`` owns no
scheme and always takes its model's state.

Windows: pass ``x`` as ``[B * num_windows, n, C]`` with ``grid`` the window's grid and ``mask`` the windows'
:class:`~vitrel.layout.tokens.TokenLayout` (:meth:`~vitrel.layout.tokens.TokenLayout.windows`: each window's regions,
Swin's shifted windows) or a float mask ``[num_windows, n, n]``; the bias is built once for the window grid and shared
by every window. A kernel that reads the windows' regions itself (``Kernel.window_layouts``) gets the layout; the
others the float mask it lowers to, repeated to the batch.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from timm.layers import register_notrace_module
from torch import Tensor, nn

from vitrel.kernels import Kernel, check_choice, resolve
from vitrel.kernels.common import eager_logits, merge_masks
from vitrel.kernels.triton.rope import rope_rotate
from vitrel.layers.norms import make_norm
from vitrel.layers.validate import check_attention_args
from vitrel.layout.geometry import as_grid, grid_str
from vitrel.layout.heads import widened_precision
from vitrel.layout.softmax import masked_softmax
from vitrel.layout.tokens import TokenLayout, isolate_images, poison, segment_mask
from vitrel.pos.base import PositionScheme, PosState
from vitrel.pos.registry import parse_pos, scheme_options

__all__ = ["Attention", "SHARED"]

#: ``Attention(..., pos=SHARED)``: the layer owns no scheme and takes the model's state in ``forward``.
SHARED = "shared"


@register_notrace_module  # torch.fx records the layer as one call (its shape checks need concrete sizes)
class Attention(nn.Module):
    """``Attention(dim, num_heads, pos=<name | config | PositionScheme | "shared">)``.

    Args:
        dim: embedding dimension ``C``.
        num_heads: number of heads; ``dim`` must be divisible by it.
        pos: the relative position scheme (a registered name, a config dict with ``name``, or a
            module), or ``"shared"`` for a layer that takes the state of a scheme its model owns
            (``forward(..., pos_state=...)``). Absolute schemes (``ape``, ``sincos2d``) act at the
            input of the network, not inside attention: they are refused here (give them to a
            model as ``abs_pos=``).
        grid: the grid (or window) the scheme is built for (sizes learned tables), and the forward's grid when it is
            given none.
        num_prefix_tokens: class/register tokens ahead of the patch tokens.
        qkv_bias: biases of the q, k and v projections: ``True``, ``False``, or ``"qv"``: q's and v's alone, the key's
            none (timm's BEiT, EVA and Swin V2; parameters ``q_bias`` and ``v_bias``, ``k_bias`` a
            zero buffer, as timm's). A key bias adds ``q_i . b`` to all of row ``i``'s logits, which the softmax
            ignores, unless ``k`` is rotated or normalised (RoPE, ``cosine``, ``qk_norm``): there it is a term
            of its own, which those models never learn.
        attn_drop, proj_drop: as in timm.
        causal: add a causal mask (1-D sequences).
        cosine: Swin V2's scaled cosine attention: logits ``cos(q_i, k_j) exp(min(s_h, log 100))`` with a learned
            ``s_h`` per head (``logit_scale``, ``log 10`` at first, not weight-decayed) for ``q . k / sqrt(d)``.
        qk_norm: a norm of each head's ``q`` and ``k`` (``q_norm``, ``k_norm``, shared by the heads; before any
            rotation), timm's ``qk_norm``.
        attn_norm: a norm of the attention's output before ``proj`` (``norm``; timm's ``scale_norm``, EVA-02
            CLIP's and BEiT-3's sub-LN).
        norm_layer, norm_eps: those norms, ``"layernorm"`` or ``"rmsnorm"`` (:mod:`vitrel.layers.norms`), and their
            epsilon.
        num_kv_heads: grouped-query attention (timm's ``num_kv_heads``): ``k`` and ``v`` projected to this many heads,
            each shared by ``num_heads / num_kv_heads`` query heads in turn (query head ``h`` reads key head
            ``h // groups``, as timm's ``repeat_interleave``), ``qkv`` then ``[q | k | v]`` of ``C + 2 C_kv`` rows.
            None: ``num_heads``.
        layer: ``(index, number of layers)`` of the block, handed to a scheme built here from a name or
            config (per-layer schedules); a model builds its blocks' schemes itself and passes them as modules.
        attn_impl: ``auto`` or a registered kernel (:func:`vitrel.kernels.list_kernels`; what each does and when to
            pick it: docs/gpu.md). ``auto`` picks per device from measurements (:data:`vitrel.kernels.AUTO`),
            else the scheme's own kernel where it has one (``shaw`` for Shaw's content terms), else ``sdpa``
            (:func:`vitrel.kernels.registry.select_kernel`). May be set on a built layer
            (``model.blocks[0].attn.attn_impl = "eager"``): checked at the assignment (an unknown name, or a kernel
            that cannot run the layer's scheme, raises there), then honoured: that layer runs the named kernel, also
            on the states its model prepares for all its blocks (:meth:`~vitrel.pos.base.PositionScheme.bind`).
            Setting a model's or Swin stage's ``attn_impl`` sets it on each of its layers.
        pos_options: the scheme's options as keywords, when ``pos`` is a name or config.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        pos: str | dict | PositionScheme | None = "none",
        grid: Any = (14, 14),
        num_prefix_tokens: int = 0,
        qkv_bias: bool | str = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        causal: bool = False,
        layer: tuple[int, int] | None = None,
        attn_impl: str = "auto",
        cosine: bool = False,
        qk_norm: bool = False,
        attn_norm: bool = False,
        norm_layer: str = "layernorm",
        norm_eps: float = 1e-6,
        num_kv_heads: int | None = None,
        **pos_options: Any,
    ) -> None:
        super().__init__()
        check_attention_args(locals())  # sizes checked first, errors name the argument
        self.dim = dim
        self.num_heads = num_heads
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.head_dim = dim // num_heads
        self.scale = 1.0 if cosine else self.head_dim**-0.5  # (cosine: the logit scale is on q)
        self.logit_scale = nn.Parameter(torch.full((num_heads, 1, 1), math.log(10.0))) if cosine else None
        self.num_prefix_tokens = num_prefix_tokens
        self.causal = causal
        self._attn_impl = check_choice(attn_impl, attn_drop=attn_drop)
        kv_dim = self.num_kv_heads * self.head_dim
        self.qkv = nn.Linear(dim, dim + 2 * kv_dim, bias=qkv_bias is True)
        if qkv_bias == "qv":  # (timm's EVA / BEiT layout: no key bias to learn)
            self.q_bias, self.v_bias = nn.Parameter(torch.zeros(dim)), nn.Parameter(torch.zeros(kv_dim))
            self.register_buffer("k_bias", torch.zeros(kv_dim), persistent=False)
        else:
            self.q_bias = self.k_bias = self.v_bias = None
        self.attn_drop = attn_drop
        norm = make_norm(norm_layer, norm_eps)
        self.q_norm = norm(self.head_dim) if qk_norm else None
        self.k_norm = norm(self.head_dim) if qk_norm else None
        self.norm = norm(dim) if attn_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.pos: PositionScheme | None = None
        self.grid = as_grid(grid)  # the forward's grid when it is given none
        if pos == SHARED:
            if pos_options:
                raise ValueError(f"pos='shared' takes no scheme options, got {sorted(pos_options)}")
            return
        if not isinstance(pos, PositionScheme):  # a name or config: parsed once, built with this layer's arguments
            self._check_keywords(parse_pos("none" if pos is None else pos).cls, pos_options)
            pos = parse_pos("none" if pos is None else pos, **pos_options).build(
                num_heads=num_heads,
                head_dim=self.head_dim,
                grid=grid,
                num_prefix_tokens=num_prefix_tokens,
                embed_dim=dim,
                layer=layer,
                causal=causal,  # e.g. T5's one-directional buckets under a causal mask
            )
        elif pos_options:
            raise TypeError(
                f"Attention() got unexpected keyword argument(s) {sorted(pos_options)}: not its own arguments, and a "
                f"built scheme ({pos.name}) takes its options where it is built"
            )
        elif layer is not None and tuple(layer) != pos.layer:  # only a scheme built here reads it
            raise ValueError(
                f"layer={tuple(layer)} with a built scheme ({pos.name}, built for layer {pos.layer}): give layer= "
                "where the scheme is built (vitrel.pos.build_pos(..., layer=...)), or pos by name"
            )
        if pos.kind == "absolute":
            raise ValueError(
                f"{pos.name!r} is an absolute position scheme: it adds an embedding to the tokens at the input of the "
                "network, so it cannot act inside attention. Give it to a model (vitrel.create_model(..., "
                f"abs_pos={pos.name!r}) or pos={pos.name!r}), or add it yourself with scheme.add_to_tokens(x, grid)."
            )
        self._check_scheme(pos)
        check_choice(attn_impl, pos)
        if getattr(pos, "causal", causal) != causal:
            raise ValueError(f"the {pos.name} scheme was built with causal={pos.causal}, the attention has {causal}")
        self.pos = pos
        pos.init_layer(self.qkv)

    @property
    def attn_impl(self) -> str:
        """``auto`` or the kernel this layer runs (see the class docstring); checked when set."""
        return self._attn_impl

    @attn_impl.setter
    def attn_impl(self, impl: str) -> None:
        self._attn_impl = check_choice(impl, self.pos, self.attn_drop)

    def choose_kernel(
        self,
        scheme: PositionScheme,
        n_tokens: int,
        device: torch.device | None,
        dtype: torch.dtype | None = None,
        mask: Tensor | TokenLayout | None = None,
        layout: bool = False,
    ) -> type[Kernel]:
        """The kernel this layer runs for ``scheme`` on ``n_tokens`` tokens of ``device`` and ``dtype``, called with
        ``mask``, on a token ``layout`` or not (its ``attn_impl``; ``auto``: :func:`vitrel.kernels.resolve`'s choice,
        a kernel that takes them), chosen once per forward and handed to the scheme."""
        case = dict(mask=mask, causal=self.causal, layout=layout)
        return resolve(self.attn_impl, scheme, n_tokens, device, self.drops_weights, dtype, **case)

    # ------------------------------------------------------------------------------ internals
    @staticmethod
    def _check_keywords(cls: type[PositionScheme], pos_options: dict[str, Any]) -> None:
        """Keywords that are not the scheme's options are refused as the layer's own, as Python refuses them (timm's
        ``rope=``, ``fused_attn=`` were reported as options the scheme lacks)."""
        unknown = sorted(set(pos_options) - scheme_options(cls))
        if unknown:
            raise TypeError(
                f"Attention() got unexpected keyword argument(s) {unknown}: neither its own arguments nor options of "
                f"the position scheme {cls.name!r} (its options: {sorted(scheme_options(cls))})"
            )

    def _check_scheme(self, scheme: PositionScheme) -> None:
        if scheme.num_heads != self.num_heads or scheme.head_dim != self.head_dim:
            raise ValueError(
                f"position scheme built for {scheme.num_heads} heads of {scheme.head_dim} dims, "
                f"attention has {self.num_heads} heads of {self.head_dim}"
            )

    @property
    def drops_weights(self) -> bool:
        """Whether this forward drops attention weights (``attn_drop > 0`` in training): ``auto`` then picks a kernel
        with attention dropout (:meth:`~vitrel.pos.base.PositionScheme.prepare`'s ``dropout``)."""
        return self.training and self.attn_drop > 0

    def _state(
        self, x: Tensor, grid: Any, pos_state: PosState | None, mask: Tensor | TokenLayout | None = None
    ) -> PosState:
        """``pos_state`` as given (it carries the grid and prefix count it was prepared for), or this layer's
        scheme prepared for ``grid``; for a kernel that takes ``mask`` (the forward's)."""
        if pos_state is not None:
            if grid is not None:
                raise ValueError(
                    "pass the grid or a pos_state, not both: the state carries the grid it was prepared for"
                )
            self._check_scheme(pos_state.scheme)
            n = (
                pos_state.layout.num_tokens
                if pos_state.layout is not None
                else pos_state.num_prefix_tokens + pos_state.grid.n
            )
            kernel = self.choose_kernel(pos_state.scheme, n, x.device, x.dtype, mask, pos_state.layout is not None)
            return pos_state.scheme.bind(pos_state, kernel, x.device, x.dtype)
        if self.pos is None:
            raise ValueError(
                "this attention layer uses its model's shared position scheme (pos='shared'): pass "
                "pos_state=scheme.prepare(grid, num_prefix_tokens, x.device, x.dtype)"
            )
        if grid is None:  # the grid the layer was built for, as timm's layers (a timm Block passes no grid)
            grid = self.grid
            if x.dim() == 3 and x.shape[1] != self.num_prefix_tokens + grid.n:
                raise ValueError(
                    f"this layer was built for grid {grid_str(grid)} with {self.num_prefix_tokens} prefix token(s), "
                    f"{self.num_prefix_tokens + grid.n} tokens, but the input has {x.shape[1]}: pass the tokens' "
                    "grid=(H, W) to the forward (or build the layer with their grid and num_prefix_tokens)"
                )
        if isinstance(grid, TokenLayout):
            if grid.num_prefix_tokens != self.num_prefix_tokens:
                raise ValueError(
                    f"the token layout has {grid.num_prefix_tokens} prefix token(s) per image, this layer was built "
                    f"with num_prefix_tokens={self.num_prefix_tokens}"
                )
            n = grid.num_tokens
        else:
            grid = as_grid(grid)
            n = self.num_prefix_tokens + grid.n
        kernel = self.choose_kernel(self.pos, n, x.device, x.dtype, mask, isinstance(grid, TokenLayout))
        return self.pos.prepare(grid, self.num_prefix_tokens, x.device, x.dtype, kernel)

    def _qkv(self, x: Tensor, st: PosState) -> tuple[Tensor, Tensor, Tensor]:
        """Projected ``q, k, v [B, heads, N, d]``, ``q`` and ``k`` rotated (and augmented) by the scheme."""
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"expected x of shape [B, N, {self.dim}], got {tuple(x.shape)}")
        st.check_tokens(x.shape[1])
        b, n, _ = x.shape
        if self.q_bias is None:
            qkv = self.qkv(x)
        else:
            qkv = F.linear(x, self.qkv.weight, torch.cat((self.q_bias, self.k_bias, self.v_bias)))
        if self.num_kv_heads == self.num_heads:
            q, k, v = qkv.reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        else:  # (grouped-query: each key / value head repeated for its query heads, before norms and rotation)
            groups, kv = self.num_heads // self.num_kv_heads, self.num_kv_heads * self.head_dim
            q, k, v = qkv.split((self.dim, kv, kv), dim=-1)
            q = q.reshape(b, n, self.num_heads, self.head_dim).transpose(1, 2)
            k, v = (t.reshape(b, n, -1, self.head_dim).transpose(1, 2).repeat_interleave(groups, 1) for t in (k, v))
        if self.q_norm is not None and self.k_norm is not None:  # (in the values' dtype: autocast's norms give fp32)
            q, k = self.q_norm(q).to(v.dtype), self.k_norm(k).to(v.dtype)
        if self.logit_scale is not None:  # Swin V2's scaled cosine attention (timm's, its clamp at 100)
            q = F.normalize(q, dim=-1) * self.logit_scale.clamp(max=math.log(100.0)).exp().to(q.dtype)
            k = F.normalize(k, dim=-1)
        if st.kernel.fused_rotation and st.scheme.fusable_rotation():  # state.rope as rotate() applies it, fused
            q, k = rope_rotate(q, k, st.rope)
        else:
            q, k = st.scheme.rotate(q, k, st)
        if st.scheme.has_token_terms:  # channels from the tokens appended to q and k (PaPE)
            q, k = st.scheme.augment(x, q, k, st)
        return q, k, v

    def _mask(
        self,
        mask: Tensor | TokenLayout | None,
        b: int,
        n: int,
        dtype: torch.dtype,
        device: torch.device,
        causal: bool = True,
        per_window: bool = False,
    ) -> Tensor | TokenLayout | None:
        """Window mask ``[nW, n, n]`` -> ``[B, 1, n, n]``; the windows' layout kept as it is for a kernel that reads
        it per window (``per_window``), else lowered to that float mask; plus the causal mask if enabled (and
        ``causal``)."""
        if isinstance(mask, TokenLayout):
            if mask.grids != (mask.grids[0],) or mask.num_tokens != n or mask.num_prefix_tokens:
                raise ValueError(f"mask: a layout of windows ({n} tokens, one grid, no prefix), got {mask.grids}")
            if b % mask.segment.shape[0]:
                raise ValueError(f"batch {b} is not a multiple of the layout's {mask.segment.shape[0]} windows")
            if per_window and not self.causal:
                return mask
            mask = segment_mask(mask, dtype)[:, 0]
        if mask is not None:
            if mask.dtype == torch.bool:  # True: attend (SDPA's rule), as an additive float mask, of any rank
                mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(~mask, float("-inf"))
            if mask.dim() == 3:
                nw = mask.shape[0]
                if b % nw:
                    raise ValueError(f"batch {b} is not a multiple of the {nw} windows of the mask")
                if not per_window:
                    mask = mask.to(dtype).repeat(b // nw, 1, 1)[:, None]  # [B, 1, n, n]
            if mask.dim() != 3:
                self._check_mask_shape(mask, b, n)
        if self.causal and causal:
            c = torch.full((n, n), float("-inf"), dtype=dtype, device=device).triu(1)
            mask = c if mask is None else mask + c
        return mask

    def _check_mask_shape(self, mask: Tensor, b: int, n: int) -> None:
        """A mask that does not broadcast to ``[B, heads, N, N]`` is one line naming the shapes (a key padding mask
        ``[B, N]`` failed inside the kernel with a broadcasting error)."""
        want = (b, self.num_heads, n, n)
        if not all(isinstance(s, int) for s in (*mask.shape, *want)):
            return  # (symbolic under torch.export: comparing would pin the program, a Swin stage of one window to B>1)
        if mask.dim() > 4 or any(s not in (1, w) for s, w in zip(reversed(mask.shape), reversed(want))):
            raise ValueError(
                f"mask of shape {list(mask.shape)} does not broadcast to [B, heads, N, N] = {list(want)}: "
                "a key padding mask [B, N] is mask[:, None, None, :]"
            )

    # ------------------------------------------------------------------------------- public
    def forward(
        self,
        x: Tensor,
        grid: Any = None,
        mask: Tensor | TokenLayout | None = None,
        pos_state: PosState | None = None,
        *,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
    ) -> Tensor:
        """``x [B, N, C]`` -> ``[B, N, C]``, the tokens on ``grid`` (default: the grid the layer was built for) or on
        the grid ``pos_state`` (a model's state of this layer's or its shared scheme) was prepared for. ``mask``: the
        windows' layout (:meth:`~vitrel.layout.tokens.TokenLayout.windows`), a ``[nW, n, n]`` window mask or a bool
        (True: attend) or float mask broadcastable to ``[B, heads, N, N]``. ``attn_mask`` and ``is_causal`` are timm's
        ``Attention.forward`` arguments (what timm's ``Block`` passes): ``attn_mask`` is ``mask``; ``is_causal=True``
        needs a layer built with ``causal=True``."""
        mask = self._timm_args(mask, attn_mask, is_causal)
        st = self._state(x, grid, pos_state, mask)
        q, k, v = self._qkv(x, st)
        if st.layout is not None:  # packed images: no image reads another's values (vitrel.layout.tokens)
            (q, k, v), bad = isolate_images(st.layout, q, k, v)
        b, n, c = x.shape
        kernel = st.kernel
        native_causal = self.causal and kernel.native_causal  # the kernel masks by index, skipping blocks
        if native_causal:
            st = st._replace(causal=True)
        m = self._mask(mask, b, n, q.dtype, q.device, causal=not native_causal, per_window=kernel.window_layouts)
        p = self.attn_drop if self.training else 0.0
        out = st.scheme.attend(q, k, v, m, self.scale, st, dropout_p=p)
        if st.layout is not None:
            out = poison(out, bad)
        out = out.transpose(1, 2)  # [B, N, heads, d]
        if torch.compiler.is_exporting():  # a real copy: ONNX's decomposed attention has other output strides
            out = out.clone(memory_format=torch.contiguous_format)
        out = self.norm(out.reshape(b, n, c))
        return self.proj_drop(self.proj(out))

    def _timm_args(self, mask: Any, attn_mask: Tensor | None, is_causal: bool) -> Any:
        """The mask from ``mask`` or timm's ``attn_mask``; timm's ``is_causal`` checked against the layer's."""
        if is_causal and not self.causal:
            raise ValueError("is_causal=True: this layer was built without a causal mask; build it with causal=True")
        if attn_mask is None:
            return mask
        if mask is not None:
            raise ValueError("pass the mask as mask or attn_mask (timm's name), not both")
        return attn_mask

    def logits(
        self, x: Tensor, grid: Any = None, mask: Tensor | TokenLayout | None = None, pos_state: PosState | None = None
    ) -> Tensor:
        """Pre-softmax logits ``[B, heads, N, N]``, computed eagerly (for inspection). For a scheme that mixes the
        weights after the softmax (GPSA), the logits of its content softmax."""
        return self._logits(x, grid, mask, pos_state)[0]

    def _logits(
        self, x: Tensor, grid: Any, mask: Tensor | TokenLayout | None, pos_state: PosState | None
    ) -> tuple[Tensor, Tensor | None, PosState]:
        """The logits, the additive mask in them (bias included) and the state they were computed with."""
        st = self._state(x, grid, pos_state)
        q, k, v = self._qkv(x, st)
        m = merge_masks(st.full_bias(), self._mask(mask, x.shape[0], x.shape[1], q.dtype, q.device), q.dtype)
        with widened_precision(q, v):  # in float32 where the scheme widened q, k in it (PaPE under autocast)
            return eager_logits(q, k, m, self.scale, st), m, st

    def attention_map(
        self, x: Tensor, grid: Any = None, mask: Tensor | TokenLayout | None = None, pos_state: PosState | None = None
    ) -> Tensor:
        """Attention probabilities ``[B, heads, N, N]``, the weights of the values (mixed by the scheme where it
        ``mixes_weights``); a row the mask closes is 0, as the kernels give it."""
        logits, m, st = self._logits(x, grid, mask, pos_state)
        attn = masked_softmax(logits, logits if mask is not None else None)
        return st.scheme.mix(attn, m, st) if st.scheme.mixes_weights else attn

    def bias(self, grid: Any) -> Tensor | None:
        """The scheme's additive term ``[heads, N, N]`` for ``grid`` (None for non-bias schemes)."""
        if self.pos is None:
            raise ValueError("this attention layer uses its model's shared scheme: ask the model's scheme for its bias")
        return self.pos.bias(self.pos.check_grid(grid), self.num_prefix_tokens)

    def extra_repr(self) -> str:
        shared = ", pos=shared" if self.pos is None else ""
        return f"dim={self.dim}, heads={self.num_heads}, prefix={self.num_prefix_tokens}{shared}"
