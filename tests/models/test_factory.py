"""The model factory: names, arguments, configs, and timm's registry."""

from __future__ import annotations

import pytest
import timm
import torch
from omegaconf import OmegaConf

import vitrel
from vitrel.models.registry import MODEL_ARGS, build_from_cfg

NAMES = [
    "vitrel_vit_tiny_patch16_224",
    "vitrel_vit_small_patch16_224",
    "vitrel_vit_base_patch16_224",
    "vitrel_vit_tiny_patch4_32",
    "vitrel_vit_small_patch4_32",
    "vitrel_swin_tiny_patch4_window7_224",
    "vitrel_swin_small_patch4_window7_224",
    "vitrel_swin_base_patch4_window7_224",
    "vitrel_swin_tiny_patch2_window4_32",
]
#: the video models (tests/models/test_video_vit.py, test_swin3d.py)
VIDEO_NAMES = [
    "vitrel_vit_video_tiny_patch16_224",
    "vitrel_vit_video_small_patch16_224",
    "vitrel_vit_video_base_patch16_224",
    "vitrel_vit_video_tiny_patch4_32",
    "vitrel_swin3d_tiny_patch244_window877_224",
    "vitrel_swin3d_tiny_patch122_window444_32",
]
SMALL = dict(depth=2, embed_dim=32, num_heads=2)


def test_list_models():
    assert vitrel.list_models() == sorted(NAMES + VIDEO_NAMES)
    assert vitrel.list_models("*swin*") == sorted(n for n in NAMES + VIDEO_NAMES if "swin" in n)
    assert vitrel.list_models("*_32") == sorted(
        ["vitrel_swin_tiny_patch2_window4_32", "vitrel_vit_small_patch4_32", "vitrel_vit_tiny_patch4_32"]
        + [n for n in VIDEO_NAMES if n.endswith("_32")]
    )
    assert vitrel.list_models("resnet*") == []
    assert sorted(timm.list_models("vitrel_*")) == sorted(NAMES + VIDEO_NAMES)  # registered with timm on import


@pytest.mark.parametrize("name", NAMES)
def test_architecture_sizes(name):
    with torch.device("meta"):
        m = vitrel.create_model(name)
    cls, args = MODEL_ARGS[name]
    assert isinstance(m, cls)
    if "_vit_" in name:
        size = name.split("_")[2]
        dims = {"tiny": (192, 3), "small": (384, 6), "base": (768, 12)}[size]
        assert (m.embed_dim, m.blocks[0].attn.num_heads, len(m.blocks)) == (*dims, 12)
    else:
        depths = [len(s.blocks) for s in m.layers]
        heads = [s.blocks[0].attn.num_heads for s in m.layers]
        expected = {
            "vitrel_swin_tiny_patch4_window7_224": (96, [2, 2, 6, 2], [3, 6, 12, 24]),
            "vitrel_swin_small_patch4_window7_224": (96, [2, 2, 18, 2], [3, 6, 12, 24]),
            "vitrel_swin_base_patch4_window7_224": (128, [2, 2, 18, 2], [4, 8, 16, 32]),
            "vitrel_swin_tiny_patch2_window4_32": (96, [2, 2, 6, 2], [3, 6, 12, 24]),
        }[name]
        assert (m.embed_dim, depths, heads) == expected
    size = 32 if name.endswith("_32") else 224
    assert m.pretrained_cfg["input_size"] == (3, size, size)
    assert m.num_classes == (10 if size == 32 else 1000)
    assert m.vitrel_cfg["architecture"] == name


def test_create_model_arguments():
    m = vitrel.create_model(
        "vitrel_vit_tiny_patch4_32", pos="rel2d_factored", num_classes=7, img_size=48, in_chans=1, **SMALL
    )
    assert m.num_classes == 7 and m.grid == (12, 12) and m.patch_embed.proj.in_channels == 1
    assert m.blocks[0].attn.pos.table_h.shape == (23, 2)  # built for the 12x12 grid
    assert m(torch.randn(2, 1, 48, 48)).shape == (2, 7)
    cfg = m.vitrel_cfg
    assert cfg["pos"] == "rel2d_factored" and cfg["img_size"] == [48, 48] and cfg["in_chans"] == 1
    assert cfg["depth"] == 2 and cfg["num_classes"] == 7
    # the same name through create_model keeps the architecture defaults
    assert (
        vitrel.create_model("vitrel_swin_tiny_patch4_window7_224", pos="rel2d_factored", depths=(2, 2, 2, 2))
        is not None
    )
    with pytest.raises(ValueError, match="unknown vitrel model"):
        vitrel.create_model("vitrel_vit_huge")
    with pytest.raises(ValueError, match="unknown position scheme"):
        vitrel.create_model("vitrel_vit_tiny_patch4_32", pos="nope", **SMALL)
    with pytest.raises(TypeError):
        vitrel.create_model("vitrel_vit_tiny_patch4_32", no_such_argument=1, **SMALL)


