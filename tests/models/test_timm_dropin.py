"""vitrel models where code written for timm expects a timm model (issue 21).

* timm's own model tests (its ``tests/models/test_models.py``), written again for a small vitrel ViT and Swin:
  forward, backward, default cfgs (``in_chans`` included), forward_features / forward_intermediates,
  ``features_only``, fx backward, reset_classifier (TorchScript aside: vitrel does not script);
* ``features_only`` with every ``feature_cls`` (getter, hook, fx, list, dict), ``out_indices``, ``output_fmt``;
* timm's resize arguments: ``dynamic_img_size`` / ``strict_img_size`` and ``set_input_size`` (equal to
  loading the saved weights at the new size);
* dense-task libraries: segmentation-models-pytorch (``vitrel[dense]``) and torchvision detection.
"""

from __future__ import annotations

import math
import warnings

import pytest
import timm
import torch
from timm.layers import get_notrace_functions, get_notrace_modules
from timm.layers.format import get_channel_dim, get_spatial_dim
from timm.models import get_model_input_config
from torchvision.models.feature_extraction import create_feature_extractor, get_graph_node_names

from vitrel.models import SwinTransformer, load_model, save_pretrained

VIT = dict(name="vitrel_vit_tiny_patch4_32", embed_dim=32, depth=3, num_heads=2)
SWIN = dict(name="vitrel_swin_tiny_patch2_window4_32", embed_dim=16, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4))
SPECS = pytest.mark.parametrize("spec", [VIT, SWIN], ids=["vit", "swin"])


def make(spec: dict, pos: str = "rel2d_full", **kw) -> torch.nn.Module:
    """Through ``timm.create_model``, as code written for timm builds it."""
    torch.manual_seed(0)
    spec = dict(spec)
    return timm.create_model(spec.pop("name"), pretrained=False, pos=pos, **{**spec, **kw})


def input_size(model) -> tuple[int, int, int]:
    return tuple(model.pretrained_cfg["input_size"])


# ---------------------------------------------------------------------------- timm's tests/models/test_models.py
@SPECS
def test_model_forward(spec):
    m = make(spec).eval()
    out = m(torch.randn(1, *input_size(m)))
    assert out.shape == (1, m.num_classes) and not torch.isnan(out).any()


@SPECS
def test_model_backward(spec):
    m = make(spec, num_classes=42).train()
    out = m(torch.randn(2, *input_size(m)))
    out.mean().backward()
    for n, p in m.named_parameters():
        assert p.grad is not None, f"no gradient for {n}"
    assert sum(p.numel() for p in m.parameters()) == sum(p.grad.numel() for p in m.parameters())
    assert out.shape[-1] == 42 and not torch.isnan(out).any()


@SPECS
def test_model_default_cfgs(spec):
    """timm's test_model_default_cfgs (Swin: spatial output) / _non_std (ViT: tokens), with ``in_chans``."""
    m = make(spec).eval()
    cfg, sd = m.pretrained_cfg, m.state_dict()
    assert m.num_classes >= 0 and m.num_features > 0 and m.head_hidden_size > 0
    assert m.in_chans == cfg["input_size"][0]
    x = torch.randn(1, *input_size(m))
    feats = m.forward_features(x)
    assert m.forward_head(feats, pre_logits=True).shape[1] == m.head_hidden_size
    if cfg["pool_size"] is not None:  # the Swin: a map in its output_fmt
        fmt = getattr(m, "output_fmt", "NCHW")
        sp, ch = get_spatial_dim(fmt), get_channel_dim(fmt)
        assert (feats.shape[sp[0]], feats.shape[sp[1]]) == tuple(cfg["pool_size"])
        assert feats.shape[ch] == m.num_features
    else:  # the ViT: tokens, features last
        assert feats.shape[-1] == m.num_features
    m.reset_classifier(0)
    out = m(x)
    assert out.dim() == 2 and out.shape[1] == m.head_hidden_size
    m.reset_classifier(0, "")
    out = m(x)
    if cfg["pool_size"] is not None:
        assert out.dim() == 4 and (out.shape[sp[0]], out.shape[sp[1]]) == tuple(cfg["pool_size"])
    else:
        assert out.dim() == 3 and out.shape[-1] == m.num_features
    for key in (cfg["classifier"], cfg["first_conv"]):
        assert key + ".weight" in sd
    one = make(spec, in_chans=1).eval()  # timm adapts first_conv for in_chans; the model says what it takes
    assert one.in_chans == 1 and one(torch.randn(1, 1, *input_size(m)[1:])).shape == (1, one.num_classes)
    assert get_model_input_config(one)["input_size"][0] == 1


