"""RoPE schemes (rope1d, rope2d_axial, rope2d_mixed) against references written from the equations.

Reference: explicit block-diagonal rotation matrices R(theta_p) built per position with loops,
pairs (2t, 2t+1); float64 throughout.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from tests.reference import scheme_qkv
from vitrel.layers.attention import Attention
from vitrel.pos import Grid, build_pos, get_pos_class
from vitrel.pos.schemes.rope import (
    Rope2dMixed,
    apply_rope,
    apply_rope_complex,
    apply_rope_real,
    init_mixed_freqs,
    rope2d_axial_angles,
    rope2d_mixed_angles,
)

ROPES = ["rope1d", "rope2d_axial", "rope2d_mixed"]
GRIDS = [Grid(3, 5), Grid(4, 4)]
CONF = Path(__file__).resolve().parents[2] / "conf" / "pos"


# ------------------------------------------------------------------------------ references
def ref_angle(name: str, scheme, h: int, row: int, col: int, grid: Grid, t: int, d: int):
    """theta_t of head h at (row, col), straight from the equations (a tensor for the mixed scheme)."""
    if name == "rope1d":
        p = row * grid.w + col
        return p * scheme.base ** (-2.0 * t / d)
    if name == "rope2d_axial":  # rows first: pairs t < d/4 the row, pairs d/4 + t the column
        q = d // 4
        if t < q:
            return row * scheme.base ** (-4.0 * t / d)
        return col * scheme.base ** (-4.0 * (t - q) / d)
    # mixed: learned frequencies (a tensor, so gradients reach them)
    return scheme.freqs[0, h, t] * col + scheme.freqs[1, h, t] * row


def ref_rotation(name: str, scheme, h: int, row: int, col: int, grid: Grid, d: int) -> torch.Tensor:
    """Block-diagonal R(theta) [d, d], blocks [[cos, -sin], [sin, cos]] on pairs (2t, 2t+1)."""
    rows = []
    for _ in range(d):
        rows.append([torch.zeros((), dtype=torch.float64) for _ in range(d)])
    for t in range(d // 2):
        th = torch.as_tensor(ref_angle(name, scheme, h, row, col, grid, t, d), dtype=torch.float64)
        c, s = torch.cos(th), torch.sin(th)
        rows[2 * t][2 * t], rows[2 * t][2 * t + 1] = c, -s
        rows[2 * t + 1][2 * t], rows[2 * t + 1][2 * t + 1] = s, c
    return torch.stack([torch.stack(r) for r in rows])


def ref_rotate(name: str, scheme, x: torch.Tensor, grid: Grid, prefix: int) -> torch.Tensor:
    """x [B, heads, N, d] with each patch token multiplied by its R(theta); prefix tokens copied."""
    b, nh, n, d = x.shape
    out = []
    for h in range(nh):
        toks = [x[:, h, i] for i in range(prefix)]
        for i in range(grid.n):
            r, c = divmod(i, grid.w)
            rot = ref_rotation(name, scheme, h, r, c, grid, d)
            toks.append(x[:, h, prefix + i] @ rot.T)
        out.append(torch.stack(toks, dim=1))
    return torch.stack(out, dim=1)


def ref_attention(name: str, attn: Attention, x: torch.Tensor, grid: Grid, prefix: int):
    """Dense float64 reference: logits and output of the attention layer with reference rotations."""
    b, n, c = x.shape
    nh, d = attn.num_heads, attn.head_dim
    qkv = x @ attn.qkv.weight.T + attn.qkv.bias
    qkv = qkv.reshape(b, n, 3, nh, d).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    q = ref_rotate(name, attn.pos, q, grid, prefix)
    k = ref_rotate(name, attn.pos, k, grid, prefix)
    logits = (q @ k.transpose(-2, -1)) / math.sqrt(d)
    p = torch.exp(logits - logits.amax(-1, keepdim=True))
    p = p / p.sum(-1, keepdim=True)
    out = (p @ v).transpose(1, 2).reshape(b, n, c)
    out = out @ attn.proj.weight.T + attn.proj.bias
    return logits, out


def make_scheme(name: str, grid=(2, 2), heads: int = 2, head_dim: int = 8, **kw):
    return build_pos(name, num_heads=heads, head_dim=head_dim, grid=grid, **kw).double()


# ------------------------------------------------------------------------------ rotation
@pytest.mark.parametrize("name", ROPES)
@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("prefix", [0, 1])
def test_rotate_matches_rotation_matrices(name, grid, prefix):
    torch.manual_seed(0)
    s = make_scheme(name)  # built on 2x2, called on larger grids: integer coordinates extend
    n = prefix + grid.n
    q = torch.randn(2, 2, n, 8, dtype=torch.float64)
    k = torch.randn(2, 2, n, 8, dtype=torch.float64)
    qr, kr = s.rotate(q, k, s.prepare(grid, prefix, q.device, q.dtype))
    with torch.no_grad():
        torch.testing.assert_close(qr, ref_rotate(name, s, q, grid, prefix), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(kr, ref_rotate(name, s, k, grid, prefix), rtol=1e-12, atol=1e-12)
    # prefix tokens bit-exact, rotation is norm preserving
    assert torch.equal(qr[:, :, :prefix], q[:, :, :prefix])
    torch.testing.assert_close(qr.norm(dim=-1), q.norm(dim=-1))
    assert s.bias(grid, prefix) is None


@pytest.mark.parametrize("name", ROPES)
@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("prefix", [0, 1])
def test_attention_logits_forward_and_grads(name, grid, prefix):
    torch.manual_seed(1)
    attn = Attention(16, num_heads=2, pos=name, grid=(2, 3), num_prefix_tokens=prefix).double()
    x = torch.randn(2, prefix + grid.n, 16, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, prefix + grid.n, 16, dtype=torch.float64)

    out = attn(x, grid)
    logits = attn.logits(x, grid)
    params = [x, attn.qkv.weight, attn.qkv.bias] + ([attn.pos.freqs] if name == "rope2d_mixed" else [])
    grads = torch.autograd.grad((out * g).sum(), params)

    ref_logits, ref_out = ref_attention(name, attn, x, grid, prefix)
    ref_grads = torch.autograd.grad((ref_out * g).sum(), params)

    torch.testing.assert_close(logits, ref_logits, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    if name == "rope2d_mixed":
        assert grads[-1].abs().sum() > 0  # the learned frequencies do get a gradient


def test_mixed_gradcheck():
    """gradcheck of the functional core of rope2d_mixed in q, k and the learned frequencies."""
    torch.manual_seed(2)
    grid = Grid(2, 3)
    freqs = init_mixed_freqs(1, 4).double().requires_grad_(True)
    q = torch.randn(1, 1, 1 + grid.n, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 1 + grid.n, 4, dtype=torch.float64, requires_grad=True)

    def f(q, k, freqs):
        theta = F.pad(rope2d_mixed_angles(freqs, grid), (0, 0, 1, 0))
        cos, sin = theta.cos(), theta.sin()
        return apply_rope(q, cos, sin) @ apply_rope(k, cos, sin).transpose(-2, -1)

    assert torch.autograd.gradcheck(f, (q, k, freqs))


# ------------------------------------------------------------------------------ relative property
def offset_spread(logits: torch.Tensor, grid: Grid, mode: str) -> float:
    """Largest spread of logits[i, j] (patch tokens) within a group of equal offsets.

    mode "1d": offset p_j - p_i of the raster index; "2d": (dh, dw).
    """
    groups: dict = {}
    for i in range(grid.n):
        for j in range(grid.n):
            ri, ci = divmod(i, grid.w)
            rj, cj = divmod(j, grid.w)
            key = (j - i) if mode == "1d" else (rj - ri, cj - ci)
            groups.setdefault(key, []).append(logits[..., i, j])
    return max((torch.stack(v, -1).amax(-1) - torch.stack(v, -1).amin(-1)).abs().max().item() for v in groups.values())


@pytest.mark.parametrize("name", ROPES)
@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("prefix", [0, 1])
def test_relative_property(name, grid, prefix):
    torch.manual_seed(3)
    s = make_scheme(name)
    n = prefix + grid.n
    q0 = torch.randn(1, 2, 1, 8, dtype=torch.float64)
    k0 = torch.randn(1, 2, 1, 8, dtype=torch.float64)
    q, k = q0.expand(1, 2, n, 8), k0.expand(1, 2, n, 8)
    with torch.no_grad():
        qr, kr = s.rotate(q, k, s.prepare(grid, prefix, q.device, q.dtype))
    logits = qr @ kr.transpose(-2, -1)
    patch = logits[..., prefix:, prefix:]
    mode = "1d" if name == "rope1d" else "2d"
    assert offset_spread(patch, grid, mode) < 1e-12
    # the logits do vary with the offset (the check can fail)
    assert patch.std() > 1e-3
    if name != "rope1d":
        # a 2-D scheme is not a function of the raster offset alone (wrap-around rows differ)
        assert offset_spread(patch, grid, "1d") > 1e-3
    if prefix:
        # the prefix token is unrotated: prefix-prefix is the plain dot product; prefix-patch
        # logits see the patch's absolute rotation (as in RoPE-ViT, the class token is not rotated)
        plain = (q0 * k0).sum(-1)[..., 0]  # [1, heads]
        torch.testing.assert_close(logits[..., 0, 0], plain)
        torch.testing.assert_close(qr[..., 0, :], q[..., 0, :], rtol=0, atol=0)


def test_offset_check_detects_non_relative_rotation():
    """Negative control: angles that are not linear in the position break the relative property."""
    grid = Grid(3, 4)
    s = make_scheme("rope2d_axial")
    theta = s.angles(grid)
    theta = theta**2  # not linear in (row, col)
    cos, sin = theta.cos(), theta.sin()
    torch.manual_seed(4)
    q = torch.randn(1, 2, 1, 8, dtype=torch.float64).expand(1, 2, grid.n, 8)
    k = torch.randn(1, 2, 1, 8, dtype=torch.float64).expand(1, 2, grid.n, 8)
    logits = apply_rope(q, cos, sin) @ apply_rope(k, cos, sin).transpose(-2, -1)
    assert offset_spread(logits, grid, "2d") > 1e-3


# ------------------------------------------------------------------------------ errors
@pytest.mark.parametrize(("name", "head_dim"), [("rope1d", 5), ("rope2d_axial", 6), ("rope2d_mixed", 6)])
def test_head_dim_errors(name, head_dim):
    with pytest.raises(ValueError, match="head_dim"):
        build_pos(name, num_heads=2, head_dim=head_dim, grid=4)


def test_head_dim_ok_and_bad_inputs():
    build_pos("rope1d", num_heads=2, head_dim=6, grid=4)  # 1-D only needs pairs
    s = make_scheme("rope2d_axial")
    q = torch.randn(1, 2, 10, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="tokens"):
        s.rotate(q, q, s.prepare(Grid(3, 3), 0, q.device, q.dtype))
    with pytest.raises(ValueError, match="base"):
        build_pos("rope1d", num_heads=2, head_dim=8, grid=4, base=0.0)


# ------------------------------------------------------------------------------ mixed specifics
def test_mixed_parameter_and_init():
    torch.manual_seed(5)
    heads, d = 3, 16
    s = build_pos("rope2d_mixed", num_heads=heads, head_dim=d, grid=4)
    assert isinstance(s, Rope2dMixed)
    assert s.freqs.shape == (2, heads, d // 2) and s.freqs.requires_grad
    assert [n for n, _ in s.named_parameters()] == ["freqs"]
    assert s.no_weight_decay_keys == ("freqs", "string")  # string: STRING basis, when enabled
    fx, fy = s.freqs.detach().double()
    mag = torch.tensor([10.0 ** (-4.0 * t / d) for t in range(d // 4)], dtype=torch.float64)
    q = d // 4
    for h in range(heads):
        # both quarters: magnitude 1 / base^(4t/d); second quarter turned by pi/2
        torch.testing.assert_close(torch.hypot(fx[h, :q], fy[h, :q]), mag, rtol=1e-6, atol=0)
        torch.testing.assert_close(torch.hypot(fx[h, q:], fy[h, q:]), mag, rtol=1e-6, atol=0)
        dot = fx[h, :q] * fx[h, q:] + fy[h, :q] * fy[h, q:]
        torch.testing.assert_close(dot, torch.zeros_like(dot), rtol=0, atol=1e-6)
        # one direction per head for every frequency
        ang = torch.atan2(fy[h, :q], fx[h, :q])
        torch.testing.assert_close(torch.cos(ang - ang[0]), torch.ones_like(ang), rtol=0, atol=1e-6)
    # different heads draw different angles
    assert not torch.allclose(fx[0], fx[1])
    s0 = build_pos("rope2d_mixed", num_heads=heads, head_dim=d, grid=4, rotate=False)
    assert torch.equal(s0.freqs[1, :, :q], torch.zeros(heads, q))  # angle 0: f^y = 0 on the first quarter


def test_mixed_recomputes_when_freqs_change():
    s = make_scheme("rope2d_mixed")
    grid = Grid(2, 3)
    q = torch.randn(1, 2, grid.n, 8, dtype=torch.float64)
    a, _ = s.rotate(q, q, s.prepare(grid, 0, q.device, q.dtype))
    with torch.no_grad():
        s.freqs.mul_(1.5)
    b, _ = s.rotate(q, q, s.prepare(grid, 0, q.device, q.dtype))
    assert not torch.allclose(a, b)
    torch.testing.assert_close(b, ref_rotate("rope2d_mixed", s, q, grid, 0).detach())


# ------------------------------------------------------------------------------ cache, dtypes, fast path
@pytest.mark.parametrize("name", ["rope1d", "rope2d_axial"])
def test_fixed_tables_and_inference_mode(name):
    s = build_pos(name, num_heads=2, head_dim=8, grid=4)
    assert list(s.parameters()) == [] and s.state_dict() == {}
    grid = Grid(3, 5)
    c1 = s.cos_sin(grid, 1, torch.device("cpu"), torch.float32)
    c3 = s.cos_sin(grid, 0, torch.device("cpu"), torch.float32)
    assert c3[0].shape == (grid.n, 4) and c1[0].shape == (grid.n + 1, 4)
    # a first call under inference_mode must not poison training calls
    q = torch.randn(1, 2, grid.n, 8)
    with torch.inference_mode():
        s.rotate(q, q, s.prepare(grid, 0, q.device, q.dtype))
    qg = q.clone().requires_grad_(True)
    qr, kr = s.rotate(qg, qg, s.prepare(grid, 0, qg.device, qg.dtype))
    (qr * kr).sum().backward()
    assert qg.grad is not None


@pytest.mark.parametrize("name", ROPES)
def test_low_precision_matches_float32(name):
    torch.manual_seed(6)
    s = build_pos(name, num_heads=2, head_dim=8, grid=4)
    grid = Grid(4, 4)
    q = torch.randn(2, 2, 1 + grid.n, 8)
    ref, _ = s.rotate(q, q, s.prepare(grid, 1, q.device, q.dtype))
    out, _ = s.rotate(q.bfloat16(), q.bfloat16(), s.prepare(grid, 1, q.bfloat16().device, q.bfloat16().dtype))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("name", ROPES)
def test_forward_is_plain_sdpa_on_rotated_qk(name):
    """The fast path: attention output equals SDPA on the rotated q, k (no bias, no mask)."""
    torch.manual_seed(7)
    attn = Attention(16, num_heads=2, pos=name, grid=(3, 3), num_prefix_tokens=1).double()
    grid = Grid(3, 3)
    x = torch.randn(2, 10, 16, dtype=torch.float64)
    q, k, v = scheme_qkv(attn, x, grid)
    expect = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 10, 16)
    torch.testing.assert_close(attn(x, grid), attn.proj(expect))
    assert attn.bias(grid) is None


# ------------------------------------------------------------------------------ configs
@pytest.mark.parametrize("name", ROPES)
def test_config_builds(name):
    cfg = yaml.safe_load((CONF / f"{name}.yaml").read_text())
    assert cfg["name"] == name
    s = build_pos(cfg, num_heads=2, head_dim=8, grid=(3, 5))
    assert type(s) is get_pos_class(name)
    assert s.base == cfg["base"]


def test_real_and_complex_kernels_agree():
    """apply_rope uses a complex multiply eagerly and the real form under compile: same values and grads."""
    torch.manual_seed(8)
    theta = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 2, 7, 8, dtype=torch.float64)
    # a view with an odd storage offset: view_as_complex needs a copy first
    flat = torch.randn(2 * 2 * 7 * 8 + 1, dtype=torch.float64, requires_grad=True)
    outs = []
    for f in (apply_rope_real, apply_rope_complex):
        x = flat[1:].view(2, 2, 7, 8)
        assert x.storage_offset() % 2 == 1
        y = f(x, theta.cos(), theta.sin())
        outs.append((y, *torch.autograd.grad((y * g).sum(), (flat, theta))))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # bf16 input with float32 tables: both compute in float32 and round once to bf16
    xb = torch.randn(2, 2, 7, 8).bfloat16()
    c, s = theta.detach().float().cos(), theta.detach().float().sin()
    yc, yr = apply_rope_complex(xb, c, s), apply_rope_real(xb, c, s)
    assert yc.dtype == yr.dtype == torch.bfloat16
    torch.testing.assert_close(yc.float(), yr.float(), rtol=1e-2, atol=1e-2)


# ------------------------------------------------------------------------------ axial: the order of its axes
@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": [2.0, 3.0]}])
def test_rope2d_axial_rows_first_against_loops(scaling):
    """Rows first: pair ``t < d/4`` rotates by ``row * base^(-4t/d)``, pair ``d/4 + t`` by ``col * base^(-4t/d)``
    (with ``scaling: linear, factor [f_rows, f_cols]``: the row pairs' frequencies / f_rows, the columns' / f_cols)."""
    d, base, grid = 16, 37.0, Grid(3, 5)
    f_rows, f_cols = (1.0, 1.0) if scaling is None else scaling["factor"]
    want = torch.zeros(grid.n, d // 2, dtype=torch.float64)
    for row in range(grid.h):
        for col in range(grid.w):
            for t in range(d // 4):
                omega = base ** (-4.0 * t / d)
                want[row * grid.w + col, t] = row * omega / f_rows
                want[row * grid.w + col, d // 4 + t] = col * omega / f_cols
    opts = {"name": "rope2d_axial", "base": base} | ({"scaling": scaling} if scaling else {})
    s = build_pos(opts, num_heads=2, head_dim=d, grid=(2, 2))  # called on another grid
    torch.testing.assert_close(s.angles(grid), want, rtol=1e-13, atol=1e-13)
    if scaling is None:
        torch.testing.assert_close(rope2d_axial_angles(grid, d, base), want, rtol=1e-13, atol=1e-13)


def ropevit_compute_axial_cis(dim: int, end_x: int, end_y: int, theta: float = 100.0) -> torch.Tensor:
    """naver-ai/rope-vit ``models/vit_rope.py``: ``compute_axial_cis`` with its ``init_t_xy``, in float64:
    ``[end_x * end_y, dim / 2]`` complex, the column (``t_x``) angles first, then the rows (``t_y``)."""
    freqs_x = 1.0 / (theta ** (torch.arange(0, dim, 4)[: (dim // 4)].double() / dim))
    freqs_y = 1.0 / (theta ** (torch.arange(0, dim, 4)[: (dim // 4)].double() / dim))
    t = torch.arange(end_x * end_y, dtype=torch.float64)
    t_x = t % end_x
    t_y = torch.div(t, end_x, rounding_mode="floor")
    freqs_x = torch.outer(t_x, freqs_x)
    freqs_y = torch.outer(t_y, freqs_y)
    freqs_cis_x = torch.polar(torch.ones_like(freqs_x), freqs_x)
    freqs_cis_y = torch.polar(torch.ones_like(freqs_y), freqs_y)
    return torch.cat([freqs_cis_x, freqs_cis_y], dim=-1)


def ropevit_attention(attn: Attention, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """RoPE-ViT's ``RoPEAttention.forward`` (its ``apply_rotary_emb`` on the tokens after the class token) with the
    weights of ``attn``."""
    b, n, c = x.shape
    h = attn.num_heads
    qkv = (x @ attn.qkv.weight.T + attn.qkv.bias).reshape(b, n, 3, h, c // h).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0].clone(), qkv[1].clone(), qkv[2]
    for t in (q, k):
        xc = torch.view_as_complex(t[:, :, 1:].reshape(*t[:, :, 1:].shape[:-1], -1, 2).contiguous())
        t[:, :, 1:] = torch.view_as_real(xc * freqs_cis).flatten(3)
    a = ((q * attn.scale) @ k.transpose(-2, -1)).softmax(dim=-1)
    return ((a @ v).transpose(1, 2).reshape(b, n, c)) @ attn.proj.weight.T + attn.proj.bias


def test_ropevit_compute_axial_cis_is_rope2d_axial_with_halves_swapped():
    """RoPE-ViT's ``compute_axial_cis`` puts the columns first: its table is vitrel's with the two halves of the pairs
    exchanged, and its attention with weights ``W`` is vitrel's with ``W``'s q/k halves swapped per head
    (:func:`vitrel.models.swap_rope_axial_halves`)."""
    from vitrel.models import swap_rope_axial_halves

    torch.manual_seed(7)
    heads, d, grid = 2, 16, Grid(3, 5)
    cis = ropevit_compute_axial_cis(d, end_x=grid.w, end_y=grid.h)
    theta = make_scheme("rope2d_axial", head_dim=d).angles(grid)
    swapped = torch.cat((theta[:, d // 4 :], theta[:, : d // 4]), dim=-1)
    torch.testing.assert_close(torch.polar(torch.ones_like(swapped), swapped), cis, rtol=0, atol=1e-13)
    assert (torch.polar(torch.ones_like(theta), theta) - cis).abs().max() > 1  # unswapped: another table

    ref = Attention(heads * d, heads, pos="rope2d_axial", grid=(2, 2), num_prefix_tokens=1).double()
    x = torch.randn(2, 1 + grid.n, heads * d, dtype=torch.float64)
    want = ropevit_attention(ref, x, cis)
    ours = Attention(heads * d, heads, pos={"name": "rope2d_axial", "base": 100.0}, grid=(2, 2), num_prefix_tokens=1)
    ours = ours.double()
    ours.load_state_dict(ref.state_dict())
    assert (ours(x, grid) - want).abs().max() > 1e-3  # RoPE-ViT's weights as they are: another function
    assert swap_rope_axial_halves(ours) is ours
    torch.testing.assert_close(ours(x, grid), want, rtol=1e-12, atol=1e-12)


def test_rope2d_axial_checkpoints_written_columns_first_load_as_they_were(tmp_path):
    """vitrel_format 4 (commit 5860b1a, tests/fixtures/make_v4_rope_axial.py) put rope2d_axial's columns first: its
    files load with ``order: columns_first`` and give the outputs that code gave (checkpoint, export folder, timm's
    local-dir, inflation refuses them by name); the same weights in the rows-first layout compute something else,
    and ``swap_rope_axial_halves`` brings them there exactly."""
    import timm

    import vitrel
    from vitrel.models import inflate_image_model, swap_rope_axial_halves

    fix = Path(__file__).resolve().parents[1] / "fixtures"
    ref = torch.load(fix / "v4_rope2d_axial_out.pt", weights_only=True)
    vit = vitrel.load_model(fix / "v4_vit_rope2d_axial.pt").eval()
    swin = vitrel.load_model(fix / "v4_swin_rope2d_axial").eval()
    local = timm.create_model(f"local-dir:{fix / 'v4_swin_rope2d_axial'}", pretrained=True).eval()
    assert all(b.attn.pos.order == "columns_first" for b in vit.blocks)
    assert vit.vitrel_cfg["vitrel_format"] >= 5 and vit.vitrel_cfg["pos"]["order"] == "columns_first"
    with torch.no_grad():
        torch.testing.assert_close(vit(ref["x"]), ref["vit"])
        torch.testing.assert_close(swin(ref["x"]), ref["swin"])
        torch.testing.assert_close(local(ref["x"]), ref["swin"])
        torch.save({"vitrel_cfg": vit.vitrel_cfg, "state_dict": vit.state_dict()}, tmp_path / "again.pt")
        torch.testing.assert_close(vitrel.load_model(tmp_path / "again.pt").eval()(ref["x"]), ref["vit"])
        new = vitrel.load_model(fix / "v4_vit_rope2d_axial.pt", pos="rope2d_axial").eval()
        assert new.blocks[0].attn.pos.order == "rows_first" and not torch.allclose(new(ref["x"]), ref["vit"])
        torch.testing.assert_close(swap_rope_axial_halves(new)(ref["x"]), ref["vit"])
    with pytest.raises(ValueError, match="already rotates columns first"):
        swap_rope_axial_halves(vit)
    # built as the image ViT (its channels, class token, pooling): what is refused is the rotary order
    video = vitrel.create_model(
        "vitrel_vit_video_tiny_patch4_32", pos={"name": "rope3d_axial", "sections": [0, 4, 4], "base": 100.0},
        img_size=16, num_frames=2, tubelet_size=1, embed_dim=32, depth=2, num_heads=2, in_chans=3, class_token=True,
        global_pool="token",
    )  # fmt: skip
    with pytest.raises(ValueError, match="order.*columns_first.*swap_rope_axial_halves"):
        inflate_image_model(fix / "v4_vit_rope2d_axial.pt", video)


def test_rope2d_axial_order_option():
    grid = Grid(3, 4)
    rows = build_pos("rope2d_axial", num_heads=2, head_dim=16, grid=grid)
    cols = build_pos({"name": "rope2d_axial", "order": "columns_first"}, num_heads=2, head_dim=16, grid=grid)
    a, b = rows.angles(grid), cols.angles(grid)
    torch.testing.assert_close(b, torch.cat((a[:, 4:], a[:, :4]), dim=-1), rtol=0, atol=0)
    assert get_pos_class("rope2d_axial").legacy_options({"name": "rope2d_axial"}, 4)["order"] == "columns_first"
    assert "order" not in get_pos_class("rope2d_axial").legacy_options({"name": "rope2d_axial"}, 5)
    with pytest.raises(ValueError, match="order must be one of"):
        build_pos({"name": "rope2d_axial", "order": "cols"}, num_heads=2, head_dim=16, grid=grid)
