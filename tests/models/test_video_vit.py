"""The video ViT: tubelet tokens t-major against the convolution written out, timm's contract (registry, forward
features / head / intermediates, reset_classifier, export), any clip size, checkpoints through every route."""

from __future__ import annotations

from unittest import mock

import pytest
import timm
import torch

import vitrel
from tests.reference import naive_pool
from vitrel.layout.geometry import Grid3
from vitrel.models.registry import MODEL_ARGS
from vitrel.models.video_features import ClipFeatureGetterNet
from vitrel.models.video_vit import VideoVisionTransformer

from .test_contract import block_outputs

VIDEO_VITS = sorted(n for n, (cls, _) in MODEL_ARGS.items() if cls is VideoVisionTransformer)
SMALL = dict(depth=2, embed_dim=32, num_heads=2)
CPU = "vitrel_vit_video_tiny_patch4_32"
SWIN3D = "vitrel_swin3d_tiny_patch122_window444_32"


def make(name: str = CPU, **kw) -> VideoVisionTransformer:
    torch.manual_seed(0)
    return vitrel.create_model(name, **{**SMALL, **kw}).eval()


def clip(b: int, c: int, t: int, h: int, w: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(b, c, t, h, w, generator=torch.Generator().manual_seed(1), dtype=dtype)


def test_registered_names():
    assert VIDEO_VITS == [
        "vitrel_vit_video_base_patch16_224",
        "vitrel_vit_video_small_patch16_224",
        "vitrel_vit_video_tiny_patch16_224",
        "vitrel_vit_video_tiny_patch4_32",
    ]
    assert set(VIDEO_VITS) <= set(timm.list_models("vitrel_vit_video_*"))


@pytest.mark.parametrize("name", VIDEO_VITS)
def test_timm_create_model_each_name(name):
    """timm's factory builds each one; a reduced copy runs at its native clip and at another one."""
    full = timm.create_model(name, device="meta")
    args = MODEL_ARGS[name][1]
    assert full.vitrel_cfg["architecture"] == name and isinstance(full, VideoVisionTransformer)
    assert full.pretrained_cfg["input_size"] == (args.get("in_chans", 3), *(2 * [args.get("img_size", 224)]))
    assert (len(full.blocks), full.embed_dim, full.patch_embed.tubelet_size) == (12, args["embed_dim"], args[
        "tubelet_size"])  # fmt: skip
    m = timm.create_model(name, **SMALL).eval()
    c, t, s = m.in_chans, m.num_frames, m.img_size[0]
    for shape in ((2, c, t, s, s), (1, c, 2 * t, s // 2, s)):  # any clip: the grid follows the input
        x = clip(*shape)
        with torch.no_grad():
            feats = m.forward_features(x)
            g = m.patch_embed.grid_for(shape[2], shape[3:])
            assert feats.shape == (shape[0], g.n, 32)
            assert m.forward_head(feats).shape == (shape[0], m.num_classes)
            torch.testing.assert_close(m(x), m.head(m.fc_norm(feats.mean(1))), rtol=0, atol=0)  # VideoMAE's pool


def test_tubelet_tokens_are_t_major_as_the_convolution_written_out():
    """Token ``(t H' + h) W' + w`` is the tubelet ``frames [t ts, (t+1) ts), rows [h p, ...), cols [w p, ...)`` under
    the 3-D kernel, in float64 from the equation."""
    m = make("vitrel_vit_video_tiny_patch16_224", depth=1).double()
    pe = m.patch_embed
    x = clip(2, 3, 4, 32, 48, torch.float64)
    tokens, grid = pe(x)
    assert grid == Grid3(2, 2, 3)
    wgt, bias = pe.proj.weight, pe.proj.bias  # [C, 3, 2, 16, 16]
    for t in range(grid.t):
        for h in range(grid.h):
            for w in range(grid.w):
                cube = x[:, :, 2 * t : 2 * t + 2, 16 * h : 16 * h + 16, 16 * w : 16 * w + 16]
                want = torch.einsum("bctij,dctij->bd", cube, wgt) + bias
                torch.testing.assert_close(tokens[:, (t * grid.h + h) * grid.w + w], want, rtol=1e-10, atol=1e-10)


def test_bad_clips_refused_before_any_work():
    m = make()
    with pytest.raises(ValueError, match=r"clips \[B, 1, T, H, W\]"):
        m(torch.randn(2, 1, 32, 32))
    v = make("vitrel_vit_video_tiny_patch16_224")
    with pytest.raises(ValueError, match="3 frames are not a positive multiple of the tubelet size 2"):
        v(torch.randn(1, 3, 3, 32, 32))
    with pytest.raises(ValueError, match="not a positive multiple of the patch size 16"):
        v(torch.randn(1, 3, 4, 32, 40))
    with pytest.raises(ValueError, match=r"rel2d_full.*video grid 8x8x8"):
        vitrel.create_model(CPU, pos="rel2d_full", **SMALL)
    assert_feature_refusals(CPU, **SMALL)


@pytest.mark.parametrize("name", [CPU, SWIN3D])
def test_lists_and_naflex_dicts_are_refused_by_video_models(name):
    """The image models take a list of images or a NaFlex dict; a video model says it takes one clip tensor."""
    m = vitrel.create_model(name, in_chans=1, num_classes=3)
    naflex = {
        "patches": torch.randn(1, 4, 16),
        "patch_coord": torch.zeros(1, 4, 2, dtype=torch.long),
        "patch_valid": torch.ones(1, 4, dtype=torch.bool),
    }
    for given, kind in [([torch.randn(1, 8, 32, 32)], "list"), (naflex, "dict")]:
        with pytest.raises(ValueError, match=rf"takes clips \[B, 1, T, H, W\] as one tensor, got a {kind}"):
            m(given)


@pytest.mark.parametrize("class_token", [False, True])
def test_forward_intermediates(class_token):
    m = make(class_token=class_token)
    x = clip(2, 1, 4, 16, 24)
    outs = block_outputs(m, x)
    with torch.no_grad():
        p = m.num_prefix_tokens
        final, feats = m.forward_intermediates(x, output_fmt="NLC")
        torch.testing.assert_close(final, m.forward_features(x), rtol=0, atol=0)
        for f, o in zip(feats, outs):
            torch.testing.assert_close(f, o[:, p:], rtol=0, atol=0)
        maps = m.forward_intermediates(x, indices=[0, -1], intermediates_only=True)  # NCTHW
        assert [tuple(t.shape) for t in maps] == [(2, 32, 4, 4, 6)] * 2
        want = outs[-1][:, p:].reshape(2, 4, 4, 6, 32).permute(0, 4, 1, 2, 3)
        torch.testing.assert_close(maps[1], want, rtol=0, atol=0)
        # token (t, h, w) of the map is token (t H + h) W + w: the t-major layout
        torch.testing.assert_close(maps[1][:, :, 3, 2, 5], outs[-1][:, p + (3 * 4 + 2) * 6 + 5], rtol=0, atol=0)
        early = m.forward_intermediates(x, indices=[0], stop_early=True, intermediates_only=True)
        torch.testing.assert_close(early[0], maps[0], rtol=0, atol=0)
        if class_token:
            pairs = m.forward_intermediates(x, indices=1, return_prefix_tokens=True, norm=True, intermediates_only=True)
            torch.testing.assert_close(pairs[0][1], m.norm(outs[-1])[:, :1], rtol=0, atol=0)
    with pytest.raises(ValueError, match="output_fmt"):
        m.forward_intermediates(x, output_fmt="NCHW")


def test_reset_classifier_and_token_pool():
    m = make(class_token=True, global_pool="token", num_classes=5)
    x = clip(2, 1, 8, 32, 32)
    with torch.no_grad():
        feats = m.forward_features(x)
        torch.testing.assert_close(m.forward_head(feats, pre_logits=True), feats[:, 0], rtol=0, atol=0)
    m.reset_classifier(7, "avg")
    assert m(x).shape == (2, 7) and m.vitrel_cfg["num_classes"] == 7 and m.vitrel_cfg["global_pool"] == "avg"
    m.reset_classifier(0, "")
    assert m(x).shape == (2, 1 + 8 * 8 * 8, 32)
    with pytest.raises(ValueError, match="class token"):
        make().reset_classifier(3, "token")
    assert "cls_token" in m.no_weight_decay()


@pytest.mark.parametrize("global_pool", ["max", "avgmax", "map"])
def test_max_avgmax_and_map_pool_the_tubelet_tokens_as_timms_vit(global_pool):
    """The video ViT took ``avg`` / ``token`` / ``''`` only; timm's ViT pools (and its SigLIP-style ``map``) now pool
    the tubelet tokens of each clip, from the equations (float64), with timm's norm placement."""
    m = make(global_pool=global_pool, num_classes=5).double()
    x = clip(2, 1, 4, 16, 16, dtype=torch.float64)
    with torch.no_grad():
        feats = m.forward_features(x)
        want = torch.stack([m.head(m.fc_norm(naive_pool(m, f))) for f in feats])
        torch.testing.assert_close(m(x), want, rtol=0, atol=1e-12)
    assert isinstance(m.fc_norm, torch.nn.LayerNorm) == (global_pool != "map")
    assert (m.attn_pool is not None) == (global_pool == "map")


def test_pos_share_runs_one_scheme_for_every_block():
    m = make(pos_share=True)
    assert m.rel_pos is not None and all(b.attn.pos is None for b in m.blocks)
    assert m(clip(1, 1, 8, 32, 32)).shape == (1, 2)


def assert_checkpoint_routes(m: torch.nn.Module, x: torch.Tensor, out_dir) -> None:
    """save_pretrained -> vitrel.load_model, timm's local-dir and create_model(checkpoint_path=): the same model."""
    out = vitrel.models.save_pretrained(m, out_dir)
    name = m.vitrel_cfg["architecture"]
    with torch.no_grad():
        want = m(x)
        for other in (
            vitrel.load_model(out),
            timm.create_model(f"local-dir:{out}", pretrained=True),
            timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(out / "model.safetensors"))),
            vitrel.create_model(name, checkpoint_path=str(out / "model.safetensors")),
        ):
            assert other.vitrel_cfg == m.vitrel_cfg
            torch.testing.assert_close(other.eval()(x), want, rtol=0, atol=0)


def test_checkpoint_routes(tmp_path):
    assert_checkpoint_routes(make(num_classes=3, class_token=True), clip(2, 1, 8, 32, 32), tmp_path / "export")


# ---------------------------------------------------------------------------- features_only (timm's getter, on clips)
def test_features_only_maps_are_the_blocks_outputs():
    """``timm.create_model(name, features_only=True)``: vitrel's getter over ``forward_intermediates``, the last 3
    blocks (as timm's ViT), ``NCTHW``: each map is its block's output, the blocks run by hand, reshaped t-major to
    ``[B, C, T', H', W']``, at a clip other than the built one (4 frames of 16 x 24; built: 8 of 32 x 32). ``NTHWC``
    gives the same maps channels last; ``feature_info`` has the spatial stride and, beside it, the time stride."""
    kw = dict(SMALL, depth=3)
    ref = make(**kw)
    f = timm.create_model(CPU, features_only=True, **kw).eval()
    assert isinstance(f, ClipFeatureGetterNet) and f.output_fmt == "NCTHW" and f.feature_info.out_indices == (0, 1, 2)
    assert f.feature_info.channels() == [32] * 3 and f.feature_info.reduction() == [4] * 3
    assert f.feature_info.get("time_reduction") == [1] * 3
    assert not f.model.load_state_dict(ref.state_dict(), strict=False).missing_keys
    assert f.model.vitrel_cfg["architecture"] == CPU
    x = clip(2, 1, 4, 16, 24)
    with torch.no_grad():
        tokens, grid = ref.embed(x)
        by_hand = []
        for blk in ref.blocks:
            tokens = blk(tokens, grid)
            by_hand.append(tokens.reshape(2, 4, 4, 6, 32))  # [B, T', H', W', C], t-major
        got = f(x)
        assert [tuple(g.shape) for g in got] == [(2, 32, 4, 4, 6)] * 3
        for g, want in zip(got, by_hand):
            torch.testing.assert_close(g, want.permute(0, 4, 1, 2, 3), rtol=0, atol=0)
        for g, want in zip(got, ref.forward_intermediates(x, indices=3, intermediates_only=True)):
            torch.testing.assert_close(g, want, rtol=0, atol=0)
        last = timm.create_model(CPU, features_only=True, output_fmt="NTHWC", out_indices=(1,), **kw).eval()
        last.model.load_state_dict(ref.state_dict(), strict=False)
        assert len(last.model.blocks) == 2 and last.feature_info.channels() == [32]  # pruned after block 1
        torch.testing.assert_close(last(x)[0], by_hand[1], rtol=0, atol=0)
    tube = timm.create_model("vitrel_vit_video_tiny_patch16_224", features_only=True, out_indices=(0,), **SMALL)
    assert tube.feature_info.reduction() == [16] and tube.feature_info.get("time_reduction") == [2]
    assert tube(clip(1, 3, 4, 32, 48))[0].shape == (1, 32, 2, 2, 3)  # T' = 4 / 2


def assert_features_load_pretrained(m: torch.nn.Module, x: torch.Tensor, out_dir, indices: tuple[int, ...]) -> None:
    """Weights written by ``save_pretrained`` load into a ``features_only`` model through timm's builder
    (``pretrained_cfg_overlay=dict(file=...)``): its maps are the saved model's ``forward_intermediates``."""
    out = vitrel.models.save_pretrained(m, out_dir)
    f = timm.create_model(
        m.vitrel_cfg["architecture"], pretrained=True, features_only=True, out_indices=indices,
        pretrained_cfg_overlay=dict(file=str(out / "model.safetensors")),
    ).eval()  # fmt: skip
    with torch.no_grad():
        want = m.forward_intermediates(x, indices=list(indices), intermediates_only=True)
        got = f(x)
    assert len(got) == len(indices)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def assert_feature_refusals(name: str, **kw) -> None:
    """timm's other feature wrappers and image layouts are refused before the model is built, naming the getter / the
    clip layouts."""
    with mock.patch.object(MODEL_ARGS[name][0], "init_weights", side_effect=AssertionError("the model was built")):
        for cls in ("hook", "fx", "list", "dict"):
            with pytest.raises(ValueError, match=f"feature_cls='{cls}' is not available.*use feature_cls='getter'"):
                timm.create_model(name, features_only=True, feature_cls=cls, **kw)
        with pytest.raises(ValueError, match="output_fmt must be 'NCTHW'.*or 'NTHWC'.*got 'NCHW'"):
            timm.create_model(name, features_only=True, output_fmt="NCHW", **kw)


def test_features_only_loads_pretrained_weights(tmp_path):
    assert_features_load_pretrained(make(num_classes=3), clip(1, 1, 4, 16, 16), tmp_path / "export", (0, 1))


def test_export_any_clip_size():
    """torch.export with symbolic batch, frames, height and width: one program for every clip."""
    m = make("vitrel_vit_video_tiny_patch16_224", depth=1, embed_dim=32, num_heads=2, img_size=32, num_frames=4)
    x = clip(2, 3, 4, 32, 48)
    t, h, w = torch.export.Dim("t", min=1, max=8), torch.export.Dim("h", min=1, max=8), torch.export.Dim("w", max=8)
    dyn = {"x": {0: torch.export.Dim("b", max=16), 2: 2 * t, 3: 16 * h, 4: 16 * w}}
    import torch.fx.experimental._config as fx_config

    with torch.no_grad():
        with fx_config.patch(backed_size_oblivious=True):  # sizes that can be 1 (as vitrel.export does for images)
            ep = torch.export.export(m, (x,), dynamic_shapes=dyn)
        for shape in ((2, 3, 4, 32, 48), (3, 3, 6, 48, 16), (1, 3, 2, 16, 32)):
            xi = clip(*shape)
            torch.testing.assert_close(ep.module()(xi), m(xi), rtol=1e-5, atol=1e-5)


VIDEO_SCHEMES = [n for n in vitrel.list_pos() if vitrel.pos.get_pos_class(n).grid_dims in (3, None)]


@pytest.mark.parametrize("pos", VIDEO_SCHEMES)
@pytest.mark.parametrize("name", [CPU, SWIN3D])
def test_every_video_scheme_forward_backward(name, pos):
    """Each scheme that takes video grids trains in both video models: finite outputs, a gradient for every
    parameter, at the native clip and a longer, larger one; a relative scheme sits in every attention layer, an
    absolute one at the input."""
    kw = SMALL if "_vit_" in name else dict(embed_dim=16, depths=(2, 2), num_heads=(2, 2))
    torch.manual_seed(0)
    m = vitrel.create_model(name, pos=pos, **kw)
    for shape in ((1, 1, 8, 32, 32), (1, 1, 12, 40, 32)):
        y = m(clip(*shape))
        assert y.shape == (1, 2) and torch.isfinite(y).all()
        y.square().sum().backward()
        assert not [n for n, p in m.named_parameters() if p.grad is None]
        m.zero_grad(set_to_none=True)
    inside = {type(a.pos).name for a in m.modules() if isinstance(a, vitrel.Attention)}
    if vitrel.pos.get_pos_class(pos).kind == "absolute":  # added to the tubelet tokens once, none in attention
        assert type(m.abs_pos).name == pos and inside == {"none"}
    else:
        assert m.abs_pos is None and inside == {pos}


@pytest.mark.parametrize(
    "name,kw",
    [
        (CPU, dict(pos="rel3d_full", abs_pos="ape", tubelet_size=2, **SMALL)),
        (SWIN3D, dict(pos="rel3d_factored", tubelet_size=2, embed_dim=16, depths=(2,), num_heads=(2,))),
    ],
    ids=["vit", "swin3d"],
)
def test_set_input_size_equals_loading_at_that_size_and_frames(tmp_path, name, kw):
    """timm's ``set_input_size`` on a video model (img_size and num_frames): learned tables and embeddings resized as
    :func:`vitrel.load_model` at that size and clip length resizes the saved weights, ``vitrel_cfg`` and the data
    config follow, the model saved afterwards reloads as it is; another patch (or Swin window) is refused."""
    import warnings

    from vitrel.models.checkpoint import save_pretrained
    from vitrel.models.data_config import model_data_config

    torch.manual_seed(0)
    m = vitrel.create_model(name, **kw).eval()
    with torch.no_grad():  # tables away from their zero init: a lost or unresized one shows
        for n, p in m.named_parameters():
            if "pos" in n:
                p.add_(torch.randn_like(p))
    save_pretrained(m, tmp_path / "before")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "resized relative-position table"
        saved = vitrel.load_model(tmp_path / "before", img_size=48, num_frames=16).eval()
        m.set_input_size(img_size=48, num_frames=16)
    assert m.vitrel_cfg["img_size"] == [48, 48] and m.vitrel_cfg["num_frames"] == 16
    assert model_data_config(m)["num_frames"] == 16 and model_data_config(m)["input_size"][1:] == [48, 48]
    assert timm.models.get_model_input_config(m)["input_size"][-2:] == (48, 48)
    assert {k: v.shape for k, v in m.state_dict().items()} == {k: v.shape for k, v in saved.state_dict().items()}
    x = clip(1, 1, 16, 48, 48)
    save_pretrained(m, tmp_path / "after")
    with torch.no_grad():
        torch.testing.assert_close(m(x), saved(x), rtol=0, atol=0)
        torch.testing.assert_close(vitrel.load_model(tmp_path / "after").eval()(x), m(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="patch size"):
        m.set_input_size(img_size=64, patch_size=8)
    with pytest.raises(ValueError, match="3 frames are not a positive multiple of the tubelet size 2"):
        m.set_input_size(num_frames=3)
    assert m.vitrel_cfg["num_frames"] == 16


def test_video_swin_set_input_size_keeps_its_window():
    s = vitrel.create_model(SWIN3D, embed_dim=16, depths=(2,), num_heads=(2,))
    s.set_input_size(img_size=48, window_size=4)  # the window it has: nothing to refuse
    with pytest.raises(ValueError, match=r"keeps the Video Swin's window \(4, 4, 4\)"):
        s.set_input_size(window_size=(2, 4, 4))
    assert s.vitrel_cfg["img_size"] == [48, 48]