@SPECS
def test_model_reset_classifier(spec):
    m = make(spec).eval()
    m.reset_classifier(5)
    assert m.get_classifier() is m.head and m(torch.randn(2, *input_size(m))).shape == (2, 5)
    assert m.num_classes == 5 == m.vitrel_cfg["num_classes"]


@pytest.mark.parametrize("pools", [("token", "avg"), ("avg", "token"), ("map", "max"), ("avgmax", "token")])
def test_a_model_reset_to_another_pool_reloads_as_it_was_saved(pools, tmp_path):
    """``reset_classifier(n, global_pool=...)`` keeps the norms where they were built (timm's): the saved
    ``vitrel_cfg`` says so (``fc_norm``), so ``save_for_hf`` / ``save_pretrained`` folders reload to the same function
    (they were refused: ``fc_norm.*`` missing, ``norm.*`` unexpected)."""
    m = make(VIT, global_pool=pools[0]).eval()
    m.reset_classifier(5, global_pool=pools[1])
    x = torch.randn(2, *input_size(m))
    timm.models.save_for_hf(m, tmp_path / "hf", safe_serialization=True)
    save_pretrained(m, tmp_path / "ours")
    for back in (timm.create_model(f"local-dir:{tmp_path / 'hf'}", pretrained=True), load_model(tmp_path / "ours")):
        assert back.global_pool == pools[1]
        torch.testing.assert_close(back.eval()(x), m(x), rtol=0, atol=0)


def test_reset_classifier_switches_among_timms_vit_pools_as_timm():
    """timm's ViT ``reset_classifier(n, global_pool)``: any of its pools, the attention pool (``map``) kept for ``map``,
    removed for another pool, and refused where the model was built without one (it cannot be added)."""
    m = make(VIT, global_pool="map").eval()
    assert isinstance(m.attn_pool, timm.layers.AttentionPoolLatent) and isinstance(m.fc_norm, torch.nn.Identity)
    x = torch.randn(2, *input_size(m))
    m.reset_classifier(4, "map")
    assert m.attn_pool is not None and m(x).shape == (2, 4)
    for pool in ("avgmax", "max", "avg", "token", ""):
        m.reset_classifier(4, pool)
        assert m.attn_pool is None and m.global_pool == m.vitrel_cfg["global_pool"] == pool
        assert not any(k.startswith("attn_pool.") for k in m.state_dict())
    with pytest.raises(ValueError, match="global_pool='map' needs the attention pool"):
        m.reset_classifier(4, "map")
    with pytest.raises(ValueError, match="global_pool must be 'token', 'avg', 'max', 'avgmax', 'map' or ''"):
        m.reset_classifier(4, "catavgmax")
    for pool in ("max", "avgmax"):  # timm's fc_norm default: after pooling for avg, max and avgmax
        assert isinstance(make(VIT, global_pool=pool).fc_norm, torch.nn.LayerNorm)


@pytest.mark.parametrize(
    "name",
    [
        "vitrel_vit_tiny_patch4_32",
        "vitrel_vit_tiny_patch16_224",
        "vitrel_swin_tiny_patch2_window4_32",
        "vitrel_swin_tiny_patch4_window7_224",
    ],
)
@pytest.mark.parametrize("training", [False, True])
def test_reset_classifier_keeps_the_mode(name, training):
    """timm's test_model_default_cfgs: after ``reset_classifier`` every module's ``training`` is the model's (the new
    head of a model in eval mode is in eval mode too), for 0 classes (``Identity``) and a new ``Linear`` head."""
    m = timm.create_model(name, pretrained=False, pos="rel2d_full", device="meta").train(training)
    for n in (0, 5, 0):
        m.reset_classifier(n)
        assert {k: mod.training for k, mod in m.named_modules() if mod.training != training} == {}


