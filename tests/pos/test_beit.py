"""``pos=rel2d_beit``: BEiT's relative bias against a loop reference from its equation (forward and gradients) and
against BEiT's attention (the authors' microsoft/unilm code as timm's ``beit.py`` ports it), its kernels, its sizes."""

from __future__ import annotations

import pytest
import torch
from timm.models.beit import Attention as BeitAttention

from tests.reference import reference_attention
from vitrel import Attention
from vitrel.kernels import get_kernel, resolve
from vitrel.pos import build_pos

DIM, HEADS = 24, 3


def layer(grid=(3, 4), prefix: int = 1, build_grid=None, **kw) -> Attention:
    torch.manual_seed(0)
    a = Attention(DIM, HEADS, pos={"name": "rel2d_beit", **kw}, grid=build_grid or grid, num_prefix_tokens=prefix)
    a = a.double()
    with torch.no_grad():  # (every entry its own value: an index bug shows)
        for p in a.pos.parameters():
            p.normal_(0, 0.5)
    return a


def naive_bias(a: Attention, grid: tuple[int, int], prefix: int) -> torch.Tensor:
    """The equation with loops, differentiable in the scheme's parameters: ``T[dh + Ht - 1, dw + Wt - 1]`` between
    patches (offsets clamped to the built table's ``Ht x Wt`` reach), ``c[0]`` prefix -> patch, ``c[1]`` patch ->
    prefix, ``c[2]`` prefix -> prefix."""
    t, c = a.pos.table, a.pos.prefix_terms
    half_h, half_w = (t.shape[0] - 1) // 2, (t.shape[1] - 1) // 2
    pts = [None] * prefix + [divmod(i, grid[1]) for i in range(grid[0] * grid[1])]
    rows = []
    for h in range(HEADS):
        for pi in pts:
            for pj in pts:
                if pi is None:
                    rows.append(c[2, h] if pj is None else c[0, h])
                elif pj is None:
                    rows.append(c[1, h])
                else:
                    dh = max(-half_h, min(half_h, pi[0] - pj[0]))
                    dw = max(-half_w, min(half_w, pi[1] - pj[1]))
                    rows.append(t[dh + half_h, dw + half_w, h])
    n = len(pts)
    return torch.stack(rows).view(HEADS, n, n)


@pytest.mark.parametrize("grid, build, prefix", [((3, 4), None, 1), ((4, 4), None, 2), ((5, 6), (3, 4), 1)])
def test_forward_and_gradients_equal_the_equation(grid, build, prefix):
    """Output and the gradients of the tokens, the table and the prefix terms, float64, against the loop reference
    (the table's reach clamped on a grid larger than it was built for; two prefix tokens share the terms)."""
    a = layer(grid, prefix, build)
    n = prefix + grid[0] * grid[1]
    x = torch.randn(2, n, DIM, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, n, DIM, dtype=torch.float64)
    params = [x, a.pos.table, a.pos.prefix_terms]
    out = a(x, grid)
    got = torch.autograd.grad(out, params, g)
    _, ref = reference_attention(a, x, naive_bias(a, grid, prefix))
    want = torch.autograd.grad(ref, params, g)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for name, u, v in zip(("x", "table", "prefix_terms"), got, want):
        torch.testing.assert_close(u, v, rtol=1e-10, atol=1e-12, msg=name)
    assert a.pos.prefix_terms.grad is None and got[2].abs().min() > 0  # (each term reached)


def _timm_pair(window=(3, 4)) -> tuple[BeitAttention, Attention]:
    torch.manual_seed(2)
    t = BeitAttention(DIM, HEADS, qkv_bias=True, window_size=window).double()
    with torch.no_grad():
        for p in t.parameters():
            p.normal_(0, 0.3)
    ours = Attention(DIM, HEADS, pos="rel2d_beit", grid=window, num_prefix_tokens=1, qkv_bias=True).double()
    flat = t.relative_position_bias_table
    with torch.no_grad():
        ours.qkv.weight.copy_(t.qkv.weight)
        ours.qkv.bias.copy_(torch.cat([t.q_bias, t.k_bias, t.v_bias]))
        ours.proj.load_state_dict(t.proj.state_dict())
        ours.pos.table.copy_(flat[:-3].view(2 * window[0] - 1, 2 * window[1] - 1, HEADS))
        ours.pos.prefix_terms.copy_(flat[-3:])
    return t, ours


