"""The kernel registry (vitrel/kernels/): every kernel declared, states that carry only what their kernel reads,
refusals named before any work, and ``auto`` read from the per-device table."""

from __future__ import annotations

import pytest
import torch

import vitrel
from vitrel.kernels import AUTO, AutoRule, attn_impls, get_kernel, list_kernels, resolve
from vitrel.kernels.registry import Kernel, register_kernel, select_kernel
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


@pytest.mark.parametrize("impl", ["sdpa", "eager", "fold", "flex", "triton", "shaw"])
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
        with pytest.raises(ValueError, match="has no such table"):
            vitrel.create_model("vitrel_vit_tiny_patch4_32", pos="shaw2d_full", attn_impl=impl, pos_share=share, **vit)
        with pytest.raises(ValueError, match="has no such table"):
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
