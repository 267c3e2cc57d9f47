"""Options of the 2-D RoPE schemes: DINOv3 coordinates (normalised, training-time augmentation), STRING's learned
orthogonal basis and the Perception Encoder's ``grid_offset``, against float64 loops written from the equations."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vitrel import Attention
from vitrel.models import VisionTransformer
from vitrel.pos import Grid, build_pos
from vitrel.pos.schemes.rope import string_basis

HEADS, D = 2, 8


def _scheme(name: str, **opts):
    torch.manual_seed(0)
    s = build_pos({"name": name, **opts}, num_heads=HEADS, head_dim=D, grid=(3, 4), num_prefix_tokens=1).double()
    with torch.no_grad():
        for p in s.parameters():
            p.normal_(0, 0.4)
    return s


def _coord(i: int, n: int, mode: str, offset: float = 0.0) -> float:
    return float(i) + offset if mode == "index" else 2 * math.pi * (2 * (i + 0.5) / n - 1)


def _naive_angles(s, grid: Grid, mode: str, offset: float = 0.0) -> torch.Tensor:
    """``[heads, P + HW, d/2]`` angles: 0 for the prefix token, then the scheme's equation per patch (its row and
    column from ``offset``)."""
    out = torch.zeros(HEADS, 1 + grid.n, D // 2, dtype=torch.float64)
    for h in range(HEADS):
        for r in range(grid.h):
            for c in range(grid.w):
                y, x = _coord(r, grid.h, mode, offset), _coord(c, grid.w, mode, offset)
                for t in range(D // 2):
                    if s.name == "rope2d_axial":
                        q = D // 4
                        omega = s.base ** (-4 * (t % q) / D)
                        out[h, 1 + r * grid.w + c, t] = (y if t < q else x) * omega  # rows first
                    else:
                        out[h, 1 + r * grid.w + c, t] = s.freqs[0, h, t] * x + s.freqs[1, h, t] * y
    return out


def _naive_rotate(x: torch.Tensor, theta: torch.Tensor, basis: torch.Tensor | None) -> torch.Tensor:
    """``R(theta) P x`` pair by pair (interleaved pairs), ``x [B, heads, N, d]``."""
    if basis is not None:
        x = torch.einsum("hab,znhb->znha", basis, x.transpose(1, 2)).transpose(1, 2)
    out = torch.empty_like(x)
    for t in range(D // 2):
        cs, sn = theta[..., t].cos(), theta[..., t].sin()
        a, b = x[..., 2 * t], x[..., 2 * t + 1]
        out[..., 2 * t] = a * cs - b * sn
        out[..., 2 * t + 1] = a * sn + b * cs
    return out


def _naive_basis(s) -> torch.Tensor | None:
    """Cayley map ``(I + A)^-1 (I - A)`` of ``A = S - S^T``; for circulant, ``S_ab = s[(b - a) mod d]``."""
    if s.string is None:
        return None
    p = s.string.detach().double()
    if s.basis_kind == "circulant":
        rows = [[[p[h, (b - a) % D].item() for b in range(D)] for a in range(D)] for h in range(HEADS)]
        p = torch.tensor(rows, dtype=torch.float64)
    A = p - p.transpose(-1, -2)
    eye = torch.eye(D, dtype=torch.float64)
    return torch.stack([torch.linalg.inv(eye + A[h]) @ (eye - A[h]) for h in range(HEADS)])


CASES = [
    ("rope2d_axial", dict(coords="normalized")),
    ("rope2d_mixed", dict(coords="normalized")),
    ("rope2d_axial", dict(basis="cayley")),
    ("rope2d_mixed", dict(basis="circulant")),
    ("rope2d_axial", dict(coords="normalized", basis="circulant")),
    ("rope2d_mixed", dict(coords="normalized", basis="cayley")),
    ("rope2d_axial", dict(grid_offset=1.0)),  # the Perception Encoder's: the class token at (-1, -1) of the grid
    ("rope2d_mixed", dict(grid_offset=0.5, basis="circulant")),
]


@pytest.mark.parametrize("name,opts", CASES)
@pytest.mark.parametrize("grid", [(3, 4), (5, 2)])
def test_rotation_matches_the_equations(name, opts, grid):
    s = _scheme(name, **opts).eval()
    g = Grid(*grid)
    q = torch.randn(2, HEADS, 1 + g.n, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, HEADS, 1 + g.n, D, dtype=torch.float64)
    theta = _naive_angles(s, g, opts.get("coords", "index"), opts.get("grid_offset", 0.0))
    basis = _naive_basis(s)
    rq, rk = s.rotate(q, k, s.prepare(g, 1, q.device, q.dtype))
    torch.testing.assert_close(rq, _naive_rotate(q, theta, basis))
    torch.testing.assert_close(rk, _naive_rotate(k, theta, basis))
    if s.string is not None:  # gradients reach STRING's parameter
        rq.square().sum().backward()
        assert s.string.grad is not None and s.string.grad.abs().sum() > 0


@pytest.mark.parametrize("kind", ["cayley", "circulant"])
def test_string_basis_is_orthogonal_and_starts_at_identity(kind):
    shape = (HEADS, D, D) if kind == "cayley" else (HEADS, D)
    p = string_basis(torch.randn(shape, dtype=torch.float64), kind)
    torch.testing.assert_close(p @ p.transpose(-1, -2), torch.eye(D, dtype=torch.float64).expand(HEADS, D, D))
    torch.testing.assert_close(string_basis(torch.zeros(shape), kind), torch.eye(D).expand(HEADS, D, D))
    plain = build_pos("rope2d_axial", num_heads=HEADS, head_dim=D, grid=(3, 3))
    fresh = build_pos({"name": "rope2d_axial", "basis": kind}, num_heads=HEADS, head_dim=D, grid=(3, 3))
    q = torch.randn(1, HEADS, 9, D)
    rotated = [s.rotate(q, q, s.prepare(Grid(3, 3), 0, q.device, q.dtype))[0] for s in (fresh, plain)]
    torch.testing.assert_close(*rotated)


@pytest.mark.parametrize(
    "name,opts", CASES + [("rope2d_axial", dict(coords="normalized", shift=0.2, jitter=1.3, rescale=1.5))]
)
def test_patch_logits_stay_relative(name, opts):
    """Between patches the logits depend on content and offset only (also with STRING, and under the
    training-time coordinate augmentation: one draw for the whole forward)."""
    h, w, (sh, sw) = 4, 5, (1, 2)
    s = _scheme(name, **opts).train()
    a = Attention(HEADS * D, HEADS, pos=s, grid=(h, w), num_prefix_tokens=1).double()
    st = s.prepare(Grid(h, w), 1, None, torch.float64)
    torch.manual_seed(1)
    pre = torch.randn(1, 1, HEADS * D, dtype=torch.float64)
    patches = torch.randn(1, h, w, HEADS * D, dtype=torch.float64)
    moved = torch.roll(patches, shifts=(sh, sw), dims=(1, 2))
    la = a.logits(torch.cat([pre, patches.reshape(1, h * w, -1)], 1), pos_state=st)
    lb = a.logits(torch.cat([pre, moved.reshape(1, h * w, -1)], 1), pos_state=st)
    src = torch.tensor([1 + r * w + c for r in range(h - sh) for c in range(w - sw)])
    dst = torch.tensor([1 + (r + sh) * w + (c + sw) for r in range(h - sh) for c in range(w - sw)])
    torch.testing.assert_close(la[:, :, src][:, :, :, src], lb[:, :, dst][:, :, :, dst])
    assert (la[:, :, src][:, :, :, src] - la[:, :, dst][:, :, :, dst]).abs().max() > 1e-3  # not trivially constant


def test_normalized_coordinates_interpolate_at_larger_sizes():
    """Index coordinates extrapolate (angles grow with the grid); normalised ones stay in DINOv3's range."""
    idx = _scheme("rope2d_axial")
    nrm = _scheme("rope2d_axial", coords="normalized")
    for g in (Grid(4, 4), Grid(8, 8), Grid(16, 16)):
        assert nrm.angles(g).abs().max() < 2 * math.pi  # |2 pi coord omega| < 2 pi: coords in (-1, 1), omega <= 1
    assert idx.angles(Grid(16, 16)).abs().max() > 2 * idx.angles(Grid(4, 4)).abs().max()


