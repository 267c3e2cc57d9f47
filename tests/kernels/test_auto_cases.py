"""``attn_impl="auto"`` over the cases a layer is called with: on every device of :data:`~vitrel.kernels.AUTO` (and the
CPU) the kernel it picks takes the call by what that kernel declares, what each kernel declares is what it does when
run on the CPU (the fused kernel through Triton's interpreter), and a kernel named for a case it cannot take refuses in
one line naming kernels that can. The devices are read by name (:func:`~vitrel.kernels.registry.select_kernel` takes
it), so the GPUs' choices are enumerated here without one; nothing runs at the sizes the rules name."""

from __future__ import annotations

import itertools
import re

import pytest
import torch

from vitrel import Attention
from vitrel.kernels import AUTO, get_kernel, list_kernels
from vitrel.kernels.registry import check_choice, select_kernel, takes_call
from vitrel.layout.geometry import Grid
from vitrel.layout.tokens import TokenLayout
from vitrel.pos import build_pos, get_pos_class, list_pos

HEADS, HEAD_DIM, GRID = 2, 8, Grid(3, 4)
DEVICES = [None, "NVIDIA H100 80GB HBM3", "NVIDIA H200"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
#: every relative scheme (and none), built once
SCHEMES = {
    n: build_pos(n, num_heads=HEADS, head_dim=HEAD_DIM, grid=(2, *GRID) if get_pos_class(n).grid_dims == 3 else GRID)
    for n in list_pos("relative")
}
#: a layer's mask, by its shape for ``b`` rows of ``n`` tokens (``windows``: the windows' layout)
MASKS = {
    "none": None,
    "key": lambda b, n: (b, 1, 1, n),
    "head": lambda b, n: (b, HEADS, n, n),
    "shared": lambda b, n: (b, 1, n, n),
}
#: patch tokens either side of every rule's ``fewest``, plus 0 or 1 prefix token
SIZES = sorted({n + p for n in {196, *(r.fewest - 1 for rules in AUTO.values() for r in rules)} for p in (0, 1)})

_WINDOWS = TokenLayout.windows(torch.tensor([[0] * 12, [0] * 6 + [1] * 6]), GRID, 2)


def _mask(kind: str, b: int, n: int, dtype: torch.dtype) -> torch.Tensor | TokenLayout | None:
    """A zero-stride mask of ``kind`` (nothing ``N x N`` is allocated at the rules' sizes)."""
    if kind == "windows":
        return _WINDOWS
    if MASKS[kind] is None:
        return None
    return torch.zeros((), dtype=dtype).expand(MASKS[kind](b, n))


def test_auto_picks_a_kernel_that_takes_every_call():
    """Every scheme x mask (none, key ``[B, 1, 1, N]``, per head ``[B, heads, N, N]``, shared ``[B, 1, N, N]``,
    windows) x prefix tokens (0, 1) x token layout (full grid; packed or token-dropped images) x causal x dropout x
    dtype x grad mode x device (CPU, H100, H200), at sizes either side of every rule: the kernel ``auto`` picks takes
    the call by each of its declared checks, and is the measured rule's kernel wherever that kernel takes it (the
    acceptance checks only pass over a kernel that cannot). (Selection reads a mask's shape, not its dtype, and a
    layout's presence, not its kind: boolean masks and each kind of layout are run below.)"""
    masks = {(kind, n): _mask(kind, 2, n, torch.float32) for kind in [*MASKS, "windows"] for n in SIZES}
    measured = {
        (name, n, device, grad): select_kernel(s, n, device, grad)
        for name, s in SCHEMES.items()
        for n, device, grad in itertools.product(SIZES, DEVICES, [False, True])
    }
    cases = itertools.product([False, True], [*MASKS, "windows"], [False, True], [False, True], DTYPES, [False, True],
                              DEVICES)  # fmt: skip
    seen = 0
    for tokens, kind, causal, dropout, dtype, grad, device in cases:
        if tokens and kind == "windows":
            continue
        for (name, s), n in itertools.product(SCHEMES.items(), SIZES):
            mask = masks[kind, n]
            case = dict(dropout=dropout, dtype=dtype, mask=mask, causal=causal, layout=tokens)
            picked = select_kernel(s, n, device, grad, **case)
            k = get_kernel(picked)
            where = (name, n, kind, tokens, causal, dropout, dtype, grad, device, picked)
            assert k.refuses(s) is None, where
            assert k.takes_dropout or not dropout, where
            assert k.float64 or dtype != torch.float64, where
            assert k.takes_layout or not tokens, where
            assert k.refuses_inputs(mask, causal, tokens) is None, where
            rule = measured[name, n, device, grad]
            assert picked == rule or not takes_call(get_kernel(rule), s, **case), where
            seen += 1
    assert seen > 50_000


def test_auto_passes_the_fused_kernel_over_for_calls_it_cannot_take():
    """The cases that showed it, on an H100 training ``rel2d_full`` at N = 4096 (its rule: ``triton``): a mask per
    head, and causal attention on packed images, get ``sdpa``; a key mask, a shared mask and windows keep ``triton``;
    ``rel2d_factored`` at 1024 keeps ``fold`` with a mask per head (fold takes one)."""
    s, h100 = SCHEMES["rel2d_full"], DEVICES[1]
    for kind, want in (("none", "triton"), ("key", "triton"), ("shared", "triton"), ("head", "sdpa")):
        assert select_kernel(s, 4096, h100, True, mask=_mask(kind, 2, 4096, torch.float32)) == want, kind
    assert select_kernel(s, 4096, h100, True, mask=_WINDOWS) == "triton"
    assert select_kernel(s, 4096, h100, True, causal=True) == "triton"
    assert select_kernel(s, 4096, h100, True, causal=True, layout=True) == "sdpa"
    assert select_kernel(s, 4096, h100, True, layout=True) == "triton"
    factored = SCHEMES["rel2d_factored"]
    assert select_kernel(factored, 1024, h100, True, mask=_mask("head", 2, 1024, torch.float32)) == "fold"


# ---- what each kernel does, run on the CPU at a tiny size: it refuses exactly what it declares
def _layout(kind: str, prefix: int) -> TokenLayout:
    """Packed images (3 x 4 and 2 x 2) or two rows of one 3 x 4 image each with different tokens dropped."""
    if kind == "packed":
        return TokenLayout.packed([GRID, Grid(2, 2)], prefix)
    pre = [(-1, k) for k in range(prefix)]
    rows = [
        [rc for i, rc in enumerate(itertools.product(range(3), range(4))) if i not in drop] for drop in ((2, 5), (0,))
    ]
    n = prefix + 12 - 1
    coords = [pre + r + [(-1, -1)] * (n - prefix - len(r)) for r in rows]
    segment = [[0] * (prefix + len(r)) + [-1] * (n - prefix - len(r)) for r in rows]
    image = [[i if t == 0 else -1 for t in seg] for i, seg in enumerate(segment)]
    return TokenLayout.build(torch.tensor(segment), torch.tensor(coords), torch.tensor(image), [GRID, GRID], prefix)


def _call(kind: str, mask_kind: str, prefix: int):
    """``(x, grid, mask)`` of a layer's forward: a full grid, a layout or a batch of windows, and a mask of
    ``mask_kind`` (``*_bool``: boolean; ``query``: ``[B, 1, N, 1]``, finite; ``square``: ``[N, N]``) that leaves every
    query a key: the diagonal, or the first token of each image (which a causal query sees too)."""
    if kind == "windows":
        return torch.randn(4, 12, HEADS * HEAD_DIM), GRID, _WINDOWS
    layout = TokenLayout.from_grid(GRID, prefix, 2) if kind == "full" else _layout(kind, prefix)
    b, n = layout.segment.shape
    x = torch.randn(b, n, HEADS * HEAD_DIM)
    base = mask_kind.removesuffix("_bool")
    if base == "none":
        return x, GRID if kind == "full" else layout, None
    shape = {"query": (b, 1, n, 1), "square": (n, n)}.get(base) or MASKS[base](b, n)
    keep = torch.rand(shape, generator=torch.Generator().manual_seed(0)) > 0.3
    if shape[-1] == n:
        first = (layout.index == 0).view(b, 1, 1, n)
        keep |= (first if len(shape) == 4 else first[0, 0]) | (
            torch.eye(n, dtype=torch.bool) if shape[-2] == n else False
        )
    mask = (
        keep
        if mask_kind.endswith("_bool")
        else torch.zeros(shape).masked_fill(~keep, -1.0 if base == "query" else -torch.inf)
    )
    return x, GRID if kind == "full" else layout, mask


#: a scheme each kernel run here takes (another kernel: the first of :data:`SCHEMES` it takes on an image grid)
RUNS = {"sdpa": "rel2d_full", "eager": "shaw2d_full", "fold": "rel2d_bucket", "shaw": "shaw2d_factored",
        "triton": "rel2d_cpb"}  # fmt: skip
#: kernels left out here, and why
NOT_RUN = {
    "flex": "compiled per shape, slow on the CPU, and no AUTO rule names it: tests/kernels/test_flex.py",
    "triton_atomic": "triton's forward, which is all this runs",
}
RUN_MASKS = ["none", "key", "key_bool", "head", "head_bool", "shared", "shared_bool", "query", "square"]


def run_scheme(impl: str) -> str:
    """The scheme :func:`check_calls` runs ``impl`` with."""
    kernel = get_kernel(impl)
    takes = [n for n, s in SCHEMES.items() if s.grid_dims != 3 and kernel.refuses(s) is None]
    return RUNS.get(impl) or next(n for n in ["rel2d_full", *takes] if n in takes)


def check_calls(impl: str, pos: str, interpreted: bool = False) -> None:
    """Each mask (float and boolean) x layout (full grid with a prefix token, packed, token-dropped, windows) x
    causal, run forward by ``impl`` on ``pos``: it refuses, with the declared sentence, exactly the calls
    :meth:`~vitrel.kernels.Kernel.refuses_inputs` and ``takes_layout`` declare, and computes the others as ``eager``
    does (the reference: every case); with attention dropout it drops weights (``takes_dropout``) or is refused where
    it is built. ``interpreted``: boolean and ``[N, N]`` masks left out (they reach the kernel as the float masks of
    ``shared`` and ``key``: Triton's interpreter's time)."""
    kernel = get_kernel(impl)
    if kernel.takes_dropout:
        torch.manual_seed(0)
        a = Attention(HEADS * HEAD_DIM, HEADS, pos=pos, grid=GRID, attn_impl=impl, attn_drop=0.5)
        x = torch.randn(2, GRID.n, HEADS * HEAD_DIM)
        with torch.no_grad():
            kept, dropped = a.eval()(x, GRID), a.train()(x, GRID)
        assert (dropped - kept).abs().max() > 1e-3, f"attn_impl={impl!r} declares takes_dropout and dropped nothing"
    # (else refused where it is built: test_a_named_kernels_refusal_is_one_line_naming_kernels_that_take_the_call)
    cases = [("none", "windows", c) for c in (False, True)]
    cases += [(m, lay, c) for m in RUN_MASKS for lay in ("full", "packed", "drop") for c in (False, True)]
    for mask_kind, layout, causal in cases:
        if interpreted and (mask_kind.endswith("_bool") or mask_kind == "square"):
            continue
        prefix = 0 if layout == "windows" else 1
        torch.manual_seed(0)
        x, grid, mask = _call(layout, mask_kind, prefix)
        kw = dict(pos=pos, grid=GRID, num_prefix_tokens=prefix, causal=causal)  # (a layout: its own count)
        a = Attention(HEADS * HEAD_DIM, HEADS, attn_impl=impl, **kw)
        tokens = layout in ("packed", "drop")
        declared = kernel.refuses_inputs(mask, causal, tokens)
        no_layout = tokens and not kernel.takes_layout
        where = (impl, mask_kind, layout, causal)
        with torch.no_grad():
            try:
                out = a(x, grid, mask)
            except ValueError as e:
                assert str(e) == declared or (declared is None and no_layout and "does not take packed" in str(e)), (
                    where,
                    str(e),
                )
                continue
            assert declared is None and not no_layout, (where, declared)
            ref = Attention(HEADS * HEAD_DIM, HEADS, attn_impl="eager", **kw)
            ref.load_state_dict(a.state_dict())
            torch.testing.assert_close(out, ref(x, grid, mask), rtol=1e-4, atol=1e-5, msg=str(where))


@pytest.mark.parametrize("impl", [k for k in list_kernels() if k not in NOT_RUN])
def test_a_kernel_refuses_exactly_the_calls_it_declares(impl):
    """:func:`check_calls` for every kernel. The measured rules' kernels run forward here only: ``triton``'s
    backward, through the interpreter, is ``tests/kernels/test_triton_bias.py``'s."""
    check_calls(impl, run_scheme(impl), interpreted=impl == "triton")


# ---- a named kernel's refusals: one line, naming kernels that take the call
def _named(message: str) -> list[str]:
    """The kernels (and ``auto``) a refusal tells the user to use: the quoted names after its last ``use``."""
    tail = message.rsplit("use ", 1)[-1]
    return [n for n in re.findall(r"'(\w+)'", tail) if n == "auto" or n in list_kernels()]


def _check_message(message: str, s, **case) -> None:
    assert "\n" not in message and message.startswith("attn_impl="), message
    names = _named(message)
    assert names, message
    for name in names:
        if name == "auto":
            picks = [select_kernel(s, n, d, t, **case) for n in SIZES for d in DEVICES for t in (False, True)]
            assert all(takes_call(get_kernel(p), s, **case) for p in picks), (message, picks)
        else:
            assert takes_call(get_kernel(name), s, **case), (message, name)


@pytest.mark.parametrize("impl", list_kernels())
def test_a_named_kernels_refusal_is_one_line_naming_kernels_that_take_the_call(impl):
    """For every scheme (at head dim 8, and at 256, above the fused kernel's): the kernel's refusal of the scheme, of
    attention dropout and of the call's inputs (a mask per head, causal attention on a layout) is one line, and every
    kernel it names (``auto`` on every device) takes the call."""
    kernel = get_kernel(impl)
    head = _mask("head", 2, 12, torch.float32)
    wide = {n: build_pos(n, num_heads=HEADS, head_dim=256, grid=s.grid) for n, s in SCHEMES.items()}
    for name, s in [*SCHEMES.items(), *wide.items()]:
        why = kernel.refuses(s)
        if why is not None:
            assert name in why, why
            _check_message(why, s)
            continue
        if not kernel.takes_dropout:
            with pytest.raises(ValueError) as err:
                check_choice(impl, s, attn_drop=0.1)
            _check_message(str(err.value), s, dropout=True)
        for case in (dict(mask=head), dict(causal=True, layout=True)):
            why = kernel.refuses_inputs(**case)
            if why is not None:
                _check_message(why, s, **case)
    if not kernel.float64:  # (said where it runs: the fused kernel's device check, FlexAttention's call)
        a = Attention(HEADS * HEAD_DIM, HEADS, pos="rel2d_full", grid=GRID, attn_impl=impl).double()
        with pytest.raises(ValueError) as err, torch.no_grad():
            a(torch.randn(1, GRID.n, HEADS * HEAD_DIM, dtype=torch.float64), GRID)
        _check_message(str(err.value), SCHEMES["rel2d_full"], dtype=torch.float64)


def test_a_layer_under_auto_chooses_for_the_call_it_is_given(monkeypatch):
    """An ``Attention`` layer hands its forward's mask, causal flag and token layout to ``auto``: under a rule that
    names the fused kernel (a GPU's name read as ``"Test GPU"``), a mask per head and causal attention on packed images
    run ``sdpa`` (they reached ``triton``, which raised), a key mask runs ``triton`` (the interpreter); the same for a
    state prepared for ``triton`` by a model and handed to the layer."""
    from vitrel.kernels import AutoRule, registry

    monkeypatch.setattr(registry, "device_name", lambda device: "Test GPU")
    monkeypatch.setitem(AUTO, "Test GPU", [AutoRule(frozenset({"rel2d_full", "none"}), 0, "triton", training=True)])
    torch.manual_seed(0)
    kw = dict(pos="rel2d_full", grid=GRID, num_prefix_tokens=1)
    auto, ref = Attention(16, HEADS, **kw), Attention(16, HEADS, attn_impl="eager", **kw)
    ref.load_state_dict(auto.state_dict())
    for mask_kind, want in (("head", "sdpa"), ("key", "triton"), ("none", "triton")):
        x, grid, mask = _call("full", mask_kind, 1)
        assert auto._state(x, grid, None, mask).impl == want, mask_kind
        torch.testing.assert_close(auto(x, grid, mask), ref(x, grid, mask), rtol=1e-4, atol=1e-5)
    shared = Attention(16, HEADS, pos="shared")
    shared.load_state_dict(auto.state_dict(), strict=False)  # (its projections)
    st = auto.pos.prepare(GRID, 1, kernel=get_kernel("triton"))
    x, _, mask = _call("full", "head", 1)
    assert shared._state(x, None, st, mask).impl == "sdpa"
    torch.testing.assert_close(shared(x, mask=mask, pos_state=st), ref(x, GRID, mask), rtol=1e-4, atol=1e-5)
    causal, eager = (Attention(16, HEADS, pos="none", grid=GRID, causal=True, attn_impl=i) for i in ("auto", "eager"))
    eager.load_state_dict(causal.state_dict())
    x, layout, _ = _call("packed", "none", 0)
    assert causal._state(x, layout, None).impl == "sdpa"
    assert causal._state(x[:, :12], GRID, None).impl == "triton"  # (a full grid: the kernel's own causal mask)
    torch.testing.assert_close(causal(x, layout), eager(x, layout), rtol=1e-4, atol=1e-5)
