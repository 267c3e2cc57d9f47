"""The ViT options timm's families need: ``mlp_layer="swiglu"`` (timm's ``SwiGLU``: DINOv3's S+, H+, 7B, EVA-02),
``mlp_norm`` (a LayerNorm in the MLP: EVA-02's), ``pre_norm`` (a LayerNorm of the input tokens: CLIP's),
``act_layer``, ``final_norm``, ``attn_pool_num_heads`` and ``pool_include_prefix`` (the Perception Encoder's): each
against its equation, timm's init and timm's models, checkpoints, inflation and the refusals."""

from __future__ import annotations

import copy

import pytest
import timm
import torch
from torch import nn

import vitrel
from tests.naflex_inputs import packed
from tests.weights import lively
from vitrel.models import save_pretrained
from vitrel.models.inflate import inflate_image_model
from vitrel.models.timm_import import UnsupportedTimmModel

SMALL = dict(embed_dim=24, depth=2, num_heads=3, mlp_ratio=2.5)


def _vit(pos="rope2d_axial") -> nn.Module:
    torch.manual_seed(0)
    return vitrel.create_model("vitrel_vit_tiny_patch4_32", pos=pos, mlp_layer="swiglu", **SMALL)


def test_the_block_mlp_is_the_equation():
    """``fc2(SiLU(x W_g^T + b_g) * (x W_x^T + b_x))`` with ``int(24 * 2.5) = 60`` hidden features, float64."""
    m = lively(_vit()).double()
    mlp = m.blocks[1].mlp
    x = torch.randn(2, 5, 24, dtype=torch.float64)
    gate = x @ mlp.fc1_g.weight.T + mlp.fc1_g.bias
    value = x @ mlp.fc1_x.weight.T + mlp.fc1_x.bias
    want = (gate * torch.sigmoid(gate) * value) @ mlp.fc2.weight.T + mlp.fc2.bias
    assert mlp.fc1_g.out_features == 60
    torch.testing.assert_close(mlp(x), want, rtol=1e-12, atol=1e-12)


def test_init_is_timms():
    """timm's SwiGLU init after its ViT init: the gate's weight near zero (std 1e-6) and its bias one, so the block
    starts as ``fc2(SiLU(1) * fc1_x x)``; the value and output layers trunc-normal(0.02)."""
    mlp = _vit().blocks[0].mlp
    assert torch.equal(mlp.fc1_g.bias, torch.ones(60)) and mlp.fc1_g.weight.std() < 1e-5
    assert 0.01 < mlp.fc1_x.weight.std() < 0.03 and torch.equal(mlp.fc1_x.bias, torch.zeros(60))


@pytest.mark.parametrize("layer", ["SwiGLU", "SwiGLUPacked"])
def test_equals_timms_vit_with_the_same_mlp_and_refuses_another_activation(layer):
    """timm's ViT with ``mlp_layer=SwiGLU`` (SiLU), or its packed form (one ``fc1``, the value rows first: split into
    ``fc1_x`` and ``fc1_g``), equals vitrel's; a SwiGLU with timm's default GELU and a GEGLU are refused by name."""
    torch.manual_seed(0)
    args = dict(img_size=32, patch_size=4, embed_dim=24, depth=2, num_heads=3, num_classes=5, mlp_ratio=2.5)
    mlp = getattr(timm.layers, layer)
    t = lively(timm.create_model("vit_tiny_patch16_224", mlp_layer=mlp, act_layer=nn.SiLU, **args)).double().eval()
    m = vitrel.from_timm(t)
    hidden = m.blocks[0].mlp.fc1_g.out_features
    assert m.vitrel_cfg["mlp_layer"] == "swiglu" and hidden == t.blocks[0].mlp.fc2.in_features
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(m(x), t(x), rtol=1e-10, atol=1e-10)
    gelu = timm.create_model("vit_tiny_patch16_224", mlp_layer=mlp, **args)  # (timm's default GELU)
    with pytest.raises(UnsupportedTimmModel, match=r"an MLP activation GELU \(vitrel: SiLU in a SwiGLU\)|a gated MLP"):
        vitrel.from_timm(gelu)


