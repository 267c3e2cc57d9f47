"""Swin on a batch of images of different sizes in one forward (a list of images, or timm's NaFlex dict of full
grids): every image gets exactly the logits (and gradients) it gets alone at its own size."""

from __future__ import annotations

import pytest
import torch
from timm.data.naflex_transforms import patchify_image
from timm.layers import DropPath

from vitrel.layout.geometry import Grid
from vitrel.layout.tokens import TokenLayout
from vitrel.models.swin import MixedMaps, SwinTransformer
from vitrel.models.swin_blocks import image_maps, pack_maps, per_image
from vitrel.pos.registry import get_pos_class, list_pos

RELATIVE = sorted({n for n in list_pos() if get_pos_class(n).kind == "relative"} | {"none"})
PATCH = 4
# 8x8 patches; 12x7 (padding to the window, an odd side at the merge, a shift along one axis only at stage 2);
# 4x16 (stage 2 is 2x8: the window shrinks to 2x4, its own window batch)
SIZES = [(32, 32), (48, 28), (16, 64)]


def _model(pos: str = "rel2d_full", dtype: torch.dtype = torch.float64, **kw) -> SwinTransformer:
    torch.manual_seed(0)
    args = dict(img_size=32, patch_size=PATCH, num_classes=5, embed_dim=16, depths=(2, 2), num_heads=(2, 2))
    args.update(window_size=4, drop_path_rate=0.0, pos=pos)
    args.update(kw)
    m = SwinTransformer(**args).eval().to(dtype)
    with torch.no_grad():  # non-trivial position terms (zero-initialised tables would hide a wrong offset)
        for name, p in m.named_parameters():
            if ".pos." in name or name.startswith(("rel_pos", "abs_pos")) or ".rel_pos." in name:
                p.add_(0.5 * torch.randn_like(p))
    return m


def _images(dtype: torch.dtype = torch.float64, sizes=SIZES) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(3, h, w, generator=g, dtype=dtype) for h, w in sizes]


