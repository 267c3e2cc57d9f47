"""RoPE scaling (vitrel/pos/rope_scaling.py): linear, NTK (static, dynamic) and YaRN for rope1d,
rope2d_axial and rope2d_mixed, against references written from the published definitions (and
against Hugging Face transformers' implementation when it is installed)."""

from __future__ import annotations

import math

import pytest
import torch

import vitrel
from vitrel import Attention
from vitrel.pos.registry import build_pos

D, HEADS = 32, 2


def scheme(name, grid=(4, 4), **opts):
    return build_pos({"name": name, **opts}, num_heads=HEADS, head_dim=D, grid=grid, num_prefix_tokens=1)


# ---------------------------------------------------------------- references from the definitions
def ref_inv_freq(kind, dim, base, factor, original, extent, beta_fast=32.0, beta_slow=1.0, truncate=True):
    """Inverse frequencies of one axis, straight from the papers' definitions (loops, float64)."""
    out = []
    if kind == "ntk":
        base = base * factor ** (dim / (dim - 2))
    if kind == "dynamic":
        seq = max(extent, original)
        base = base * (factor * seq / original - (factor - 1)) ** (dim / (dim - 2))

    def corr(rot):  # the dimension whose wavelength fits `rot` turns into `original` positions
        return dim * math.log(original / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr(beta_fast), corr(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    for t in range(dim // 2):
        omega = base ** (-2 * t / dim)
        if kind == "linear":
            out.append(omega / factor)
        elif kind in ("ntk", "dynamic"):
            out.append(omega)
        else:  # yarn: gamma = 0 extrapolates (keeps omega), 1 interpolates (omega / s)
            gamma = min(max((t - low) / ((high if high != low else high + 0.001) - low), 0.0), 1.0)
            out.append((1 - gamma) * omega + gamma * omega / factor)
    return torch.tensor(out, dtype=torch.float64)


def ref_mscale(s):
    return 1.0 if s <= 1 else 0.1 * math.log(s) + 1.0


def rope1d_inv_freq(sc, call_grid):
    """The inverse frequencies rope1d uses on ``call_grid``: the angles of raster index 1."""
    return sc.angles(vitrel.pos.as_grid(call_grid))[1]


# ---------------------------------------------------------------- 1-D: the published definitions
KINDS_1D = [("linear", True), ("ntk", True), ("dynamic", True), ("yarn", True), ("yarn", False)]


@pytest.mark.parametrize("kind, truncate", KINDS_1D)
@pytest.mark.parametrize("factor", [2.0, 3.5])
def test_rope1d_inverse_frequencies_equal_definition(kind, factor, truncate):
    opts = {"rope_type": kind, "factor": factor, **({"truncate": False} if not truncate else {})}
    base = 100.0
    sc = scheme("rope1d", grid=(4, 4), base=base, scaling=opts)  # original extent: 16 raster positions
    call = (8, 6)  # 48 positions
    got = rope1d_inv_freq(sc, call)
    want = ref_inv_freq(kind, D, base, factor, 16, 48, truncate=truncate)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    cos, _ = sc.cos_sin(vitrel.pos.as_grid(call), 1, None, torch.float64)
    assert cos[0, 0].item() == pytest.approx(ref_mscale(factor) if kind == "yarn" else 1.0, abs=1e-12)


@pytest.mark.parametrize("kind", ["linear", "dynamic", "yarn"])
def test_rope1d_equals_transformers(kind):
    tf = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    base, factor, orig, seq = 100.0, 2.5, 16, 48
    params = {"rope_type": kind, "factor": factor, "rope_theta": base}
    if kind == "yarn":
        params["original_max_position_embeddings"] = orig
    cfg = tf.LlamaConfig(
        hidden_size=D * HEADS,
        num_attention_heads=HEADS,
        head_dim=D,
        max_position_embeddings=orig,
        rope_parameters=params,
    )
    inv_freq, attn = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu", **({"seq_len": seq} if kind == "dynamic" else {}))
    sc = scheme("rope1d", grid=(4, 4), base=base, scaling={"rope_type": kind, "factor": factor})
    got = rope1d_inv_freq(sc, (8, 6))
    torch.testing.assert_close(got.float(), inv_freq.float(), rtol=2e-6, atol=0)
    assert sc.attention_factor(vitrel.pos.as_grid((8, 6))) == pytest.approx(attn, abs=1e-12)


def test_yarn_attention_factor_scales_every_logit():
    """YaRN's m multiplies cos and sin of every token: q.k of every pair (prefix included) is scaled by m^2."""
    torch.manual_seed(0)
    a = Attention(dim=D * HEADS, num_heads=HEADS, pos={"name": "rope1d"}, grid=(4, 4), num_prefix_tokens=1)
    b = Attention(
        dim=D * HEADS,
        num_heads=HEADS,
        pos={"name": "rope1d", "scaling": {"rope_type": "yarn", "factor": 1.0, "attention_factor": 1.3}},
        grid=(4, 4),
        num_prefix_tokens=1,
    )
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 17, D * HEADS, dtype=torch.float64)
    a, b = a.double(), b.double()
    torch.testing.assert_close(b.logits(x, grid=(4, 4)), 1.3**2 * a.logits(x, grid=(4, 4)))


# ---------------------------------------------------------------- 2-D: per axis, decoupled, auto
@pytest.mark.parametrize("kind", ["linear", "ntk", "dynamic", "yarn"])
def test_rope2d_axial_per_axis(kind):
    base, (fr, fc) = 100.0, (2.0, 3.0)
    sc = scheme("rope2d_axial", grid=(4, 6), base=base, scaling={"rope_type": kind, "factor": [fr, fc]})
    call = vitrel.pos.as_grid((8, 20))
    theta = sc.angles(call)  # [H*W, d/2]: [row * omega_r, col * omega_c] (rows first)
    half = D // 2
    r, c = call.h, call.w
    # patch (row 1, col 0) carries the row frequencies, (0, 1) the column ones
    omega_r = theta[c, : half // 2]
    omega_c = theta[1, half // 2 :]
    torch.testing.assert_close(omega_c, ref_inv_freq(kind, half, base, fc, 6, c), rtol=1e-12, atol=0)
    torch.testing.assert_close(omega_r, ref_inv_freq(kind, half, base, fr, 4, r), rtol=1e-12, atol=0)
    m = sc.attention_factor(call)
    assert m == pytest.approx(ref_mscale(fr * fc) if kind == "yarn" else 1.0)


def test_factor_auto_follows_the_call_grid():
    base = 100.0
    auto = scheme("rope2d_axial", grid=(4, 6), base=base, scaling={"rope_type": "yarn", "factor": "auto"})
    fixed = scheme("rope2d_axial", grid=(4, 6), base=base, scaling={"rope_type": "yarn", "factor": [2.0, 1.5]})
    plain = scheme("rope2d_axial", grid=(4, 6), base=base)
    g = vitrel.pos.as_grid((8, 9))
    torch.testing.assert_close(auto.angles(g), fixed.angles(g))
    assert auto.attention_factor(g) == pytest.approx(ref_mscale(3.0))
    built = vitrel.pos.as_grid((4, 6))  # at (or below) the built grid: no scaling at all
    torch.testing.assert_close(auto.angles(built), plain.angles(built))
    assert auto.attention_factor(built) == 1.0
    torch.testing.assert_close(auto.built_cos, plain.built_cos)


def test_factor_grid_spans_the_reference_at_every_grid():
    """``factor: grid`` (EVA's rule, timm's ``ref_feat_shape``): the angle of row ``r`` is ``r * L / L' * omega``
    on a larger and on a smaller grid than the reference ``L`` (``auto`` leaves a smaller one unscaled)."""
    base = 100.0
    grid = scheme("rope2d_axial", grid=(4, 6), base=base, scaling={"rope_type": "linear", "factor": "grid"})
    plain = scheme("rope2d_axial", grid=(4, 6), base=base)
    half = D // 2
    for call in [(8, 9), (2, 3), (4, 6)]:
        g = vitrel.pos.as_grid(call)
        theta, want = grid.angles(g), plain.angles(g)
        rows, cols = 4 / call[0], 6 / call[1]  # (L / L' per axis)
        torch.testing.assert_close(theta[:, : half // 2], want[:, : half // 2] * rows, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(theta[:, half // 2 :], want[:, half // 2 :] * cols, rtol=1e-12, atol=1e-12)
    assert grid.size_branches and grid.attention_factor(vitrel.pos.as_grid((2, 3))) == 1.0
    with pytest.raises(ValueError, match="factor=grid .* give rope_type=linear, got 'yarn'"):
        scheme("rope2d_axial", scaling={"rope_type": "yarn", "factor": "grid"})


@pytest.mark.parametrize("kind", ["linear", "ntk", "dynamic", "yarn"])
def test_rope2d_mixed_at_init_equals_axial_with_halves_swapped(kind):
    """Unrotated RoPE-Mixed starts as axial RoPE in RoPE-ViT's columns-first layout (f^x = [m, 0], f^y = [0, m]),
    i.e. rope2d_axial (rows first) with the two halves of its pairs exchanged; scaled, its non-zero components
    equal axial's scaled frequencies of the other half (YaRN with the continuous ramp, as learned frequencies
    have no whole dimension)."""
    opts = {"rope_type": kind, "factor": [2.0, 3.0], **({"truncate": False} if kind == "yarn" else {})}
    mixed = scheme("rope2d_mixed", grid=(4, 6), base=100.0, rotate=False, scaling=opts)
    axial = scheme("rope2d_axial", grid=(4, 6), base=100.0, scaling=opts)
    g = vitrel.pos.as_grid((8, 20))
    f = mixed.scaled_freqs(mixed.freqs.double(), g)  # [2 (cols, rows), heads, d/2]
    q = D // 4
    theta = axial.angles(g)
    # mixed's first quarter rotates with the column (axial's second), its second with the row (axial's first)
    torch.testing.assert_close(f[0, :, :q], theta[1, q:].expand(HEADS, q), rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(f[1, :, q:], theta[g.w, :q].expand(HEADS, q), rtol=1e-6, atol=1e-9)


def test_rope2d_mixed_prepare_many_equals_one_by_one():
    torch.manual_seed(0)
    opts = {"rope_type": "yarn", "factor": "auto"}
    blocks = [scheme("rope2d_mixed", grid=(4, 4), scaling=opts).double() for _ in range(3)]
    g = (7, 5)
    together = type(blocks[0]).prepare_many(blocks, g, 1)
    for s, st in zip(blocks, together):
        one = s.prepare(g, 1, None, torch.float64)
        torch.testing.assert_close(st.rope[0], one.rope[0])
        torch.testing.assert_close(st.rope[1], one.rope[1])


@pytest.mark.parametrize("name", ["rope1d", "rope2d_axial", "rope2d_mixed"])
def test_scaled_rope_is_relative_and_differentiable(name):
    """Scaling changes frequencies, not the form: patch<->patch logits still depend on offsets only."""
    torch.manual_seed(0)
    opts = {"rope_type": "yarn", "factor": 2.0}
    if name != "rope1d":
        opts["factor"] = [2.0, 1.5]
    attn = Attention(dim=D * HEADS, num_heads=HEADS, pos={"name": name, "scaling": opts}, grid=(3, 3)).double()
    x = torch.randn(1, 36, D * HEADS, dtype=torch.float64, requires_grad=True)
    logits = attn.logits(x, grid=(6, 6))
    logits.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    if name == "rope2d_mixed":
        assert attn.pos.freqs.grad is None or torch.isfinite(attn.pos.freqs.grad).all()


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "opts, match",
    [
        ({"rope_type": "longrope", "factor": 2}, "rope_type"),
        ({"rope_type": "yarn", "factor": 0.5}, "factor"),
        ({"rope_type": "linear", "factor": [2, 2, 2]}, "factor"),
        ({"rope_type": "dynamic", "factor": "auto"}, "factor=auto"),
        ({"rope_type": "linear", "factor": 2, "attention_factor": 1.2}, "attention_factor"),
        ({"rope_type": "yarn", "factor": 2, "beta_fast": 1, "beta_slow": 2}, "beta_fast"),
        ({"rope_type": "yarn", "factor": 2, "fator": 2}, "fator"),
    ],
)
def test_bad_scaling_is_one_clear_error(opts, match):
    with pytest.raises(ValueError, match=match):
        scheme("rope2d_axial", scaling=opts)


def test_scaling_needs_frequencies_and_integer_coordinates():
    with pytest.raises(ValueError, match=r"'alibi2d' has no option\(s\) \['scaling'\]"):
        scheme("alibi2d", scaling={"rope_type": "yarn", "factor": 2})
    with pytest.raises(ValueError, match="coords='normalized'"):
        scheme("rope2d_axial", coords="normalized", scaling={"rope_type": "yarn", "factor": 2})
