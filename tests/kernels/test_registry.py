"""The kernel registry (vitrel/kernels/): every kernel declared, states that carry only what their kernel reads,
refusals named before any work, and ``auto`` read from the per-device table."""

from __future__ import annotations

import pytest
import torch

import vitrel
from tests.reference import dense_bias, reference_attention, t5_bucket_scalar
from vitrel.kernels import AUTO, AutoRule, attn_impls, get_kernel, list_kernels, resolve
from vitrel.kernels.registry import Kernel, register_kernel, select_kernel
from vitrel.layers import Attention
from vitrel.pos import build_pos, list_pos

INPUTS = {"bias", "factors", "table", "block_mask"}
RELATIVE = [n for n in list_pos("relative") if n != "none"]


def test_every_kernel_is_registered_and_declared():
    assert {"sdpa", "eager", "fold", "flex", "triton", "shaw"} <= set(list_kernels())
    assert attn_impls() == ("auto", *list_kernels())
    for name in list_kernels():
        k = get_kernel(name)
        assert k.name == name and k.reads and k.reads <= INPUTS, name
    with pytest.raises(ValueError, match="registered already"):
        register_kernel("sdpa")(type("Again", (Kernel,), {}))


def test_register_kernel_refuses_a_kernel_that_declares_no_reads_or_no_attend(monkeypatch):
    """A kernel without ``reads`` (the base's empty default) was prepared states without the bias it read, and ran
    without it, silently (docs/gpu.md's example kernel less its ``reads`` line: 0.28 off eager's output of 0.60 on
    ``rel2d_full``); now registering it raises, naming the declaration. So does a read no state holds, and no
    ``attend``."""
    from vitrel.kernels import registry
    from vitrel.kernels.eager import EagerKernel

    monkeypatch.setattr(registry, "_KERNELS", dict(registry._KERNELS))  # (restored after)
    with pytest.raises(TypeError, match=r"NoReads declares reads = frozenset\(\): declare the state fields"):
        register_kernel("no_reads")(type("NoReads", (Kernel,), {"attend": EagerKernel.attend}))
    with pytest.raises(TypeError, match="declares reads = {'mask'}"):
        register_kernel("mask")(type("Mask", (Kernel,), {"reads": frozenset({"mask"}), "attend": EagerKernel.attend}))
    with pytest.raises(TypeError, match="NoAttend defines no attend"):
        register_kernel("no_attend")(type("NoAttend", (Kernel,), {"reads": frozenset({"bias"})}))
    assert register_kernel("again")(type("Again", (EagerKernel,), {})).name == "again"
    assert not {"no_reads", "mask", "no_attend"} & set(registry._KERNELS)


@pytest.mark.parametrize("impl", list_kernels())
@pytest.mark.parametrize("name", RELATIVE)
def test_prepare_builds_only_what_the_kernel_reads(impl, name):
    """A state carries the inputs its kernel reads and none of the others; a kernel that cannot run the scheme says
    so, naming the scheme, when the state is prepared."""
    s = build_pos(name, num_heads=2, head_dim=8, grid=(3, 4))
    kernel = get_kernel(impl)
    why = kernel.refuses(s)
    if why is not None:
        assert name in why and f"attn_impl={impl!r}" in why
        with pytest.raises(ValueError, match=name):
            s.prepare((3, 4), 1, kernel=kernel)
        return
    st = s.prepare((3, 4), 1, kernel=kernel)
    assert st.impl == impl
    for field in INPUTS - kernel.reads:
        assert getattr(st, field) is None, (impl, name, field)


