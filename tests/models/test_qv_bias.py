"""``qkv_bias="qv"``: a query and a value bias, none on the key, as timm builds BEiT, EVA (EVA-02, DINOv3's ``qkvb``)
and Swin V2 (``q_bias`` and ``v_bias`` learned, ``k_bias`` a zero buffer). Checked against the equation in float64,
and through ``from_timm``: fine-tuning the imported model learns what timm's learns."""

from __future__ import annotations

import math

import pytest
import timm
import torch

import vitrel
from tests.weights import lively
from vitrel import Attention
from vitrel.models import save_pretrained

D, HEADS, N = 16, 2, 5


def _x(seed: int = 0, shape: tuple[int, ...] = (2, N, D)) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def test_qv_attention_is_the_equation_forward_and_gradients():
    """``softmax((x Wq + bq)(x Wk)^T / sqrt(d)) (x Wv + bv) Wo + bo`` per head, written out in float64; the layer
    holds ``q_bias`` and ``v_bias``, no key bias to learn or save."""
    torch.manual_seed(0)
    a = Attention(D, HEADS, qkv_bias="qv").double()
    with torch.no_grad():
        for p in (a.q_bias, a.v_bias):
            p.normal_()
    assert {n for n, _ in a.named_parameters()} == {"qkv.weight", "q_bias", "v_bias", "proj.weight", "proj.bias"}
    assert "k_bias" not in a.state_dict() and a.qkv.bias is None
    x = _x().requires_grad_()
    out = a(x, grid=(1, N))
    g = _x(1)
    (out * g).sum().backward()

    x2 = x.detach().clone().requires_grad_()
    w = a.qkv.weight.detach().clone().requires_grad_()
    bq, bv = (p.detach().clone().requires_grad_() for p in (a.q_bias, a.v_bias))
    d = D // HEADS
    ref = torch.zeros(2, N, D, dtype=torch.float64)
    heads = []
    for h in range(HEADS):
        rows = slice(h * d, (h + 1) * d)
        q = x2 @ w[:D][rows].T + bq[rows]
        k = x2 @ w[D : 2 * D][rows].T
        v = x2 @ w[2 * D :][rows].T + bv[rows]
        heads.append(torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), -1) @ v)
    ref = torch.cat(heads, -1) @ a.proj.weight.detach().T + a.proj.bias.detach()
    (ref * g).sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for ours, theirs in ((x.grad, x2.grad), (a.qkv.weight.grad, w.grad), (a.q_bias.grad, bq.grad),
                         (a.v_bias.grad, bv.grad)):  # fmt: skip
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("pos, kw, matters", [("none", {}, False), ("rope2d_axial", {}, True),
                                              ("none", {"cosine": True}, True)])  # fmt: skip
def test_a_key_bias_is_a_term_of_its_own_only_under_rotation_or_normalisation(pos, kw, matters):
    """Why the layout matters: a key bias adds ``q_i . b`` to all of row ``i``, which the softmax ignores (its
    gradient is rounding), unless ``k`` is rotated or normalised."""
    torch.manual_seed(0)
    a = Attention(D, HEADS, pos=pos, grid=(2, 3), **kw).double()
    (a(_x(shape=(2, 6, D)), grid=(2, 3)) * _x(1, (2, 6, D))).sum().backward()
    k_grad = a.qkv.bias.grad[D : 2 * D].abs().max().item()
    assert k_grad > 1e-3 if matters else k_grad < 1e-12


SOURCES = {  # timm's attention layouts with q / v biases: fused qkv, separate projections, Swin V2's cosine windows
    "vit_small_patch16_dinov3_qkvb": dict(img_size=64, depth=2, embed_dim=64, num_heads=2, num_classes=5),
    "eva02_base_patch14_448": dict(img_size=64, depth=2, embed_dim=64, num_heads=2, num_classes=5, patch_size=16),
    "swinv2_tiny_window8_256": dict(
        img_size=64, embed_dim=16, depths=(2, 2), num_heads=(1, 2), window_size=4, num_classes=5
    ),
}


@pytest.mark.parametrize("name", list(SOURCES))
def test_fine_tuning_an_import_learns_what_timm_learns(name):
    """One SGD step on every attention parameter of timm's model and of its import, the same batch and loss: the two
    still compute the same function (a learned key bias would have moved the import alone: RoPE, cosine attention).
    """
    torch.manual_seed(0)
    t = lively(timm.create_model(name, **SOURCES[name])).double()
    m = vitrel.from_timm(t).train()
    t.train()
    attn = next(mod for n, mod in m.named_modules() if n.endswith("blocks.0.attn"))
    assert attn.q_bias is not None and attn.qkv.bias is None and m.vitrel_cfg["qkv_bias"] == "qv"
    x, w = _x(2, (2, 3, 64, 64)), _x(3, (2, 5))
    for model in (t, m):
        params = [p for n, p in model.named_parameters() if ".attn." in n]
        opt = torch.optim.SGD(params, lr=0.5)
        (model(x) * w).sum().backward()
        opt.step()
    t.eval(), m.eval()
    with torch.no_grad():
        torch.testing.assert_close(m(x), t(x), rtol=1e-6, atol=1e-6)  # (EVA-02: timm's float32 RoPE table)
        assert sum(p.numel() for n, p in m.named_parameters() if ".attn." in n) == sum(
            p.numel() for n, p in t.named_parameters() if ".attn." in n
        )


def test_qv_models_save_load_and_refuse_other_values(tmp_path):
    m = vitrel.create_model("vitrel_vit_tiny_patch4_32", qkv_bias="qv", pos="rope2d_axial", depth=1).eval()
    with torch.no_grad():
        m.blocks[0].attn.q_bias.normal_()
    back = vitrel.load_model(save_pretrained(m, tmp_path / "m")).eval()
    assert back.vitrel_cfg["qkv_bias"] == "qv"
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(back(x), m(x))
    with pytest.raises(ValueError, match="qkv_bias must be true, false or 'qv'"):
        vitrel.create_model("vitrel_vit_tiny_patch4_32", qkv_bias="kv")
