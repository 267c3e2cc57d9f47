"""torch.export and ONNX for every model x position scheme, and the rule that a forward pass changes nothing.

Each exported program is checked against eager at the size it was traced at and at other sizes
(another batch, and for dynamic height/width other, non-square images: a Swin's grid padded to whole
windows and shifted, and smaller than its window at the last stage). The whole matrix is ``slow``; a
representative subset (the quick cases) runs by default. The quick Swin cases use models of several stages
(2 of a plain and a shifted block), and so do the quick ViT cases whose scheme prepares its blocks' states together
(2 blocks: :func:`by_blocks`); the other cases use the fewest blocks that run the scheme's whole path (ViT: 1,
average-pooled; Swin: 1 stage): no other scheme's code depends on the number of blocks. The matrices' models have
weights that make every scheme show in the logits (:func:`case_model`).
An ONNX case converts the program its torch.export check traced (as ``python -m vitrel.export`` does).
"""

from __future__ import annotations

import itertools
import warnings

import lightning  # noqa: F401  (wraps torch.compile, as in any training process: the same in every test order)
import pytest
import torch

import vitrel
from tests.weights import lively
from vitrel.export import best_dynamic, export_program, onnx_program, program_input_sizes

SCHEMES = vitrel.list_pos()
ARCHS = ("vit", "swin")
MODES = ("static", "batch", "hw")
#: the schemes inside attention whose terms depend on the grid's extent (1-D raster order, normalised coordinates): in
#: a Swin, their window's extent changes with the stage grid (docs/export.md); an absolute scheme's (sincos1d) is the
#: image's grid at the input, not a window's
EXTENT = {
    n
    for n in SCHEMES
    if (s := vitrel.pos.build_pos(n, num_heads=2, head_dim=16, grid=(4, 4))).depends_on_extent and s.kind != "absolute"
}


def small_model(arch: str, pos: str, stages: int = 2, **kw) -> torch.nn.Module:
    """A few-block model of each kind (ViT: ``stages`` blocks, 4 heads of 16; Swin: ``stages`` stages of a plain
    and a shifted block)."""
    torch.manual_seed(0)
    if arch == "vit":
        m = vitrel.create_model("vitrel_vit_tiny_patch4_32", pos=pos, embed_dim=64, depth=stages, num_heads=4, **kw)
    else:
        m = vitrel.create_model(
            "vitrel_swin_tiny_patch2_window4_32", pos=pos, embed_dim=32, depths=(2,) * stages, num_heads=(2,) * stages,
            **kw,
        )  # fmt: skip
    return m.eval()


def other_sizes(arch: str, mode: str, stages: int = 2) -> list[tuple[int, ...]]:
    """Sizes other than the traced one (2 x 3 x 32 x 32) an exported program is checked at."""
    if mode != "hw":
        return [(3, 3, 32, 32) if mode == "batch" else (2, 3, 32, 32)]
    if arch == "vit":
        return [(3, 3, 24, 36)]  # another batch, non-square
    # another batch, non-square: the first stage's grid (6 x 10) padded to whole windows and shifted, the last
    # stage's grid (3 x 5) smaller than its window (4 x 4: it shrinks to 3 x 4 and shifts along the width only)
    return [(3, 3, 12, 20)] if stages == 2 else [(3, 3, 12, 20), (3, 3, 6, 10)]


def by_blocks(pos: str) -> bool:
    """The scheme's class prepares its blocks' states together (its own ``prepare_many``: RoPE-Mixed, LookHere), so
    its path differs with more than one block; every other scheme's blocks each run the same code on their own state."""
    owner = next(c for c in vitrel.pos.get_pos_class(pos).__mro__ if "prepare_many" in vars(c))
    return owner is not vitrel.pos.PositionScheme


