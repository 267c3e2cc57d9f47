"""A model loaded at a larger size (``vitrel.load_model(path, img_size=..., num_frames=...)``: what ``eval.py
data.img_size=`` and ``data.num_frames=`` score) computes what the model as trained computes on that grid, for every
scheme: learned tables keep their offsets and give new ones the edge value a larger call grid reads (``extend:
grow``, the default), absolute embeddings resample as at call time, the other schemes extend by themselves."""

from __future__ import annotations

import warnings

import pytest
import torch

import vitrel
from vitrel.models.checkpoint import save_pretrained

VIDEO = sorted(n for n in vitrel.list_pos() if "3d" in n)
IMAGE = sorted(set(vitrel.list_pos()) - set(VIDEO))


def _loaded_and_trained(tmp_path, arch, pos, size, **larger):
    torch.manual_seed(0)
    m = vitrel.create_model(arch, pos=pos, embed_dim=32, depth=2, num_heads=2, num_classes=3, **size)
    with torch.no_grad():  # trained tables: no two offsets alike
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    save_pretrained(m, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the resize warnings
        return vitrel.load_model(tmp_path, **larger).eval(), vitrel.load_model(tmp_path).eval()


@pytest.mark.parametrize("pos", IMAGE)
def test_an_image_model_loaded_at_a_larger_size_is_the_trained_one_there(tmp_path, pos):
    big, trained = _loaded_and_trained(tmp_path, "vitrel_vit_tiny_patch4_32", pos, {"img_size": 28}, img_size=48)
    x = torch.randn(2, 3, 48, 48)
    with torch.no_grad():
        torch.testing.assert_close(big(x), trained(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pos", VIDEO)
def test_a_video_model_loaded_at_more_frames_is_the_trained_one_there(tmp_path, pos):
    arch, size = "vitrel_vit_video_tiny_patch4_32", {"img_size": 16, "num_frames": 4, "in_chans": 3}
    big, trained = _loaded_and_trained(tmp_path, arch, pos, size, num_frames=8, img_size=24)
    x = torch.randn(2, 3, 8, 24, 24)
    with torch.no_grad():
        torch.testing.assert_close(big(x), trained(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("size", [(48, 32), 48, (16, 64)])
def test_a_non_square_ape_table_resamples_from_its_stored_grid(tmp_path, size):
    """An 8 x 12 table (96 entries) at 12 x 8 (as many entries: it was read as 12 x 8, unresampled), 12 x 12 (a
    ``CheckpointError``: 96 is neither square nor 1:1) and 4 x 16: timm's ``resample_abs_pos_embed`` from the stored
    grid, through ``load_model`` and ``set_input_size`` alike."""
    from timm.layers import resample_abs_pos_embed

    arch = "vitrel_vit_tiny_patch4_32"
    src = vitrel.create_model(arch, pos="ape", img_size=(32, 48), embed_dim=32, depth=1, num_heads=2)
    with torch.no_grad():
        src.abs_pos.pos_embed.normal_()
    save_pretrained(src, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the resample warning
        loaded = vitrel.load_model(tmp_path, img_size=size)
        resized = vitrel.load_model(tmp_path)
        resized.set_input_size(img_size=size)
    h, w = loaded.abs_pos.space
    want = resample_abs_pos_embed(src.abs_pos.pos_embed, [h, w], old_size=[8, 12], num_prefix_tokens=0)
    torch.testing.assert_close(loaded.abs_pos.pos_embed, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(resized.abs_pos.pos_embed, want, rtol=0, atol=1e-6)
