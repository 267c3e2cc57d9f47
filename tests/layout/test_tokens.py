"""Tokens carry coordinates: packed rows, padded NaFlex batches, lists of images and token dropping.

The defining property: for every scheme, a packed row gives each image exactly the logits that image gets alone
at its own size (float64 to rounding; float32 within 1e-5), with 0 and 1 prefix tokens and with registers; token
dropping equals the full grid with the dropped tokens removed from attention (keys and queries)."""

from __future__ import annotations

import pytest
import torch

import vitrel
from tests.naflex_inputs import packed
from vitrel.layers.attention import Attention
from vitrel.layout.geometry import Grid
from vitrel.layout.tokens import TokenLayout, gather_pairs, segment_mask
from vitrel.models.naflex import drop_tokens, grid_batch, parse_naflex
from vitrel.pos.registry import get_pos_class, list_pos

#: (the video schemes refuse token layouts: tests/pos/test_bias3d.py)
RELATIVE = [n for n in list_pos() if get_pos_class(n).kind == "relative" and get_pos_class(n).grid_dims != 3]
ABSOLUTE = [n for n in list_pos() if get_pos_class(n).kind == "absolute"]
#: images of different sizes and aspect ratios (patch 4): grids 3x4, 2x2 and 6x5, larger than the models' 4x4 (learned
#: tables extend by their own rule: grow, clip or interpolate)
IMAGES = [(12, 16), (8, 8), (24, 20)]
#: rows of the packed batch: images 0 and 1 in row 0, image 2 in row 1, then padding
ROWS = [[0, 1], [2]]
PREFIXES = {"prefix0": dict(class_token=False, global_pool="avg"), "prefix1": {}, "registers": dict(reg_tokens=2)}


def images(dtype=torch.float64, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, h, w, generator=g, dtype=dtype) for h, w in IMAGES]


def model(pos: str, dtype=torch.float64, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    kw = {"embed_dim": 64, "num_heads": 4, **kw}
    m = vitrel.create_model("vitrel_vit_tiny_patch4_32", pos=pos, img_size=16, num_classes=5, depth=2, **kw)
    return m.to(dtype).eval()


def alone(m, imgs, rows=ROWS) -> torch.Tensor:
    return torch.cat([m(imgs[i][None]) for r in rows for i in r])


# ----------------------------------------------------------------------------------- the defining property
@pytest.mark.parametrize("prefix", list(PREFIXES))
@pytest.mark.parametrize("pos", RELATIVE + ABSOLUTE)
def test_packed_row_gives_each_image_its_logits_alone(pos, prefix):
    m, imgs = model(pos, **PREFIXES[prefix]), images()
    with torch.no_grad():
        got, ref = m(packed(imgs)), alone(m, imgs)
    assert got.shape == (3, 5)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-10)


@pytest.mark.parametrize("pos", ["rel2d_full", "rope2d_mixed", "shaw2d_full", "lookhere", "pape", "rel1d_bucket"])
def test_packed_float32_within_1e5_and_lists_of_images(pos):
    m, imgs = model(pos, torch.float32, reg_tokens=1), images(torch.float32)
    with torch.no_grad():
        ref = alone(m, imgs)
        torch.testing.assert_close(m(packed(imgs)), ref, rtol=0, atol=1e-5)
        torch.testing.assert_close(m(imgs), torch.cat([m(i[None]) for i in imgs]), rtol=0, atol=1e-5)


@pytest.mark.parametrize("pos", ["rel2d_factored", "rope2d_axial", "shaw2d_factored", "pape_ri", "liere"])
def test_packed_gradients_equal_the_sum_of_each_image_alone(pos):
    m, imgs = model(pos), images()
    m(packed(imgs)).square().sum().backward()
    got = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad()
    alone(m, imgs).square().sum().backward()
    assert got
    for n, p in m.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(got[n], p.grad, rtol=0, atol=1e-10, msg=n)


@pytest.mark.parametrize(
    "pos,terms", [("shaw2d_factored", 2), ({"name": "irpe", "rpe_on": "qkv"}, 3), ({"name": "irpe", "rpe_on": "k"}, 1)]
)
def test_packed_content_terms_scatter_only_for_the_terms_a_scheme_has(pos, terms, monkeypatch):
    """A packed batch scatters its tokens (or attention) per image once per content term the scheme has: Shaw's keys
    and iRPE's unused terms are not scattered for nothing."""
    import vitrel.kernels.common as common

    scattered = []
    groups = common._image_groups
    monkeypatch.setattr(common, "_image_groups", lambda layout: scattered.append(1) or groups(layout))
    m, imgs = model(pos), images()
    with torch.no_grad():
        m(packed(imgs))
    assert len(scattered) == 2 * terms  # the model's two blocks