@SPECS
def test_model_forward_features(spec):
    """timm's test_model_forward_features: ``features_only=True`` outputs in the wrapper's ``output_fmt``."""
    m = make(spec, features_only=True).eval()
    channels, reductions = m.feature_info.channels(), m.feature_info.reduction()
    assert len(channels) >= 3
    fmt = getattr(m, "output_fmt", "NCHW")
    ch, sp = get_channel_dim(fmt), get_spatial_dim(fmt)
    size = input_size(m)
    outs = m(torch.randn(1, *size))
    assert len(outs) == len(channels)
    for c, r, o in zip(channels, reductions, outs):
        assert o.shape[ch] == c and o.shape[0] == 1 and not torch.isnan(o).any()
        assert (o.shape[sp[0]], o.shape[sp[1]]) == (math.ceil(size[1] / r), math.ceil(size[2] / r))


@SPECS
def test_model_forward_intermediates(spec):
    m = make(spec).eval()
    info = timm.models.FeatureInfo(m.feature_info, len(m.feature_info))
    size = input_size(m)
    x = torch.randn(1, *size)
    final, inter = m.forward_intermediates(x)
    assert len(inter) == len(info.channels()) >= 3
    for c, r, o in zip(info.channels(), info.reduction(), inter):  # NCHW, forward_intermediates' default
        assert o.shape == (1, c, math.ceil(size[1] / r), math.ceil(size[2] / r))
    torch.testing.assert_close(final, m.forward_features(x))
    m.set_grad_checkpointing()
    torch.testing.assert_close(m.forward_intermediates(x)[0], final)


