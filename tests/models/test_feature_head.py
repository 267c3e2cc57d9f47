"""timm's feature-extraction split on the ViT: ``forward_head(forward_features(x)) == forward(x)`` for every input form.

A token layout (timm's NaFlex dict, padded or packed, a list of images, token dropping with a range of rates) has
padding and, packed, several images per row: ``forward_features`` returns timm's NaFlexVit dict (``patches``,
``patch_valid``) with the ``layout`` so that ``forward_head`` pools each image's own tokens, as ``forward`` does.
Checked in float64 against ``forward``, against each image alone, and against timm's ``global_pool_naflex``."""

from __future__ import annotations

import pytest
import torch
from timm.models.naflexvit import global_pool_naflex

import vitrel
from tests.naflex_inputs import packed
from tests.reference import naive_pool
from vitrel.models.naflex import images_batch

SIZES = [(12, 16), (8, 8), (24, 20)]  # patch 4: grids 3x4, 2x2, 6x5
CONFIGS = {
    "token": {},
    "avg": dict(global_pool="avg"),
    "avg_no_fc_norm": dict(global_pool="avg", fc_norm=False),
    "registers_avg": dict(global_pool="avg", reg_tokens=2),
    "registers_token": dict(reg_tokens=2),
    "no_prefix_avg": dict(class_token=False, global_pool="avg"),
}


def model(**kw) -> torch.nn.Module:
    torch.manual_seed(0)
    m = vitrel.create_model(
        "vitrel_vit_tiny_patch4_32", img_size=16, num_classes=5, depth=2, embed_dim=32, num_heads=2, **kw
    )
    return m.double().eval()


def images() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(3, h, w, generator=g, dtype=torch.float64) for h, w in SIZES]


def alone(m, imgs) -> torch.Tensor:
    return torch.cat([m(img[None]) for img in imgs])


