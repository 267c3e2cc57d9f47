"""The ViT's ``pos_depth`` (the relative scheme in the first blocks only) and ``prefix_at`` (the prefix tokens join
before a later block: ConViT's class token), on every input form.

The reference runs the model's own blocks one by one from the equation of the layout: the patch tokens (with the
absolute embedding) through blocks ``0 .. k-1``, each block's scheme prepared for the grid with no prefix token, then
the class token (and registers) put ahead and blocks ``k ..`` on ``P + N`` tokens, with no position."""

from __future__ import annotations

import pytest
import torch

import vitrel
from tests.naflex_inputs import packed
from vitrel.models.blocks import prepare_state

DEPTH, K = 4, 2


def _model(pos="rel2d_full", share=False, **kw):
    torch.manual_seed(0)
    args = dict(img_size=16, patch_size=4, embed_dim=32, depth=DEPTH, num_heads=2, num_classes=3, global_pool="token")
    m = vitrel.create_model("vitrel_vit_tiny_patch4_32", pos=pos, pos_share=share, **{**args, **kw})
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # (tables and tokens away from their zero init)
    return m.double().eval()


def _reference(m, x, k=K, pos_depth=K):
    tok, grid = m.patch_embed(x)
    if m.abs_pos is not None and m.abs_pos.after_block is None:
        tok = m.abs_pos.add_to_tokens(tok, grid, 0)
    for i, blk in enumerate(m.blocks):
        if i == k:
            prefix = [t.expand(len(x), -1, -1) for t in (m.cls_token, m.reg_token) if t is not None]
            tok = torch.cat([*prefix, tok], dim=1)
        if blk.attn.pos is None:  # (the model's shared scheme)
            assert i < pos_depth
            tok = blk(tok, pos_state=prepare_state(m.rel_pos, grid, 0, tok))
        else:
            assert (blk.attn.pos.name == "none") == (i >= pos_depth)
            tok = blk(tok, grid)
        if m.abs_pos is not None and m.abs_pos.after_block == i:
            tok = m.abs_pos.add_to_tokens(tok, grid, 0 if i < k else m.num_prefix_tokens)
    return m.head(m.norm(tok)[:, 0])