def test_coordinate_augmentation_is_training_only_seeded_and_dinov3s():
    s = _scheme("rope2d_mixed", coords="normalized", shift=0.5, jitter=2.0, rescale=2.0)
    g = Grid(3, 4)
    s.eval()
    ev = s.cos_sin(g)
    torch.testing.assert_close(s.cos_sin(g)[0], ev[0])
    s.train()
    torch.manual_seed(3)
    a = s.cos_sin(g)[0]
    b = s.cos_sin(g)[0]
    torch.manual_seed(3)
    torch.testing.assert_close(s.cos_sin(g)[0], a)  # reproducible from the seed
    assert not torch.allclose(a, b) and not torch.allclose(a, ev[0])
    # the draws are DINOv3's: shift, then jitter per axis, then one rescale (row axis first)
    from vitrel.pos.schemes.rope import augment_coords, rope_coords

    r, c = rope_coords(g, "normalized")
    torch.manual_seed(5)
    got = augment_coords(r / (2 * math.pi), c / (2 * math.pi), 0.5, 2.0, 2.0)
    torch.manual_seed(5)
    shift = torch.empty(2, dtype=torch.float64).uniform_(-0.5, 0.5)
    jit = torch.empty(2, dtype=torch.float64).uniform_(-math.log(2.0), math.log(2.0)).exp()
    res = torch.empty(1, dtype=torch.float64).uniform_(-math.log(2.0), math.log(2.0)).exp()
    want_r = (r / (2 * math.pi) + shift[0]) * jit[0] * res
    want_c = (c / (2 * math.pi) + shift[1]) * jit[1] * res
    torch.testing.assert_close(got[0], want_r)
    torch.testing.assert_close(got[1], want_c)