def test_mlp_norm_is_a_layernorm_of_the_hidden_features():
    """``mlp_norm=True`` (timm's ``scale_mlp``, EVA-02's sub-LN): ``fc2(LN(SiLU(fc1_g x) * fc1_x x))`` with the
    blocks' eps, for either MLP; the option is a bool."""
    torch.manual_seed(0)
    m = lively(vitrel.create_model("vitrel_vit_tiny_patch4_32", mlp_layer="swiglu", mlp_norm=True, **SMALL)).double()
    mlp = m.blocks[0].mlp
    x = torch.randn(2, 5, 24, dtype=torch.float64)
    gate, value = mlp.fc1_g(x), mlp.fc1_x(x)
    h = torch.nn.functional.layer_norm(gate * torch.sigmoid(gate) * value, (60,), mlp.norm.weight, mlp.norm.bias, 1e-6)
    torch.testing.assert_close(mlp(x), mlp.fc2(h), rtol=1e-12, atol=1e-12)
    plain = vitrel.create_model("vitrel_vit_tiny_patch4_32", mlp_norm=True, **SMALL)
    assert isinstance(plain.blocks[0].mlp.norm, nn.LayerNorm) and plain.blocks[0].mlp.norm.eps == 1e-6
    with pytest.raises(ValueError, match="mlp_norm must be true or false, got 'yes'"):
        vitrel.create_model("vitrel_vit_tiny_patch4_32", mlp_norm="yes")


def test_checkpoint_and_inflation_keep_it(tmp_path):
    m = _vit("rel2d_full")
    save_pretrained(m, tmp_path / "m")
    back = vitrel.load_model(tmp_path / "m")
    assert back.vitrel_cfg["mlp_layer"] == "swiglu" and back.blocks[0].mlp.fc1_g.out_features == 60
    like = dict(in_chans=3, class_token=True, global_pool="token", num_classes=m.num_classes, **SMALL)
    video = vitrel.create_model("vitrel_vit_video_tiny_patch4_32", pos="rel3d_full", mlp_layer="swiglu", **like)
    inflate_image_model(m, video)
    torch.testing.assert_close(video.blocks[1].mlp.fc1_g.weight, m.blocks[1].mlp.fc1_g.weight)
    plain = vitrel.create_model("vitrel_vit_video_tiny_patch4_32", pos="rel3d_full", **like)
    with pytest.raises(ValueError, match="mlp_layer image 'swiglu', video 'mlp'"):
        inflate_image_model(m, plain)


def test_an_unknown_mlp_layer_is_refused():
    with pytest.raises(ValueError, match="mlp_layer must be 'mlp' .* or 'swiglu' .*, got 'geglu'"):
        vitrel.create_model("vitrel_vit_tiny_patch4_32", mlp_layer="geglu")


def test_pre_norm_normalises_the_input_tokens_on_every_input_form():
    """``pre_norm=True`` (timm's ``norm_pre``, CLIP's ``ln_pre``): the tokens after the absolute embedding, class token
    included, go through a LayerNorm before block 0; a list of images of two sizes equals each image alone (the
    token-layout path normalises as well); with ``prefix_at`` it is refused."""
    torch.manual_seed(0)
    kw = dict(pos="rope2d_axial", abs_pos="ape", **SMALL)
    m = lively(vitrel.create_model("vitrel_vit_tiny_patch4_32", pre_norm=True, **kw)).double().eval()
    plain = vitrel.create_model("vitrel_vit_tiny_patch4_32", **kw).double().eval()
    plain.load_state_dict({k: v for k, v in m.state_dict().items() if not k.startswith("norm_pre.")})
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        want, _ = plain.embed(x)
        got, _ = m.embed(x)
        ln = m.norm_pre
        torch.testing.assert_close(got, torch.nn.functional.layer_norm(want, (24,), ln.weight, ln.bias, 1e-6))
        images = [torch.randn(3, 32, 32, dtype=torch.float64), torch.randn(3, 16, 24, dtype=torch.float64)]
        together = m(images)
        for i, img in enumerate(images):
            torch.testing.assert_close(together[i], m(img[None])[0], rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="pre_norm normalises the tokens before block 0"):
        vitrel.create_model("vitrel_vit_tiny_patch4_32", pre_norm=True, pos="none", prefix_at=1, **SMALL)
    with pytest.raises(ValueError, match="pre_norm must be true or false"):
        vitrel.create_model("vitrel_vit_tiny_patch4_32", pre_norm=1)