def test_auto_is_sdpa_on_cpu_and_reads_the_device_table(monkeypatch):
    s = build_pos("rel1d_bucket", num_heads=2, head_dim=8, grid=(3, 4))
    assert resolve("auto", s, 12, None).name == "sdpa"
    assert select_kernel(s, 4096, None) == "sdpa"
    assert select_kernel(s, 4096, "NVIDIA H200") == AUTO["H200"][1].kernel == "triton"
    assert select_kernel(s, 1024, "NVIDIA H200") == "sdpa"  # below the measured size
    assert select_kernel(s, 4096, "NVIDIA H200", training=False) == "sdpa"  # (measured forward + backward)
    assert select_kernel(build_pos("rel2d_full", num_heads=2, head_dim=8, grid=(3, 4)), 4096, "NVIDIA H200") == "sdpa"
    factored = build_pos("rel2d_factored", num_heads=2, head_dim=8, grid=(3, 4))  # folded when trained from N = 1024
    assert [select_kernel(factored, n, "NVIDIA H200", True) for n in (196, 1024, 4096)] == ["sdpa", "fold", "fold"]
    assert select_kernel(factored, 4096, "NVIDIA H200", False) == "sdpa"
    monkeypatch.setitem(AUTO, "Test GPU", [AutoRule(frozenset({"rel2d_full"}), 0, "flex")])
    assert select_kernel(build_pos("rel2d_full", num_heads=2, head_dim=8, grid=(3, 4)), 10, "Test GPU 80GB") == "flex"
    # a rule whose kernel cannot run the scheme is passed over, to the scheme's own kernel (Shaw's: "shaw")
    monkeypatch.setitem(AUTO, "Test GPU", [AutoRule(frozenset({"shaw2d_full"}), 0, "flex")])
    assert select_kernel(build_pos("shaw2d_full", num_heads=2, head_dim=8, grid=(3, 4)), 10, "Test GPU") == "shaw"


def test_device_name_is_read_as_compile_folds_it(monkeypatch):
    """``auto`` reads the device's name in every forward: from ``get_device_properties`` (``torch.compile`` folds it
    to a constant), not ``get_device_name`` (a graph break)."""
    from types import SimpleNamespace

    from vitrel.kernels.registry import device_name

    def untraceable(device=None):
        raise AssertionError("get_device_name breaks torch.compile's graph")

    monkeypatch.setattr(torch.cuda, "get_device_name", untraceable)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: SimpleNamespace(name="NVIDIA H100 PCIe"))
    assert device_name(torch.device("cuda")) == "NVIDIA H100 PCIe" and device_name("cpu") is None


def test_auto_passes_over_a_kernel_without_dropout_for_layers_that_drop(monkeypatch):
    """``auto`` does not pick a kernel without attention dropout (``triton``) for a layer that drops attention weights
    in this forward: an ``Attention`` with ``attn_drop > 0`` in training, a ViT any of whose blocks does; in
    evaluation, and without dropout, the rule applies."""
    from vitrel.kernels import registry
    from vitrel.layout.geometry import Grid

    monkeypatch.setattr(registry, "device_name", lambda device: "Test GPU")
    monkeypatch.setitem(AUTO, "Test GPU", [AutoRule(frozenset({"rel2d_full"}), 0, "triton", training=True)])
    assert not get_kernel("triton").takes_dropout
    x = torch.randn(1, 12, 16)
    for drop, want in ((0.0, "triton"), (0.1, "sdpa")):
        a = vitrel.Attention(16, 2, pos="rel2d_full", grid=(3, 4), attn_drop=drop, attn_impl="auto").train()
        assert a._state(x, (3, 4), None).impl == want
        assert a.eval()._state(x, (3, 4), None).impl == "triton"
    for share in (False, True):
        m = vitrel.create_model(
            "vitrel_vit_tiny_patch4_32", pos="rel2d_full", img_size=16, depth=2, attn_drop_rate=0.1, pos_share=share
        )
        assert {st.impl for st in m.train().position_states(Grid(4, 4), x)} == {"sdpa"}
        assert {st.impl for st in m.eval().position_states(Grid(4, 4), x)} == {"triton"}
    swin = vitrel.create_model("vitrel_swin_tiny_patch2_window4_32", pos="rel2d_full", attn_drop_rate=0.1)
    maps = torch.randn(1, 16, 16, swin.layers[0].blocks[0].attn.qkv.in_features)
    stage, block = swin.layers[0], swin.layers[0].blocks[0]
    assert {st.impl for st in swin.train().layers[0].position_states(maps)} == {"sdpa"}
    assert block._state(maps, None, None).impl == "sdpa"
    assert {st.impl for st in swin.eval().layers[0].position_states(maps)} == {"triton"}
    assert stage.blocks[0]._state(maps, None, None).impl == "triton"