def test_equals_beits_attention():
    """timm's BEiT ``Attention`` (the authors' ``relative_position_index``: patches, then cls -> token, token -> cls,
    cls -> cls as the flat table's last three rows), float64: output and the table's gradient."""
    t, ours = _timm_pair()
    x = torch.randn(2, 13, DIM, dtype=torch.float64)
    want, got = t(x), ours(x, (3, 4))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(want)
    (gt,) = torch.autograd.grad(want, t.relative_position_bias_table, g)
    ga, gc = torch.autograd.grad(got, [ours.pos.table, ours.pos.prefix_terms], g)
    torch.testing.assert_close(torch.cat([ga.reshape(-1, HEADS), gc]), gt, rtol=1e-10, atol=1e-12)


def test_without_prefix_tokens_it_is_rel2d_full():
    """Built without prefix tokens (a Swin, ``class_token=False``) the scheme has no terms and its bias is
    ``rel2d_full``'s; called with prefix tokens, their pairs are zero (as every scheme built without them)."""
    a = build_pos("rel2d_beit", num_heads=HEADS, head_dim=8, grid=(3, 4))
    full = build_pos("rel2d_full", num_heads=HEADS, head_dim=8, grid=(3, 4))
    assert a.prefix_terms is None and set(dict(a.named_parameters())) == {"table"}
    full.load_state_dict(a.state_dict())
    for p in (0, 1):
        torch.testing.assert_close(a.bias((3, 4), p), full.bias((3, 4), p), rtol=0, atol=0)


def test_kernels():
    """``auto`` takes sdpa (a dense bias); flex and triton, which read a bias by offset, refuse it naming sdpa;
    eager and sdpa agree."""
    a = layer()
    s = a.pos
    assert resolve("auto", s, 13, None).name == "sdpa"
    for impl in ("flex", "triton"):
        why = get_kernel(impl).refuses(s)
        assert why is not None and "rel2d_beit" in why and "sdpa" in why
    x = torch.randn(2, 13, DIM, dtype=torch.float64)
    eager = Attention(DIM, HEADS, pos="rel2d_beit", grid=(3, 4), num_prefix_tokens=1, attn_impl="eager").double()
    eager.load_state_dict(a.state_dict())
    torch.testing.assert_close(eager(x, (3, 4)), a(x, (3, 4)), rtol=1e-12, atol=1e-12)


def test_prefix_terms_get_no_weight_decay_and_the_table_resizes_on_load():
    import vitrel

    m = vitrel.create_model("vitrel_vit_tiny_patch4_32", pos="rel2d_beit", embed_dim=24, depth=1, num_heads=HEADS)
    assert {"blocks.0.attn.pos.table", "blocks.0.attn.pos.prefix_terms"} <= set(m.no_weight_decay())
    big = vitrel.create_model(
        "vitrel_vit_tiny_patch4_32", pos="rel2d_beit", embed_dim=24, depth=1, num_heads=HEADS, img_size=48
    )
    with pytest.warns(UserWarning, match="rel2d_beit"):
        big.load_state_dict(m.state_dict())
    small, grown = m.blocks[0].attn.pos, big.blocks[0].attn.pos
    torch.testing.assert_close(grown.prefix_terms, small.prefix_terms)
    assert grown.table.shape[:2] == (23, 23)  # (8 x 8 patches -> 12 x 12: every offset it had keeps its value)
    torch.testing.assert_close(grown.table[4:19, 4:19], small.table)