@pytest.mark.parametrize("impl", ["fold", "eager"])
def test_packed_through_other_kernels(impl):
    m, imgs = model("rel2d_factored", attn_impl=impl), images()
    with torch.no_grad():
        torch.testing.assert_close(m(packed(imgs)), alone(m, imgs), rtol=0, atol=1e-10)


@pytest.mark.parametrize("pos", ["rel2d_full", "lookhere"])
def test_flex_document_mask_reads_offsets_from_coordinates(pos):
    """FlexAttention on a packed batch (inference on CPU): the bias read by each token pair's coordinate offset in its
    own image's table (LookHere: with its views' block mask), blocks across images skipped by the document mask."""
    imgs = images(torch.float32)
    flex, sdpa = model(pos, torch.float32, attn_impl="flex"), model(pos, torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(flex(packed(imgs)), alone(sdpa, imgs), rtol=0, atol=1e-5)


def test_pos_share_and_intermediates_per_token():
    m, imgs = model("rel2d_full", pos_share=True), images()
    d = packed(imgs)
    with torch.no_grad():
        torch.testing.assert_close(m(d), alone(m, imgs), rtol=0, atol=1e-10)
        final, feats = m.forward_intermediates(d, indices=[0, 1], output_fmt="NLC")
        n = d["patches"].shape[1]
        assert [f.shape for f in feats] == [(2, n, m.embed_dim)] * 2
        # image 2 (row 1) alone: its patch tokens, in the input's order
        solo = m.forward_intermediates(imgs[2][None], indices=[1], output_fmt="NLC", intermediates_only=True)[0]
        k = solo.shape[1]
        torch.testing.assert_close(feats[1][1, :k], solo[0], rtol=0, atol=1e-10)
        f = m.forward_features(d)  # timm's NaFlexVit dict, with the layout (a packed dict: no patch_valid)
        assert f["patches"].shape == (2, n + 2, m.embed_dim)  # one class token per image, two images in row 0
        with pytest.raises(ValueError, match="NLC"):
            m.forward_intermediates(d, output_fmt="NCHW")


# ----------------------------------------------------------------------------------- token dropping
@pytest.mark.parametrize("pos", ["rel2d_full", "rope2d_mixed", "shaw2d_full", "pape", "alibi1d", "ape"])
def test_token_dropping_equals_the_full_grid_with_dropped_tokens_masked(pos):
    m = model(pos, reg_tokens=1, token_drop=0.4).train()
    x = torch.randn(2, 3, 16, 12, dtype=torch.float64)
    torch.manual_seed(5)
    got, layout, _, _ = m.forward_layout(x)
    p, grid = m.num_prefix_tokens, Grid(4, 3)
    n = p + grid.n
    kept = torch.zeros(2, n, dtype=torch.bool)
    kept[:, :p] = True
    rows, cols = layout.coords[..., 0], layout.coords[..., 1]
    for b in range(2):
        sel = rows[b] >= 0
        kept[b, p + rows[b, sel] * grid.w + cols[b, sel]] = True
    assert int(kept.sum()) == 2 * (p + round(0.6 * grid.n))
    mask = torch.zeros(2, 1, n, n, dtype=torch.float64).masked_fill(~kept[:, None, None, :], float("-inf"))
    ref, g = m.embed(x)
    for blk, st in zip(m.blocks, m.position_states(g, ref)):
        ref = blk(ref, mask=mask, pos_state=st)
    ref = m.norm(ref)
    for b in range(2):
        idx = layout.index[b][layout.valid[b]]
        torch.testing.assert_close(got[b][layout.valid[b]], ref[b, idx], rtol=0, atol=1e-10)


def test_token_drop_range_and_eval_uses_every_token():
    m = model("rel2d_full", token_drop=(0.2, 0.6))
    x = torch.randn(8, 3, 16, 16, dtype=torch.float64)
    m.train()
    _, layout, _, _ = m.forward_layout(x)
    counts = torch.bincount(layout.image[layout.is_patch], minlength=8)
    assert counts.min() >= round(0.4 * 16) and counts.max() <= round(0.8 * 16) and len(set(counts.tolist())) > 1
    assert m(x).shape == (8, 5)
    m.eval()
    with torch.no_grad():
        torch.testing.assert_close(m(x), m.forward_head(m.forward_features(x)))
    with pytest.raises(ValueError, match="token_drop"):
        model("rel2d_full", token_drop=1.0)
    with pytest.raises(ValueError, match="low <= high"):
        model("rel2d_full", token_drop=(0.5, 0.1))


def test_drop_tokens_keeps_coordinates_and_compacts_rows():
    tokens = torch.arange(2 * 12, dtype=torch.float64).reshape(2, 12, 1)
    batch = grid_batch(tokens, Grid(3, 4))
    out = drop_tokens(batch, torch.tensor([0.5, 0.25]), torch.Generator().manual_seed(0))
    assert out.patches.shape[1] == 9  # the longer row: 9 of 12 kept
    assert (out.segment >= 0).sum(1).tolist() == [6, 9]
    for b in range(2):
        v = out.segment[b] >= 0
        r, c = out.coords[b, v].unbind(-1)
        torch.testing.assert_close(out.patches[b, v, 0], tokens[b, r * 4 + c, 0])  # each kept token at its place
        assert torch.unique(r * 4 + c).numel() == int(v.sum())


# ----------------------------------------------------------------------------------- layouts, attention level
def test_attention_on_a_layout_equals_each_image_alone_for_every_scheme_and_head_mask():
    torch.manual_seed(0)
    grids = [Grid(3, 4), Grid(2, 2)]
    pre = [(-1, 0)]
    coords = pre + [(r, c) for r in range(3) for c in range(4)] + pre + [(r, c) for r in range(2) for c in range(2)]
    seg = [0] * 13 + [1] * 5
    layout = TokenLayout.build(
        torch.tensor([seg + [-1]]), torch.tensor([coords + [(-1, -1)]]), torch.tensor([seg + [-1]]), grids, 1
    )
    mask = segment_mask(layout, torch.float64)[0, 0]
    assert torch.isinf(mask[:13, 13:]).all() and (mask[:13, :13] == 0).all() and mask[-1, -1] == 0
    assert torch.isinf(mask[:-1, -1]).all()  # nobody reads the padding
    for name in RELATIVE:
        attn = Attention(32, 4, pos=name, grid=(3, 3), num_prefix_tokens=1).double().eval()
        x = torch.randn(1, 19, 32, dtype=torch.float64)
        with torch.no_grad():
            out = attn(x, layout)
            torch.testing.assert_close(out[:, :13], attn(x[:, :13], grids[0]), rtol=0, atol=1e-10, msg=name)
            torch.testing.assert_close(out[:, 13:18], attn(x[:, 13:18], grids[1]), rtol=0, atol=1e-10, msg=name)


def test_gather_pairs_reads_each_images_own_bias():
    grids = [Grid(2, 2), Grid(1, 3)]
    per = [torch.randn(2, 4, 4), torch.randn(2, 3, 3)]
    layout = TokenLayout.build(
        torch.tensor([[0, 0, 0, 0, 1, 1, 1]]),
        torch.tensor([[(0, 0), (0, 1), (1, 0), (1, 1), (0, 0), (0, 1), (0, 2)]]),
        torch.tensor([[0, 0, 0, 0, 1, 1, 1]]),
        grids,
        0,
    )
    got = gather_pairs(per, layout)[0]
    torch.testing.assert_close(got[:, :4, :4], per[0])
    torch.testing.assert_close(got[:, 4:, 4:], per[1])


# ----------------------------------------------------------------------------------- bad input
def _dict(**change):
    d = packed(images(torch.float32))
    d.update(change)
    return d


def test_bad_batches_each_get_one_clear_error():
    m = model("rel2d_full", torch.float32)
    d = _dict()
    seg1 = torch.where(d["patch_valid"], d["segment_ids"] + 1, 0)
    with pytest.raises(ValueError, match="start at 0.*T5X"):
        m(_dict(segment_ids=seg1))
    gap = d["segment_ids"].clone()
    gap[0][gap[0] == 1] = 2
    with pytest.raises(ValueError, match="image with no tokens"):
        m(_dict(segment_ids=gap))
    twice = d["patch_coord"].clone()
    twice[0, 1] = twice[0, 0]
    with pytest.raises(ValueError, match="appears twice"):
        m(_dict(patch_coord=twice))
    hole = d["patch_valid"].clone()
    hole[0, 2] = False
    with pytest.raises(ValueError, match="padding"):
        m(_dict(patch_valid=hole))
    with pytest.raises(ValueError, match="P\\*P\\*C"):
        m(_dict(patches=d["patches"][..., :-1]))
    with pytest.raises(ValueError, match="missing"):
        m({"patches": d["patches"]})
    with pytest.raises(ValueError, match="multiples of the patch size"):
        m([torch.randn(3, 10, 12)])


def test_parse_naflex_takes_timms_padded_dict_as_is():
    """timm's own NaFlex collator output (one image per row, padded, with its extra 'seq_len' key)."""
    from timm.data.naflex_dataset import NaFlexCollator
    from timm.data.naflex_transforms import Patchify

    imgs = images(torch.float32)
    batch, _ = NaFlexCollator(max_seq_len=32)([(Patchify(4)(im), 0) for im in imgs])
    parsed = parse_naflex(batch, 48)
    assert parsed.image_grids == (Grid(3, 4), Grid(2, 2), Grid(6, 5))
    m = model("rope2d_mixed", torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(m(batch), torch.cat([m(i[None]) for i in imgs]), rtol=0, atol=1e-5)
