"""attn_impl="triton_atomic": the fused bias kernel with ``dq`` added by atomics in the ``dkdv`` kernel (no ``dq``
kernel), against the same float64 reference as ``triton`` (tests/kernels/test_triton_bias.py: the interpreter on this
CPU, bf16 under ``pytest -m cuda``); which launches run, and where the deterministic backward is kept."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # before the kernels are first imported (vitrel imports them lazily)
    os.environ["TRITON_INTERPRET"] = "1"

import vitrel  # noqa: E402
from tests.kernels.test_triton_bias import DEVICES, _check, _inputs, four_kernels, interpreted  # noqa: E402
from tests.kernels.test_triton_bias import pytestmark as pytestmark  # noqa: E402
from vitrel.kernels import get_kernel  # noqa: E402
from vitrel.kernels import triton as fused  # noqa: E402
from vitrel.kernels.triton import rel_bias_attention  # noqa: E402
from vitrel.layout.geometry import Grid  # noqa: E402
from vitrel.layout.windows import window_regions  # noqa: E402


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("grid", "prefix", "table_on", "table_grad"),
    [((5, 7), 1, True, True), ((4, 8), 1, True, True), ((4, 24), 1, True, False), ((3, 5), 0, False, False)],
)
def test_atomic_dq_equals_reference(device, grid, prefix, table_on, table_grad):
    """Output, ``dq, dk, dv`` and the table's gradient: a trained table read as bias tiles (``dkdv`` with atomics and
    ``dbias``; 4 x 8: patterns that repeat, several tiles adding into one row of ``dq``), a fixed one (4 x 24: bias
    tiles of three phases; one batch element, the others two), none."""
    _check(device, 1 if grid == (4, 24) else 2, 2, 16, grid, prefix, table_on=table_on, table_grad=table_grad,
           deterministic=False)  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("grid", "prefix", "d"), [((3, 7), 0, 32), ((4, 6), 2, 24), ((5, 5), 1, 16), ((3, 8), 1, 16),
                                               ((14, 14), 1, 16)])  # fmt: skip
def test_table_grad_with_atomic_dq_equals_reference(device, grid, prefix, d):
    """With ``dq`` added by atomics (no ``dq`` kernel), the ``dbias`` kernel sums the bias tiles' gradient, whether
    each tile is one pattern (3 x 7, 4 x 6, 5 x 5 in the interpreter's tiles; ViT-B/16's 197 tokens in a GPU's) or
    patterns are shared (3 x 8): the table's gradient and q, k, v's against the float64 reference, with and without
    prefix tokens; the launches asserted (no ``dq``). A batch of 3, so a program sums two batch elements. The table's
    gradient bitwise equal on a second run (its sums in a fixed order; only ``dq``'s atomics are not)."""
    if device == "cpu" and grid == (14, 14):  # (the interpreter's 16-token tiles: the grids above cover them)
        pytest.skip("197 tokens in a GPU's 64-token tiles: under -m cuda")
    n = prefix + grid[0] * grid[1]
    q, k, v, table = (t.float() for t in _inputs(3, 2, n, d, grid))  # (3: a share of two, in the interpreter's 2)
    launches = fused.plan(
        q, k, v, table, grid, prefix, bias_read="tiles", deterministic=False, sms=None if device == "cpu" else 132
    )
    if device == "cpu" or grid == (14, 14):  # (a GPU's tiles: the others fit one tile, or one pattern a tile)
        dkdv = launches["dkdv"]
        assert dkdv.args["ATOMIC_DQ"] and "dbias" in launches and "dq" not in launches
        assert launches["dbias"].args["n_split"] == 2 and dkdv.grid == (dkdv.grid[0], 3 * 2)  # (shares of 2 and 1)
        assert dkdv.grid[0] > 1  # (more than one key tile: the four kernels, not the one-tile one)
    _, grads = _check(device, 3, 2, d, grid, prefix, bias_read="tiles", deterministic=False)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    qd, kd, vd = (t.to(device, dtype).requires_grad_() for t in (q, k, v))
    td = table.to(device).requires_grad_()
    call = dict(bias_read="tiles", deterministic=False)
    out = rel_bias_attention(qd, kd, vd, td, grid, prefix, **call)
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)  # (_check's)
    (again,) = torch.autograd.grad(out, td, go.to(device, dtype))  # (the second run: _check's inputs, its go)
    assert torch.equal(again, grads[3])


@pytest.mark.parametrize("device", DEVICES)
def test_atomic_dq_causal_windows_and_batch_shares(device):
    """Causal 1-D (no tile above the diagonal adds to ``dq``), a batch of windows with their regions, and a batch run
    as shares of CUDA's grid (``dq``'s buffer sliced with each share)."""
    _check(device, 2, 2, 16, (1, 37), 0, causal=True, deterministic=False)
    regions = window_regions(Grid(7, 9), (4, 5), (2, 2))  # (an image's four windows; their ids repeated over a
    _check(device, 4, 2, 16, (4, 5), 0, regions=regions, deterministic=False)  # batch: test_kernel_window_regions)
    config = four_kernels(device, grid_y_max=12)  # 2 heads: at most 6 batch elements a launch
    _check(device, 9, 2, 16, (3, 4), 1, deterministic=False, config=config)


def _launches(deterministic: bool, table_grad: bool = True, **kw) -> dict:
    q, k, v, table = (t.float() for t in _inputs(2, 2, 1 + 70, 16, (5, 14)))  # (more than a GPU's one tile)
    call = dict(table=table, grid=(5, 14), num_prefix_tokens=1, deterministic=deterministic, **kw)
    return fused.plan(q, k, v, **call, table_grad=table_grad)


def test_which_launches_run():
    """No ``dq`` kernel where the ``dkdv`` kernel adds ``dq`` by atomics (the ``dbias`` kernel sums the bias tiles'
    gradient); the deterministic backward where the ``dq`` kernel reduces the table's gradient (the bias gathered per
    score, or summed per tile pattern: then no ``dbias`` kernel), by default, and under
    ``torch.use_deterministic_algorithms``."""

    def kernels(launches):
        return sorted(launches), launches["dkdv"].args["ATOMIC_DQ"]

    assert kernels(_launches(False, bias_read="tiles")) == (["dbias", "delta", "dkdv", "fwd"], True)
    assert kernels(_launches(False, table_grad=False)) == (["delta", "dkdv", "fwd"], True)
    assert kernels(_launches(False, bias_read="gather")) == (["delta", "dkdv", "dq", "fwd"], False)
    assert kernels(_launches(False, table_grad=False, bias_read="gather")) == (["delta", "dkdv", "fwd"], True)
    assert kernels(_launches(True, bias_read="tiles")) == (["delta", "dkdv", "dq", "fwd"], False)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert kernels(_launches(False, bias_read="tiles")) == (["delta", "dkdv", "dq", "fwd"], False)
    finally:
        torch.use_deterministic_algorithms(was)
    assert _launches(True, bias_read="tiles")["dq"].args["TABLE_GRAD"] == 2  # (the bias tiles' sums in dq)
    assert get_kernel("triton_atomic").deterministic is False and get_kernel("triton").deterministic is True


@interpreted
def test_model_with_triton_atomic():
    """A ViT built with ``attn_impl="triton_atomic"`` gives ``triton``'s logits and, to float32 rounding, its
    gradients (only the order of ``dq``'s additions differs)."""
    kw = dict(img_size=16, embed_dim=32, depth=1, num_heads=2, num_classes=3, pos="rel2d_full")
    torch.manual_seed(0)
    ref = vitrel.create_model("vitrel_vit_tiny_patch4_32", attn_impl="triton", **kw)
    m = vitrel.create_model("vitrel_vit_tiny_patch4_32", attn_impl="triton_atomic", **kw)
    m.load_state_dict(ref.state_dict())
    assert m.vitrel_cfg["attn_impl"] == "triton_atomic"
    x = torch.randn(2, 3, 16, 16)
    y_ref, y = ref(x), m(x)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    y_ref.square().sum().backward()
    y.square().sum().backward()
    for (name, a), b in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)