def test_pos_from_hydra_config():
    """``pos`` as a config dict - also a Hydra DictConfig - with the scheme's options."""
    pos = OmegaConf.create({"name": "rel2d_bucket", "num_buckets": 8, "max_distance": 16})
    m = vitrel.create_model("vitrel_vit_tiny_patch4_32", pos=pos, **SMALL)
    assert m.blocks[0].attn.pos.num_buckets == 8
    assert m.vitrel_cfg["pos"] == {"name": "rel2d_bucket", "num_buckets": 8, "max_distance": 16}
    assert type(m.vitrel_cfg["pos"]) is dict  # plain: JSON and weights_only-safe
    m2 = vitrel.create_model("vitrel_vit_tiny_patch4_32", pos={"name": "rope2d_mixed"}, **SMALL)
    assert type(m2.blocks[0].attn.pos).name == "rope2d_mixed"


def test_rebuild_from_vitrel_cfg():
    torch.manual_seed(0)
    m = vitrel.create_model("vitrel_swin_tiny_patch2_window4_32", pos="rel2d_cpb", abs_pos="ape", embed_dim=24)
    cfg = m.vitrel_cfg
    assert cfg["architecture"] == "vitrel_swin_tiny_patch2_window4_32"
    r = build_from_cfg(cfg)
    assert r.vitrel_cfg == cfg
    assert {k: v.shape for k, v in r.state_dict().items()} == {k: v.shape for k, v in m.state_dict().items()}
    r.load_state_dict(m.state_dict())
    x = torch.randn(2, 3, 32, 32)
    m.eval(), r.eval()
    torch.testing.assert_close(r(x), m(x), rtol=0, atol=0)


def test_timm_create_model():
    m = timm.create_model("vitrel_vit_small_patch16_224", pos="rope2d_mixed", num_classes=10)
    assert isinstance(m, vitrel.models.VisionTransformer)
    assert m.num_classes == 10 and type(m.blocks[0].attn.pos).name == "rope2d_mixed"
    assert m.pretrained_cfg["architecture"] == "vitrel_vit_small_patch16_224"
    assert m.vitrel_cfg["architecture"] == "vitrel_vit_small_patch16_224"
    s = timm.create_model("vitrel_swin_tiny_patch2_window4_32", pos="rel2d_factored", embed_dim=24)
    assert s(torch.randn(1, 3, 32, 32)).shape == (1, 10)
    with pytest.raises(RuntimeError, match="No pretrained weights"):
        timm.create_model("vitrel_vit_tiny_patch4_32", pretrained=True)


TINY_SWIN = dict(embed_dim=16, depths=(1, 1), num_heads=(2, 2))
VIT32, SWIN32 = ("vitrel_vit_tiny_patch4_32", SMALL), ("vitrel_swin_tiny_patch2_window4_32", TINY_SWIN)