@SPECS
def test_model_forward_intermediates_features(spec):
    m = make(spec, features_only=True, feature_cls="getter").eval()
    fmt = getattr(m, "output_fmt", "NCHW")
    ch, sp = get_channel_dim(fmt), get_spatial_dim(fmt)
    size = input_size(m)
    for c, r, o in zip(m.feature_info.channels(), m.feature_info.reduction(), m(torch.randn(1, *size))):
        assert o.shape[ch] == c and (o.shape[sp[0]], o.shape[sp[1]]) == (size[1] // r, size[2] // r)


@SPECS
def test_model_backward_fx(spec):
    """timm's test_model_backward_fx: the traced model (timm's leaf modules / notrace functions) trains."""
    m = make(spec, num_classes=42).train()
    kw = dict(leaf_modules=get_notrace_modules(), autowrap_functions=get_notrace_functions())
    train_nodes, eval_nodes = get_graph_node_names(m, tracer_kwargs=kw)
    fx = create_feature_extractor(
        m, train_return_nodes=[train_nodes[-1]], eval_return_nodes=[eval_nodes[-1]], tracer_kwargs=kw
    )
    (out,) = fx(torch.randn(2, *input_size(m))).values()
    out.mean().backward()
    assert all(p.grad is not None for p in fx.parameters()) and out.shape[-1] == 42


# ---------------------------------------------------------------------------- features_only: every feature_cls
@pytest.mark.parametrize("feature_cls", ["getter", "hook", "fx", "list", "dict"])
def test_swin_feature_cls(feature_cls):
    """Every timm feature wrapper gives the Swin's stage maps, NHWC (its ``output_fmt``, as timm's Swin)."""
    ref = make(SWIN).eval()
    m = make(SWIN, features_only=True, feature_cls=feature_cls, out_indices=(1, 3)).eval()
    assert m.output_fmt == "NHWC" and m.feature_info.channels() == [32, 128]
    x = torch.randn(2, 3, 32, 48)
    with torch.no_grad():
        want = ref.forward_intermediates(x, indices=[1, 3], output_fmt="NHWC", intermediates_only=True)
        got = m(x)
    if feature_cls == "dict":
        assert list(got) == ["1", "3"]
        got = list(got.values())
    assert len(got) == 2
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    nets = [n for n in m.modules() if isinstance(n, SwinTransformer)]
    if feature_cls in ("getter", "hook"):  # the network is inside the wrapper: it carries the configuration
        assert nets[0].vitrel_cfg["architecture"] == SWIN["name"]
    else:  # fx / list / dict rebuild the network from its parts
        assert not nets


def test_feature_output_fmt():
    x = torch.randn(1, 3, 32, 32)
    nhwc = make(SWIN, features_only=True).eval()
    nchw = make(SWIN, features_only=True, output_fmt="NCHW").eval()
    assert nchw.output_fmt == "NCHW"
    with torch.no_grad():
        for a, b in zip(nchw(x), nhwc(x)):
            torch.testing.assert_close(a, b.permute(0, 3, 1, 2), rtol=0, atol=0)
    with pytest.raises(ValueError, match="needs feature_cls='getter'"):
        make(SWIN, features_only=True, feature_cls="hook", output_fmt="NCHW")
    vit = make(VIT, features_only=True).eval()  # the ViT's getter stays NCHW (timm's ViT)
    assert vit.output_fmt == "NCHW" and vit(x)[0].shape == (1, 32, 8, 8)


@pytest.mark.parametrize("feature_cls", ["hook", "fx"])
def test_vit_feature_cls(feature_cls):
    """hook / fx give the blocks' outputs (tokens, prefix first), as for timm's ViT."""
    ref = make(VIT).eval()
    m = make(VIT, features_only=True, feature_cls=feature_cls, out_indices=(0, 2)).eval()
    x = torch.randn(1, 3, 32, 24)
    with torch.no_grad():
        inter = ref.forward_intermediates(x, indices=[0, 2], output_fmt="NLC", return_prefix_tokens=True)[1]
        got = m(x)
    for (patches, prefix), out in zip(inter, got):
        torch.testing.assert_close(out, torch.cat([prefix, patches], 1), rtol=0, atol=0)


def test_feature_cls_refused():
    for cls in ("list", "dict"):
        with pytest.raises(ValueError, match="ViT's do not allow"):
            make(VIT, features_only=True, feature_cls=cls)
        with pytest.raises(ValueError, match="absolute position embedding"):
            make(SWIN, features_only=True, feature_cls=cls, abs_pos="ape")
    with pytest.raises(ValueError, match="unknown feature_cls"):
        make(SWIN, features_only=True, feature_cls="nope")


# ---------------------------------------------------------------------------- dynamic / strict input size
@SPECS
def test_dynamic_and_strict_img_size(spec):
    size = input_size(make(spec))[1:]
    other = torch.randn(1, 3, size[0] + 16, size[1] - 8)
    for kw in ({"dynamic_img_size": True}, {"strict_img_size": False}, {}):
        m = make(spec, **kw).eval()
        assert m.dynamic_img_size and not m.strict_img_size and not get_model_input_config(m)["fixed_input_size"]
        assert m(other).shape == (1, m.num_classes)
    for kw in ({"strict_img_size": True}, {"dynamic_img_size": False}):  # timm: the input must be img_size
        m = make(spec, **kw).eval()
        assert m.strict_img_size and not m.dynamic_img_size and get_model_input_config(m)["fixed_input_size"]
        assert m(torch.randn(1, 3, *size)).shape == (1, m.num_classes)
        with pytest.raises(ValueError, match="strict_img_size"):
            m(other)
        with pytest.raises(ValueError, match="strict_img_size"):  # (images as a list or patches: the same rule)
            m([other[0]])
        assert m([torch.randn(3, *size)]).shape == (1, m.num_classes)
        assert load_model_back(m).strict_img_size  # the setting is part of vitrel_cfg
    if spec is SWIN:  # the children-in-turn wrapper checks it too
        f = make(spec, features_only=True, feature_cls="list", strict_img_size=True)
        with pytest.raises(ValueError, match="strict_img_size"):
            f(other)


def test_vit_layer_decay_and_prefix_tokens_as_timm():
    """timm's ViT: the final norm is in the last block's group (``group_matcher``, so layer-wise decay scales its
    rate as the last block's, not the head's); ``return_prefix_tokens`` where a NaFlex dict or a list has no prefix
    tokens to return: a clear error, not the flag ignored."""
    from timm.optim import param_groups_layer_decay

    for model in (make(VIT), timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, depth=3)):
        groups = param_groups_layer_decay(model, layer_decay=0.5)
        norm = {round(g["lr_scale"], 6) for g in groups if any(p is model.norm.weight for p in g["params"])}
        head = {round(g["lr_scale"], 6) for g in groups if any(p is model.head.weight for p in g["params"])}
        assert norm == {0.5} and head == {1.0}, (type(model).__name__, norm, head)
    m = make(VIT).eval()
    with pytest.raises(ValueError, match="return_prefix_tokens"):
        m.forward_intermediates([torch.randn(3, 32, 32)], output_fmt="NLC", return_prefix_tokens=True)


