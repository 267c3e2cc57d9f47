"""timm's ``VisionTransformer.forward(x, attn_mask=None, is_causal=False)`` (and ``forward_features``,
``forward_intermediates``): the mask, with SDPA's semantics (bool True = attend, or additive float, broadcast to
``[B, heads, N, N]``), is added to every block's logits together with the position scheme's bias, against a float64
dense reference written from the equations."""

from __future__ import annotations

import pytest
import torch

import vitrel
from tests.reference import scheme_qkv

ARGS = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)  # 4 x 4 grid, N = 17
B, N = 2, 17


def _model(pos: str = "rel2d_full", **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    m = vitrel.create_model("vitrel_vit_tiny_patch4_32", pos=pos, **{**ARGS, **kw}).double().eval()
    with torch.no_grad():  # non-trivial weights everywhere (tables, tokens)
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return m


def _images() -> torch.Tensor:
    return torch.randn(B, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _additive(mask: torch.Tensor | None) -> torch.Tensor | None:
    if mask is None or mask.is_floating_point():
        return mask
    return torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, float("-inf"))


def reference_features(m: torch.nn.Module, images: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``forward_features`` from the equations: each block's ``A = q k^T / sqrt(d) + bias + mask`` (``q, k`` rotated
    by a RoPE scheme), ``softmax(A) v``, projected; pre-norm residual blocks, the final norm."""
    x, grid = m.embed(images)
    for blk in m.blocks:
        a = blk.attn
        h = blk.norm1(x)
        q, k, v = scheme_qkv(a, h, grid)
        logits = torch.einsum("bhid,bhjd->bhij", q, k) / a.head_dim**0.5
        bias = a.bias(grid)
        if bias is not None:
            logits = logits + bias
        if mask is not None:
            logits = logits + _additive(mask)
        out = torch.einsum("bhij,bhjd->bhid", logits.softmax(-1), v).transpose(1, 2).reshape(x.shape)
        x = x + blk.ls1(a.proj(out))
        x = x + blk.ls2(blk.mlp(blk.norm2(x)))
    return m.norm(x)


def _masks() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    eye = torch.eye(N, dtype=torch.bool)  # (every query keeps a key: no row closed)
    floats = 2 * torch.randn(B, 1, N, N, generator=g, dtype=torch.float64)
    floats = floats.masked_fill((torch.rand(B, 1, N, N, generator=g) < 0.3) & ~eye, float("-inf"))
    keys = torch.rand(B, N, generator=g) < 0.7
    keys[:, 0] = True
    return {
        "float": floats,
        "bool_NN": (torch.rand(N, N, generator=g) < 0.6) | eye,
        "bool_BHNN": (torch.rand(B, 2, N, N, generator=g) < 0.6) | eye,
        "bool_heads_HNN": (torch.rand(2, N, N, generator=g) < 0.6) | eye,  # 3-D: [heads, N, N], SDPA's broadcast
        "key_padding": keys[:, None, None, :],
    }


@pytest.mark.parametrize("pos, impl", [("rel2d_full", "auto"), ("rel2d_full", "eager"), ("rope2d_axial", "auto"),
                                       ("ape", "auto")])  # fmt: skip
@pytest.mark.parametrize("kind", list(_masks()))
def test_attn_mask_adds_to_the_logits_with_the_bias(pos, impl, kind):
    m, x = _model(pos, attn_impl=impl), _images()
    mask = _masks()[kind]
    with torch.no_grad():
        want = reference_features(m, x, mask)
        torch.testing.assert_close(m.forward_features(x, attn_mask=mask), want, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(m(x, attn_mask=mask), m.forward_head(want), rtol=1e-9, atol=1e-9)
        assert not torch.allclose(want, m.forward_features(x), atol=1e-6)  # (the mask changed the answer)


@pytest.mark.parametrize("pos", ["rel2d_full", "rope2d_axial"])
def test_a_fully_true_mask_is_no_mask_and_is_causal_is_the_lower_triangle(pos):
    m, x = _model(pos), _images()
    with torch.no_grad():
        plain = m.forward_features(x)
        torch.testing.assert_close(plain, reference_features(m, x, None), rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(m.forward_features(x, attn_mask=torch.ones(N, N, dtype=torch.bool)), plain)
        torch.testing.assert_close(m.forward_features(x, attn_mask=torch.zeros(1, 1, N, N)), plain)
        causal = reference_features(m, x, torch.ones(N, N, dtype=torch.bool).tril())
        torch.testing.assert_close(m.forward_features(x, is_causal=True), causal, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(m(x, is_causal=True), m.forward_head(causal), rtol=1e-9, atol=1e-9)


def test_attn_mask_in_forward_intermediates_and_under_gradient_checkpointing():
    m, x = _model(), _images()
    mask = _masks()["float"]
    want = reference_features(m, x, mask)
    with torch.no_grad():
        final, feats = m.forward_intermediates(x, attn_mask=mask, output_fmt="NLC")
    torch.testing.assert_close(final, want, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(m.norm(feats[-1]), want[:, 1:], rtol=1e-9, atol=1e-9)
    m.train().set_grad_checkpointing(True)  # (no dropout: training computes the same function)
    out = m.forward_features(x, attn_mask=mask)
    out.sum().backward()
    torch.testing.assert_close(out.detach(), want, rtol=1e-9, atol=1e-9)


def test_bad_masks_are_one_error_naming_the_fix():
    m, x = _model(), _images()
    with pytest.raises(ValueError, match=r"does not broadcast to \[B, heads, N, N\] = \[2, 2, 17, 17\].*\[B, N\]"):
        m(x, attn_mask=torch.ones(B, N, dtype=torch.bool))  # a key padding mask given as [B, N]
    with pytest.raises(ValueError, match=r"pass one, e.g. attn_mask & torch.ones\(17, 17"):
        m(x, attn_mask=torch.ones(N, N, dtype=torch.bool), is_causal=True)
    with pytest.raises(ValueError, match="bool .* or float .* got torch.int64"):
        m(x, attn_mask=torch.ones(N, N, dtype=torch.long))
    with pytest.raises(ValueError, match="take a batch of images.*list of images"):
        m([x[0], x[1, :, :24]], attn_mask=torch.ones(N, N, dtype=torch.bool))
    tri = vitrel.create_model("vitrel_vit_tiny_patch4_32", pos="rel2d_full", attn_impl="triton", **ARGS).eval()
    with pytest.raises(ValueError, match=r"attn_impl='triton' takes a mask shared by the heads.*'sdpa' or 'auto'"):
        tri(x.float(), attn_mask=_masks()["bool_BHNN"])  # (a kernel that cannot take the mask names those that can)


def test_attn_mask_through_timms_torch_fx_trace():
    """timm's fx feature extraction (``feature_cls="fx"``, ``test_model_backward_fx``) traces ``forward``, whose
    ``attn_mask`` / ``is_causal`` are then graph inputs: the traced model takes them as the model does."""
    from timm.layers import get_notrace_functions, get_notrace_modules
    from torchvision.models.feature_extraction import create_feature_extractor, get_graph_node_names

    m, x = _model(), _images()
    kw = dict(leaf_modules=get_notrace_modules(), autowrap_functions=get_notrace_functions())
    fx = create_feature_extractor(m, return_nodes=[get_graph_node_names(m, tracer_kwargs=kw)[1][-1]], tracer_kwargs=kw)
    mask = _masks()["bool_NN"]
    with torch.no_grad():
        for call in (dict(attn_mask=mask), dict(is_causal=True), dict()):
            (got,) = fx(x, **call).values()
            torch.testing.assert_close(got, m(x, **call), rtol=0, atol=0)
