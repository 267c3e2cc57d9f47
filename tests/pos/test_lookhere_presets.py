"""LookHere's ``fov`` presets against the authors' released configurations, re-derived from their code.

The reference below is a float64 loop rewrite of the authors' ``create_lh_bias_tensor`` /
``create_lh_layer_tensor`` / ``get_slopes`` / ``get_none_slopes`` (GreenCUBIC/lookhere ``lookhere.py``,
commit 641deab8): their head-direction shorthands, their head split by number of names and heads, slopes
per run of equal names (``groupby``), their direction masks (coordinate comparisons) and triangle masks
(``np.tri`` bounded by the query's diagonal labels), a head masking the union of its parts' masks (a
``diag_a_b`` part masking what both triangles mask), then ``global_slope * linspace(layer) * slope * dist``
and a zero row and column for the class token. The presets are the released LH-180
``halves-diagonals-none``, LH-90 ``corners-triangles-none``, LH-45 ``eighths1-eighths2-none``, with
``global_slope`` 2 and ``layer_slopes`` (1.5, 0.5): the co-author's ADE20K configurations
(DanielKyr/mmsegmentation ``configs/lookhere/LH2-ADE.py``, ``LH4-ADE.py``, ``LH8-ADE.py``, commit 407200d0,
whose ``alibi.py`` builds the same bias) and, for LH-90, DTU-PAS PaPE's ``pape/nn/positions/lookhere.py``.
The authors cast to bfloat16 and fill masked pairs with its largest finite value; the comparison is
before that cast, masked pairs as ``-inf``.
"""

from __future__ import annotations

import math
from itertools import groupby
from pathlib import Path

import numpy as np
import pytest
import timm
import torch

import vitrel
from tests.weights import reloaded_as_written
from vitrel.kernels import get_kernel
from vitrel.pos import Grid, build_pos
from vitrel.pos.registry import get_pos_class
from vitrel.pos.schemes.lookhere import LookHere, group_sizes

FIX = Path(__file__).parents[1] / "fixtures"
INF = float("-inf")

# the authors' shorthands: per set, the parts of each of its four heads
AUTHORS_SETS = {
    "none": [(), (), (), ()],
    "halves": [("up",), ("down",), ("left",), ("right",)],
    "corners": [("up", "left"), ("up", "right"), ("down", "left"), ("down", "right")],
    "triangles": [("tri_up",), ("tri_down",), ("tri_left",), ("tri_right",)],
    "diagonals": [("diag_up_right",), ("diag_up_left",), ("diag_down_right",), ("diag_down_left",)],
    "eighths1": [("tri_up", "left"), ("tri_down", "left"), ("tri_left", "up"), ("tri_right", "up")],
    "eighths2": [("tri_up", "right"), ("tri_down", "right"), ("tri_left", "down"), ("tri_right", "down")],
}
PRESETS = {180: "halves-diagonals-none", 90: "corners-triangles-none", 45: "eighths1-eighths2-none"}