@pytest.mark.parametrize("impl", ["triton", "flex"])
def test_a_kernel_that_cannot_run_the_model_is_refused_when_it_is_built(impl):
    """A kernel named (not ``auto``) that cannot run a block's scheme, the model's shared one, its head dim or its
    attention dropout raises when the layer or model is built (``check_choice``), not at its first training step;
    ``auto`` builds and chooses per call."""
    vit = dict(img_size=16, embed_dim=32, depth=2, num_heads=2)
    swin = dict(img_size=16, embed_dim=32, depths=(2,), num_heads=(2,), window_size=4)
    for share in (False, True):
        with pytest.raises(ValueError, match="shaw2d_full has no offset table to read"):
            vitrel.create_model("vitrel_vit_tiny_patch4_32", pos="shaw2d_full", attn_impl=impl, pos_share=share, **vit)
        with pytest.raises(ValueError, match="shaw2d_full has no offset table to read"):
            vitrel.create_model(
                "vitrel_swin_tiny_patch2_window4_32", pos="shaw2d_full", attn_impl=impl, pos_share=share, **swin
            )
    for name, kw in (("vitrel_vit_tiny_patch4_32", vit), ("vitrel_swin_tiny_patch2_window4_32", swin)):
        with pytest.raises(ValueError, match="no attention dropout"):
            vitrel.create_model(name, pos="rel2d_full", attn_impl=impl, attn_drop_rate=0.1, **kw)
        vitrel.create_model(name, pos="rel2d_full", attn_impl="auto", attn_drop_rate=0.1, **kw)
    with pytest.raises(ValueError, match="no attention dropout"):
        vitrel.Attention(32, 2, pos=None, grid=(3, 3), attn_impl=impl, attn_drop=0.1)
    if impl == "triton":
        with pytest.raises(ValueError, match="head dims up to 128, rel2d_full is built for 256"):
            vitrel.create_model(
                "vitrel_vit_tiny_patch4_32", pos="rel2d_full", attn_impl=impl, **{**vit, "embed_dim": 512}
            )
    vitrel.create_model("vitrel_vit_tiny_patch4_32", pos="rel2d_full", attn_impl=impl, **vit)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU")
def test_auto_compiles_as_one_graph_on_cuda():
    """A layer with ``attn_impl="auto"`` compiles with ``fullgraph=True`` on CUDA (the kernel chosen per forward from
    the device's name and the grad mode, no graph break)."""
    a = vitrel.Attention(64, 4, pos="rel2d_full", grid=(4, 4), attn_impl="auto").cuda()
    x = torch.randn(2, 16, 64, device="cuda", requires_grad=True)
    f = torch.compile(lambda t: a(t, grid=(4, 4)), fullgraph=True)
    torch.testing.assert_close(f(x), a(x, grid=(4, 4)))


