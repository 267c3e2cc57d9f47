"""Mean attention distance (``vitrel.viz.attention_distance``) against a float64 loop written from its equation:
``D[l, h] = mean_{images, windows, query patches i} sum_{key patches j} a_ij ||c_i - c_j||`` with patch centres in
pixels (and ``|t_i - t_j|`` in frames for clips): a ViT, a Swin with shifted windows, a video ViT, a Video Swin."""

import itertools
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
    ps = 4
    gh, gw = x.shape[-2] // ps, x.shape[-1] // ps
    out = torch.zeros(len(model.blocks), model.blocks[0].attn.num_heads, dtype=torch.float64)
    for l, (blk, t) in enumerate(zip(model.blocks, seen)):
        p = t.shape[1] - gh * gw  # (the prefix tokens in this block's input)
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


@pytest.mark.parametrize(
    "kw",
    [{}, dict(class_token=False, global_pool="avg"), dict(abs_pos="cpe"), dict(prefix_at=1, reg_tokens=1)],
    ids=["class_token", "no_prefix", "cpe_after_block_0", "prefix_joins_at_block_1"],
)
def test_attention_distance_is_its_equation(kw):
    """The blocks' inputs as the model's forward makes them: CPE's convolution after block 0 (it was left out) and
    prefix tokens joining late (``prefix_at``) included."""
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


def _inputs(model, x):
    """Each block's input caught in a real forward (eval mode, no gradients), blocks in order."""
    blocks = [b for s in model.layers for b in s.blocks] if hasattr(model, "layers") else list(model.blocks)
    seen = []
    hooks = [b.register_forward_pre_hook(lambda m, a: seen.append(a[0])) for b in blocks]
    model.eval()
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return list(zip(blocks, seen))


def _probs(blk, tokens, mask):
    """softmax(q k^T / sqrt(d) + mask) of ``blk`` on ``tokens [B, N, C]`` (pos=none: no bias), float64."""
    attn = blk.attn
    h = blk.norm1(tokens).double()
    b, n, _ = h.shape
    q, k, _ = attn.qkv.double()(h).reshape(b, n, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
    return (q @ k.transpose(-1, -2) / math.sqrt(attn.head_dim) + mask).softmax(-1)


def _same_window(a, b, n, win, shifted):
    """Whether places ``a`` and ``b`` of an axis of ``n`` tokens attend to each other: the window shrinks to an axis
    it covers (no shift there); shifted windows are rolled by half a window, and the tokens that wrapped around stay
    apart from the others (Liu et al. 2021's mask; no padding here)."""
    win = min(win, n)
    s = win // 2 if shifted and n > win else 0
    ra, rb = (a - s) % n, (b - s) % n
    return ra // win == rb // win and (ra >= n - s) == (rb >= n - s)


def _naive_windows(model, x, patch, tubelet=1):
    """A Swin (pos=none) written out on the whole map: the mask from :func:`_same_window` per axis, the distance
    between the tokens' places on the map, pair by pair; a stage's stride doubles at each merge."""
    out_px, out_t = {}, {}
    for l, (blk, m) in enumerate(_inputs(model, x)):
        grid = m.shape[1:-1] if m.dim() == 5 else (1, *m.shape[1:-1])
        win = blk.window_size if len(blk.window_size) == 3 else (1, *blk.window_size)
        stride = patch * (2 ** int(math.log2(round(x.shape[-1] / patch / grid[-1]))))
        places = list(itertools.product(*map(range, grid)))
        n = len(places)
        mask, dpx, dt = (torch.zeros(n, n, dtype=torch.float64) for _ in range(3))
        for i, pi in enumerate(places):
            for j, pj in enumerate(places):
                if not all(_same_window(a, b, g, w, blk.shifted) for a, b, g, w in zip(pi, pj, grid, win)):
                    mask[i, j] = float("-inf")
                dpx[i, j] = math.hypot((pi[1] - pj[1]) * stride, (pi[2] - pj[2]) * stride)
                dt[i, j] = abs(pi[0] - pj[0]) * tubelet
        a = _probs(blk, m.reshape(m.shape[0], n, m.shape[-1]), mask)
        out_px[l], out_t[l] = (a * dpx).sum(-1).mean((0, 2)), (a * dt).sum(-1).mean((0, 2))
    heads = max(len(v) for v in out_px.values())
    nan = float("nan")
    return tuple(torch.stack([torch.cat([v, v.new_full((heads - len(v),), nan)]) for v in d.values()])
                 for d in (out_px, out_t))  # fmt: skip


def test_swin_attention_distance_is_its_equation_with_shifted_windows():
    """Two stages (1 and 2 heads), shifted windows in both (8 x 16 then 4 x 8 tokens, window 4: the second stage's
    rows covered, unshifted), against the whole map written out with the mask from its rule."""
    torch.manual_seed(0)
    small = dict(img_size=(16, 32), in_chans=1, pos="none", num_classes=3, embed_dim=8, depths=(2, 2), num_heads=(1, 2))
    swin = vitrel.create_model("vitrel_swin_tiny_patch2_window4_32", **small).double().train()
    x = torch.randn(2, 1, 16, 32, dtype=torch.float64)
    got = viz.attention_distance(swin, x)
    assert swin.training and got.shape == (4, 2) and got[:2, 1].isnan().all()  # stage 0's blocks have one head
    want, _ = _naive_windows(swin, x, patch=2)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, equal_nan=True)
    # a window's slots in the rolled map are at their places in the image for the pairs the mask allows, and a
    # head spreading its weight over a 4 x 4 window of stride 2 (or 4) looks no further than its diagonal
    assert (got[~got.isnan()] < math.hypot(3, 3) * 4).all()


