"""attn_impl="flex": FlexAttention with the bias read from the scheme's offset table in ``score_mod``.

The offset table of every bias scheme is checked against its dense bias (itself checked against float64
loop references in the scheme tests) on several grids; the flex forward against SDPA with the bias as a
float mask (CPU: forward only, torch has no FlexAttention backward there; the gradients are checked by
``bench/gpu.py`` on a GPU).
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

import vitrel
import vitrel.kernels.flex as kernels
from vitrel.kernels import get_kernel
from vitrel.layers import Attention
from vitrel.layout.geometry import expand_offset_table
from vitrel.pos import Grid, build_pos, list_pos
from vitrel.pos.registry import get_pos_class

TABLE_SCHEMES = [n for n in list_pos("relative") if get_pos_class(n).has_offset_table]
CASES = [(n, {}) for n in TABLE_SCHEMES] + [
    ("rel1d_bucket", {"causal": True}),
    ("alibi2d", {"slopes": "geometric"}),
    ("lookhere", {"fov": 45}),
    ("lookhere", {"fov": 90}),
]


#: bias schemes whose bias is not a function of the offset alone: FIRE's normaliser psi(max(L, p_i)) reads the
#: query's position (tests/pos/test_fire.py shows it); iRPE's pairs with a prefix token take a learned bucket, BEiT's
#: three learned terms, where an offset table's are zero
NOT_BY_OFFSET = {"fire1d", "irpe_bias", "rel2d_beit"}


def test_every_bias_scheme_has_an_offset_table():
    """Every relative scheme with a bias (and no content terms) reads it by offset, so flex takes it, except those
    whose bias is not a function of the offset (named above), which flex refuses."""
    bias_schemes = {
        n for n in list_pos("relative") if get_pos_class(n).has_bias and not get_pos_class(n).has_content_terms
    }
    assert bias_schemes - NOT_BY_OFFSET == set(TABLE_SCHEMES)
    for name in NOT_BY_OFFSET:
        assert name in bias_schemes and not get_pos_class(name).has_offset_table
        with pytest.raises(ValueError, match="has no such table"):
            _scheme(name, {}).prepare((3, 4), 0, kernel=get_kernel("flex"))
    assert {"rel2d_full", "rel2d_factored", "rel2d_cpb", "rel2d_bucket", "alibi2d", "alibi1d", "rel1d_bucket"} <= set(
        TABLE_SCHEMES
    )


def _scheme(name: str, kw: dict, heads: int = 4):
    torch.manual_seed(0)
    s = build_pos({"name": name, **kw}, num_heads=heads, head_dim=8, grid=(3, 4)).double()
    with torch.no_grad():
        for t in s.parameters():  # away from the init, so that every entry matters
            t.normal_(0.0, 0.5)
    return s


@pytest.mark.parametrize(("name", "kw"), CASES)
@pytest.mark.parametrize("grid", [(3, 4), (5, 2), (4, 7)])  # the built grid, then others (clamped / grown)
@pytest.mark.parametrize("prefix", [0, 1])
def test_offset_table_is_the_bias(name, kw, grid, prefix):
    s = _scheme(name, kw)
    g = s.check_grid(grid)  # (a video scheme reads an image grid as one frame, (1, H, W))
    t = s.offset_table(g)
    assert t.shape == (4, *(2 * n - 1 for n in g))
    torch.testing.assert_close(expand_offset_table(t, g, prefix), s.bias(g, prefix), atol=0, rtol=0)


pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@pytest.fixture
def eager_flex(monkeypatch):
    """FlexAttention uncompiled (torch's reference implementation): the same score_mod, no compile per shape."""
    monkeypatch.setattr(kernels, "_flex_attention", flex_attention)


def _pair(name: str, kw: dict, prefix: int, causal: bool = False):
    kw = dict(kw)
    causal = kw.pop("causal", causal)  # a causal scheme goes with a causal Attention
    layers = []
    for impl in ("sdpa", "flex"):
        torch.manual_seed(1)
        layers.append(
            Attention(
                32, 4, pos={"name": name, **kw}, grid=(3, 4), num_prefix_tokens=prefix, causal=causal, attn_impl=impl
            )
            .double()
            .eval()
        )
    with torch.no_grad():
        for t in layers[0].pos.parameters():
            t.normal_(0.0, 0.5)
        layers[1].load_state_dict(layers[0].state_dict())
    return layers


@pytest.mark.parametrize(("name", "kw"), CASES + [("rope2d_mixed", {}), ("none", {})])
@pytest.mark.parametrize("prefix", [0, 1])
def test_flex_forward_equals_sdpa(eager_flex, name, kw, prefix):
    sdpa, flex = _pair(name, kw, prefix)
    for grid in [(3, 4), (4, 5)]:
        x = torch.randn(2, prefix + grid[0] * grid[1], 32, dtype=torch.float64)
        with torch.no_grad():
            torch.testing.assert_close(flex(x, grid), sdpa(x, grid), atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("name", ["rel2d_full", "lookhere"])
def test_flex_window_mask_and_causal(eager_flex, name):
    """A Swin-style [nW, n, n] window mask (read per batch element in score_mod), and causal 1-D attention."""
    sdpa, flex = _pair(name, {}, 0)
    g = torch.Generator().manual_seed(2)
    mask = torch.where(torch.rand(2, 12, 12, generator=g) < 0.4, -100.0, 0.0).double() * (1 - torch.eye(12))
    x = torch.randn(4, 12, 32, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(flex(x, (3, 4), mask=mask), sdpa(x, (3, 4), mask=mask), atol=1e-12, rtol=1e-10)
    sdpa, flex = _pair("rel1d_bucket", {}, 0, causal=True)
    with torch.no_grad():
        torch.testing.assert_close(flex(x, (3, 4)), sdpa(x, (3, 4)), atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("name", ["rel2d_full", "lookhere"])
def test_flex_reads_the_windows_layout(eager_flex, name):
    """Swin's windows' layout (``TokenLayout.windows``) as the mask: flex reads the ``[nW, n]`` region ids in its
    score_mod (window ``b mod nW``), no float mask; equal to SDPA with the float mask it lowers to. A 7 x 9 map in
    4 x 5 windows shifted by (2, 2) (the seam and the padding), two maps' windows."""
    from vitrel.layout.geometry import Grid
    from vitrel.layout.windows import window_layout, window_regions

    assert kernels.FlexKernel.window_layouts
    sdpa, flex = _pair(name, {}, 0)
    lay = window_layout(window_regions(Grid(7, 9), (4, 5), (2, 2)), (4, 5))
    x = torch.randn(8, 20, 32, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(flex(x, (4, 5), mask=lay), sdpa(x, (4, 5), mask=lay), atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("name", ["rel1d_bucket", "alibi1d", "lookhere"])
def test_flex_causal_block_mask(eager_flex, monkeypatch, name):
    """Causal attention with flex goes through a BlockMask of ``j <= i`` (intersected with LookHere's views):
    the blocks above the diagonal are skipped (sparsity > 0 at 300 tokens), no float mask is read, and the
    output equals SDPA's with the causal float mask."""
    from torch.nn.attention.flex_attention import create_mask

    seen = []
    real = kernels.with_causal_blocks
    monkeypatch.setattr(kernels, "with_causal_blocks", lambda *a: seen.append(real(*a)) or seen[-1])
    sdpa, flex = _pair(name, {}, 0, causal=True)
    grid = (12, 25)
    x = torch.randn(2, 300, 32, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(flex(x, grid), sdpa(x, grid), atol=1e-12, rtol=1e-10)
    (bm,) = seen
    dense = create_mask(bm.mask_mod, None, 4, 300, 300, device="cpu")[0]
    want = torch.ones(300, 300, dtype=torch.bool).tril()
    if name == "lookhere":
        want = want & (sdpa.pos.bias(vitrel.pos.as_grid(grid)) > float("-inf"))
    assert torch.equal(dense, want.expand_as(dense))
    assert bm.sparsity() > 0


@pytest.mark.parametrize("compiled", [True, False])
def test_flex_model_equals_sdpa(compiled, monkeypatch):
    """In models, eval, float32: the real path (FlexAttention compiled on first use) for the ViT, and Swin's
    shifted windows (masks read in score_mod) with torch's unfused flex."""
    if not compiled:
        monkeypatch.setattr(kernels, "_flex_attention", flex_attention)
    x = torch.randn(2, 3, 32, 32)
    for arch in ["vitrel_vit_tiny_patch4_32"] if compiled else ["vitrel_swin_tiny_patch2_window4_32"]:
        torch.manual_seed(0)
        ref = vitrel.create_model(arch, pos="rel2d_full", num_classes=10).eval()
        torch.manual_seed(0)
        m = vitrel.create_model(arch, pos="rel2d_full", num_classes=10, attn_impl="flex").eval()
        m.load_state_dict(ref.state_dict())
        with torch.no_grad():
            torch.testing.assert_close(m(x), ref(x), atol=2e-5, rtol=1e-4)
            if compiled:
                with torch.compiler.set_stance("fail_on_recompile"):  # compiled once: every block, every call
                    torch.testing.assert_close(m(2 * x), ref(2 * x), atol=2e-5, rtol=1e-4)


def test_cpu_flex_short_sequences_equal_sdpa():
    """torch 2.14's compiled CPU FlexAttention reads keys past their storage at short sequences (8 and 24 keys): the
    last batch x head slice came out wrong in most calls (NaN or finite) before the keys got zero slack
    (``kernels._keys_with_slack``; a Swin whose last stage has 2x4 windows, a 16x64 input, returned NaN logits).
    Without the slack, 6 calls here all pass about once in a thousand runs."""
    g = torch.Generator().manual_seed(0)
    for _ in range(6):
        q, k, v = (torch.randn(2, 2, 8, 16, generator=g) for _ in range(3))
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        torch.testing.assert_close(kernels._flex_attention(q, k, v), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pos", ["alibi2d", "lookhere"])
def test_compiled_cpu_flex_on_float64_slopes_and_a_key_padding_mask(pos):
    """Compiled FlexAttention (what a float32 model runs, not the reference the other tests use) equals SDPA where the
    scheme's table is float64 (ALiBi's and LookHere's slopes: NaN before the table was made float32) and with a
    key-padding mask ``[B, 1, 1, N]`` (score_mod read it at ``[qi, ki]``: out of bounds)."""
    x = torch.randn(2, 17, 32, generator=torch.Generator().manual_seed(1))
    pad = torch.zeros(2, 1, 1, 17)
    pad[1, ..., -3:] = float("-inf")
    layers = []
    for impl in ("sdpa", "flex"):
        torch.manual_seed(0)
        layers.append(Attention(32, 2, pos=pos, grid=(4, 4), num_prefix_tokens=1, attn_impl=impl).eval())
    assert layers[1].pos.offset_table(Grid(4, 4)).dtype == torch.float64
    with torch.no_grad():
        for mask in (None, pad):
            torch.testing.assert_close(layers[1](x, (4, 4), mask=mask), layers[0](x, (4, 4), mask=mask))


def test_flex_errors_are_clear():
    with pytest.raises(ValueError, match="flex"):
        Attention(32, 4, pos="shaw2d_factored", grid=(3, 4), attn_impl="flex")(torch.randn(1, 12, 32), (3, 4))
    with pytest.raises(ValueError, match="no attention dropout"):  # (at build: tests/kernels/test_registry.py)
        Attention(32, 4, pos="rel2d_full", grid=(3, 4), attn_impl="flex", attn_drop=0.1)
    m = Attention(32, 4, pos="rel2d_full", grid=(3, 4), attn_impl="flex").train()
    m.attn_drop = 0.1  # (set on a built layer: the forward's own check)
    with torch.no_grad(), pytest.raises(ValueError, match="dropout"):
        m(torch.randn(1, 12, 32), (3, 4))
    m = Attention(32, 4, pos="rel2d_full", grid=(3, 4), attn_impl="flex").train()
    with pytest.raises(ValueError, match="CPU"):
        m(torch.randn(1, 12, 32), (3, 4))
    with torch.no_grad(), pytest.raises(ValueError, match="not float64"):  # (compiled FlexAttention's own error)
        m.double().eval()(torch.randn(1, 12, 32, dtype=torch.float64), (3, 4))


@pytest.mark.parametrize("fov", [180, 90, 45])
def test_lookhere_block_mask_is_its_views(fov):
    """LookHere's flex state carries a BlockMask of exactly the pairs its bias lets through (prefix pairs
    always), and on a 16x16 grid whole blocks of 128 x 128 pairs are skipped."""
    from torch.nn.attention.flex_attention import create_mask

    s = _scheme("lookhere", {"fov": fov}, heads=8)
    for grid, prefix in [((3, 4), 1), ((16, 16), 0)]:
        g = vitrel.pos.as_grid(grid)
        st = s.prepare(g, prefix, kernel=get_kernel("flex"))
        n = prefix + g.n
        dense = create_mask(st.block_mask.mask_mod, None, 8, n, n, device="cpu")[0]
        assert torch.equal(dense, s.bias(g, prefix) > float("-inf"))
    assert st.block_mask.sparsity() > 0


def test_flex_state_of_schemes_without_masked_offsets_has_no_block_mask():
    st = _scheme("rel2d_full", {}).prepare((3, 4), 1, kernel=get_kernel("flex"))
    assert st.block_mask is None and st.table is not None and st.bias is None


def test_lookhere_blocks_share_one_block_mask(eager_flex):
    """A ViT whose blocks each own a LookHere scheme (per-layer slopes) builds one BlockMask per forward for
    all of them (the views do not depend on the slope), and equals the sdpa model."""
    torch.manual_seed(0)
    kw = dict(pos="lookhere", num_classes=5, embed_dim=32, depth=3, num_heads=4)
    ref = vitrel.create_model("vitrel_vit_tiny_patch4_32", **kw).eval()
    m = vitrel.create_model("vitrel_vit_tiny_patch4_32", attn_impl="flex", **kw).eval()
    m.load_state_dict(ref.state_dict())
    x = torch.randn(2, 3, 32, 32)
    states = m.position_states((8, 8), x)
    assert len({id(st.block_mask) for st in states}) == 1 and states[0].block_mask is not None
    sums = {st.table.nan_to_num(neginf=0.0).sum().item() for st in states}
    assert len(sums) == 3  # each block keeps its own slopes
    with torch.no_grad():
        torch.testing.assert_close(m(x), ref(x), atol=2e-5, rtol=1e-4)
