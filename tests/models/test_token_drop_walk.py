"""NaViT token dropping (``token_drop``) against references, for every image scheme.

The kept tokens are read from the model's own draw (same seed). A naive float64 forward written from the equations
(``rel2d_full`` + ``ape``) checks the layout path itself; every other scheme (with the DINOv3 coordinate augmentation
and STRING) is checked against the full grid with the dropped tokens removed from attention (and zero to CPE's
convolution), forward and gradients
of every parameter; padded slots of unequal counts must reach neither pooling nor the logits; every kernel agrees."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import vitrel
from tests.layout.test_tokens import IMAGES, images, packed
from vitrel.layout.geometry import Grid
from vitrel.models.naflex import token_drop_rates
from vitrel.pos.registry import get_pos_class, list_pos

IMAGE_SCHEMES = [n for n in list_pos() if get_pos_class(n).grid_dims != 3] + ["sincos3d"]
VARIANTS = {
    "dinov3": {"name": "rope2d_axial", "coords": "normalized", "shift": 0.5, "jitter": 1.5, "rescale": 2.0},
    "string": {"name": "rope2d_mixed", "basis": "cayley", "coords": "normalized", "jitter": 2.0},
}
PREFIXES = {"prefix0": dict(class_token=False, global_pool="avg"), "registers": dict(reg_tokens=2)}


def model(pos, dtype=torch.float64, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    kw = {"embed_dim": 32, "num_heads": 4, **kw}
    m = vitrel.create_model("vitrel_vit_tiny_patch4_32", pos=pos, img_size=16, num_classes=5, depth=2, **kw)
    return m.to(dtype).train()


def drawn(m, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's logits with ``seed`` and its kept patches ``[B, H'W']`` (bool, raster order) of that draw."""
    torch.manual_seed(seed)
    logits = m(x)
    torch.manual_seed(seed)
    _, layout, _, _ = m.forward_layout(x)
    grid = Grid(x.shape[-2] // 4, x.shape[-1] // 4)
    kept = torch.zeros(x.shape[0], grid.n, dtype=torch.bool)
    for b in range(x.shape[0]):
        rc = layout.coords[b, layout.is_patch[b]]
        kept[b, rc[:, 0] * grid.w + rc[:, 1]] = True
    return logits, kept


def masked_reference(m, x: torch.Tensor, kept: torch.Tensor, seed: int) -> torch.Tensor:
    """Logits of the full grid with the dropped patches removed as keys and from pooling; the random draws (the
    drop's, then any coordinate augmentation's) replayed from ``seed``."""
    p = m.num_prefix_tokens
    keep = F.pad(kept, (p, 0), value=True)
    n = keep.shape[1]
    mask = torch.zeros(x.shape[0], 1, n, n, dtype=x.dtype).masked_fill(~keep[:, None, None, :], float("-inf"))
    torch.manual_seed(seed)
    if not isinstance(m.token_drop, float):
        token_drop_rates(m.token_drop, x.shape[0])
    torch.rand(kept.shape)  # the drop's scores
    y, grid = m.embed(x)
    after = None if m.abs_pos is None else m.abs_pos.after_block
    for i, (blk, st) in enumerate(zip(m.blocks, m.position_states(grid, y))):
        y = blk(y, mask=mask, pos_state=st)
        if i == after:  # (CPE after a block: the dropped patches are absent, zeros to its convolution)
            z = y * keep[..., None]
            y = y + m.abs_pos.add_to_tokens(z, grid, p) - z
    y = m.norm(y)
    if m.global_pool == "avg":
        pooled = torch.stack([y[b, p:][kept[b]].mean(0) for b in range(x.shape[0])])
    else:
        pooled = y[:, 0]
    return m.head(m.fc_norm(pooled))


def grads(m, logits: torch.Tensor, w: torch.Tensor) -> dict[str, torch.Tensor]:
    names, params = zip(*[(k, v) for k, v in m.named_parameters() if v.requires_grad])
    got = torch.autograd.grad((logits * w).sum(), params, allow_unused=True)
    return {k: g for k, g in zip(names, got) if g is not None}


# ------------------------------------------------------------------------------ naive, from the equations
def naive_logits(m, x: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """``rel2d_full`` + ``ape`` with class and register tokens, written out: each image's kept patches only, with
    their original absolute embedding and their original (row, col) offsets into the bias table."""
    out = []
    gw = x.shape[-1] // 4
    for b in range(x.shape[0]):
        idx = kept[b].nonzero()[:, 0]
        r, c = idx // gw, idx % gw
        patches = m.patch_embed.proj(x[b : b + 1]).flatten(2)[0].t()[idx]
        patches = patches + m.abs_pos.pos_embed[0, idx]
        t = torch.cat([m.cls_token[0], m.reg_token[0], patches])
        p, n = m.num_prefix_tokens, t.shape[0]
        for blk in m.blocks:
            a, heads = blk.attn, blk.attn.num_heads
            h = blk.norm1(t)
            q, k, v = (a.qkv(h).view(n, 3, heads, -1).permute(1, 2, 0, 3)).unbind(0)
            table = a.pos.table  # [2H-1, 2W-1, heads], offset (0, 0) at the centre
            cy, cx = (table.shape[0] - 1) // 2, (table.shape[1] - 1) // 2
            bias = torch.zeros(heads, n, n, dtype=x.dtype)
            bias[:, p:, p:] = table[(r[:, None] - r[None]) + cy, (c[:, None] - c[None]) + cx].permute(2, 0, 1)
            att = (q @ k.transpose(-1, -2) * a.head_dim**-0.5 + bias).softmax(-1)
            t = t + a.proj((att @ v).transpose(0, 1).reshape(n, -1))
            t = t + blk.mlp(blk.norm2(t))
        out.append(m.head(m.fc_norm(m.norm(t)[0])))
    return torch.stack(out)


def test_token_drop_equals_a_naive_forward_of_the_kept_tokens():
    m = model("rel2d_full", abs_pos="ape", reg_tokens=1, token_drop=(0.2, 0.8))
    x = torch.randn(4, 3, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    got, kept = drawn(m, x, seed=3)
    counts = kept.sum(1).tolist()
    assert len(set(counts)) > 1, counts  # unequal counts: padded slots in the batch
    ref = naive_logits(m, x, kept)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    w = torch.randn(got.shape, dtype=torch.float64)
    torch.manual_seed(3)
    g_got = grads(m, m(x), w)
    g_ref = grads(m, naive_logits(m, x, kept), w)
    for name in ("blocks.0.attn.qkv.weight", "blocks.1.attn.pos.table", "blocks.0.attn.pos.table", "abs_pos.pos_embed"):
        torch.testing.assert_close(g_got[name], g_ref[name], rtol=1e-10, atol=1e-12, msg=name)


# ------------------------------------------------------------------------------ every scheme
@pytest.mark.parametrize("prefix", list(PREFIXES))
@pytest.mark.parametrize("pos", IMAGE_SCHEMES + list(VARIANTS))
def test_token_drop_equals_the_masked_full_grid(pos, prefix):
    """Forward, and every parameter's gradient (with registers); a grid (5x4) larger than the 4x4 tables, unequal
    counts."""
    m = model(VARIANTS.get(pos, pos), token_drop=(0.1, 0.9), **PREFIXES[prefix])
    x = torch.randn(3, 3, 20, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    got, kept = drawn(m, x, seed=5)
    ref = masked_reference(m, x, kept, seed=5)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    if prefix == "prefix0":
        return
    w = torch.randn(got.shape, dtype=torch.float64)
    torch.manual_seed(5)
    g_got = grads(m, m(x), w)
    g_ref = grads(m, masked_reference(m, x, kept, seed=5), w)
    assert g_got.keys() == g_ref.keys()
    for name in g_got:
        torch.testing.assert_close(g_got[name], g_ref[name], rtol=1e-9, atol=1e-11, msg=name)


@pytest.mark.parametrize("drop", [0.0, 0.5, 0.95, (0.0, 0.0), (0.3, 0.9)])
def test_rates_keep_at_least_one_patch_and_padding_reaches_no_pooling(drop):
    for pool in ("avg", "token"):
        m = model("rel2d_full", token_drop=drop, global_pool=pool, reg_tokens=1)
        x = torch.randn(5, 3, 16, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        got, kept = drawn(m, x, seed=7)
        lo, hi = (drop, drop) if isinstance(drop, float) else drop
        assert kept.sum(1).min() >= max(1, round((1 - hi) * 12)) and kept.sum(1).max() <= round((1 - lo) * 12)
        torch.testing.assert_close(got, masked_reference(m, x, kept, seed=7), rtol=0, atol=1e-12)


@pytest.mark.parametrize("pos", ["rel2d_full", "rel2d_factored", "alibi2d", "rope2d_mixed", "lookhere", "shaw2d_full"])
def test_every_kernel_gives_the_same_dropped_forward(pos):
    x = torch.randn(4, 3, 16, 12, generator=torch.Generator().manual_seed(1))
    outs = {}
    for impl in ("eager", "sdpa", "fold", "shaw"):  # (flex: compiled, slow on CPU; the same layout masks)
        try:
            m = model(pos, dtype=torch.float32, token_drop=(0.2, 0.7), attn_impl=impl, reg_tokens=1)
        except ValueError:  # a kernel that does not compute this scheme says so when built
            continue
        torch.manual_seed(3)
        with torch.no_grad():
            outs[impl] = m(x)
    assert len(outs) >= 2, outs.keys()
    first = next(iter(outs.values()))
    for impl, out in outs.items():
        torch.testing.assert_close(out, first, rtol=0, atol=1e-5, msg=impl)


@pytest.mark.parametrize("form", ["packed", "list"])
@pytest.mark.parametrize("pos", ["rel2d_full", "rope2d_mixed", "alibi1d", "shaw2d_full", "ape", "lookhere"])
def test_token_drop_of_naflex_inputs_equals_each_image_alone_masked(pos, form):
    """Images of other grids (3x4, 2x2, 6x5) packed two to a row, or a list: each image's logits are its own grid's
    with its dropped patches removed."""
    m = model(pos, token_drop=(0.2, 0.7), reg_tokens=1)
    imgs = images()
    x = packed(imgs) if form == "packed" else imgs
    torch.manual_seed(4)
    got = m(x)
    torch.manual_seed(4)
    _, layout, _, _ = m.forward_layout(x)
    for i, (h, w) in enumerate(IMAGES):
        grid = Grid(h // 4, w // 4)
        rc = layout.coords[layout.is_patch & (layout.image == i)]
        kept = torch.zeros(1, grid.n, dtype=torch.bool)
        kept[0, rc[:, 0] * grid.w + rc[:, 1]] = True
        assert 1 <= rc.shape[0] < grid.n  # some dropped, at least one kept
        p = m.num_prefix_tokens
        keep = F.pad(kept, (p, 0), value=True)
        mask = torch.zeros(1, 1, p + grid.n, p + grid.n, dtype=torch.float64).masked_fill(
            ~keep[:, None, None], -torch.inf
        )
        y, g = m.embed(imgs[i][None])
        for blk, st in zip(m.blocks, m.position_states(g, y)):
            y = blk(y, mask=mask, pos_state=st)
        ref = m.head(m.fc_norm(m.norm(y)[:, 0]))
        torch.testing.assert_close(got[i : i + 1], ref, rtol=0, atol=1e-12)