@pytest.mark.parametrize(
    ("name", "n", "training", "want"),
    [
        ("rel2d_full", 4096, True, "triton"),  # trained faster and in a fifth of the memory (gpu_h100_bias_tiles.md)
        ("rel2d_factored", 4097, True, "triton"),  # retuned: 2.25x plain SDPA against fold's 2.74x (gpu_h100_tables.md)
        ("rel2d_factored", 1024, True, "fold"),  # (1.64x against the float mask's 2.32x and triton's 2.39x)
        ("rel2d_factored", 196, True, "sdpa"),  # (1.57x against fold's 1.61x)
        ("rel2d_factored", 4096, False, "sdpa"),  # (fold's forward alone: not timed)
        ("fire2d", 4096, True, "triton"),
        ("rel2d_full", 4096, False, "sdpa"),  # forward alone: SDPA's float mask was faster
        ("rel2d_full", 1024, True, "triton"),  # (retuned: 1.94x against 2.22x, gpu_h100_retuned.md)
        ("rel2d_full", 196, True, "sdpa"),  # (1.51x against 1.59x)
        ("rel2d_cpb", 1024, True, "triton"),  # (retuned: 2.01x against 2.44x, gpu_h100_tables.md)
        ("fire2d", 1024, True, "triton"),  # (2.04x against 2.52x)
        ("rel2d_bucket", 1024, True, "fold"),  # (1.88x against triton's 2.07x and the float mask's 2.36x)
        ("rel2d_bucket", 4096, True, "triton"),  # (2.38x against fold's 2.90x)
        ("rel2d_cpb", 196, True, "sdpa"),  # (1.77x against 2.04x)
        ("rel1d_bucket", 1024, True, "triton"),  # (2.49x against 4.84x)
        ("alibi2d", 4096, True, "sdpa"),  # no table to train: SDPA was faster at every size
        ("lookhere", 4096, True, "sdpa"),
    ],
)
def test_auto_on_an_h100_trains_learned_tables_with_the_fused_kernel(name, n, training, want):
    """The H100's rules (measured: ``bench/results/gpu_h100_bias_tiles.md``, ``gpu_h100_retuned.md``,
    ``gpu_h100_tables.md``): the fused kernel where a learned table is trained at N = 4096 (from N = 1024 the full
    2-D table, T5's 1-D buckets, CPB and FIRE), the factored table and the 2-D buckets folded into q and k from
    N = 1024 below that, SDPA in
    evaluation (no gradient: the state is prepared under ``torch.no_grad``), for fixed biases and at N = 196."""
    s = build_pos(name, num_heads=2, head_dim=8, grid=(3, 4))
    assert select_kernel(s, n, "NVIDIA H100 80GB HBM3", training) == want
    with torch.set_grad_enabled(training):  # (the default: the grad mode the state is prepared in)
        assert select_kernel(s, n, "NVIDIA H100 80GB HBM3") == want


def test_layout_refused_by_a_kernel_that_does_not_take_it(monkeypatch):
    from vitrel.kernels import registry
    from vitrel.kernels.sdpa import SdpaKernel

    class FullGridOnly(SdpaKernel):
        name = "full_grid_only"
        takes_layout = False

    monkeypatch.setitem(registry._KERNELS, "full_grid_only", FullGridOnly)
    m = vitrel.create_model(
        "vitrel_vit_tiny_patch4_32", pos="rel2d_full", attn_impl="full_grid_only", img_size=16, depth=1
    )
    with pytest.raises(ValueError, match="does not take packed"):
        m([torch.randn(3, 16, 16), torch.randn(3, 8, 16)])


def test_onnx_export_refuses_exactly_the_kernels_that_declare_no_onnx():
    """``--onnx`` is refused by what a kernel declares (``Kernel.onnx``), for every registered kernel: ``flex``
    declared ``onnx = True`` and was refused by its name in vitrel/export.py, so ``get_kernel("flex").onnx`` was
    wrong and the declaration was read for every kernel but the one that needed it."""
    from torch import nn

    from vitrel.export import check_exportable

    for name in list_kernels():
        m = nn.Module()
        m.attn_impl = name
        if get_kernel(name).onnx:
            check_exportable(m, "static", onnx=True)
        else:
            with pytest.raises(ValueError, match=f"attn_impl={name!r} runs a kernel that ONNX has no operator for"):
                check_exportable(m, "static", onnx=True)


# ---- attn_impl: sdpa (bias as a float mask), fold (a factored bias folded into q and k), eager.
GRIDS = [(4, 5), (6, 3)]  # the built grid, then another one (tables clamp at their edge)


def _runs_factored(impl: str) -> bool:
    """The kernel ``impl`` takes rel2d_factored (not Shaw's own kernel, for one)."""
    return get_kernel(impl).refuses(build_pos("rel2d_factored", num_heads=2, head_dim=8, grid=(3, 4))) is None


