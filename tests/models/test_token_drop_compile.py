"""``token_drop`` under ``torch.compile``: one graph set per image size, not one per draw of the rates.

A batch of images with a range of rates keeps a different number of tokens per draw; the rows are padded to the count
the lowest rate keeps (:func:`~vitrel.models.naflex.token_drop_keep_max`) and pooling reads no data-dependent shape,
so a compiled model compiles its graphs on the first step and never again. The padded path computes what the compact
one did (float64 logits and gradients, the same kept tokens)."""

from __future__ import annotations

import pytest
import torch

import vitrel
import vitrel.models.vit as vit_module
from vitrel.layout.geometry import Grid
from vitrel.layout.tokens import TokenLayout
from vitrel.models.naflex import token_drop_keep_max
from vitrel.models.pooling import pool_images


def tiny(dtype=torch.float32, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    kw = {"embed_dim": 16, "num_heads": 2, "depth": 1, "global_pool": "avg", "token_drop": (0.25, 0.75), **kw}
    return vitrel.create_model("vitrel_vit_tiny_patch4_32", pos="rel2d_full", img_size=16, num_classes=3, **kw).to(
        dtype
    )


@pytest.mark.parametrize("pool", ["avg", "token"])
def test_compiled_token_drop_compiles_once_per_size(pool):
    """Six training steps at one size with rates drawn per image: every graph compiled in the first step (before the
    fix each step's longest kept row, and pooling's boolean masks, were new shapes: a recompile per step)."""
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    m = tiny(global_pool=pool).train()
    torch._dynamo.reset()
    try:
        step = torch.compile(m, backend=counting, dynamic=False)
        x = torch.randn(4, 3, 16, 16)
        after = []
        for seed in range(6):
            torch.manual_seed(seed)
            step(x).sum().backward()
            after.append(len(graphs))
    finally:
        torch._dynamo.reset()
    assert after[0] > 0
    assert after == [after[0]] * 6, f"graphs compiled after each step: {after}"


def test_padded_rows_compute_what_compact_rows_did(monkeypatch):
    """Float64: logits and every parameter's gradient of the padded rows equal those of rows cut to their longest
    kept count (the path before, ``length=None``), for the same kept tokens (same seed)."""
    m = tiny(torch.float64, depth=2, reg_tokens=1, global_pool="token", token_drop=(0.4, 0.75)).train()
    x = torch.randn(5, 3, 16, 16, dtype=torch.float64)
    w = torch.randn(5, 3, dtype=torch.float64)

    def run():
        torch.manual_seed(2)
        logits = m(x)
        torch.manual_seed(2)
        feats = m.forward_features(x)["patches"]  # (a range of rates: timm's NaFlexVit dict)
        params = [p for p in m.parameters() if p.requires_grad]
        return logits, feats.shape[1], torch.autograd.grad((logits * w).sum(), params, allow_unused=True)

    padded, n_padded, g_padded = run()
    monkeypatch.setattr(vit_module, "token_drop_keep_max", lambda *a: None)  # rows cut to the longest kept count
    compact, n_compact, g_compact = run()
    assert n_padded == 2 + token_drop_keep_max((0.4, 0.75), 16, torch.float64) > n_compact  # the padding is there
    torch.testing.assert_close(padded, compact, rtol=0, atol=1e-12)
    for a, b in zip(g_padded, g_compact):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_pool_images_against_boolean_masks():
    """Pooling without boolean indexing equals the masked reference (padding and prefix tokens left out)."""
    torch.manual_seed(0)
    b, n = 3, 7
    image = torch.tensor([[0, 0, 0, 0, -1, -1, -1], [1, 1, 1, 1, 1, 1, 1], [2, 2, 2, -1, -1, -1, -1]])
    segment = torch.where(image >= 0, 0, -1)
    coords = torch.stack([torch.arange(n)[None].expand(b, -1) // 3, torch.arange(n)[None].expand(b, -1) % 3], -1)
    coords = torch.where(image[..., None] >= 0, coords, -1)
    coords[:, 0] = torch.tensor([-1, 0])  # a class token ahead of each image
    layout = TokenLayout.build(segment, coords, image, (Grid(3, 3),) * b, 1)
    x = torch.randn(b, n, 4, dtype=torch.float64)
    x[image < 0] = float("nan")  # padding slots are never read
    cls = layout.valid & ~layout.is_patch & (layout.index == 0)
    torch.testing.assert_close(pool_images(x, layout, "token"), x[cls], rtol=0, atol=0)
    want = torch.stack([x[i][layout.is_patch[i]].mean(0) for i in range(b)])
    torch.testing.assert_close(pool_images(x, layout, "avg"), want, rtol=0, atol=1e-15)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_keep_max_bounds_every_rate_of_the_range(dtype):
    """The row length is at least what the lowest rate keeps in the rates' dtype (never cuts a kept token) and at
    most one more."""
    for low in [i / 20 for i in range(20)] + [0.3, 0.7, 0.9]:
        rate = torch.full((1,), low, dtype=dtype)
        for n in range(1, 300):
            kept = int(((1 - rate.double()) * n).round().clamp(min=1))
            bound = token_drop_keep_max([low, 0.99], n, dtype)
            assert kept <= bound <= kept + 1, (low, n, kept, bound)