@pytest.mark.parametrize("act, cls", [("gelu_tanh", timm.layers.GELUTanh), ("quick_gelu", timm.layers.QuickGELU)])
def test_act_layer_is_the_mlps_and_the_attention_pools(act, cls):
    """``act_layer`` (timm's names): SigLIP's tanh GELU, OpenAI CLIP's QuickGELU, in the blocks' MLP and the
    ``"map"`` pool's; refused with a SwiGLU (which gates with SiLU) and by an unknown name."""
    m = vitrel.create_model("vitrel_vit_tiny_patch4_32", act_layer=act, global_pool="map", class_token=False, **SMALL)
    assert isinstance(m.blocks[1].mlp.act, cls) and isinstance(m.attn_pool.mlp.act, cls)
    x = torch.randn(3, 7)
    torch.testing.assert_close(m.blocks[0].mlp.act(x), cls()(x))
    with pytest.raises(ValueError, match="mlp_layer='swiglu' gates with SiLU"):
        vitrel.create_model("vitrel_vit_tiny_patch4_32", act_layer=act, mlp_layer="swiglu")
    with pytest.raises(ValueError, match="act_layer must be one of .*got 'relu'"):
        vitrel.create_model("vitrel_vit_tiny_patch4_32", act_layer="relu")


@pytest.mark.parametrize("pool", ["token", "avg"])
def test_final_norm_false_leaves_the_tokens_of_the_last_block(pool):
    """``final_norm=False`` (timm's): neither ``norm`` nor ``fc_norm``, whichever the pool would use; the features are
    the last block's output, and timm's ViT built so equals vitrel's through ``from_timm``."""
    torch.manual_seed(0)
    args = dict(img_size=32, patch_size=4, embed_dim=24, depth=2, num_heads=3, num_classes=5, global_pool=pool)
    t = lively(timm.create_model("vit_tiny_patch16_224", final_norm=False, **args)).double().eval()
    m = vitrel.from_timm(t)
    assert m.vitrel_cfg["final_norm"] is False
    assert isinstance(m.norm, nn.Identity) and isinstance(m.fc_norm, nn.Identity)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(m(x), t(x), rtol=1e-10, atol=1e-10)
        last = []
        m.blocks[-1].register_forward_hook(lambda _m, _a, out: last.append(out))
        torch.testing.assert_close(m.forward_features(x), last[0])
    with pytest.raises(ValueError, match="final_norm must be true or false, got 0"):
        vitrel.create_model("vitrel_vit_tiny_patch4_32", final_norm=0)


def test_attn_pool_num_heads_sizes_the_pool_alone(tmp_path):
    """``attn_pool_num_heads`` (timm's EVA name; the Perception Encoder's pool has 8 heads, its blocks 12 or 16):
    the ``"map"`` pool's heads, the blocks' unchanged, kept by a checkpoint; a count that does not divide
    ``embed_dim`` is refused, and loading with another count warns (the weights fit, the function differs)."""
    kw = dict(global_pool="map", class_token=False, **SMALL)
    m = vitrel.create_model("vitrel_vit_tiny_patch4_32", attn_pool_num_heads=4, **kw)
    assert m.attn_pool.num_heads == 4 and m.blocks[0].attn.num_heads == 3
    assert vitrel.create_model("vitrel_vit_tiny_patch4_32", **kw).attn_pool.num_heads == 3
    save_pretrained(m, tmp_path / "m")
    assert vitrel.load_model(tmp_path / "m").attn_pool.num_heads == 4
    with pytest.warns(UserWarning, match=r"attn_pool_num_heads=2 \(trained with 4\)"):
        vitrel.load_model(tmp_path / "m", attn_pool_num_heads=2)
    with pytest.raises(ValueError, match="attn_pool_num_heads"):
        vitrel.create_model("vitrel_vit_tiny_patch4_32", attn_pool_num_heads=5, **kw)


