"""The fused rotation of queries and keys (``vitrel.kernels.triton.rope``), run by ``attn_impl="triton"``.

On this CPU the Triton kernel runs through Triton's interpreter (``TRITON_INTERPRET=1``, set below before the kernels
are first used), at small sizes (grid 3 x 4, head dims 16 / 24 / 32, tiles of 16 tokens), against a float64 reference
written from the equations (pairs ``(2t, 2t+1)`` rotated one by one, STRING's ``P x`` and LieRE / ComRoPE's blocks
as explicit sums): outputs, the gradients of ``q`` and ``k`` and of every learned parameter of the rotation
(RoPE-Mixed's frequencies, STRING's basis, LieRE / ComRoPE's generators), for every rotary scheme and option. Marked
``cuda``, the same cases run in bf16 on a GPU (``pytest -m cuda``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # before the kernels are first imported (vitrel imports them lazily)
    os.environ["TRITON_INTERPRET"] = "1"

import vitrel  # noqa: E402
from tests.kernels.test_triton_bias import DEVICES, _tol, interpreted, pytestmark  # noqa: E402, F401
from vitrel import Attention  # noqa: E402
from vitrel.kernels import get_kernel  # noqa: E402
from vitrel.kernels.triton.rope import rope_rotate  # noqa: E402
from vitrel.layout.geometry import Grid  # noqa: E402
from vitrel.layout.tokens import TokenLayout  # noqa: E402
from vitrel.pos import list_pos  # noqa: E402
from vitrel.pos.registry import get_pos_class, parse_pos  # noqa: E402

GRID = Grid(3, 4)
#: the rotary schemes the fused rotation computes (a scheme with its own rotate(), as rope3d_vjepa2, is rotated before
#: the kernel: tests/pos/test_add_scheme.py)
ROTARY = [n for n in list_pos("relative") if get_pos_class(n).has_rotation and get_pos_class(n).fusable_rotation()]

#: every rotary scheme and option: (scheme, options, head dim, prefix tokens); prefix 5 = a class token and 4 registers
CASES = [
    ("rope1d", {}, 16, 0),
    ("rope1d", {"scaling": {"rope_type": "yarn", "factor": 2.0}}, 16, 1),
    ("rope2d_axial", {}, 16, 5),
    ("rope2d_axial", {"coords": "normalized", "shift": 0.2, "jitter": 1.3, "rescale": 1.4}, 16, 1),  # DINOv3
    ("rope2d_axial", {"scaling": {"rope_type": "ntk", "factor": [2.0, 1.5]}}, 32, 0),
    ("rope2d_axial", {"basis": "cayley"}, 16, 1),
    ("rope2d_mixed", {}, 16, 1),
    ("rope2d_mixed", {"basis": "circulant", "coords": "normalized"}, 32, 5),
    ("rope2d_mixed", {"scaling": {"rope_type": "yarn", "factor": 2.0}}, 16, 0),
    ("rope3d_axial", {}, 16, 1),  # (on GRID, one frame: the video grid's tables are tested in tests/pos/test_rope3d.py)
    ("rope3d_axial", {"sections": [1, 3, 2], "layout": "interleaved", "freqs": "shared"}, 16, 0),
    ("rope3d_mixed", {"scaling": {"rope_type": "yarn", "factor": 2.0}}, 16, 1),
    ("spiral_rope", {"directions": 2}, 16, 1),
    ("spiral_rope", {"directions": 4, "same_theta": True, "basis": "cayley"}, 16, 0),
    ("liere", {"preset": "comrope_baseline"}, 16, 1),  # 2 x 2 blocks: cos / sin from learned generators
    ("liere", {"block_size": 4}, 16, 5),
    ("liere", {"block_size": "head", "cls_position": None}, 16, 1),
    ("comrope", {}, 16, 0),
    ("comrope", {"variant": "ap", "block_size": 4}, 16, 1),
    ("comrope", {"block_size": 3}, 24, 1),  # a block and a head dim that are not powers of 2
]


def reference(x: torch.Tensor, rope: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """float64, from the equations: ``x [B, heads, N, d]`` rotated by ``rope`` = ``(cos, sin)``, ``(cos, sin, P)`` or
    ``(R,)`` (tables ``[N, w]``, ``[heads, N, w]`` or ``[B, 1 | heads, N, w]``), one pair / block entry at a time."""
    x = x.double()
    d = x.shape[-1]
    if len(rope) == 1:  # x~_{mb+i} = sum_j R[m, i, j] x_{mb+j}
        r = rope[0].double()
        nb, bs = r.shape[-3], r.shape[-1]
        out = torch.zeros_like(x)
        for m in range(nb):
            for i in range(bs):
                for j in range(bs):
                    out[..., m * bs + i] = out[..., m * bs + i] + r[..., m, i, j] * x[..., m * bs + j]
        return out
    cos, sin = rope[0].double(), rope[1].double()
    if len(rope) == 3:  # y_i = sum_j P[h, i, j] x_j
        p = rope[2].double()
        y = torch.zeros_like(x)
        for i in range(d):
            for j in range(d):
                y[..., i] = y[..., i] + p[:, i, j][None, :, None] * x[..., j]
        x = y
    out = torch.empty_like(x)
    for t in range(d // 2):
        c, s = cos[..., t], sin[..., t]
        out[..., 2 * t] = x[..., 2 * t] * c - x[..., 2 * t + 1] * s
        out[..., 2 * t + 1] = x[..., 2 * t] * s + x[..., 2 * t + 1] * c
    return out


def _scheme(name: str, options: dict, head_dim: int, prefix: int, heads: int = 2) -> torch.nn.Module:
    """The scheme in float64, its parameters moved off their initial values (STRING's basis off the identity)."""
    torch.manual_seed(1)
    s = parse_pos(name, **options).build(num_heads=heads, head_dim=head_dim, grid=GRID, num_prefix_tokens=prefix)
    s = s.double()
    with torch.no_grad():
        for p in s.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return s


def _compare(scheme, state_of, q, k, device: str) -> None:
    """``rope_rotate`` on ``device`` (fp32 in the interpreter, bf16 on a GPU) against :func:`reference`, outputs and
    the gradients of ``q``, ``k`` and of every parameter of the scheme. ``state_of()`` prepares a fresh state."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    params = [p for p in scheme.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(2)
    wq, wk = (torch.randn(q.shape, generator=g, dtype=torch.float64) for _ in range(2))
    leaves = [q.clone().requires_grad_(), k.clone().requires_grad_()]
    oq, ok = reference(leaves[0], state_of().rope), reference(leaves[1], state_of().rope)
    ref_grads = torch.autograd.grad((oq * wq).sum() + (ok * wk).sum(), leaves + params)
    xs = [q.clone().requires_grad_(), k.clone().requires_grad_()]
    rope = tuple(t.to(device) for t in state_of().rope)
    gq, gk = rope_rotate(xs[0].to(device, dtype), xs[1].to(device, dtype), rope)
    loss = (gq.double().cpu() * wq).sum() + (gk.double().cpu() * wk).sum()
    grads = torch.autograd.grad(loss, xs + params)
    tol = _tol(device)
    torch.testing.assert_close(gq.double().cpu(), oq, **tol, msg="q")
    torch.testing.assert_close(gk.double().cpu(), ok, **tol, msg="k")
    names = ["dq", "dk"] + [n for n, p in scheme.named_parameters() if p.requires_grad]
    for name, a, b in zip(names, grads, ref_grads):
        scale = max(b.abs().max().item(), 1.0)
        torch.testing.assert_close(a.double() / scale, b / scale, **tol, msg=name)


def test_every_rotary_scheme_has_a_case():
    assert {c[0] for c in CASES} == set(ROTARY)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_fused_rotation_equals_reference(case, device):
    """Every rotary scheme and option: the state's rotation (2 x 2 pairs, STRING's basis, dense blocks) through the
    kernel equals the float64 reference, forward and the gradients of q, k and the scheme's parameters."""
    name, options, d, prefix = case
    scheme = _scheme(name, options, d, prefix)
    n = prefix + GRID.n
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(3, 2, n, d, generator=g, dtype=torch.float64) for _ in range(2))

    def state_of():  # DINOv3's augmentation draws its coordinates per forward: the same draw for both paths
        torch.manual_seed(3)
        return scheme.prepare(GRID, prefix, torch.device("cpu"), torch.float64, get_kernel("sdpa"))

    _compare(scheme, state_of, q, k, device)