def case_model(arch: str, pos: str, quick: bool) -> tuple[torch.nn.Module, int]:
    """A matrix case's model and its blocks (ViT) or stages (Swin): several for the quick Swin cases and the quick ViT
    cases of a scheme whose path depends on the number of blocks (:func:`by_blocks`), one for the others (a one-block
    ViT average-pools: its class token alone would see no bias between patches).

    The weights are :func:`tests.weights.lively`'s, not timm's: under timm's init a scheme changes these models'
    logits by less than the checks' tolerance (at 2 blocks rel2d_full by 6e-6; at 1 block, alibi2d by 0), so a scheme
    dropped or computed differently in a program would not show."""
    stages = 2 if quick and (arch == "swin" or by_blocks(pos)) else 1
    m = small_model(arch, pos, stages=stages, **({} if stages == 2 or arch == "swin" else {"global_pool": "avg"}))
    lively(m)
    return m, stages


def supported(arch: str, pos: str, mode: str) -> bool:
    return not (arch == "swin" and mode == "hw" and pos in EXTENT)


def check_export(m: torch.nn.Module, arch: str, mode: str, stages: int) -> torch.export.ExportedProgram:
    """``m``'s program (``mode`` sizes) equals ``m`` at the traced size and :func:`other_sizes`; neither a forward
    nor tracing changed anything on ``m`` (:func:`_snapshot`: its state, buffers and every plain attribute).
    Returns the program."""
    x = torch.randn(2, 3, 32, 32)
    snap = _snapshot(m)
    with torch.no_grad():
        before = m(x)
    _same(snap, _snapshot(m), "forward")
    ep = export_program(m, x, dynamic=mode)
    _same(snap, _snapshot(m), "export")
    program = ep.module()  # (one module called at every size, as a loaded program is)
    with torch.no_grad():
        for shape in [x.shape, *other_sizes(arch, mode, stages)]:
            xi = torch.randn(*shape)
            torch.testing.assert_close(program(xi), m(xi), rtol=1e-5, atol=1e-5)
        after = m(x)
    assert type(after) is torch.Tensor  # not a FakeTensor left behind by the trace
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    _same(snap, _snapshot(m), "forward at other sizes")
    return ep


def matrix(quick: set[tuple], *axes) -> list:
    """Every combination of ``axes``, those not in ``quick`` marked ``slow`` (``-m "not slow"`` keeps the quick
    subset; the default suite runs each case once)."""
    import itertools

    return [pytest.param(*c, marks=() if c in quick else pytest.mark.slow) for c in itertools.product(*axes)]


#: quick ONNX cases (each with its torch.export check at best_dynamic's sizes: "hw" here)
QUICK_ONNX = {
    ("vit", "rel2d_factored"),
    ("vit", "rope2d_mixed"),
    ("vit", "shaw2d_factored"),
    ("vit", "rel2d_full"),
    ("vit", "ape"),
    ("swin", "rel2d_full"),
}
QUICK_EXPORT = {("vit", "alibi2d", "batch"), ("swin", "rel2d_cpb", "static")}


def _own_path(name: str) -> bool:
    """The scheme runs attention (its own kernel's ``content_attention``: Shaw), or builds its queries and keys, its own
    way (not the protocol's defaults)."""
    cls = vitrel.pos.get_pos_class(name)
    base = vitrel.pos.PositionScheme
    return any(
        getattr(cls, hook, None) is not getattr(base, hook, None) for hook in ("attend", "augment", "content_attention")
    )


#: Swin programs (ONNX; torch.export's batch mode): a scheme of each family (and LookHere's -inf
#: views), and every scheme with its own attention or token path. The rest of a Swin's graph (windows, shifts,
#: masks, merging) does not depend on the scheme; every scheme goes through ONNX on the ViT, and through
#: torch.export on both models at dynamic resolution (EXPORT_CASES).
FAMILY_CASES = {"none", "ape", "rel2d_full", "alibi2d", "lookhere", "rope2d_mixed", "gpsa"}
SWIN_ONNX = FAMILY_CASES | {n for n in SCHEMES if _own_path(n)}


def _built_buffers(name: str) -> bool:
    """The scheme keeps its built grid's terms as buffers (``built_*``), read only at that concrete grid."""
    s = vitrel.pos.build_pos(name, num_heads=2, head_dim=16, grid=(4, 4))
    return any(n.startswith("built_") for n, _ in s.named_buffers())


def onnx_mode(arch: str, pos: str) -> str:
    """The sizes an ONNX case exports (``best_dynamic``: "batch" for a Swin with an extent-dependent scheme)."""
    return "batch" if arch == "swin" and pos in EXTENT else "hw"