def split(m, x, seed=None):
    """``forward`` and ``forward_head(forward_features(x))`` (and with ``pre_logits``), the same drawn tokens."""
    if seed is not None:
        torch.manual_seed(seed)
    want = m(x)
    if seed is not None:
        torch.manual_seed(seed)
    f = m.forward_features(x)
    return want, f, m.forward_head(f), m.head(m.forward_head(f, pre_logits=True))


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("form", ["padded", "packed", "list"])
def test_head_of_features_is_forward_on_layouts(cfg, form):
    m, imgs = model(**CONFIGS[cfg]), images()
    x = {"padded": images_batch(imgs, 4), "packed": packed(imgs), "list": imgs}[form]
    with torch.no_grad():
        want, f, got, via_pre = split(m, x)
        ref = alone(m, imgs)
    torch.testing.assert_close(want, ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(via_pre, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(m.forward_head(**f), want, rtol=0, atol=1e-12)  # timm's forward: forward_head(**f)


@pytest.mark.parametrize("cfg", ["token", "avg_no_fc_norm", "registers_avg"])
@pytest.mark.parametrize("rate", [0.4, 0.125, (0.1, 0.7)])  # 0.125: 12 * 0.875 = 10.5, rounded to 10 (even)
@pytest.mark.parametrize("form", ["images", "padded", "packed"])
def test_head_of_features_is_forward_with_token_drop(cfg, rate, form):
    m, imgs = model(token_drop=rate, **CONFIGS[cfg]).train(), images()
    x = {"images": torch.randn(6, 3, 16, 12, dtype=torch.float64), "padded": images_batch(imgs, 4)}.get(form)
    x = packed(imgs) if x is None else x
    want, f, got, via_pre = split(m, x, seed=3)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(via_pre, want, rtol=0, atol=1e-12)
    if form == "images" and not isinstance(rate, tuple):  # one rate: every image keeps as many tokens, no padding
        assert isinstance(f, torch.Tensor)


@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_images_keep_tensor_features(cfg):
    m = model(**CONFIGS[cfg])
    x = torch.randn(2, 3, 16, 12, dtype=torch.float64)
    with torch.no_grad():
        f = m.forward_features(x)
        assert type(f) is torch.Tensor and f.shape == (2, m.num_prefix_tokens + 12, 32)
        torch.testing.assert_close(m.forward_head(f), m(x), rtol=0, atol=0)
        torch.testing.assert_close(m.forward_head(f, pre_logits=True), m.fc_norm(m.pool(f)), rtol=0, atol=0)


@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_timm_call_form_on_a_padded_dict(cfg):
    """timm's NaFlexVit form: ``forward_head(f['patches'], patch_valid=f['patch_valid'])``, pooled as timm's
    ``global_pool_naflex`` pools (patch-only validity ``[B, N - P]``, prefix tokens excluded)."""
    m, imgs = model(**CONFIGS[cfg]), images()
    x = images_batch(imgs, 4)
    with torch.no_grad():
        f = m.forward_features(x)
        assert isinstance(f, dict) and f["patch_valid"].dtype == torch.bool
        p, pv = m.num_prefix_tokens, f["patch_valid"]
        assert pv.shape == (3, f["patches"].shape[1] - p)
        assert pv.sum(1).tolist() == [h * w // 16 for h, w in SIZES]
        got = m.forward_head(f["patches"], patch_valid=pv)
        torch.testing.assert_close(got, m(x), rtol=0, atol=1e-12)
        timm_pool = global_pool_naflex(f["patches"], pv, pool_type=m.global_pool, num_prefix_tokens=p)
        torch.testing.assert_close(m.forward_head(f["patches"], patch_valid=pv, pre_logits=True), m.fc_norm(timm_pool))
        with pytest.raises(ValueError, match="patch_valid"):
            m.forward_head(f["patches"], patch_valid=pv[:, 1:])


def test_packed_features_refuse_the_padded_form():
    """A packed row holds several images: no ``patch_valid`` can pool it; the lookup says what to do instead."""
    m = model(global_pool="avg")
    with torch.no_grad():
        f = m.forward_features(packed(images()))
    assert "patch_valid" not in f and f["patches"].shape[0] == 2
    with pytest.raises(KeyError, match="forward_head"):
        f["patch_valid"]
    with pytest.raises(ValueError, match="layout"):
        m.forward_head(f, patch_valid=torch.ones(2, 3, dtype=torch.bool))


def test_token_pool_of_packed_rows_reads_each_images_class_token():
    """``global_pool='token'`` on a packed row: each image's own class token (the first token of the row is image
    0's only)."""
    m, imgs = model(), images()
    with torch.no_grad():
        f = m.forward_features(packed(imgs))
        torch.testing.assert_close(m.forward_head(f), alone(m, imgs), rtol=0, atol=1e-10)
        assert m.forward_head(f["patches"]).shape[0] == 2  # the bare tensor: one row per row of the batch


def test_global_pool_none_on_a_layout():
    """``global_pool=''``: the head on every token, as ``forward``."""
    m = model(global_pool="")
    x = images_batch(images(), 4)
    with torch.no_grad():
        torch.testing.assert_close(m.forward_head(m.forward_features(x)), m(x), rtol=0, atol=0)


# ----------------------------------------------------------------------------------- timm's max, avgmax, map
POOLS = {
    "max": dict(global_pool="max", reg_tokens=1),
    "avgmax": dict(global_pool="avgmax", reg_tokens=1),
    "map": dict(global_pool="map", class_token=False),  # SigLIP's
    "map_registers": dict(global_pool="map", reg_tokens=1),
    "attentive": dict(global_pool="map", class_token=False, attn_pool_type="attentive", attn_pool_depth=2),
}


def pooling_model(cfg: str, **kw) -> torch.nn.Module:
    m = model(**POOLS[cfg], **kw)
    with torch.no_grad():  # away from init (zero biases, the latent's scale), so every part of the pool shows
        for p in m.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return m


def naive_logits(m, imgs) -> torch.Tensor:
    """Each image alone (its own full grid), its patch tokens pooled by :func:`naive_pool`, then timm's head."""
    p = m.num_prefix_tokens
    return torch.stack([m.head(m.fc_norm(naive_pool(m, m.forward_features(img[None])[0, p:]))) for img in imgs])


def grads(m, logits: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
    return torch.autograd.grad((logits * w).sum(), list(m.parameters()), allow_unused=True)


@pytest.mark.parametrize("cfg", list(POOLS))
@pytest.mark.parametrize("form", ["images", "padded", "packed", "list", "patch_valid"])
def test_max_avgmax_and_map_pool_each_images_own_patches_on_every_input(cfg, form):
    """timm's ViT pools ``max``, ``avgmax`` and ``map`` (SigLIP's attention pool); vitrel's ViT refused them (a
    ``ValueError``). On every input form each image's logits and every parameter's gradient are those of the image
    alone pooled from the equations (float64): prefix tokens, padding and the other images of a packed row never
    reach an image's pool."""
    m = pooling_model(cfg)
    imgs = images() if form != "images" else list(torch.randn(3, 3, 16, 12, dtype=torch.float64).unbind())
    if form == "patch_valid":  # timm's NaFlexVit form: forward_head(f['patches'], patch_valid=f['patch_valid'])
        f = m.forward_features(images_batch(imgs, 4))
        got = m.forward_head(f["patches"], patch_valid=f["patch_valid"])
    else:
        x = {"padded": images_batch, "packed": lambda i, _: packed(i), "list": lambda i, _: i}.get(form)
        got = m(torch.stack(imgs) if x is None else x(imgs, 4))
    want = naive_logits(m, imgs)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    w = torch.randn(want.shape, dtype=torch.float64)
    for a, b, (name, _) in zip(grads(m, got, w), grads(m, want, w), m.named_parameters()):
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize("cfg", list(POOLS))
def test_padding_never_wins_a_max_or_takes_attention(cfg):
    """Padding slots holding huge values (a kernel's leftovers) change no image's pool, on the layout and in timm's
    ``patch_valid`` form."""
    m, imgs = pooling_model(cfg), images()
    with torch.no_grad():
        f = m.forward_features(images_batch(imgs, 4))
        want = m(imgs)
        p, valid = m.num_prefix_tokens, f["patch_valid"]
        f["patches"][:, p:][~valid] = 1e6
        torch.testing.assert_close(m.forward_head(f), want, rtol=0, atol=1e-12)
        torch.testing.assert_close(m.forward_head(f["patches"], patch_valid=valid), want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("cfg", list(POOLS))
@pytest.mark.parametrize("form", ["images", "packed"])
def test_max_avgmax_and_map_pool_the_kept_tokens_under_token_drop(cfg, form):
    """``token_drop`` in training: each image pools its kept patch tokens (forward, features + head)."""
    m = pooling_model(cfg, token_drop=(0.2, 0.7)).train()
    x = torch.randn(3, 3, 16, 12, dtype=torch.float64) if form == "images" else packed(images())
    want, f, got, via_pre = split(m, x, seed=3)
    torch.manual_seed(3)
    tokens, layout, _, _ = m.forward_layout(x)
    ref = torch.stack(
        [
            m.head(m.fc_norm(naive_pool(m, tokens[layout.is_patch & (layout.image == i)])))
            for i in range(layout.num_images)
        ]
    )
    assert int(layout.is_patch.sum()) < sum(g.h * g.w for g in layout.image_grids)  # (some dropped)
    torch.testing.assert_close(want, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(via_pre, want, rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------------- forward_intermediates
@pytest.mark.parametrize("rate", [0.4, 0.125, (0.1, 0.7)])  # 0.125: 12 * 0.875 = 10.5, rounded to 10 (even)
@pytest.mark.parametrize("form", ["images", "packed"])
def test_intermediates_of_dropped_tokens_come_with_their_coordinates(rate, form):
    """In training with ``token_drop`` the NLC intermediates are the kept tokens: ``output_dict=True`` gives their
    ``patch_coord`` / ``patch_valid`` / ``segment_ids`` (each token at its place in the final features); without it,
    a clear error (timm's NaFlexVit asks the same under patch dropout)."""
    m = model(token_drop=rate, reg_tokens=1).train()
    x = torch.randn(3, 3, 16, 12, dtype=torch.float64) if form == "images" else packed(images())
    with pytest.raises(ValueError, match="output_dict=True"):
        m.forward_intermediates(x, output_fmt="NLC")
    torch.manual_seed(3)
    d = m.forward_intermediates(x, indices=[1], norm=True, output_fmt="NLC", output_dict=True)
    torch.manual_seed(3)
    _, layout, _, _ = m.forward_layout(x)
    torch.manual_seed(3)
    f = m.forward_features(x)
    assert set(d) == {"image_intermediates", "image_features", "patch_coord", "patch_valid", "segment_ids"}
    tokens, got, valid = (
        (f if isinstance(f, torch.Tensor) else f["patches"]),
        d["image_intermediates"][0],
        d["patch_valid"],
    )
    torch.testing.assert_close(
        d["image_features"] if isinstance(f, torch.Tensor) else d["image_features"]["patches"], tokens
    )
    for b in range(got.shape[0]):
        patch = layout.is_patch[b]
        torch.testing.assert_close(got[b][valid[b]], tokens[b][patch], rtol=0, atol=1e-12)
        assert torch.equal(d["patch_coord"][b][valid[b]], layout.coords[b][patch])
        assert torch.equal(d["segment_ids"][b][valid[b]], layout.segment[b][patch])
        assert bool((d["patch_coord"][b][~valid[b]] == -1).all())


def test_intermediates_dict_of_a_padded_dict_in_eval_are_at_the_inputs_positions():
    m, imgs = model(reg_tokens=2), images()
    x = images_batch(imgs, 4)
    with torch.no_grad():
        d = m.forward_intermediates(x, indices=[0, 1], output_fmt="NLC", output_dict=True)
        final, feats = m.forward_intermediates(x, indices=[0, 1], output_fmt="NLC")
    valid = x["patch_valid"]
    assert torch.equal(d["patch_valid"], valid) and torch.equal(d["patch_coord"][valid], x["patch_coord"][valid])
    assert torch.equal(d["segment_ids"], torch.where(valid, 0, -1))
    for a, b in zip(d["image_intermediates"], feats):
        assert torch.equal(a, b)
    torch.testing.assert_close(m.forward_head(final), m(x), rtol=0, atol=1e-12)  # final: forward_features' dict


def test_intermediates_dict_of_images():
    m = model(reg_tokens=1)
    x = torch.randn(2, 3, 16, 12, dtype=torch.float64)
    with torch.no_grad():
        final, feats = m.forward_intermediates(x, indices=2, return_prefix_tokens=True)
        d = m.forward_intermediates(x, indices=2, return_prefix_tokens=True, output_dict=True)
    assert set(d) == {"image_intermediates", "image_intermediates_prefix", "image_features"}
    assert torch.equal(d["image_features"], final)
    for a, p, (fa, fp) in zip(d["image_intermediates"], d["image_intermediates_prefix"], feats):
        assert torch.equal(a, fa) and torch.equal(p, fp)