def load_model_back(m, **overrides):
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        save_pretrained(m, d)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "resized relative-position table"
            return load_model(d, **overrides).eval()


@pytest.mark.parametrize(
    "spec,new,load_kw",
    [
        (VIT, {"img_size": (48, 40)}, {"img_size": (48, 40)}),
        (SWIN, {"img_size": 48}, {"img_size": 48, "window_size": 6}),  # the window scales with the grid (timm)
        (SWIN, {"img_size": 48, "window_size": 3}, {"img_size": 48, "window_size": 3}),
        (SWIN, {"window_ratio": 2}, {"window_size": 8}),  # grid 16 / 2
    ],
    ids=["vit", "swin-scaled-window", "swin-window", "swin-ratio"],
)
def test_set_input_size_equals_loading_at_that_size(spec, new, load_kw):
    """``set_input_size`` resizes learned tables / absolute embeddings as loading the saved weights at the
    new size does, and ``vitrel_cfg`` follows (the model saved afterwards reloads at the new size)."""
    m = make(spec, abs_pos="ape").eval()
    saved = load_model_back(m, **load_kw)  # the weights before, loaded at the new size
    keep = {n: p for n, p in m.named_parameters() if "pos" not in n}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m.set_input_size(**new)
    h, w = m.vitrel_cfg["img_size"]
    assert get_model_input_config(m)["input_size"] == (3, h, w)
    assert all(p is keep[n] for n, p in m.named_parameters() if n in keep)  # the rest untouched
    x = torch.randn(2, 3, h, w)
    with torch.no_grad():
        torch.testing.assert_close(m(x), saved(x), rtol=0, atol=0)
        torch.testing.assert_close(load_model_back(m)(x), m(x), rtol=0, atol=0)
    assert {k: v.shape for k, v in m.state_dict().items()} == {k: v.shape for k, v in saved.state_dict().items()}


def test_set_input_size_noop_and_refusals():
    for spec in (VIT, SWIN):
        m = make(spec).eval()
        before = {k: v.clone() for k, v in m.state_dict().items()}
        m.set_input_size(img_size=input_size(m)[1:])  # the current size: nothing changes
        assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
        with pytest.raises(ValueError, match="patch size"):
            m.set_input_size(img_size=64, patch_size=8)
    s = make(SWIN)
    with pytest.raises(ValueError, match="one window for all stages"):
        s.set_input_size(window_size=[(4, 4), (4, 4), (2, 2), (2, 2)])
    with pytest.raises(ValueError, match="always_partition"):
        s.set_input_size(always_partition=True)
    frozen = make(VIT)
    frozen.blocks[0].attn.pos.requires_grad_(False)
    frozen.set_input_size(img_size=48)
    assert not any(p.requires_grad for p in frozen.blocks[0].attn.pos.parameters())