@pytest.mark.parametrize("pool", ["avg", "max", "avgmax", "map"])
def test_pool_include_prefix_pools_the_prefix_tokens_on_every_input_form(pool):
    """``pool_include_prefix=True`` (timm's; timm's EVA attention pool, the Perception Encoder's): the pool reduces
    the class and register tokens with the patches: against the pool written out over every token, timm's ViT built
    so (through ``from_timm``), and on a list of sizes, a packed NaFlex dict and a padded one (``forward_head`` with
    ``patch_valid`` too) each image as it is alone."""
    torch.manual_seed(0)
    args = dict(img_size=32, patch_size=4, embed_dim=24, depth=2, num_heads=3, num_classes=5, reg_tokens=2)
    t = timm.create_model("vit_tiny_patch16_224", global_pool=pool, pool_include_prefix=True, fc_norm=False, **args)
    t = lively(t).double().eval()
    m = vitrel.from_timm(t)
    assert m.vitrel_cfg["pool_include_prefix"] is True and m.pool_include_prefix
    imgs = [torch.randn(3, *hw, dtype=torch.float64) for hw in ((32, 32), (16, 24), (24, 16))]
    with torch.no_grad():
        torch.testing.assert_close(m(imgs[0][None]), t(imgs[0][None]), rtol=1e-10, atol=1e-10)
        f = m.forward_features(imgs[0][None])
        mean, top = f.mean(1), f.amax(1)
        want = {"avg": mean, "max": top, "avgmax": 0.5 * (mean + top), "map": m.attn_pool(f) if m.attn_pool else None}
        torch.testing.assert_close(m.forward_head(f, pre_logits=True), m.fc_norm(want[pool]))
        patches_only = vitrel.from_timm(t, pool_include_prefix=False)
        assert (patches_only(imgs[0][None]) - t(imgs[0][None])).abs().max() > 1e-4
        alone = torch.cat([m(i[None]) for i in imgs])
        padded = {k: v for k, v in packed(imgs, rows=((0,), (1,), (2,))).items() if k != "segment_ids"}
        feats = m.forward_features(padded)
        forms = {
            "list": m(imgs),
            "packed": m(packed(imgs)),
            "padded": m(padded),
            "patch_valid": m.forward_head(feats["patches"], patch_valid=feats["patch_valid"]),
        }
        for form, got in forms.items():
            torch.testing.assert_close(got, alone, rtol=1e-9, atol=1e-9, msg=form)
    with pytest.raises(ValueError, match="pool_include_prefix must be true or false"):
        vitrel.create_model("vitrel_vit_tiny_patch4_32", pool_include_prefix="yes")


@pytest.mark.parametrize(
    "name, kw, tol",
    [
        ("vit_tiny_patch16_224", dict(qk_norm=True, scale_attn_norm=True), 1e-10),
        ("vit_small_patch16_rope_224", dict(qk_norm=True), 1e-7),  # (q / k channels in vitrel's RoPE layout)
        ("vit_small_patch16_rope_mixed_224", dict(qk_norm=True), 1e-7),
    ],
)
def test_qk_norm_and_attn_norm_are_timms(name, kw, tol, tmp_path):
    """``qk_norm`` (a LayerNorm of each head's q and k, before the rotation) and ``attn_norm`` (of the attention's
    output, timm's ``scale_attn_norm``) equal timm's models built so, their norms moved off their init; under RoPE
    the norms' channels follow q's and k's into vitrel's layout (timm's 1e-8: its float32 angles). A checkpoint keeps
    them; the options are bools."""
    torch.manual_seed(0)
    args = dict(img_size=32, patch_size=4, embed_dim=24, depth=2, num_heads=2, num_classes=5)
    t = lively(timm.create_model(name, **args, **kw)).double().eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in t.named_parameters():
            if "_norm." in n or "attn.norm." in n:
                p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    m = vitrel.from_timm(t)
    assert m.vitrel_cfg["qk_norm"] and m.vitrel_cfg["attn_norm"] == ("scale_attn_norm" in kw)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(m(x), t(x), rtol=tol, atol=tol)
        save_pretrained(m, tmp_path / "m")
        back = vitrel.load_model(tmp_path / "m")  # (float32 on disk)
        assert back.vitrel_cfg["qk_norm"] and back.vitrel_cfg["attn_norm"] == m.vitrel_cfg["attn_norm"]
        torch.testing.assert_close(back.double()(x), m(x), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="qk_norm must be true or false"):
        vitrel.create_model("vitrel_vit_tiny_patch4_32", qk_norm="yes")


