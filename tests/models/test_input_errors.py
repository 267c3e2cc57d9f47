"""Bad input on the any-resolution paths (NaFlex dicts, lists of images, token dropping, the packing collator): each
is taken where taking it is right (numpy arrays; a features_only map in training) or refused by one clear error
naming the key or argument and the value, at the model's entrance, before any work (issue 33, items 1-10)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from timm.data.naflex_transforms import patchify_image

import vitrel
from tests.layout.test_tokens import images, model, packed
from tests.models.test_swin_mixed import _images as swin_images
from tests.models.test_swin_mixed import _model as swin_model
from tests.models.test_swin_mixed import _naflex as swin_naflex
from vitrel.data.packing import PackingCollator, PackingError


@pytest.fixture(scope="module")
def vit():
    return model("rel2d_full", torch.float32)


@pytest.fixture(scope="module")
def batch():
    return packed(images(torch.float32))


def _with(batch, **change):
    out = {k: v.clone() for k, v in batch.items()}
    out.update(change)
    return out


# 1 ------------------------------------------------------------------------------------------- numpy arrays
def test_a_dict_of_numpy_arrays_is_taken(vit, batch):
    with torch.no_grad():
        ref = vit(batch)
        got = vit({k: v.numpy() for k, v in batch.items()})
    torch.testing.assert_close(got, ref)


def test_a_dict_entry_of_another_type_names_the_key(vit, batch):
    with pytest.raises(ValueError, match="'patch_coord' must be a tensor .*got list"):
        vit(_with(batch, patch_coord=batch["patch_coord"].tolist()))


# 2 ---------------------------------------------------------------------------- segment id -1 on a valid token
def test_negative_segment_id_on_a_valid_token_says_so(vit, batch):
    seg = batch["segment_ids"].clone()
    seg[0, 5] = -1
    with pytest.raises(ValueError, match=r"row 0: 'segment_ids' is -1 on token 5, which 'patch_valid' marks valid"):
        vit(_with(batch, segment_ids=seg))


def test_negative_segment_ids_on_padding_are_ignored(vit, batch):
    seg = torch.where(batch["patch_valid"], batch["segment_ids"], -1)
    with torch.no_grad():
        torch.testing.assert_close(vit(_with(batch, segment_ids=seg)), vit(batch))


# 3 --------------------------------------------------------------------------------- fractional coordinates
def test_fractional_patch_coord_is_refused_naming_the_value(vit, batch):
    coord = batch["patch_coord"].double()
    coord[1, 3] += 0.5
    with pytest.raises(ValueError, match=r"'patch_coord' must hold whole patch indices .*row 1, token 3"):
        vit(_with(batch, patch_coord=coord))


def test_whole_float_patch_coord_is_taken(vit, batch):
    with torch.no_grad():
        torch.testing.assert_close(vit(_with(batch, patch_coord=batch["patch_coord"].float())), vit(batch))


# 4, 5, 6 ----------------------------------------------------------------------------- a batch with no image
def test_all_false_patch_valid_vit(vit, batch):
    with pytest.raises(ValueError, match="holds no image: 'patch_valid' is False on all"):
        vit(_with(batch, patch_valid=torch.zeros_like(batch["patch_valid"])))


def test_all_false_patch_valid_swin():
    m, b = swin_model(dtype=torch.float32), swin_naflex(swin_images(torch.float32))
    b["patch_valid"][:] = False
    with pytest.raises(ValueError, match="holds no image: 'patch_valid' is False on all"):
        m(b)


def test_a_dict_with_zero_rows(vit, batch):
    with pytest.raises(ValueError, match=r"holds no image: 'patches' is \(0, "):
        vit({k: v[:0] for k, v in batch.items()})


def test_patch_valid_other_than_0_or_1_is_refused(vit, batch):
    with pytest.raises(ValueError, match="'patch_valid' must be bool .*value 2"):
        vit(_with(batch, patch_valid=batch["patch_valid"].long() * 2))


# 7 ------------------------------------------------------------------------------------- an RGB and a grey image
def test_a_list_of_rgb_and_grey_names_the_image_and_channels(vit):
    with pytest.raises(ValueError, match="image 1 of the list has 1 channels, the model takes 3"):
        vit([torch.randn(3, 8, 8), torch.randn(1, 8, 8)])


def test_a_list_of_grey_images_for_an_rgb_model(vit):
    with pytest.raises(ValueError, match="image 0 of the list has 1 channels, the model takes 3"):
        vit([torch.randn(1, 8, 8), torch.randn(1, 8, 12)])


def test_integer_images_are_refused_not_scored_as_raw_pixels(vit, batch):
    """``model([torchvision.io.read_image(p)])``: uint8 0..255 values went through the patch embedding as they were
    (a batch tensor fails in the convolution); a list, a dict of the ViT or the Swin names the dtype."""
    u8 = (torch.rand(3, 8, 8) * 255).to(torch.uint8)
    with pytest.raises(ValueError, match="image 1 of the list is torch.uint8: the model takes float images normalised"):
        vit([torch.randn(3, 8, 8), u8])
    with pytest.raises(ValueError, match="'patches' is torch.int64: the model takes float images normalised"):
        vit(_with(batch, patches=batch["patches"].long()))
    with pytest.raises(ValueError, match="image 0 of the list is torch.uint8"):
        swin_model()([u8])


def test_an_attn_mask_of_ones_own_is_refused_not_ignored(vit, batch):
    """timm's NaFlexVit lets ``x['attn_mask']`` override its masks; vitrel ignored the key (and ``model(patches,
    patch_coord=...)``, timm's keyword form, is a TypeError)."""
    mask = torch.zeros(batch["patches"].shape[0], 1, batch["patches"].shape[1], batch["patches"].shape[1])
    with pytest.raises(ValueError, match="the NaFlex batch holds an 'attn_mask': vitrel builds its attention masks"):
        vit({**batch, "attn_mask": mask})
    with torch.no_grad():
        torch.testing.assert_close(vit({**batch, "attn_mask": None}), vit(batch))
    with pytest.raises(TypeError):
        vit(batch["patches"], patch_coord=batch["patch_coord"], patch_valid=batch["patch_valid"])


