"""``pos=gpsa``: ConViT's gated positional self-attention against a loop reference from its equation and against
ConViT's ``GPSA`` (the authors' released code, in timm), its init, its kernels, and its masks."""

from __future__ import annotations

import math

import pytest
import timm
import torch
from timm.models.convit import GPSA

import vitrel
import vitrel.viz
from tests.reference import scheme_qkv
from vitrel import Attention
from vitrel.kernels import get_kernel
from vitrel.layout.geometry import Grid
from vitrel.pos import build_pos
from vitrel.pos.schemes.gpsa import Gpsa

DIM, HEADS = 24, 4


def layer(grid=(3, 4), prefix: int = 0, heads: int = HEADS, **kw) -> Attention:
    torch.manual_seed(0)
    a = Attention(DIM, heads, pos={"name": "gpsa", **kw}, grid=grid, num_prefix_tokens=prefix).double()
    with torch.no_grad():
        a.pos.pos_proj.add_(0.3 * torch.randn_like(a.pos.pos_proj))
        a.pos.gating.normal_()  # (every head its own gate)
    return a


def naive(a: Attention, x: torch.Tensor, grid: Grid, prefix: int, mask=None) -> torch.Tensor:
    """The module docstring's equation with loops over heads, queries and keys: ``(1 - s_h) softmax(q k / sqrt(d))
    + s_h softmax_j(w_h . (c_j - c_i, r_j - r_i, dr^2 + dc^2))`` for patch queries (over patch keys), the content
    softmax alone for prefix queries; ``mask [B, N, N]`` (0 / -inf) in both."""
    b, n, _ = x.shape
    d = DIM // a.num_heads
    q, k, v = (x @ a.qkv.weight.t() + a.qkv.bias).reshape(b, n, 3, a.num_heads, d).permute(2, 0, 3, 1, 4)
    pts = [None] * prefix + [divmod(i, grid.w) for i in range(grid.n)]
    w, s = a.pos.pos_proj, torch.sigmoid(a.pos.gating)
    out = torch.zeros(b, a.num_heads, n, d, dtype=x.dtype)
    for bi in range(b):
        for h in range(a.num_heads):
            for i in range(n):
                m = torch.zeros(n, dtype=x.dtype) if mask is None else mask[bi, i]
                content = torch.softmax(q[bi, h, i] @ k[bi, h].t() / math.sqrt(d) + m, -1)
                if pts[i] is None:
                    attn = content
                else:
                    logits = []
                    for j in range(n):
                        if pts[j] is None:
                            logits.append(torch.tensor(float("-inf"), dtype=x.dtype))
                            continue
                        dr, dc = pts[j][0] - pts[i][0], pts[j][1] - pts[i][1]
                        logits.append(w[h, 0] * dc + w[h, 1] * dr + w[h, 2] * (dr * dr + dc * dc))
                    pos = torch.softmax(torch.stack(logits) + m, -1)
                    attn = (1 - s[h]) * content + s[h] * pos
                out[bi, h, i] = attn @ v[bi, h]
    return out.transpose(1, 2).reshape(b, n, DIM) @ a.proj.weight.t() + a.proj.bias


@pytest.mark.parametrize("prefix", [0, 1])
@pytest.mark.parametrize("grid", [Grid(3, 4), Grid(2, 2)])
def test_equals_the_equation_forward_and_gradients(grid, prefix):
    a = layer(grid, prefix)
    x = torch.randn(2, prefix + grid.n, DIM, dtype=torch.float64, requires_grad=True)
    got, want = a(x, grid), naive(a, x, grid, prefix)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    params = (x, a.pos.pos_proj, a.pos.gating, a.qkv.weight)
    gw = torch.randn_like(got)
    for g1, g2 in zip(torch.autograd.grad((got * gw).sum(), params), torch.autograd.grad((want * gw).sum(), params)):
        torch.testing.assert_close(g1, g2, rtol=1e-10, atol=1e-12)


def test_a_mask_closes_keys_in_both_softmaxes():
    grid = Grid(3, 3)
    a = layer(grid, 1)
    x = torch.randn(2, 10, DIM, dtype=torch.float64)
    mask = torch.zeros(2, 10, 10, dtype=torch.float64)
    mask[0, :, [2, 5]] = float("-inf")
    mask[1, :, 7] = float("-inf")
    got = a(x, grid, mask=mask[:, None])
    torch.testing.assert_close(got, naive(a, x, grid, 1, mask), rtol=0, atol=1e-12)
    weights = a.attention_map(x, grid, mask=mask[:, None])  # the weights of the values, mixture included
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, HEADS, 10, dtype=torch.float64), rtol=0, atol=1e-12)
    assert not weights[0, :, :, [2, 5]].any() and not weights[1, :, :, 7].any()