@pytest.mark.parametrize("create", [vitrel.create_model, timm.create_model], ids=["vitrel", "timm"])
@pytest.mark.parametrize(
    "arch, pos, abs_pos, image",
    [
        (VIT32, "rope3d_axial", None, {"pos": "rope2d_axial"}),
        (VIT32, "sincos3d", None, {"pos": "sincos2d"}),
        (SWIN32, "rel3d_full", None, {"pos": "rel2d_full"}),
        (SWIN32, "alibi3d", "sincos3d", {"pos": "alibi2d", "abs_pos": "sincos2d"}),
    ],
    ids=["vit-rope3d_axial", "vit-sincos3d", "swin-rel3d_full", "swin-alibi3d+sincos3d"],
)
def test_a_video_scheme_on_an_image_model_is_one_warning_when_built(create, arch, pos, abs_pos, image, caplog):
    """An image model built with a 3-D (video) scheme runs it as one frame (T = 1): one warning per scheme when it is
    built (by vitrel's or timm's create_model), naming the image scheme to use; none at forward, none for a 2-D
    scheme on images or a 3-D one on video."""
    name, args = arch
    caplog.set_level("WARNING", logger="vitrel.models.backbone")
    m = create(name, pos=pos, abs_pos=abs_pos, **args)
    said = [r.getMessage() for r in caplog.records if r.name == "vitrel.models.backbone"]
    given = {"pos": pos, "abs_pos": abs_pos}
    assert [s.split(" ")[0] for s in said] == [f"{k}={given[k]}" for k in image], said
    for s, (key, instead) in zip(said, image.items()):
        assert f"is a video scheme (grids T x H x W): {type(m).__name__} takes images, so it runs as one frame" in s
        assert f"For images use {key}={instead};" in s
    caplog.clear()
    m(torch.randn(1, 3, 32, 32))
    create(name, pos="rel2d_factored", **args)
    create("vitrel_vit_video_tiny_patch4_32", pos=pos, **SMALL)
    assert not [r for r in caplog.records if r.name == "vitrel.models.backbone"]


def test_timm_overlay_route_names_the_arguments_given_unlike_the_files(tmp_path):
    """``timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=...), depth=3)`` for a file trained
    at depth 2: "the weights do not fit this VisionTransformer (None)" and the advice to take the route already taken.
    The error names each argument given unlike the stored one; the route's own load needs none left out."""
    from vitrel.models import save_pretrained
    from vitrel.models.checkpoint import CheckpointError

    m = vitrel.create_model("vitrel_vit_tiny_patch4_32", pos="rel2d_factored", embed_dim=32, depth=2, num_heads=2)
    save_pretrained(m, tmp_path)
    file = str(tmp_path / "model.safetensors")
    for given, said in ((dict(depth=3), "depth=3 (stored: 2)"), (dict(pos="rope2d_axial"), "pos='rope2d_axial'")):
        with pytest.raises(CheckpointError) as err:
            timm.create_model(
                "vitrel_vit_tiny_patch4_32", pretrained=True, pretrained_cfg_overlay=dict(file=file), **given
            )
        text = str(err.value)
        assert f"does not load into a vitrel_vit_tiny_patch4_32 built with {said}" in text, text
        assert "pretrained_cfg_overlay" not in text and "(None)" not in text and "  " in text  # (the keys)
    same = timm.create_model(
        "vitrel_vit_tiny_patch4_32", pretrained=True, pretrained_cfg_overlay=dict(file=file), depth=2
    )
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(same.eval()(x), m.eval()(x))


def test_timm_overlay_route_warns_of_arguments_the_weights_fit_as_load_model_does(tmp_path):
    """``timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=<train.py .ckpt>), pos=...)``
    reads the file's stored arguments as ``load_model`` does, but loaded a file into a model built with another
    parameter-free scheme, or other ``num_heads``, silently: not the trained model. It now gives ``load_model``'s
    warning (on the user's line), whole and ``features_only``; ``img_size`` / ``num_classes`` and the stored values
    stay quiet."""
    import warnings

    from tests.train_helpers import FAST, TINY_VIT, compose
    from vitrel.train.run import train

    run = [*TINY_VIT, *FAST, "trainer.max_steps=2", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1"]
    train(compose(tmp_path, [*run, "logger=none", "test=false", "pos=rope2d_axial"]))
    path = str(tmp_path / "checkpoints" / "last.ckpt")
    name = vitrel.load_model(path).vitrel_cfg["architecture"]
    for given, said in ((dict(pos="alibi2d"), r"pos=alibi2d \(trained with rope2d_axial\)"), (dict(num_heads=4), "")):
        with pytest.warns(UserWarning, match=r"another function") as loaded:
            vitrel.load_model(path, **given)
        text = str(loaded[0].message).replace(path, "<file>")
        for fo in ({}, dict(features_only=True)):
            with pytest.warns(UserWarning, match=said + ".*another function") as via_timm:
                timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=path), **given, **fo)
            (warned,) = [w for w in via_timm if "another function" in str(w.message)]
            assert str(warned.message).replace(path, "<file>") == text and warned.filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=path), pos="rope2d_axial", depth=2)
        timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=path), img_size=36, num_classes=3)
