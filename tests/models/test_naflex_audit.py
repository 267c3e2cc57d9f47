"""The NaFlex data path end to end: PIL images of mixed sizes and aspect ratios through ``naflex_transform`` and
``PackingCollator`` into a model, each image's logits those it gets alone (float64); and the model's error for
patches of another patch size or channel count."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import vitrel
from vitrel.data.packing import PackingCollator, naflex_transform

P = 4
SIZES = [(28, 28), (20, 44), (50, 12), (9, 9), (33, 17), (64, 64), (4, 60)]


def unpatchify(d: dict) -> torch.Tensor:
    """An image ``[C, H, W]`` (float64) from timm's per-image dict (flattened ``(P, P, C)`` patches, raster order)."""
    v = d["patch_valid"]
    h, w = (int(s) + 1 for s in d["patch_coord"][v].max(0).values)
    c = d["patches"].shape[1] // (P * P)
    return d["patches"][v].double().reshape(h, w, P, P, c).permute(4, 0, 2, 1, 3).reshape(c, h * P, w * P)


@pytest.mark.parametrize("pos", ["rel2d_full", "rope2d_mixed"])
@pytest.mark.parametrize("pool", ["token", "avg"])
def test_packed_pipeline_logits_are_each_image_alone(pos, pool):
    rng = np.random.default_rng(0)
    pil = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in SIZES]
    tf = naflex_transform(train=False, patch_size=P, max_tokens=64, mean=(0.5,) * 3, std=(0.5,) * 3)
    items = [(tf(im), i) for i, im in enumerate(pil)]
    batch, targets = PackingCollator(128, "pack")(items)
    assert batch["patches"].shape[0] < len(SIZES) and bool((batch["segment_ids"] > 0).any())  # rows share images
    torch.manual_seed(0)
    model = vitrel.create_model(
        "vitrel_vit_tiny_patch4_32", pos=pos, num_classes=10, global_pool=pool, embed_dim=32, depth=2, num_heads=2
    )
    model = model.double().eval()
    with torch.no_grad():
        packed = model({**batch, "patches": batch["patches"].double()})
        alone = torch.cat([model(unpatchify(items[k][0])[None]) for k in targets.tolist()])
    assert packed.shape == (len(SIZES), 10)
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-12)


def test_patches_of_another_patch_size_or_channels_name_it():
    model = vitrel.create_model("vitrel_vit_tiny_patch4_32", num_classes=10, embed_dim=32, depth=1, num_heads=2)
    with pytest.raises(
        ValueError, match=r"the data's patches are 2x2 \(of 3 channels\), the model's 4x4: .*Patchify\(4\)"
    ):
        model(vitrel.models.naflex.images_batch([torch.rand(3, 8, 8)], 2))
    with pytest.raises(ValueError, match=r"4x4 patches have 1 channel\(s\), the model takes 3"):
        model(vitrel.models.naflex.images_batch([torch.rand(1, 8, 8)], 4))
