"""Properties every registered scheme must have (schemes added later are picked up automatically)."""

from __future__ import annotations

import warnings

import pytest
import torch

import vitrel
from tests.reference import scheme_qkv
from vitrel import Attention
from vitrel.kernels.common import merge_masks
from vitrel.kernels.eager import attend_eager
from vitrel.layout.geometry import Grid, Grid3, expand_offset_table
from vitrel.pos import build_pos, get_pos_class, list_pos
from vitrel.pos.base import FAMILIES
from vitrel.pos.registry import UnknownSchemeError

ALL = list_pos()
RELATIVE = list_pos("relative")
ABSOLUTE = list_pos("absolute")
DIM, HEADS = 32, 2  # head_dim 16: divisible by 4 for 2-D RoPE


def _attn(name: str, grid, prefix: int, seed: int = 0) -> Attention:
    """An attention layer with scheme ``name``; an absolute scheme is kept as ``a.abs_pos`` (it acts on
    the tokens, the layer itself has ``none``)."""
    torch.manual_seed(seed)
    absolute = get_pos_class(name).kind == "absolute"
    a = Attention(DIM, HEADS, pos="none" if absolute else name, grid=grid, num_prefix_tokens=prefix)
    a.abs_pos = (
        build_pos(name, num_heads=HEADS, head_dim=DIM // HEADS, grid=grid, num_prefix_tokens=prefix)
        if absolute
        else None
    )
    a = a.double()
    with torch.no_grad():
        for _, p in a.named_parameters():  # non-trivial position parameters
            if _.startswith(("pos.", "abs_pos.")):
                p.add_(torch.randn_like(p) * 0.3)
    return a


def _tokens(a: Attention, x: torch.Tensor, grid) -> torch.Tensor:
    return x if a.abs_pos is None else a.abs_pos.add_to_tokens(x, Grid(*grid), a.num_prefix_tokens)


def _logits(a: Attention, x: torch.Tensor, grid) -> torch.Tensor:
    return a.logits(_tokens(a, x, grid), grid)


def _shift_violation(name: str, prefix: int, with_prefix_pairs: bool = True) -> float:
    """Max |logit(i, j) - logit'(i + s, j + s)| when the grid content is translated by s."""
    h, w, (sh, sw) = 5, 6, (1, 2)
    a = _attn(name, (h, w), prefix)
    torch.manual_seed(1)
    pre = torch.randn(1, prefix, DIM, dtype=torch.float64)
    patches = torch.randn(1, h, w, DIM, dtype=torch.float64)
    shifted = torch.roll(patches, shifts=(sh, sw), dims=(1, 2))
    la = _logits(a, torch.cat([pre, patches.reshape(1, h * w, DIM)], 1), (h, w))
    lb = _logits(a, torch.cat([pre, shifted.reshape(1, h * w, DIM)], 1), (h, w))
    # tokens whose content did not wrap around, and where they moved to
    src = [prefix + r * w + c for r in range(h - sh) for c in range(w - sw)]
    dst = [prefix + (r + sh) * w + (c + sw) for r in range(h - sh) for c in range(w - sw)]
    if with_prefix_pairs:
        src = list(range(prefix)) + src
        dst = list(range(prefix)) + dst
    ia, ib = torch.tensor(src), torch.tensor(dst)
    a, b = la[:, :, ia][:, :, :, ia], lb[:, :, ib][:, :, :, ib]
    same_inf = torch.isinf(a) & (a == b)  # masked pairs (-inf, e.g. LookHere's views) must stay masked
    return torch.where(same_inf, 0.0, a - b).abs().max().item()


@pytest.mark.parametrize("prefix", [0, 1])
@pytest.mark.parametrize("name", RELATIVE)
def test_relative_schemes_are_translation_equivariant(name, prefix):
    # Between patches every relative scheme depends on content and offset only, but for the ones that
    # declare themselves relative only approximately (LieRE): those must show it, or the flag is wrong.
    violation = _shift_violation(name, prefix, with_prefix_pairs=False)
    if not _attn(name, (5, 6), prefix).pos.exactly_relative:
        assert violation > 1e-6, f"{name} is exactly relative: set exactly_relative = True"
        return
    assert violation < 1e-9
    # Prefix<->patch pairs too, except for rotations: an unrotated class token against a rotated
    # key sees the key's absolute angle (RoPE-ViT and timm behave the same way); and except for schemes
    # that place prefix tokens somewhere (PaPE's class token at the origin, as its authors').
    cls = get_pos_class(name)
    if not (cls.has_rotation or cls.prefix_positioned):
        assert _shift_violation(name, prefix) < 1e-9
    elif prefix and cls.prefix_positioned:  # the test can fail: the class token's term moves with its key
        assert _shift_violation(name, prefix) > 1e-4


@pytest.mark.parametrize("name", ABSOLUTE)
def test_absolute_schemes_fail_the_translation_test(name):
    """The same test must be able to fail: absolute position breaks it."""
    assert _shift_violation(name, 1) > 1e-4


def test_there_are_absolute_and_relative_schemes():
    assert "none" in RELATIVE and len(RELATIVE) >= 7


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("grid", [(3, 5), (4, 4)])
def test_any_grid_at_call_time_forward_backward(name, grid):
    """Built for one grid, called on the same and on larger/other grids, prefix 0 and 2."""
    for prefix in (0, 2):
        a = _attn(name, grid, prefix).float()
        for g in (grid, (grid[1], grid[0] + 2)):
            x = torch.randn(2, prefix + g[0] * g[1], DIM, requires_grad=True)
            y = a(_tokens(a, x, g), g)
            assert y.shape == x.shape and torch.isfinite(y).all()
            y.square().mean().backward()
            assert torch.isfinite(x.grad).all()
            for n, p in a.pos.named_parameters():
                if a.pos.kind == "relative":
                    assert p.grad is not None and torch.isfinite(p.grad).all(), n
            a.zero_grad()


@pytest.mark.parametrize("name", ALL)
def test_fast_path_matches_eager_logits_path(name):
    """forward (SDPA / fused kernels) == softmax(logits) path, float64, with prefix token."""
    grid = (3, 4)
    a = _attn(name, grid, 1)
    x = _tokens(a, torch.randn(2, 13, DIM, dtype=torch.float64), grid)
    out = a(x, grid)
    # the one eager path: softmax(eager_logits) v + content_values
    st = a.pos.prepare(Grid(*grid), 1, x.device, x.dtype)
    q, k, v = scheme_qkv(a, x, state=st)
    o = attend_eager(q, k, v, merge_masks(st.bias, None, q.dtype), a.scale, st)
    eager = a.proj(o.transpose(1, 2).reshape(x.shape))
    torch.testing.assert_close(out, eager, rtol=1e-7, atol=1e-9)
    # attention dropout goes through the same call: active in training, off in eval, finite
    a.attn_drop = 0.5
    a.train()
    torch.manual_seed(0)
    dropped = a(x, grid)
    assert torch.isfinite(dropped).all() and not torch.allclose(dropped, out)
    a.eval()
    torch.testing.assert_close(a(x, grid), out)


@pytest.mark.parametrize("name", ALL)
def test_window_mask_is_applied_per_window(name):
    """x as [B * nW, n, C] with a [nW, n, n] mask equals each window run alone with its mask."""
    grid, nw, b = (2, 3), 3, 2
    a = _attn(name, grid, 0)
    torch.manual_seed(3)
    x = torch.randn(b * nw, 6, DIM, dtype=torch.float64)
    mask = torch.zeros(nw, 6, 6, dtype=torch.float64)
    mask[1, :3, 3:] = -100.0  # Swin-style shift mask values
    mask[1, 3:, :3] = -100.0
    mask[2, ::2, 1::2] = -100.0
    out = a(x, grid, mask=mask)
    for s in range(b * nw):
        alone = a(x[s : s + 1], grid, mask=mask[s % nw][None, None])
        torch.testing.assert_close(out[s : s + 1], alone)
    with pytest.raises(ValueError, match="multiple of the 3 windows"):
        a(x[:4], grid, mask=mask)


@pytest.mark.parametrize("name", [n for n in RELATIVE if n != "none"])
def test_learned_tables_grow_and_keep_offsets(name):
    """A state dict from a small grid loads into a larger grid; offsets it had keep their values."""
    small, big = (3, 4), (5, 7)
    a = _attn(name, small, 1)
    b = _attn(name, big, 1, seed=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the resize warning
        b.load_state_dict(a.state_dict())
    x = torch.randn(2, 1 + 12, DIM, dtype=torch.float64)
    torch.testing.assert_close(_logits(b, x, small), _logits(a, x, small))


def test_unknown_scheme_lists_the_names():
    with pytest.raises(UnknownSchemeError, match="known schemes: .*rel2d_full"):
        Attention(DIM, HEADS, pos="rel2d_ful", grid=(4, 4))
    assert issubclass(UnknownSchemeError, ValueError)


def test_grid_token_mismatch_is_a_clear_error():
    a = Attention(DIM, HEADS, pos="rel2d_full", grid=(4, 4), num_prefix_tokens=1)
    with pytest.raises(ValueError, match=r"grid 4x5 with 1 prefix token\(s\) needs 21 tokens, but the input has 17"):
        a(torch.randn(1, 17, DIM), (4, 5))
    with pytest.raises(ValueError, match="grid must be"):
        a(torch.randn(1, 17, DIM), "4x4")
    with pytest.raises(ValueError, match="expected x of shape"):
        a(torch.randn(17, DIM), (4, 4))


def test_config_dict_and_shared_module():
    p = build_pos({"name": "rel2d_factored", "init_std": 0.1}, num_heads=HEADS, head_dim=16, grid=(4, 4))
    a1 = Attention(DIM, HEADS, pos=p, grid=(4, 4))
    a2 = Attention(DIM, HEADS, pos=p, grid=(4, 4))
    assert a1.pos is a2.pos
    with pytest.raises(ValueError, match="needs a 'name' key"):
        build_pos({"init_std": 0.1}, num_heads=HEADS, head_dim=16, grid=(4, 4))
    with pytest.raises(ValueError, match="built for 2 heads"):
        Attention(48, 3, pos=p, grid=(4, 4))


def test_absolute_scheme_inside_attention_is_a_clear_error():
    for name in ABSOLUTE:
        with pytest.raises(ValueError, match=f"'{name}' is an absolute position scheme.*abs_pos='{name}'"):
            Attention(DIM, HEADS, pos=name, grid=(4, 4))
        with pytest.raises(ValueError, match="absolute position scheme"):
            Attention(DIM, HEADS, pos={"name": name}, grid=(4, 4))


@pytest.mark.parametrize("name", ALL)
def test_declared_capabilities_match_behaviour(name):
    """kind / family / has_bias / has_rotation / has_content_terms / has_bias_factors are declared; check
    them against what the hooks actually do, so a declaration cannot drift from the code."""
    cls = get_pos_class(name)
    s = build_pos(name, num_heads=HEADS, head_dim=DIM // HEADS, grid=(3, 4), num_prefix_tokens=1).double()
    with torch.no_grad():
        for p in s.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    g = Grid(3, 4)
    q = torch.randn(1, HEADS, 13, DIM // HEADS, dtype=torch.float64)
    b = s.bias(g, 1)
    assert (b is not None) == cls.has_bias, name
    rq, rk = s.rotate(q, q.clone(), s.prepare(g, 1, q.device, q.dtype))
    assert (not torch.equal(rq, q)) == cls.has_rotation, name
    assert (s.content_logits(q, s.prepare(g, 1, q.device, q.dtype)) is not None) == cls.has_content_terms, name
    factors = s.bias_factors(g, 1)
    assert (factors is not None) == cls.has_bias_factors, name
    if factors is not None:  # a bias that factors: u w^T is the bias
        torch.testing.assert_close(factors[0] @ factors[1].transpose(-2, -1), b, rtol=1e-12, atol=1e-12)
    table = s.offset_table(g)
    assert (table is not None) == cls.has_offset_table, name
    if table is not None:  # the bias by offset (flex, triton) is the bias (sdpa): a sign or axis slip is not
        frames = Grid3(1, *g) if table.dim() == 4 else g  # (a video scheme's table on an image: one frame)
        torch.testing.assert_close(expand_offset_table(table, frames, 1), b, rtol=1e-12, atol=1e-12)
    x = torch.randn(1, 13, DIM, dtype=torch.float64)
    assert (not torch.equal(s.add_to_tokens(x, g, 1), x)) == (cls.kind == "absolute"), name
    assert cls.family in FAMILIES
    assert (cls.family == "absolute") == (cls.kind == "absolute")
    assert (cls.family == "rotary") == cls.has_rotation
    assert (cls.family == "content") == cls.has_content_terms
    if cls.family in ("learned bias", "fixed bias"):
        assert cls.has_bias and (cls.family == "learned bias") == any(True for _ in s.parameters())


@pytest.mark.parametrize("name", ["rel2d_full", "alibi2d", "rope2d_mixed", "shaw2d_factored"])
def test_shared_state_is_prepared_once_per_forward_and_passed_to_blocks(name):
    """pos_share=True: the model prepares its scheme's state once per forward (with gradient
    checkpointing too) and every block uses it; the forward stores nothing on the modules."""
    m = vitrel.create_model("vitrel_vit_tiny_patch4_32", pos=name, pos_share=True, embed_dim=32, depth=3, num_heads=2)
    assert all(blk.attn.pos is None for blk in m.blocks) and m.rel_pos is not None
    calls = []
    orig = m.rel_pos.prepare
    m.rel_pos.prepare = lambda *a, **k: calls.append(1) or orig(*a, **k)
    x = torch.randn(2, 3, 32, 32)
    for ckpt in (False, True):
        m.set_grad_checkpointing(ckpt)
        before = {n: dict(vars(mod)) for n, mod in m.named_modules()}
        m(x).sum().backward()
        for n, mod in m.named_modules():  # no attribute added, replaced or removed by the forward
            d = vars(mod)
            assert set(d) == set(before[n]) and all(d[k] is before[n][k] for k in d), n
    assert len(calls) == 2
    assert all(p.grad is not None for p in m.rel_pos.parameters())
    with pytest.raises(ValueError, match="shared position scheme"):
        m.blocks[0].attn(torch.randn(1, 65, 32), (8, 8))
