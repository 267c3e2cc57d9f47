"""Video Swin: its 3-D shifted windows against a windowed attention written from scratch (float64: pad, roll,
partition, Video Swin's ``compute_mask`` regions, attention, reverse), patch merging in space, and timm's contract
(registry, forward features / head / intermediates, reset_classifier, export, checkpoints)."""

from __future__ import annotations

import pytest
import timm
import torch

import vitrel
from vitrel.models.registry import MODEL_ARGS
from vitrel.models.swin3d import Swin3DBlock, SwinTransformer3D

from .test_contract import block_outputs
from .test_video_vit import assert_checkpoint_routes, assert_feature_refusals, assert_features_load_pretrained

SWIN3D = sorted(n for n, (cls, _) in MODEL_ARGS.items() if cls is SwinTransformer3D)
CPU = "vitrel_swin3d_tiny_patch122_window444_32"
SMALL = dict(embed_dim=16, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4))


def make(name: str = CPU, **kw) -> SwinTransformer3D:
    torch.manual_seed(0)
    return vitrel.create_model(name, **{**SMALL, **kw}).eval()


def rand(*shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=dtype)


# ---------------------------------------------------------------------------- the windows, from scratch
def reference_block(blk: Swin3DBlock, x: torch.Tensor, bias=None) -> torch.Tensor:
    """The block on the map ``x [B, T, H, W, C]`` written out: Video Swin's ``get_window_size`` (per axis, a window
    no smaller than the side shrinks to it, unshifted), zero padding to multiples of the window, the roll by -shift,
    the partition, ``compute_mask``'s 27 slice regions on the rolled map (keys of another region masked), padded keys
    masked (vitrel's rule), softmax attention per window with the block's own weights, then reverse, roll back, crop.
    ``bias(win) -> [heads, n, n]``: the scheme's term over a window's tokens (None: none)."""
    b, t, h, w, c = x.shape
    sizes = (t, h, w)
    win = [min(m, g) for m, g in zip(blk.window_size, sizes)]
    shift = [m // 2 if blk.shifted and g > m else 0 for m, g in zip(win, sizes)]
    padded = [-(-g // m) * m for g, m in zip(sizes, win)]
    xp = x.new_zeros(b, *padded, c)
    xp[:, :t, :h, :w] = blk.norm1(x)
    valid = torch.zeros(padded, dtype=torch.bool)
    valid[:t, :h, :w] = True
    region = torch.zeros(padded, dtype=torch.long)
    cnt = 0
    for sd in (slice(-win[0]), slice(-win[0], -shift[0]), slice(-shift[0], None)):
        for sh in (slice(-win[1]), slice(-win[1], -shift[1]), slice(-shift[1], None)):
            for sw in (slice(-win[2]), slice(-win[2], -shift[2]), slice(-shift[2], None)):
                region[sd, sh, sw] = cnt
                cnt += 1
    dims = (1, 2, 3)
    xr = torch.roll(xp, [-s for s in shift], dims)
    valid = torch.roll(valid, [-s for s in shift], (0, 1, 2))
    out = torch.zeros_like(xr)
    attn = blk.attn
    heads, hd = attn.num_heads, attn.head_dim
    for i0 in range(0, padded[0], win[0]):
        for i1 in range(0, padded[1], win[1]):
            for i2 in range(0, padded[2], win[2]):
                sl = (slice(i0, i0 + win[0]), slice(i1, i1 + win[1]), slice(i2, i2 + win[2]))
                tok = xr[:, sl[0], sl[1], sl[2]].reshape(b, -1, c)  # t-major inside the window
                n = tok.shape[1]
                q, k, v = attn.qkv(tok).view(b, n, 3, heads, hd).permute(2, 0, 3, 1, 4)
                logits = q @ k.transpose(-1, -2) * hd**-0.5
                if bias is not None:
                    logits = logits + bias(win)
                reg, ok = region[sl].reshape(-1), valid[sl].reshape(-1)
                allowed = (reg[:, None] == reg[None, :]) & ok[None, :]
                logits = logits.masked_fill(~allowed, float("-inf"))
                y = (logits.softmax(-1) @ v).transpose(1, 2).reshape(b, n, c)
                out[:, sl[0], sl[1], sl[2]] = attn.proj(y).view(b, *win, c)
    y = torch.roll(out, shift, dims)[:, :t, :h, :w]
    x = x + y
    return x + blk.mlp(blk.norm2(x))


@pytest.mark.parametrize(
    "sizes,window",
    [
        ((8, 8, 8), (4, 4, 4)),  # shifted on every axis, no padding
        ((6, 7, 10), (4, 4, 4)),  # padding on every axis, and shifted
        ((3, 9, 6), (4, 4, 4)),  # the window shrinks to the 3 frames: no shift in time
        ((5, 6, 6), (2, 3, 3)),  # windows of another shape
    ],
)
@pytest.mark.parametrize("shifted", [False, True])
@pytest.mark.parametrize("pos", ["none", "rel3d_full"])
def test_windows_against_attention_written_from_scratch(sizes, window, shifted, pos):
    torch.manual_seed(0)
    blk = Swin3DBlock(16, 2, window, shifted, pos=pos, build_grid=sizes).double().eval()
    bias = None
    if pos == "rel3d_full":  # Video Swin's bias: table[dt + Wt-1, dh + Wh-1, dw + Ww-1, head] (the table's centre)
        with torch.no_grad():
            blk.attn.pos.table.normal_()
        table = blk.attn.pos.table_4d()

        def bias(win):
            t, h, w = torch.meshgrid(*(torch.arange(n) for n in win), indexing="ij")
            t, h, w = t.reshape(-1), h.reshape(-1), w.reshape(-1)
            c = [(s - 1) // 2 for s in table.shape[:3]]
            d = [a[:, None] - a[None, :] + ci for a, ci in zip((t, h, w), c)]
            return table[d[0], d[1], d[2]].permute(2, 0, 1)

    x = rand(2, *sizes, 16, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(blk(x), reference_block(blk, x, bias), rtol=1e-10, atol=1e-10)


def test_shifted_windows_keep_the_wrapped_tokens_apart():
    """A token changed at frame 0 reaches, in a shifted block, only tokens of its own shifted window: on a
    ``8 x 8 x 8`` grid with ``4 x 4 x 4`` windows shifted by 2, the window holding frames 6, 7 and (wrapped) 0, 1 keeps
    the wrapped part apart: frames 6 and 7 of that window do not change."""
    torch.manual_seed(0)
    blk = Swin3DBlock(16, 2, (4, 4, 4), True, pos="none", build_grid=(8, 8, 8)).double().eval()
    x = rand(1, 8, 8, 8, 16, dtype=torch.float64)
    x2 = x.clone()
    x2[0, 0, 0, 0] += rand(16, dtype=torch.float64)  # (not a constant: the norm would remove it)
    with torch.no_grad():
        d = (blk(x2) - blk(x)).abs().sum(-1)[0]  # [T, H, W]
    changed = d > 1e-12
    assert changed[0:2, 0:2, 0:2].all()  # its own region of the shifted window (frames 0-1, rows 0-1, cols 0-1)
    assert not changed[6:8].any() and not changed[:, 6:8].any() and not changed[:, :, 6:8].any()
    assert not changed[2:6].any()


def test_patch_merging_is_spatial_per_frame():
    m = make()
    merge = m.layers[1].downsample
    x = rand(2, 8, 6, 6, 16)
    with torch.no_grad():
        y = merge(x)
        assert y.shape == (2, 8, 3, 3, 32)
        for t in (0, 5):  # each frame merged alone, as the image Swin merges an image (timm's channel order)
            f = x[:, t]
            cat = torch.cat([f[:, 0::2, 0::2], f[:, 1::2, 0::2], f[:, 0::2, 1::2], f[:, 1::2, 1::2]], -1)
            torch.testing.assert_close(y[:, t], merge.reduction(merge.norm(cat)), rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------- timm's contract
def test_registered_names():
    assert SWIN3D == ["vitrel_swin3d_tiny_patch122_window444_32", "vitrel_swin3d_tiny_patch244_window877_224"]
    assert set(SWIN3D) <= set(timm.list_models("vitrel_swin3d_*"))


@pytest.mark.parametrize("name", SWIN3D)
def test_timm_create_model_each_name(name):
    full = timm.create_model(name, device="meta")
    args = MODEL_ARGS[name][1]
    assert full.vitrel_cfg["architecture"] == name and full.window_size == args["window_size"]
    assert [len(s.blocks) for s in full.layers] == [2, 2, 6, 2]
    m = timm.create_model(name, **SMALL).eval()
    c, t, s = m.in_chans, m.num_frames, m.img_size[0]
    for shape in ((2, c, t, s, s), (1, c, t // 2, s // 2, s + 2 * 4 * m.patch_embed.patch_size)):
        x = rand(*shape)
        with torch.no_grad():
            feats = m.forward_features(x)
            tt = shape[2] // m.patch_embed.tubelet_size
            side = [-(-(n // m.patch_embed.patch_size) // 8) for n in shape[3:]]
            assert feats.shape == (shape[0], tt, *side, 128)
            torch.testing.assert_close(m(x), m.head(feats.mean((1, 2, 3))), rtol=0, atol=0)


def test_forward_intermediates_and_prune():
    m = make()
    x = rand(2, 1, 8, 32, 24)
    outs = block_outputs(m, x)
    with torch.no_grad():
        final, feats = m.forward_intermediates(x)
        torch.testing.assert_close(final, m.forward_features(x), rtol=0, atol=0)
        assert [tuple(f.shape) for f in feats] == [(2, 16, 8, 16, 12), (2, 32, 8, 8, 6), (2, 64, 8, 4, 3),
                                                   (2, 128, 8, 2, 2)]  # fmt: skip
        for f, o in zip(feats, outs):
            torch.testing.assert_close(f, o.permute(0, 4, 1, 2, 3), rtol=0, atol=0)
        nthwc = m.forward_intermediates(x, indices=[-1], norm=True, output_fmt="NTHWC", intermediates_only=True)
        torch.testing.assert_close(nthwc[0], m.norm(outs[-1]), rtol=0, atol=0)
        assert m.prune_intermediate_layers([0, 1]) == [0, 1] and len(m.layers) == 2
        assert m(x).shape == (2, 8, 8, 6, 32)
    with pytest.raises(ValueError, match="output_fmt"):
        m.forward_intermediates(x, output_fmt="NCHW")


def test_reset_classifier_pos_share_and_errors():
    m = make(pos_share=True, num_classes=4)
    assert all(s.rel_pos is not None for s in m.layers)
    x = rand(1, 1, 8, 32, 32)
    assert m(x).shape == (1, 4)
    m.reset_classifier(6)
    assert m(x).shape == (1, 6) and m.vitrel_cfg["num_classes"] == 6
    m.reset_classifier(0, "")
    assert m(x).shape == (1, 8, 2, 2, 128)
    with pytest.raises(ValueError, match=r"clips \[B, 1, T, H, W\]"):
        m(rand(1, 1, 32, 32))
    with pytest.raises(ValueError, match="window_size"):
        make(window_size=(4, 4))
    with pytest.raises(ValueError, match=r"rel2d_full.*video grid"):
        make(pos="rel2d_full")
    assert_feature_refusals(CPU, **SMALL)


def test_checkpoint_routes(tmp_path):
    assert_checkpoint_routes(make(num_classes=3), rand(2, 1, 8, 32, 32), tmp_path / "export")


def test_features_only_maps_are_the_stages_outputs():
    """``timm.create_model(name, features_only=True)``: every stage (as timm's Swin), ``NCTHW``: each map is its
    stage's output, the stages run by hand, channels first, at a clip other than the built one (6 frames of 24 x 40;
    built: 8 of 32 x 32); ``feature_info``: the stages' widths, the spatial stride (merging halves each side, odd
    sides padded) and the time stride beside it (no merging in time). ``NTHWC`` keeps the stages' own layout."""
    ref = make()
    f = timm.create_model(CPU, features_only=True, **SMALL).eval()
    assert f.output_fmt == "NCTHW" and f.feature_info.out_indices == (0, 1, 2, 3)
    assert f.feature_info.channels() == [16, 32, 64, 128] and f.feature_info.reduction() == [2, 4, 8, 16]
    assert f.feature_info.get("time_reduction") == [1] * 4
    assert not f.model.load_state_dict(ref.state_dict(), strict=False).missing_keys
    x = rand(2, 1, 6, 24, 40)
    with torch.no_grad():
        m, by_hand = ref.embed(x), []
        for stage in ref.layers:
            m = stage(m)
            by_hand.append(m)  # [B, T', H', W', C]
        got = f(x)
        for g, want, r in zip(got, by_hand, f.feature_info.reduction()):
            assert g.shape[1:] == (want.shape[-1], 6, -(-24 // r), -(-40 // r))
            torch.testing.assert_close(g, want.permute(0, 4, 1, 2, 3), rtol=0, atol=0)
        for g, want in zip(got, ref.forward_intermediates(x, intermediates_only=True)):
            torch.testing.assert_close(g, want, rtol=0, atol=0)
        two = timm.create_model(CPU, features_only=True, output_fmt="NTHWC", out_indices=(0, 1), **SMALL).eval()
        two.model.load_state_dict(ref.state_dict(), strict=False)
        assert len(two.model.layers) == 2 and two.feature_info.channels() == [16, 32]  # pruned after stage 1
        for g, want in zip(two(x), by_hand):
            torch.testing.assert_close(g, want, rtol=0, atol=0)


def test_features_only_loads_pretrained_weights(tmp_path):
    assert_features_load_pretrained(make(num_classes=3), rand(1, 1, 4, 16, 16), tmp_path / "export", (1, 3))


def test_export_static_and_dynamic_batch():
    """torch.export at the traced clip size, with a symbolic batch."""
    m = make()
    x = rand(2, 1, 8, 32, 32)
    with torch.no_grad():
        ep = torch.export.export(m, (x,), dynamic_shapes={"x": {0: torch.export.Dim("b", max=64)}})
        for xi in (x, rand(3, 1, 8, 32, 32)):
            torch.testing.assert_close(ep.module()(xi), m(xi), rtol=1e-5, atol=1e-5)


def test_train_config_builds_the_video_swin_on_moving_fmnist(tmp_path):
    """``model=vitrel_swin3d_tiny_patch122_window444_32 data=moving_fmnist`` (the Video Swin docs/video.md names for
    Moving Fashion-MNIST) composes and builds at the data's clip size; an image model on that data names it."""
    from hydra.utils import instantiate

    from tests.train_helpers import compose
    from vitrel.train.run import build_model

    name = "vitrel_swin3d_tiny_patch122_window444_32"
    cfg = compose(tmp_path, [f"model={name}", "data=moving_fmnist", "pos=rel3d_full", "data.num_frames=4"])
    dm = instantiate(cfg.data)
    m = build_model(cfg.model, dm)
    assert isinstance(m, SwinTransformer3D) and m.num_classes == 2
    assert m(torch.randn(1, 1, 4, 32, 32)).shape == (1, 2)
    cfg = compose(tmp_path, ["model=vitrel_swin_tiny_patch2_window4_32", "data=moving_fmnist"])
    with pytest.raises(ValueError, match=f"model={name}"):
        build_model(cfg.model, instantiate(cfg.data))
