"""3-D RoPE (rope3d_axial, rope3d_mixed) against references written from the equations and from the authors' code.

References: float64, one token and one pair at a time (``x~_2j = x_2j cos - x_2j+1 sin``,
``x~_2j+1 = x_2j sin + x_2j+1 cos``), the pair's axis and frequency spelled out from the option's definition; V-JEPA 2's
``rotate_queries_or_keys`` and Qwen2-VL / Qwen3-VL's M-RoPE re-written from their code (``rotate_half`` pairs
converted to vitrel's by a permutation of the channels).
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from tests.reference import scheme_qkv
from vitrel.kernels import get_kernel
from vitrel.layers.attention import Attention
from vitrel.layout.geometry import Grid3
from vitrel.pos import build_pos, get_pos_class
from vitrel.pos.schemes.rope3d import Rope3dAxial, Rope3dMixed

CONF = Path(__file__).resolve().parents[2] / "conf" / "pos"
D = 16  # head dim: 8 pairs
SECTIONS = [None, (0, 2, 2), (1, 3, 2), (3, 1, 0), (4, 2, 2), (2, 0, 5)]  # None: V-JEPA 2's (2, 2, 2) of 8 pairs
OPTIONS = [
    {"sections": s, "layout": lay, "freqs": fr}
    for s, lay, fr in itertools.product(SECTIONS, ("sectioned", "interleaved"), ("per_axis", "shared"))
]
GRID = Grid3(2, 3, 2)


def _id(o: dict) -> str:
    return f"{o['sections']}-{o['layout']}-{o['freqs']}"


# ------------------------------------------------------------------------------ references from the equations
def ref_pair(opts: dict, d: int, j: int, base: float) -> tuple[int, float] | None:
    """(axis, omega) of pair ``j`` (axis 0: t, 1: h, 2: w), None for an unrotated pair."""
    st, sh, sw = opts["sections"] if opts["sections"] is not None else ((d // 3) // 2,) * 3
    sections = (st, sh, sw)
    if j >= st + sh + sw:
        return None
    if opts["layout"] == "sectioned":
        if j < st:
            axis, k = 0, j
        elif j < st + sh:
            axis, k = 1, j - st
        else:
            axis, k = 2, j - st - sh
    else:  # slots dealt t, h, w, t, h, w, ...; an axis with no pair left is skipped
        used, slot, found = [0, 0, 0], 0, None
        while found is None:
            for a in range(3):
                if used[a] < sections[a]:
                    if slot == j:
                        found = (a, used[a])
                        break
                    used[a] += 1
                    slot += 1
        axis, k = found
    if opts["freqs"] == "per_axis":
        return axis, base ** (-k / sections[axis])
    return axis, base ** (-2.0 * j / d)


def ref_rotate(x: torch.Tensor, grid: Grid3, prefix: int, angle) -> torch.Tensor:
    """``x [B, heads, N, d]``: patch token ``i`` of head ``h``, pair ``j`` rotated by ``angle(h, (t, r, c), j)``
    (None: unrotated); prefix tokens copied."""
    b, nh, n, d = x.shape
    out = x.clone()
    for h in range(nh):
        for i in range(grid.n):
            t, rem = divmod(i, grid.h * grid.w)
            r, c = divmod(rem, grid.w)
            for j in range(d // 2):
                th = angle(h, (t, r, c), j)
                if th is None:
                    continue
                th = torch.as_tensor(th, dtype=torch.float64)
                x0, x1 = x[:, h, prefix + i, 2 * j], x[:, h, prefix + i, 2 * j + 1]
                out[:, h, prefix + i, 2 * j] = x0 * torch.cos(th) - x1 * torch.sin(th)
                out[:, h, prefix + i, 2 * j + 1] = x0 * torch.sin(th) + x1 * torch.cos(th)
    return out


def axial_angle(opts: dict, d: int, base: float):
    def angle(h, pos, j):
        pa = ref_pair(opts, d, j, base)
        return None if pa is None else pos[pa[0]] * pa[1]

    return angle


def mixed_angle(freqs: torch.Tensor):
    return lambda h, pos, j: sum(freqs[a, h, j] * pos[a] for a in range(3))


def ref_attention(attn: Attention, x: torch.Tensor, grid: Grid3, prefix: int, angle):
    b, n, c = x.shape
    nh, d = attn.num_heads, attn.head_dim
    q, k, v = (x @ attn.qkv.weight.T + attn.qkv.bias).reshape(b, n, 3, nh, d).permute(2, 0, 3, 1, 4)
    q, k = ref_rotate(q, grid, prefix, angle), ref_rotate(k, grid, prefix, angle)
    logits = q @ k.transpose(-2, -1) / math.sqrt(d)
    out = (torch.softmax(logits, -1) @ v).transpose(1, 2).reshape(b, n, c)
    return logits, out @ attn.proj.weight.T + attn.proj.bias


def _attn(pos, grid=GRID, prefix=1, heads=2, d=D, **kw) -> Attention:
    return Attention(heads * d, heads, pos=pos, grid=grid, num_prefix_tokens=prefix, **kw).double()


# ------------------------------------------------------------------------------ rope3d_axial
@pytest.mark.parametrize("opts", OPTIONS, ids=_id)
@pytest.mark.parametrize("prefix", [0, 1])
def test_axial_matches_equations_forward_and_grads(opts, prefix):
    torch.manual_seed(0)
    # built on one grid, called on another
    attn = _attn({"name": "rope3d_axial", **opts}, grid=(1, 2, 2), prefix=prefix)
    x = torch.randn(2, prefix + GRID.n, 2 * D, dtype=torch.float64, requires_grad=True)
    g = torch.randn_like(x)
    out, logits = attn(x, GRID), attn.logits(x, GRID)
    params = [x, attn.qkv.weight, attn.qkv.bias]
    grads = torch.autograd.grad((out * g).sum(), params)
    ref_logits, ref_out = ref_attention(attn, x, GRID, prefix, axial_angle(opts, D, 10000.0))
    ref_grads = torch.autograd.grad((ref_out * g).sum(), params)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_interleaved_assignment_spelled_out():
    """The axes of the pairs, written by hand: Qwen3-VL's t h w t h w ... and the skip of a used-up axis."""
    from vitrel.pos.schemes.rope3d import pair_axes

    assert pair_axes((2, 2, 2), "interleaved") == [0, 1, 2, 0, 1, 2]
    assert pair_axes((1, 3, 2), "interleaved") == [0, 1, 2, 1, 2, 1]
    assert pair_axes((4, 1, 1), "interleaved") == [0, 1, 2, 0, 0, 0]
    assert pair_axes((0, 2, 2), "interleaved") == [1, 2, 1, 2]
    assert pair_axes((1, 3, 2), "sectioned") == [0, 1, 1, 1, 2, 2]