@pytest.mark.parametrize("arch", ["vit", "swin"])
def test_one_grid_methods_name_the_list_or_dict_they_were_given(vit, batch, arch):
    """``attention_maps`` (and the Swin's ``forward_intermediates``) take one grid: a list or a dict failed deep inside
    (``'list' object has no attribute 'dim'``)."""
    from vitrel.viz import attention_maps

    m = vit if arch == "vit" else swin_model()
    dtype = next(m.parameters()).dtype
    given = {"a list of images": [torch.randn(3, 8, 8, dtype=dtype)], "a NaFlex dict": batch}
    for got, x in given.items():
        with pytest.raises(ValueError, match=f"attention_maps takes a batch of images .* got {got}: give it each"):
            m.attention_maps(x)
        with pytest.raises(ValueError, match=f"got {got}"):
            attention_maps(m, x)
    if arch == "swin":
        with pytest.raises(ValueError, match="the Swin's forward_intermediates takes a batch of images"):
            m.forward_intermediates(given["a list of images"])


# 8 ------------------------------------------------------------------------------------------ token_drop typed
@pytest.mark.parametrize("spec", ["0.5", ("0.1", "0.5"), True, {"low": 0.1}])
def test_token_drop_takes_numbers_only(spec):
    with pytest.raises(ValueError, match="token_drop"):
        vitrel.create_model("vitrel_vit_tiny_patch4_32", depth=1, token_drop=spec)


def test_token_drop_numpy_numbers_are_taken():
    m = vitrel.create_model("vitrel_vit_tiny_patch4_32", depth=1, token_drop=(np.float32(0.25), np.float64(0.5)))
    assert m.token_drop == [0.25, 0.5]


# 9 ----------------------------------------------------------------------------- features_only with token_drop
def test_features_only_backbone_with_token_drop_gives_full_grid_maps_in_training():
    torch.manual_seed(0)
    fb = vitrel.create_model("vitrel_vit_tiny_patch4_32", depth=3, token_drop=0.5, features_only=True)
    x = torch.randn(2, 3, 32, 32)
    fb.train()
    got = fb(x)
    fb.eval()
    with torch.no_grad():
        ref = fb(x)
    assert [tuple(t.shape) for t in got] == [(2, 192, 8, 8)] * 3
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r)


def test_forward_intermediates_nlc_still_drops_tokens_in_training():
    m = model("rel2d_full", torch.float32, token_drop=0.5).train()
    d = m.forward_intermediates(torch.randn(2, 3, 16, 16), output_fmt="NLC", intermediates_only=True, output_dict=True)
    assert d["image_intermediates"][0].shape[1] == 8 and d["patch_coord"].shape == (2, 8, 2)  # half of the 4 x 4


# 10 ---------------------------------------------------------------------------------- collator without labels
def _per_image(n: int = 2) -> list[dict]:
    parts = [patchify_image(torch.randn(3, 8, 8), (4, 4)) for _ in range(n)]
    return [{"patches": p, "patch_coord": c, "patch_valid": v} for p, c, v in parts]


def test_packing_collator_given_dicts_without_labels():
    with pytest.raises(PackingError, match=r"sample 0: .*\(NaFlex per-image dict, label\) pairs, got a dict"):
        PackingCollator(16)(_per_image())


def test_packing_collator_takes_pairs():
    batch, targets = PackingCollator(16)([(d, i) for i, d in enumerate(_per_image())])
    assert batch["patches"].shape == (1, 16, 48) and targets.tolist() == [0, 1]