def test_attention_map_is_the_weights_of_the_values():
    """``Attention.attention_map`` returns the mixture, what weighs the values, not the content softmax alone."""
    grid = Grid(3, 4)
    a = layer(grid, 1)
    x = torch.randn(2, 13, DIM, dtype=torch.float64)
    v = scheme_qkv(a, x, grid)[2]
    out = (a.attention_map(x, grid) @ v).transpose(1, 2).reshape(2, 13, DIM) @ a.proj.weight.t() + a.proj.bias
    torch.testing.assert_close(out, a(x, grid), rtol=0, atol=1e-12)


def test_equals_convit_gpsa_the_authors_released_code():
    """ConViT's ``GPSA`` (facebookresearch/convit, as timm's ``convit.py``) with the same weights, on its square grid
    without a class token (where ConViT runs it); its ``pos_proj`` bias, which the softmax cancels, random."""
    grid = Grid(4, 4)
    a = layer(grid, 0)
    theirs = GPSA(DIM, HEADS, qkv_bias=True).double()
    with torch.no_grad():
        theirs.qk.weight.copy_(a.qkv.weight[: 2 * DIM])
        theirs.qk.bias.copy_(a.qkv.bias[: 2 * DIM])
        theirs.v.weight.copy_(a.qkv.weight[2 * DIM :])
        theirs.v.bias.copy_(a.qkv.bias[2 * DIM :])
        theirs.proj.load_state_dict(a.proj.state_dict())
        theirs.pos_proj.weight.copy_(a.pos.pos_proj)
        theirs.pos_proj.bias.normal_()
        theirs.gating_param.copy_(a.pos.gating)
    x = torch.randn(3, 16, DIM, dtype=torch.float64)
    torch.testing.assert_close(a(x, grid), theirs(x), rtol=0, atol=1e-12)


@pytest.mark.parametrize(("heads", "strength"), [(4, 1.0), (9, 0.5), (6, 2.0)])
def test_local_init_is_convit(heads, strength):
    """ConViT's ``local_init`` (timm's ``GPSA.local_init``) on the first ``k^2`` heads; the other heads' rows keep
    their trunc-normal(0.02) draw, scaled by the locality strength as theirs; the gates start at 1."""
    torch.manual_seed(0)  # (the class itself: build_pos draws from the scheme's own stream)
    s = Gpsa(num_heads=heads, head_dim=4, grid=Grid(4, 4), locality_strength=strength)
    theirs = GPSA(heads * 4, heads, locality_strength=strength)
    theirs.local_init()
    k = int(math.sqrt(heads))
    torch.testing.assert_close(s.pos_proj[: k * k], theirs.pos_proj.weight[: k * k], rtol=0, atol=0)
    torch.manual_seed(0)
    draw = torch.nn.init.trunc_normal_(torch.empty(heads, 3), std=0.02)
    torch.testing.assert_close(s.pos_proj[k * k :], draw[k * k :] * strength, rtol=0, atol=0)
    assert torch.equal(s.gating, torch.ones(heads))
    torch.manual_seed(0)
    off = Gpsa(num_heads=heads, head_dim=4, grid=Grid(4, 4), local_init=False)
    torch.testing.assert_close(off.pos_proj, draw, rtol=0, atol=0)


def test_local_init_attends_to_the_offsets_of_a_convolution():
    """With a strong locality, each of 9 heads' positional attention peaks at its own offset of a 3 x 3 kernel."""
    grid = Grid(5, 5)
    s = build_pos("gpsa", num_heads=9, head_dim=4, grid=grid, locality_strength=10.0).double()
    p = s.positional_attention(None, s.prepare(grid), torch.float64)  # [heads, N, N]
    centre = 2 * 5 + 2
    peaks = {divmod(int(p[h, centre].argmax()), 5) for h in range(9)}
    assert peaks == {(2 + dr, 2 + dc) for dr in (-1, 0, 1) for dc in (-1, 0, 1)}
    assert p[:, centre].max(-1).values.min() > 0.99