def factored_reference(attn: Attention, h: int, w: int, prefix: int):
    """``b^(h)[clamp(ri - rj)] + b^(w)[clamp(ci - cj)]`` per head, from the tables, with loops."""
    th, tw = attn.pos.table_h, attn.pos.table_w
    hh, hw = (th.shape[0] - 1) // 2, (tw.shape[0] - 1) // 2

    def fn(hd, pi, pj):
        dh = max(-hh, min(hh, pi[0] - pj[0]))
        dw = max(-hw, min(hw, pi[1] - pj[1]))
        return th[dh + hh, hd] + tw[dw + hw, hd]

    return dense_bias(fn, attn.num_heads, h, w, prefix)


def bucket_reference(attn: Attention, h: int, w: int, prefix: int):
    """T5's bidirectional bucket of ``-dh`` (``-dw``) per axis into that axis' table."""
    p = attn.pos
    nb, md = p.num_buckets, p.max_distance

    def fn(hd, pi, pj):
        bh = t5_bucket_scalar(pj[0] - pi[0], nb, md)
        bw = t5_bucket_scalar(pj[1] - pi[1], nb, md)
        return p.table_h[bh, hd] + p.table_w[bw, hd]

    return dense_bias(fn, attn.num_heads, h, w, prefix)


@pytest.mark.parametrize(
    "pos,reference,opts",
    [("rel2d_factored", factored_reference, {}), ("rel2d_bucket", bucket_reference, {"max_distance": 8})],
)
@pytest.mark.parametrize("prefix", [0, 1])
def test_fold_equals_the_equation(pos, reference, opts, prefix):
    torch.manual_seed(0)
    attn = Attention(24, 3, pos=pos, grid=GRIDS[0], num_prefix_tokens=prefix, attn_impl="fold", **opts).double()
    for table in (attn.pos.table_h, attn.pos.table_w):
        torch.nn.init.normal_(table, std=0.5)  # large enough to matter
    for h, w in GRIDS:
        n = prefix + h * w
        x = torch.randn(2, n, 24, dtype=torch.float64, requires_grad=True)
        mask = torch.zeros(2, 1, n, n, dtype=torch.float64)
        mask[1, :, : n // 2, n // 2 :] = float("-inf")  # a window-style mask still applies
        out = attn(x, (h, w), mask)
        _, ref = reference_attention(attn, x, reference(attn, h, w, prefix), mask)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
        g = torch.randn_like(out)
        params = [x, attn.pos.table_h, attn.pos.table_w, attn.qkv.weight]
        grads = torch.autograd.grad(out, params, g)
        ref_grads = torch.autograd.grad(ref, params, g)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
        # the logits for inspection multiply the factors out
        logits = attn.logits(x, (h, w), mask)
        ref_logits, _ = reference_attention(attn, x, reference(attn, h, w, prefix), mask)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-10, atol=1e-10)


def test_factors_multiply_to_the_bias_and_pad_for_fused_kernels():
    s = vitrel.build_pos("rel2d_factored", num_heads=2, head_dim=16, grid=(5, 7), num_prefix_tokens=1).double()
    u, w = s.bias_factors(s.grid, 1)
    assert u.shape == w.shape == (2, 36, 16)  # rank 5 + 7 = 12, padded so 16 + 16 is a multiple of 8
    torch.testing.assert_close(u @ w.transpose(-2, -1), s.bias(s.grid, 1), rtol=0, atol=0)
    assert (w[:, 1:, :12].sum(-1) == 2).all() and (w[:, 0] == 0).all()  # one-hot row and column; prefix zero