def _alone(model: SwinTransformer, images: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([model(img[None]) for img in images])


def _naflex(images: list[torch.Tensor], shuffle: bool = False) -> dict[str, torch.Tensor]:
    """timm's patchify_image on each image: images 0 and 1 packed in row 0 (segment_ids), image 2 alone in row 1,
    rows padded to the longest. ``shuffle``: image 1's tokens in a random order."""
    parts = [patchify_image(img, (PATCH, PATCH)) for img in images]
    if shuffle:
        p, c, v = parts[1]
        perm = torch.randperm(p.shape[0], generator=torch.Generator().manual_seed(2))
        parts[1] = (p[perm], c[perm], v[perm])
    rows = [[0, 1], [2]]
    n = max(sum(parts[i][0].shape[0] for i in row) for row in rows)
    d = parts[0][0].shape[1]
    batch = {
        "patches": torch.zeros(len(rows), n, d, dtype=images[0].dtype),
        "patch_coord": torch.zeros(len(rows), n, 2, dtype=torch.long),
        "patch_valid": torch.zeros(len(rows), n, dtype=torch.bool),
        "segment_ids": torch.zeros(len(rows), n, dtype=torch.long),
    }
    for r, row in enumerate(rows):
        at = 0
        for s, i in enumerate(row):
            p, c, v = parts[i]
            sl = slice(at, at + p.shape[0])
            batch["patches"][r, sl], batch["patch_coord"][r, sl], batch["patch_valid"][r, sl] = p, c, v
            batch["segment_ids"][r, sl] = s
            at += p.shape[0]
    return batch


# ---------------------------------------------------------------------------- the defining property
@pytest.mark.parametrize("pos", RELATIVE)
def test_list_matches_alone_float64(pos: str) -> None:
    m, imgs = _model(pos), _images()
    with torch.no_grad():
        mixed, alone = m(imgs), _alone(m, imgs)
    assert mixed.shape == (len(imgs), 5)
    torch.testing.assert_close(mixed, alone, rtol=0, atol=1e-10)


@pytest.mark.parametrize("pos", RELATIVE)
def test_list_matches_alone_float32(pos: str) -> None:
    m, imgs = _model(pos, torch.float32), _images(torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(m(imgs), _alone(m, imgs), rtol=0, atol=1e-5)


@pytest.mark.parametrize("pos", RELATIVE)
def test_naflex_dict_matches_alone(pos: str) -> None:
    m, imgs = _model(pos), _images()
    with torch.no_grad():
        alone = _alone(m, imgs)
        torch.testing.assert_close(m(_naflex(imgs)), alone, rtol=0, atol=1e-10)
        torch.testing.assert_close(m(_naflex(imgs, shuffle=True)), alone, rtol=0, atol=1e-10)


@pytest.mark.parametrize("pos", ["rel2d_full", "rope2d_mixed", "shaw2d_full", "pape"])
def test_naflex_dict_matches_alone_float32(pos: str) -> None:
    m, imgs = _model(pos, torch.float32), _images(torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(m(_naflex(imgs)), _alone(m, imgs), rtol=0, atol=1e-5)


@pytest.mark.parametrize("pos", RELATIVE)
def test_list_gradients_match_per_image(pos: str) -> None:
    m, imgs = _model(pos), _images()
    w = torch.randn(len(imgs), 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    for i, img in enumerate(imgs):  # the sum of per-image backwards
        (m(img[None])[0] * w[i]).sum().backward()
    alone = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad(set_to_none=True)
    (m(imgs) * w).sum().backward()
    mixed = {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
    assert mixed.keys() == alone.keys() and alone
    for n in alone:
        torch.testing.assert_close(mixed[n], alone[n], rtol=0, atol=1e-10, msg=n)


def test_input_gradients_match_per_image() -> None:
    m = _model("rel2d_full")
    imgs = [img.requires_grad_() for img in _images()]
    m(imgs).sum().backward()
    mixed = [img.grad.clone() for img in imgs]
    for img, g in zip(imgs, mixed):
        img.grad = None
        m(img[None]).sum().backward()
        torch.testing.assert_close(g, img.grad, rtol=0, atol=1e-10)


# ---------------------------------------------------------------------------- model variants
@pytest.mark.parametrize(
    "kw",
    [
        dict(pos_share=True),
        dict(abs_pos="ape"),
        dict(pos="sincos2d"),
        dict(attn_impl="eager"),
        dict(pos="rel2d_factored", attn_impl="fold"),
        dict(window_size=3),
        dict(depths=(1, 2, 1), num_heads=(2, 2, 4)),
        dict(global_pool="max"),
        dict(global_pool="avgmax"),
    ],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()),
)
def test_variants_match_alone(kw: dict) -> None:
    m, imgs = _model(**kw), _images()
    with torch.no_grad():
        torch.testing.assert_close(m(imgs), _alone(m, imgs), rtol=0, atol=1e-10)
        torch.testing.assert_close(m(_naflex(imgs)), _alone(m, imgs), rtol=0, atol=1e-10)


def test_grad_checkpointing_matches_alone() -> None:
    m, imgs = _model(), _images()
    m.set_grad_checkpointing(True)
    m.train()  # no dropout, no drop path: train mode only enables checkpointing
    torch.testing.assert_close(m(imgs), _alone(m, imgs), rtol=0, atol=1e-10)


def test_same_size_list_equals_tensor_batch() -> None:
    m, imgs = _model(), _images(sizes=[(32, 48)] * 3)
    with torch.no_grad():
        torch.testing.assert_close(m(imgs), m(torch.stack(imgs)), rtol=0, atol=1e-10)


def test_forward_features_gives_each_image_its_map() -> None:
    m, imgs = _model(), _images()
    with torch.no_grad():
        feats = m.forward_features(imgs)
        assert isinstance(feats, MixedMaps)
        assert feats.tokens.shape == (sum(g.h * g.w for g in feats.grids), m.num_features)
        for img, fmap in zip(imgs, feats.maps()):
            torch.testing.assert_close(fmap, m.forward_features(img[None]), rtol=0, atol=1e-10)
        torch.testing.assert_close(m.forward_head(feats, pre_logits=True), torch.cat([m.pool(f) for f in feats.maps()]))


def test_stochastic_depth_drawn_per_image() -> None:
    layout = TokenLayout.packed((Grid(2, 5), Grid(2, 3), Grid(1, 3)))
    tokens = torch.ones(1, 10 + 6 + 3, 4)
    dp = DropPath(0.5).train()
    for seed in range(20):
        torch.manual_seed(seed)
        out = per_image(dp, tokens, layout)
        assert out.shape == tokens.shape
        for chunk in out[0].split(layout.image_sizes):  # each image kept whole (x2) or dropped whole (0)
            assert chunk.unique().numel() == 1 and chunk[0, 0].item() in (0.0, 2.0)
    dp.eval()
    assert per_image(dp, tokens, layout) is tokens


# ---------------------------------------------------------------------------- errors
def test_naflex_segment_missing_coordinates() -> None:
    m, imgs = _model(), _images()
    batch = _naflex(imgs)
    batch["patch_valid"][0, 70] = False  # image 1 (row 0, segment 1) loses a patch in the middle: ...
    keep = batch["patch_valid"][0].clone()
    for k in ("patches", "patch_coord", "segment_ids"):  # ... compacted, padding last
        batch[k][0] = torch.cat([batch[k][0][keep], batch[k][0][~keep]])
    batch["patch_valid"][0] = torch.cat([keep[keep], keep[~keep]])
    with pytest.raises(ValueError, match=r"full grid; token dropping is for the ViT: image 1 .* 83 of the 12 x 7"):
        m(batch)


def test_image_not_a_multiple_of_the_patch() -> None:
    m = _model()
    with pytest.raises(ValueError, match="not a positive multiple of the patch size 4"):
        m(_images(sizes=[(32, 32), (30, 32)]))


def test_list_of_non_images() -> None:
    m = _model()
    with pytest.raises(ValueError, match=r"tensors \[C, H, W\]"):
        m([torch.randn(2, 3, 32, 32, dtype=torch.float64)])  # a batch in the list (one image [1, C, H, W] is taken)


def test_mixed_needs_a_pool() -> None:
    m = _model(global_pool="")
    with pytest.raises(ValueError, match=r"need a global_pool \('avg', 'max' or 'avgmax'"):
        m(_images())


def test_forward_intermediates_refuses_a_list() -> None:
    with pytest.raises(ValueError, match="one size"):
        _model().forward_intermediates(_images())


def test_strict_img_size_checks_each_image() -> None:
    m = _model(strict_img_size=True)
    with pytest.raises(ValueError, match="does not match the model's img_size"):
        m(_images())
    with pytest.raises(ValueError, match="does not match the model's img_size"):
        m(_naflex(_images()))
    with torch.no_grad():
        imgs = _images(sizes=[(32, 32)] * 3)
        torch.testing.assert_close(m(_naflex(imgs)), _alone(m, imgs), rtol=0, atol=1e-10)


@pytest.mark.parametrize("shifted", [False, True])
def test_block_alone_on_mixed_maps(shifted: bool) -> None:
    """A block called without its stage prepares its own scheme per window grid."""
    blk = _model("rel2d_cpb").layers[0].blocks[int(shifted)]
    g = torch.Generator().manual_seed(4)
    maps = [torch.randn(1, h, w, 16, generator=g, dtype=torch.float64) for h, w in [(8, 8), (6, 11), (3, 9)]]
    with torch.no_grad():
        x, layout = pack_maps(maps)
        out = blk(x, layout)
        for got, m in zip(image_maps(out, layout), maps):
            torch.testing.assert_close(got, blk(m), rtol=0, atol=1e-10)
