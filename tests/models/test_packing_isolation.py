"""Packed images cannot touch each other, whatever they hold.

A mask gives a foreign or padded key weight 0, but ``0 * NaN`` is NaN in ``attn @ v`` (and ``inf - inf`` in the
logits): without isolation a NaN (or a 1e30 that overflows) in one image, or in the padding, made every image of
the row NaN. Here each image of a packed row must get the logits it gets alone (``allclose``), with NaN or 1e30 in
the padding slots or in a neighbouring image, for every attention kernel and for the Swin; the poisoned image
itself is not finite, as it is alone.
"""

from __future__ import annotations

import pytest
import torch

from tests.layout.test_tokens import alone, images, model, packed
from tests.models.test_swin_mixed import _alone as swin_alone
from tests.models.test_swin_mixed import _images as swin_images
from tests.models.test_swin_mixed import _model as swin_model
from tests.models.test_swin_mixed import _naflex as swin_naflex

#: (attn_impl, scheme): every kernel, with a scheme it runs (fold: a factored bias; eager: Shaw's content terms too)
KERNELS = [
    ("sdpa", "rel2d_full"),
    ("sdpa", "rope2d_mixed"),
    ("sdpa", "pape"),
    ("eager", "rel2d_full"),
    ("eager", "shaw2d_full"),
    ("fold", "rel2d_factored"),
    ("flex", "rel2d_full"),
    ("triton", "rel2d_full"),
]
VALUES = {"nan": float("nan"), "1e30": 1e30}


def _poison(batch: dict[str, torch.Tensor], imgs: list[torch.Tensor], where: str, value: float):
    """``batch`` (and the images alone) with ``value`` in every padding slot, or in one pixel of image 0
    (packed in row 0 beside image 1)."""
    if where == "padding":
        batch = {k: v.clone() for k, v in batch.items()}
        pad = ~batch["patch_valid"]
        assert pad.any(), "the batch should hold padding"
        batch["patches"][pad] = value
        return batch, imgs
    imgs = [i.clone() for i in imgs]
    imgs[0][0, 1, 2] = value
    return None, imgs


def _check(got: torch.Tensor, ref: torch.Tensor, poisoned: set[int], atol: float) -> None:
    for i in range(ref.shape[0]):
        if i in poisoned:  # not finite alone, not finite packed
            assert not ref[i].isfinite().all() and not got[i].isfinite().all(), i
        else:
            assert ref[i].isfinite().all(), i
            torch.testing.assert_close(got[i], ref[i], rtol=0, atol=atol, msg=f"image {i}")


@pytest.mark.parametrize("value", list(VALUES))
@pytest.mark.parametrize("where", ["padding", "neighbour"])
@pytest.mark.parametrize("impl,pos", KERNELS)
def test_vit_packed_images_isolated(impl, pos, where, value):
    m, imgs = model(pos, torch.float32, attn_impl=impl, reg_tokens=1), images(torch.float32)
    batch, imgs = _poison(packed(imgs), imgs, where, VALUES[value])
    with torch.no_grad():
        got = m(batch if batch is not None else packed(imgs))
        ref = alone(m, imgs)
    _check(got, ref, set() if where == "padding" else {0}, 1e-5)


@pytest.mark.parametrize("pool", ["token", "avg"])
def test_vit_finite_huge_neighbour_is_exact_float64(pool):
    """A value that stays finite (1e30 in float64) changes nothing: the neighbour is exact, and so is the image."""
    kw = {} if pool == "token" else dict(class_token=False, global_pool="avg")
    m, imgs = model("rel2d_full", **kw), images()
    imgs[0][0, 1, 2] = 1e30
    with torch.no_grad():
        got, ref = m(packed(imgs)), alone(m, imgs)
    _check(got, ref, set(), 1e-10)


def test_vit_token_features_of_padding_stay_finite():
    """Padding tokens are zeroed at the entrance: ``forward_features`` is finite everywhere, padding included."""
    m, imgs = model("rel2d_full", torch.float32), images(torch.float32)
    batch, _ = _poison(packed(imgs), imgs, "padding", float("nan"))
    with torch.no_grad():
        assert m.forward_features(batch)["patches"].isfinite().all()


def test_vit_input_gradients_of_the_other_images_are_theirs_alone():
    """Backward through a row beside a NaN image: each other image's pixels get the gradient they get alone (the
    poisoned image's loss left out; weight gradients are NaN there as in any batch holding a NaN image)."""
    m, imgs = model("rel2d_full", torch.float32), images(torch.float32)
    imgs[0][0, 1, 2] = float("nan")
    batch = packed(imgs)
    patches = batch["patches"].clone().requires_grad_(True)
    m(dict(batch, patches=patches))[1:].square().sum().backward()
    ref = []
    for img in imgs[1:]:
        x = img.clone().requires_grad_(True)
        m(x[None]).square().sum().backward()
        ref.append(x.grad)
    valid, seg = batch["patch_valid"], batch["segment_ids"]
    got = patches.grad
    packed_ref = packed([torch.zeros_like(imgs[0]), *ref])["patches"]  # the reference gradients, patchified
    for r, s in [(0, 1), (1, 0)]:
        sel = valid[r] & (seg[r] == s)
        torch.testing.assert_close(got[r][sel], packed_ref[r][sel], rtol=0, atol=1e-6)


@pytest.mark.parametrize("value", list(VALUES))
@pytest.mark.parametrize("where", ["padding", "neighbour"])
def test_swin_packed_images_isolated(where, value):
    m, imgs = swin_model(dtype=torch.float32), swin_images(torch.float32)
    batch, imgs = _poison(swin_naflex(imgs), imgs, where, VALUES[value])
    with torch.no_grad():
        got = m(batch if batch is not None else swin_naflex(imgs))
        ref = swin_alone(m, imgs)
        listed = m(imgs)
    poisoned = set() if where == "padding" else {0}
    _check(got, ref, poisoned, 1e-5)
    _check(listed, ref, poisoned, 1e-5)


def test_the_full_grid_path_pays_nothing(monkeypatch):
    """Isolation runs on token layouts only: a plain image batch never calls it (the full-grid forward runs the same
    operations as before the fix; a packed dict does call it)."""
    import vitrel.layers.attention as attention

    calls = []
    real = attention.isolate_images
    monkeypatch.setattr(attention, "isolate_images", lambda *a: calls.append(1) or real(*a))
    m, imgs = model("rel2d_full", torch.float32), images(torch.float32)
    with torch.no_grad():
        m(torch.randn(2, 3, 16, 16))
        assert not calls
        m(packed(imgs))
    assert len(calls) == len(m.blocks)
