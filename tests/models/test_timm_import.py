"""timm weights into vitrel models (``vitrel.from_timm``) and timm's ``checkpoint_path`` convention.

Offline: the timm models are built here with random weights (perturbed, so a wrong mapping shows) and
saved in timm's on-disk formats."""

from __future__ import annotations

import logging
import warnings

import pytest
import timm
import torch
from safetensors.torch import save_file
from timm.models import adapt_input_conv, save_for_hf

import vitrel
from tests.weights import lively
from vitrel import CheckpointError
from vitrel.models.timm_import import UnsupportedTimmModel, load_timm_file, transfer_timm_weights

SMALL_VIT = dict(img_size=64, depth=2, embed_dim=64, num_heads=2, num_classes=5)
SOURCES = {
    "vit_small_patch16_224": (SMALL_VIT, "none", "ape"),
    "vit_base_patch16_clip_224": (SMALL_VIT, "none", "ape"),  # CLIP: a pre-norm, no patch-embedding bias
    "vit_base_patch16_clip_quickgelu_224": (SMALL_VIT, "none", "ape"),  # OpenAI CLIP's QuickGELU
    "vit_base_patch32_siglip_gap_256": ({**SMALL_VIT, "patch_size": 16}, "none", "ape"),  # GELU, tanh form
    "vit_base_patch16_siglip_256": (SMALL_VIT, "none", "ape"),  # SigLIP's attention pool ("map")
    "vit_base_patch16_radio_v3": (SMALL_VIT, "none", "ape"),  # C-RADIO: 7 registers, no final norm (final_norm=False)
    "deit_tiny_patch16_224": (dict(img_size=64, depth=2, num_classes=5), "none", "ape"),
    "vit_relpos_small_patch16_224": ({**SMALL_VIT, "rel_pos_type": "bias"}, "rel2d_full", None),
    # timm's relpos ViTs' own bias (RelPosMlp, mode cr): rel2d_cpb's mode cr; a class token; one shared by the blocks
    "vit_relpos_medium_patch16_cls_224": (SMALL_VIT, "rel2d_cpb", None),
    "vit_srelpos_small_patch16_224": (SMALL_VIT, "rel2d_cpb", None),
    "swin_tiny_patch4_window7_224": (
        dict(img_size=64, embed_dim=16, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4), window_size=4, num_classes=7),
        "rel2d_full",
        None,
    ),
    "vit_small_patch16_rope_mixed_224": (SMALL_VIT, "rope2d_mixed", None),
    "vit_small_patch16_rope_224": (SMALL_VIT, "rope2d_axial", None),
    "vit_small_patch16_dinov3": ({**SMALL_VIT, "global_pool": "token"}, "rope2d_axial", None),
    "vit_small_patch16_dinov3_qkvb": (SMALL_VIT, "rope2d_axial", None),  # avg pooling, EVA's q / v biases
    "vit_small_plus_patch16_dinov3": (SMALL_VIT, "rope2d_axial", None),  # SwiGLU MLPs (mlp_layer="swiglu")
    # timm's own RoPE ViT: EVA's positions i * ref / feat (ref_feat_shape 16 x 16, the grid here 4 x 4)
    "vit_base_patch16_rope_reg1_gap_256": (SMALL_VIT, "rope2d_axial", None),
    # EVA-02 (reference grid too, and an absolute embedding): tiny's packed SwiGLU with its gate first, base's
    # separate q / k / v projections and SwiGLU with a LayerNorm inside (mlp_norm)
    "eva02_tiny_patch14_224": ({**SMALL_VIT, "patch_size": 16}, "rope2d_axial", "ape"),
    "eva02_base_patch14_448": ({**SMALL_VIT, "patch_size": 16}, "rope2d_axial", "ape"),
    "eva_giant_patch14_224": ({**SMALL_VIT, "patch_size": 16}, "none", "ape"),  # EVA-01: the embedding alone
    "eva02_enormous_patch14_clip_224": ({**SMALL_VIT, "patch_size": 16}, "none", "ape"),  # post-norm EVA blocks
    # a LayerNorm of the attention's output (attn_norm): EVA-02's CLIP tower, BEiT-3
    "eva02_base_patch16_clip_224": (SMALL_VIT, "rope2d_axial", "ape"),
    "beit3_base_patch16_224": (SMALL_VIT, "none", "ape"),
    # the Perception Encoder's spatial and language towers: RoPE with the class token before the grid (grid_offset),
    # no final norm (final_norm=False); the language tower with layer scale
    "vit_pe_spatial_small_patch16_512": (SMALL_VIT, "rope2d_axial", "ape"),
    "vit_pe_lang_large_patch14_448": ({**SMALL_VIT, "patch_size": 16}, "rope2d_axial", "ape"),
    # ... and its CLIP tower: an attention pool of 8 heads over every token, class token included
    "vit_pe_core_small_patch16_384": (SMALL_VIT, "rope2d_axial", "ape"),
    # ... its ViT-G: no class token, the pool's MLP ratio 4 under blocks of another (attn_pool_mlp_ratio)
    "vit_pe_core_gigantic_patch14_448": ({**SMALL_VIT, "patch_size": 16, "mlp_ratio": 5.8125}, "rope2d_axial", "ape"),
    # BEiT: a table and class-token terms in every block, layer scale, q / v biases, mean pooling under fc_norm; the
    # second as BEiT's pre-training: one table shared by all blocks (tests/models/test_beit_import.py)
    "beit_base_patch16_224": ({**SMALL_VIT, "init_values": 0.1}, "rel2d_beit", None),
    "beitv2_base_patch16_224": (
        {**SMALL_VIT, "use_shared_rel_pos_bias": True, "use_rel_pos_bias": False},
        "rel2d_beit",
        None,
    ),
    # GPSA in 2 of 3 blocks, the class token after them (tests/models/test_convit_import.py); width 16 per head
    "convit_tiny": (
        dict(img_size=64, embed_dim=16, num_heads=4, depth=3, local_up_to_layer=2, num_classes=5),
        "gpsa",
        "ape",
    ),  # fmt: skip
}


