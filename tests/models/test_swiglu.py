"""``mlp_layer="swiglu"``: a ViT whose blocks' MLP is timm's ``SwiGLU`` (DINOv3's ViT-S+, H+ and 7B): the block against
its equation, timm's init, timm's ViT with the same MLP, checkpoints, inflation and the refusals."""

from __future__ import annotations

import pytest
import timm
import torch
from torch import nn

import vitrel
from tests.weights import lively
from vitrel.models import save_pretrained
from vitrel.models.inflate import inflate_image_model
from vitrel.models.timm_import import UnsupportedTimmModel

SMALL = dict(embed_dim=24, depth=2, num_heads=3, mlp_ratio=2.5)


def _vit(pos="rope2d_axial") -> nn.Module:
    torch.manual_seed(0)
    return vitrel.create_model("vitrel_vit_tiny_patch4_32", pos=pos, mlp_layer="swiglu", **SMALL)


def test_the_block_mlp_is_the_equation():
    """``fc2(SiLU(x W_g^T + b_g) * (x W_x^T + b_x))`` with ``int(24 * 2.5) = 60`` hidden features, float64."""
    m = lively(_vit()).double()
    mlp = m.blocks[1].mlp
    x = torch.randn(2, 5, 24, dtype=torch.float64)
    gate = x @ mlp.fc1_g.weight.T + mlp.fc1_g.bias
    value = x @ mlp.fc1_x.weight.T + mlp.fc1_x.bias
    want = (gate * torch.sigmoid(gate) * value) @ mlp.fc2.weight.T + mlp.fc2.bias
    assert mlp.fc1_g.out_features == 60
    torch.testing.assert_close(mlp(x), want, rtol=1e-12, atol=1e-12)


def test_init_is_timms():
    """timm's SwiGLU init after its ViT init: the gate's weight near zero (std 1e-6) and its bias one, so the block
    starts as ``fc2(SiLU(1) * fc1_x x)``; the value and output layers trunc-normal(0.02)."""
    mlp = _vit().blocks[0].mlp
    assert torch.equal(mlp.fc1_g.bias, torch.ones(60)) and mlp.fc1_g.weight.std() < 1e-5
    assert 0.01 < mlp.fc1_x.weight.std() < 0.03 and torch.equal(mlp.fc1_x.bias, torch.zeros(60))


def test_equals_timms_vit_with_the_same_mlp_and_refuses_another_activation():
    torch.manual_seed(0)
    args = dict(img_size=32, patch_size=4, embed_dim=24, depth=2, num_heads=3, num_classes=5, mlp_ratio=2.5)
    t = lively(timm.create_model("vit_tiny_patch16_224", mlp_layer=timm.layers.SwiGLU, act_layer=nn.SiLU, **args))
    t = t.double().eval()
    m = vitrel.from_timm(t)
    assert (m.vitrel_cfg["mlp_layer"], m.vitrel_cfg["mlp_ratio"]) == ("swiglu", 2.5)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(m(x), t(x), rtol=1e-10, atol=1e-10)
    gelu = timm.create_model("vit_tiny_patch16_224", mlp_layer=timm.layers.SwiGLU, **args)  # (timm's default GELU)
    with pytest.raises(UnsupportedTimmModel, match=r"an MLP activation GELU \(vitrel: SiLU in a SwiGLU\)"):
        vitrel.from_timm(gelu)
    packed = timm.create_model("vit_tiny_patch16_224", mlp_layer=timm.layers.SwiGLUPacked, act_layer=nn.SiLU, **args)
    with pytest.raises(UnsupportedTimmModel, match="a gated MLP other than timm's SwiGLU"):
        vitrel.from_timm(packed)


def test_checkpoint_and_inflation_keep_it(tmp_path):
    m = _vit("rel2d_full")
    save_pretrained(m, tmp_path / "m")
    back = vitrel.load_model(tmp_path / "m")
    assert back.vitrel_cfg["mlp_layer"] == "swiglu" and back.blocks[0].mlp.fc1_g.out_features == 60
    like = dict(in_chans=3, class_token=True, global_pool="token", num_classes=m.num_classes, **SMALL)
    video = vitrel.create_model("vitrel_vit_video_tiny_patch4_32", pos="rel3d_full", mlp_layer="swiglu", **like)
    inflate_image_model(m, video)
    torch.testing.assert_close(video.blocks[1].mlp.fc1_g.weight, m.blocks[1].mlp.fc1_g.weight)
    plain = vitrel.create_model("vitrel_vit_video_tiny_patch4_32", pos="rel3d_full", **like)
    with pytest.raises(ValueError, match="mlp_layer image 'swiglu', video 'mlp'"):
        inflate_image_model(m, plain)


def test_an_unknown_mlp_layer_is_refused():
    with pytest.raises(ValueError, match="mlp_layer must be 'mlp' .* or 'swiglu' .*, got 'geglu'"):
        vitrel.create_model("vitrel_vit_tiny_patch4_32", mlp_layer="geglu")