ARCHS = {
    "vit": ("vitrel_vit_tiny_patch4_32", dict(embed_dim=32, depth=2, num_heads=2)),
    "swin": (
        "vitrel_swin_tiny_patch2_window4_32",
        dict(patch_size=4, window_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 2], drop_path_rate=0.0),
    ),
}


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("pos_share", [False, True])
def test_models_give_the_same_function_with_every_impl(arch, pos_share):
    name, kw = ARCHS[arch]
    torch.manual_seed(0)
    ref = vitrel.create_model(name, pos="rel2d_factored", pos_share=pos_share, **kw).double().eval()
    x = torch.randn(2, 3, 40, 40, dtype=torch.float64)  # not the built size: the tables clamp
    out_ref = ref(x)
    grad_ref = torch.autograd.grad(out_ref.square().sum(), [p for n, p in ref.named_parameters() if "table" in n])
    # flex: no backward on CPU (tests/kernels/test_flex.py); triton, triton_atomic: float32 through the interpreter
    # (tests/kernels/test_triton_bias.py, tests/kernels/test_triton_atomic.py)
    for impl in [i for i in attn_impls() if i not in ("flex", "triton", "triton_atomic") and _runs_factored(i)]:
        m = vitrel.create_model(name, pos="rel2d_factored", pos_share=pos_share, attn_impl=impl, **kw).double()
        m.load_state_dict(ref.state_dict())
        m.eval()
        assert m.vitrel_cfg["attn_impl"] == impl
        out = m(x)
        torch.testing.assert_close(out, out_ref, rtol=1e-10, atol=1e-12)
        grads = torch.autograd.grad(out.square().sum(), [p for n, p in m.named_parameters() if "table" in n])
        for a, b in zip(grads, grad_ref):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_fold_exports():
    torch.manual_seed(0)
    m = vitrel.create_model("vitrel_vit_tiny_patch4_32", pos="rel2d_factored", attn_impl="fold", embed_dim=32, depth=1,
                            num_heads=2).eval()  # fmt: skip
    x = torch.randn(2, 3, 32, 32)
    ep = torch.export.export(m, (x,))
    torch.testing.assert_close(ep.module()(x), m(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["sdpa", "eager", "fold"])
def test_a_boolean_mask_of_any_rank_keeps_the_pairs_it_marks(impl):
    """A boolean mask is True where a pair attends (SDPA's rule) whatever its rank: a window mask ``[nW, N, N]`` and
    ``[B, 1, N, N]`` each equal their additive float masks (0 / -inf), and mask something."""
    n, grid = 12, (3, 4)
    keep = torch.rand(2, n, n, generator=torch.Generator().manual_seed(3)) > 0.3
    keep |= torch.eye(n, dtype=torch.bool)
    as_float = torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    x = torch.randn(4, n, 32, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    a = Attention(32, 2, pos="rel2d_factored", grid=grid, attn_impl=impl).eval()
    with torch.no_grad():
        torch.testing.assert_close(a(x, grid, mask=keep), a(x, grid, mask=as_float))
        torch.testing.assert_close(a(x[:2], grid, mask=keep[:, None]), a(x[:2], grid, mask=as_float[:, None]))
        assert not torch.allclose(a(x, grid, mask=keep), a(x, grid), atol=1e-3)


def test_bad_impl_choices_are_clear_errors():
    with pytest.raises(ValueError, match="attn_impl must be one of"):
        Attention(16, 2, pos="rel2d_factored", grid=(3, 3), attn_impl="flash")
    with pytest.raises(ValueError, match="rope2d_mixed has no such bias.*attn_impl='sdpa'"):  # (when built)
        Attention(16, 2, pos="rope2d_mixed", grid=(3, 3), attn_impl="fold")
    attn = Attention(16, 2, pos="rope2d_mixed", grid=(3, 3))
    with pytest.raises(ValueError, match="rope2d_mixed has no such bias.*attn_impl='sdpa'"):
        attn.attn_impl = "fold"  # (set on a built layer: checked at the assignment)
    shared = Attention(16, 2, pos="shared")
    shared.attn_impl = "fold"  # (a layer without a scheme of its own: the forward's own check)
    with pytest.raises(ValueError, match="rope2d_mixed has no such bias.*attn_impl='sdpa'"):
        shared(torch.randn(1, 9, 16), pos_state=attn.pos.prepare((3, 3), 0))
    with pytest.raises(ValueError, match="attn_impl must be one of"):
        vitrel.create_model("vitrel_vit_tiny_patch4_32", pos="rel2d_full", attn_impl="Fold")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU")
def test_every_impl_agrees_on_cuda():
    """On a GPU in bf16 autocast: every kernel gives the sdpa model's logits and table gradients (bf16 tolerance)."""
    torch.manual_seed(0)
    kw = dict(img_size=32, embed_dim=64, depth=2, num_heads=2, num_classes=5)
    ref = vitrel.create_model("vitrel_vit_tiny_patch4_32", pos="rel2d_factored", **kw).cuda()
    x = torch.randn(4, 3, 32, 32, device="cuda")

    def run(m):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = m(x).float()
        tables = [p for n, p in m.named_parameters() if "table" in n]
        return y, torch.autograd.grad(y.square().sum(), tables)

    y_ref, g_ref = run(ref)
    for impl in [i for i in attn_impls() if i not in ("auto", "sdpa") and _runs_factored(i)]:
        m = vitrel.create_model("vitrel_vit_tiny_patch4_32", pos="rel2d_factored", attn_impl=impl, **kw).cuda()
        m.load_state_dict(ref.state_dict())
        y, g = run(m)
        torch.testing.assert_close(y, y_ref, atol=5e-2, rtol=5e-2, msg=impl)
        for a, b in zip(g, g_ref):
            scale = b.abs().max()
            torch.testing.assert_close(a / scale, b / scale, atol=5e-2, rtol=5e-2, msg=impl)


def _spy_kernels(monkeypatch) -> list[str]:
    """The names of the kernels that attend, in call order, for every forward after this call."""
    calls: list[str] = []
    for name in ("sdpa", "eager", "fold"):
        kernel = get_kernel(name)
        attend = kernel.attend

        def spy(cls, *args, _attend=attend, **kw):
            calls.append(cls.name)
            return _attend(*args, **kw)

        monkeypatch.setattr(kernel, "attend", classmethod(spy))
    return calls


def _layers(m) -> list[Attention]:
    """The attention layers of a ViT or a Swin, in forward order."""
    blocks = m.blocks if hasattr(m, "blocks") else [b for stage in m.layers for b in stage.blocks]
    return [b.attn for b in blocks]


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("pos_share", [False, True])
@pytest.mark.parametrize("impl", ["eager", "fold"])
def test_attn_impl_set_on_one_built_layer_is_what_that_layer_runs(monkeypatch, arch, pos_share, impl):
    """``m.<block>.attn.attn_impl = impl`` on a built model: that layer (and only it) runs ``impl``, the model's
    function unchanged, whether the block owns its scheme (the model prepares its state for that kernel) or shares
    the model's (the layer binds the shared state to its kernel)."""
    name, kw = ARCHS[arch]
    torch.manual_seed(0)
    m = vitrel.create_model(name, pos="rel2d_factored", pos_share=pos_share, attn_impl="sdpa", **kw).double().eval()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        ref = m(x)
    layers = _layers(m)
    layers[1].attn_impl = impl
    calls = _spy_kernels(monkeypatch)
    with torch.no_grad():
        out = m(x)
    assert calls == ["sdpa", impl] + ["sdpa"] * (len(layers) - 2), calls
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    # the model's (a Swin stage's) attn_impl sets every layer's
    owner = m if hasattr(m, "blocks") else m.layers[0]
    owner.attn_impl = impl
    assert {a.attn_impl for a in _layers(owner)} == {impl}
    calls.clear()
    with torch.no_grad():
        torch.testing.assert_close(m(x), ref, rtol=1e-10, atol=1e-12)
    assert calls[: len(_layers(owner))] == [impl] * len(_layers(owner)), calls


@pytest.mark.parametrize("arch", list(ARCHS))
def test_attn_impl_set_on_a_built_layer_is_checked_at_the_assignment(arch):
    name, kw = ARCHS[arch]
    m = vitrel.create_model(name, pos="rel2d_full", **kw)
    attn = _layers(m)[0]
    for bad in ("flsh", "Eager", ""):
        with pytest.raises(ValueError, match=f"attn_impl must be one of .*got {bad!r}") as err:
            attn.attn_impl = bad
        assert all(f"'{k}'" in str(err.value) for k in list_kernels()), err.value  # names every valid kernel
    with pytest.raises(ValueError, match="attn_impl='fold' folds a bias that factors.*rel2d_full"):
        attn.attn_impl = "fold"  # a kernel that cannot run the layer's scheme
    owner = m if hasattr(m, "blocks") else m.layers[0]
    with pytest.raises(ValueError, match="attn_impl must be one of"):
        owner.attn_impl = "flsh"
    with pytest.raises(ValueError, match="rel2d_full"):
        owner.attn_impl = "fold"
    assert attn.attn_impl == owner.attn_impl == "auto"  # nothing changed by a refused assignment
    assert {a.attn_impl for a in _layers(m)} == {"auto"}


SWINS = {
    "swin": ARCHS["swin"],
    "swin3d": ("vitrel_swin3d_tiny_patch122_window444_32", dict(embed_dim=16, depths=[2, 2], num_heads=[2, 2])),
}


@pytest.mark.parametrize("arch", list(SWINS))
def test_attn_impl_set_on_a_swin_model_is_what_every_layer_runs(monkeypatch, arch):
    """``swin.attn_impl = impl`` sets every stage's and layer's, as on the ViT (it was a plain attribute nothing
    read: the model kept running ``auto``), and a kernel one layer cannot run changes none."""
    name, kw = SWINS[arch]
    pos = "rel3d_factored" if arch == "swin3d" else "rel2d_factored"
    torch.manual_seed(0)
    m = vitrel.create_model(name, pos=pos, **{"drop_path_rate": 0.0, **kw}).double().eval()
    x = torch.randn(1, 1, 4, 32, 32) if arch == "swin3d" else torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        ref = m(x.double())
    assert m.attn_impl == "auto"
    m.attn_impl = "eager"
    assert m.attn_impl == "eager" and {a.attn_impl for a in _layers(m)} == {"eager"}
    calls = _spy_kernels(monkeypatch)
    with torch.no_grad():
        torch.testing.assert_close(m(x.double()), ref, rtol=1e-10, atol=1e-12)
    assert set(calls) == {"eager"} and len(calls) == len(_layers(m)), calls
    m.layers[1].blocks[0].attn.pos = build_pos("rel2d_full" if arch == "swin" else "rel3d_full", num_heads=2,
                                               head_dim=16, grid=m.layers[1].blocks[0].attn.pos.grid)  # fmt: skip
    with pytest.raises(ValueError, match="attn_impl='fold' folds a bias that factors"):
        m.attn_impl = "fold"  # the last stage has a layer fold cannot run: nothing changes
    assert m.attn_impl == "eager" and {a.attn_impl for a in _layers(m)} == {"eager"}


@pytest.mark.parametrize("name", ["vitrel_vit_tiny_patch4_32", "vitrel_swin_tiny_patch2_window4_32"])
def test_attn_impl_set_after_building_is_what_a_saved_model_loads_with(tmp_path, name):
    """``model.attn_impl = "eager"`` changed every layer but not the configuration checkpoints store, so the saved
    model loaded back as ``auto`` (an audit's); the kernel set is recorded, and a refused one records nothing."""
    from vitrel.models.checkpoint import save_pretrained

    m = vitrel.create_model(name, pos="rel2d_full", num_classes=3)
    m.attn_impl = "eager"
    assert m.vitrel_cfg["attn_impl"] == "eager"
    save_pretrained(m, tmp_path / "m")
    assert vitrel.load_model(tmp_path / "m").attn_impl == "eager"
    with pytest.raises(ValueError):
        m.attn_impl = "no_such_kernel"
    assert m.vitrel_cfg["attn_impl"] == "eager"