def _distances(rows: int, cols: int, stride: int):
    """``[N, N]`` pixel distances between the centres of a ``rows x cols`` raster of ``stride``-pixel tokens."""
    c = [(r * stride, k * stride) for r in range(rows) for k in range(cols)]
    return torch.tensor([[math.dist(a, b) for b in c] for a in c], dtype=torch.float64)


def test_swin_with_padded_windows_and_a_bias_matches_its_dense_attention():
    """Maps padded to the window (10 x 14 tokens, window 4) with a learned relative bias: the block's attention over
    the image positions (``SwinBlock.dense_attention``, padding cut), times the distances between them."""

    torch.manual_seed(0)
    small = dict(img_size=(20, 28), pos="rel2d_full", num_classes=3, embed_dim=8, depths=(2, 2), num_heads=(1, 2))
    swin = vitrel.create_model("vitrel_swin_tiny_patch2_window4_32", **small).double().eval()
    x = torch.randn(2, 3, 20, 28, dtype=torch.float64)
    got = viz.attention_distance(swin, x)
    want, stride = torch.full((4, 2), float("nan"), dtype=torch.float64), 2
    with torch.no_grad():
        h, l = swin.embed(x), 0
        for stage in swin.layers:
            if stage.merges:
                h, stride = stage.downsample(h), stride * 2
            for blk in stage.blocks:
                dist = _distances(h.shape[1], h.shape[2], stride)
                v = (blk.dense_attention(h) * dist).sum(-1).mean((0, 2))
                want[l, : len(v)], l, h = v, l + 1, blk(h)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, equal_nan=True)


