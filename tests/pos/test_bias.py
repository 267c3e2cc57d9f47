"""Bias-type schemes (rel2d_full, rel2d_factored, rel2d_cpb, rel2d_bucket, rel1d_bucket, alibi1d,
alibi2d) against naive float64 references: bias, logits, outputs and gradients."""

from __future__ import annotations

import math

import pytest
import torch

from tests.reference import (
    alibi_slopes_reference,
    autocast_param_errors,
    dense_bias,
    reference_attention,
    t5_bucket_scalar,
)
from vitrel import Attention
from vitrel.pos import Grid, build_pos

torch.manual_seed(0)

GRIDS = [(4, 4), (3, 5)]
PREFIX = [0, 1]


def _clamp(d: int, half: int) -> int:
    return max(-half, min(half, d))


def ref_full(pos, grid):
    t = pos.table.detach().double()
    hh, hw = (t.shape[0] - 1) // 2, (t.shape[1] - 1) // 2
    return lambda h, pi, pj: t[_clamp(pi[0] - pj[0], hh) + hh, _clamp(pi[1] - pj[1], hw) + hw, h]


def ref_factored(pos, grid):
    th, tw = pos.table_h.detach().double(), pos.table_w.detach().double()
    hh, hw = (th.shape[0] - 1) // 2, (tw.shape[0] - 1) // 2
    return lambda h, pi, pj: th[_clamp(pi[0] - pj[0], hh) + hh, h] + tw[_clamp(pi[1] - pj[1], hw) + hw, h]


def ref_cpb(pos, grid):
    ref = pos.ref_grid.tolist()
    ref = type("G", (), {"h": ref[0], "w": ref[1]})
    w1, b1, w2 = (p.detach().double() for p in (pos.mlp[0].weight, pos.mlp[0].bias, pos.mlp[2].weight))

    def f(h, pi, pj):
        x = torch.tensor(
            [8.0 * (pi[0] - pj[0]) / max(ref.h - 1, 1), 8.0 * (pi[1] - pj[1]) / max(ref.w - 1, 1)],
            dtype=torch.float64,
        )
        x = torch.sign(x) * torch.log2(x.abs() + 1) / math.log2(8)
        hid = torch.relu(w1 @ x + b1)
        return 16 * torch.sigmoid(w2 @ hid)[h]

    return f


def ref_cpb_cr(pos, grid):
    """timm's ``RelPosMlp(mode="cr")``: ``MLP(sign(d) ln(1 + |d|))``, both layers with a bias, no gate."""
    w1, b1, w2, b2 = (p.detach().double() for p in (pos.mlp[0].weight, pos.mlp[0].bias, pos.mlp[3].weight,
                                                     pos.mlp[3].bias))  # fmt: skip

    def f(h, pi, pj):
        x = torch.tensor([pi[0] - pj[0], pi[1] - pj[1]], dtype=torch.float64)
        return (w2 @ torch.relu(w1 @ (torch.sign(x) * torch.log(1 + x.abs())) + b1) + b2)[h]

    return f


def ref_bucket2d(pos, grid):
    th, tw = pos.table_h.detach().double(), pos.table_w.detach().double()
    nb, md = pos.num_buckets, pos.max_distance
    return lambda h, pi, pj: (
        th[t5_bucket_scalar(pj[0] - pi[0], nb, md), h] + tw[t5_bucket_scalar(pj[1] - pi[1], nb, md), h]
    )


def ref_bucket1d(pos, grid):
    t = pos.table.detach().double()
    nb, md, w = pos.num_buckets, pos.max_distance, grid[1]
    return lambda h, pi, pj: t[t5_bucket_scalar((pj[0] * w + pj[1]) - (pi[0] * w + pi[1]), nb, md), h]


def _slope(h, pos):
    if pos.slope_rule == "geometric":
        return 2.0 ** (-8.0 * (h + 1) / pos.num_heads)
    return alibi_slopes_reference(pos.num_heads)[h]


def ref_alibi1d(pos, grid):
    w = grid[1]
    return lambda h, pi, pj: -_slope(h, pos) * abs((pi[0] * w + pi[1]) - (pj[0] * w + pj[1]))


def ref_alibi2d(pos, grid):
    return lambda h, pi, pj: -_slope(h, pos) * math.hypot(pi[0] - pj[0], pi[1] - pj[1])


REFS = {
    "rel2d_full": (ref_full, {}),
    "rel2d_factored": (ref_factored, {}),
    "rel2d_cpb": (ref_cpb, {"hidden_dim": 16}),
    "rel2d_cpb:cr": (ref_cpb_cr, {"hidden_dim": 16, "mode": "cr", "mlp_drop": 0.0}),
    "rel2d_bucket": (ref_bucket2d, {"num_buckets": 8, "max_distance": 6}),
    "rel1d_bucket": (ref_bucket1d, {"num_buckets": 8, "max_distance": 12}),
    "alibi1d": (ref_alibi1d, {}),
    "alibi2d": (ref_alibi2d, {}),
}