@interpreted
def test_views_of_one_projection():
    """q and k as ``Attention`` hands them (views of one ``qkv`` projection, rows not contiguous) are read in place
    through their strides: the output and the gradients equal the reference."""
    scheme = _scheme("rope2d_mixed", {"basis": "cayley"}, 16, 1)
    qkv = torch.randn(2, 1 + GRID.n, 3, 2, 16).permute(2, 0, 3, 1, 4).requires_grad_()  # [3, B, heads, N, d]
    q, k, _ = qkv.unbind(0)
    assert not q.is_contiguous()
    rope = scheme.prepare(GRID, 1, torch.device("cpu"), torch.float64, get_kernel("sdpa")).rope
    oq, ok = rope_rotate(q, k, rope)
    torch.testing.assert_close(oq.double(), reference(q, rope), atol=2e-5, rtol=2e-4)
    torch.testing.assert_close(ok.double(), reference(k, rope), atol=2e-5, rtol=2e-4)
    w = torch.randn_like(oq)
    (g,) = torch.autograd.grad((oq * w).sum() + ok.sum(), qkv)
    q64 = q.detach().double().requires_grad_()
    (g_ref,) = torch.autograd.grad((reference(q64, rope) * w.double()).sum(), q64)
    torch.testing.assert_close(g[0].double(), g_ref, atol=2e-5, rtol=2e-4)


