"""``swap_rope_axial_halves``: weights trained with ``rope2d_axial``'s columns-first layout compute, after the swap,
what they computed then (float64), in the ViT and the Swin, shared or per-block schemes, with STRING's bases."""

from __future__ import annotations

import pytest
import torch

import vitrel
from vitrel.models import swap_rope_axial_halves

#: the columns-first layout rope2d_axial had: spiral_rope's two directions (column, row) with shared frequencies
#: (tests/pos/test_spiral.py: rope2d_axial's angles with the halves exchanged)
OLD = {"name": "spiral_rope", "directions": 2, "same_theta": True, "base": 100.0}
NEW = {"name": "rope2d_axial", "base": 100.0}
MODELS = {
    "vit": ("vitrel_vit_tiny_patch16_224", dict(embed_dim=32, depth=2, num_heads=2, img_size=32)),
    "swin": ("vitrel_swin_tiny_patch4_window7_224", dict(embed_dim=16, depths=(2, 2), num_heads=(2, 2), img_size=32,
                                                         window_size=4)),
}  # fmt: skip


def _model(kind: str, pos: dict, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    name, args = MODELS[kind]
    m = vitrel.create_model(name, pos=pos, num_classes=5, **args, **kw)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith(".string"):
                p.normal_(0, 0.3)  # a trained STRING basis, not the identity it starts as
    return m.double().eval()


@pytest.mark.parametrize("kind", ["vit", "swin"])
@pytest.mark.parametrize("pos_share", [False, True])
@pytest.mark.parametrize("basis", ["identity", "cayley", "circulant"])
def test_old_layout_weights_compute_the_same_function_after_the_swap(kind, pos_share, basis):
    old = _model(kind, {**OLD, "basis": basis}, pos_share=pos_share)
    new = _model(kind, {**NEW, "basis": basis}, pos_share=pos_share)
    new.load_state_dict(old.state_dict())
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        want = old.forward_features(x)
        assert (new.forward_features(x) - want).abs().max() > 1e-3  # loaded as they are: another function
        swap_rope_axial_halves(new)
        torch.testing.assert_close(new.forward_features(x), want, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(new(x), old(x), rtol=1e-10, atol=1e-10)
        swap_rope_axial_halves(new)  # its own inverse
        torch.testing.assert_close(new.state_dict(), old.state_dict(), rtol=0, atol=0)


def test_a_model_without_rope2d_axial_is_refused():
    m = _model("vit", {"name": "rope2d_mixed"})
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(ValueError, match="no attention layer rotating with rope2d_axial"):
        swap_rope_axial_halves(m)
    torch.testing.assert_close(m.state_dict(), before, rtol=0, atol=0)
