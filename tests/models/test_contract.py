"""timm's model contract: forward_intermediates / prune_intermediate_layers, feature_info and
``features_only``, ``device=`` / ``dtype=`` (meta-device construction), pretrained_cfg fields, torch.fx."""

from __future__ import annotations

import pytest
import timm
import torch
from timm.layers import get_notrace_functions, get_notrace_modules
from torchvision.models.feature_extraction import create_feature_extractor, get_graph_node_names

import vitrel

VIT = dict(name="vitrel_vit_tiny_patch4_32", embed_dim=64, depth=3, num_heads=4)
SWIN = dict(name="vitrel_swin_tiny_patch2_window4_32", embed_dim=32, depths=(2, 2, 2, 2), num_heads=(2, 2, 4, 4))


def make(spec: dict, pos: str = "rel2d_full", create=vitrel.create_model, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    spec = dict(spec)
    return create(spec.pop("name"), pos=pos, **spec, **kw).eval()


def block_outputs(model, x) -> list[torch.Tensor]:
    """What every ViT block / Swin stage returns, caught by forward hooks."""
    mods = model.blocks if hasattr(model, "blocks") else model.layers
    outs: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda _m, _i, o: outs.append(o)) for m in mods]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in hooks:
            h.remove()
    return outs


# ---------------------------------------------------------------------------- forward_intermediates
@pytest.mark.parametrize("pos", ["rel2d_full", "rope2d_mixed", "ape"])
def test_vit_forward_intermediates(pos):
    m = make(VIT, pos, reg_tokens=1)
    x = torch.randn(2, 3, 32, 24)
    blocks = block_outputs(m, x)
    p = m.num_prefix_tokens
    with torch.no_grad():
        final, feats = m.forward_intermediates(x, output_fmt="NLC")
        torch.testing.assert_close(final, m.forward_features(x))
        assert len(feats) == len(m.blocks) == len(m.feature_info)
        for f, b in zip(feats, blocks):
            torch.testing.assert_close(f, b[:, p:])
        nchw = m.forward_intermediates(x, indices=[0, -1], intermediates_only=True)
        assert [t.shape for t in nchw] == [(2, 64, 8, 6)] * 2
        torch.testing.assert_close(nchw[1], blocks[-1][:, p:].reshape(2, 8, 6, 64).permute(0, 3, 1, 2))
        pairs = m.forward_intermediates(x, indices=1, return_prefix_tokens=True, norm=True, intermediates_only=True)
        torch.testing.assert_close(pairs[0][1], m.norm(blocks[-1])[:, :p])
        early = m.forward_intermediates(x, indices=[0], stop_early=True, intermediates_only=True)
        torch.testing.assert_close(early[0], nchw[0])


@pytest.mark.parametrize("pos", ["rel2d_full", "alibi2d", "rope2d_axial"])
def test_swin_forward_intermediates(pos):
    m = make(SWIN, pos)
    x = torch.randn(2, 3, 32, 48)
    stages = block_outputs(m, x)
    with torch.no_grad():
        final, feats = m.forward_intermediates(x)
        torch.testing.assert_close(final, m.forward_features(x))
        for f, s, info in zip(feats, stages, m.feature_info):
            torch.testing.assert_close(f, s.permute(0, 3, 1, 2))
            assert f.shape[1] == info["num_chs"] and f.shape[2] == -(-32 // info["reduction"])
        nhwc = m.forward_intermediates(x, indices=2, output_fmt="NHWC", intermediates_only=True)
        torch.testing.assert_close(nhwc[0], stages[2])
        last = m.forward_intermediates(x, indices=[-1], norm=True, intermediates_only=True)
        torch.testing.assert_close(last[0], m.norm(stages[-1]).permute(0, 3, 1, 2))


def test_prune_intermediate_layers():
    x = torch.randn(1, 3, 32, 32)
    for spec, keep, n in ((VIT, [0, 1], 3), (SWIN, (0, 1, 2), 4)):
        m = make(spec)
        with torch.no_grad():
            want = m.forward_intermediates(x, indices=keep, intermediates_only=True)
        assert m.prune_intermediate_layers(keep) == list(keep)
        mods = m.blocks if hasattr(m, "blocks") else m.layers
        assert len(mods) == max(keep) + 1 < n and m.num_classes == 0
        with torch.no_grad():
            got = m.forward_intermediates(x, indices=keep, intermediates_only=True)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b)
            assert m(x).shape[-1] == m.num_features  # head and pooling gone (timm: reset_classifier(0, ""))


