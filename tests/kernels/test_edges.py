"""Every kernel the CPU runs, through the attention layer, against the float64 equation written out:
``proj(softmax(q k^T * scale + bias + mask) v)`` (dense, autograd for the gradients of the input and every
parameter, the scheme's tables included), at the edges a user hits: key padding masks (NaFlex) of the documented
shape ``[B, 1, 1, N]``."""

from __future__ import annotations

import copy
import os

import pytest
import torch

if not torch.cuda.is_available():  # before the kernels are first imported
    os.environ["TRITON_INTERPRET"] = "1"

from vitrel import Attention  # noqa: E402
from vitrel.kernels import get_kernel  # noqa: E402
from vitrel.kernels.triton import interpreter_on  # noqa: E402

TRITON = [pytest.param(k, marks=pytest.mark.skipif(not interpreter_on(), reason="Triton's interpreter is off"))
          for k in ("triton", "triton_atomic")]  # fmt: skip


def reference(layer: Attention, x: torch.Tensor, grid, mask: torch.Tensor | None) -> torch.Tensor:
    """The layer's function in float64 from the equation (the scheme's rotation and dense bias)."""
    b, n, c = x.shape
    h, d = layer.num_heads, layer.head_dim
    q, k, v = (x @ layer.qkv.weight.T + layer.qkv.bias).reshape(b, n, 3, h, d).permute(2, 0, 3, 1, 4).unbind(0)
    st = layer.pos.prepare(grid, layer.num_prefix_tokens, x.device, x.dtype, get_kernel("eager"))
    q, k = layer.pos.rotate(q, k, st)
    logits = q @ k.transpose(-1, -2) * layer.scale
    if layer.pos.has_bias:
        logits = logits + layer.pos.bias(grid, layer.num_prefix_tokens)
    if mask is not None:
        logits = logits + mask
    out = (softmax_over_open_keys(logits) @ v).transpose(1, 2).reshape(b, n, c)
    return out @ layer.proj.weight.T + layer.proj.bias


def softmax_over_open_keys(logits: torch.Tensor) -> torch.Tensor:
    """Each row's softmax over the keys it sees (finite logits), one row at a time; a row that sees no key is 0 (the
    empty sum: SDPA's rule)."""
    rows = logits.reshape(-1, logits.shape[-1])
    out = [torch.zeros_like(r) if bool(torch.isinf(r).all()) else r.softmax(-1) for r in rows]
    return torch.stack(out).reshape(logits.shape)


def check_layer(impl, pos, grid, prefix, b, mask=None, d=8, heads=2):
    """The layer (float32, ``impl``) against :func:`reference`: output and every gradient, within 1e-4 of the largest
    reference entry, plus 1e-6 (a gradient zero in exact arithmetic, a table's rows on a grid one token high)."""
    torch.manual_seed(0)
    layer = Attention(d * heads, heads, pos=pos, grid=grid, num_prefix_tokens=prefix, attn_impl=impl)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    ref = copy.deepcopy(layer).double()
    n = prefix + grid[0] * grid[1]
    x, go = torch.randn(2, b, n, d * heads, dtype=torch.float64)
    x64 = x.clone().requires_grad_()
    m64 = mask
    if mask is not None and mask.dtype == torch.bool:
        m64 = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, float("-inf"))
    want = reference(ref, x64, grid, m64)
    (want * go).sum().backward()
    x32 = x.float().requires_grad_()
    got = layer(x32, grid, mask if mask is None or mask.dtype == torch.bool else mask.float())
    (got * go.float()).sum().backward()
    pairs = [("out", got, want), ("dx", x32.grad, x64.grad)]
    pairs += [(nm, p.grad, r.grad) for (nm, p), r in zip(layer.named_parameters(), ref.parameters())]
    for name, a, r in pairs:
        assert (a is None) == (r is None), name
        if r is not None:
            err, size = (a.double() - r).abs().max().item(), r.abs().max().item()
            assert err < 1e-4 * size + 1e-6, f"{impl} {pos} {name}: {err:.2e} of {size:.2e}"


EDGES = [((1, 1), 0, 8, 1), ((1, 2), 1, 24, 3), ((1, 17), 2, 40, 3), ((3, 5), 1, 8, 1)]  # grid, prefix, d, batch


@pytest.mark.parametrize(("grid", "prefix", "d", "b"), EDGES)
@pytest.mark.parametrize(
    ("impl", "pos"),
    [("sdpa", "rel2d_cpb"), ("fold", "rel2d_bucket"), ("eager", "fire2d"), *[pytest.param(*c, marks=t.marks)
     for t in TRITON for c in ((t.values[0], "rel2d_factored"), (t.values[0], "rope2d_mixed"))]],
)  # fmt: skip
def test_token_counts_prefix_and_head_dims_equal_the_equation(impl, pos, grid, prefix, d, b):
    """1, 2 and 17 patch tokens (not a multiple of any tile), prefix tokens, a non-square grid, head dims 8 / 24 /
    40, batches 1 and 3: output, input and every parameter's gradient (tables, MLPs, frequencies; the fused
    kernel's rotation) are the equation's."""
    check_layer(impl, pos, grid, prefix, b, d=d)


