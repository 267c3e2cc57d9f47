"""The kernels on video grids ``(T, H, W)``: ``sdpa``, ``eager``, ``fold`` (rel3d_factored) and ``flex`` against float64
attention with the bias written from the equations (``tests/pos/test_bias3d.py``), gradients included (flex: forward
only, torch has no FlexAttention backward on CPU); the fused Triton kernel's refusal; ``auto`` never choosing a kernel
that refuses a video scheme."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

import vitrel.kernels.flex as flex_module
from tests.pos.test_bias3d import REFS, dense_bias3
from tests.reference import reference_attention
from vitrel import Attention
from vitrel.kernels import AUTO, AutoRule, get_kernel, list_kernels, resolve
from vitrel.kernels.registry import select_kernel
from vitrel.layout.geometry import Grid3
from vitrel.pos import build_pos, get_pos_class, list_pos

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

VIDEO = [n for n in list_pos() if get_pos_class(n).grid_dims == 3]
BIAS = ["rel3d_full", "rel3d_factored", "alibi3d"]
#: the kernels each scheme runs with (fold: a bias that factors)
IMPLS = {"rel3d_full": ["sdpa", "eager"], "rel3d_factored": ["sdpa", "eager", "fold"], "alibi3d": ["sdpa", "eager"]}
GRID = (2, 3, 4)


def _layer(name: str, impl: str, prefix: int, grid=GRID) -> Attention:
    torch.manual_seed(1)
    a = Attention(24, 3, pos=name, grid=grid, num_prefix_tokens=prefix, attn_impl=impl).double()
    with torch.no_grad():
        for p in a.pos.parameters():
            p.normal_(0.0, 0.5)
    return a


def test_the_video_bias_schemes_are_registered():
    assert set(BIAS) <= set(VIDEO)


@pytest.mark.parametrize("name", BIAS)
@pytest.mark.parametrize("prefix", [0, 1])
@pytest.mark.parametrize("grid", [GRID, (3, 2, 5)])  # the built grid, and another (offsets clamped)
def test_each_kernel_equals_the_reference_with_gradients(name, prefix, grid):
    n = prefix + Grid3(*grid).n
    torch.manual_seed(2)
    x0 = torch.randn(2, n, 24, dtype=torch.float64)
    mask = torch.zeros(2, 1, n, n, dtype=torch.float64)
    mask[1, :, : n // 2, n // 2 :] = float("-inf")  # a mask still applies
    for impl in IMPLS[name]:
        a = _layer(name, impl, prefix)
        x = x0.clone().requires_grad_(True)
        out = a(x, grid, mask)
        assert a.pos.prepare(grid, prefix, kernel=get_kernel(impl)).impl == impl
        bias = dense_bias3(REFS[name](a.pos), 3, grid, prefix).requires_grad_(True)
        x_ref = x0.clone().requires_grad_(True)
        _, ref = reference_attention(a, x_ref, bias, mask)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10, msg=impl)
        g = torch.randn_like(out)
        params = dict(a.pos.named_parameters())
        got = torch.autograd.grad(out, [x, a.qkv.weight, *params.values()], g)
        gx, gw, g_bias = torch.autograd.grad(ref, [x_ref, a.qkv.weight, bias], g)
        torch.testing.assert_close(got[0], gx, rtol=1e-9, atol=1e-10, msg=impl)
        torch.testing.assert_close(got[1], gw, rtol=1e-9, atol=1e-10, msg=impl)
        # the tables' gradients: the bias gradient pulled back through the scheme's dense bias (itself checked
        # against the loop reference's gradients in tests/pos/test_bias3d.py)
        if params:
            pulled = torch.autograd.grad(a.bias(grid), list(params.values()), g_bias)
            for pname, gp, gf in zip(params, pulled, got[2:]):
                torch.testing.assert_close(gf, gp, rtol=1e-9, atol=1e-10, msg=f"{impl} {pname}")


@pytest.fixture
def eager_flex(monkeypatch):
    """FlexAttention uncompiled (torch's reference implementation, float64): the same score_mod, no compile."""
    monkeypatch.setattr(flex_module, "_flex_attention", flex_attention)


@pytest.mark.parametrize("name", BIAS)
@pytest.mark.parametrize("prefix", [0, 1])
def test_flex_reads_the_3d_offset_table(eager_flex, name, prefix):
    """The score_mod's index arithmetic (frame, row and column from the t-major token index) against the reference,
    on the built grid and on a larger one."""
    a = _layer(name, "flex", prefix)
    for grid in [GRID, (3, 4, 2)]:
        n = prefix + Grid3(*grid).n
        x = torch.randn(2, n, 24, dtype=torch.float64)
        st = a.pos.prepare(grid, prefix, kernel=get_kernel("flex"))
        assert st.bias is None and st.table.shape == (3, *(2 * s - 1 for s in grid))
        with torch.no_grad():
            out = a(x, grid)
            _, ref = reference_attention(a, x, dense_bias3(REFS[name](a.pos), 3, grid, prefix))
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(st.full_bias(), a.bias(grid), rtol=0, atol=0)


def test_compiled_flex_on_a_video_grid():
    """What users run: the compiled kernel (float32) against SDPA's float mask."""
    flex, sdpa = (_layer("rel3d_full", impl, 1).float().eval() for impl in ("flex", "sdpa"))
    sdpa.load_state_dict(flex.state_dict())
    x = torch.randn(2, 1 + 24, 24)
    with torch.no_grad():
        torch.testing.assert_close(flex(x, GRID), sdpa(x, GRID), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("prefix", [0, 1])
def test_fold_factors_multiply_to_the_bias_and_pad(prefix):
    s = build_pos("rel3d_factored", num_heads=2, head_dim=16, grid=(2, 3, 5), num_prefix_tokens=prefix).double()
    u, w = s.bias_factors(s.grid, prefix)
    assert u.shape == w.shape == (2, prefix + 30, 16)  # rank 2 + 3 + 5 = 10, padded so 16 + 16 is a multiple of 8
    torch.testing.assert_close(u @ w.transpose(-2, -1), s.bias(s.grid, prefix), rtol=0, atol=0)
    assert (w[:, prefix:, :10].sum(-1) == 3).all() and (w[:, :prefix] == 0).all()  # one-hot t, row, column


@pytest.mark.parametrize("name", BIAS)
def test_triton_refuses_video_schemes_and_grids_before_any_work(monkeypatch, name):
    import vitrel.kernels.triton.attend as attend

    def no_work(*args, **kwargs):
        raise AssertionError("the fused kernel ran")

    monkeypatch.setattr(attend, "rel_bias_attention", no_work)
    pattern = r"attn_impl='triton' takes biases on image grids \(H, W\) only.*'sdpa', 'flex'"
    with pytest.raises(ValueError, match=pattern) as err:
        Attention(24, 3, pos=name, grid=GRID, attn_impl="triton")
    assert f"the video scheme {name}" in str(err.value)
    assert ("'fold'" in str(err.value)) == (name == "rel3d_factored")  # (the one that factors)
    s = build_pos(name, num_heads=3, head_dim=8, grid=GRID)
    for impl in ("triton", "triton_atomic"):
        with pytest.raises(ValueError, match=f"attn_impl='{impl}' takes biases on image grids"):
            s.prepare(GRID, 0, kernel=get_kernel(impl))


def test_triton_runs_no_position_on_a_video_grid():
    """Without a bias the fused kernel reads no table: the t-major tokens are a (T*H) x W raster (equal to sdpa)."""
    torch.manual_seed(0)
    ref = Attention(24, 3, pos="none", grid=GRID, num_prefix_tokens=1, attn_impl="sdpa")
    fused = Attention(24, 3, pos="none", grid=GRID, num_prefix_tokens=1, attn_impl="triton")
    fused.load_state_dict(ref.state_dict())
    x = torch.randn(2, 25, 24)
    torch.testing.assert_close(fused(x, GRID), ref(x, GRID), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", BIAS)
def test_auto_never_picks_a_kernel_that_refuses_a_video_scheme(monkeypatch, name):
    """On every device of AUTO (and on the CPU), at every size, training or not, and even under a rule that names the
    scheme with the fused kernel: the kernel auto picks takes the scheme."""
    s = build_pos(name, num_heads=3, head_dim=8, grid=GRID)
    assert resolve("auto", s, 1568, None).name == "sdpa"
    monkeypatch.setitem(AUTO, "Test GPU", [AutoRule(frozenset({name}), 0, "triton"), AutoRule(frozenset(), 0, "sdpa")])
    for device in [None, *AUTO]:
        for n in (24, 1568, 65536):
            for training in (False, True):
                picked = select_kernel(s, n, device, training=training)
                assert get_kernel(picked).refuses(s) is None, (device, n, training, picked)
    assert select_kernel(s, 1568, "Test GPU") == "sdpa"


#: the kernels vitrel ships (another one's video schemes are its own: tests/kernels/test_conformance.py runs them)
SHIPPED = {"sdpa", "eager", "fold", "flex", "triton", "triton_atomic", "shaw"}


def test_every_kernel_says_whether_it_takes_the_video_schemes():
    """Each registered kernel either takes each video bias scheme (and computes it on a video grid:
    tests/kernels/test_conformance.py) or refuses it by name; of the shipped ones, sdpa, eager and flex take them
    all, fold the factored one."""
    for name in BIAS:
        s = build_pos(name, num_heads=3, head_dim=8, grid=GRID)
        takes = set()
        for k in list_kernels():
            why = get_kernel(k).refuses(s)
            if why is None:
                takes.add(k)
            else:
                assert name in why, (k, why)
        want = {"sdpa", "eager", "flex"} | ({"fold"} if name == "rel3d_factored" else set())
        assert takes & SHIPPED == want, name


@pytest.mark.parametrize("name", ["rel3d_full", "alibi3d"])
def test_fold_names_the_video_scheme_it_takes(name):
    """``attn_impl='fold'`` on a video scheme without factors names the factored tables it folds, the video one
    among them (``rel3d_factored``), not only the 2-D ones, which refuse a video grid."""
    with pytest.raises(ValueError, match=r"folds a bias that factors .*rel3d_factored") as err:
        Attention(24, 3, pos=name, grid=GRID, attn_impl="fold")
    assert "\n" not in str(err.value)
