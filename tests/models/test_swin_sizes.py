"""Swin at sizes it was not built for: the windows, their shift and masks against Swin's definition, and
``set_input_size``'s windows against timm's."""

from __future__ import annotations

import math
import warnings

import pytest
import timm
import torch

import vitrel
from vitrel.layout.geometry import Grid
from vitrel.models.swin_blocks import window_attention

SWIN = "vitrel_swin_tiny_patch2_window4_32"
ARGS = dict(embed_dim=16, depths=(2, 2, 2, 2), num_heads=(2, 2, 2, 4), num_classes=5, drop_path_rate=0.0)


def _swin(pos: str, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    m = vitrel.create_model(SWIN, pos=pos, **{**ARGS, **kw}).double().eval()
    with torch.no_grad():  # non-trivial position terms: a zero table would hide a wrong offset
        for name, p in m.named_parameters():
            if ".pos." in name:
                p.add_(0.5 * torch.randn_like(p))
    return m


def _groups(n: int, shift: int, window: int) -> list[int]:
    """The shifted window of each row (column) ``r``: ``floor((r - s) / M)`` (Swin's windows, offset by ``s``)."""
    return [math.floor((r - shift) / window) for r in range(n)]


def _reference(blk, xn: torch.Tensor) -> torch.Tensor:
    """The block's window attention written from Swin's definition: the window is the configured one shrunk to a
    smaller grid, the shift ``M // 2`` along an axis where the grid exceeds the window (0 else, 0 in a plain block);
    a token attends to exactly the tokens of its group (same ``floor((r - s) / M)`` on both axes), and a group is
    attended as an image of its own (every scheme here is a function of the offsets)."""
    b, h, w, c = xn.shape
    (mh, mw), out = blk.window_size, torch.full_like(xn, float("nan"))
    wh, ww = min(mh, h), min(mw, w)
    sh = wh // 2 if blk.shifted and h > wh else 0
    sw = ww // 2 if blk.shifted and w > ww else 0
    gr, gc = _groups(h, sh, wh), _groups(w, sw, ww)
    for a in set(gr):
        rows = [r for r in range(h) if gr[r] == a]
        for g in set(gc):
            cols = [col for col in range(w) if gc[col] == g]
            t = xn[:, rows[0] : rows[-1] + 1, cols[0] : cols[-1] + 1]
            o = blk.attn(t.reshape(b, -1, c), grid=Grid(len(rows), len(cols)))
            out[:, rows[0] : rows[-1] + 1, cols[0] : cols[-1] + 1] = o.view(b, len(rows), len(cols), c)
    return out


# built at 32 (stage grids 16, 8, 4, 2); these map grids: larger and smaller than built, not multiples of the window
# (padding), the window shrunk on one axis only, a grid of one row, a grid just over the window
GRIDS = [(18, 18), (9, 9), (5, 7), (6, 11), (3, 3), (1, 6), (2, 9), (8, 8)]


@pytest.mark.parametrize("pos", ["rel2d_full", "rel2d_cpb", "rope2d_axial", "shaw2d_factored", "alibi2d", "none"])
def test_windows_at_other_sizes_follow_swins_definition(pos: str) -> None:
    m = _swin(pos)
    g = torch.Generator().manual_seed(1)
    for stage in m.layers:
        for blk in stage.blocks:
            for h, w in GRIDS:
                x = torch.randn(2, h, w, blk.norm1.normalized_shape[0], generator=g, dtype=torch.float64)
                xn = blk.norm1(x)
                got = window_attention(blk, xn, blk._state(xn, None, None))
                torch.testing.assert_close(got, _reference(blk, xn), rtol=1e-10, atol=1e-10, msg=f"{(h, w)}")


def _timm_windows(model) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    return [(tuple(b.window_size), tuple(b.shift_size)) for s in model.layers for b in s.blocks]


def _our_windows(model, size: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Each block's window and shift in a forward pass on ``size x size`` images (what ``SwinBlock.windows`` used)."""
    seen, blocks = [], [b for s in model.layers for b in s.blocks]
    for blk in blocks:

        def windows(x, _blk=blk):
            out = type(_blk).windows(_blk, x)
            seen.append((tuple(out[2]), tuple(out[3])))
            return out

        blk.windows = windows
    try:
        with torch.no_grad():
            model(torch.zeros(1, 3, size, size, dtype=torch.float64))
    finally:
        for blk in blocks:
            del blk.windows
    return seen


def _timm_swin(**kw) -> torch.nn.Module:
    args = dict(img_size=32, patch_size=2, window_size=4, embed_dim=16, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4))
    return timm.create_model("swin_tiny_patch4_window7_224", num_classes=5, drop_path_rate=0.0, **{**args, **kw})


def test_set_input_size_windows_are_timms() -> None:
    """timm's rule: without ``window_size`` / ``window_ratio`` the window scales from the window and grid last set
    explicitly (at construction, or by a ``window_size`` / ``window_ratio``), so sizes there and back give the window
    back; the same windows and shifts as timm's Swin after every call, and then the same logits."""
    ref = _timm_swin().double().eval()
    ours = vitrel.create_model(SWIN, pos="rel2d_full", **{**ARGS, "num_heads": (1, 2, 2, 4)}).double().eval()
    calls = [
        dict(img_size=20),  # window 4 * 10 // 16 = 2
        dict(img_size=32),  # back: 4 (scaled from 2 at grid 10: 3)
        dict(img_size=72),  # 4 * 36 // 16 = 9
        dict(img_size=40, window_size=3),  # an explicit window: the new reference
        dict(img_size=64),  # 3 * 32 // 20 = 4
        dict(window_ratio=4),  # 32 // 4 = 8, the new reference
        dict(img_size=48),  # 8 * 24 // 32 = 6
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # resized tables
        for kw in calls:
            ref.set_input_size(**kw)
            ours.set_input_size(**kw)
            assert _our_windows(ours, ours.img_size[0]) == _timm_windows(ref), kw
    with torch.no_grad():  # timm's weights (large tables, so a wrong offset shows): the same logits at 48
        mine = dict(ours.named_parameters())
        for n, p in ref.named_parameters():
            if "relative_position_bias_table" in n:
                p.normal_(0, 1.0)
                n = n.replace("attn.relative_position_bias_table", "attn.pos.table")
            mine[n.replace("head.fc.", "head.")].copy_(p.view(mine[n.replace("head.fc.", "head.")].shape))
    x = torch.randn(2, 3, 48, 48, dtype=torch.float64)
    torch.testing.assert_close(ours(x), ref(x))


def test_windows_at_a_call_size_are_timms_set_to_it() -> None:
    """A model built at 32 and run at another size windows as timm's Swin set to that size with the model's
    window (``set_input_size(img_size=s, window_size=4)``): the window shrunk to each stage's grid at that size."""
    ours = _swin("rel2d_full")
    for size in (16, 20, 36, 48, 64, 72):
        ref = _timm_swin()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # timm's table resize (its own interpolation code's notices)
            ref.set_input_size(img_size=size, window_size=4)
        assert _our_windows(ours, size) == _timm_windows(ref), size


@pytest.mark.parametrize("ratio", [0, -2])
def test_set_input_size_refuses_a_window_ratio_below_one(ratio: int) -> None:
    """A ratio below 1 has no window (timm asserts it positive): a ``ValueError`` naming it, the model unchanged
    (-2 gave a 1 x 1 window without a word, 0 a ``ZeroDivisionError``)."""
    m = _swin("rel2d_full")
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(ValueError, match=f"window_ratio must be an int >= 1 .*, got {ratio}$"):
        m.set_input_size(window_ratio=ratio)
    assert m.window_size == (4, 4) and m.vitrel_cfg["window_size"] == [4, 4]
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())


def _equation_block(blk, x: torch.Tensor) -> torch.Tensor:
    """A ``rel2d_full`` block from Swin's equations over the whole map: token ``(r, c)`` attends to the tokens of its
    group ``floor((r - s) / M)`` on both axes with ``q.k / sqrt(d) + B[dr, dc]``, ``B`` the block's table read at the
    offset (clamped to its edge); then the MLP."""
    b, h, w, c = x.shape
    xn = blk.norm1(x)
    wh, ww = min(blk.window_size[0], h), min(blk.window_size[1], w)
    sh = wh // 2 if blk.shifted and h > wh else 0
    sw = ww // 2 if blk.shifted and w > ww else 0
    r, col = torch.arange(h).repeat_interleave(w), torch.arange(w).repeat(h)
    gr, gc = torch.tensor(_groups(h, sh, wh))[r], torch.tensor(_groups(w, sw, ww))[col]
    same = (gr[:, None] == gr[None]) & (gc[:, None] == gc[None])
    a, table = blk.attn, blk.attn.pos.table
    th, tw = (table.shape[0] - 1) // 2, (table.shape[1] - 1) // 2
    bias = table[(r[:, None] - r[None]).clamp(-th, th) + th, (col[:, None] - col[None]).clamp(-tw, tw) + tw]
    q, k, v = a.qkv(xn.reshape(b, h * w, c)).reshape(b, h * w, 3, a.num_heads, a.head_dim).permute(2, 0, 3, 1, 4)
    logits = (q @ k.transpose(-1, -2) * a.scale + bias.permute(2, 0, 1)).masked_fill(~same, float("-inf"))
    x = x + a.proj((logits.softmax(-1) @ v).transpose(1, 2).reshape(b, h * w, c)).view(b, h, w, c)
    return x + blk.mlp(blk.norm2(x))


def _equation_swin(m, images: torch.Tensor) -> torch.Tensor:
    """The whole Swin from its equations: patch embedding, 2 x 2 merging of zero-padded odd sides (timm's channel
    order), the blocks (:func:`_equation_block`), the final norm, mean pooling and the head."""
    x = m.patch_embed.norm(m.patch_embed.proj(images).permute(0, 2, 3, 1))
    for stage in m.layers:
        if stage.merges:
            x = torch.nn.functional.pad(x, (0, 0, 0, x.shape[2] % 2, 0, x.shape[1] % 2))
            parts = [x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]]
            x = stage.downsample.reduction(stage.downsample.norm(torch.cat(parts, -1)))
        for blk in stage.blocks:
            x = _equation_block(blk, x)
    return m.head(m.norm(x).mean((1, 2)))


def test_whole_model_at_other_sizes_follows_swins_equations() -> None:
    """The model end to end, at sizes that are not multiples of the window (padding), smaller than it (shrunk) and
    larger than built, then set to a larger window (its tables grown): equal to :func:`_equation_swin` in float64."""
    m = _swin("rel2d_full", depths=(2, 2, 2), num_heads=(2, 2, 4), strict_img_size=False)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for size in [(32, 32), (20, 20), (22, 30), (14, 10), (6, 18), (44, 44)]:
            x = torch.randn(2, 3, *size, generator=g, dtype=torch.float64)
            torch.testing.assert_close(m(x), _equation_swin(m, x), rtol=0, atol=1e-12, msg=f"{size}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # resized tables
            m.set_input_size(img_size=48)  # window 4 * 24 // 16 = 6
        assert m.window_size == (6, 6)
        x = torch.randn(2, 3, 44, 36, generator=g, dtype=torch.float64)
        torch.testing.assert_close(m(x), _equation_swin(m, x), rtol=0, atol=1e-12)