@pytest.mark.parametrize("impl", ["eager", "sdpa", *TRITON])
@pytest.mark.parametrize("as_bool", [False, True])
@pytest.mark.parametrize(("grid", "prefix", "b"), [((3, 5), 1, 3), ((1, 7), 0, 1)])
def test_key_padding_mask_equals_the_equation(impl, as_bool, grid, prefix, b):
    """A key padding mask ``[B, 1, 1, N]`` (NaFlex: each image's padding keys masked for every query), float
    ``-inf`` or boolean (True: attend), is the equation's for every kernel that takes masks, the fused Triton kernel
    included (which read it as a full ``[B, N, N]`` mask before and failed on the reshape)."""
    n = prefix + grid[0] * grid[1]
    keep = torch.rand(b, n, generator=torch.Generator().manual_seed(1)) > 0.3
    keep[:, 0] = True
    mask = keep[:, None, None] if as_bool else torch.zeros(b, 1, 1, n).masked_fill(~keep[:, None, None], -torch.inf)
    check_layer(impl, "rel2d_full", grid, prefix, b, mask)


def padding(pair: bool) -> torch.Tensor:
    """Image 1 of 2 on a 3 x 5 grid ends in 6 padding tokens: a key padding mask ``[B, 1, 1, N]`` (padding keys
    closed to every query) or a pair mask ``[B, 1, N, N]`` (also every key closed to a padding query)."""
    keep = torch.ones(2, 15, dtype=torch.bool)
    keep[1, 9:] = False
    return keep[:, None, None] & keep[:, None, :, None] if pair else keep[:, None, None]


@pytest.mark.parametrize(
    ("impl", "pos", "pair"),
    [(i, "rel2d_full", True) for i in ("eager", "sdpa")]
    + [pytest.param(t.values[0], "rel2d_full", True, marks=t.marks) for t in TRITON]
    + [(i, "lookhere", pair) for i in ("eager", "sdpa") for pair in (False, True)],
)
def test_a_query_the_mask_leaves_no_key_attends_to_nothing(impl, pos, pair):
    """A padding query under a pair mask, or one whose LookHere head looks only at padding keys, sees no key: its
    attention is 0 (SDPA's rule), its output ``proj``'s bias, and every gradient the equation's. The eager path gave
    NaN outputs there, and NaN gradients to every weight (``0 * NaN``), though the loss never read those rows."""
    mask = padding(pair)
    check_layer(impl, pos, (3, 5), 0, 2, mask)
    torch.manual_seed(0)
    layer = Attention(16, 2, pos=pos, grid=(3, 5), attn_impl=impl)
    assert (layer.attention_map(torch.randn(2, 15, 16), (3, 5), mask)[1, :, 9:].sum(-1) == 0).any()


def test_shaw_kernel_gives_a_query_the_mask_leaves_no_key_nothing():
    """Shaw's own kernel (``auto`` for its schemes) under a pair mask: the padding queries' output is ``proj``'s
    bias; output and every gradient equal the eager path's (float64), which the test above holds to the equation."""
    torch.manual_seed(0)
    x = torch.randn(2, 15, 16, dtype=torch.float64)
    outs = []
    for impl in ("shaw", "eager"):
        torch.manual_seed(0)
        layer = Attention(16, 2, pos="shaw2d_full", grid=(3, 5), attn_impl=impl).double()
        xi = x.clone().requires_grad_()
        y = layer(xi, (3, 5), padding(True))
        y.square().sum().backward()
        torch.testing.assert_close(y[1, 9:], layer.proj.bias.expand(6, 16))
        outs.append([y, xi.grad, *(p.grad for p in layer.parameters())])
    for got, want in zip(*outs):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("impl", TRITON)
def test_fused_kernel_refuses_a_second_derivative(impl):
    """A gradient penalty (``create_graph=True``, then backward) through the fused kernel raises: its backward is
    not differentiable, and treating its gradients as constants gave a second derivative 95 % off the float64
    equation's (``d |dL/dx|^2 / d qkv.weight``, rel2d_full on 3 x 5 + 1 prefix), with no warning."""
    torch.manual_seed(0)
    layer = Attention(16, 2, pos="rel2d_full", grid=(3, 5), num_prefix_tokens=1, attn_impl=impl)
    x = torch.randn(2, 16, 16, requires_grad=True)
    (gx,) = torch.autograd.grad(layer(x, (3, 5)).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        gx.square().sum().backward()


@pytest.mark.parametrize("impl", TRITON)
def test_fused_kernel_refuses_float64(impl):
    """The fused kernel computes in float32: float64 tokens came out at float32's precision (a 2e-8 output and a
    4e-6 ``dx`` error against the float64 equation, where SDPA's are 3e-15 and 9e-15) in a float64 tensor. Now a
    clear error, as FlexAttention's."""
    layer = Attention(16, 2, pos="rel2d_full", grid=(3, 5), num_prefix_tokens=1, attn_impl=impl).double()
    with pytest.raises(ValueError, match="float64"):
        layer(torch.randn(2, 16, 16, dtype=torch.float64), (3, 5))


def test_auto_passes_over_kernels_without_float64(monkeypatch):
    """``auto`` on a device whose rule picks the fused kernel takes SDPA for float64 tokens (a layer, and a model's
    shared states), the rule's kernel for float32."""
    import vitrel
    from vitrel.kernels import AUTO, AutoRule, registry
    from vitrel.layout.geometry import Grid

    monkeypatch.setattr(registry, "device_name", lambda device: "Test GPU")
    monkeypatch.setitem(AUTO, "Test GPU", [AutoRule(frozenset({"rel2d_full"}), 0, "triton", training=True)])
    layer = Attention(16, 2, pos="rel2d_full", grid=(3, 4), attn_impl="auto")
    for dtype, want in ((torch.float32, "triton"), (torch.float64, "sdpa")):
        x = torch.randn(1, 12, 16, dtype=dtype)
        assert layer._state(x, (3, 4), None).impl == want
        m = vitrel.create_model("vitrel_vit_tiny_patch4_32", pos="rel2d_full", img_size=16, depth=2, pos_share=True)
        assert {st.impl for st in m.to(dtype).position_states(Grid(4, 4), x)} == {want}
