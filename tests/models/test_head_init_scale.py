"""``head_init_scale``: a new head's initial weight times the scale, its bias zero (timm's EVA's
``head_init_scale``, VideoMAE's fine-tuning ``init_scale`` 0.001), for the image and the video ViT: against the same
model built from the same seed without it (the head the scale times theirs bit for bit, every other parameter the
same), through ``reset_classifier``, ``init_weights()`` after ``to_empty``, ``from_videomae``'s pre-training route,
and a saved model loaded back (the stored head, not scaled again)."""

from __future__ import annotations

import pytest
import torch

import vitrel

ARCHS = {
    "vitrel_vit_tiny_patch16_224": dict(img_size=32, patch_size=8, depth=1),
    "vitrel_vit_video_tiny_patch4_32": dict(img_size=16, num_frames=4, depth=1),
}
SCALE = 0.001


def _pair(arch: str, **kw):
    out = []
    for scale in (SCALE, 1.0):
        torch.manual_seed(0)
        out.append(vitrel.create_model(arch, num_classes=5, head_init_scale=scale, **ARCHS[arch], **kw))
    return out


@pytest.mark.parametrize("arch", list(ARCHS))
def test_the_head_starts_scaled_and_nothing_else_changes(arch):
    scaled, plain = _pair(arch)
    assert scaled.vitrel_cfg["head_init_scale"] == SCALE
    for (k, a), b in zip(scaled.state_dict().items(), plain.state_dict().values(), strict=True):
        want = b * SCALE if k.startswith("head.") else b
        assert torch.equal(a, want), k
    assert plain.head.weight.std().item() == pytest.approx(0.02, rel=0.2)  # (timm's trunc-normal 0.02)
    torch.manual_seed(1)
    scaled.reset_classifier(3)
    torch.manual_seed(1)
    plain.reset_classifier(3)
    assert torch.equal(scaled.head.weight, plain.head.weight * SCALE) and scaled.head.weight.shape == (3, 192)


def test_init_weights_after_to_empty_and_a_saved_model_keep_it(tmp_path):
    arch = "vitrel_vit_video_tiny_patch4_32"
    m = vitrel.create_model(arch, num_classes=5, head_init_scale=SCALE, device="meta", **ARCHS[arch])
    m.to_empty(device="cpu")
    m.init_weights()
    assert m.head.weight.std().item() == pytest.approx(0.02 * SCALE, rel=0.2)
    with torch.no_grad():
        m.head.weight.fill_(0.5)  # (trained)
    vitrel.models.save_pretrained(m, tmp_path / "m")
    again = vitrel.load_model(tmp_path / "m")
    assert torch.equal(again.head.weight, m.head.weight) and again.vitrel_cfg["head_init_scale"] == SCALE


def test_a_videomae_pretraining_file_gets_their_scaled_head(tmp_path):
    """``from_videomae`` of a pre-training encoder with ``head_init_scale=0.001`` (their fine-tuning's): the encoder
    as stored, the new head the scale times the head it would have had."""
    from tests.models.test_videomae_import import DIM, HEADS, network_weights

    encoder = {k: v for k, v in network_weights(2, head=False).items() if not k.startswith("fc_norm.")}
    pre = {"model": {f"encoder.{k}": v for k, v in encoder.items()}}
    out = []
    for scale in (SCALE, 1.0):
        torch.manual_seed(0)
        out.append(vitrel.from_videomae(pre, num_heads=HEADS, num_classes=3, img_size=16, num_frames=4,
                                        head_init_scale=scale))  # fmt: skip
    scaled, plain = out
    assert scaled.head.weight.shape == (3, DIM)  # (made in float32, scaled, then in the file's float64)
    torch.testing.assert_close(scaled.head.weight, plain.head.weight * SCALE, rtol=1e-6, atol=0)
    assert all(torch.equal(scaled.state_dict()[k], v) for k, v in encoder.items())


def test_a_scale_that_is_not_a_finite_number_at_least_zero_is_refused():
    for bad in (-0.1, float("inf"), "0.001", True):
        with pytest.raises(ValueError, match="head_init_scale must be a finite number >= 0"):
            vitrel.create_model("vitrel_vit_tiny_patch16_224", head_init_scale=bad, img_size=32, patch_size=8)