def test_only_the_eager_kernel_runs_it_and_auto_picks_it():
    s = build_pos("gpsa", num_heads=2, head_dim=4, grid=(3, 3))
    for impl in ("sdpa", "fold", "flex", "triton"):
        why = get_kernel(impl).refuses(s)
        assert why is not None and "attn_impl='eager'" in why, impl
    a = Attention(8, 2, pos="gpsa", grid=(3, 3))
    assert a.choose_kernel(a.pos, 9, torch.device("cpu"), torch.float32).name == "eager"
    with pytest.raises(ValueError, match="mixes the attention weights"):
        Attention(8, 2, pos="gpsa", grid=(3, 3), attn_impl="sdpa")


def test_position_matrix_refuses_it_in_one_line():
    """No term of its own in the logits (its positional attention is a second softmax): a picture of one is refused."""
    with pytest.raises(ValueError, match="gpsa's position encoding mixes its own attention in after softmax"):
        vitrel.viz.position_matrix(build_pos("gpsa", num_heads=2, head_dim=4, grid=(3, 3)))


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), True])
def test_refuses_a_locality_strength_that_is_not_positive(bad):
    with pytest.raises(ValueError, match="locality_strength"):
        build_pos("gpsa", num_heads=2, head_dim=4, grid=(3, 3), locality_strength=bad)


def test_vit_with_convit_options_trains_and_dropout_goes_after_the_mixture():
    """ConViT's configuration, an ``ape`` beside it (``abs_pos``), trains; attention dropout drops the mixed
    weights (at rate 1 no value passes)."""
    torch.manual_seed(0)
    m = vitrel.create_model(
        "vitrel_vit_tiny_patch4_32", pos="gpsa", abs_pos="ape", img_size=16, num_classes=3, embed_dim=16,
        num_heads=4, depth=2, global_pool="avg",
    )  # fmt: skip
    x = torch.randn(2, 3, 16, 16)
    m(x).sum().backward()
    assert all(b.attn.pos.gating.grad.abs().sum() > 0 for b in m.blocks)
    a = layer((3, 3), 0)
    a.attn_drop = 1.0
    a.train()
    out = a(torch.randn(1, 9, DIM, dtype=torch.float64), (3, 3))
    torch.testing.assert_close(out, a.proj.bias.expand_as(out), rtol=0, atol=0)


def test_local_init_makes_the_value_projection_the_identity_as_convits():
    """ConViT's ``local_init`` also sets each GPSA layer's value projection to the identity (timm's ``ConVit`` as
    built); vitrel's models do it over timm's ViT init, for a layer's own scheme, a shared one and a Swin's, and keep it
    through ``init_weights()``; ``local_init=False`` leaves timm's values, and the other blocks are untouched."""
    t = timm.create_model("convit_tiny", img_size=64, embed_dim=16, num_heads=4, depth=3, local_up_to_layer=2)
    assert all(torch.equal(blk.attn.v.weight, torch.eye(64)) for blk in t.blocks[:2])
    eye = torch.eye(64)
    args = dict(img_size=64, embed_dim=64, num_heads=4, depth=3, pos_depth=2)
    for kw in ({}, {"pos_share": True}):
        m = vitrel.create_model("vitrel_vit_tiny_patch16_224", pos="gpsa", **args, **kw)
        for again in (False, True):
            if again:
                m.init_weights()
            assert [torch.equal(blk.attn.qkv.weight[128:], eye) for blk in m.blocks] == [True, True, False]
            assert not torch.equal(m.blocks[0].attn.qkv.weight[:64], eye)
            assert not m.blocks[0].attn.qkv.bias[128:].any()
    plain = vitrel.create_model("vitrel_vit_tiny_patch16_224", pos={"name": "gpsa", "local_init": False}, **args)
    assert not torch.equal(plain.blocks[0].attn.qkv.weight[128:], eye)
    assert torch.equal(vitrel.Attention(64, 4, pos="gpsa", grid=(4, 4)).qkv.weight[128:], eye)
    swin = vitrel.create_model(
        "vitrel_swin_tiny_patch2_window4_32", pos="gpsa", embed_dim=16, depths=[1, 1], num_heads=[2, 2]
    )
    layers = [a for a in swin.modules() if isinstance(a, Attention)]
    assert len(layers) == 2 and all(torch.equal(a.qkv.weight[2 * a.dim :], torch.eye(a.dim)) for a in layers)