# ---------------------------------------------------------------------------- features_only through timm's builder
def features(spec: dict, pos: str, **feature_cfg) -> torch.nn.Module:
    """``features_only=True`` through timm's ``build_model_with_cfg`` (the builder vitrel's registry calls)."""
    from timm.models import build_model_with_cfg

    from vitrel.models.registry import MODEL_ARGS

    spec = dict(spec)
    name = spec.pop("name")
    cls, args = MODEL_ARGS[name]
    torch.manual_seed(0)
    return build_model_with_cfg(
        cls, name, False, feature_cfg=feature_cfg, features_only=True, **{**args, **spec, "pos": pos}
    ).eval()


@pytest.mark.parametrize("pos", ["rel2d_full", "rope2d_mixed"])
def test_features_only_swin(pos):
    m = features(SWIN, pos, feature_cls="getter", out_indices=(0, 1, 2, 3))
    assert m.feature_info.channels() == [32, 64, 128, 256]
    assert m.feature_info.reduction() == [2, 4, 8, 16]
    with torch.no_grad():
        outs = m(torch.randn(2, 3, 64, 48))
    assert [tuple(o.shape) for o in outs] == [(2, 32, 32, 24), (2, 64, 16, 12), (2, 128, 8, 6), (2, 256, 4, 3)]
    nhwc = features(SWIN, pos, feature_cls="getter", out_indices=(0, 1, 2, 3), output_fmt="NHWC")
    with torch.no_grad():
        assert nhwc(torch.randn(1, 3, 32, 32))[0].shape == (1, 16, 16, 32)


def test_features_only_vit():
    m = features(VIT, "rel2d_factored", feature_cls="getter", out_indices=(0, 2))
    assert m.feature_info.channels() == [64, 64] and m.feature_info.reduction() == [4, 4]
    with torch.no_grad():
        outs = m(torch.randn(2, 3, 32, 40))
    assert [tuple(o.shape) for o in outs] == [(2, 64, 8, 10)] * 2


