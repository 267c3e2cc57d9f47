"""PaPE and PaPE-RI (vitrel/pos/schemes/pape.py) against the equation, the authors' code and their released defaults.

Authors' code: github.com/DTU-PAS/parabolic-position-encoding, commit 21cb390eafb9398e78c7c786d20505f557c973ec,
``pape/nn/positions/pape.py`` (``ParabolicPositionEncoder.encode_query_key``), ``pape/nn/positions/pape_ri.py``
(``ParabolicRotationInvariantPositionEncoder.encode_query_key``), ``pape/nn/encoder.py`` (``Attention.forward``:
the encoder gets the layer input, SDPA with ``scale = head_size ** -0.5``), ``pape/nn/image_classifier.py`` (the
positions: ``(col, row)`` from 1, the class token at ``(0, 0)``) and ``pape/configs.py`` (``parabolas = 50``).
"""

from __future__ import annotations

import copy
import functools
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from tests.reference import scheme_qkv
from vitrel import Attention
from vitrel.pos import Grid, build_pos, get_pos_class

DIM, HEADS = 32, 2
D = DIM // HEADS
CONF = Path(__file__).resolve().parents[2] / "conf" / "pos"
CASES = [((3, 4), 1), ((2, 5), 0), ((4, 3), 2), ((3, 3), 1)]  # non-square grids, a class token, two registers


def layer(name: str, grid, prefix: int, seed: int = 0, **opts) -> Attention:
    torch.manual_seed(seed)
    a = Attention(DIM, HEADS, pos=name, grid=grid, num_prefix_tokens=prefix, **opts).double()
    with torch.no_grad():  # weights of a trained size: curvatures and slopes well away from 0
        for p in a.pos.parameters():
            p.normal_(0.0, 0.5)
        if name == "pape_ri":
            a.pos.position_scales.uniform_(-math.sqrt(0.5), math.sqrt(0.5))
    return a


def tokens(grid, prefix: int, batch: int = 2, seed: int = 1) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(batch, prefix + grid[0] * grid[1], DIM, dtype=torch.float64, requires_grad=True)


# ------------------------------------------------------------------------ (1) naive float64 reference
def position(t: int, grid, prefix: int) -> tuple[float, float]:
    """Token ``t``'s position ``(x, y)``: patch (row, col) at (col + 1, row + 1), prefix tokens at the origin."""
    if t < prefix:
        return 0.0, 0.0
    r, c = divmod(t - prefix, grid[1])
    return float(c + 1), float(r + 1)


def reference_logits(a: Attention, x: torch.Tensor, grid, prefix: int, prefix_term: bool = True) -> torch.Tensor:
    """The paper's logits, one pair at a time (float64):
    pape:    (q_i . k_j + sum_p [-a_ip (u_ip - u_jp)^2 + b_ip (u_ip - u_jp)]) / sqrt(d),  u = W pos, (a, b) of x_i
    pape_ri: (q_i . k_j - a_i s_h^2 |pos_i - pos_j|^2) / sqrt(d)."""
    s = a.pos
    b, n, _ = x.shape
    q, k, _ = (a.qkv(x).view(b, n, 3, HEADS, D)).unbind(2)  # [B, N, heads, d]
    if s.name == "pape":
        p = s.parabolas
        w = s.position.weight.view(HEADS, p, 2)
        ab = (x @ s.ab.weight.t()).view(b, n, 2, HEADS, p)
        curv, slope = F.softplus(ab[:, :, 0]), ab[:, :, 1]  # [B, N, heads, P]
    else:
        scales = s.position_scales.view(HEADS)
        curv = F.softplus(x @ s.a.weight.t())  # [B, N, heads]
    rows = []
    for i in range(n):
        row = []
        pi = torch.tensor(position(i, grid, prefix), dtype=torch.float64)
        for j in range(n):
            pj = torch.tensor(position(j, grid, prefix), dtype=torch.float64)
            logit = (q[:, i] * k[:, j]).sum(-1)  # [B, heads]
            if prefix_term or (i >= prefix and j >= prefix):
                if s.name == "pape":
                    du = w @ (pi - pj)  # [heads, P]: u_i - u_j
                    logit = logit + (-curv[:, i] * du**2 + slope[:, i] * du).sum(-1)
                else:
                    logit = logit - curv[:, i] * scales**2 * ((pi - pj) ** 2).sum()
            row.append(logit / math.sqrt(D))
        rows.append(torch.stack(row, -1))
    return torch.stack(rows, -2)  # [B, heads, N, N]


