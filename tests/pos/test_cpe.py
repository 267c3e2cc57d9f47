"""``pos=cpe``: CPVT's position encoding generator against a loop reference from its equation, Twins' ``PosConv`` (the
authors' released code, in timm), its place in the ViT, packed and dropped tokens, and its refusals."""

from __future__ import annotations

import math

import pytest
import torch
from timm.models.twins import PosConv

import vitrel
import vitrel.viz
from tests.layout.test_tokens import images, packed
from vitrel.layout.geometry import Grid
from vitrel.pos import build_pos
from vitrel.pos.schemes.cpe import Cpe


def make(grid=(3, 5), embed_dim: int = 6, **kw) -> Cpe:
    torch.manual_seed(0)
    s = build_pos("cpe", num_heads=2, head_dim=embed_dim // 2, grid=grid, embed_dim=embed_dim, **kw).double()
    with torch.no_grad():
        s.proj.bias.normal_()  # (zero at init: a bias read from the wrong place would not show)
    return s


def naive_peg(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, grid: Grid, prefix: int) -> torch.Tensor:
    """``x_i + b + sum_{u, v} w[u, v] x_{(r_i + u, c_i + v)}`` per channel, zero outside the grid; loops."""
    k = weight.shape[-1]
    out = [x[:, i] for i in range(prefix)]
    for i in range(grid.n):
        r, c = divmod(i, grid.w)
        acc = x[:, prefix + i] + bias
        for u in range(-(k // 2), k // 2 + 1):
            for v in range(-(k // 2), k // 2 + 1):
                if 0 <= r + u < grid.h and 0 <= c + v < grid.w:
                    acc = acc + weight[:, 0, u + k // 2, v + k // 2] * x[:, prefix + (r + u) * grid.w + c + v]
        out.append(acc)
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("prefix", [0, 2])
@pytest.mark.parametrize(("grid", "k"), [(Grid(3, 5), 3), (Grid(4, 4), 5), (Grid(2, 3), 1)])
def test_peg_equals_the_equation_forward_and_gradients(grid, k, prefix):
    s = make(grid, kernel_size=k)
    x = torch.randn(2, prefix + grid.n, 6, dtype=torch.float64, requires_grad=True)
    got = s.add_to_tokens(x, grid, prefix)
    want = naive_peg(x, s.proj.weight, s.proj.bias, grid, prefix)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    w = torch.randn_like(got)
    params = (x, s.proj.weight, s.proj.bias)
    for a, b in zip(torch.autograd.grad((got * w).sum(), params), torch.autograd.grad((want * w).sum(), params)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_equals_twins_posconv_the_authors_released_code():
    """Twins' ``PosConv`` (Meituan-AutoML/Twins ``gvt.py``, as timm's ``twins.py``) with the same weights."""
    s = make(Grid(4, 6), embed_dim=8)
    theirs = PosConv(8, 8).double()
    with torch.no_grad():
        theirs.proj[0].weight.copy_(s.proj.weight)
        theirs.proj[0].bias.copy_(s.proj.bias)
    x = torch.randn(3, 24, 8, dtype=torch.float64)
    torch.testing.assert_close(s.add_to_tokens(x, Grid(4, 6)), theirs(x, (4, 6)), rtol=0, atol=0)


def test_init_is_twins():
    """Twins' ``_init_weights`` for its convolutions: ``N(0, 2 / fan_out)``, ``fan_out = k * k`` (depthwise), zero
    bias."""
    torch.manual_seed(0)
    s = build_pos("cpe", num_heads=8, head_dim=256, grid=(4, 4))
    std = s.proj.weight.std().item()
    assert abs(std - math.sqrt(2 / 9)) < 0.02 * math.sqrt(2 / 9), std  # 18,432 draws: 0.5 % standard error
    assert abs(s.proj.weight.mean().item()) < 0.01 and not s.proj.bias.any()


# ------------------------------------------------------------------------------ in the ViT
def model(after_block=0, depth: int = 3, **kw):
    torch.manual_seed(0)
    m = vitrel.create_model(
        "vitrel_vit_tiny_patch4_32", pos={"name": "cpe", "after_block": after_block}, img_size=16, num_classes=5,
        embed_dim=24, num_heads=2, depth=depth, **kw,
    )  # fmt: skip
    with torch.no_grad():
        m.abs_pos.proj.bias.normal_()
    return m.double().eval()


def by_hand(m, x: torch.Tensor, after_block) -> torch.Tensor:
    """CPVT's Algorithm 1: the embedded tokens through the blocks, the PEG (:func:`naive_peg`) on block
    ``after_block``'s output (None: on the embedded tokens), the class token passed through."""
    grid, p = Grid(x.shape[-2] // 4, x.shape[-1] // 4), m.num_prefix_tokens
    conv = m.abs_pos.proj
    t = m.patch_embed.proj(x).flatten(2).transpose(1, 2)
    t = torch.cat([m.cls_token.expand(x.shape[0], -1, -1), t], dim=1)
    if after_block is None:
        t = naive_peg(t, conv.weight, conv.bias, grid, p)
    for i, blk in enumerate(m.blocks):
        t = blk(t, grid)
        if i == after_block:
            t = naive_peg(t, conv.weight, conv.bias, grid, p)
    return m.head(m.norm(t)[:, 0])


@pytest.mark.parametrize("after_block", [0, 2, None])
def test_vit_adds_it_after_its_block(after_block):
    m = model(after_block)
    x = torch.randn(2, 3, 16, 20, dtype=torch.float64)
    torch.testing.assert_close(m(x), by_hand(m, x, after_block), rtol=0, atol=1e-12)
    grads = torch.autograd.grad(m(x).sum(), [m.abs_pos.proj.weight, m.blocks[0].attn.qkv.weight])
    want = torch.autograd.grad(by_hand(m, x, after_block).sum(), [m.abs_pos.proj.weight, m.blocks[0].attn.qkv.weight])
    for a, b in zip(grads, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_intermediates_and_checkpointing_see_it():
    m = model(0, depth=2)
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    feats = m.forward_intermediates(x, indices=[0], output_fmt="NLC", intermediates_only=True)[0]
    t = m.blocks[0](m.embed(x)[0])
    want = naive_peg(t, m.abs_pos.proj.weight, m.abs_pos.proj.bias, Grid(4, 4), 1)[:, 1:]
    torch.testing.assert_close(feats, want, rtol=0, atol=1e-12)  # block 0's output, with the encoding
    m.set_grad_checkpointing(True)
    m.train()
    torch.testing.assert_close(m(x), model(0, depth=2).train()(x), rtol=0, atol=1e-12)


@pytest.mark.parametrize("after_block", [0, None])
def test_images_of_any_size_in_one_batch_each_as_alone(after_block):
    """A list of images and a packed NaFlex dict: each image's logits are its own forward alone (its own grid, its own
    zero borders), whatever shares its row."""
    m = model(after_block)
    imgs = images(torch.float64)
    alone = torch.cat([m(img[None]) for img in imgs])
    torch.testing.assert_close(m(imgs), alone, rtol=0, atol=1e-12)
    torch.testing.assert_close(m(packed(imgs)), alone, rtol=0, atol=1e-12)


def test_dropped_tokens_are_zeros_to_the_convolution():
    """``token_drop`` with the encoding at the input: each image's kept tokens, the dropped ones zero to the
    convolution (a border inside the image), against the full grid with those tokens zeroed and masked as keys."""
    m = model(None, depth=1, token_drop=0.5, class_token=False, global_pool="avg").train()
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    torch.manual_seed(4)
    got = m(x)
    torch.manual_seed(4)
    _, layout, _, _ = m.forward_layout(x)
    kept = torch.zeros(2, 16, dtype=torch.bool)
    for b in range(2):
        rc = layout.coords[b, layout.is_patch[b]]
        kept[b, rc[:, 0] * 4 + rc[:, 1]] = True
    t = m.patch_embed.proj(x).flatten(2).transpose(1, 2) * kept[..., None]
    t = naive_peg(t, m.abs_pos.proj.weight, m.abs_pos.proj.bias, Grid(4, 4), 0)
    mask = torch.zeros(2, 1, 16, 16, dtype=x.dtype).masked_fill(~kept[:, None, None, :], float("-inf"))
    t = m.norm(m.blocks[0](t, mask=mask))
    want = m.head(m.fc_norm(torch.stack([t[b][kept[b]].mean(0) for b in range(2)])))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


# ------------------------------------------------------------------------------ in the Swin
def swin(after_block=0):
    torch.manual_seed(0)
    m = vitrel.create_model(
        "vitrel_swin_tiny_patch2_window4_32", pos={"name": "cpe", "after_block": after_block}, num_classes=5,
        embed_dim=8, depths=(2, 2), num_heads=(2, 2),
    )  # fmt: skip
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, Cpe):
                mod.proj.bias.normal_()
    return m.double().eval()


def peg_map(x: torch.Tensor, conv: torch.nn.Conv2d) -> torch.Tensor:
    b, h, w, c = x.shape
    return naive_peg(x.reshape(b, h * w, c), conv.weight, conv.bias, Grid(h, w), 0).reshape(b, h, w, c)


def test_swin_adds_one_in_every_stage_after_its_block():
    """Twins' placement in a hierarchy: each stage its own PEG at its width, after its first block."""
    m = swin(0)
    assert m.abs_pos is None and [st.abs_pos.embed_dim for st in m.layers] == [8, 16]
    x = torch.randn(2, 3, 32, 24, dtype=torch.float64)
    t = m.patch_embed(x)
    for stage in m.layers:
        t = stage.downsample(t) if stage.merges else t
        for i, blk in enumerate(stage.blocks):
            t = blk(t)
            t = peg_map(t, stage.abs_pos.proj) if i == 0 else t
    torch.testing.assert_close(m(x), m.forward_head(m.norm(t)), rtol=0, atol=1e-12)
    imgs = [torch.randn(3, 32, 24, dtype=torch.float64), torch.randn(3, 16, 40, dtype=torch.float64)]
    torch.testing.assert_close(m(imgs), torch.cat([m(img[None]) for img in imgs]), rtol=0, atol=1e-12)


def test_swin_at_the_input():
    m = swin(None)
    assert isinstance(m.abs_pos, Cpe) and all(st.abs_pos is None for st in m.layers)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    t = peg_map(m.patch_embed(x), m.abs_pos.proj)
    for stage in m.layers:
        t = stage(t)
    torch.testing.assert_close(m(x), m.forward_head(m.norm(t)), rtol=0, atol=1e-12)


def test_no_weight_decay_names_its_parameters():
    """As Twins' ``no_weight_decay`` (every parameter of its ``pos_block``)."""
    assert {"abs_pos.proj.weight", "abs_pos.proj.bias"} <= model().no_weight_decay()


# ------------------------------------------------------------------------------ refusals
def test_refusals_name_the_fix():
    with pytest.raises(ValueError, match="after block 3.*3 blocks"):
        model(3)
    with pytest.raises(ValueError, match="after_block"):
        make(after_block=-1)
    with pytest.raises(ValueError, match="odd"):
        make(kernel_size=4)
    with pytest.raises(ValueError, match="below its 1 blocks"):
        vitrel.create_model(
            "vitrel_swin_tiny_patch2_window4_32", pos={"name": "cpe", "after_block": 1}, depths=(2, 1), num_heads=(2, 2)
        )
    with pytest.raises(ValueError, match="takes image grids"):
        vitrel.create_model("vitrel_vit_video_tiny_patch4_32", pos="cpe")
    with pytest.raises(ValueError, match="computed from the tokens"):
        vitrel.viz.position_matrix(make())