def test_timm_create_model_features_only():
    """``timm.create_model("vitrel_...", features_only=True)``: timm's FeatureGetterNet over
    forward_intermediates, every Swin stage (NHWC, the Swin's own ``output_fmt`` as timm's Swin;
    ``output_fmt="NCHW"`` permutes) or the ViT's last 3 blocks by default, ``out_indices`` respected; the
    configuration stays on the network inside the wrapper."""
    m = timm.create_model("vitrel_swin_tiny_patch2_window4_32", features_only=True, embed_dim=48).eval()
    assert m.feature_info.channels() == [48, 96, 192, 384] and m.feature_info.reduction() == [2, 4, 8, 16]
    assert m.output_fmt == "NHWC"
    x = torch.randn(1, 3, 64, 48)
    with torch.no_grad():
        outs = m(x)
    assert [tuple(o.shape) for o in outs] == [(1, 32, 24, 48), (1, 16, 12, 96), (1, 8, 6, 192), (1, 4, 3, 384)]
    torch.manual_seed(0)
    nchw = timm.create_model("vitrel_swin_tiny_patch2_window4_32", features_only=True, embed_dim=48, output_fmt="NCHW")
    nchw.load_state_dict(m.state_dict())
    nchw.eval()
    with torch.no_grad():
        for a, b in zip(nchw(x), outs):
            torch.testing.assert_close(a, b.permute(0, 3, 1, 2), rtol=0, atol=0)
    assert m.model.vitrel_cfg["architecture"] == "vitrel_swin_tiny_patch2_window4_32"
    assert "vitrel_cfg" not in vars(m)
    v = timm.create_model("vitrel_vit_tiny_patch4_32", features_only=True, pos="rope2d_mixed", embed_dim=48)
    assert v.feature_info.out_indices == (9, 10, 11) and v.feature_info.channels() == [48] * 3  # as timm's ViT
    plain = v.model.eval()
    with torch.no_grad():
        x = torch.randn(2, 3, 32, 32)
        want = plain.forward_intermediates(x, indices=3, intermediates_only=True)
        for a, b in zip(v(x), want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    two = timm.create_model("vitrel_vit_tiny_patch4_32", features_only=True, out_indices=(0, 1), embed_dim=48)
    assert len(two(torch.randn(1, 3, 32, 32))) == 2


# ---------------------------------------------------------------------------- device / dtype, pretrained_cfg
@pytest.mark.parametrize(
    "spec,pos", [(VIT, "rope2d_axial"), (SWIN, "rel2d_full"), (VIT, "sincos2d"), (SWIN, "lookhere")]
)
def test_meta_device_construction(spec, pos):
    ref = make(spec, pos)
    m = make(spec, pos, device="meta")
    assert all(t.is_meta for t in [*m.parameters(), *(b for b in m.buffers() if b is not None)])
    assert "device" not in m.vitrel_cfg and "dtype" not in m.vitrel_cfg
    m = m.to_empty(device="cpu")
    m.load_state_dict(ref.state_dict())
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(m(x), ref(x), rtol=0, atol=0)
    d = make(spec, pos, dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in d.parameters())
    d.load_state_dict(ref.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(d(x.double()).float(), ref(x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "spec,pos,kw",
    [(SWIN, "rel2d_cpb", {}), (SWIN, "rel2d_full", {"abs_pos": "ape"}), (VIT, "rope2d_mixed", {}), (VIT, "fire2d", {})],
)
def test_init_weights_after_to_empty_initialises_everything(spec, pos, kw):
    """timm's route for a model built on the meta device: ``to_empty()`` (parameters and persistent buffers undefined),
    then ``init_weights()``. It re-initialised only the linear layers and norms outside the schemes: the patch
    embedding, position tables and MLPs, absolute embeddings and ``rel2d_cpb``'s ``ref_grid`` (garbage such as
    ``[326417514500, 55834574948]``, saved with the weights: a reload normalised the offsets by it) stayed as the
    memory was. Now every tensor is what the constructor makes, drawn alike (the same seed: the same model)."""
    ref = make(spec, pos, **kw)
    m = make(spec, pos, create=timm.create_model, device="meta", **kw).to_empty(device="cpu")
    persistent = m.state_dict()
    with torch.no_grad():  # what to_empty leaves: any values (here NaN, or -1 for integers)
        for t in persistent.values():
            t.fill_(float("nan") if t.is_floating_point() else -1)
    torch.manual_seed(0)
    m.init_weights()
    for k, v in m.state_dict().items():
        torch.testing.assert_close(v, ref.state_dict()[k], rtol=0, atol=0, msg=k)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(m(x), ref(x), rtol=0, atol=0)


def test_timm_create_model_device_dtype():
    m = timm.create_model("vitrel_vit_tiny_patch4_32", device="meta", dtype=torch.bfloat16, depth=2)
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in m.parameters())


@pytest.mark.parametrize("name", vitrel.list_models())
def test_pretrained_cfg_fields(name):
    m = vitrel.create_model(name, device="meta")
    cfg = m.pretrained_cfg
    sd = m.state_dict()
    assert cfg["first_conv"] + ".weight" in sd and cfg["classifier"] + ".weight" in sd
    assert cfg["input_size"][1:] == tuple(m.vitrel_cfg["img_size"])
    if isinstance(m, vitrel.models.SwinTransformer):  # (a video model's pool_size is None: its map has frames)
        h, w = cfg["input_size"][1:]
        x = torch.empty(1, 3, h, w, device="meta")
        assert tuple(m.forward_features(x).shape[1:3]) == tuple(cfg["pool_size"])
    else:
        assert cfg["pool_size"] is None


# ---------------------------------------------------------------------------- torch.fx (timm's tracer settings)
def fx_model(model):
    """As timm's tests/models/test_models.py: trace with timm's leaf modules and autowrapped functions."""
    kw = dict(
        leaf_modules=get_notrace_modules(), autowrap_functions=get_notrace_functions(), param_shapes_constant=True
    )
    train_nodes, eval_nodes = get_graph_node_names(model, tracer_kwargs=kw)
    return create_feature_extractor(
        model, train_return_nodes=[train_nodes[-1]], eval_return_nodes=[eval_nodes[-1]], tracer_kwargs=kw
    )


@pytest.mark.parametrize(
    "spec,pos,kw",
    [
        (VIT, "rel2d_full", {}),
        (VIT, "rope2d_mixed", {"pos_share": True}),
        (VIT, "ape", {}),
        (VIT, "shaw2d_factored", {}),
        (SWIN, "rel2d_full", {}),
        (SWIN, "alibi2d", {"pos_share": True}),
        (SWIN, "rel2d_full", {"abs_pos": "ape"}),
    ],
)
def test_fx_trace_equals_eager(spec, pos, kw):
    m = make(spec, pos, **kw)
    g = fx_model(m)
    with torch.inference_mode():
        for shape in ((1, 3, 32, 32), (2, 3, 24, 40)):
            x = torch.randn(*shape)
            (out,) = g(x).values()
            assert torch.equal(out, m(x))