def test_bad_options_are_clear_errors():
    with pytest.raises(ValueError, match="coords must be one of"):
        build_pos({"name": "rope2d_axial", "coords": "pixels"}, num_heads=2, head_dim=8, grid=(3, 3))
    with pytest.raises(ValueError, match="coords='normalized'"):
        build_pos({"name": "rope2d_axial", "shift": 0.1}, num_heads=2, head_dim=8, grid=(3, 3))
    with pytest.raises(ValueError, match="jitter must be"):
        build_pos({"name": "rope2d_mixed", "coords": "normalized", "jitter": 0.5}, num_heads=2, head_dim=8, grid=(3, 3))
    with pytest.raises(ValueError, match="basis must be"):
        build_pos({"name": "rope2d_mixed", "basis": "householder"}, num_heads=2, head_dim=8, grid=(3, 3))
    with pytest.raises(ValueError, match=r"grid_offset shifts integer coordinates \(coords='index'\)"):
        spec = {"name": "rope2d_axial", "coords": "normalized", "grid_offset": 1}
        build_pos(spec, num_heads=2, head_dim=8, grid=(3, 3))
    with pytest.raises(ValueError, match="grid_offset must be a finite number, got inf"):
        build_pos({"name": "rope2d_axial", "grid_offset": math.inf}, num_heads=2, head_dim=8, grid=(3, 3))


class _CountOps(TorchDispatchMode):
    """Counts the aten ops a forward runs, by name."""

    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _tiny_vit(pos, depth: int, **kw) -> VisionTransformer:
    """The ViT of the mixed-RoPE model tests: 16 x 16 images in 4 x 4 patches, 2 heads of 16 channels, 5 classes."""
    return VisionTransformer(
        img_size=16, patch_size=4, embed_dim=32, depth=depth, num_heads=2, num_classes=5, pos=pos, **kw
    )