def _make(name, grid, prefix, build_grid=None, **kw):
    torch.manual_seed(1)
    pos = name.split(":")[0]  # (a key "<scheme>:<variant>": the scheme with that entry's options)
    a = Attention(24, 3, pos=pos, grid=build_grid or grid, num_prefix_tokens=prefix, **{**REFS[name][1], **kw})
    a = a.double()
    # non-trivial tables (zero-init MLPs/tables would hide index bugs)
    with torch.no_grad():
        for n, p in a.pos.named_parameters():
            p.normal_(0, 0.5 if "table" in n else p.std().item() + 0.1)
    return a


@pytest.mark.parametrize("name", list(REFS))
@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("prefix", PREFIX)
def test_bias_matches_reference(name, grid, prefix):
    a = _make(name, grid, prefix)
    ref = dense_bias(REFS[name][0](a.pos, grid), 3, *grid, prefix)
    got = a.bias(grid)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", list(REFS))
@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("prefix", PREFIX)
def test_logits_output_and_grads_match_reference(name, grid, prefix):
    a = _make(name, grid, prefix)
    n = prefix + grid[0] * grid[1]
    x = torch.randn(2, n, 24, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)

    logits = a.logits(x, grid)
    out = a(x, grid)  # fast path: SDPA with the bias as float mask
    params = [p for p in a.parameters() if p.requires_grad]
    g_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, *params], g_out)

    # reference: bias rebuilt from the equation with autograd through the scheme's own parameters
    # is not possible from a loop of python floats, so we check the bias gradient separately below
    bias_ref = dense_bias(REFS[name][0](a.pos, grid), 3, *grid, prefix)
    logits_ref, out_ref = reference_attention(a, x_ref, bias_ref)
    torch.testing.assert_close(logits, logits_ref)
    torch.testing.assert_close(out, out_ref)
    gx_ref = torch.autograd.grad(out_ref, x_ref, g_out)[0]
    torch.testing.assert_close(grads[0], gx_ref)

    # gradient w.r.t. the bias itself: d out / d bias from the dense reference, pulled back to the
    # scheme's parameters through the scheme's own bias() must equal autograd through the fast path
    bias_leaf = bias_ref.clone().requires_grad_(True)
    _, out_b = reference_attention(a, x.detach(), bias_leaf)
    g_bias = torch.autograd.grad(out_b, bias_leaf, g_out)[0]
    pos_params = [p for p in a.pos.parameters() if p.requires_grad]
    if pos_params:
        pulled = torch.autograd.grad(a.bias(grid), pos_params, g_bias)
        fast = torch.autograd.grad(a(x.detach(), grid), pos_params, g_out)
        for gp, gf in zip(pulled, fast):
            torch.testing.assert_close(gf, gp)


@pytest.mark.parametrize("name", ["rel2d_full", "rel2d_factored", "rel2d_bucket"])
def test_table_gradient_by_finite_differences(name):
    """gradcheck of the bias w.r.t. the table: catches index/scatter bugs in the backward."""
    a = _make(name, (3, 4), 1)
    pos = a.pos
    names = [n for n, _ in pos.named_parameters()]

    def f(*tables):
        for n, t in zip(names, tables):
            setattr(pos, n, t)  # temporarily replace the parameter by a plain tensor
        return pos.bias(Grid(3, 4), 1)

    saved = {n: p for n, p in pos.named_parameters()}
    tables = [p.detach().clone().requires_grad_(True) for p in saved.values()]
    for n in names:
        delattr(pos, n)
    try:
        assert torch.autograd.gradcheck(f, tables, eps=1e-6, atol=1e-6)
    finally:
        for n, p in saved.items():
            if hasattr(pos, n):
                delattr(pos, n)
            pos.register_parameter(n, p)


@pytest.mark.parametrize("grid", GRIDS)
def test_factored_equals_full_with_outer_sum_table(grid):
    f = _make("rel2d_factored", grid, 1)
    full = _make("rel2d_full", grid, 1)
    with torch.no_grad():
        full.pos.table.copy_(f.pos.table_h[:, None, :] + f.pos.table_w[None, :, :])
    torch.testing.assert_close(f.bias(grid), full.bias(grid))


def test_alibi_has_no_parameters_and_slopes_are_geometric():
    a = Attention(32, 8, pos="alibi2d", grid=(4, 4))
    assert sum(p.numel() for p in a.pos.parameters()) == 0
    s = a.pos.slopes
    torch.testing.assert_close(s[1:] / s[:-1], torch.full((7,), 0.5, dtype=s.dtype))