#: the torch.export matrix keeps every scheme at dynamic resolution (both models). At a concrete grid (static and
#: batch programs) a scheme runs the code it runs at a symbolic one (its caches are bypassed while tracing) but
#: for the built grid's buffers, and only its own attend / augment meet the batch dimension, which a static
#: program fixes as well: so the batch programs are kept for SWIN_ONNX's schemes (a scheme of each family,
#: every scheme with its own path) and, on the ViT, every scheme with built buffers. A static program runs the
#: lines of vitrel its model's batch program runs, but export's ``dynamic_shapes`` returning None (and not
#: ``full_mask``'s expansion to a symbolic batch), at the batch program's traced input: one static program a
#: model (STATIC, and QUICK_EXPORT's Swin), each with a bias.
STATIC = {("vit", "rel2d_full")}
EXPORT_CASES = {
    (a, p, m)
    for a, p, m in itertools.product(ARCHS, SCHEMES, MODES)
    if m == "hw"
    or (m == "batch" and (p in SWIN_ONNX or (a == "vit" and _built_buffers(p))))
    or (m == "static" and (a, p) in STATIC)
} | QUICK_EXPORT
ONNX_CASES = {(a, p) for a, p in itertools.product(ARCHS, SCHEMES) if a == "vit" or p in SWIN_ONNX}
#: the torch.export checks the ONNX cases make (on the program they convert), left out of test_export_matrix
ONNX_EXPORT = {(a, p, onnx_mode(a, p)) for a, p in ONNX_CASES}


# ---------------------------------------------------------------------------- the export matrix
@pytest.mark.parametrize(
    ("arch", "pos", "mode"),
    [c for c in matrix(QUICK_EXPORT, ARCHS, SCHEMES, MODES) if tuple(c.values) in EXPORT_CASES - ONNX_EXPORT],
)
def test_export_matrix(arch, pos, mode):
    m, stages = case_model(arch, pos, (arch, pos, mode) in QUICK_EXPORT)
    if not supported(arch, pos, mode):
        assert best_dynamic(m) == "batch"
        with pytest.raises(ValueError, match="window's extent"):
            export_program(m, torch.randn(2, 3, 32, 32), dynamic="hw")
        return
    check_export(m, arch, mode, stages)


def test_swin_extent_schemes_refuse_dynamic_resolution():
    m = small_model("swin", "alibi1d")
    assert best_dynamic(m) == "batch" and best_dynamic(small_model("vit", "alibi1d")) == "hw"
    with pytest.raises(ValueError, match="window's extent"):
        export_program(m, torch.randn(2, 3, 32, 32), dynamic="hw")


