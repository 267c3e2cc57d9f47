"""Bad input on the configuration paths (issue 33, "Raw errors or silent nonsense", items 11 to 21): each is
refused before any work is done, with one error naming the key or argument and its value, or made to work."""

from __future__ import annotations

import pytest
import torch

import vitrel

TINY = {
    "vitrel_vit_tiny_patch4_32": dict(embed_dim=32, depth=1, num_heads=2),
    "vitrel_swin_tiny_patch2_window4_32": dict(embed_dim=16, depths=[1, 1], num_heads=[2, 2]),
}


# ------------------------------------------------------------------------------------------ item 19
@pytest.mark.parametrize("name", sorted(TINY))
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_reset_classifier_builds_the_head_on_the_models_device_and_dtype(name, device):
    """timm's test_model_default_cfgs: after ``model.to(device, dtype=float64)``, ``reset_classifier(0)`` then
    ``reset_classifier(2)`` gives a head of the model's device and dtype."""
    m = vitrel.create_model(name, num_classes=10, **TINY[name])
    m.to(device=device, dtype=torch.float64)
    m.reset_classifier(0)
    assert isinstance(m.get_classifier(), torch.nn.Identity)
    m.reset_classifier(2)
    head = m.get_classifier()
    assert head.weight.dtype == head.bias.dtype == torch.float64
    assert head.weight.device.type == head.bias.device.type == device
    if device == "cpu":
        size = m.vitrel_cfg["img_size"]
        out = m(torch.randn(2, 3, *size, dtype=torch.float64))
        assert out.shape == (2, 2) and out.dtype == torch.float64


# ------------------------------------------------------------------------------------------ item 20
def test_swin_features_only_takes_an_image_size_pair():
    """``img_size=(224, 288)`` with ``features_only=True``: the Swin, as the ViT, takes a pair."""
    kw = dict(img_size=(32, 48), features_only=True, embed_dim=16, depths=[1, 1], num_heads=[2, 2])
    m = vitrel.create_model("vitrel_swin_tiny_patch2_window4_32", **kw)
    feats = m(torch.randn(1, 3, 32, 48))
    assert [tuple(f.shape[1:3]) for f in feats] == [(16, 24), (8, 12)]
    assert vitrel.create_model("vitrel_swin_tiny_patch4_window7_224", img_size=(224, 288), features_only=True)
    swin = vitrel.models.SwinTransformer
    assert swin.feature_defaults({"img_size": (224, 288), "patch_size": 4})["pool_size"] == (7, 9)
    assert swin.feature_defaults({"img_size": 224, "patch_size": 4})["pool_size"] == (7, 7)
