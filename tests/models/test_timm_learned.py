"""``from_timm``'s models learn what timm's learn, not only compute the same function: fine-tuning one moves it as
timm's moves. Two layouts make that so: ``qkv_bias="qv"`` (a query and a value bias, none on the key: timm's BEiT, EVA
and Swin V2, ``q_bias`` and ``v_bias`` learned, ``k_bias`` a zero buffer) and ``patch_bias=False`` (CLIP's and the
Perception Encoder's patch projections). Checked against the equation in float64 and against timm."""

from __future__ import annotations

import math

import pytest
import timm
import torch

import vitrel
from tests.models.test_swin_v2 import _timm_v2  # (its post-norms redrawn: timm starts them at 0)
from tests.models.test_timm_import import SOURCES as IMPORTED
from tests.models.test_timm_import import _timm
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


VIT = dict(img_size=64, depth=2, embed_dim=64, num_heads=2, num_classes=5)
SOURCES = {  # q / v biases (fused qkv, separate projections, Swin V2's cosine windows); patch projections without bias
    "vit_small_patch16_dinov3_qkvb": (VIT, {"qkv_bias": "qv"}),
    "eva02_base_patch14_448": ({**VIT, "patch_size": 16}, {"qkv_bias": "qv"}),
    "swinv2_tiny_window8_256": (dict(depths=(2, 2), num_heads=(1, 2), num_classes=5), {"qkv_bias": "qv"}),
    "vit_base_patch16_clip_224": (VIT, {"patch_bias": False}),
    "vit_pe_core_small_patch16_384": (VIT, {"patch_bias": False}),
    "vit_relpos_medium_patch16_cls_224": (VIT, {"qkv_bias": False}),  # (its bias MLP, rel2d_cpb's mode cr)
}


@pytest.mark.parametrize("name", list(SOURCES))
def test_fine_tuning_an_import_learns_what_timm_learns(name):
    """One SGD step on every attention and patch-embedding parameter of timm's model and of its import, the same batch
    and loss: the two still compute the same function. A learned key bias (under RoPE, cosine attention) or patch
    bias would have moved the import alone."""
    kw, read = SOURCES[name]
    torch.manual_seed(0)
    t = _timm_v2(name, **kw) if "swinv2" in name else lively(timm.create_model(name, **kw)).double()
    m = vitrel.from_timm(t).eval()  # (no stochastic depth: Swin V2's drop_path_rate 0.1 draws in training mode)
    t.eval()
    assert {k: m.vitrel_cfg[k] for k in read} == read
    x, w = _x(2, (2, 3, 64, 64)), _x(3, (2, 5))
    for model in (t, m):
        params = [p for n, p in model.named_parameters() if ".attn." in n or n.startswith("patch_embed.")]
        opt = torch.optim.SGD(params, lr=0.5)
        (model(x) * w).sum().backward()
        opt.step()
    with torch.no_grad():
        torch.testing.assert_close(m(x), t(x), rtol=1e-7, atol=1e-7)  # (EVA-02: timm's float32 RoPE table, 2e-8)


@pytest.mark.parametrize("name", list(IMPORTED))
def test_an_import_learns_as_many_numbers_as_timms_model(name):
    """Every source ``from_timm`` reads: the import's parameters hold as many numbers as timm's model, less what is
    folded on purpose: the absolute embedding's class / register slots (added to those tokens: the same sums,
    learned once) and ConViT's positional-logit bias (the softmax cancels it)."""
    t = _timm(name)
    m = vitrel.from_timm(t)
    folded = 0
    if getattr(t, "pos_embed", None) is not None and not getattr(t, "no_embed_class", True) and name != "convit_tiny":
        folded = t.num_prefix_tokens * t.pos_embed.shape[-1]
    if name == "convit_tiny":
        folded = sum(b.attn.pos_proj.bias.numel() for b in t.blocks if hasattr(b.attn, "pos_proj"))
    assert sum(p.numel() for p in m.parameters()) == sum(p.numel() for p in t.parameters()) - folded


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