MIXED_OPTS = [
    {},
    {"basis": "cayley"},
    {"basis": "circulant"},
    {"coords": "normalized"},
]


@pytest.mark.parametrize("opts", MIXED_OPTS)
@pytest.mark.parametrize("prefix", [0, 1])
def test_mixed_blocks_prepared_together(opts, prefix):
    """A ViT whose blocks each own a rope2d_mixed scheme computes every block's cos/sin in one product (one
    ``cos`` per forward, as RoPE-ViT): the states equal each scheme's own ``prepare``, and the model's output and
    every gradient equal those of blocks that prepare their own state."""
    torch.manual_seed(0)
    pos = {"name": "rope2d_mixed", **opts}
    m = _tiny_vit(pos, 3, class_token=bool(prefix), global_pool="token" if prefix else "avg").double()
    with torch.no_grad():  # STRING's basis away from the identity, so that it matters
        for blk in m.blocks:
            if blk.attn.pos.string is not None:
                blk.attn.pos.string.normal_(0.0, 0.3)
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    grid = (4, 4)
    like = torch.empty(0, dtype=torch.float64)
    states = m.position_states(grid, like)
    for blk, st in zip(m.blocks, states):
        own = blk.attn.pos.prepare(grid, m.num_prefix_tokens, like.device, like.dtype)
        assert st.scheme is blk.attn.pos and len(st.rope) == len(own.rope)
        for a, b in zip(st.rope, own.rope):
            assert torch.equal(a, b)

    count = _CountOps()
    with count:
        out = m(x)
    assert count.calls.get("aten.cos") == 1 and count.calls.get("aten.sin") == 1
    params = list(m.parameters())
    grads = torch.autograd.grad(out.square().sum(), params)

    def own_states(x):  # every block prepares its own state inside its attention
        t, g = m.embed(x)
        for blk in m.blocks:
            t = blk(t, g)
        return m.forward_head(m.norm(t))

    ref = own_states(x)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    for (name, _), g, r in zip(m.named_parameters(), grads, torch.autograd.grad(ref.square().sum(), params)):
        torch.testing.assert_close(g, r, atol=1e-12, rtol=1e-12, msg=lambda s, name=name: f"grad {name}: {s}")


def test_swin_mixed_blocks_prepared_per_stage(monkeypatch):
    """A Swin whose blocks each own a rope2d_mixed scheme computes each stage's cos/sin in one product (one
    ``cos`` per stage and forward); output and every gradient equal those of blocks preparing their own."""
    from vitrel.models.swin import SwinStage, SwinTransformer

    torch.manual_seed(0)
    m = SwinTransformer(
        img_size=16, patch_size=2, embed_dim=16, depths=(2, 2), num_heads=(2, 2), window_size=4, num_classes=5,
        drop_path_rate=0.0,
        pos={"name": "rope2d_mixed", "basis": "cayley"},
    ).double()  # fmt: skip
    with torch.no_grad():  # STRING's basis away from the identity, so that it matters
        for stage in m.layers:
            for blk in stage.blocks:
                blk.attn.pos.string.normal_(0.0, 0.3)
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    count = _CountOps()
    with count:
        out = m(x)
    assert count.calls.get("aten.cos") == len(m.layers)
    params = list(m.parameters())
    grads = torch.autograd.grad(out.square().sum(), params)
    monkeypatch.setattr(SwinStage, "position_states", lambda self, x, layout=None: [None] * len(self.blocks))
    ref = m(x)  # every block prepares its own state inside its attention
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    for (name, _), g, r in zip(m.named_parameters(), grads, torch.autograd.grad(ref.square().sum(), params)):
        torch.testing.assert_close(g, r, atol=1e-12, rtol=1e-12, msg=lambda s, name=name: f"grad {name}: {s}")