@pytest.mark.parametrize("heads", [6, 8, 12, 16, 3, 5])
def test_alibi_slopes_follow_the_reference_code(heads):
    """``slopes="reference"`` (default) = ALiBi's get_slopes / BLOOM; ``"geometric"`` = 2^(-8(h+1)/n)."""
    ref = torch.tensor(alibi_slopes_reference(heads), dtype=torch.float64)
    s = build_pos("alibi2d", num_heads=heads, head_dim=8, grid=(3, 3))
    torch.testing.assert_close(s.slopes, ref, rtol=1e-15, atol=0)
    g = build_pos({"name": "alibi1d", "slopes": "geometric"}, num_heads=heads, head_dim=8, grid=(3, 3))
    geo = torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)], dtype=torch.float64)
    torch.testing.assert_close(g.slopes, geo, rtol=1e-15, atol=0)
    if heads & (heads - 1) == 0:
        torch.testing.assert_close(s.slopes, g.slopes)  # both rules agree for powers of two
    else:
        assert (s.slopes - g.slopes).abs().max() > 0.05
    if heads == 12:  # the held-out check: up to 0.69 apart for ViT-B's 12 heads
        assert abs((s.slopes - g.slopes).abs().max().item() - 0.69) < 0.01
    with pytest.raises(ValueError, match="'reference' or 'geometric'"):
        build_pos({"name": "alibi2d", "slopes": "linear"}, num_heads=heads, head_dim=8, grid=(3, 3))
    for bad in (0, -8):  # (slopes of 1 and more: 4, 16, 64 ... at -8)
        said = r"max_exponent must be > 0 \(slopes 2\^-\(max_exponent \(h\+1\) / heads\), h = 0 \.\. heads-1\)"
        with pytest.raises(ValueError, match=f"{said}, got {bad}"):  # (the slopes' exponent as the code has it)
            build_pos({"name": "alibi2d", "max_exponent": bad}, num_heads=heads, head_dim=8, grid=(3, 3))


def test_checkpoints_written_before_keep_their_alibi_slopes(tmp_path):
    """A vitrel 0.1 config (no ``vitrel_format``) meant the geometric rule: it still builds with it."""
    import vitrel

    m = vitrel.create_model("vitrel_vit_tiny_patch4_32", pos="alibi2d", embed_dim=48, depth=1, num_heads=6)
    assert m.blocks[0].attn.pos.slope_rule == "reference" and m.vitrel_cfg["vitrel_format"] >= 2
    old = {k: v for k, v in m.vitrel_cfg.items() if k != "vitrel_format"}
    old["pos"] = {"name": "alibi2d", "max_exponent": 8.0}  # as conf/pos/alibi2d.yaml stored it in 0.1
    torch.save(
        {"state_dict": {"model." + k: v for k, v in m.state_dict().items()}, "vitrel_cfg": old}, tmp_path / "a.ckpt"
    )
    back = vitrel.load_model(tmp_path / "a.ckpt")
    assert back.blocks[0].attn.pos.slope_rule == "geometric"
    again = vitrel.load_model(tmp_path / "a.ckpt", pos="alibi2d")  # an explicit override is taken as given
    assert again.blocks[0].attn.pos.slope_rule == "reference"


def test_bucket_is_exact_for_small_offsets_and_log_for_large():
    from vitrel.pos.schemes.bucket import t5_bucket

    rel = torch.arange(-200, 201)
    got = t5_bucket(rel, 32, 128)
    ref = torch.tensor([t5_bucket_scalar(int(r), 32, 128) for r in rel])
    assert torch.equal(got, ref)
    # exact region: |r| < 8 -> distinct buckets; far region saturates at the last bucket of each side
    assert len(set(got[(rel.abs() < 8)].tolist())) == 15
    assert got[-1].item() == 31 and got[0].item() == 15


@pytest.mark.parametrize("name", ["rel2d_full", "rel2d_factored"])
def test_larger_call_grid_clamps_to_table_edge(name):
    a = _make(name, (3, 3), 0)
    big = (5, 6)
    ref = dense_bias(REFS[name][0](a.pos, big), 3, *big, 0)
    torch.testing.assert_close(a.bias(big), ref)