def _layout() -> TokenLayout:
    """Two rows of packed images (3 x 4 and 2 x 2, then 2 x 2 and 3 x 4), a class token each, one padding token."""
    pre = [(-1, 0)]
    big = pre + [(r, c) for r in range(3) for c in range(4)]
    small = pre + [(r, c) for r in range(2) for c in range(2)]
    seg = [[0] * 13 + [1] * 5 + [-1], [0] * 5 + [1] * 13 + [-1]]
    coords = [big + small + [(-1, -1)], small + big + [(-1, -1)]]
    image = [[0] * 13 + [1] * 5 + [-1], [2] * 5 + [3] * 13 + [-1]]
    grids = [GRID, Grid(2, 2), Grid(2, 2), GRID]
    return TokenLayout.build(torch.tensor(seg), torch.tensor(coords), torch.tensor(image), grids, 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "case", [("rope2d_axial", {}), ("rope2d_mixed", {"basis": "cayley"}), ("liere", {"block_size": 4})]
)
def test_packed_layout(case, device):
    """Tokens of packed images: each token's own (gathered) rotation, tables with a batch axis."""
    scheme = _scheme(case[0], case[1], 16, 1)
    layout = _layout()
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 2, layout.num_tokens, 16, generator=g, dtype=torch.float64) for _ in range(2))

    def state_of():
        return scheme.prepare(layout, 1, torch.device("cpu"), torch.float64, get_kernel("sdpa"))

    assert state_of().rope[0].shape[0] == 2  # a batch axis: per-token tables
    _compare(scheme, state_of, q, k, device)


def _pair(name: str, prefix: int, **options) -> tuple[Attention, Attention]:
    torch.manual_seed(0)
    ref = Attention(32, 2, pos=name, grid=GRID, num_prefix_tokens=prefix, **options).double()
    with torch.no_grad():
        for p in ref.pos.parameters():
            p.add_(0.3 * torch.randn_like(p))
    fused = Attention(32, 2, pos=name, grid=GRID, num_prefix_tokens=prefix, attn_impl="triton", **options).float()
    fused.load_state_dict(ref.state_dict())
    return ref, fused


@interpreted
@pytest.mark.parametrize(
    "name,prefix,options",
    [("rope2d_axial", 1, {}), ("rope2d_mixed", 1, {"basis": "cayley"}), ("liere", 5, {"block_size": 4})],
)
def test_attention_triton_equals_sdpa(name, prefix, options):
    """``Attention(..., attn_impl="triton")`` (the fused rotation, then the fused attention) equals the float64
    ``sdpa`` path: outputs and the gradient of every parameter."""
    ref, fused = _pair(name, prefix, **options)
    x = torch.randn(2, prefix + GRID.n, 32, dtype=torch.float64)
    y_ref = ref(x, grid=GRID)
    y = fused(x.float(), grid=GRID)
    torch.testing.assert_close(y.double(), y_ref, atol=1e-5, rtol=1e-4)
    g_ref = torch.autograd.grad(y_ref.square().sum(), list(ref.parameters()))
    g = torch.autograd.grad(y.square().sum(), list(fused.parameters()))
    for (pname, _), a, b in zip(ref.named_parameters(), g, g_ref):
        scale = max(b.abs().max().item(), 1e-2)
        torch.testing.assert_close(a.double() / scale, b / scale, atol=2e-5, rtol=1e-4, msg=pname)