def _one_draw(shift: float, jitter: float, rescale: float) -> list[float]:
    """DINOv3's draws in its order (``RopePositionEmbedding.forward``): a shift per axis, a jitter factor per axis, one
    rescale factor; rows first."""
    sh = torch.empty(2, dtype=torch.float64).uniform_(-shift, shift)
    jit = torch.empty(2, dtype=torch.float64).uniform_(-math.log(jitter), math.log(jitter)).exp()
    res = torch.empty(1, dtype=torch.float64).uniform_(-math.log(rescale), math.log(rescale)).exp()
    return [float(v) for v in (sh[0], sh[1], jit[0], jit[1], res[0])]


AUG = {"coords": "normalized", "shift": 0.3, "jitter": 1.5, "rescale": 2.0}


def test_augmentation_is_one_draw_per_forward_for_every_block():
    """DINOv3 draws its coordinate augmentation once per forward and every block rotates by those coordinates: a ViT
    whose blocks each own a rope2d_mixed scheme (their own frequencies) rotates block ``b`` by ``f^x_b c' + f^y_b r'``
    with one draw ``(r + s_r) j_r m``, ``(c + s_c) j_c m`` (in DINOv3's units), written here from the equation."""
    torch.manual_seed(0)
    m = _tiny_vit({"name": "rope2d_mixed", **AUG}, 3).double().train()
    grid, like = Grid(4, 4), torch.empty(0, dtype=torch.float64)
    torch.manual_seed(11)
    states = m.position_states(grid, like)
    torch.manual_seed(11)
    s_r, s_c, j_r, j_c, res = _one_draw(AUG["shift"], AUG["jitter"], AUG["rescale"])
    for blk, st in zip(m.blocks, states):
        f = blk.attn.pos.freqs.detach()
        p = m.num_prefix_tokens  # (the class token: angle 0)
        want = torch.zeros(2, p + grid.n, f.shape[-1], dtype=torch.float64)
        for r in range(grid.h):
            for c in range(grid.w):
                y = 2 * math.pi * ((2 * (r + 0.5) / grid.h - 1) + s_r) * j_r * res
                x = 2 * math.pi * ((2 * (c + 0.5) / grid.w - 1) + s_c) * j_c * res
                for h in range(2):
                    for t in range(f.shape[-1]):
                        want[h, p + r * grid.w + c, t] = f[0, h, t] * x + f[1, h, t] * y
        torch.testing.assert_close(st.rope[0], want.cos(), atol=1e-12, rtol=0)
        torch.testing.assert_close(st.rope[1], want.sin(), atol=1e-12, rtol=0)
    count = _CountOps()
    with count:  # every block's cos/sin still in one product
        m(torch.randn(2, 3, 16, 16, dtype=torch.float64))
    assert count.calls.get("aten.cos") == 1


@pytest.mark.parametrize("name", ["rope2d_axial", "spiral_rope"])
@pytest.mark.parametrize("sizes", [[(16, 16)], [(16, 16), (8, 12)]])
def test_blocks_of_their_own_augment_as_one_shared_scheme(name, sizes):
    """Schemes without parameters compute the same function whether the blocks share one scheme (``pos_share``) or
    each own one, augmentation included: one draw per forward for every block, on full grids and on token layouts
    (images of different sizes). Drawn per block, the blocks' coordinates would differ (an audit's)."""
    pos = {"name": name, **AUG}
    torch.manual_seed(0)
    own = _tiny_vit(pos, 3).double().train()
    shared = _tiny_vit(pos, 3, pos_share=True).double().train()
    shared.load_state_dict(own.state_dict())
    x = [torch.randn(3, h, w, dtype=torch.float64) for h, w in sizes]
    x = x[0][None] if len(x) == 1 else x
    outs = []
    for model in (own, shared):
        torch.manual_seed(5)
        outs.append(model(x))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-12, rtol=0)
    torch.manual_seed(6)
    assert not torch.allclose(own(x), outs[0])  # (the draw changes the function)
