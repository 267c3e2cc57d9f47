"""LieRE and ComRoPE (vitrel/pos/schemes/lie.py) against float64 reimplementations of two authors' codes:

* the ComRoPE code (Longin-Yu/ComRoPE ``model.py`` at 7aeef08: ``get_positions``, ``get_exponent_matrix`` of each
  attention class, the full ``d x d`` block-diagonal ``R = exp(sum_a A_a x_a)``, ``(R q) . (R k)``), with scipy's
  ``expm`` for the exponential: ``comrope`` and ``liere`` with ``preset: comrope_baseline`` (its ``LieREAttention``);
* the LieRE authors' code (StanfordMIMI/LieRE ``models/rope_vit.py`` at b27b41b: ``PositionEncoderBase.forward``,
  ``LierePositionEncoder`` with ``phase_type="naver"`` and ``rotary_embedding_per_head``,
  ``FlexibleAttention.apply_transforms``): ``liere`` with its default ``preset: liere_authors``, at the
  training grid and at larger ones."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.linalg
import torch

from tests.weights import reloaded_as_written
from vitrel import Attention
from vitrel.pos import Grid, build_pos

DIM, HEADS = 32, 2
HD = DIM // HEADS


def attn(name, grid=(3, 4), prefix=1, **opts):
    torch.manual_seed(0)
    a = Attention(DIM, HEADS, pos={"name": name, **opts}, grid=grid, num_prefix_tokens=prefix).double()
    return a


def authors_generators(scheme) -> np.ndarray:
    """``[heads, 2, d, d]``: each axis's generator as the full block-diagonal matrix, built as the authors'
    ``get_exponent_matrix`` (skew = F - F^T; ld: times the per-axis multiplier; ap: round-robin mask)."""
    b, m = scheme.block_size, scheme.num_blocks
    f = scheme.generator.detach().double().reshape(scheme.num_heads, -1, m, b, b).numpy()  # stored [heads, (2,) m b b]
    skew = f - np.swapaxes(f, -1, -2)  # [heads, axes or 1, m, b, b]
    if scheme.name == "comrope" and scheme.variant == "ld":
        skew = skew * scheme.multiplier.detach().double().numpy()[None, :, :, None, None]  # stored [axes, m]
    elif scheme.name == "comrope":
        mask = np.zeros((2, m))
        for i in range(2):
            mask[i, i::2] = 1.0
        skew = np.broadcast_to(skew, (skew.shape[0], 2, m, b, b)) * mask[None, :, :, None, None]
    out = np.zeros((skew.shape[0], 2, m * b, m * b))
    for h in range(skew.shape[0]):
        for a in range(2):
            for j in range(m):
                out[h, a, j * b : (j + 1) * b, j * b : (j + 1) * b] = skew[h, a, j]
    return out


def authors_positions(grid, prefix, cls_position=0.5, axis_scale=True) -> np.ndarray:
    """``get_positions`` for an ``H x W`` grid (the authors' code takes a square one: per axis here)."""
    H, W = grid
    pos = [[r, c] for r in range(H) for c in range(W)]
    pos = np.array(pos, dtype=np.float64)
    if axis_scale:
        pos = (pos + 0.5) / np.array([H, W])
    cls = np.full((prefix, 2), cls_position if cls_position is not None else 0.0)
    return np.concatenate([cls, pos], axis=0)


def authors_logits(a: Attention, x: torch.Tensor, grid, cls_position=0.5, axis_scale=True) -> torch.Tensor:
    q, k, _ = a.qkv(x).reshape(x.shape[0], x.shape[1], 3, HEADS, HD).permute(2, 0, 3, 1, 4).unbind(0)
    gens = authors_generators(a.pos)
    pos = authors_positions(grid, a.num_prefix_tokens, cls_position, axis_scale)
    n = pos.shape[0]
    out = torch.zeros(x.shape[0], HEADS, n, n, dtype=torch.float64)
    for h in range(HEADS):
        rots = [scipy.linalg.expm(pos[i, 0] * gens[h, 0] + pos[i, 1] * gens[h, 1]) for i in range(n)]
        rq = np.stack([rots[i] @ q[:, h, i].detach().numpy().T for i in range(n)], axis=1)  # [d, n, B]
        rk = np.stack([rots[i] @ k[:, h, i].detach().numpy().T for i in range(n)], axis=1)
        out[:, h] = torch.from_numpy(np.einsum("dnb,dmb->bnm", rq, rk)) * HD**-0.5
    return out


CASES = [
    ("liere", {"preset": "comrope_baseline"}),  # the ComRoPE code's LieRE (vitrel's liere before vitrel_format 4)
    ("liere", {"preset": "comrope_baseline", "block_size": 4}),
    ("comrope", {"variant": "ld"}),
    ("comrope", {"variant": "ld", "block_size": 4}),
    ("comrope", {"variant": "ap"}),
    ("comrope", {"variant": "ap", "block_size": 4}),
]


@pytest.mark.parametrize("name, opts", CASES)
def test_logits_equal_the_authors_forward(name, opts):
    a = attn(name, **opts)
    x = torch.randn(2, 1 + 12, DIM, dtype=torch.float64)
    torch.testing.assert_close(a.logits(x, grid=(3, 4)), authors_logits(a, x, (3, 4)), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("cls_position, coords", [(None, "normalized"), (0.5, "index")])
def test_options_prefix_unrotated_and_index_coords(cls_position, coords):
    a = attn("comrope", cls_position=cls_position, coords=coords, block_size=4)
    x = torch.randn(1, 1 + 12, DIM, dtype=torch.float64)
    want = authors_logits(a, x, (3, 4), cls_position=cls_position, axis_scale=coords == "normalized")
    torch.testing.assert_close(a.logits(x, grid=(3, 4)), want, rtol=1e-9, atol=1e-9)


def shift_violation(a: Attention) -> float:
    """Max |logit(i, j) - logit(i + s, j + s)| over patch pairs when the content moves by s = (1, 2)."""
    h, w = 5, 6
    torch.manual_seed(1)
    patches = torch.randn(1, h, w, DIM, dtype=torch.float64)
    shifted = torch.roll(patches, shifts=(1, 2), dims=(1, 2))
    la = a.logits(patches.reshape(1, h * w, DIM), grid=(h, w))
    lb = a.logits(shifted.reshape(1, h * w, DIM), grid=(h, w))
    src = torch.tensor([r * w + c for r in range(h - 1) for c in range(w - 2)])
    dst = torch.tensor([(r + 1) * w + (c + 2) for r in range(h - 1) for c in range(w - 2)])
    return (la[:, :, src][:, :, :, src] - lb[:, :, dst][:, :, :, dst]).abs().max().item()


@pytest.mark.parametrize("variant", ["ld", "ap"])
def test_comrope_is_exactly_relative_and_liere_approximately(variant):
    """ComRoPE's commuting generators: exact. LieRE with 4 x 4 blocks: its generators do not commute and
    the logits change with a translation (documented as approximate); with 2 x 2 blocks it is exact."""
    com = attn("comrope", grid=(5, 6), prefix=0, variant=variant, block_size=4)
    assert com.pos.exactly_relative and shift_violation(com) < 1e-9
    lie4 = attn("liere", grid=(5, 6), prefix=0, block_size=4)
    assert not lie4.pos.exactly_relative and shift_violation(lie4) > 1e-3
    lie2 = attn("liere", grid=(5, 6), prefix=0, block_size=2)
    assert lie2.pos.exactly_relative and shift_violation(lie2) < 1e-9


def test_comrope_block_size_head_is_one_generator_over_the_head():
    """``block_size: head`` (conf/pos/comrope.yaml: ``head: b = d``), as ``liere`` takes it: one ``d x d`` block,
    still exactly relative (``ld``'s generators are multiples of one matrix); ``ap`` cannot split one block
    between the axes and says so."""
    com = attn("comrope", grid=(5, 6), prefix=0, block_size="head")
    assert (com.pos.block_size, com.pos.num_blocks) == (HD, 1)
    assert shift_violation(com) < 1e-9
    with pytest.raises(ValueError, match=f"block_size must divide {HD // 2}, got block_size={HD}"):
        attn("comrope", variant="ap", block_size="head")


@pytest.mark.parametrize("name, opts", [("liere", {"block_size": 4}), ("comrope", {"variant": "ld"})])
def test_gradients_reach_the_generators(name, opts):
    a = attn(name, grid=(2, 2), prefix=1, **opts)
    x = torch.randn(1, 5, DIM, dtype=torch.float64)
    params = [p for n, p in a.pos.named_parameters()]

    def f(*ps):
        with torch.no_grad():
            for p, v in zip(params, ps):
                p.copy_(v)
        return a.logits(x, grid=(2, 2))

    # the analytic gradient against central differences of the whole logits
    a.zero_grad()
    w = torch.randn_like(a.logits(x, grid=(2, 2)))
    (a.logits(x, grid=(2, 2)) * w).sum().backward()
    for p in params:
        g = p.grad.clone()
        idx = tuple(int(i) for i in torch.nonzero(g.abs() > 1e-6)[0])
        eps, old = 1e-6, p.data[idx].item()
        with torch.no_grad():
            p.data[idx] = old + eps
            up = (a.logits(x, grid=(2, 2)) * w).sum().item()
            p.data[idx] = old - eps
            down = (a.logits(x, grid=(2, 2)) * w).sum().item()
            p.data[idx] = old
        assert g[idx].item() == pytest.approx((up - down) / (2 * eps), rel=1e-5, abs=1e-7)


def test_rotation_is_computed_once_per_forward_and_orthogonal():
    a = attn("comrope", block_size=4)
    st = a.pos.prepare((3, 4), 1, None, torch.float64)
    (r,) = st.rope
    assert r.shape == (HEADS, 13, HD // 4, 4, 4)
    eye = torch.eye(4, dtype=r.dtype).expand_as(r)
    torch.testing.assert_close(r @ r.transpose(-1, -2), eye)
    # 2 x 2 blocks: the plane rotations as cos / sin, equal to the matrix exponential's entries
    b2 = attn("liere", block_size=2).pos
    cos, sin = b2.prepare((3, 4), 1, None, torch.float64).rope
    from vitrel.pos.schemes.lie import block_rotations

    full = block_rotations(b2.generators().double(), b2.positions(b2.grid, 1, None, torch.float64))
    torch.testing.assert_close(cos, full[..., 0, 0])
    torch.testing.assert_close(sin, full[..., 1, 0])


@pytest.mark.parametrize(
    "name, opts, match",
    [
        ("liere", {"block_size": 3}, "block_size"),
        ("comrope", {"block_size": 16}, "block_size must divide 8"),  # ap needs d/2 % b: 16 > 8
        ("comrope", {"variant": "xy"}, "variant"),
        ("liere", {"coords": "pixels"}, "coords"),
    ],
)
def test_bad_options_are_one_clear_error(name, opts, match):
    if match.startswith("block_size must divide"):
        opts = {**opts, "variant": "ap"}
    with pytest.raises(ValueError, match=match):
        attn(name, **opts)


def test_liere_init_std_without_the_normal_init_is_refused():
    # the liere_authors preset initialises U[0, 2 pi): a pos.init_std sweep gave the same run for every value
    with pytest.raises(ValueError, match=r"liere: init_std \(3.0\) is the spread of init: normal; .*uniform_triu"):
        attn("liere", init_std=3.0)
    torch.manual_seed(0)
    a = attn("liere", init="normal", init_std=3.0)
    assert a.pos.init == "normal" and 2.0 < a.pos.generator.std() < 4.0
    assert attn("liere", preset="comrope_baseline", init_std=3.0).pos.init == "normal"
    assert attn("liere").pos.init == "uniform_triu"  # the default init_std (conf/pos/liere.yaml's) builds


@pytest.mark.parametrize("name", ["liere", "comrope"])
@pytest.mark.parametrize("bad", ["centre", "nan", "0.5", float("nan"), float("inf"), -math.inf])
def test_cls_position_must_be_a_finite_number_or_null(name, bad):
    """A string (liere's type is ``float | None | str`` for ``"preset"``) or a non-finite number: one error naming
    the option (comrope's strings: the registry's type check), not ``could not convert string to float`` or NaN
    logits."""
    with pytest.raises(ValueError, match=r"cls_position must be a (finite )?number") as err:
        attn(name, cls_position=bad)
    assert name in str(err.value) and repr(bad) in str(err.value)


@pytest.mark.parametrize("name", ["liere", "comrope"])
@pytest.mark.parametrize("good", [None, 0, 0.5, -1.25])
def test_cls_position_finite_numbers_and_null_build(name, good):
    m = attn(name, cls_position=good)
    assert m.pos.cls_position == (None if good is None else float(good))
    assert torch.isfinite(m(torch.randn(1, 1 + 12, DIM, dtype=torch.float64), (3, 4))).all()


# ------------------------------------------------------------------ the LieRE authors' code (StanfordMIMI/LieRE)
def liere_authors_rotations(raw: torch.Tensor, image_size, model_image_size, patch: int) -> torch.Tensor:
    """``LierePositionEncoder.forward`` (models/rope_vit.py lines 216-281) in float64, for a batch of one image:
    ``raw`` is their ``generator_raw_params [input_dim, layers, num_generators, g, g]``; returns the transforms
    ``[1, 1 + N, layers, num_generators, g, g]`` (class token first)."""
    # PositionEncoderBase.forward (lines 50-83): positions per axis linspace(0, steps / expected_steps, steps)
    expected = tuple(s // patch for s in model_image_size)
    steps = tuple(math.ceil(s / patch) for s in image_size)
    max_values = tuple(s / e for s, e in zip(steps, expected))
    positions = torch.cartesian_prod(
        *(torch.linspace(0, m, n, dtype=torch.float64) for m, n in zip(max_values, steps))
    ).unsqueeze(0)
    # phase_type "naver": generator_transform is nn.Identity (line 214)
    upper_triangle = torch.triu(raw, diagonal=1) - 0.5
    bases = upper_triangle - torch.transpose(upper_triangle, -1, -2)
    in_basis_positions = positions.reshape(list(positions.shape) + [1] * 4) * bases
    generator_pos = torch.sum(in_basis_positions, dim=-5)
    cls_generator = torch.zeros_like(generator_pos[:, 0, ...]).unsqueeze(1)  # "add an identity for the CLS token"
    generator_pos = torch.cat((cls_generator, generator_pos), dim=1)
    return torch.matrix_exp(generator_pos)  # theirs in float32 (EXPONENTIATE_ONE_SHOT), here float64


def liere_authors_logits(q: torch.Tensor, k: torch.Tensor, transforms: torch.Tensor, heads: int) -> torch.Tensor:
    """``FlexibleAttention.apply_transforms`` (lines 330-373) on ``q`` and ``k`` ``[B, heads, N, d]``, then
    ``dots = q k^T * scale`` (line 386); ``transforms`` as ``liere_authors_rotations`` (their Transformer gives
    each layer ``transforms[:, :, i]``, here the one layer)."""

    def apply_transforms(x, positional_transforms):
        generator_dim = positional_transforms.shape[-1]
        batch_size, num_heads, num_tokens, head_size = x.shape
        num_rotators = positional_transforms.shape[-3] // heads  # learnable_heads_rotations = heads (per head)
        rotatable_dim = generator_dim * num_rotators
        rotatable_states = x[:, :, :, :rotatable_dim]
        unrotatable_states = x[:, :, :, rotatable_dim:]
        states_split = rotatable_states.reshape((batch_size, num_heads, num_tokens, num_rotators, generator_dim, 1))
        positional_transforms = positional_transforms.squeeze(2)
        positional_transforms = positional_transforms.view(
            (1, num_tokens, heads, num_rotators, generator_dim, generator_dim)
        )
        positional_transforms = positional_transforms.transpose(1, 2)
        rotated_states = torch.matmul(positional_transforms, states_split)
        return torch.cat([rotated_states.flatten(start_dim=-3), unrotatable_states], axis=-1)

    q, k = apply_transforms(q, transforms), apply_transforms(k, transforms)
    return torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5


def as_authors_raw(scheme) -> torch.Tensor:
    """vitrel's ``generator [heads, 2, m b b]`` as their ``generator_raw_params [2, 1, heads * m, b, b]`` (their
    generator ``h * m + j`` serves head ``h``, block ``j``: ``view(1, N, heads, num_rotators, g, g)``)."""
    b = scheme.block_size
    f = scheme.generator.detach().double().reshape(scheme.num_heads, 2, -1, b, b)
    return f.permute(1, 0, 2, 3, 4).reshape(2, 1, -1, b, b)


LIERE_DIM, LIERE_HEADS, PATCH = 128, 2, 4  # 64-channel heads: the authors' FlexibleAttention asserts dim_head 64


@pytest.mark.parametrize("generator_dim", [64, 8])  # 64: ModelArgs' default, lightning_cifar100.sh; 8: imagenet.sh
@pytest.mark.parametrize("grid", [(3, 4), (6, 8), (9, 16), (5, 4)])  # the training grid (3, 4), then larger ones
def test_liere_equals_the_liere_authors_construction(grid, generator_dim):
    """``liere`` with its default preset (``liere_authors``) against the LieRE authors' code, float64: the rotation
    of every token (the class token's the identity) and the logits, at the grid it was built for (3 x 4: positions
    0..1 per axis) and at larger grids (positions past 1)."""
    torch.manual_seed(0)
    opts = {} if generator_dim == 64 else {"block_size": generator_dim}
    a = Attention(LIERE_DIM, LIERE_HEADS, pos={"name": "liere", **opts}, grid=(3, 4), num_prefix_tokens=1).double()
    hd = LIERE_DIM // LIERE_HEADS
    assert (a.pos.preset, a.pos.block_size, a.pos.init) == ("liere_authors", generator_dim, "uniform_triu")
    want = liere_authors_rotations(as_authors_raw(a.pos), (grid[0] * PATCH, grid[1] * PATCH), (12, 16), PATCH)
    n = 1 + grid[0] * grid[1]
    (rot,) = a.pos.prepare(grid, 1, None, torch.float64).rope  # [heads, N, m, b, b]
    got = rot.permute(1, 0, 2, 3, 4).reshape(1, n, 1, -1, generator_dim, generator_dim)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    eye = torch.eye(generator_dim, dtype=torch.float64).expand_as(rot[:, 0])
    torch.testing.assert_close(rot[:, 0], eye, rtol=0, atol=0)  # the class token: unrotated, exactly
    x = torch.randn(2, n, LIERE_DIM, dtype=torch.float64)
    q, k, _ = a.qkv(x).reshape(2, n, 3, LIERE_HEADS, hd).permute(2, 0, 3, 1, 4).unbind(0)
    theirs = liere_authors_logits(q, k, want, LIERE_HEADS)
    torch.testing.assert_close(a.logits(x, grid=grid), theirs, rtol=1e-9, atol=1e-9)
    # the positions themselves: 0..1 at the training grid, past 1 at a larger one (not interpolated)
    pos = a.pos.positions(Grid(*grid), 1, None, torch.float64)
    assert pos[0].tolist() == [0.0, 0.0]
    assert pos[-1].tolist() == pytest.approx([grid[0] / 3, grid[1] / 4], abs=1e-12)


def test_liere_authors_init_and_presets():
    """The default preset draws ``F ~ U[0, 2 pi)`` and uses its strict upper triangle (``A = U - U^T``, so the
    upper entries of ``A`` are in ``[0, 2 pi)``); ``comrope_baseline`` is the ComRoPE code's ``N(0, 1)``, ``F - F^T``
    on 2 x 2 blocks; an option given explicitly wins over its preset."""
    torch.manual_seed(0)
    lie = build_pos("liere", num_heads=4, head_dim=16, grid=(5, 5))
    f, a = lie.generator.detach(), lie.generators().detach()
    assert f.shape == (4, 2, 16 * 16) and 0 <= f.min() and f.max() < 2 * math.pi  # [heads, axes, m b b], m = 1
    f = f.reshape(4, 2, 1, 16, 16)
    iu = torch.triu_indices(16, 16, offset=1)
    torch.testing.assert_close(a[..., iu[0], iu[1]], f[..., iu[0], iu[1]], rtol=0, atol=0)
    torch.testing.assert_close(a, -a.transpose(-1, -2), rtol=0, atol=0)
    assert (lie.coords, lie.cls_position, lie.depends_on_extent, lie.exactly_relative) == (
        "linspace",
        None,
        True,
        False,
    )
    base = build_pos({"name": "liere", "preset": "comrope_baseline"}, num_heads=4, head_dim=16, grid=(5, 5))
    assert (base.block_size, base.init, base.coords, base.cls_position) == (2, "normal", "normalized", 0.5)
    assert base.generator.min() < 0  # N(0, 1)
    mixed = build_pos({"name": "liere", "coords": "normalized", "block_size": 4}, num_heads=4, head_dim=16, grid=(5, 5))
    assert (mixed.block_size, mixed.init, mixed.coords, mixed.cls_position) == (4, "uniform_triu", "normalized", None)
    with pytest.raises(ValueError, match="preset must be one of"):
        build_pos({"name": "liere", "preset": "authors"}, num_heads=4, head_dim=16, grid=(5, 5))
    with pytest.raises(ValueError, match="init must be one of"):
        build_pos({"name": "liere", "init": "uniform"}, num_heads=4, head_dim=16, grid=(5, 5))


def test_liere_configs_written_before_keep_the_comrope_baseline(tmp_path):
    """A checkpoint written before ``vitrel_format`` 4 meant by ``liere`` the ComRoPE code's LieRE: it loads as
    that model (same parameters, same outputs); one written now is taken as written."""
    import vitrel

    torch.manual_seed(0)
    kw = dict(embed_dim=32, depth=1, num_heads=2)
    old = vitrel.create_model("vitrel_vit_tiny_patch4_32", pos={"name": "liere", "preset": "comrope_baseline"}, **kw)
    cfg = {**old.vitrel_cfg, "vitrel_format": 3, "pos": "liere"}  # as format 3 stored `pos="liere"`
    torch.save(
        {"state_dict": {"model." + k: v for k, v in old.state_dict().items()}, "vitrel_cfg": cfg}, tmp_path / "o.ckpt"
    )
    back = vitrel.load_model(tmp_path / "o.ckpt").eval()
    pos = back.blocks[0].attn.pos
    assert (pos.preset, pos.block_size, pos.coords, pos.cls_position) == ("comrope_baseline", 2, "normalized", 0.5)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(back(x), old.eval()(x))
    new = vitrel.create_model("vitrel_vit_tiny_patch4_32", pos="liere", **kw)
    assert new.vitrel_cfg["vitrel_format"] >= 4
    torch.save(
        {"state_dict": {"model." + k: v for k, v in new.state_dict().items()}, "vitrel_cfg": new.vitrel_cfg},
        tmp_path / "n.ckpt",
    )
    assert vitrel.load_model(tmp_path / "n.ckpt").blocks[0].attn.pos.preset == "liere_authors"


def test_expm_squaring_equals_matrix_exp():
    """The exported programs' matrix exponential (products only, for ONNX) against torch's, float64, on LieRE-sized
    skew-symmetric logs (entries up to 2 pi, positions up to 4)."""
    from vitrel.pos.schemes.lie import expm_squaring

    torch.manual_seed(0)
    f = torch.triu(torch.rand(4, 50, 1, 16, 16, dtype=torch.float64) * 2 * math.pi, 1)
    a = (f - f.transpose(-1, -2)) * torch.rand(4, 50, 1, 1, 1, dtype=torch.float64) * 4
    a[0, 0] = 0.0  # the class token's
    torch.testing.assert_close(expm_squaring(a), torch.linalg.matrix_exp(a), rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("grid", [(3, 4), (6, 8), (9, 5)])
def test_linspace_unit_is_their_scale_0_to_1_branch(grid):
    """``coords: linspace_unit``: ``cartesian_prod(linspace(0, 1, s) per axis)``, the branch the LieRE code has
    behind ``scale_0_to_1 = False`` (models/rope_vit.py lines 68-75); at the built grid it equals ``linspace``."""
    unit = build_pos({"name": "liere", "coords": "linspace_unit"}, num_heads=2, head_dim=16, grid=(3, 4))
    want = torch.cartesian_prod(*(torch.linspace(0, 1, n, dtype=torch.float64) for n in grid))
    got = unit.positions(Grid(*grid), 1, None, torch.float64)
    torch.testing.assert_close(got[1:], want, rtol=0, atol=1e-15)
    assert got[0].tolist() == [0.0, 0.0] and unit.depends_on_extent and not unit.depends_on_built_grid
    lin = build_pos("liere", num_heads=2, head_dim=16, grid=(3, 4))
    if grid == (3, 4):
        torch.testing.assert_close(lin.positions(Grid(*grid), 1, None, torch.float64), got, rtol=0, atol=0)


def test_a_checkpoint_with_the_init_std_liere_ignored_loads(tmp_path):
    """``init_std`` beside the authors' uniform init was ignored before ``vitrel_format`` 6 and is refused now: a
    checkpoint written then with ``pos.init_std=0.5`` (a sweep over it) loads, the option dropped, the same model."""
    import vitrel

    torch.manual_seed(0)
    old = vitrel.create_model("vitrel_vit_tiny_patch4_32", pos="liere", embed_dim=32, depth=1, num_heads=2)
    with pytest.raises(ValueError, match="init_std"):
        vitrel.create_model("vitrel_vit_tiny_patch4_32", pos={"name": "liere", "init_std": 0.5})
    back = reloaded_as_written(old, tmp_path / "o.ckpt", vitrel_format=5, pos={"name": "liere", "init_std": 0.5})
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(back(x), old.eval()(x))
