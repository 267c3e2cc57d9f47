"""The registry of attention kernels: what each reads, what it takes, and how ``attn_impl="auto"`` chooses.

A kernel computes ``dropout(softmax(q k^T * scale + bias + mask)) v`` for ``[B, heads, N, d]`` inputs from a scheme's
:class:`~vitrel.pos.base.PosState`. It is a class in one file of :mod:`vitrel.kernels`, decorated
``@register_kernel("name")``, that declares

* ``reads``: the position inputs :meth:`~vitrel.pos.base.PositionScheme.prepare` builds for it (``bias``: the dense
  ``[heads, N, N]`` term, which a kernel that reads nothing else takes as the scheme makes it; ``factors``:
  ``(u, w)`` with ``bias = u w^T``; ``table``: the offset table ``[heads, 2H-1, 2W-1]``; ``block_mask``:
  FlexAttention's), and builds them (:meth:`Kernel.inputs`, :meth:`Kernel.layout_inputs`);
* which cases it takes: :meth:`Kernel.refuses` (a scheme's capabilities), ``takes_layout`` (packed / token-dropped
  layouts), ``takes_dropout``, ``native_causal`` (it masks the keys after the query itself, from ``state.causal``,
  instead of reading a causal float mask), ``window_layouts`` (it takes the windows' layout as ``mask``,
  :meth:`~vitrel.layout.tokens.TokenLayout.windows`, and masks across their regions itself, instead of reading the float
  mask it lowers to, repeated to the batch), ``onnx`` (what it runs translates to ONNX), ``fused_rotation`` (a rotary
  scheme's queries and keys are rotated by the fused Triton rotation, :mod:`vitrel.kernels.triton.rope`, instead of
  the scheme's torch ops);
* which inputs of a call it takes beyond the scheme: :meth:`Kernel.refuses_inputs` (the mask a layer is called with,
  causal attention on a token layout);
* how it attends: :meth:`Kernel.attend`.

``attn_impl`` is a kernel's name or ``auto``: :func:`select_kernel` reads :data:`AUTO` (per device, decided by
measurement: ``bench/gpu.py``), then takes the kernel that declares itself a scheme's own path
(:meth:`Kernel.default_for`: Shaw's), and falls back to ``sdpa`` where nothing better is known. A new kernel is one
file, one test and a row of docs/gpu.md's table of kernels (docs/gpu.md, "Adding a kernel"); the shared tests
(tests/kernels/test_conformance.py, test_auto_cases.py) check what it declares against what it computes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import torch
from torch import Tensor

if TYPE_CHECKING:
    from vitrel.layout.geometry import Grid
    from vitrel.layout.tokens import TokenLayout
    from vitrel.pos.base import PositionScheme, PosState

__all__ = [
    "AUTO",
    "AutoRule",
    "Kernel",
    "KernelDeviceError",
    "attn_impls",
    "check_choice",
    "check_impl",
    "device_name",
    "get_kernel",
    "list_kernels",
    "register_kernel",
    "resolve",
    "select_kernel",
    "takes_call",
]

_KERNELS: dict[str, type[Kernel]] = {}


class AutoRule(NamedTuple):
    """One rule of :data:`AUTO`: ``kernel`` for the schemes named ``schemes`` at ``fewest`` tokens or more; with
    ``training``, only where gradients are computed (:func:`torch.is_grad_enabled` when the state is prepared: a
    training step, not evaluation), where the kernel was measured faster forward and backward but not forward alone."""

    schemes: frozenset[str]
    fewest: int
    kernel: str
    training: bool = False


#: the learned-table schemes the fused kernel trains faster than SDPA's float mask at N = 4096 on an H100
_TABLES = frozenset({"rel2d_full", "rel2d_factored", "rel2d_bucket", "rel2d_cpb", "fire2d", "rel1d_bucket"})

#: ``attn_impl="auto"`` per device (a substring of ``torch.cuda.get_device_name``): :class:`AutoRule` s, first match
#: wins, else the scheme's own kernel (``shaw`` for Shaw's content terms), else ``sdpa``. Only measured wins go here
#: (``bench/results/``, the attention layer of ``bench/attention.py`` in bf16, 65,536 tokens a batch):
#:
#: * H200 (the first fused kernel, ``gpu_h200_first_kernel.md``): it beat SDPA's float mask only for T5's 1-D buckets at
#:   N = 4096 (5.5x plain SDPA against 29x).
#: * H100 (``gpu_h100_bias_tiles.md``, the kernel with bias tiles): forward + backward at N = 4096, every learned
#:   table through ``triton`` took 3.18x-3.32x plain SDPA against 4.02x-4.31x (28x for ``rel1d_bucket``) and 1.07x its
#:   memory against 5.3x-5.5x; ``rel1d_bucket`` also at N = 1024 (2.49x against 4.84x). SDPA stayed faster at N = 1024
#:   for the 2-D tables (2.30x against 2.37x), at N = 196 for all, for ALiBi and LookHere (no table to train) at every
#:   size, and forward-only (``rel2d_full`` at N = 4096: 2.12x against 3.17x), hence ``training``.
#: * H100, the retuned kernel (``gpu_h100_retuned.md``: square 64 x 64 tiles in every kernel at head dim 64):
#:   ``rel2d_full`` through ``triton`` trains at 1.94x plain SDPA at N = 1024 against SDPA's float mask's 2.22x, in
#:   1.07x its memory against 1.83x (at 4096 2.22x, that run's other row ``auto``, so ``triton`` again: the float mask
#:   took 4.11x in ``gpu_h100_bias_tiles.md``; at 196 1.59x against 1.51x, where SDPA stays). The
#:   other tables were not timed with the retuned kernel at N = 1024 (with the earlier tiles, ``gpu_h100_untuned.md``,
#:   ``triton`` was within 5 % of SDPA there, either way).
#: * ``rel2d_factored`` trains fastest folded into the queries and keys (``fold``, :data:`_FOLD`) from N = 1024 on
#:   both: H100 1.64x / 2.73x plain SDPA at N = 1024 / 4096, against SDPA's float mask 2.32x / 4.02x and ``triton``
#:   2.39x / 3.18x; H200 (the baseline, ``gpu_h200_first_kernel.md``, ``attention_h200_offset_index.md``) 1.58x-1.71x /
#:   2.82x-2.85x against 2.22x-2.39x / 4.01x-4.08x. Its peak memory is 1.40x / 2.07x plain SDPA's (the float mask's
#:   1.82x / 5.32x, ``triton``'s 1.07x). SDPA's mask stays at N = 196 (1.47x-1.57x against 1.53x-1.61x); the
#:   forward alone was not timed with ``fold``.
#: * H100, the retuned kernel, every table (``gpu_h100_tables.md``), trained at N = 1024 / 4096: ``triton`` 1.85x-2.11x
#:   / 2.23x-2.42x plain SDPA. (That run's rows without ``@`` are ``auto`` as its rules then were: SDPA's float mask at
#:   196 and, at 1024, for the 2-D buckets, CPB and FIRE; ``triton`` again for the full table and T5's buckets at 1024
#:   and every table at 4096, the factored one ``fold``: the same kernel twice in one run, 2.03x against 1.85x for the
#:   full table at 1024, which bounds what a smaller margin means.) At 1024 ``triton`` beat SDPA's float mask for CPB
#:   (2.01x against 2.44x) and FIRE (2.04x against 2.52x); the 2-D buckets trained fastest folded (1.88x against
#:   ``triton``'s 2.07x and the mask's 2.36x), the factored table folded (1.66x against ``triton``'s 1.85x). At 4096
#:   ``triton`` beat ``fold`` for the factored table (2.25x against 2.74x) and the 2-D buckets (2.38x against 2.90x),
#:   hence the 4096 rule first. At 196 SDPA's mask stayed the fastest for every table (1.53x-1.82x against
#:   1.82x-2.33x). The full table and T5's buckets keep ``triton`` from 1024 (``gpu_h100_retuned.md``,
#:   ``gpu_h100_bias_tiles.md``).
_FOLD = AutoRule(frozenset({"rel2d_factored"}), 1024, "fold", training=True)
AUTO: dict[str, list[AutoRule]] = {
    "H200": [_FOLD, AutoRule(frozenset({"rel1d_bucket"}), 4096, "triton", training=True)],
    "H100": [
        AutoRule(_TABLES, 4096, "triton", training=True),
        AutoRule(frozenset({"rel2d_factored", "rel2d_bucket"}), 1024, "fold", training=True),
        AutoRule(frozenset({"rel1d_bucket", "rel2d_full", "rel2d_cpb", "fire2d"}), 1024, "triton", training=True),
    ],
}


class KernelDeviceError(ValueError):
    """A kernel named by ``attn_impl`` that cannot run on the call's device or dtype (``flex``'s training on CPU,
    ``triton`` off CUDA): a sentence naming what to use instead (``train.py`` prints it as one line)."""


class Kernel:
    """One attention implementation (see the module docstring). Class methods only: a kernel holds no state."""

    name: ClassVar[str] = "base"
    reads: ClassVar[frozenset[str]] = frozenset()
    takes_layout: ClassVar[bool] = True
    takes_dropout: ClassVar[bool] = True
    native_causal: ClassVar[bool] = False
    window_layouts: ClassVar[bool] = False
    #: ``torch.onnx`` can translate what it runs (a custom op cannot be)
    onnx: ClassVar[bool] = True
    #: float64 inputs computed in float64 (flex and triton take float32, float16 and bfloat16 only)
    float64: ClassVar[bool] = True
    #: rotary schemes' ``state.rope`` applied by :func:`vitrel.kernels.triton.rope.rope_rotate` (one launch for q and k)
    fused_rotation: ClassVar[bool] = False
    #: ``attend`` mixes the weights of a scheme that ``mixes_weights`` (GPSA) by its ``mix`` (else refused them)
    mixes_weights: ClassVar[bool] = False

    @classmethod
    def refuses(cls, scheme: PositionScheme) -> str | None:
        """Why this kernel cannot run ``scheme`` (a sentence naming both, and what to use instead), or None. By default
        the schemes that mix the attention weights after the softmax (GPSA), unless the kernel declares
        ``mixes_weights``: a kernel that refuses more returns its own reason ``or super().refuses(scheme)``."""
        if scheme.mixes_weights and not cls.mixes_weights:
            return (
                f"attn_impl={cls.name!r} computes one softmax; {scheme.name} mixes the attention weights with a "
                "positional attention of its own, which the eager path computes: use attn_impl='eager' (what 'auto' "
                "picks)"
            )
        return None

    @classmethod
    def refuses_inputs(
        cls, mask: Tensor | TokenLayout | None = None, causal: bool = False, layout: bool = False
    ) -> str | None:
        """Why this kernel cannot take a call's ``mask`` (what a layer is called with: a tensor broadcastable to
        ``[B, heads, N, N]``, a window mask ``[nW, N, N]``, the windows' layout) or causal attention (``causal``) on a
        token layout (``layout``: packed or token-dropped images): a sentence naming the kernels that can, or None."""
        return None

    @classmethod
    def default_for(cls, scheme: PositionScheme) -> bool:
        """This kernel is ``auto``'s choice for ``scheme`` on every device where no :data:`AUTO` rule applies (a
        scheme family's own path, which no general kernel computes: Shaw's content terms)."""
        return False

    @classmethod
    def inputs(cls, scheme: PositionScheme, grid: Grid, num_prefix_tokens: int) -> dict[str, Any]:
        """The :class:`~vitrel.pos.base.PosState` fields this kernel reads, for a full grid."""
        return {"bias": scheme.bias(grid, num_prefix_tokens)} if "bias" in cls.reads else {}

    @classmethod
    def layout_inputs(cls, scheme: PositionScheme, layout: TokenLayout, mask: Tensor) -> dict[str, Any]:
        """The fields for tokens laid out by ``layout`` (``mask``: its block-diagonal ``[B, 1, N, N]`` float mask
        of the images); ``grid`` is then the largest image extent, unless the fields hold another ``grid``."""
        return {"bias": scheme.layout_bias(layout, mask)}

    @classmethod
    def attend(
        cls, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, state: PosState, dropout_p: float = 0.0
    ) -> Tensor:
        raise NotImplementedError


#: the :class:`~vitrel.pos.base.PosState` fields a kernel may read (``Kernel.reads``)
READS = frozenset({"bias", "factors", "table", "block_mask"})


def register_kernel(name: str) -> Callable[[type[Kernel]], type[Kernel]]:
    """Class decorator: make a kernel runnable as ``attn_impl=name``. The class must declare what it reads
    (``reads``, some of :data:`READS`: a state holds only those) and define ``attend``."""

    def deco(cls: type[Kernel]) -> type[Kernel]:
        if name in _KERNELS or name == "auto":
            raise ValueError(f"attention kernel {name!r} is registered already")
        if not cls.reads or not cls.reads <= READS:
            raise TypeError(
                f"{cls.__name__} declares reads = {set(cls.reads) or 'frozenset()'}: declare the state fields attend "
                f"reads, some of {sorted(READS)} (a state holds only those; e.g. reads = frozenset({{'bias'}}))"
            )
        if cls.attend.__func__ is Kernel.attend.__func__:
            raise TypeError(f"{cls.__name__} defines no attend()")
        cls.name = name
        _KERNELS[name] = cls
        return cls

    return deco


def list_kernels() -> list[str]:
    return list(_KERNELS)


def attn_impls() -> tuple[str, ...]:
    """Every value ``attn_impl`` takes: ``auto`` and the registered kernels."""
    return ("auto", *_KERNELS)


def check_impl(impl: str) -> str:
    if impl != "auto" and impl not in _KERNELS:
        raise ValueError(f"attn_impl must be one of {attn_impls()}, got {impl!r}")
    return impl


def check_choice(impl: str, scheme: PositionScheme | None = None, attn_drop: float = 0.0) -> str:
    """``impl`` checked where a layer or model is built, so that a kernel named (not ``auto``, which chooses per call)
    that cannot run ``scheme`` (:meth:`Kernel.refuses`) or drop attention weights (``attn_drop > 0``,
    ``takes_dropout``) raises there, not at the first training step (Lightning's sanity check runs in eval mode,
    without dropout). ``Attention.attn_impl`` set on a built layer is checked here too; the forward checks again
    (:func:`resolve`), against the scheme a layer without one of its own is given."""
    check_impl(impl)
    if impl == "auto":
        return impl
    kernel = _KERNELS[impl]
    reason = None if scheme is None else kernel.refuses(scheme)
    if reason is not None:
        raise ValueError(reason)
    if attn_drop > 0 and not kernel.takes_dropout:
        raise ValueError(
            f"attn_impl={impl!r} has no attention dropout (attn_drop={attn_drop:g}): use attn_impl='sdpa', or 'auto', "
            "which picks a kernel that drops weights when training"
        )
    return impl


def get_kernel(name: str) -> type[Kernel]:
    """The kernel registered as ``name`` (``auto`` states are prepared with a concrete kernel; see :func:`resolve`)."""
    check_impl(name)
    return _KERNELS["sdpa" if name == "auto" else name]


def device_name(device: torch.device | str | None) -> str | None:
    """The name of a CUDA device (``torch.cuda.get_device_name``'s), None for any other. Read from
    ``get_device_properties``, which ``torch.compile`` folds to a constant; ``get_device_name`` it cannot trace (a
    graph break in every attention layer's forward under ``attn_impl="auto"``, an error with ``fullgraph=True``)."""
    if device is None or torch.device(device).type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).name


def takes_call(
    kernel: type[Kernel],
    scheme: PositionScheme,
    dropout: bool = False,
    dtype: torch.dtype | None = None,
    mask: Tensor | TokenLayout | None = None,
    causal: bool = False,
    layout: bool = False,
) -> bool:
    """Whether ``kernel`` runs this call, by what it declares: the scheme (:meth:`Kernel.refuses`), attention dropout
    (``takes_dropout``), float64 tokens (``Kernel.float64``), a token layout (``takes_layout``) and the call's other
    inputs (:meth:`Kernel.refuses_inputs`)."""
    return (
        kernel.refuses(scheme) is None
        and (kernel.takes_dropout or not dropout)
        and (kernel.float64 or dtype != torch.float64)
        and (kernel.takes_layout or not layout)
        and kernel.refuses_inputs(mask, causal, layout) is None
    )


def select_kernel(
    scheme: PositionScheme,
    n_tokens: int,
    device: str | None,
    training: bool | None = None,
    dropout: bool = False,
    dtype: torch.dtype | None = None,
    mask: Tensor | TokenLayout | None = None,
    causal: bool = False,
    layout: bool = False,
) -> str:
    """``attn_impl="auto"`` on the device named ``device`` (:func:`device_name`): the first :data:`AUTO` rule of that
    device that matches (``training``: gradients computed, default :func:`torch.is_grad_enabled`), if its kernel takes
    the call (:func:`takes_call`: the scheme; with ``dropout``, attention dropout; tokens of ``dtype``; the ``mask``
    the layer is called with; ``causal`` attention; a token ``layout``); else the first kernel that is the scheme's
    own (:meth:`Kernel.default_for`); else ``sdpa``. A rule whose kernel cannot take the call is passed over, so
    ``auto`` never picks a kernel that refuses it: the fused Triton kernel refuses the video schemes
    (``grid_dims == 3``), which therefore get ``sdpa`` on every device until a rule names another kernel that takes
    them (``flex``, ``fold``), and masks that differ per head, which get ``sdpa`` (or ``fold``) instead; on the CPU
    (``device`` None) every scheme gets ``sdpa`` or its own kernel."""
    training = torch.is_grad_enabled() if training is None else training
    for key, rules in AUTO.items():
        if device is not None and key in device:
            for rule in rules:
                if scheme.name in rule.schemes and n_tokens >= rule.fewest and (training or not rule.training):
                    if takes_call(_KERNELS[rule.kernel], scheme, dropout, dtype, mask, causal, layout):
                        return rule.kernel
    return next((name for name, k in _KERNELS.items() if k.default_for(scheme)), "sdpa")


def resolve(
    impl: str,
    scheme: PositionScheme,
    n_tokens: int,
    device: torch.device | None,
    dropout: bool = False,
    dtype: torch.dtype | None = None,
    mask: Tensor | TokenLayout | None = None,
    causal: bool = False,
    layout: bool = False,
) -> type[Kernel]:
    """The kernel ``impl`` names (``auto``: :func:`select_kernel`; ``dropout``: the layer drops attention weights;
    ``dtype``: the tokens'; ``mask``, ``causal``, ``layout``: the call's, :meth:`Kernel.refuses_inputs`), checked
    against ``scheme`` and the call's inputs: a clear error naming the kernels that can run them when it cannot."""
    check_impl(impl)
    auto = impl == "auto"
    case = dict(dropout=dropout, dtype=dtype, mask=mask, causal=causal, layout=layout)
    name = select_kernel(scheme, n_tokens, device_name(device), **case) if auto else impl
    kernel = _KERNELS[check_choice(name, scheme)]
    reason = kernel.refuses_inputs(mask, causal, layout)
    if reason is not None:
        raise ValueError(reason)
    return kernel