def test_axial_default_sections_are_vjepa2s():
    for d, s in ((16, 2), (64, 10), (8, 1), (12, 2)):
        assert build_pos("rope3d_axial", num_heads=1, head_dim=d, grid=(2, 2, 2)).sections == (s, s, s)


def vjepa2_rotate(x: torch.Tensor, pos: torch.Tensor, fixed: bool = True) -> torch.Tensor:
    """V-JEPA 2's ``rotate_queries_or_keys`` (src/models/utils/modules.py), re-written: ``fixed`` the authors'
    documented ``repeat_interleave`` fix, else their released ``repeat``."""
    d = x.shape[-1]
    omega = torch.arange(d // 2, dtype=x.dtype) / (d / 2.0)
    omega = 1.0 / 10000**omega
    freq = pos.to(x.dtype)[:, None] * omega[None, :]
    s, c = freq.sin(), freq.cos()
    if fixed:
        s, c = s.repeat_interleave(2, dim=-1), c.repeat_interleave(2, dim=-1)
    else:
        s, c = s.repeat(1, 2), c.repeat(1, 2)
    y1, y2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    y = torch.stack((-y2, y1), dim=-1).flatten(-2)
    return x * c + y * s


def vjepa2_qk(q: torch.Tensor, grid: Grid3, fixed: bool = True) -> torch.Tensor:
    """V-JEPA 2's ``RoPEAttention.forward`` rotation of ``q [B, heads, N, d]`` (no mask, no prefix)."""
    d = q.shape[-1]
    dim = int(2 * ((d // 3) // 2))
    ids = torch.arange(grid.n)
    frame = ids // (grid.h * grid.w)
    height = (ids - grid.h * grid.w * frame) // grid.w
    width = ids - grid.h * grid.w * frame - grid.w * height
    parts, s = [], 0
    for pos in (frame, height, width):
        parts.append(vjepa2_rotate(q[..., s : s + dim], pos, fixed))
        s += dim
    return torch.cat(parts + [q[..., s:]], dim=-1)


@pytest.mark.parametrize("d", [16, 24, 64])
def test_axial_default_equals_vjepa2_fixed(d):
    torch.manual_seed(1)
    grid = Grid3(3, 4, 5)
    s = build_pos("rope3d_axial", num_heads=2, head_dim=d, grid=grid).double()
    q = torch.randn(2, 2, grid.n, d, dtype=torch.float64)
    qr, _ = s.rotate(q, q, s.prepare(grid, 0, q.device, q.dtype))
    torch.testing.assert_close(qr, vjepa2_qk(q, grid), rtol=1e-12, atol=1e-12)
    # the released expansion (repeat, not repeat_interleave) is not this rotation: the comparison can fail
    assert (qr - vjepa2_qk(q, grid, fixed=False)).abs().max() > 1e-2


def qwen_qk(q: torch.Tensor, grid: Grid3, sections, interleaved: bool, base: float) -> torch.Tensor:
    """Qwen2-VL's ``apply_multimodal_rotary_pos_emb`` (``interleaved=False``) or Qwen3-VL's ``apply_interleaved_mrope``
    (``True``) on vision tokens at positions ``(t, h, w)`` from 0, re-written, on ``q [B, heads, N, d]`` in Qwen's
    ``rotate_half`` layout."""
    d = q.shape[-1]
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ids = torch.arange(grid.n)
    pos = torch.stack((ids // (grid.h * grid.w), (ids // grid.w) % grid.h, ids % grid.w)).double()  # [3, N]
    freqs = pos[:, :, None] * inv_freq[None, None, :]  # [3, N, d/2]
    if interleaved:
        f = freqs[0].clone()
        for dim, offset in enumerate((1, 2), start=1):
            idx = slice(offset, sections[dim] * 3, 3)
            f[..., idx] = freqs[dim, ..., idx]
        emb = torch.cat((f, f), dim=-1)
        cos, sin = emb.cos(), emb.sin()
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
        split = list(sections) * 2
        cos = torch.cat([m[i % 3] for i, m in enumerate(emb.cos().split(split, dim=-1))], dim=-1)
        sin = torch.cat([m[i % 3] for i, m in enumerate(emb.sin().split(split, dim=-1))], dim=-1)

    def rotate_half(x):
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
        return torch.cat((-x2, x1), dim=-1)

    return q * cos + rotate_half(q) * sin


@pytest.mark.parametrize(
    "sections,layout",
    [((2, 3, 3), "sectioned"), ((4, 2, 2), "sectioned"), ((4, 2, 2), "interleaved"), ((3, 3, 2), "interleaved")],
)
def test_axial_shared_equals_qwen_mrope(sections, layout):
    """``freqs: shared`` with sections summing to d/2: Qwen2-VL's M-RoPE (sectioned) and Qwen3-VL's (interleaved),
    after the permutation from vitrel's pairs (2j, 2j+1) to Qwen's (j, j + d/2)."""
    torch.manual_seed(2)
    grid, base = Grid3(3, 2, 4), 1e6
    opts = {"name": "rope3d_axial", "sections": list(sections), "layout": layout, "freqs": "shared", "base": base}
    s = build_pos(opts, num_heads=2, head_dim=D, grid=grid).double()
    q = torch.randn(2, 2, grid.n, D, dtype=torch.float64)
    qr, _ = s.rotate(q, q, s.prepare(grid, 0, q.device, q.dtype))
    to_qwen = torch.cat((torch.arange(0, D, 2), torch.arange(1, D, 2)))  # Qwen channel i holds vitrel's to_qwen[i]
    ref = qwen_qk(q[..., to_qwen], grid, sections, layout == "interleaved", base)
    torch.testing.assert_close(qr[..., to_qwen], ref, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------ relative property, T = 1
def offset_spread(logits: torch.Tensor, grid: Grid3, axes=(0, 1, 2)) -> float:
    """Largest spread of the patch logits within a group of equal offsets along ``axes``."""
    groups: dict = {}
    pos = [(i // (grid.h * grid.w), (i // grid.w) % grid.h, i % grid.w) for i in range(grid.n)]
    for i, pi in enumerate(pos):
        for j, pj in enumerate(pos):
            groups.setdefault(tuple(pi[a] - pj[a] for a in axes), []).append(logits[..., i, j])
    return max((torch.stack(v, -1).amax(-1) - torch.stack(v, -1).amin(-1)).abs().max().item() for v in groups.values())


@pytest.mark.parametrize(
    "pos",
    [
        {"name": "rope3d_axial"},
        {"name": "rope3d_axial", "sections": [1, 3, 2], "layout": "interleaved", "freqs": "shared"},
        {"name": "rope3d_mixed"},
    ],
    ids=["axial", "axial-interleaved-shared", "mixed"],
)
@pytest.mark.parametrize("prefix", [0, 1])
def test_translation_in_t_h_w_leaves_the_logits(pos, prefix):
    """Logits between patches depend on (dt, dh, dw) only; they do vary, and with dt (time is seen); the prefix token
    is unrotated."""
    torch.manual_seed(3)
    grid = Grid3(3, 3, 4)
    s = build_pos(pos, num_heads=2, head_dim=D, grid=grid, num_prefix_tokens=prefix).double()
    n = prefix + grid.n
    q0, k0 = torch.randn(1, 2, 1, D, dtype=torch.float64), torch.randn(1, 2, 1, D, dtype=torch.float64)
    q, k = q0.expand(1, 2, n, D), k0.expand(1, 2, n, D)
    with torch.no_grad():
        qr, kr = s.rotate(q, k, s.prepare(grid, prefix, q.device, q.dtype))
    logits = qr @ kr.transpose(-2, -1)
    patch = logits[..., prefix:, prefix:]
    assert offset_spread(patch, grid) < 1e-12
    assert patch.std() > 1e-3
    assert offset_spread(patch, grid, axes=(1, 2)) > 1e-3  # not a function of (dh, dw) alone
    assert offset_spread(patch, grid, axes=(0, 1)) > 1e-3 and offset_spread(patch, grid, axes=(0, 2)) > 1e-3
    if prefix:
        assert torch.equal(qr[..., 0, :], q[..., 0, :]) and torch.equal(kr[..., 0, :], k[..., 0, :])


def test_translation_check_fails_for_angles_not_linear_in_position():
    """Negative control of the test above: squared angles break the relative property."""
    grid = Grid3(3, 3, 4)
    s = build_pos("rope3d_axial", num_heads=2, head_dim=D, grid=grid).double()
    theta = s.angles(grid) ** 2
    q = torch.randn(1, 2, 1, D, dtype=torch.float64).expand(1, 2, grid.n, D)
    from vitrel.pos.schemes.rope import apply_rope

    logits = apply_rope(q, theta.cos(), theta.sin()) @ apply_rope(q, theta.cos(), theta.sin()).transpose(-2, -1)
    assert offset_spread(logits, grid) > 1e-3


@pytest.mark.parametrize("grid", [(1, 3, 4), (3, 4)])
@pytest.mark.parametrize("prefix", [0, 1])
@pytest.mark.parametrize("d", [D, 2 * D])
def test_axial_at_one_frame_is_rope2d_axial(grid, prefix, d):
    """The API contract: at T = 1 (or on an image grid) ``sections: [0, d/4, d/4]``, ``freqs: per_axis`` is
    ``rope2d_axial`` at the same base, both rows first then columns: the same weights give the same logits and
    outputs. (``rope2d_axial`` splits the pairs evenly, ``d/4`` per axis: an uneven ``[0, sh, sw]`` has no 2-D
    counterpart.)"""
    torch.manual_seed(4)
    base, heads = 37.0, 2
    pos3 = {"name": "rope3d_axial", "sections": [0, d // 4, d // 4], "freqs": "per_axis", "base": base}
    a3 = _attn(pos3, grid=(1, 3, 4), prefix=prefix, heads=heads, d=d)
    a2 = _attn({"name": "rope2d_axial", "base": base}, grid=(3, 4), prefix=prefix, heads=heads, d=d)
    a2.load_state_dict(a3.state_dict())
    x = torch.randn(2, prefix + 12, heads * d, dtype=torch.float64)
    torch.testing.assert_close(a3.logits(x, grid), a2.logits(x, (3, 4)), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(a3(x, grid), a2(x, (3, 4)), rtol=1e-12, atol=1e-12)
    # the comparison can fail: the two halves of each head's q and k swapped change the logits
    half = torch.cat((torch.arange(d // 2, d), torch.arange(d // 2)))
    rows = torch.cat([part * heads * d + h * d + half for part in (0, 1) for h in range(heads)])
    rows = torch.cat((rows, torch.arange(2 * heads * d, 3 * heads * d)))
    with torch.no_grad():
        a2.qkv.weight.copy_(a3.qkv.weight[rows])
        a2.qkv.bias.copy_(a3.qkv.bias[rows])
    assert (a3.logits(x, grid) - a2.logits(x, (3, 4))).abs().max() > 1e-3


# ------------------------------------------------------------------------------ scaling per axis
@pytest.mark.parametrize("freqs", ["per_axis", "shared"])
def test_axial_scaling_per_axis(freqs):
    """``linear`` divides one axis's frequencies by its factor; ``ntk`` changes that axis's base to
    ``base * s^(D / (D - 2))``, ``D`` the rotary width of its series (2s per axis, head_dim shared)."""
    kw = dict(num_heads=1, head_dim=D, grid=(2, 3, 3))
    base_opts = {"name": "rope3d_axial", "sections": [2, 3, 3], "freqs": freqs}
    plain = build_pos(base_opts, **kw)
    g = Grid3(4, 3, 3)
    om = plain.pair_omega(g)
    lin = build_pos({**base_opts, "scaling": {"rope_type": "linear", "factor": [2.0, 1.0, 1.0]}}, **kw)
    expect = om.clone()
    expect[:2] /= 2
    torch.testing.assert_close(lin.pair_omega(g), expect, rtol=1e-12, atol=0)
    ntk = build_pos({**base_opts, "scaling": {"rope_type": "ntk", "factor": [1.0, 3.0, 1.0]}}, **kw)
    expect = om.clone()
    for j in range(2, 5):
        width, k = (6, j - 2) if freqs == "per_axis" else (D, j)
        expect[j] = (10000.0 * 3.0 ** (width / (width - 2))) ** (-2.0 * k / width)
    torch.testing.assert_close(ntk.pair_omega(g), expect, rtol=1e-12, atol=0)
    # one pair per axis: NTK keeps its frequency 1; every type runs at a larger grid
    one = {"name": "rope3d_axial", "sections": [1, 1, 1]}
    for rt in ("linear", "ntk", "dynamic", "yarn"):
        s = build_pos({**one, "scaling": {"rope_type": rt, "factor": 2.0}}, **kw)
        assert torch.isfinite(s.angles(Grid3(4, 5, 5))).all()


# ------------------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    "sections,match",
    [
        ([1, 2], "three whole numbers"),
        ([1, -1, 2], "three whole numbers"),
        ([1.5, 1, 1], "sections must be a list"),
        ([True, 1, 1], "sections must be a list"),
        ("abc", "sections must be a list"),
        ([0, 0, 0], "rotate no pair"),
        ([3, 3, 3], r"9 rotary pairs \(18 channels\), more than head_dim=16 holds \(8 pairs\)"),
    ],
)
def test_axial_refuses_sections_that_do_not_fit(sections, match):
    with pytest.raises(ValueError, match=match):
        build_pos({"name": "rope3d_axial", "sections": sections}, num_heads=2, head_dim=D, grid=(2, 2, 2))
    with pytest.raises(ValueError, match="sections"):  # at build, through the layer
        Attention(32, 2, pos={"name": "rope3d_axial", "sections": sections}, grid=(2, 2, 2))


def test_axial_refuses_other_bad_options():
    kw = dict(num_heads=2, grid=(2, 2, 2))
    with pytest.raises(ValueError, match="too small for the default sections"):
        build_pos("rope3d_axial", head_dim=4, **kw)
    build_pos({"name": "rope3d_axial", "sections": [0, 1, 1]}, head_dim=4, **kw)  # given sections fit
    with pytest.raises(ValueError, match="head_dim divisible by 2"):
        build_pos({"name": "rope3d_axial", "sections": [1, 1, 1]}, head_dim=7, **kw)
    with pytest.raises(ValueError, match="layout"):
        build_pos({"name": "rope3d_axial", "layout": "blocks"}, head_dim=D, **kw)
    with pytest.raises(ValueError, match="freqs"):
        build_pos({"name": "rope3d_axial", "freqs": "mixed"}, head_dim=D, **kw)
    with pytest.raises(ValueError, match="head_dim divisible by 4"):
        build_pos("rope3d_mixed", head_dim=6, **kw)
    with pytest.raises(ValueError, match="scaling.factor takes 1 or 3"):
        build_pos({"name": "rope3d_axial", "scaling": {"rope_type": "linear", "factor": [2, 2]}}, head_dim=D, **kw)


# ------------------------------------------------------------------------------ rope3d_mixed
@pytest.mark.parametrize("prefix", [0, 1])
@pytest.mark.parametrize("grid", [GRID, Grid3(3, 2, 2)])
def test_mixed_matches_equations_forward_and_freq_grads(prefix, grid):
    torch.manual_seed(5)
    attn = _attn("rope3d_mixed", grid=(2, 2, 2), prefix=prefix)
    with torch.no_grad():
        attn.pos.freqs.add_(0.3 * torch.randn_like(attn.pos.freqs))
    x = torch.randn(2, prefix + grid.n, 2 * D, dtype=torch.float64, requires_grad=True)
    g = torch.randn_like(x)
    out, logits = attn(x, grid), attn.logits(x, grid)
    params = [x, attn.qkv.weight, attn.pos.freqs]
    grads = torch.autograd.grad((out * g).sum(), params)
    ref_logits, ref_out = ref_attention(attn, x, grid, prefix, mixed_angle(attn.pos.freqs))
    ref_grads = torch.autograd.grad((ref_out * g).sum(), params)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    assert grads[-1][0].abs().sum() > 0  # the time frequencies do get a gradient


def test_mixed_init_and_parameter():
    torch.manual_seed(6)
    heads, d = 3, 16
    s = build_pos("rope3d_mixed", num_heads=heads, head_dim=d, grid=(2, 4, 4))
    assert isinstance(s, Rope3dMixed) and s.freqs.shape == (3, heads, d // 2)
    assert [n for n, _ in s.named_parameters()] == ["freqs"] and s.no_weight_decay_keys == ("freqs",)
    torch.manual_seed(6)
    s2 = build_pos("rope2d_mixed", num_heads=heads, head_dim=d, grid=(4, 4))
    # space: rope2d_mixed's draws (rows f^y, columns f^x); time: the magnitudes 10^(-4k/d), twice, every head
    torch.testing.assert_close(s.freqs[1], s2.freqs[1], rtol=0, atol=0)
    torch.testing.assert_close(s.freqs[2], s2.freqs[0], rtol=0, atol=0)
    mag = torch.tensor([10.0 ** (-4.0 * k / d) for k in range(d // 4)] * 2)
    torch.testing.assert_close(s.freqs[0], mag.expand(heads, -1), rtol=1e-6, atol=0)
    torch.manual_seed(6)  # (the class draws from the global generator; build_pos from the scheme's own stream)
    before = Rope3dMixed(num_heads=heads, head_dim=d, grid=(2, 4, 4)).freqs.detach()
    with torch.no_grad():
        s.freqs.zero_()
    torch.manual_seed(6)
    s.reset_parameters()
    torch.testing.assert_close(s.freqs.detach(), before, rtol=0, atol=0)


@pytest.mark.parametrize("prefix", [0, 1])
def test_mixed_at_one_frame_is_rope2d_mixed(prefix):
    """Built from the same seed, at T = 1 (or on an image grid) rope3d_mixed gives rope2d_mixed's logits."""
    torch.manual_seed(7)
    a3 = _attn("rope3d_mixed", grid=(2, 3, 4), prefix=prefix)
    torch.manual_seed(7)
    a2 = _attn("rope2d_mixed", grid=(3, 4), prefix=prefix)
    with torch.no_grad():  # after training too: the time frequencies meet t = 0
        a3.pos.freqs[0].add_(1.0)
    x = torch.randn(2, prefix + 12, 2 * D, dtype=torch.float64)
    for g in ((1, 3, 4), (3, 4)):
        torch.testing.assert_close(a3.logits(x, g), a2.logits(x, (3, 4)), rtol=1e-12, atol=1e-12)


def test_mixed_scaling_per_axis():
    """``linear`` with factors ``[t, h, w]`` divides each axis's learned frequencies by its factor."""
    kw = dict(num_heads=2, head_dim=D, grid=(2, 3, 3))
    torch.manual_seed(8)
    plain = build_pos("rope3d_mixed", **kw)
    torch.manual_seed(8)
    lin = build_pos({"name": "rope3d_mixed", "scaling": {"rope_type": "linear", "factor": [2.0, 1.0, 4.0]}}, **kw)
    g = Grid3(4, 3, 6)
    expect = plain.freqs.detach() / torch.tensor([2.0, 1.0, 4.0])[:, None, None]
    torch.testing.assert_close(lin.scaled_freqs(lin.freqs, g), expect)
    for rt in ("ntk", "dynamic", "yarn"):
        s = build_pos({"name": "rope3d_mixed", "scaling": {"rope_type": rt, "factor": 2.0}}, **kw)
        assert torch.isfinite(s.cos_sin(g, 1)[0]).all()


# ------------------------------------------------------------------------------ kernels, grids, configs
@pytest.mark.parametrize("name", ["rope3d_axial", "rope3d_mixed"])
def test_video_scheme_takes_image_grids_and_image_schemes_name_it(name):
    s = build_pos(name, num_heads=2, head_dim=D, grid=(3, 4))
    assert s.grid == Grid3(1, 3, 4)
    with pytest.raises(ValueError, match=name):
        Attention(32, 2, pos="rope2d_axial", grid=(2, 3, 4))


@pytest.mark.parametrize("name", ["rope3d_axial", "rope3d_mixed"])
@pytest.mark.parametrize("impl", ["eager", "flex", "triton"])
def test_kernels_on_a_video_grid_equal_sdpa(name, impl):
    """Every kernel that takes rotary schemes runs them on a video grid (the fused rotation for triton), inference
    in float32 against the float64 sdpa path."""
    if impl == "flex":
        pytest.importorskip("torch.nn.attention.flex_attention")
    torch.manual_seed(9)
    grid = (2, 3, 4)
    ref = _attn(name, grid=grid)
    with torch.no_grad():
        for p in ref.pos.parameters():
            p.add_(0.3 * torch.randn_like(p))
    other = Attention(32, 2, pos=name, grid=grid, num_prefix_tokens=1, attn_impl=impl).float()
    other.load_state_dict(ref.state_dict())
    x = torch.randn(2, 25, 32, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(other(x.float(), grid).double(), ref(x, grid), atol=2e-5, rtol=1e-4)
    assert get_kernel(impl).refuses(ref.pos) is None


def test_triton_trains_on_a_video_grid():
    """attn_impl="triton" (fused rotation, then attention) on a video grid: the gradients of the learned frequencies and
    of the projections equal the float64 sdpa path's."""
    torch.manual_seed(11)
    grid = (2, 3, 4)
    ref = _attn("rope3d_mixed", grid=grid)
    with torch.no_grad():
        ref.pos.freqs.add_(0.3 * torch.randn_like(ref.pos.freqs))
    fused = Attention(32, 2, pos="rope3d_mixed", grid=grid, num_prefix_tokens=1, attn_impl="triton").float()
    fused.load_state_dict(ref.state_dict())
    x = torch.randn(2, 25, 32, dtype=torch.float64)
    g_ref = torch.autograd.grad(ref(x, grid).square().sum(), list(ref.parameters()))
    g = torch.autograd.grad(fused(x.float(), grid).square().sum(), list(fused.parameters()))
    for (pname, _), a, b in zip(ref.named_parameters(), g, g_ref):
        scale = max(b.abs().max().item(), 1e-2)
        torch.testing.assert_close(a.double() / scale, b / scale, atol=2e-5, rtol=1e-4, msg=pname)


@pytest.mark.parametrize("name", ["rope3d_axial", "rope3d_mixed"])
def test_forward_is_plain_sdpa_on_rotated_qk(name):
    torch.manual_seed(10)
    attn = _attn(name, grid=(2, 2, 3))
    x = torch.randn(2, 13, 32, dtype=torch.float64)
    q, k, v = scheme_qkv(attn, x, (2, 2, 3))
    expect = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 13, 32)
    torch.testing.assert_close(attn(x, (2, 2, 3)), attn.proj(expect))
    assert attn.bias((2, 2, 3)) is None


def test_axial_tables_are_buffers_of_the_built_grid():
    s = build_pos("rope3d_axial", num_heads=2, head_dim=D, grid=(2, 3, 4), num_prefix_tokens=1)
    assert isinstance(s, Rope3dAxial) and list(s.parameters()) == [] and s.state_dict() == {}
    cos, sin = s.rotation(Grid3(2, 3, 4), 1, None, torch.float32)
    assert cos is s.built_cos and cos.shape == (25, D // 2)
    torch.testing.assert_close(cos[0], torch.ones(D // 2)) and torch.testing.assert_close(sin[0], torch.zeros(D // 2))
    assert (cos[:, 6:] == 1).all() and (sin[:, 6:] == 0).all()  # V-JEPA 2's split: the last 2 pairs unrotated


@pytest.mark.parametrize("name", ["rope3d_axial", "rope3d_mixed"])
def test_config_builds(name):
    cfg = yaml.safe_load((CONF / f"{name}.yaml").read_text())
    assert cfg["name"] == name
    s = build_pos(cfg, num_heads=2, head_dim=D, grid=(2, 3, 5))
    assert type(s) is get_pos_class(name) and s.base == cfg["base"]