def _timm(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    t = timm.create_model(name, **SOURCES[name][0]).double().eval()
    with torch.no_grad():
        for _, p in t.named_parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return t


def _x(seed: int = 1) -> torch.Tensor:
    return torch.randn(2, 3, 64, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(SOURCES))
def test_same_function(name):
    t = _timm(name)
    m = vitrel.from_timm(t)
    _, pos, abs_pos = SOURCES[name]
    assert m.vitrel_cfg["pos"] == pos or m.vitrel_cfg["pos"]["name"] == pos
    if "dinov3" in name:
        assert m.vitrel_cfg["pos"]["coords"] == "normalized" and m.vitrel_cfg["reg_tokens"] == 4
    assert m.vitrel_cfg["abs_pos"] == abs_pos
    assert not m.training and next(m.parameters()).dtype == torch.float64
    with torch.no_grad():
        torch.testing.assert_close(m(_x()), t(_x()), rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize(
    "name",
    [
        "vit_base_patch16_rope_reg1_gap_256",
        "eva02_tiny_patch14_224",
        "eva02_base_patch14_448",
        "vit_pe_spatial_small_patch16_512",
    ],
)
def test_timms_rope_vits_with_a_reference_grid_are_equal_at_every_size(name):
    """timm's ``vit_*_rope_reg*_gap_256``, EVA-02 and the Perception Encoder place RoPE positions at ``i * ref / feat``
    (``ref_feat_shape``, EVA's rule): ``rope2d_axial`` with ``scaling: {rope_type: linear, factor: grid}`` and the
    reference grid carried as each scheme's ``ref_grid`` equal them at the built size, larger and smaller (timm's
    ``dynamic_img_size``; the absolute embeddings resampled as timm's); plain RoPE does not. The Perception Encoder's
    ``i + 1`` (its class token at 0, ``grid_offset``) matters too."""
    torch.manual_seed(0)
    t = lively(timm.create_model(name, **SOURCES[name][0], dynamic_img_size=True))
    t = t.double().eval()
    m = vitrel.from_timm(t)
    assert m.vitrel_cfg["pos"]["scaling"] == {"rope_type": "linear", "factor": "grid"}
    assert tuple(m.blocks[1].attn.pos.ref) == tuple(t.rope.ref_feat_shape)
    with torch.no_grad():
        for side in (64, 96, 32):
            x = torch.randn(2, 3, side, side, dtype=torch.float64)
            torch.testing.assert_close(m(x), t(x), rtol=1e-7, atol=1e-7)
        assert (vitrel.from_timm(t, pos="rope2d_axial")(x) - t(x)).abs().max() > 1e-3
        if t.rope.grid_offset:
            assert m.vitrel_cfg["pos"]["grid_offset"] == 1.0
            at_zero = {**m.vitrel_cfg["pos"], "grid_offset": 0.0}
            assert (vitrel.from_timm(t, pos=at_zero)(x) - t(x)).abs().max() > 1e-3


def test_dinov3_same_function_at_another_size_and_the_channel_order_matters():
    """DINOv3's normalised coordinates interpolate: equal at 96 px too (timm's dynamic size). Its RoPE
    lays channels out rotate-half (rows first, as vitrel): without the q/k channel permutation the function
    differs."""
    from vitrel.models import timm_import

    t = _timm("vit_small_patch16_dinov3")
    m = vitrel.from_timm(t)
    x = torch.randn(2, 3, 96, 96, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(m(x), t(x), rtol=1e-8, atol=1e-8)
    d = t.blocks[0].attn.head_dim
    half = torch.arange(d // 2)
    # DINOv3 is rows first, as vitrel: only rotate-half's pairs (t, t + d/2) become vitrel's (2t, 2t + 1)
    assert torch.equal(timm_import.rope_channel_order(t), torch.stack((half, half + d // 2), dim=-1).flatten())
    # timm's RoPE-ViT port (grid_indexing "xy": columns first, interleaved pairs): the two halves swapped
    axial = _timm("vit_small_patch16_rope_224")
    d = axial.blocks[0].attn.head_dim
    order = timm_import.rope_channel_order(axial)
    assert torch.equal(order, torch.cat((torch.arange(d // 2, d), torch.arange(d // 2))))
    orig = timm_import.rope_channel_order
    try:
        timm_import.rope_channel_order = lambda _t: None
        wrong = vitrel.from_timm(t)
    finally:
        timm_import.rope_channel_order = orig
    with torch.no_grad():
        assert (wrong(x) - t(x)).abs().max() > 1e-3


@pytest.mark.parametrize("fmt", ["safetensors", "pth", "bin", "hf_folder"])
@pytest.mark.parametrize(
    "name",
    ["vit_small_patch16_224", "swin_tiny_patch4_window7_224", "vit_small_patch16_rope_mixed_224", "convit_tiny"]
    + ["beit_base_patch16_224"],
)
def test_from_local_files_in_timm_formats(tmp_path, name, fmt):
    t = _timm(name).float()
    if fmt == "safetensors":
        path = tmp_path / "w.safetensors"
        save_file({k: v.contiguous() for k, v in t.state_dict().items()}, str(path))
    elif fmt in ("pth", "bin"):
        path = tmp_path / f"w.{fmt}"
        torch.save(t.state_dict(), path)
    else:
        path = tmp_path / "export"
        save_for_hf(t, str(path), safe_serialization=True)
    kw = {} if fmt == "hf_folder" else SOURCES[name][0]  # the folder's config.json holds the model args
    m = vitrel.from_timm(name, checkpoint_path=path, timm_kwargs=kw).eval()
    x = _x().float()
    with torch.no_grad():
        torch.testing.assert_close(m(x), t(x), rtol=1e-4, atol=1e-5)


def test_vit_to_any_scheme_carries_every_non_position_tensor(caplog):
    t = _timm("vit_small_patch16_224")
    with caplog.at_level(logging.INFO, logger="vitrel.models.timm_import"):
        m = vitrel.from_timm(t, pos="rel2d_factored")
    assert "dropped" in caplog.text and "pos_embed" in caplog.text
    ours, theirs = m.state_dict(), t.state_dict()
    carried = [k for k in ours if not k.startswith("blocks.") or ".attn.pos." not in k]
    for k in carried:
        torch.testing.assert_close(ours[k], theirs[k], rtol=0, atol=0, msg=k)
    assert all(f"blocks.{i}.attn.pos.table_h" in ours for i in range(2))
    rep = transfer_timm_weights(t, vitrel.from_timm(t, pos="rope2d_mixed"))
    assert "pos_embed" in rep.dropped and any(k.endswith("attn.pos.freqs") for k in rep.initialised)
    assert set(rep.carried) | set(rep.converted) | set(rep.initialised) == set(
        vitrel.from_timm(t, pos="rope2d_mixed").state_dict()
    )


def test_keep_the_absolute_embedding_with_a_relative_scheme():
    t = _timm("vit_small_patch16_224")
    m = vitrel.from_timm(t, pos="rel2d_full", abs_pos="ape")
    with torch.no_grad():
        for p in (blk.attn.pos.table for blk in m.blocks):
            p.zero_()  # a zero relative bias: the same function as the source
        torch.testing.assert_close(m(_x()), t(_x()))


def test_new_head_size_and_channels():
    t = _timm("swin_tiny_patch4_window7_224")
    m = vitrel.from_timm(t, num_classes=3, img_size=96, in_chans=1)
    assert m.num_classes == 3 and m(torch.randn(1, 1, 96, 96, dtype=torch.float64)).shape == (1, 3)
    w = adapt_input_conv(1, t.state_dict()["patch_embed.proj.weight"])
    torch.testing.assert_close(m.state_dict()["patch_embed.proj.weight"], w)
    torch.testing.assert_close(m.layers[2].blocks[0].mlp.fc1.weight, t.layers[2].blocks[0].mlp.fc1.weight)


PADDING_VITS = ["vit_small_patch16_224", "vit_small_patch16_rope_mixed_224", "vit_small_patch16_dinov3"]


@pytest.mark.parametrize("name", PADDING_VITS)
def test_a_vit_that_pads_images_imports_as_timms_function_at_sizes_off_the_patch(name):
    """timm's ViT with ``dynamic_img_pad=True`` pads an image of no whole patches; imported, vitrel's refused it (the
    argument was not carried). Now it pads as timm's: the same logits and ``forward_intermediates`` maps (of the
    padded grid) on 57 x 70 images. A timm ViT of non-square patches is refused by name, not run with one side."""
    torch.manual_seed(0)
    t = timm.create_model(name, **SOURCES[name][0], dynamic_img_size=True, dynamic_img_pad=True).double().eval()
    with torch.no_grad():
        for p in t.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    m = vitrel.from_timm(t)
    assert m.vitrel_cfg["dynamic_img_pad"]
    x = torch.randn(2, 3, 57, 70, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(m(x), t(x), rtol=1e-8, atol=1e-8)
        got, want = (n.forward_intermediates(x, indices=[0, 1], intermediates_only=True) for n in (m, t))
        assert [g.shape for g in got] == [w.shape for w in want] == [(2, 64, 4, 5)] * 2
        for g, w in zip(got, want):  # (unnormalised block outputs: float64 rounding of a larger scale)
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
    with pytest.raises(UnsupportedTimmModel, match="non-square patches 16x8"):
        vitrel.from_timm(timm.create_model("vit_small_patch16_224", img_size=32, depth=1, patch_size=(16, 8)))


def test_unsupported_sources_are_clear_errors(tmp_path):
    with pytest.raises(UnsupportedTimmModel, match="takes timm VisionTransformer"):
        vitrel.from_timm(timm.create_model("resnet18"))
    rms = timm.create_model("vit_small_patch16_224", img_size=32, depth=1, qk_norm=True)  # (the blocks' kind reads)
    rms.blocks[0].attn.q_norm = timm.layers.RmsNorm(rms.blocks[0].attn.head_dim)
    with pytest.raises(UnsupportedTimmModel, match="q/k norms other than the blocks'"):
        vitrel.from_timm(rms)
    with pytest.raises(UnsupportedTimmModel, match=r"a CNN stem before the patch embedding \(HybridEmbed"):
        vitrel.from_timm(timm.create_model("vit_small_r26_s32_224", img_size=64, depth=1))  # (crashed on its .norm)
    swin_mlp = dict(img_size=32, depth=1, rel_pos_type="mlp_swin")  # (timm's RelPosMlp in its swin mode: no scheme)
    with pytest.raises(UnsupportedTimmModel, match="give pos="):
        vitrel.from_timm(timm.create_model("vit_relpos_small_patch16_224", **swin_mlp))
    m = vitrel.from_timm(timm.create_model("vit_relpos_small_patch16_224", **swin_mlp), pos="rel2d_cpb")
    assert m.vitrel_cfg["pos"] == "rel2d_cpb"
    torch.save(_timm("vit_small_patch16_224").state_dict(), tmp_path / "vit.pth")
    with pytest.raises(CheckpointError, match="holds the weights of another architecture than timm's swin"):
        load_timm_file(
            "swin_tiny_patch4_window7_224", tmp_path / "vit.pth", **SOURCES["swin_tiny_patch4_window7_224"][0]
        )


@pytest.mark.parametrize("name", ["vit_small_patch16_224", "vit_small_patch16_dinov3", "swin_tiny_patch4_window7_224"])
def test_the_source_preprocessing_is_the_model_data_config(name):
    """The model took the vitrel architecture's ``pretrained_cfg``, so ``timm.data.resolve_data_config(model=m)``
    normalised a ``vit_*_224`` (augreg: mean = std = 0.5) with ImageNet's statistics, and a DINOv3 (256 px, crop 1.0)
    at 224 px with crop 0.9. The source's preprocessing is now the model's, at the model's input size."""
    t = timm.create_model(name, **SOURCES[name][0])
    want = timm.data.resolve_data_config(model=t)
    for kw in ({}, {"pos": "rel2d_factored", "num_classes": 3}):
        got = timm.data.resolve_data_config(model=vitrel.from_timm(t, **kw))
        assert {k: v for k, v in got.items() if k != "input_size"} == {
            k: v for k, v in want.items() if k != "input_size"
        }
        assert got["input_size"] == (3, 64, 64)  # the model's (timm keeps its 224 for a model built at 64 px)


def test_an_instance_with_a_checkpoint_path_is_an_error(tmp_path):
    """``from_timm(instance, checkpoint_path=f)`` returned the instance's own weights and ignored ``f``."""
    path = tmp_path / "vit.safetensors"
    save_file(_timm("vit_small_patch16_224").float().state_dict(), path)
    t = timm.create_model("vit_small_patch16_224", **SOURCES["vit_small_patch16_224"][0])
    with pytest.raises(ValueError, match="timm model instance.*checkpoint_path.*name"):
        vitrel.from_timm(t, checkpoint_path=path)


def test_a_file_of_another_variant_is_a_checkpoint_error(tmp_path):
    """A file of another variant of the architecture (here without a class token) failed inside timm's checkpoint
    filter with a bare ``RuntimeError: shape '[1, 4, 4, -1]' is invalid``."""
    path = tmp_path / "vit.safetensors"
    kw = {**SOURCES["vit_small_patch16_224"][0], "class_token": False, "global_pool": "avg"}
    torch.manual_seed(0)
    save_file(timm.create_model("vit_small_patch16_224", **kw).state_dict(), path)
    with pytest.raises(CheckpointError, match="does not fit timm's vit_small_patch16_224.*timm_kwargs"):
        load_timm_file("vit_small_patch16_224", path, **SOURCES["vit_small_patch16_224"][0])


def test_a_reset_head_is_reported_as_new(caplog):
    """``num_classes=`` resets the head, but the transfer report counted it as carried (and listed no new head)."""
    t = _timm("vit_small_patch16_224").float()
    with caplog.at_level(logging.INFO, logger="vitrel.models.timm_import"), pytest.warns(UserWarning, match="reset"):
        vitrel.from_timm(t, pos="rel2d_factored", num_classes=3)
    (text,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("from_timm(")]
    assert "  new        head.weight" in text and "  new        head.bias" in text, text
    carried = len(t.state_dict()) - 3  # all but pos_embed (dropped) and the head
    assert f"carried {carried} tensors, converted 0, newly initialised 6," in text, text  # 2 blocks x 2 tables + head


def test_trained_position_parameters_left_behind_are_named_in_a_warning():
    """A scheme that has no place for the source's trained position parameters (a ViT's ``pos_embed`` under
    ``pos="none"``, the docs' probe command once; a Swin's tables under ``rel2d_factored``) dropped them with an INFO
    line only, whose reason for the embedding ("the target uses a relative scheme") was wrong under ``none``. A
    warning now names them; the same function (``pos=None``, ``ape``) and the GPSA bias the softmax cancels warn
    nothing."""
    vit = _timm("vit_small_patch16_224").float()
    lost = "trained position parameters are not carried"
    with pytest.warns(UserWarning, match=rf"pos=none: the source's {lost}: pos_embed \(abs_pos='ape' keeps"):
        vitrel.from_timm(vit, pos="none")
    swin = timm.create_model("swin_tiny_patch4_window7_224", **SOURCES["swin_tiny_patch4_window7_224"][0])
    with pytest.warns(UserWarning, match=rf"{lost}: relative_position_bias_table \(x8\); the scheme's own"):
        vitrel.from_timm(swin, pos="rel2d_factored")
    convit = timm.create_model("convit_tiny", img_size=32, patch_size=8, embed_dim=48, depth=2, local_up_to_layer=1)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", f".*{lost}")
        for source, pos in ((vit, None), (vit, "ape"), (convit, None)):
            vitrel.from_timm(source, pos=pos)


def test_layer_decay_puts_a_swin_stage_shared_table_with_its_stage():
    """With ``pos_share=True`` a Swin stage's table (``layers.<i>.rel_pos``) matched no group of ``group_matcher`` and
    took the head's rate (the top one) under ``module.layer_decay``; it is now its stage's first block's rate."""
    from vitrel.train.optim import param_groups

    m = vitrel.create_model(
        "vitrel_swin_tiny_patch2_window4_32", pos="rel2d_factored", pos_share=True, embed_dim=16, depths=(1, 1),
        num_heads=(1, 2),
    )  # fmt: skip
    rate = {
        n: g["lr"]
        for g in param_groups(m, 0.5, 1.0)
        for n, p in m.named_parameters()
        if any(p is q for q in g["params"])
    }
    for i in (0, 1):
        assert rate[f"layers.{i}.rel_pos.table_h"] == rate[f"layers.{i}.blocks.0.attn.qkv.weight"], rate
    assert rate["layers.0.rel_pos.table_h"] < rate["head.weight"]


def test_init_files_missing_or_of_another_architecture(tmp_path):
    """A missing ``init_file`` said only "no such checkpoint"; one of another architecture was an 11 kB message (every
    key of timm's ``load_state_dict`` error) that asked for ``timm_kwargs=``, which ``train.py`` did not take."""
    vit = tmp_path / "vit.safetensors"
    save_file(_timm("vit_small_patch16_224").float().state_dict(), str(vit))
    with pytest.raises(CheckpointError, match=r"no such file or folder: .*nope.*model\.init_file="):
        vitrel.create_model("x", init_from="timm:vit_small_patch16_224", init_file=str(tmp_path / "nope"))
    with pytest.raises(CheckpointError, match="another architecture than timm's swin.*init_from=timm:<name>") as e:
        vitrel.create_model("x", init_from="timm:swin_tiny_patch4_window7_224", init_file=str(vit), pos="rel2d_full")
    assert len(str(e.value)) < 600, str(e.value)
    kw = SOURCES["vit_small_patch16_224"][0]
    with pytest.raises(CheckpointError, match=r"does not fit .*missing .*timm_kwargs") as e:
        vitrel.create_model(
            "x", init_from="timm:vit_small_patch16_224", init_file=str(vit), timm_kwargs={**kw, "depth": 3}
        )
    assert len(str(e.value)) < 600, str(e.value)
    vit_small = dict(init_from="timm:vit_small_patch16_224", init_file=str(vit))
    with pytest.raises(CheckpointError, match=r"does not fit .*unexpected .*timm_kwargs"):  # a file deeper than asked
        vitrel.create_model("x", **vit_small, timm_kwargs={**kw, "depth": 1})
    with pytest.raises(CheckpointError, match=r"does not fit .*missing .*timm_kwargs"):  # the registered default
        vitrel.create_model("x", **vit_small)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (timm_kwargs is used, not warned as ignored)
        m = vitrel.create_model("x", init_from="timm:vit_small_patch16_224", init_file=str(vit), timm_kwargs=kw)
    assert m.vitrel_cfg["depth"] == 2


# ---------------------------------------------------------------------------- checkpoint_path convention
CASES = [
    (
        "vitrel_vit_tiny_patch4_32",
        dict(embed_dim=48, depth=2, num_heads=2),
        ["rel2d_factored", "rope2d_mixed", "shaw2d_factored"],
    ),
    (
        "vitrel_swin_tiny_patch2_window4_32",
        dict(embed_dim=16, depths=(2, 1, 1, 1), num_heads=(1, 2, 2, 2)),
        ["rel2d_full", "alibi2d", "rel2d_cpb"],
    ),
]


@pytest.mark.parametrize("fmt", ["safetensors", "pth"])
@pytest.mark.parametrize("arch,kw,schemes", CASES)
def test_create_model_checkpoint_path_with_a_plain_state_dict(tmp_path, arch, kw, schemes, fmt):
    for pos in schemes:
        torch.manual_seed(0)
        src = vitrel.create_model(arch, pos=pos, num_classes=4, **kw).eval()
        path = tmp_path / f"{pos}.{fmt}"
        sd = {k: v.contiguous() for k, v in src.state_dict().items()}
        save_file(sd, str(path)) if fmt == "safetensors" else torch.save(sd, path)
        m = vitrel.create_model(arch, pos=pos, num_classes=4, checkpoint_path=path, **kw).eval()
        x = torch.randn(2, 3, 32, 32)
        torch.testing.assert_close(m(x), src(x))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # learned tables are resized (warned)
            big = vitrel.create_model(arch, pos=pos, num_classes=4, img_size=48, checkpoint_path=path, **kw)
        assert big(torch.randn(1, 3, 48, 48)).shape == (1, 4)
        with pytest.raises(CheckpointError, match="give num_classes=4"):
            vitrel.create_model(arch, pos=pos, num_classes=10, checkpoint_path=path, **kw)
        other = "rel2d_bucket" if pos != "rel2d_bucket" else "rel2d_full"
        with pytest.raises(CheckpointError, match="do not fit"):
            vitrel.create_model(arch, pos=other, num_classes=4, checkpoint_path=path, **kw)


@pytest.mark.parametrize(
    "name", ["vit_small_patch16_224", "swin_tiny_patch4_window7_224", "vit_small_patch16_rope_mixed_224"]
)
def test_create_model_checkpoint_path_with_a_timm_file_names_from_timm(tmp_path, name):
    """A timm model's state dict given to ``vitrel.create_model(..., checkpoint_path=...)`` said "give
    num_classes=5" and then "the weights do not fit this architecture (another model?)": it names
    ``vitrel.from_timm``, which maps timm's layout."""
    path = tmp_path / "timm.pth"
    torch.save(_timm(name).float().state_dict(), path)
    arch = "vitrel_swin_tiny_patch4_window7_224" if "swin" in name else "vitrel_vit_small_patch16_224"
    with pytest.raises(CheckpointError, match=r"a timm model's weights.*vitrel\.from_timm\("):
        vitrel.create_model(arch, pos="rel2d_full", checkpoint_path=path)


# ---------------------------------------------------------------------------- the Hydra route
def test_finetune_fast_dev_run_from_a_local_timm_export(tmp_path):
    """``train.py model.init_from=timm:<name> model.init_file=<folder> pos=...``: one batch of each stage."""
    from tests.train_helpers import FAST, compose
    from vitrel.train.run import train

    src = timm.create_model(
        "swin_tiny_patch4_window7_224", img_size=32, embed_dim=16, depths=(1, 1), num_heads=(1, 2), window_size=4
    )
    save_for_hf(src, str(tmp_path / "timm_export"), safe_serialization=True)
    over = [  # the default model config (a slim vitrel ViT): init_from replaces its architecture, with a warning
        "model.init_from=timm:swin_tiny_patch4_window7_224",
        f"model.init_file={tmp_path / 'timm_export'}",
        "pos=rel2d_factored",
        "debug=fdr",
        *FAST,
    ]
    with pytest.warns(UserWarning, match="the architecture is swin_tiny_patch4_window7_224's"):
        metrics = train(compose(tmp_path / "run", over))
    assert "test/acc1" in metrics


def test_init_from_errors():
    with pytest.raises(ValueError, match="init_file needs init_from=timm:"):
        vitrel.create_model("vitrel_vit_tiny_patch4_32", init_file="x.safetensors")
    with pytest.raises(ValueError, match="init_from must be 'timm:<model name>"):
        vitrel.create_model("vitrel_vit_tiny_patch4_32", init_from="swin_tiny_patch4_window7_224")


# ---------------------------------------------------------------------------- bad files, every route
EVAL_FAST = ["data.num_workers=0", "trainer.accelerator=cpu", "progress_bar=none"]


class _Payload:
    """Unpickling this runs ``open(<marker>, "w")``: a stand-in for code a pickle could run."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _bad_files(tmp_path) -> dict[str, object]:
    vit = vitrel.create_model("vitrel_vit_tiny_patch4_32", embed_dim=32, depth=1, num_heads=2, num_classes=10)
    good = tmp_path / "good.ckpt"
    torch.save(
        {"state_dict": {"model." + k: v for k, v in vit.state_dict().items()}, "vitrel_cfg": vit.vitrel_cfg}, good
    )
    raw = good.read_bytes()
    swin = vitrel.create_model("vitrel_swin_tiny_patch2_window4_32", embed_dim=16, depths=(1, 1), num_heads=(1, 2))
    files = {
        "random_bytes": (tmp_path / "random.ckpt", bytes(torch.randint(0, 256, (4096,), dtype=torch.uint8).tolist())),
        "truncated_ckpt": (tmp_path / "truncated.ckpt", raw[: len(raw) // 2]),
    }
    for path, data in files.values():
        path.write_bytes(data)
    st = tmp_path / "full.safetensors"
    save_file({k: v.contiguous() for k, v in vit.state_dict().items()}, str(st), metadata={"vitrel_cfg": "{}"})
    (tmp_path / "truncated.safetensors").write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    torch.save(swin.state_dict(), tmp_path / "other_arch.pth")
    torch.save({"state_dict": {"x": _Payload(str(tmp_path / "PWNED"))}}, tmp_path / "payload.ckpt")
    return {
        "random_bytes": tmp_path / "random.ckpt",
        "truncated_ckpt": tmp_path / "truncated.ckpt",
        "truncated_safetensors": tmp_path / "truncated.safetensors",
        "other_arch_state_dict": tmp_path / "other_arch.pth",
        "pickle_that_runs_code": tmp_path / "payload.ckpt",
    }


@pytest.mark.parametrize("route", ["load_model", "create_model", "eval.py", "train.py"])
def test_bad_files_give_one_clear_error_on_every_route(tmp_path, route):
    from tests.train_helpers import FAST, TINY_VIT, compose
    from vitrel.train.evaluate import evaluate
    from vitrel.train.run import train

    files = _bad_files(tmp_path)
    for kind, path in files.items():
        if route == "load_model":
            call = lambda p=path: vitrel.load_model(p)  # noqa: E731
        elif route == "create_model":
            call = lambda p=path: vitrel.create_model(  # noqa: E731
                "vitrel_vit_tiny_patch4_32", embed_dim=32, depth=1, num_heads=2, num_classes=10, checkpoint_path=p
            )
        elif route == "eval.py":
            call = lambda p=path: evaluate(compose(tmp_path / "eval", [f"ckpt_path={p}", *EVAL_FAST], "eval"))  # noqa: E731
        else:
            over = [f"ckpt_path={path}", *TINY_VIT, *FAST, "logger=none", "trainer.max_epochs=1"]
            call = lambda o=over, k=kind: train(compose(tmp_path / f"train_{k}", o))  # noqa: E731
        with pytest.raises(CheckpointError) as err:
            call()
        msg = str(err.value)
        assert str(path.name) in msg or "weights do not fit" in msg, (kind, msg)
        if kind == "pickle_that_runs_code":
            assert "refused" in msg and "could run code" in msg
        assert not (tmp_path / "PWNED").exists(), "the pickle's code ran"


@pytest.mark.parametrize(
    "kw",
    [
        dict(img_size=128, window_size=(4, 4, 8, 4)),  # a window per stage, as swin_s3_*: (7, 7, 14, 7)
        dict(window_size=4, always_partition=True),  # windows larger than a stage's grid (8, 4, 2 at 64)
    ],
    ids=["per_stage", "always_partition"],
)
def test_swin_windows_vitrel_cannot_reproduce_are_refused(kw):
    """vitrel's Swin has one window for all stages, shrunk to a smaller grid. A timm Swin with a window per stage
    (``swin_s3_*``) or unshrunk windows used to be built with stage 0's window: the tables of the other windows
    dropped (as if the target were not ``rel2d_full``) and another function, without an error."""
    args = dict(img_size=64, embed_dim=16, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4), num_classes=7)
    t = timm.create_model("swin_tiny_patch4_window7_224", **{**args, **kw})
    with pytest.raises(UnsupportedTimmModel, match="one window for all stages"):
        vitrel.from_timm(t)
    with pytest.raises(UnsupportedTimmModel, match="one window for all stages"):
        vitrel.from_timm(t, pos="rel2d_factored")  # the windows are wrong whatever the scheme


def _small_swin(**kw) -> torch.nn.Module:
    return timm.create_model(
        "swin_tiny_patch4_window7_224", img_size=32, patch_size=2, window_size=4, embed_dim=16, depths=(1, 1),
        num_heads=(1, 1), num_classes=5, **kw,
    )  # fmt: skip


def test_a_swin_pooling_vitrel_has_not_is_refused_as_the_vit_s_is():
    """A timm Swin pooling as vitrel's cannot (``catavgmax``: the features doubled) is the
    :class:`UnsupportedTimmModel` naming the setting that a ViT's unknown pooling gives, not a bare ``ValueError``."""
    with pytest.raises(UnsupportedTimmModel, match="global_pool='catavgmax'; vitrel's backbones have no equivalent"):
        vitrel.from_timm(_small_swin(global_pool="catavgmax"))


@pytest.mark.parametrize("global_pool", ["max", "avgmax"])
def test_a_swin_with_max_or_avgmax_pooling_is_timms_function(global_pool):
    """timm's Swin pools ``max`` / ``avgmax`` (timm's ``SelectAdaptivePool2d``); vitrel's Swin refused them. Imported,
    it computes timm's logits (float64), and ``reset_classifier`` switches its pooling as timm's does."""
    t = _small_swin(global_pool=global_pool).double().eval()
    with torch.no_grad():
        for p in t.parameters():
            p.add_(0.05 * torch.randn_like(p))
    m = vitrel.from_timm(t)
    assert m.global_pool == m.vitrel_cfg["global_pool"] == global_pool
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(m(x), t(x), rtol=1e-10, atol=1e-10)
        t.reset_classifier(5, "avg"), m.reset_classifier(5, "avg")
        m.head.load_state_dict({k.removeprefix("fc."): v for k, v in t.head.state_dict().items()})
        torch.testing.assert_close(m(x), t(x), rtol=1e-10, atol=1e-10)


def test_swin_weights_at_another_window_keep_their_trained_tables():
    """``from_timm(swin, window_size=8)`` of weights trained at window 4 (an audit's): every stage's trained table
    was dropped for a fresh one (std 0.02), though the scheme is ``rel2d_full``, with a warning only for a stage
    whose table timm had resized. Each table is now carried and resized by the scheme's ``extend``: ``grow`` keeps
    the trained offsets and gives the new ones the edge's values (from the equation, with a clamp), ``geometric``
    is timm's own load of the weights into a Swin built at window 8 (its ``checkpoint_filter_fn``), same logits."""
    import timm.models.swin_transformer as timm_swin

    t = _small_swin().double().eval()
    with torch.no_grad():
        for p in t.parameters():
            p.add_(0.5 * torch.randn_like(p))
    with pytest.warns(UserWarning, match=r"resized relative-position tables \(7, 7, 1\) -> \(15, 15, 1\)"):
        m = vitrel.from_timm(t, window_size=8)
    for i in range(2):
        src = t.layers[i].blocks[0].attn.relative_position_bias_table.view(7, 7, 1)
        idx = torch.arange(-7, 8).clamp(-3, 3) + 3  # grow: offset d takes the table's value at clamp(d, -3, 3)
        torch.testing.assert_close(m.layers[i].blocks[0].attn.pos.table, src[idx][:, idx], rtol=0, atol=0)
    t8 = timm.create_model(
        "swin_tiny_patch4_window7_224", img_size=32, patch_size=2, window_size=8, embed_dim=16, depths=(1, 1),
        num_heads=(1, 1), num_classes=5,
    ).double().eval()  # fmt: skip
    t8.load_state_dict(timm_swin.checkpoint_filter_fn(t.state_dict(), t8))
    with pytest.warns(UserWarning, match="extend='geometric'"):
        g = vitrel.from_timm(t, window_size=8, pos={"name": "rel2d_full", "extend": "geometric"}).eval()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(g(x), t8(x), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "kw",
    [
        dict(global_pool="max"),
        dict(global_pool="avgmax", reg_tokens=2),
        dict(global_pool="map", class_token=False),  # SigLIP's head
        dict(global_pool="map"),
    ],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()),
)
def test_a_vit_with_max_avgmax_or_map_pooling_is_timms_function(kw):
    """timm's ViT pools ``max`` / ``avgmax`` / ``map`` (``AttentionPoolLatent``, SigLIP's); ``from_timm`` refused them
    (vitrel's ViT had no such pool). Imported, the pool's weights keep timm's names (``attn_pool.*``, carried as
    they are), the logits are timm's (float64), and ``reset_classifier`` switches the pool as timm's does."""
    torch.manual_seed(0)
    t = timm.create_model("vit_small_patch16_224", **SMALL_VIT, **kw).double().eval()
    with torch.no_grad():
        for p in t.parameters():
            p.add_(0.05 * torch.randn_like(p))
    m = vitrel.from_timm(t)
    assert m.global_pool == m.vitrel_cfg["global_pool"] == kw["global_pool"]
    assert {k for k in t.state_dict() if k.startswith("attn_pool.")} == {
        k for k in m.state_dict() if k.startswith("attn_pool.")
    }
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(m(x), t(x), rtol=1e-10, atol=1e-10)
        t.reset_classifier(5, "avg"), m.reset_classifier(5, "avg")
        m.head.load_state_dict(t.head.state_dict())
        torch.testing.assert_close(m(x), t(x), rtol=1e-10, atol=1e-10)


def test_an_attention_pool_vitrel_does_not_build_is_refused():
    t = timm.create_model("vit_small_patch16_224", **SMALL_VIT, global_pool="map", class_token=False)
    t.attn_pool.latent_len = 2  # (several latents: a head vitrel's map does not build)
    with pytest.raises(UnsupportedTimmModel, match="attention pooling other than timm's ViT's AttentionPoolLatent"):
        vitrel.from_timm(t)


def test_timms_own_swin_v2_refusal_says_why():
    """timm's ``swinv2_cr_*`` got the generic "from_timm takes timm VisionTransformer ..." list; the refusal names the
    model, what vitrel's Swin lacks and that the authors' Swin V2 (``swinv2_*``, tests/models/test_swin_v2.py)
    reads."""
    why = r"swinv2_cr_tiny_ns_224 is timm's own Swin V2 .*the authors' Swin V2 \(swinv2_\*\) reads"
    with pytest.raises(UnsupportedTimmModel, match=why):
        vitrel.from_timm(timm.create_model("swinv2_cr_tiny_ns_224", pretrained=False))
    with pytest.raises(UnsupportedTimmModel, match=why):
        vitrel.from_timm("swinv2_cr_tiny_ns_224", pretrained=False)


def test_refused_architecture_named_before_its_weights_are_fetched(monkeypatch):
    """``from_timm("swin_s3_tiny_224")`` is refused for its windows before timm fetches its weights: offline it
    was a ``CheckpointError`` saying to give the weights as a file (after the Hub's retries), which then failed."""
    real = timm.create_model

    def offline(name, pretrained=False, **kw):
        if pretrained:
            raise OSError("no network")
        return real(name, pretrained=False, **kw)

    monkeypatch.setattr(timm, "create_model", offline)
    with pytest.raises(UnsupportedTimmModel, match="one window for all stages"):
        vitrel.from_timm("swin_s3_tiny_224.ms_in1k")
    with pytest.raises(UnsupportedTimmModel, match="takes timm VisionTransformer"):
        vitrel.from_timm("resnet18", checkpoint_path="resnet18.safetensors")  # refused before the file is read
    with pytest.raises(CheckpointError, match="cannot fetch timm's pretrained weights"):
        vitrel.from_timm("swin_tiny_patch4_window7_224")  # a supported one still fetches its weights


def test_a_swin_that_pads_its_own_grids_warns_that_the_logits_differ():
    """At a timm Swin's own size a stage grid that is not a multiple of its window is padded by timm, whose tokens
    attend to the zeros; vitrel masks the padding. ``from_timm`` gave that other function without a word (logits 0.1
    apart at 64 x 96, window 4: stage 2's 4 x 6 grid); it now warns, naming the grids. At a window multiple: silent,
    equal."""
    args = dict(embed_dim=16, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4), window_size=4, num_classes=7)
    torch.manual_seed(0)
    t = timm.create_model("swin_tiny_patch4_window7_224", img_size=(64, 96), **args).double().eval()
    with torch.no_grad():
        for p in t.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    with pytest.warns(UserWarning, match=r"pads the stage grids 4x6 \(window 4x4\) of its img_size \(64, 96\)"):
        m = vitrel.from_timm(t)
    x = torch.randn(2, 3, 64, 96, dtype=torch.float64)
    with torch.no_grad():
        assert (m(x) - t(x)).abs().max() > 1e-2
    t = _timm("swin_tiny_patch4_window7_224")  # 64 x 64: grids 16, 8, 4, 2 (window shrunk to 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        vitrel.from_timm(t)


@pytest.mark.parametrize("name", ["vit_small_patch16_224", "deit_tiny_patch16_224"])
def test_get_intermediate_layers_equal_timms(name):
    """timm's (DINO's) ``get_intermediate_layers`` on the imported model gives timm's tensors: the last ``n`` blocks or
    the listed ones, token lists or maps (``reshape``), normed, with the prefix tokens apart."""
    t = _timm(name)
    m = vitrel.from_timm(t)
    calls = [
        dict(n=2),
        dict(n=[0, 1], reshape=True),
        dict(n=1, norm=True, return_prefix_tokens=True),
        dict(n=(1,), reshape=True, norm=True, return_prefix_tokens=True),
    ]
    with torch.no_grad():
        for kw in calls:
            got, want = m.get_intermediate_layers(_x(), **kw), t.get_intermediate_layers(_x(), **kw)
            assert len(got) == len(want) > 0, kw
            for g, w in zip(got, want):
                for gt, wt in zip(g, w) if kw.get("return_prefix_tokens") else [(g, w)]:
                    torch.testing.assert_close(gt, wt, rtol=1e-8, atol=1e-8)


def _jittered(name: str, **kw) -> torch.nn.Module:
    """timm's ``name`` (2 blocks, 64 px) in float64 with its weights moved off their initialisation (tables by 1)."""
    torch.manual_seed(1)
    t = timm.create_model(name, pretrained=False, depth=2, img_size=64, **kw).eval().double()
    with torch.no_grad():
        for n, p in t.named_parameters():
            p.add_(torch.randn_like(p) * (1.0 if "relative_position" in n else 0.05))
    return t


@pytest.mark.parametrize(
    "name, kw, why",
    [
        ("vit_pwee_patch16_reg1_gap_256", {}, "ParallelScalingBlock blocks"),
        ("vit_small_patch16_18x2_224", {}, "ParallelThingsBlock blocks"),
        ("vit_relpos_medium_patch16_cls_224", dict(rel_pos_type="bias"), "no scheme equal .* give pos="),
        ("deit_tiny_distilled_patch16_224", {}, r"a distillation token and head \(DeiT's distilled models\)"),
        ("vit_dwee_patch16_reg1_gap_256", {}, r"differential attention \(DiffAttention\)"),
    ],
)
def test_a_timm_vit_vitrel_cannot_compute_is_refused_not_converted(name, kw, why):
    """Were converted without a word to another function (features off by 0.5 to 1.1): a class-token bias table (BEiT's
    3 extra rows) replaced by a fresh one under the claimed ``rel2d_full`` (and post-norm blocks loaded into pre-norm
    ones: they now read, below); the parallel blocks an ``AttributeError``."""
    with pytest.raises(UnsupportedTimmModel, match=why):
        vitrel.from_timm(_jittered(name, **kw))


def test_images_not_whole_patches_are_refused_with_the_size_that_gives_timms_function():
    """SigLIP's so400m at 384 px has 14-px patches: timm's convolution drops the last 6 pixels; the import crashed on
    vitrel's own size check. It is refused with the size to build timm's model at, whose weights (the same) give, on
    that top-left crop, timm's function at 384."""
    kw = dict(depth=1, embed_dim=48, num_heads=2, mlp_ratio=2.0, num_classes=3)
    torch.manual_seed(0)
    t384 = lively(timm.create_model("vit_so400m_patch14_siglip_384", **kw)).double().eval()
    with pytest.raises(UnsupportedTimmModel, match=r"384x384 images are not whole 14-px patches.*'img_size': 378"):
        vitrel.from_timm(t384)
    t378 = timm.create_model("vit_so400m_patch14_siglip_384", img_size=378, **kw).double().eval()
    t378.load_state_dict(t384.state_dict())
    x = torch.randn(1, 3, 384, 384, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(vitrel.from_timm(t378)(x[..., :378, :378]), t384(x), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "name, kw",
    [
        ("vit_base_patch16_rpn_224", dict(embed_dim=64, num_heads=2)),
        ("vit_relpos_base_patch16_rpn_224", dict(rel_pos_type="bias")),
    ],
)
def test_timms_res_post_norm_vits_read_with_post_norm(name, kw):
    """timm's ``ResPostBlock`` / ``ResPostRelPosBlock`` ViTs (``x + LN(Attn x)``) were refused (before that, loaded into
    pre-norm blocks: another function); they read with ``post_norm=True``, equal in float64."""
    t = _jittered(name, **kw)
    m = vitrel.from_timm(t)
    assert m.vitrel_cfg["post_norm"] is True
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(m(x), t(x), rtol=1e-10, atol=1e-10)


def test_a_timm_vit_without_an_absolute_embedding_gets_none():
    """``pos_embed='none'``: was given a random ``abs_pos='ape'`` embedding (features off by 0.06)."""
    t = _jittered("vit_tiny_patch16_224", pos_embed="none")
    m = vitrel.from_timm(t)
    assert m.vitrel_cfg["pos"] == "none" and m.vitrel_cfg["abs_pos"] is None
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(m.forward_features(x), t.forward_features(x), rtol=1e-10, atol=1e-10)


def test_a_timm_train_checkpoint_gives_its_ema_copy_as_timm_does(tmp_path):
    """A checkpoint of timm's train script with ``--model-ema`` (``state_dict`` and ``state_dict_ema``): timm's
    ``create_model(checkpoint_path=)`` loads the EMA copy (``load_checkpoint``'s ``use_ema=True``); ``from_timm`` and
    ``model.init_file=`` loaded the live weights. A file without one loads its weights."""
    kw = dict(depth=2, img_size=32, patch_size=8, num_classes=5)
    torch.manual_seed(0)
    live, ema = (timm.create_model("vit_tiny_patch16_224", **kw).eval() for _ in range(2))
    torch.save({"epoch": 9, "state_dict": live.state_dict(), "state_dict_ema": ema.state_dict()}, tmp_path / "c.pth")
    torch.save(live.state_dict(), tmp_path / "plain.pth")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        timms = timm.create_model("vit_tiny_patch16_224", checkpoint_path=str(tmp_path / "c.pth"), **kw).eval()
        for file, want in (("c.pth", ema(x)), ("plain.pth", live(x))):
            m = vitrel.from_timm("vit_tiny_patch16_224", checkpoint_path=tmp_path / file, timm_kwargs=kw).eval()
            torch.testing.assert_close(m(x), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(timms(x), ema(x))


def test_eva_keeps_its_embedding_under_another_scheme_unless_told(caplog):
    """EVA's absolute embedding is part of its architecture beside RoPE: with another ``pos=`` it stays as
    ``abs_pos="ape"``; ``abs_pos=None`` drops it, and the report says so."""
    t = _timm("eva02_tiny_patch14_224")
    kept = vitrel.from_timm(t, pos="rel2d_full")
    assert kept.vitrel_cfg["abs_pos"] == "ape"
    torch.testing.assert_close(kept.abs_pos.pos_embed, t.pos_embed[:, 1:], rtol=0, atol=0)
    with caplog.at_level(logging.INFO, logger="vitrel.models.timm_import"):
        dropped = vitrel.from_timm(t, pos="rel2d_full", abs_pos=None)
    assert dropped.abs_pos is None and "dropped    pos_embed: absolute embedding" in caplog.text


def test_sapiens2_reads_with_grouped_query_rmsnorm_and_attention_only_layer_scale(tmp_path):
    """sapiens2 (timm's ``vit_*_sapiens2``): DINOv3's RoPE, every norm an RmsNorm (``norm_layer="rmsnorm"``),
    grouped-query attention in some blocks (``num_kv_heads`` one per block), layer scale on the attention branch only
    (``attn_only_layer_scale``), 8 registers; equal to timm's at the built size (portrait), larger and square (timm
    computes its RoPE tables in float32: 1e-6). A checkpoint keeps it."""
    args = dict(img_size=(64, 48), embed_dim=64, depth=4, num_heads=4, num_kv_heads=(4, 2, 1, 4), num_classes=5)
    torch.manual_seed(0)
    t = lively(timm.create_model("vit_base_patch16_sapiens2", **args)).double().eval()
    with torch.no_grad():
        for n, p in t.named_parameters():
            if "norm" in n:  # (off their init: an RmsNorm read as a LayerNorm, or its channels unpermuted, shows)
                p.add_(0.3 * torch.randn_like(p))
    m = vitrel.from_timm(t)
    cfg = m.vitrel_cfg
    assert (cfg["norm_layer"], cfg["num_kv_heads"], cfg["attn_only_layer_scale"]) == ("rmsnorm", [4, 2, 1, 4], True)
    assert cfg["pos"]["coords"] == "normalized" and cfg["reg_tokens"] == 8
    with torch.no_grad():
        for hw in ((64, 48), (96, 64), (32, 32)):
            x = torch.randn(2, 3, *hw, dtype=torch.float64, generator=torch.Generator().manual_seed(sum(hw)))
            torch.testing.assert_close(m(x), t(x), rtol=1e-6, atol=1e-6, msg=str(hw))
        vitrel.models.save_pretrained(m, tmp_path / "m")
        back = vitrel.load_model(tmp_path / "m").double().eval()
        torch.testing.assert_close(back(x), m(x), rtol=1e-6, atol=1e-6)