def test_video_vit_attention_distance_in_pixels_and_frames():
    """A video ViT with a class token (left out) on 4 frames in tubelets of 2: distance in the frame plane in pixels,
    and frames apart (tubelet_size x |dt|), against the pairs written out."""
    torch.manual_seed(0)
    kw = dict(pos="none", embed_dim=16, depth=2, num_heads=2, num_frames=4, tubelet_size=2, img_size=12)
    video = vitrel.create_model("vitrel_vit_video_tiny_patch4_32", class_token=True, global_pool="token", **kw)
    video = video.double()
    x = torch.randn(2, 1, 4, 12, 8, dtype=torch.float64)  # a 2 x 3 x 2 tubelet grid
    px, frames = viz.attention_distance(video, x, frames=True)
    assert px.shape == frames.shape == (2, 2)
    torch.testing.assert_close(viz.attention_distance(video, x), px, rtol=0, atol=0)
    places = list(itertools.product(range(2), range(3), range(2)))  # t-major
    want_px, want_t = torch.zeros(2, 2, dtype=torch.float64), torch.zeros(2, 2, dtype=torch.float64)
    for l, (blk, t) in enumerate(_inputs(video, x)):
        a = _probs(blk, t, torch.zeros(()))
        for hd, img in itertools.product(range(2), range(2)):
            for i, pi in enumerate(places):
                for j, pj in enumerate(places):
                    w = a[img, hd, 1 + i, 1 + j].item()  # the class token: index 0
                    want_px[l, hd] += w * math.hypot((pi[1] - pj[1]) * 4, (pi[2] - pj[2]) * 4) / (2 * len(places))
                    want_t[l, hd] += w * abs(pi[0] - pj[0]) * 2 / (2 * len(places))
    torch.testing.assert_close(px, want_px, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(frames, want_t, rtol=1e-12, atol=1e-12)


def test_video_swin_attention_distance_is_its_equation():
    """A Video Swin (windows 4 x 2 x 2 shifted by 2 frames and 1 token; a frame per tubelet, patch 2)."""
    torch.manual_seed(0)
    small = dict(img_size=8, pos="none", embed_dim=8, depths=(2, 1), num_heads=(1, 2), num_frames=8)
    model = vitrel.create_model("vitrel_swin3d_tiny_patch122_window444_32", window_size=(4, 2, 2), **small).double()
    x = torch.randn(1, 1, 8, 8, 8, dtype=torch.float64)  # 8 x 4 x 4 tokens, then 8 x 2 x 2
    px, frames = viz.attention_distance(model, x, frames=True)
    want_px, want_t = _naive_windows(model, x, patch=2)
    torch.testing.assert_close(px, want_px, rtol=1e-12, atol=1e-12, equal_nan=True)
    torch.testing.assert_close(frames, want_t, rtol=1e-12, atol=1e-12, equal_nan=True)


def _packed(images, rows):
    """timm's NaFlex dict of ``images [C, H, W]`` packed into ``rows`` (lists of image indices), with segment_ids
    and padding ending the shorter rows (4x4 patches)."""
    from timm.data.naflex_transforms import patchify_image

    parts = [patchify_image(img, (4, 4), pad=False) for img in images]
    n = max(sum(len(parts[i][0]) for i in row) for row in rows)
    out = {k: [] for k in ("patches", "patch_coord", "patch_valid", "segment_ids")}
    for row in rows:
        pieces = [(*parts[i], torch.full((len(parts[i][0]),), s)) for s, i in enumerate(row)]
        for key, col in zip(out, zip(*pieces)):
            t = torch.cat(col)
            out[key].append(torch.cat([t, t.new_zeros(n - len(t), *t.shape[1:])]))
    return {k: torch.stack(v) for k, v in out.items()}


def test_packed_naflex_batches_give_each_image_its_own_attention():
    """A packed NaFlex dict (two images to a row, padding, three sizes) through the model's packed path, each block's
    tokens caught there, a key of another image given probability 0: the distance pair by pair over every patch query
    of every image equals what ``attention_distance`` gives on the dict, on the images as a list, and on them batched
    by size and weighted by their queries."""
    model = _vit("ape", dynamic_img_size=True, reg_tokens=1)
    images = [torch.randn(1, *hw, dtype=torch.float64) for hw in ((12, 16), (8, 8), (12, 16), (4, 12))]
    batch = _packed(images, [[0, 1], [2, 3]])
    _, layout, _, _ = model.eval().forward_layout(batch)
    seg, rc = layout.segment, layout.coords
    foreign = seg[:, :, None] != seg[:, None, :]
    mask = torch.zeros(foreign.shape, dtype=torch.float64).masked_fill(foreign, -math.inf)
    want = torch.zeros(2, 2, dtype=torch.float64)
    queries = 0
    for l, (blk, tokens) in enumerate(_inputs(model, batch)):
        a = _probs(blk, tokens, mask[:, None])
        for b, i in itertools.product(range(seg.shape[0]), range(seg.shape[1])):
            if rc[b, i, 0] < 0:  # a prefix token or padding: not a query
                continue
            queries += l == 0
            for j in range(seg.shape[1]):
                if rc[b, j, 0] >= 0:
                    d = 4 * math.hypot(rc[b, i, 0] - rc[b, j, 0], rc[b, i, 1] - rc[b, j, 1])
                    want[l] += a[b, :, i, j] * d
    want /= queries
    assert queries == 12 + 4 + 12 + 3
    for given in (batch, images):
        torch.testing.assert_close(viz.attention_distance(model, given), want, rtol=1e-12, atol=1e-12)
    by_size = [(torch.stack(images[0::2]), 24), (images[1][None], 4), (images[3][None], 3)]
    mean = sum(viz.attention_distance(model, x) * n for x, n in by_size) / queries
    torch.testing.assert_close(mean, want, rtol=1e-12, atol=1e-12)


def test_naflex_images_are_the_images_it_was_made_of():
    from vitrel.models.naflex import parse_naflex

    images = [torch.randn(3, *hw) for hw in ((12, 16), (8, 8), (12, 16), (4, 12))]
    back = parse_naflex(_packed(images, [[0, 1], [2], [3]]), (4, 3)).images(4)
    assert len(back) == 4 and all(torch.equal(a, b) for a, b in zip(back, images))
    dropped = _packed(images[:1], [[0]])
    dropped["patch_valid"][0, 11:] = False  # its last patch dropped: the grid still 3x4
    with pytest.raises(ValueError, match="image 0 of the NaFlex batch has 11 of the 12 patches of its 3x4 grid"):
        parse_naflex(dropped, (4, 3)).images(4)


def test_attention_distance_refuses_what_it_cannot_read():
    with pytest.raises(TypeError, match="ViT, video ViT, Swin or Video Swin"):
        viz.attention_distance(torch.nn.Linear(2, 2), torch.randn(1, 3, 32, 32))
    vit = _vit("none")
    with pytest.raises(ValueError, match="clips"):
        viz.attention_distance(vit, torch.randn(1, 1, 12, 16), frames=True)
    with pytest.raises(ValueError, match=r"images \[B, C, H, W\] or clips"):
        viz.attention_distance(vit, torch.randn(1, 12, 16))


def test_plot_attention_distance_one_series_per_model():
    d = torch.rand(3, 2) * 10
    fig = viz.plot_attention_distance({"rel2d_full": d, "none": d + 1})
    (ax,) = panels(fig)
    assert len(ax.collections) == 2 and [t.get_text() for t in ax.get_legend().get_texts()] == ["rel2d_full", "none"]
    assert sorted(ax.collections[1].get_offsets()[:, 1].tolist()) == sorted((d + 1).ravel().tolist())
    with pytest.raises(ValueError, match="depth, heads"):
        viz.plot_attention_distance(torch.rand(3))


def test_a_video_models_picture_draws_the_frames_beside_the_pixels():
    """A video run's ``attention_distance.png`` showed the pixel distances only (the frames were in the CSV alone)."""
    d, frames = torch.rand(3, 2) * 10, torch.rand(3, 2) * 4
    fig = viz.plot_attention_distance(d, "clips", frames)
    pixels_ax, frames_ax = panels(fig)
    assert frames_ax.get_ylabel() == "mean attention distance (frames)"
    assert sorted(frames_ax.collections[0].get_offsets()[:, 1].tolist()) == sorted(frames.ravel().tolist())
    assert sorted(pixels_ax.collections[0].get_offsets()[:, 1].tolist()) == sorted(d.ravel().tolist())
    with pytest.raises(ValueError, match="frames needs one model's distances"):
        viz.plot_attention_distance({"a": d}, frames=frames)


def test_the_picture_keeps_its_labels_and_legend_clear_of_the_dots():
    """A sweep's picture of a shallow model (2 blocks, three schemes): before, the x label ran off the figure and the
    legend sat on the dots."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = viz.plot_attention_distance({f"pos={p}": torch.rand(2, 4) for p in ("rel2d_factored", "rope2d_axial", "x")})
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    (ax,) = panels(fig)
    whole, drawn = fig.bbox, fig.get_window_extent(renderer)
    for text in (ax.xaxis.label, ax.yaxis.label, ax.title, *ax.get_legend().get_texts()):
        box = text.get_window_extent(renderer)
        assert whole.x0 <= box.x0 and box.x1 <= whole.x1 and drawn.y0 <= box.y0, text.get_text()
    assert ax.get_legend().get_window_extent(renderer).x0 >= ax.get_window_extent(renderer).x1