def authors_heads(head_directions: str, num_heads: int) -> tuple[list[str], list[tuple[str, ...]], list[float]]:
    """Per head: the set's name, its parts and its slope, by the authors' branches."""
    sh = head_directions.split("-")
    sets = [AUTHORS_SETS[s] for s in sh]
    if num_heads == 6:
        names, views = [sh[0]] * 4 + [sh[1]] * 2, sets[0] + sets[1][:2]
    elif len(sh) == 1:
        names, views = [sh[0]] * num_heads, sets[0] * (num_heads // 4)
    else:  # blocks of four heads per name
        reps = {(2, 12): (2, 1), (2, 16): (2, 2), (3, 12): (1, 1, 1), (3, 16): (2, 1, 1), (4, 16): (1, 1, 1, 1)}
        r = reps[(len(sh), num_heads)]
        names = [n for n, k in zip(sh, r) for _ in range(4 * k)]
        views = [v for s, k in zip(sets, r) for v in s * k]
    slopes = []
    for name, run in groupby(names):
        n = len(list(run))
        if name == "none":
            base = [0.25, 0.0625, 0.015625, 0.00390625]
            slopes += base[:2] if n == 2 else base if n == 4 else [s for s in base for _ in range(n // 4)]
        else:
            slopes += [2.0 ** -(i + 1) for i in range(n // 4) for _ in range(4)]
    assert len(names) == len(views) == len(slopes) == num_heads
    return names, views, slopes


def _tri(k: int, r: int, c: int) -> bool:
    """``np.tri(..., k)[r, c]``."""
    return c <= r + k


def authors_masked(part: str, q: tuple[int, int], k: tuple[int, int], width: int) -> bool:
    """Is key ``k`` masked for query ``q`` by ``part`` (``(x, y)`` = (column, row) as the authors' coords)?"""
    (xq, yq), (xk, yk) = q, k
    if part in ("up", "down", "left", "right"):
        return {"right": xk < xq, "left": xk > xq, "up": yk > yq, "down": yk < yq}[part]
    dpos, dneg = xq - yq, (width - 1) - xq - yq  # the query's diagonal labels (np.diag offsets, fliplr grid)
    trid, triu = _tri(dpos, yk, xk), not _tri(dpos - 1, yk, xk)
    trir, tril = _tri(dneg, yk, width - 1 - xk), not _tri(dneg - 1, yk, width - 1 - xk)
    masked = {"up": not (triu and tril), "down": not (trid and trir), "right": not (triu and trir)}
    masked["left"] = not (trid and tril)
    if part.startswith("tri_"):
        return masked[part[4:]]
    _, a, b = part.split("_")  # diag_a_b
    return masked[a] and masked[b]


def authors_bias(head_directions, num_heads, grid, layer, depth, cls, g=2.0, layer_slopes=(1.5, 0.5)):
    """``[heads, N, N]`` float64: the authors' bias of block ``layer`` of ``depth``, masked pairs ``-inf``."""
    _, views, slopes = authors_heads(head_directions, num_heads)
    gy, gx = grid
    s_l = float(np.linspace(layer_slopes[0], layer_slopes[1], depth)[layer])
    coords = [(x, y) for y in range(gy) for x in range(gx)]
    p = int(cls)
    out = torch.zeros(num_heads, p + len(coords), p + len(coords), dtype=torch.float64)
    for h in range(num_heads):
        for i, q in enumerate(coords):
            for j, k in enumerate(coords):
                masked = any(authors_masked(part, q, k, gx) for part in views[h])
                dist = math.dist(q, k)
                out[h, p + i, p + j] = INF if masked else -(g * s_l * slopes[h] * dist)
    return out


def ours(spec, heads, grid, layer, depth, cls):
    s = build_pos(spec, num_heads=heads, head_dim=8, grid=grid, num_prefix_tokens=int(cls), layer=(layer, depth))
    return s.double().bias(Grid(*grid), int(cls))


def assert_same(got, want):
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = ~torch.isinf(want)
    torch.testing.assert_close(got[fin], want[fin], atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("fov", [180, 90, 45])
@pytest.mark.parametrize("cls", [False, True])
def test_presets_are_the_released_head_groups(fov, cls):
    """fov 180 / 90 / 45 at 12 heads (ViT-B) equal the released configurations, every block of a depth-3
    model (with and without the class token) on a non-square grid."""
    for layer in range(3):
        want = authors_bias(PRESETS[fov], 12, (4, 5), layer, 3, cls)
        assert_same(ours({"name": "lookhere", "fov": fov}, 12, (4, 5), layer, 3, cls), want)


@pytest.mark.parametrize("fov", [180, 90, 45])
def test_presets_at_16_heads_are_the_authors_split(fov):
    """16 heads (ViT-L): the authors' code gives the first group 8 heads (slopes 1/2 and 1/4), the others 4."""
    assert_same(
        ours({"name": "lookhere", "fov": fov}, 16, (3, 4), 1, 2, True),
        authors_bias(PRESETS[fov], 16, (3, 4), 1, 2, True),
    )


@pytest.mark.parametrize("name", ["diagonals", "eighths2", "none", "triangles", "eighths1", "corners", "halves"])
@pytest.mark.parametrize("heads", [4, 8])
def test_each_direction_set_alone(name, heads):
    """Every set as the single-set form (``directions: <set>``), one by one; the authors' names are taken."""
    want = authors_bias(name, heads, (5, 4), 0, 1, False, g=0.7)
    got = ours({"name": "lookhere", "directions": name, "global_slope": 0.7}, heads, (5, 4), 0, 1, False)
    assert_same(got, want)


def test_the_new_sets_views_by_hand():
    """The centre query of a 3x3 grid (keys numbered row by row, 4 is the query): which keys each view keeps."""
    s = build_pos(
        {"name": "lookhere", "directions": ["diagonals", "eighths2", "none"]}, num_heads=12, head_dim=8, grid=(3, 3)
    )
    seen = [set(torch.nonzero(row > INF).flatten().tolist()) for row in s.bias(Grid(3, 3))[:, 4]]
    assert (
        seen
        == [
            {0, 1, 2, 4, 5, 8},  # diagonals: up-right (dh >= dw)
            {0, 1, 2, 3, 4, 6},  # up-left (dh >= -dw)
            {2, 4, 5, 6, 7, 8},  # down-right (dh <= -dw)
            {0, 3, 4, 6, 7, 8},  # down-left (dh <= dw)
            {1, 2, 4},  # eighths2: up-triangle & right half
            {4, 7, 8},  # down-triangle & right half
            {3, 4, 6},  # left-triangle & down half
            {4, 5, 8},  # right-triangle & down half
        ]
        + [set(range(9))] * 4
    )  # none
    assert s.head_slopes.tolist() == [0.5] * 4 + [0.5] * 4 + [1 / 4, 1 / 16, 1 / 64, 1 / 256]


@pytest.mark.parametrize(
    "directions,heads",
    [
        ("halves-none", 12),
        ("halves-none", 6),
        ("triangles-none", 6),
        ("halves-halves-none", 16),
        ("none-halves-none", 12),
    ],
)
def test_group_lists_as_the_authors_code(directions, heads):
    """Group lists: slopes restart per run of equal sets, a repeated set continues its run, 6 heads take 4 + 2."""
    for spec in ({"directions": directions}, {"directions": directions.split("-")}):
        got = ours({"name": "lookhere", **spec}, heads, (3, 4), 2, 3, True)
        assert_same(got, authors_bias(directions, heads, (3, 4), 2, 3, True))


def test_other_head_counts():
    """Blocks of four dealt from the first group, the rest to the next: the authors' split where their code
    builds (12, 16 heads), the same rule elsewhere (6 heads included); every head gets a view and a slope."""
    assert [group_sizes(3, h) for h in (2, 3, 4, 6, 8, 12, 14, 16, 24)] == [
        [2, 0, 0],
        [3, 0, 0],
        [4, 0, 0],
        [4, 2, 0],
        [4, 4, 0],
        [4, 4, 4],
        [6, 4, 4],
        [8, 4, 4],
        [8, 8, 8],
    ]
    groups = {
        h: build_pos({"name": "lookhere", "fov": 180}, num_heads=h, head_dim=8, grid=(3, 3)).groups for h in (3, 6)
    }
    assert groups == {3: [("halves", 3)], 6: [("halves", 4), ("diagonals", 2)]}
    s = build_pos({"name": "lookhere", "fov": 90}, num_heads=6, head_dim=8, grid=(3, 4))
    assert s.head_slopes.tolist() == [0.5] * 6
    single = build_pos({"name": "lookhere", "directions": "halves"}, num_heads=6, head_dim=8, grid=(3, 3))
    assert single.groups == [("halves", 6)] and single.head_slopes.tolist() == [0.5] * 4 + [0.25] * 2
    with pytest.raises(ValueError, match="directions must be one of"):
        build_pos({"name": "lookhere", "directions": "halves-spiral"}, num_heads=4, head_dim=8, grid=(3, 3))


@pytest.mark.parametrize("fov", [180, 45])
def test_flex_block_mask_of_a_preset(fov):
    """The flex BlockMask of a preset is its bias's finite pairs (the ``none`` heads: every pair), one mask
    for blocks of different slopes (prepare_many)."""
    from torch.nn.attention.flex_attention import create_mask

    grid, prefix = Grid(5, 6), 1
    blocks = [
        build_pos(
            {"name": "lookhere", "fov": fov}, num_heads=12, head_dim=8, grid=grid, num_prefix_tokens=1, layer=(i, 2)
        )
        for i in range(2)
    ]
    states = LookHere.prepare_many(blocks, grid, prefix, kernel=get_kernel("flex"))
    assert states[0].block_mask is states[1].block_mask
    dense = create_mask(states[0].block_mask.mask_mod, None, 12, 31, 31, device="cpu")[0]
    assert torch.equal(dense, blocks[0].bias(grid, prefix) > INF)
    assert dense[8:].all() and not dense[:8].all()


def _v2_outputs():
    return torch.load(FIX / "v2_lookhere_out.pt", weights_only=True)


def test_checkpoints_written_before_the_presets_load_as_they_were():
    """vitrel_format 2 (commit 358d964) stored ``fov: 90`` / ``pos: lookhere`` meaning one set for every head
    with ``global_slope`` 1: the fixtures load as that model (checkpoint, export folder, timm's local-dir),
    and the same weights under the new meaning compute something else."""
    ref = _v2_outputs()
    vit = vitrel.load_model(FIX / "v2_vit_lookhere_fov90.pt").eval()
    swin = vitrel.load_model(FIX / "v2_swin_lookhere").eval()
    local = timm.create_model(f"local-dir:{FIX / 'v2_swin_lookhere'}", pretrained=True).eval()
    assert all(b.attn.pos.directions == ("quadrants",) and b.attn.pos.global_slope == 1.0 for b in vit.blocks)
    with torch.no_grad():
        torch.testing.assert_close(vit(ref["x"]), ref["vit"])
        torch.testing.assert_close(swin(ref["x"]), ref["swin"])
        torch.testing.assert_close(local(ref["x"]), ref["swin"])
        assert vit.vitrel_cfg["vitrel_format"] >= 3 and vit.vitrel_cfg["pos"]["directions"] == "quadrants"
        fov90 = {"name": "lookhere", "fov": 90, "directions": None}  # (a mapping sets options over the stored ones)
        new = vitrel.load_model(FIX / "v2_vit_lookhere_fov90.pt", pos=fov90).eval()
        assert new.blocks[0].attn.pos.groups == [("quadrants", 4), ("triangles", 4)]
        assert not torch.allclose(new(ref["x"]), ref["vit"])


def test_configs_written_now_keep_the_presets(tmp_path):
    """A format-3 config is taken as written: fov 180 stays the preset, global_slope 2."""
    m = vitrel.create_model("vitrel_vit_tiny_patch4_32", pos="lookhere", embed_dim=48, depth=1, num_heads=12)
    torch.save({"vitrel_cfg": m.vitrel_cfg, "state_dict": m.state_dict()}, tmp_path / "m.pt")
    back = vitrel.load_model(tmp_path / "m.pt").blocks[0].attn.pos
    assert back.directions == ("halves", "diagonals", "none") and back.global_slope == 2.0
    assert LookHere.legacy_options({"name": "lookhere", "fov": 45}, 2) == {
        "name": "lookhere",
        "directions": "eighths",
        "global_slope": 1.0,
    }
    kept = {"name": "lookhere", "directions": ["halves", "none"], "global_slope": 3.0}
    assert LookHere.legacy_options(kept, 2) == kept
    assert LookHere.legacy_options({**kept, "fov": 90}, 2) == kept  # fov beside directions: ignored then, dropped
    alibi = get_pos_class("alibi2d")  # format 2 already meant ALiBi's reference slopes; 0.1 (1) the geometric
    assert alibi.legacy_options({"name": "alibi2d"}, 2) == {"name": "alibi2d"}
    assert alibi.legacy_options({"name": "alibi2d"}, 1) == {"slopes": "geometric", "name": "alibi2d"}


def test_a_checkpoint_with_the_fov_lookhere_ignored_loads(tmp_path):
    """``fov`` beside ``directions`` was ignored before ``vitrel_format`` 6 and is refused now: a checkpoint written
    then with both (``pos.directions=halves pos.fov=90``) loads, ``fov`` dropped, the same model."""
    torch.manual_seed(0)
    spec = {"name": "lookhere", "directions": "halves"}
    old = vitrel.create_model("vitrel_vit_tiny_patch4_32", pos=spec, embed_dim=32, depth=1, num_heads=2)
    with pytest.raises(ValueError, match="give one of the two"):
        vitrel.create_model("vitrel_vit_tiny_patch4_32", pos={**spec, "fov": 90})
    back = reloaded_as_written(old, tmp_path / "o.ckpt", vitrel_format=5, pos={**spec, "fov": 90})
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(back(x), old.eval()(x))


@pytest.mark.parametrize("arch", ["vitrel_vit_tiny_patch4_32", "vitrel_swin_tiny_patch2_window4_32"])
def test_a_lookhere_shared_by_the_blocks_says_its_slope_is_the_first_blocks(arch, recwarn):
    """``pos_share=True`` builds one LookHere for no block: its ``layer_slopes`` (1.5 at the first block to 0.5 at the
    last) became 1.5 for every block without a word. It warns, saying so (and the slope is that); one value for all
    blocks is no warning."""
    kw = dict(embed_dim=32, depth=2, num_heads=2) if "vit_" in arch else {}
    with pytest.warns(UserWarning, match=r"layer_slopes \[1.5, 0.5\] set a slope per block: every block takes the f"):
        m = vitrel.create_model(arch, pos="lookhere", pos_share=True, **kw)
    shared = next(mod for mod in m.modules() if isinstance(mod, LookHere))
    assert shared.slope == shared.global_slope * 1.5
    recwarn.clear()
    vitrel.create_model(arch, pos={"name": "lookhere", "layer_slopes": [1.0, 1.0]}, pos_share=True, **kw)
    vitrel.create_model(arch, pos="lookhere", **kw)
    assert not [w for w in recwarn if "pos_share" in str(w.message)]