def test_qk_norm_follows_a_rope_layout_swap():
    """``swap_rope_axial_halves`` moves each head's q / k channels; a ``qk_norm``'s weights move with them, so the
    swapped model under ``order: columns_first`` computes what the original did."""
    from vitrel.models.rope_layout import swap_rope_axial_halves

    torch.manual_seed(0)
    kw = dict(embed_dim=32, depth=2, num_heads=2, qk_norm=True)
    m = lively(vitrel.create_model("vitrel_vit_tiny_patch4_32", pos="rope2d_axial", **kw)).double().eval()
    with torch.no_grad():
        for blk in m.blocks:
            blk.attn.q_norm.weight.normal_(1.0, 0.3)
    cols = vitrel.create_model(
        "vitrel_vit_tiny_patch4_32", pos={"name": "rope2d_axial", "order": "columns_first"}, **kw
    )
    cols = cols.double().eval()
    cols.load_state_dict(swap_rope_axial_halves(copy.deepcopy(m)).state_dict())
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(cols(x), m(x), rtol=1e-10, atol=1e-10)


def _rms_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * w`` over the last axis, written out in float64."""
    x = x.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("arch", ["vitrel_vit_tiny_patch4_32", "vitrel_vit_video_tiny_patch4_32"])
def test_norm_layer_rmsnorm_is_every_norm_of_the_model(arch):
    """``norm_layer="rmsnorm"``: every norm the model builds (the blocks', q / k and the attention's, the MLP's, the
    input's, the final and the pool's) is timm's ``RmsNorm``, no LayerNorm left, each the equation; an unknown name and
    timm's class are refused with the names."""
    flags = dict(qk_norm=True, attn_norm=True, mlp_norm=True, pre_norm=True, global_pool="map", class_token=False)
    if "video" in arch:
        flags = dict(flags, pos="rel3d_full")
    m = vitrel.create_model(arch, norm_layer="rmsnorm", norm_eps=1e-5, **flags, **SMALL)
    norms = [n for n, mod in m.named_modules() if isinstance(mod, (nn.LayerNorm, timm.layers.RmsNorm))]
    assert all(isinstance(m.get_submodule(n), timm.layers.RmsNorm) for n in norms)
    for part in ("norm_pre", "blocks.0.norm1", "blocks.1.norm2", "blocks.0.attn.q_norm", "blocks.0.attn.norm",
                 "blocks.1.mlp.norm", "norm", "attn_pool.norm"):  # fmt: skip
        assert part in norms, part
    norm1 = m.blocks[0].norm1.double()
    nn.init.normal_(norm1.weight)
    x = torch.randn(2, 5, 24, dtype=torch.float64)
    torch.testing.assert_close(norm1(x), _rms_reference(x, norm1.weight, 1e-5), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"norm_layer must be one of \('layernorm', 'rmsnorm'\)"):
        vitrel.create_model(arch, norm_layer="batchnorm")
    with pytest.raises(ValueError, match="norm_layer must be one of"):
        vitrel.create_model(arch, norm_layer=nn.LayerNorm)