def _x(n=2, h=16, w=16, seed=1):
    return torch.randn(n, 3, h, w, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "pos,share,kw",
    [
        ("rel2d_full", False, {}),
        ("rel2d_full", True, {}),
        ("rope2d_axial", False, {"abs_pos": "ape", "reg_tokens": 2}),
        ("gpsa", False, {"abs_pos": "cpe"}),  # (CPE's convolution after block 0, before the prefix joins)
    ],
)
def test_the_prefix_joins_before_block_k_and_only_blocks_before_k_carry_the_scheme(pos, share, kw):
    m = _model(pos, share, pos_depth=K, prefix_at=K, **kw)
    assert [blk.attn.num_prefix_tokens for blk in m.blocks] == [0, 0, m.num_prefix_tokens, m.num_prefix_tokens]
    x = _x().requires_grad_()
    got, want = m(x), _reference(m, x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    g_got, g_want = (
        torch.autograd.grad(got.square().sum(), [x, m.cls_token]),
        torch.autograd.grad(want.square().sum(), [x, m.cls_token]),
    )
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # the layout changes the function: the prefix from the input, or the scheme in one block fewer, is another one
    for other in (dict(pos_depth=K, prefix_at=0), dict(pos_depth=K - 1, prefix_at=K)):
        with torch.no_grad():
            assert (_model(pos, share, **other, **kw)(x) - got).abs().max() > 1e-4


def test_pos_depth_alone_keeps_the_prefix_from_the_input():
    m = _model("rel2d_full", pos_depth=1)
    assert [blk.attn.pos.name for blk in m.blocks] == ["rel2d_full", "none", "none", "none"]
    x = _x()
    with torch.no_grad():
        torch.testing.assert_close(m(x), _reference(m, x, k=0, pos_depth=1), rtol=1e-12, atol=1e-12)


def test_every_input_form_computes_each_image_as_alone():
    """A list of images of two sizes, timm's packed NaFlex dict, and the intermediates of both: each image as its own
    batch of one, the layout's prefix tokens joining each image's patches at block ``prefix_at``."""
    m = _model("gpsa", abs_pos="ape", pos_depth=K, prefix_at=K)
    imgs = [_x(1, 16, 16, 2)[0], _x(1, 12, 20, 3)[0], _x(1, 8, 8, 4)[0]]
    with torch.no_grad():
        alone = torch.cat([m(i[None]) for i in imgs])
        torch.testing.assert_close(m(imgs), alone, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(m(packed(imgs)), alone, rtol=1e-12, atol=1e-12)
        got = m.forward_intermediates(imgs, output_fmt="NLC", output_dict=True, intermediates_only=True)
        for i, img in enumerate(imgs):
            want = m.forward_intermediates(img[None], output_fmt="NLC", intermediates_only=True)
            n = want[0].shape[1]
            for g, w in zip(got["image_intermediates"], want):
                torch.testing.assert_close(g[i, :n], w[0], rtol=1e-12, atol=1e-12)


def test_intermediates_have_no_prefix_tokens_before_it_joins_and_pruning_drops_it():
    m = _model("rel2d_full", reg_tokens=1, pos_depth=K, prefix_at=K)
    x = _x()
    with torch.no_grad():
        feats = m.forward_intermediates(x, return_prefix_tokens=True, intermediates_only=True, output_fmt="NLC")
        assert [p.shape[1] for _, p in feats] == [0, 0, 2, 2] and all(f.shape[1] == 16 for f, _ in feats)
        maps = [m.attention_maps(x, block=i) for i in range(DEPTH)]  # (the class token's row once it joined)
        assert all(a.shape == (2, 2, 4, 4) for a in maps)
        early = m.forward_features(x)
        m.prune_intermediate_layers([1])  # the prefix would join after the blocks kept: the model has none (timm's)
    assert m.num_prefix_tokens == 0 and m.cls_token is None and m.prefix_at == 0
    assert m.vitrel_cfg["class_token"] is False
    with torch.no_grad():
        assert m.forward_features(x).shape == (2, 16, 32) and early.shape == (2, 18, 32)
        torch.testing.assert_close(m.forward_intermediates(x, indices=[1])[1][0], feats[1][0].mT.reshape(2, 32, 4, 4))


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(prefix_at=2, class_token=False, global_pool="avg"), "has none"),
        (dict(prefix_at=DEPTH), "below depth"),
        (dict(prefix_at=2, pos_depth=3), "pos_depth <= prefix_at"),
        (dict(prefix_at=2), "pos_depth <= prefix_at"),  # (None: every block)
        (dict(pos_depth=DEPTH + 1), "at most depth"),
        (dict(pos_depth=-1), "pos_depth must be >= 0"),
        (dict(prefix_at=1.5, pos_depth=1), "prefix_at must be an integer"),
    ],
)
def test_bad_layouts_are_clear_errors(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        _model("rel2d_full", **kw)


def test_a_late_prefix_with_timms_attn_mask_is_refused_and_no_scheme_needs_no_pos_depth():
    m = _model("rel2d_full", pos_depth=K, prefix_at=K)
    with pytest.raises(ValueError, match="attn_mask"):
        m(_x(), attn_mask=torch.zeros(2, 1, 16, 16, dtype=torch.float64))
    _model("none", prefix_at=K)  # (no relative scheme: any block may follow)


def test_export_and_compile_take_the_late_prefix_whole():
    m = _model("gpsa", abs_pos="ape", pos_depth=K, prefix_at=K).float()
    x = _x().float()
    with torch.no_grad():
        want = m(x)
        torch.testing.assert_close(torch.export.export(m, (x,)).module()(x), want, rtol=0, atol=0)
        torch.testing.assert_close(torch.compile(m, fullgraph=True, backend="eager")(x), want, rtol=0, atol=0)


def test_dropped_tokens_train_with_the_prefix_joining_each_image():
    """NaViT's token dropping in training: the kept tokens run the early blocks alone, then every image's class token
    joins them; the loss reaches the class token and the early blocks' scheme."""
    m = _model("gpsa", pos_depth=K, prefix_at=K, token_drop=(0.25, 0.5)).train()
    torch.manual_seed(0)
    out = m(_x())
    assert out.shape == (2, 3) and torch.isfinite(out).all()
    out.square().sum().backward()
    assert m.cls_token.grad.abs().sum() > 0 and m.blocks[0].attn.pos.gating.grad.abs().sum() > 0
    assert m.blocks[K].attn.qkv.weight.grad.abs().sum() > 0
