"""Every registered kernel against the float64 equation, for every scheme it does not refuse: a layer with one prefix
token on a non-square grid (video schemes on a video grid), its output and the gradients of its input and of every
parameter, against ``softmax((q k^T + content_logits) * scale + bias) v + content_values`` written here from the
scheme's hooks in float64 (the softmax's weights mixed by the scheme's ``mix`` where it ``mixes_weights``). A kernel
that computes in float64 (``Kernel.float64``) is held to 1e-10 in float64, the others to 1e-4 in float32. A new
kernel is checked unasked (the cases are read from :func:`list_kernels`); tests/kernels/test_add_kernel.py runs
:func:`check_schemes` on kernels registered inside a test, wrong ones included. A kernel that declares ``onnx``
exports a ViT through ONNX Runtime (:func:`check_onnx`). The calls a kernel takes (masks, windows, layouts, causal
attention, dropout) are checked by tests/kernels/test_auto_cases.py."""

from __future__ import annotations

import copy
import os

import pytest
import torch

if not torch.cuda.is_available():  # before the kernels are first imported
    os.environ["TRITON_INTERPRET"] = "1"

from tests.reference import scheme_qkv  # noqa: E402
from vitrel import Attention  # noqa: E402
from vitrel.kernels import get_kernel, list_kernels  # noqa: E402
from vitrel.pos import build_pos, get_pos_class, list_pos  # noqa: E402

HEADS, HEAD_DIM = 2, 8
#: the grid of each scheme's layer: non-square, and a video grid for the video schemes
GRIDS = {2: (3, 4), 3: (2, 2, 3)}
#: every relative scheme (and none)
SCHEMES = list_pos("relative")
#: kernels left to their own tests here, and why
SLOW = {"flex": "compiled per shape on the CPU, about 5 s a scheme, and no backward there: tests/kernels/test_flex.py"}


def _grid(name: str) -> tuple[int, ...]:
    return GRIDS[3 if get_pos_class(name).grid_dims == 3 else 2]


def reference(layer: Attention, x: torch.Tensor, grid) -> torch.Tensor:
    """The layer's function in float64 from its scheme's hooks, on a dense state (no kernel)."""
    b, n, c = x.shape
    st = layer.pos.prepare(grid, layer.num_prefix_tokens, x.device, x.dtype)
    q, k, v = scheme_qkv(layer, x, state=st)
    logits = q @ k.transpose(-1, -2)
    terms = st.scheme.content_logits(q, st)
    logits = (logits if terms is None else logits + terms) * layer.scale
    if st.scheme.has_bias:
        logits = logits + st.scheme.bias(st.grid, layer.num_prefix_tokens)
    a = logits.softmax(-1)
    if st.scheme.mixes_weights:  # (GPSA's mixture, after the softmax: its equation is tests/pos/test_gpsa.py's)
        a = st.scheme.mix(a, None, st)
    out = a @ v
    values = st.scheme.content_values(a, st)
    out = (out if values is None else out + values).transpose(1, 2).reshape(b, n, c)
    return layer.proj(out)


def check_scheme(impl: str, name: str) -> None:
    """``impl`` on a layer of scheme ``name`` against :func:`reference`: output and every gradient."""
    kernel = get_kernel(impl)
    dtype, rtol = (torch.float64, 1e-10) if kernel.float64 else (torch.float32, 1e-4)
    grid = _grid(name)
    torch.manual_seed(0)
    layer = Attention(HEADS * HEAD_DIM, HEADS, pos=name, grid=grid, num_prefix_tokens=1, attn_impl=impl)
    with torch.no_grad():
        for p in layer.parameters():  # (tables start at zero: a kernel that drops the bias would pass)
            p.add_(torch.randn_like(p) * 0.3)
    ref = copy.deepcopy(layer).double()
    layer = layer.to(dtype)
    n = 1 + torch.Size(grid).numel()
    x, go = torch.randn(2, 2, n, HEADS * HEAD_DIM, dtype=torch.float64)
    x64 = x.clone().requires_grad_()
    want = reference(ref, x64, grid)
    (want * go).sum().backward()
    xk = x.to(dtype).requires_grad_()
    got = layer(xk, grid)
    (got * go.to(dtype)).sum().backward()
    pairs = [("out", got, want), ("dx", xk.grad, x64.grad)]
    pairs += [(nm, p.grad, r.grad) for (nm, p), r in zip(layer.named_parameters(), ref.parameters())]
    for what, a, r in pairs:
        assert (a is None) == (r is None), f"attn_impl={impl!r}, pos={name!r}: {what}'s gradient"
        if r is not None:
            err, size = (a.double() - r).abs().max().item(), r.abs().max().item()
            where = f"attn_impl={impl!r}, pos={name!r}, {what}"
            assert err <= rtol * size + 1e-6 * rtol, f"{where}: {err:.2e} of {size:.2e}"


def taken(impl: str) -> list[str]:
    """The schemes ``impl`` does not refuse."""
    kernel = get_kernel(impl)
    return [
        n for n in SCHEMES if kernel.refuses(build_pos(n, num_heads=HEADS, head_dim=HEAD_DIM, grid=_grid(n))) is None
    ]


def check_schemes(impl: str) -> list[str]:
    """:func:`check_scheme` for every scheme ``impl`` does not refuse; the names checked."""
    names = taken(impl)
    for name in names:
        check_scheme(impl, name)
    return names


@pytest.mark.parametrize("impl", [k for k in list_kernels() if k not in SLOW])
def test_every_kernel_computes_every_scheme_it_takes(impl):
    assert check_schemes(impl), f"attn_impl={impl!r} takes no scheme"


def check_onnx(impl: str, path) -> None:
    """A one-block ViT with ``impl`` through :func:`vitrel.export.onnx_program` and ONNX Runtime, equal to the model:
    what ``Kernel.onnx`` declares (an AssertionError naming the kernel where the export fails)."""
    import warnings

    import numpy as np
    import onnxruntime

    from vitrel.export import onnx_program
    from vitrel.models import create_model

    images = [n for n in taken(impl) if _grid(n) == GRIDS[2]]
    pos = "rel2d_full" if "rel2d_full" in images else images[0]
    torch.manual_seed(0)
    m = create_model("vitrel_vit_tiny_patch4_32", pos=pos, attn_impl=impl, img_size=16, embed_dim=16, depth=1,
                     num_heads=HEADS).eval()  # fmt: skip
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            onnx_program(m, dynamic="static").save(str(path))
    except Exception as e:  # (the exporter's own errors)
        raise AssertionError(f"attn_impl={impl!r} declares onnx and does not export to ONNX: {e}") from e
    sess = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = torch.randn(2, 3, 16, 16)
    (out,) = sess.run(None, {"images": x.numpy()})
    with torch.no_grad():
        np.testing.assert_allclose(out, m(x).numpy(), rtol=1e-4, atol=1e-4, err_msg=impl)


@pytest.mark.usefixtures("one_torchlib_registry")  # (tests/conftest.py)
@pytest.mark.parametrize("impl", [k for k in list_kernels() if get_kernel(k).onnx])
def test_a_kernel_that_declares_onnx_exports_to_onnx(impl, tmp_path):
    pytest.importorskip("onnxruntime", reason="pip install vitrel[export]")
    check_onnx(impl, tmp_path / "m.onnx")
