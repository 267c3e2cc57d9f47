"""Grouped-query attention (``num_kv_heads``): each key / value head serves ``num_heads / num_kv_heads`` query heads in
turn, against a float64 loop reference written from the equation (forward and gradients) and timm's ``AttentionRope``
(sapiens2's attention)."""

from __future__ import annotations

import math

import pytest
import timm
import torch

import vitrel
from vitrel.layers import Attention

GRID = (3, 4)


def _layer(pos: str, kv: int, impl: str = "sdpa") -> Attention:
    torch.manual_seed(0)
    a = Attention(32, 4, pos=pos, grid=GRID, num_prefix_tokens=1, num_kv_heads=kv, attn_impl=impl).double()
    with torch.no_grad():
        for p in a.parameters():
            p.normal_(0, 0.3)
    return a


def reference(a: Attention, x: torch.Tensor) -> torch.Tensor:
    """``q_h = x W_q^h``, ``k_g, v_g`` likewise for the ``G`` key heads; head ``h`` attends with key head
    ``g = h // (H / G)``: ``softmax(q_h k_g^T / sqrt(d) + bias_h) v_g``, the heads joined, then ``proj``. RoPE rotates
    ``q_h`` and head ``h``'s copy of ``k_g`` with head ``h``'s angles (the scheme's ``rotate`` on those copies)."""
    b, n, c = x.shape
    heads, kv, d = a.num_heads, a.num_kv_heads, a.head_dim
    y = x @ a.qkv.weight.T + a.qkv.bias
    q = y[..., :c].reshape(b, n, heads, d).transpose(1, 2)
    k = y[..., c : c + kv * d].reshape(b, n, kv, d).transpose(1, 2)
    v = y[..., c + kv * d :].reshape(b, n, kv, d).transpose(1, 2)
    group = heads // kv
    k = torch.stack([k[:, h // group] for h in range(heads)], 1)  # (head h's copy of its key head)
    v = torch.stack([v[:, h // group] for h in range(heads)], 1)
    state = a.pos.prepare(GRID, 1, x.device, x.dtype)
    q, k = a.pos.rotate(q, k, state)
    bias = a.bias(GRID)  # (None: no additive term)
    bias = torch.zeros(heads, n, n, dtype=x.dtype) if bias is None else bias
    out = torch.zeros(b, heads, n, d, dtype=x.dtype)
    for h in range(heads):
        logits = q[:, h] @ k[:, h].transpose(-1, -2) / math.sqrt(d) + bias[h]
        out[:, h] = torch.softmax(logits, -1) @ v[:, h]
    return out.transpose(1, 2).reshape(b, n, c) @ a.proj.weight.T + a.proj.bias


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("pos", ["none", "rel2d_full", "alibi2d", "rope2d_mixed", "rope2d_axial"])
@pytest.mark.parametrize("kv", [1, 2])
def test_equals_the_loop_reference_forward_and_gradients(pos, kv, impl):
    a = _layer(pos, kv, impl)
    assert a.qkv.out_features == 32 + 2 * kv * 8
    x = torch.randn(2, 1 + 12, 32, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 13, 32, dtype=torch.float64)
    ours, ref = a(x), reference(a, x)
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-10)
    params = [x, a.qkv.weight, *[p for p in a.pos.parameters()]]
    for got, want in zip(torch.autograd.grad((ours * g).sum(), params), torch.autograd.grad((ref * g).sum(), params)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_equals_timms_attention_rope():
    """timm's ``AttentionRope(num_kv_heads=...)`` (separate q / k / v projections, joined into ``qkv``)."""
    a = _layer("none", 2)
    t = timm.layers.AttentionRope(32, 4, num_kv_heads=2, qkv_fused=False).double()
    with torch.no_grad():
        w, bias = a.qkv.weight.split((32, 16, 16)), a.qkv.bias.split((32, 16, 16))
        for proj, wi, bi in zip((t.q_proj, t.k_proj, t.v_proj), w, bias):
            proj.weight.copy_(wi)
            proj.bias.copy_(bi)
        t.proj.load_state_dict(a.proj.state_dict())
    x = torch.randn(2, 13, 32, dtype=torch.float64)
    torch.testing.assert_close(a(x), t(x), rtol=1e-10, atol=1e-10)


def test_models_take_one_or_one_per_block_and_refuse_what_does_not_divide():
    m = vitrel.create_model("vitrel_vit_tiny_patch4_32", embed_dim=32, depth=3, num_heads=4, num_kv_heads=[4, 2, 1])
    assert [b.attn.num_kv_heads for b in m.blocks] == [4, 2, 1]
    assert m(torch.randn(1, 3, 32, 32)).shape == (1, m.num_classes)
    with pytest.raises(ValueError, match="num_heads 4 is not divisible by num_kv_heads 3"):
        vitrel.create_model("vitrel_vit_tiny_patch4_32", embed_dim=32, depth=2, num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="num_kv_heads lists 2 values, one per block of depth 3"):
        vitrel.create_model("vitrel_vit_tiny_patch4_32", embed_dim=32, depth=3, num_heads=4, num_kv_heads=[4, 2])
    with pytest.raises(ValueError, match="gpsa's local init makes v the identity"):
        vitrel.create_model("vitrel_vit_tiny_patch4_32", embed_dim=32, depth=2, num_heads=4, num_kv_heads=2, pos="gpsa")


def test_attn_only_layer_scale_scales_the_attention_branch_alone():
    m = vitrel.create_model("vitrel_vit_tiny_patch4_32", init_values=0.1, attn_only_layer_scale=True)
    assert isinstance(m.blocks[0].ls1, timm.layers.LayerScale) and isinstance(m.blocks[0].ls2, torch.nn.Identity)