@interpreted
def test_model_triton_equals_sdpa_and_compiles():
    """``create_model(..., attn_impl="triton")`` with ``rope2d_mixed`` (every block's cos / sin in one product) equals
    ``sdpa``; ``torch.compile(fullgraph=True)`` captures the rotation's custom op, forward and backward."""
    assert get_kernel("triton").fused_rotation and not get_kernel("sdpa").fused_rotation
    kw = dict(pos="rope2d_mixed", img_size=16, embed_dim=32, depth=2, num_heads=2, num_classes=3)
    ref, m = (vitrel.create_model("vitrel_vit_tiny_patch4_32", attn_impl=i, **kw) for i in ("sdpa", "triton"))
    m.load_state_dict(ref.state_dict())
    x = torch.randn(2, 3, 16, 16)
    y_ref = ref(x)
    torch.testing.assert_close(m(x), y_ref, atol=1e-5, rtol=1e-4)
    c = torch.compile(m, fullgraph=True, backend="aot_eager")
    y = c(x)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-4)
    y.square().sum().backward()
    ref(x).square().sum().backward()
    freqs = [(a.grad, b.grad) for (n, a), b in zip(m.named_parameters(), ref.parameters()) if "freqs" in n]
    assert freqs
    for a, b in freqs:
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-3)


@interpreted
def test_clear_errors(monkeypatch):
    """On CPU without the interpreter, and for tables that do not fit q and k: one clear error each."""
    q = torch.randn(1, 2, 13, 16)
    cos, sin = torch.ones(13, 8), torch.zeros(13, 8)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        rope_rotate(q, q, (cos, sin))
    a = Attention(32, 2, pos="rope2d_axial", grid=GRID, num_prefix_tokens=1, attn_impl="triton")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        a(torch.randn(1, 13, 32), grid=GRID)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="does not fit"):
        rope_rotate(q, q, (torch.ones(12, 8), torch.zeros(12, 8)))
    with pytest.raises(ValueError, match="block rotations"):
        rope_rotate(q, q, (torch.ones(2, 13, 3, 4, 4),))


@interpreted
@pytest.mark.parametrize("pos", ["rope2d_mixed", "liere"])
def test_attention_on_a_packed_layout_equals_sdpa(pos):
    """``Attention(..., attn_impl="triton")`` on packed images: the fused rotation with per-token tables, then the fused
    attention on the layout, equals the sdpa path on the same layout (outputs and every parameter's gradient)."""
    torch.manual_seed(0)
    a = Attention(32, 2, pos=pos, grid=GRID, num_prefix_tokens=1)
    x = torch.randn(2, 19, 32)
    ref = a(x, _layout())
    g_ref = torch.autograd.grad(ref.square().sum(), list(a.parameters()))
    a.attn_impl = "triton"
    y = a(x, _layout())
    g = torch.autograd.grad(y.square().sum(), list(a.parameters()))
    torch.testing.assert_close(y, ref, atol=2e-5, rtol=1e-4)
    for (name, _), gi, gr in zip(a.named_parameters(), g, g_ref):
        torch.testing.assert_close(gi, gr, atol=2e-5, rtol=1e-4, msg=name)


def test_kernels_compile_for_hopper():
    """The kernels compile ahead of time for an H100 / H200 (sm_90) with the launch configuration used there, in bf16
    (head dim 64; the pairs with STRING's basis and every gradient, or none; LieRE's whole-head 64 x 64 blocks),
    within its shared memory (232,448 bytes): what the interpreter cannot check. A fresh process, interpreter off."""
    import json
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia", reason="Triton has no CUDA backend here")
    bench = str(Path(__file__).resolve().parents[2] / "bench")  # (bench/triton_aot.py: the compiler's tools)
    code = f"import json, sys; sys.path.insert(0, {bench!r}); from triton_aot import compile_rope_kernels as c; "
    code += "print(json.dumps(c(90, 64, 64)))"
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "TRITON_INTERPRET": "0"}
    )
    assert run.returncode == 0, run.stderr[-3000:]
    shared = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(shared) == {"pairs_fwd", "pairs_bwd", "pairs_bwd_fixed", "blocks_fwd", "blocks_bwd"}, shared
    assert all(0 <= v <= 232448 for v in shared.values()), shared