def test_cpb_extends_to_any_grid_without_parameters_change():
    a = _make("rel2d_cpb", (4, 4), 1)
    ref = dense_bias(REFS["rel2d_cpb"][0](a.pos, (7, 5)), 3, 7, 5, 1)
    torch.testing.assert_close(a.bias((7, 5)), ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpb_table_under_autocast_is_the_float32_table(dtype):
    # the MLP, its sigmoid and the table's gather run in the weights' dtype with autocast off: under autocast the
    # bias, its offset table and its table are those of float32, bit for bit
    s = build_pos("rel2d_cpb", num_heads=3, head_dim=8, grid=(6, 6), num_prefix_tokens=1)
    g = Grid(7, 5)
    want = (s.bias(g, 1), s.offset_table(g), s.table(g))
    with torch.autocast("cpu", dtype=dtype):
        got = (s.bias(g, 1), s.offset_table(g), s.table(g))
    for a, b in zip(got, want, strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_cpb_mlp_gradients_under_autocast_are_those_of_float32_mlp():
    """Under fp16 autocast at a 14 x 14 grid the MLP's gradients are about as close to float64 as the attention's
    own (q, k, v gradients: 1.5e-3; MLP: 2.1e-3 to 2.6e-3); with the MLP under autocast its first layer's were 1.9e-2
    and 3.2e-2: its inputs (the log-spaced offsets) and the per-offset gradients rounded to fp16 before the sum over
    the offsets, which cancels (the offsets are symmetric)."""
    grid = (14, 14)
    torch.manual_seed(0)
    a = Attention(48, 3, pos="rel2d_cpb", grid=grid, num_prefix_tokens=1, hidden_dim=64)
    for n, err in autocast_param_errors(a, grid).items():
        assert err < 5e-3, (n, err)


@pytest.mark.parametrize("hidden_dim", [0, -4])
def test_cpb_without_hidden_units_is_refused(hidden_dim):
    # an MLP of no hidden units gives 16 sigmoid(0) = 8 for every offset: no position at all, trained silently
    with pytest.raises(ValueError, match=rf"rel2d_cpb: hidden_dim must be a positive integer, got {hidden_dim}"):
        build_pos({"name": "rel2d_cpb", "hidden_dim": hidden_dim}, num_heads=2, head_dim=8, grid=(3, 3))


@pytest.mark.parametrize("n", [7, 200])
def test_rel1d_bucket_under_causal_attention_uses_t5_one_directional_buckets(n):
    """Beyond max_distance too (n = 200 > 128): the bias equals T5's decoder mapping, and the output
    equals the dense reference with the causal mask."""
    from tests.reference import t5_bucket_causal_scalar

    torch.manual_seed(0)
    a = Attention(16, 2, pos="rel1d_bucket", grid=(1, n), causal=True).double()
    assert a.pos.causal
    with torch.no_grad():
        a.pos.table.normal_(0, 0.5)
    t = a.pos.table
    want = torch.tensor(
        [
            [[t[t5_bucket_causal_scalar(j - i, 32, 128), h].item() for j in range(n)] for i in range(n)]
            for h in range(2)
        ],
        dtype=torch.float64,
    )
    past = torch.ones(n, n, dtype=torch.bool).tril()
    torch.testing.assert_close(a.bias((1, n))[:, past], want[:, past])
    x = torch.randn(2, n, 16, dtype=torch.float64)
    mask = torch.zeros(n, n, dtype=torch.float64).masked_fill(~past, float("-inf"))
    _, ref = reference_attention(a, x, want, mask)
    torch.testing.assert_close(a(x, (1, n)), ref)
    if n == 200:  # every bucket serves the past (bidirectional buckets would leave half unused)
        assert len({t5_bucket_causal_scalar(-d, 32, 128) for d in range(n)}) == 32
    # the bidirectional scheme in a causal layer would differ: a clear error instead of a silent mix
    with pytest.raises(ValueError, match="built with causal=False"):
        Attention(16, 2, pos=build_pos("rel1d_bucket", num_heads=2, head_dim=8, grid=(1, n)), grid=(1, n), causal=True)


def test_cpb_cr_drops_hidden_features_in_training_only():
    """``mode: cr``'s dropout on the MLP's hidden features (timm's 0.125): a new table each training forward, the
    reference's in evaluation."""
    a = _make("rel2d_cpb:cr", (4, 4), 1, mlp_drop=0.5)
    ref = dense_bias(REFS["rel2d_cpb:cr"][0](a.pos, (4, 4)), 3, 4, 4, 1)
    torch.testing.assert_close(a.eval().bias((4, 4)), ref, rtol=1e-10, atol=1e-10)
    a.train()
    assert (a.bias((4, 4)) - a.bias((4, 4))).abs().max() > 1e-3
    assert build_pos("rel2d_cpb", num_heads=2, head_dim=8, grid=(3, 3), mode="cr").mlp_drop == 0.125
    with pytest.raises(ValueError, match="mode must be 'swin'"):
        build_pos("rel2d_cpb", num_heads=2, head_dim=8, grid=(3, 3), mode="CR")