# ---------------------------------------------------------------------------- timm's PatchEmbed
@SPECS
def test_patch_embed_patch_size_is_timms_pair(spec):
    """timm's ``PatchEmbed.patch_size`` is ``(p, p)``, which DINO-style code and timm's ``resample_abs_pos_embed``
    callers index (``patch_size[0]``: a ``TypeError`` on vitrel's int); ``feat_ratio`` and ``dynamic_feat_size`` as
    timm's. A non-square pair is refused, not run with one side."""
    m = make(spec).eval()
    pe, p = m.patch_embed, m.vitrel_cfg["patch_size"]
    assert pe.patch_size == (p, p) == pe.feat_ratio(as_scalar=False) and pe.feat_ratio() == p
    x = torch.randn(1, 3, 32, 24)
    grid = (x.shape[-2] // pe.patch_size[0], x.shape[-1] // pe.patch_size[1])  # DINO's interpolate_pos_encoding
    assert pe.dynamic_feat_size((32, 24)) == grid
    assert m.forward_intermediates(x, indices=[0], intermediates_only=True)[0].shape[-2:] == grid
    with pytest.raises(ValueError, match="square patches only"):
        type(pe)((4, 2), 3, 8)


@pytest.mark.parametrize("strict", [False, True])
@SPECS
def test_patch_embed_built_size_is_timms(spec, strict):
    """timm's ``PatchEmbed.img_size`` / ``grid_size`` / ``num_patches`` (the built size, which DINO-style code and
    position-embedding resamplers read: an ``AttributeError`` on vitrel's) equal those of timm's model of the same
    sizes, before and after ``set_input_size``; ``strict_img_size`` as timm's (the Swin's ``img_size`` was None unless
    strict)."""
    if "depths" in spec:
        ref = timm.create_model("swin_tiny_patch4_window7_224", img_size=32, patch_size=2, window_size=4, embed_dim=16)
    else:
        ref = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=4, embed_dim=32, depth=1, num_heads=2)
    m = make(spec, strict_img_size=strict)
    for size in (None, 48):
        if size is not None:
            m.set_input_size(img_size=size), ref.set_input_size(img_size=size)
        got, want = m.patch_embed, ref.patch_embed
        assert (got.img_size, got.grid_size, got.num_patches) == (want.img_size, want.grid_size, want.num_patches)
        assert got.strict_img_size == strict


def test_dynamic_img_pad_pads_as_timms_patch_embed():
    """``dynamic_img_pad=True`` (timm's ViT argument, a ``TypeError`` before): images of any size are zero-padded on
    the right and bottom to whole patches as timm's ``PatchEmbed`` pads them (same weights, same tokens and grid), the
    relative positions and ``forward_intermediates``' maps are the padded grid's, and each image of a list is padded as
    a batch of it is. ``vitrel_cfg`` records it: the saved model reloads padding."""
    m = make(VIT, dynamic_img_pad=True).eval()
    ref = timm.layers.PatchEmbed(None, 4, 3, 32, dynamic_img_pad=True, strict_img_size=False)
    ref.load_state_dict(m.patch_embed.state_dict())
    with torch.no_grad():
        for h, w in ((30, 27), (32, 32), (5, 3)):
            x = torch.randn(2, 3, h, w)
            tokens, grid = m.patch_embed(x)
            torch.testing.assert_close(tokens, ref(x), rtol=0, atol=0)
            assert tuple(grid) == ref.dynamic_feat_size((h, w)) == m.patch_embed.dynamic_feat_size((h, w))
            maps = m.forward_intermediates(x, indices=[0, 2], intermediates_only=True)
            assert [f.shape for f in maps] == [(2, 32, *grid)] * 2
            torch.testing.assert_close(m([x[0], x[1]]), m(x))  # (the list path: a NaFlex batch of padded images)
        x = torch.randn(2, 3, 30, 27)
        assert load_model_back(m).vitrel_cfg["dynamic_img_pad"]
        torch.testing.assert_close(load_model_back(m)(x), m(x), rtol=0, atol=0)
        built = make(VIT, dynamic_img_pad=True, img_size=30, strict_img_size=True).eval()  # img_size off the patch
        square = torch.randn(1, 3, 30, 30)
        assert tuple(built.grid) == (8, 8) and built(square).shape == built([square[0]]).shape == (1, 10)
        with pytest.raises(ValueError, match="strict_img_size"):  # (a list: the image as given, before padding)
            built([square[0, :, :29, :29]])


