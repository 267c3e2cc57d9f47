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


# ------------------------------------------------------------------------------------------ items 15, 16
def _rope(scaling: dict, name: str = "rope2d_axial"):
    return vitrel.create_model("vitrel_vit_tiny_patch4_32", pos={"name": name, "scaling": scaling}, **TINY_VIT)


TINY_VIT = TINY["vitrel_vit_tiny_patch4_32"]


@pytest.mark.parametrize("name", ["rope1d", "rope2d_axial", "rope2d_mixed"])
@pytest.mark.parametrize(
    "key, value, words",
    [
        ("truncate", "false", "scaling.truncate must be true or false, got 'false'"),
        ("truncate", 0, "scaling.truncate must be true or false, got 0"),
        ("beta_fast", "fast", "scaling.beta_fast must be a finite number, got 'fast'"),
        ("beta_slow", "1", "scaling.beta_slow must be a finite number, got '1'"),
        ("beta_fast", True, "scaling.beta_fast must be a finite number, got True"),
        ("factor", "2", "scaling.factor must be a number >= 1, a list of them, or auto; got '2'"),
        ("attention_factor", True, "scaling.attention_factor must be a positive number or null, got True"),
    ],
)
def test_rope_scaling_options_are_typed(name, key, value, words):
    """``truncate: "false"`` (a string) was read as true; ``beta_fast: "fast"`` failed in a float conversion naming
    no key: each is refused, naming the scheme, the option and the value."""
    scaling = {"rope_type": "yarn", "factor": 2.0, key: value}
    with pytest.raises(ValueError, match=f"{name}: " + _re(words)):
        _rope(scaling, name)


def test_rope_scaling_truncate_false_changes_the_frequencies():
    from vitrel.pos.rope_scaling import parse_scaling

    assert parse_scaling({"rope_type": "yarn", "factor": 2, "truncate": False}, 2, "rope2d_axial").truncate is False
    assert parse_scaling({"rope_type": "yarn", "factor": 2}, 2, "rope2d_axial").truncate is True


@pytest.mark.parametrize(
    "spec, words",
    [
        ({"name": "rope2d_mixed", "rotate": "false"}, "option rotate must be true or false, got 'false' (str)"),
        ({"name": "rope2d_axial", "base": "ten"}, "option base must be a number, got 'ten' (str)"),
        ({"name": "rel2d_bucket", "num_buckets": 8.5}, "option num_buckets must be an integer, got 8.5 (float)"),
        ({"name": "rope2d_axial", "scaling": "yarn"}, "option scaling must be a mapping or null, got 'yarn' (str)"),
    ],
)
def test_scheme_options_are_typed(spec, words):
    """Every scheme option is checked against its constructor's annotation when the spec is parsed (before any
    model is built), naming the scheme, the option and the value."""
    from vitrel.pos.registry import parse_pos

    with pytest.raises(ValueError, match=f"position scheme '{spec['name']}': " + _re(words)):
        parse_pos(spec)
    assert parse_pos({"name": "rope2d_axial", "base": 10})  # an int is a number


def _re(text: str) -> str:
    import re

    return re.escape(text)


# ------------------------------------------------------------------------------------------ items 17, 18
@pytest.mark.parametrize("key, value", [("topk", 0), ("topk", -1), ("batch_size", 0), ("num_workers", -1)])
def test_predict_refuses_counts_out_of_range_before_loading(tmp_path, key, value):
    """``predict.py topk=0`` wrote a CSV with only a filename column; ``topk=-1`` failed in torch.topk. Both are
    refused from the composed config, before the checkpoint is read (here there is none)."""
    from tests.train_helpers import compose
    from vitrel.inference import run_predict

    cfg = compose(tmp_path, [f"ckpt_path={tmp_path / 'absent.ckpt'}", f"input={tmp_path}", f"{key}={value}"], "predict")
    with pytest.raises(
        ValueError, match=_re(f"{key} must be an integer >= {0 if key == 'num_workers' else 1}, got {value}")
    ):
        run_predict(cfg)
    assert not (tmp_path / "predictions.csv").exists()


def test_predict_folder_refuses_topk_zero(tmp_path):
    from vitrel.inference import Predictor, predict_folder

    model = vitrel.create_model("vitrel_vit_tiny_patch4_32", **TINY_VIT).eval()
    pred = Predictor(model, {"input_size": (3, 32, 32), "mean": (0.5,) * 3, "std": (0.5,) * 3}, "memory")
    for k in (0, -1):
        with pytest.raises(ValueError, match=_re(f"topk must be an integer >= 1, got {k}")):
            predict_folder(pred, tmp_path, topk=k)
