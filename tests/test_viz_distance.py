"""Mean attention distance (``vitrel.viz.attention_distance``) against a float64 loop written from its equation:
``D[l, h] = mean_{images, query patches i} sum_{key patches j} a_ij ||c_i - c_j||`` with patch centres in pixels."""

import math

import pytest
import torch

import vitrel
from tests.test_viz import panels
from vitrel import viz


def _vit(pos, **kw):
    torch.manual_seed(0)
    args = dict(img_size=(12, 16), in_chans=1, num_classes=3, embed_dim=16, depth=2, num_heads=2, pos=pos)
    return vitrel.create_model("vitrel_vit_tiny_patch4_32", **{**args, **kw}).double()


def _naive(model, x):
    """Each block's input caught in a real forward, its attention written out (no position: pos=none), then the
    distance summed pair by pair."""
    seen = []
    hooks = [b.register_forward_pre_hook(lambda m, a: seen.append(a[0])) for b in model.blocks]
    model.eval()
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    p, ps = model.num_prefix_tokens, 4
    gh, gw = x.shape[-2] // ps, x.shape[-1] // ps
    out = torch.zeros(len(model.blocks), model.blocks[0].attn.num_heads, dtype=torch.float64)
    for l, (blk, t) in enumerate(zip(model.blocks, seen)):
        attn = blk.attn
        h = blk.norm1(t)
        b, n, _ = h.shape
        q, k, _ = attn.qkv(h).reshape(b, n, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
        a = (q @ k.transpose(-1, -2) / math.sqrt(attn.head_dim)).softmax(-1)
        for hd in range(attn.num_heads):
            total = 0.0
            for img in range(b):
                for i in range(gh * gw):
                    for j in range(gh * gw):
                        dr, dc = (i // gw - j // gw) * ps, (i % gw - j % gw) * ps
                        total += a[img, hd, p + i, p + j].item() * math.hypot(dr, dc)
            out[l, hd] = total / (b * gh * gw)
    return out


@pytest.mark.parametrize("class_token", [True, False])
def test_attention_distance_is_its_equation(class_token):
    kw = {} if class_token else dict(class_token=False, global_pool="avg")
    model = _vit("none", **kw).train()
    x = torch.randn(2, 1, 12, 16, dtype=torch.float64)
    got = viz.attention_distance(model, x)
    assert model.training  # its mode restored
    assert got.shape == (2, 2) and got.dtype == torch.float64
    torch.testing.assert_close(got, _naive(model, x), rtol=1e-12, atol=1e-12)


def test_a_local_scheme_looks_nearer_than_none():
    """ALiBi's distance penalty makes every head look nearer than no position does, at initialisation already."""
    x = torch.randn(4, 1, 12, 16, dtype=torch.float64)
    near, far = viz.attention_distance(_vit("alibi2d"), x), viz.attention_distance(_vit("none"), x)
    assert (near < far).all(), (near, far)


def test_attention_distance_refuses_what_has_no_global_image_grid():
    small = dict(pos="rel2d_full", num_classes=3, embed_dim=8, depths=(1, 1), num_heads=(1, 1))
    swin = vitrel.create_model("vitrel_swin_tiny_patch2_window4_32", **small)
    with pytest.raises(TypeError, match="global ViT"):
        viz.attention_distance(swin, torch.randn(1, 3, 32, 32))
    video = vitrel.create_model("vitrel_vit_video_tiny_patch4_32", pos="rope3d_axial", embed_dim=24, depth=1)
    with pytest.raises(ValueError, match="image grids"):
        viz.attention_distance(video, torch.randn(1, 1, 2, 16, 16))


def test_plot_attention_distance_one_series_per_model():
    d = torch.rand(3, 2) * 10
    fig = viz.plot_attention_distance({"rel2d_full": d, "none": d + 1})
    (ax,) = panels(fig)
    assert len(ax.collections) == 2 and [t.get_text() for t in ax.get_legend().get_texts()] == ["rel2d_full", "none"]
    assert sorted(ax.collections[1].get_offsets()[:, 1].tolist()) == sorted((d + 1).ravel().tolist())
    with pytest.raises(ValueError, match="depth, heads"):
        viz.plot_attention_distance(torch.rand(3))