def reference_forward(a: Attention, x: torch.Tensor, grid, prefix: int, prefix_term: bool = True) -> torch.Tensor:
    b, n, _ = x.shape
    v = a.qkv(x).view(b, n, 3, HEADS, D)[:, :, 2].transpose(1, 2)
    out = reference_logits(a, x, grid, prefix, prefix_term).softmax(-1) @ v
    return a.proj(out.transpose(1, 2).reshape(b, n, DIM))


def grads(loss: torch.Tensor, a: Attention, x: torch.Tensor) -> list[torch.Tensor]:
    return torch.autograd.grad(loss, [x, *a.parameters()])


SCHEMES = [("pape", {"channels": "compact"}), ("pape", {"channels": "parabolas"}), ("pape_ri", {})]


@pytest.mark.parametrize(("name", "opts"), SCHEMES)
@pytest.mark.parametrize(("grid", "prefix"), CASES)
def test_logits_forward_and_gradients_equal_the_equation(name, opts, grid, prefix):
    opts = {"parabolas": 3, **opts} if name == "pape" else opts
    a = layer(name, grid, prefix, **opts)
    x = tokens(grid, prefix)
    ref = reference_logits(a, x, grid, prefix)
    torch.testing.assert_close(a.logits(x, grid), ref, rtol=1e-10, atol=1e-10)
    out, want = a(x, grid), reference_forward(a, x, grid, prefix)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    g = torch.randn_like(out)
    for got, exp in zip(grads((out * g).sum(), a, x), grads((want * g).sum(), a, x), strict=True):
        torch.testing.assert_close(got, exp, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("channels", ["compact", "parabolas"])
def test_default_parabolas_equal_the_equation(channels):
    """The released 50 parabolas per head, with a class token (one case, the loops are the same)."""
    grid, prefix = (2, 3), 1
    a = layer("pape", grid, prefix, channels=channels)
    assert a.pos.parabolas == 50
    x = tokens(grid, prefix)
    torch.testing.assert_close(a.logits(x, grid), reference_logits(a, x, grid, prefix), rtol=1e-10, atol=1e-9)


@pytest.mark.parametrize("name", ["pape", "pape_ri"])
def test_prefix_position_none_gives_prefix_pairs_no_term(name):
    grid, prefix = (3, 4), 2
    a = layer(name, grid, prefix, prefix_position="none")
    x = tokens(grid, prefix)
    ref = reference_logits(a, x, grid, prefix, prefix_term=False)
    torch.testing.assert_close(a.logits(x, grid), ref, rtol=1e-10, atol=1e-10)
    want = reference_forward(a, x, grid, prefix, prefix_term=False)
    torch.testing.assert_close(a(x, grid), want, rtol=1e-10, atol=1e-10)
    with_origin = layer(name, grid, prefix)
    assert not torch.allclose(with_origin.logits(x, grid), ref)  # the class token's own term is real


# ------------------------------------------------------------------------ (2) the authors' code
def authors_positions(grid, dtype=torch.float64) -> torch.Tensor:
    """``ImageClassifier.__init__``'s positions (normalize=False): ``(col, row)`` from 1, class token at (0, 0)."""
    h, w = grid
    rows, cols = torch.arange(1, h + 1), torch.arange(1, w + 1)
    pos = torch.stack((cols[None].repeat(h, 1).view(-1), rows[:, None].repeat(1, w).view(-1)), -1)
    return torch.cat((torch.zeros(1, 2, dtype=pos.dtype), pos))[None].to(dtype)  # [1, 1 + HW, 2]


def authors_pape(hidden, query, key, positions, position_w, ab_w, heads, parabolas, head_size):
    """``ParabolicPositionEncoder.encode_query_key`` as it computes (order of channels, padding included)."""
    bsz, n, _ = positions.shape
    u = (positions @ position_w.t()).view(bsz, n, heads, parabolas).permute(0, 2, 1, 3)
    u2 = u.pow(2)
    b = key.size(0)
    u, u2 = u.expand(b, -1, -1, -1), u2.expand(b, -1, -1, -1)
    ab = (hidden @ ab_w.t()).view(b, n, 2, heads, parabolas).permute(2, 0, 3, 1, 4)
    ca, cb = F.softplus(ab[0]), ab[1]
    ones = torch.ones(b, heads, n, 1, dtype=u.dtype)
    query = torch.cat([query, (ca * -u2).sum(-1, keepdim=True), ca, ca * 2 * u, (cb * u).sum(-1, keepdim=True), cb], -1)
    key = torch.cat([key, ones, -u2, u, ones, -u], -1)
    total = head_size + 3 * parabolas + 2
    pad = 8 * math.ceil(total / 8) - total
    return F.pad(query, (0, pad)), F.pad(key, (0, pad))


def authors_pape_ri(hidden, query, key, positions, scales, a_w, heads, head_size):
    """``ParabolicRotationInvariantPositionEncoder.encode_query_key`` as it computes (``num_positions = 2``)."""
    u = positions.unsqueeze(1) * scales
    u2 = u.pow(2)
    b, n = key.size(0), key.size(2)
    u, u2 = u.expand(b, -1, -1, -1), u2.expand(b, -1, -1, -1)
    ca = F.softplus((hidden @ a_w.t()).view(b, n, heads).transpose(1, 2)).unsqueeze(-1).expand(-1, -1, -1, 2)
    ones = torch.ones(b, heads, n, 1, dtype=u.dtype)
    query = torch.cat([query, (ca * -u2).sum(-1, keepdim=True), ca, ca * 2 * u], -1)
    key = torch.cat([key, ones, -u2, u], -1)
    total = head_size + 2 * 2 + 1
    pad = 8 * math.ceil(total / 8) - total
    return F.pad(query, (0, pad)), F.pad(key, (0, pad))


def authors_attention(a: Attention, x: torch.Tensor, grid) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``encoder.Attention.forward`` (SDPA path, their scale) with this layer's weights: ``(out, q', k')``."""
    b, n, _ = x.shape
    qkv = a.qkv(x).view(b, n, 3, HEADS, D).permute(2, 0, 3, 1, 4)
    pos = authors_positions(grid)
    s = a.pos
    if s.name == "pape":
        q, k = authors_pape(x, qkv[0], qkv[1], pos, s.position.weight, s.ab.weight, HEADS, s.parabolas, D)
    else:
        q, k = authors_pape_ri(x, qkv[0], qkv[1], pos, s.position_scales, s.a.weight, HEADS, D)
    out = F.scaled_dot_product_attention(q, k, qkv[2], scale=D**-0.5)
    return a.proj(out.permute(0, 2, 1, 3).reshape(b, n, DIM)), q, k


@pytest.mark.parametrize(("name", "opts"), SCHEMES)
@pytest.mark.parametrize("grid", [(3, 4), (4, 4)])
def test_equals_the_authors_code(name, opts, grid):
    """Same weights (their parameter names and shapes), a class token: the layer's output and gradients are
    theirs; with their channel layout (pape channels="parabolas", pape_ri) the augmented q', k' are theirs
    channel for channel."""
    a = layer(name, grid, 1, seed=2, **opts)
    x = tokens(grid, 1, seed=3)
    want, q_ref, k_ref = authors_attention(a, x, grid)
    q, k, _ = scheme_qkv(a, x, Grid(*grid))
    if opts.get("channels") != "compact":
        torch.testing.assert_close(q, q_ref, rtol=0, atol=1e-12)
        torch.testing.assert_close(k, k_ref, rtol=0, atol=1e-12)
    else:  # the same products q' k'^T from 6 channels instead of 3 P + 2
        assert q.shape[-1] == D + 8 and q_ref.shape[-1] == D + 3 * 50 + 2
        torch.testing.assert_close(q @ k.transpose(-2, -1), q_ref @ k_ref.transpose(-2, -1), rtol=1e-11, atol=1e-9)
    out = a(x, grid)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    for got, exp in zip(grads(out.square().sum(), a, x), grads(want.square().sum(), a, x), strict=True):
        torch.testing.assert_close(got, exp, rtol=1e-10, atol=1e-12)


def test_parameters_and_defaults_are_the_authors():
    """Their state-dict names and shapes, torch's default Linear init (theirs), the released configuration
    (PaPEConfig.parabolas = 50, class token at the origin) in the classes and in conf/pos/."""
    s = build_pos("pape", num_heads=3, head_dim=64, grid=(14, 14), num_prefix_tokens=1)
    shapes = {k: tuple(v.shape) for k, v in s.state_dict().items()}
    assert shapes == {"position.weight": (3 * 50, 2), "ab.weight": (2 * 3 * 50, 192)}
    assert s.ab.weight.abs().max() <= 1 / math.sqrt(192) and s.position.weight.abs().max() <= 1 / math.sqrt(2)
    assert s.ab.weight.std() > 0.5 / math.sqrt(3 * 192)  # kaiming-uniform(a = sqrt 5): std 1 / sqrt(3 fan_in)
    r = build_pos("pape_ri", num_heads=3, head_dim=64, grid=(14, 14), num_prefix_tokens=1)
    shapes = {k: tuple(v.shape) for k, v in r.state_dict().items()}
    assert shapes == {"position_scales": (1, 3, 1, 1), "a.weight": (3, 192)}
    assert [n for n, _ in r.named_parameters()] == ["a.weight"]  # the scales are a buffer (not learned)
    torch.manual_seed(0)
    scales = torch.cat([build_pos("pape_ri", num_heads=64, head_dim=8, grid=4).position_scales.flatten()])
    assert scales.abs().max() <= math.sqrt(0.5) and scales.min() < -0.5 and scales.max() > 0.5
    for name in ("pape", "pape_ri"):
        conf = yaml.safe_load((CONF / f"{name}.yaml").read_text())
        assert conf.pop("name") == name and conf["prefix_position"] == "origin"
        built = build_pos({"name": name, **conf}, num_heads=2, head_dim=8, grid=4)
        default = build_pos(name, num_heads=2, head_dim=8, grid=4)
        assert built.extra_repr() == default.extra_repr()
    assert "parabolas=50" in build_pos("pape", num_heads=2, head_dim=8, grid=4).extra_repr()
    # q' width: head_dim + 3 P + 2 (+ 2 * 2 + 1 for RI), padded to a multiple of 8, as theirs
    x = torch.randn(1, 197, 768)
    for pos, width in (({"name": "pape", "channels": "parabolas"}, 216), ("pape", 72), ("pape_ri", 72)):
        a = Attention(768, 12, pos=pos, grid=(14, 14), num_prefix_tokens=1)  # compact: 64 + 6, padded
        assert scheme_qkv(a, x, Grid(14, 14))[0].shape[-1] == width


# ------------------------------------------------------------------------ (3) fast path == eager logits path
@pytest.mark.parametrize("name", ["pape", "pape_ri"])
def test_sdpa_path_equals_the_eager_logits_path(name):
    grid, prefix = (3, 5), 1
    a = layer(name, grid, prefix)
    e = layer(name, grid, prefix, attn_impl="eager")
    x = tokens(grid, prefix)
    out, eager = a(x, grid), e(x, grid)
    b, n, _ = x.shape
    v = a.qkv(x).view(b, n, 3, HEADS, D)[:, :, 2].transpose(1, 2)
    by_logits = a.proj((a.logits(x, grid).softmax(-1) @ v).transpose(1, 2).reshape(b, n, DIM))
    torch.testing.assert_close(out, eager, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, by_logits, rtol=1e-12, atol=1e-12)
    for got, exp in zip(grads(out.sum(), a, x), grads(eager.sum(), e, x), strict=True):
        torch.testing.assert_close(got, exp, rtol=1e-10, atol=1e-12)
    for impl in ("flex", "fold"):
        with pytest.raises(ValueError, match="depends on the query token"):
            layer(name, grid, prefix, attn_impl=impl)(x, grid)


# ------------------------------------------------------------------------ (4) translation and rotation
def _term(a: Attention, x: torch.Tensor, grid) -> torch.Tensor:
    """The position term of the logits: logits minus q k^T * scale (same x)."""
    b, n, _ = x.shape
    q, k, _ = a.qkv(x).view(b, n, 3, HEADS, D).permute(2, 0, 3, 1, 4)
    return a.logits(x, grid) - q @ k.transpose(-2, -1) * D**-0.5


@pytest.mark.parametrize("name", ["pape", "pape_ri"])
def test_patch_term_depends_on_query_content_and_offset_only(name):
    """Translate the content of the grid: the term between patches that moved together is unchanged; the class
    token's (at the origin) is not, as in the authors' model."""
    h, w, (sh, sw) = 4, 5, (1, 2)
    a = layer(name, (h, w), 1)
    with torch.no_grad():
        x = tokens((h, w), 1)
        patches = x[:, 1:].reshape(2, h, w, DIM)
        y = torch.cat([x[:, :1], patches.roll((sh, sw), (1, 2)).reshape(2, h * w, DIM)], 1)
        ta, tb = _term(a, x, (h, w)), _term(a, y, (h, w))
    src = torch.tensor([1 + r * w + c for r in range(h - sh) for c in range(w - sw)])
    dst = torch.tensor([1 + (r + sh) * w + c + sw for r in range(h - sh) for c in range(w - sw)])
    torch.testing.assert_close(ta[:, :, src][..., src], tb[:, :, dst][..., dst], rtol=1e-10, atol=1e-10)
    assert not torch.allclose(ta[:, :, 0, src], tb[:, :, 0, dst])  # class token -> patches
    assert get_pos_class(name).prefix_positioned
    a = layer(name, (h, w), 1, prefix_position="none")  # vitrel's convention: prefix pairs have no term at all
    with torch.no_grad():
        tn = _term(a, x, (h, w))
    assert tn[:, :, 0].abs().max() < 1e-12 and tn[:, :, :, 0].abs().max() < 1e-12


@pytest.mark.parametrize(("name", "invariant"), [("pape_ri", True), ("pape", False)])
def test_rotation_invariance_of_pape_ri_only(name, invariant):
    """Rotate the content of a square grid by 90 degrees: PaPE-RI's term between patches moves with it, PaPE's
    (learned directions) does not."""
    n = 4
    a = layer(name, (n, n), 0)
    with torch.no_grad():
        x = tokens((n, n), 0)
        y = x.reshape(2, n, n, DIM).rot90(1, (1, 2)).reshape(2, n * n, DIM)
        ta, tb = _term(a, x, (n, n)), _term(a, y, (n, n))
    # rot90 over (rows, cols): content at (r, c) moves to (n - 1 - c, r)
    perm = torch.tensor([(n - 1 - c) * n + r for r in range(n) for c in range(n)])
    same = torch.allclose(ta, tb[:, :, perm][..., perm], rtol=1e-10, atol=1e-10)
    assert same == invariant


# ------------------------------------------------------------------------ (5) mixed precision
AMP_GRID = (32, 32)  # positions up to 33: their squares cancel in bfloat16 products (module docstring of pape.py)


def amp_errors(pos, dtype: torch.dtype, attn_impl: str = "sdpa", model_dtype: bool = False) -> dict[str, float]:
    """Relative errors against float64 (norm of the difference over the reference's) of one layer at ``AMP_GRID``
    under ``torch.autocast(dtype)`` (or, ``model_dtype``, the layer and its input cast to ``dtype``): output,
    gradients (input and parameters), attention map."""
    torch.manual_seed(0)
    a = Attention(DIM, HEADS, pos=pos, grid=AMP_GRID, num_prefix_tokens=1, attn_impl=attn_impl)
    a64 = copy.deepcopy(a).double()
    x = torch.randn(1, 1 + AMP_GRID[0] * AMP_GRID[1], DIM)
    x64 = x.double().requires_grad_()
    ref = a64(x64, AMP_GRID)
    g = torch.randn_like(ref)
    (ref * g).sum().backward()
    if model_dtype:
        a, x = a.to(dtype), x.to(dtype)
    x.requires_grad_()
    with torch.autocast("cpu", dtype=dtype, enabled=not model_dtype):
        out = a(x, AMP_GRID)
        with torch.no_grad():
            probs = a.attention_map(x, AMP_GRID)
    assert out.dtype == dtype
    (out.double() * g).sum().backward()

    def rel(got, want):
        return ((got.double() - want).norm() / want.norm()).item()

    grads = [torch.cat([t.grad.flatten() for t in (xx, *m.parameters())]) for xx, m in ((x, a), (x64, a64))]
    with torch.no_grad():
        return {
            "out": rel(out.detach(), ref.detach()),
            "grad": rel(*grads),
            "probs": rel(probs, a64.attention_map(x64, AMP_GRID)),
        }


@functools.cache
def no_position_errors(dtype: torch.dtype, attn_impl: str, model_dtype: bool) -> dict[str, float]:
    return amp_errors("none", dtype, attn_impl, model_dtype)


@pytest.mark.parametrize(
    ("pos", "dtype", "attn_impl", "model_dtype"),
    [
        ("pape", torch.bfloat16, "sdpa", False),
        ({"name": "pape", "channels": "parabolas", "parabolas": 8}, torch.bfloat16, "sdpa", False),
        ("pape_ri", torch.bfloat16, "sdpa", False),
        ("pape", torch.float16, "eager", False),
        ("pape", torch.bfloat16, "sdpa", True),
    ],
)
def test_mixed_precision_errors_are_those_of_no_position(pos, dtype, attn_impl, model_dtype):
    """At a 32 x 32 grid under autocast (or a bfloat16 layer), output, gradients and attention map are as far from
    float64 as with no position at all (within 2x): q', k' and the attention are float32 there, no bfloat16 product
    of squared positions cancels."""
    got = amp_errors(pos, dtype, attn_impl, model_dtype)
    base = no_position_errors(dtype, attn_impl, model_dtype)
    for k, v in got.items():
        assert v < 2 * base[k], (k, got, base)