def test_sizes_of_no_whole_patches_name_dynamic_img_pad():
    """Without ``dynamic_img_pad`` an image (or an ``img_size``) of no whole patches is refused naming the argument
    that pads it; timm's Swin takes no ``dynamic_img_pad``, and vitrel's Swin and video ViT say whose it is."""
    m = make(VIT).eval()
    for bad in (torch.randn(1, 3, 30, 27), [torch.randn(3, 30, 27)]):
        with pytest.raises(ValueError, match="not a positive multiple of the patch size 4.*dynamic_img_pad=True"):
            m(bad)
    with pytest.raises(ValueError, match=r"30x30 .*\(img_size, patch_size\).*dynamic_img_pad=True"):
        make(VIT, img_size=30)
    for spec in (SWIN, dict(VIT, name="vitrel_vit_video_tiny_patch4_32")):
        with pytest.raises(TypeError, match=r"dynamic_img_pad=True \(timm's image ViT's \(vitrel_vit_\*\)"):
            make(spec, dynamic_img_pad=True)


# ---------------------------------------------------------------------------- dense-task libraries
def train_step(model, loss_fn):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    loss = loss_fn()
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_smp_unet_swin_and_dpt_vit():
    smp = pytest.importorskip("segmentation_models_pytorch")
    torch.manual_seed(0)
    unet = smp.Unet(
        "tu-vitrel_swin_tiny_patch4_window7_224",
        encoder_weights=None,
        decoder_channels=(32, 16, 8, 8, 4),
        classes=2,
        pos="rope2d_mixed",
        embed_dim=16,
        depths=(1, 1, 1, 1),
        num_heads=(1, 1, 2, 2),
    )
    x = torch.randn(2, 3, 64, 96)
    assert unet(x).shape == (2, 2, 64, 96)
    train_step(unet, lambda: unet(x).square().mean())
    dpt = smp.DPT(
        "tu-vitrel_vit_tiny_patch16_224",
        encoder_weights=None,
        dynamic_img_size=True,
        classes=2,
        pos="rel2d_factored",
        embed_dim=32,
        num_heads=2,
        decoder_intermediate_channels=(16, 16, 16, 16),
        decoder_fusion_channels=16,
    )
    assert dpt.encoder.model.dynamic_img_size
    assert dpt(x).shape == (2, 2, 64, 96)
    train_step(dpt, lambda: dpt(x).square().mean())


def test_torchvision_faster_rcnn_on_swin_fpn():
    from torchvision.models.detection import FasterRCNN
    from torchvision.ops import FeaturePyramidNetwork
    from torchvision.ops.feature_pyramid_network import LastLevelMaxPool

    class SwinFPN(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = make(SWIN, pos="alibi2d", features_only=True, output_fmt="NCHW")
            self.fpn = FeaturePyramidNetwork(self.body.feature_info.channels(), 16, extra_blocks=LastLevelMaxPool())
            self.out_channels = 16

        def forward(self, x):
            return self.fpn({str(i): f for i, f in enumerate(self.body(x))})

    det = FasterRCNN(SwinFPN(), num_classes=3, min_size=64, max_size=64)
    images = [torch.rand(3, 64, 64), torch.rand(3, 64, 48)]
    targets = [
        {"boxes": torch.tensor([[4.0, 4.0, 30.0, 40.0]]), "labels": torch.tensor([1])},
        {"boxes": torch.tensor([[10.0, 2.0, 40.0, 20.0]]), "labels": torch.tensor([2])},
    ]
    det.train()
    train_step(det, lambda: sum(det(images, targets).values()))
    det.eval()
    with torch.no_grad():
        out = det(images)
    assert len(out) == 2 and {"boxes", "labels", "scores"} <= set(out[0])