@pytest.mark.parametrize(
    ("name", "clip", "other"),
    [
        ("vitrel_swin_tiny_patch2_window4_32", (3, 16, 16), (3, 24, 16)),
        ("vitrel_swin3d_tiny_patch122_window444_32", (1, 4, 16, 16), (1, 2, 16, 24)),
    ],
)
def test_swin_program_with_a_stage_of_one_window_takes_batch_one(name, clip, other):
    """A 2-stage Swin (image and video) traced at batch 2, its last stage one window (grid 4 x 4, frames 4): the
    ``"hw"`` program runs at batch 1, at that size and another, as eager does (the mask check pinned the windows'
    batch, ``B * nW != 1``, and the program refused a single image or clip)."""
    torch.manual_seed(0)
    extra = {"num_frames": 4} if len(clip) == 4 else {}
    m = vitrel.create_model(name, embed_dim=16, depths=(2, 2), num_heads=(2, 2), img_size=16, **extra)
    lively(m.eval())
    program = export_program(m, torch.randn(2, *clip), dynamic="hw").module()
    with torch.no_grad():
        for shape in [(1, *clip), (1, *other), (2, *clip)]:
            x = torch.randn(*shape)
            torch.testing.assert_close(program(x), m(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("global_pool", ["max", "avgmax", "map", "attentive"])
def test_a_vit_with_timms_other_pools_exports_for_batch_one_and_any_size(global_pool):
    """``max``, ``avgmax`` and ``map`` (timm's ``AttentionPoolLatent``, whose expanded latent guarded ``batch != 1``
    under size-oblivious tracing: the export failed) give ``"hw"`` programs that equal eager at batch 1 and at other
    sizes; a ``map`` program takes sides of 2 patches or more (a side of 1 patch: refused). So does ``map`` with
    V-JEPA 2's attentive pool (``attn_pool_type="attentive"``, 2 blocks)."""
    torch.manual_seed(0)
    kw = dict(attn_pool_type="attentive", attn_pool_depth=2) if global_pool == "attentive" else {}
    global_pool = "map" if kw else global_pool
    m = vitrel.create_model(
        "vitrel_vit_tiny_patch4_32", embed_dim=32, depth=1, num_heads=2, global_pool=global_pool, class_token=False,
        **kw,
    )  # fmt: skip
    ep = export_program(lively(m.eval()), torch.randn(2, 3, 32, 32), dynamic="hw")
    smallest = 8 if global_pool == "map" else 4  # (the sizes it states are those it takes: before, map's said 4 px)
    assert [r.start for r in program_input_sizes(ep)[2:]] == [smallest, smallest]
    program = ep.module()
    with torch.no_grad():
        for shape in [(1, 3, 32, 32), (1, 3, 8, 12), (3, 3, 48, 40)]:
            x = torch.randn(*shape)
            torch.testing.assert_close(program(x), m(x), rtol=1e-5, atol=1e-5)


def test_shared_scheme_exports_at_any_size():
    """pos_share: the state is prepared once per forward (per stage in Swin) inside the program."""
    for arch in ARCHS:
        m = lively(small_model(arch, "rel2d_factored", pos_share=True))
        x = torch.randn(2, 3, 32, 32)
        ep = export_program(m, x, dynamic="hw")
        x2 = torch.randn(*other_sizes(arch, "hw")[0])
        with torch.no_grad():
            torch.testing.assert_close(ep.module()(x2), m(x2), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- a forward changes nothing
#: what torch itself keeps on a module (the containers are compared above; torch.compile marks the module,
#: and once lightning is imported its wrapper of torch.compile records the arguments: _compile_kwargs)
_TORCH_OWN = {"_parameters", "_buffers", "_modules", "_is_torch_compile", "_compile_kwargs", "_compiled_call_impl"}


def _snapshot(model: torch.nn.Module) -> dict:
    """state_dict, every buffer (persistent or not) and every plain attribute of every module."""
    snap = {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    snap["buffers"] = {k: (None if v is None else v.detach().clone()) for k, v in model.named_buffers()}
    attrs = {}
    for name, mod in model.named_modules():
        for k, v in vars(mod).items():
            if k in _TORCH_OWN or k.startswith("_forward") or k.endswith("_hooks"):
                continue
            attrs[f"{name}.{k}"] = _plain(v)
    snap["attrs"] = attrs
    return snap


def _plain(v):
    if isinstance(v, torch.Tensor):
        return ("tensor", v.detach().clone())
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, [_plain(x) for x in v])
    if isinstance(v, (set, frozenset)):
        return ("set", sorted(map(repr, v)))
    if isinstance(v, (int, float, str, bool, type(None), torch.dtype, torch.device)):
        return v
    if hasattr(v, "__dict__") and not callable(v):
        return (type(v).__name__, {k: _plain(x) for k, x in vars(v).items()})
    return (type(v).__name__, id(v))


def _same(a, b, where="") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and type(b) is torch.Tensor, where
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, set(a) ^ set(b))
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


@pytest.mark.parametrize(
    "arch,pos",
    [("vit", "alibi2d"), ("vit", "rope2d_axial"), ("vit", "sincos2d"), ("swin", "rel2d_full"), ("swin", "lookhere")],
)
def test_forward_and_compile_change_nothing(arch, pos):
    """A forward (at the built grid and at another one) and ``torch.compile`` change nothing on the model; what
    ``torch.export`` changes is checked on every exported program (:func:`check_export`)."""
    torch._dynamo.reset()
    m = lively(small_model(arch, pos))
    x, x_other = torch.randn(2, 3, 32, 32), torch.randn(1, 3, 24, 40)
    snap = _snapshot(m)
    with torch.no_grad():
        ref, ref_other = m(x), m(x_other)  # at the built grid (buffers) and at another one (computed)
    _same(snap, _snapshot(m), "forward")
    compiled = torch.compile(m, backend="eager")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(compiled(x), ref, rtol=1e-5, atol=1e-5)
    _same(snap, _snapshot(m), "compile")
    with torch.no_grad():
        torch.testing.assert_close(m(x_other), ref_other, rtol=0, atol=0)


def test_to_and_to_empty_remake_buffers():
    """The built grid's tensors are non-persistent buffers, remade exactly on a new dtype / after to_empty."""
    m = small_model("vit", "alibi2d")
    sd = m.state_dict()
    assert not any("built_" in k for k in sd)  # not saved
    blk = small_model("vit", "alibi2d").double().blocks[0].attn.pos
    made = small_model("vit", "alibi2d", dtype=torch.float64).blocks[0].attn.pos  # built in float64 from the start
    torch.testing.assert_close(blk.built_bias, made.built_bias, rtol=0, atol=0)
    assert blk.built_bias.dtype == torch.float64
    e = vitrel.create_model(
        "vitrel_vit_tiny_patch4_32", pos="alibi2d", embed_dim=64, depth=2, num_heads=4, device="meta"
    ).to_empty(device="cpu")
    e.load_state_dict(sd)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(e.eval()(x), m(x), rtol=0, atol=0)


def test_swin_masks_and_sincos_remade_after_conversions():
    """One mechanism (``NonPersistentBuffers``) remakes every derived buffer: Swin's window regions after
    ``to_empty()``, and exact float64 values (not float32 ones cast up) after ``double()``; the modules
    that own them are those timm's ``reinit_non_persistent_buffers`` finds."""
    from timm.models._manipulate import reinit_non_persistent_buffers

    from vitrel.pos.schemes.absolute import sincos2d_embed

    ref = small_model("swin", "rel2d_full", abs_pos="sincos2d")
    masks = {n: b for n, b in ref.named_buffers() if n.endswith("window_regions")}
    assert masks and not any(n.endswith("window_regions") for n in ref.state_dict())
    e = vitrel.create_model(
        "vitrel_swin_tiny_patch2_window4_32",
        pos="rel2d_full",
        abs_pos="sincos2d",
        embed_dim=32,
        depths=(2, 2),
        num_heads=(2, 2),
        device="meta",
    ).to_empty(device="cpu")
    for n, b in e.named_buffers():
        if n in masks:
            torch.testing.assert_close(b, masks[n], rtol=0, atol=0)
    d = small_model("swin", "rel2d_full", abs_pos="sincos2d").double()
    pe = d.abs_pos.built_embed
    assert pe.dtype == torch.float64
    torch.testing.assert_close(pe, sincos2d_embed(d.abs_pos.grid, 32, 10000.0).to(pe.dtype), rtol=0, atol=0)
    assert ref.abs_pos.built_embed.double().ne(pe).any()  # a float32 table cast up would not be exact
    names = reinit_non_persistent_buffers(ref)
    assert "abs_pos" in names and sum(n.endswith(".blocks.1") for n in names) == 2  # the shifted blocks


def test_one_buffer_mechanism():
    """Only ``NonPersistentBuffers`` overrides ``nn.Module._apply`` (PyTorch has no public hook after a
    conversion); every other module with derived buffers goes through it."""
    from pathlib import Path

    root = Path(vitrel.__file__).parent
    owners = [p.relative_to(root).as_posix() for p in root.rglob("*.py") if "def _apply(" in p.read_text()]
    assert owners == ["pos/cache.py"]


# ---------------------------------------------------------------------------- ONNX
onnxruntime = pytest.importorskip("onnxruntime", reason="pip install vitrel[export]")


@pytest.fixture(scope="module", autouse=True)
def _one_torchlib_registry(one_torchlib_registry):
    """torch.onnx.export's operator registry built once for the ONNX cases, not at every export
    (tests/conftest.py's ``one_torchlib_registry``)."""


def test_shared_registry_is_a_fresh_one_of_its_own():
    """The shared registry (:func:`_one_torchlib_registry`) holds what a fresh one holds, at each call a copy: what
    one call registers (a ``custom_translation_table``) is not in the next call's."""
    from torch.onnx._internal.exporter._registration import ONNXRegistry

    from vitrel.export import ONNX_OPSET

    assert hasattr(ONNXRegistry.from_torchlib, "original")  # (installed)
    fresh = ONNXRegistry.from_torchlib.original(ONNXRegistry, opset_version=ONNX_OPSET)
    one, two = (ONNXRegistry.from_torchlib(opset_version=ONNX_OPSET) for _ in range(2))
    assert one.opset_version == fresh.opset_version == ONNX_OPSET and one.functions == fresh.functions
    one.register_op(torch.ops.aten.relu.default, lambda x: x)
    assert one.functions != fresh.functions and two.functions == fresh.functions
    assert ONNXRegistry.from_torchlib(opset_version=ONNX_OPSET).functions == fresh.functions


def check_onnx(arch: str, pos: str, tmp_path) -> None:
    """The torch.export check (:func:`check_export`) at ``best_dynamic``'s sizes, then that program through ONNX
    (:func:`onnx_program` with ``program=``, as the command converts the program it traced) and ONNX Runtime,
    equal to eager at the same sizes."""
    import numpy as np

    m, stages = case_model(arch, pos, (arch, pos) in QUICK_ONNX)
    dynamic = best_dynamic(m)
    assert dynamic == onnx_mode(arch, pos)
    ep = check_export(m, arch, dynamic, stages)
    path = tmp_path / f"{arch}_{pos}.onnx"
    onnx_program(m, dynamic=dynamic, program=ep).save(str(path))
    sess = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for shape in [(2, 3, 32, 32), *other_sizes(arch, dynamic, stages)]:
        x = torch.randn(*shape)
        (out,) = sess.run(None, {"images": x.numpy()})
        with torch.no_grad():
            np.testing.assert_allclose(out, m(x).numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("arch", "pos"), [c for c in matrix(QUICK_ONNX, ARCHS, SCHEMES) if tuple(c.values) in ONNX_CASES]
)
def test_onnx_matrix(arch, pos, tmp_path):
    check_onnx(arch, pos, tmp_path)


def test_reduced_matrices_cover_every_family_scheme_and_quick_case():
    """What the reduced matrices keep: every scheme through torch.export at dynamic resolution on both models
    (test_export_matrix, or the check an ONNX case makes on the program it converts), every scheme through ONNX
    on the ViT, a scheme of each family and every scheme with its own path on the Swin; quick cases of several
    blocks on both models, and a one-stage Swin checked where its window shrinks and where it pads and shifts."""
    from vitrel.layout.geometry import Grid
    from vitrel.layout.windows import window_and_shift

    families = {vitrel.pos.get_pos_class(n).family for n in SCHEMES}
    assert families == {vitrel.pos.get_pos_class(n).family for n in SWIN_ONNX}
    assert {p for a, p in QUICK_ONNX if a == "swin"} <= SWIN_ONNX
    assert {p for a, p in ONNX_CASES if a == "vit"} == set(SCHEMES)
    assert {a for a, p in QUICK_ONNX} == set(ARCHS) and QUICK_ONNX <= ONNX_CASES
    assert {a for a, p in QUICK_ONNX if a == "swin" or by_blocks(p)} == set(ARCHS)  # several blocks, both models
    # each torch.export case runs once: in test_export_matrix, or in the ONNX case that converts its program
    assert ONNX_EXPORT <= EXPORT_CASES and QUICK_EXPORT <= EXPORT_CASES - ONNX_EXPORT
    for arch in ARCHS:  # every scheme at dynamic resolution
        assert {p for a, p, m in EXPORT_CASES if (a, m) == (arch, "hw")} == set(SCHEMES), arch
    batch = {(a, p) for a, p, m in EXPORT_CASES if m == "batch"}  # every built buffer read, every own path
    assert {("vit", p) for p in SCHEMES if _built_buffers(p)} <= batch
    assert {(a, p) for a in ARCHS for p in SCHEMES if _own_path(p)} <= batch
    # a static program on each model; each family's scheme at a concrete grid in a batch program (which runs what its
    # static program would, at the same input and more: STATIC's comment)
    assert {a for a, p, m in EXPORT_CASES if m == "static"} == set(ARCHS)
    assert {(a, p) for a in ARCHS for p in FAMILY_CASES} <= batch
    # the Swins' shifted blocks (patch 2, window 4) at the other sizes: a stage grid padded to whole windows and
    # shifted, and one smaller than the window (it shrinks), in the one-stage Swin as in the two-stage one
    for stages in (1, 2):
        seen = set()
        for _, _, h, w in other_sizes("swin", "hw", stages):
            for stage in range(stages):
                grid = Grid(h // 2 >> stage, w // 2 >> stage)
                win, shift = window_and_shift(grid, (4, 4), shifted=True)
                padded = grid.h % win[0] or grid.w % win[1]
                seen |= {"shrinks"} if win != (4, 4) else {"pads and shifts"} if padded and shift != (0, 0) else set()
        assert seen == {"shrinks", "pads and shifts"}, stages


# ---------------------------------------------------------------------------- the command's refusals
def _saved(tmp_path, arch: str = "vit", pos: str = "rel2d_full", **kw):
    """Exported weights (``save_pretrained``) of a small model built with ``kw`` (e.g. ``attn_impl``)."""
    from vitrel.models.checkpoint import save_pretrained

    return save_pretrained(small_model(arch, pos, **kw), tmp_path / "weights")


@pytest.mark.parametrize(
    ("built", "args", "said"),
    [
        (dict(attn_impl="flex"), ["--onnx"], "ONNX has no operator"),
        (dict(attn_impl="flex"), ["--pt2"], "cannot be saved as .pt2"),
        (dict(attn_impl="flex"), ["--pt2", "--dynamic", "hw"], "cannot be saved as .pt2"),
        (dict(attn_impl="triton"), ["--onnx"], "ONNX has no operator"),
        (dict(arch="swin", pos="alibi1d"), ["--pt2", "--dynamic", "hw"], "window's extent"),
    ],
)
def test_export_command_refuses_before_writing(tmp_path, capsys, built, args, said):
    """``python -m vitrel.export``: every refusal (kernel, sizes) is one error, and the output folder is not made."""
    from vitrel.export import main

    src = _saved(tmp_path, **built)
    out = tmp_path / "out"
    assert main([str(src), str(out), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and said in err and "Traceback" not in err
    assert not out.exists()


def test_export_command_trace_failure_writes_nothing(tmp_path, capsys, monkeypatch):
    """A trace torch refuses (a raw RuntimeError of torch._dynamo) is one error line; nothing is written."""
    import vitrel.export

    def refuse(*args, **kwargs):
        raise RuntimeError("s0 is not tracked with proxy\nmore lines")

    monkeypatch.setattr(vitrel.export, "export_program", refuse)
    out = tmp_path / "out"
    assert vitrel.export.main([str(_saved(tmp_path)), str(out), "--pt2"]) == 2
    err = capsys.readouterr().err
    assert "torch.export could not export the model" in err and "not tracked with proxy" in err
    assert not out.exists()


def test_flex_exports_with_static_shapes(tmp_path):
    """``attn_impl="flex"``: traced without gradients (export is not training: on CPU, FlexAttention has no backward),
    at static shapes (:func:`best_dynamic`), the same function as the weights with ``sdpa``; dynamic sizes are one
    clear error; the weights export (no program) works."""
    from vitrel.export import main

    m = lively(small_model("vit", "rel2d_full", attn_impl="flex"))
    assert best_dynamic(m) == "static"
    with pytest.raises(ValueError, match="static shapes only"):
        export_program(m, dynamic="hw")
    x = torch.randn(2, 3, 32, 32)
    assert torch.is_grad_enabled()
    ep = export_program(m, x, dynamic="static")
    ref = lively(small_model("vit", "rel2d_full", attn_impl="sdpa"))
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(x), ref(x), rtol=1e-5, atol=1e-5)
    assert main([str(_saved(tmp_path, attn_impl="flex")), str(tmp_path / "out")]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]
