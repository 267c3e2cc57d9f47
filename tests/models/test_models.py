"""Backbones: every architecture x every position scheme, the model surface, shared schemes, and
Swin's shifted windows against a dense full-image reference."""

from __future__ import annotations

import copy
import math

import pytest
import timm
import torch

import vitrel
from vitrel.models.registry import MODEL_ARGS
from vitrel.models.swin import SwinBlock, SwinTransformer, shifted_window_mask, window_and_shift
from vitrel.pos import Grid, PositionScheme, list_pos

SCHEMES = list_pos()
#: the image models (the video ones: tests/models/test_video_vit.py, test_swin3d.py)
MODELS = [n for n in vitrel.list_models() if MODEL_ARGS[n][0] in (vitrel.models.VisionTransformer, SwinTransformer)]


def _reduced(name: str) -> tuple[dict, int, int]:
    """(overrides, native size, larger size). 224 models: same heads, head_dim 8-16, fewer blocks.
    32 models: Swins at full depth (tiny_patch2 at half width, head_dim 16), ViTs at two blocks and head_dim 16, same
    heads (a scheme's code depends on neither; LieRE's 64 x 64 matrix exponentials took 19 s at ViT-Ti's 12 blocks,
    and ViT-S's 6 heads of 64 at two blocks 30 s)."""
    if "_224" in name:
        if "_vit_" in name:
            heads = {"tiny": 3, "small": 6, "base": 12}[name.split("_")[2]]
            return dict(depth=1, embed_dim=heads * 16), 224, 256
        heads0 = 4 if "base" in name else 3
        return dict(depths=(2, 1, 1, 1), embed_dim=heads0 * 8), 224, 256
    if name in ("vitrel_vit_tiny_patch4_32", "vitrel_vit_small_patch4_32"):
        heads = {"tiny": 3, "small": 6}[name.split("_")[2]]
        return dict(depth=2, embed_dim=heads * 16), 32, 48
    if name == "vitrel_swin_tiny_patch2_window4_32":
        return dict(embed_dim=48), 32, 48
    return {}, 32, 48


@pytest.mark.parametrize("pos", SCHEMES)
@pytest.mark.parametrize("name", MODELS)
def test_every_model_every_scheme_forward_backward(name, pos):
    overrides, size, bigger = _reduced(name)
    torch.manual_seed(0)
    m = vitrel.create_model(name, pos=pos, **overrides)
    assert m.vitrel_cfg["architecture"] == name and m.vitrel_cfg["pos"] == pos
    for s in (size, bigger):  # the grid follows the image: a larger image runs without rebuilding
        x = torch.randn(1, 3, s, s)
        y = m(x)
        assert y.shape == (1, m.num_classes)
        assert torch.isfinite(y).all()
        y.square().sum().backward()
        no_grad = [n for n, p in m.named_parameters() if p.grad is None]
        assert not no_grad, f"parameters without gradient: {no_grad[:5]}"
        assert all(torch.isfinite(p.grad).all() for p in m.parameters())
        m.zero_grad(set_to_none=True)
    # the scheme is where it should be: absolute at the input, relative in every attention layer
    kind = vitrel.pos.get_pos_class(pos).kind
    attn_schemes = {type(mod.pos).name for mod in m.modules() if isinstance(mod, vitrel.Attention)}
    if kind == "absolute":  # (the model's abs_pos; CPE in a Swin: every stage's own)
        where = [m.abs_pos] if m.abs_pos is not None else [s.abs_pos for s in m.layers]
        assert {type(s).name for s in where} == {pos} and attn_schemes == {"none"}
    else:
        assert m.abs_pos is None and attn_schemes == {pos}


# The full-size architectures: built once each (the forward/backward above runs on reduced copies).
TIMM_EQUIV = {
    # ours (with settings of the timm model) -> timm model, parameter counts must agree exactly
    "vitrel_vit_tiny_patch16_224": ("vit_tiny_patch16_224", dict(pos="ape")),
    "vitrel_vit_small_patch16_224": ("vit_small_patch16_224", dict(pos="ape")),
    "vitrel_vit_base_patch16_224": ("vit_base_patch16_224", dict(pos="ape")),
    "vitrel_swin_tiny_patch4_window7_224": ("swin_tiny_patch4_window7_224", dict(pos="rel2d_full")),
    "vitrel_swin_small_patch4_window7_224": ("swin_small_patch4_window7_224", dict(pos="rel2d_full")),
    "vitrel_swin_base_patch4_window7_224": ("swin_base_patch4_window7_224", dict(pos="rel2d_full")),
}


@pytest.mark.parametrize("name", sorted(TIMM_EQUIV))
def test_full_size_architectures_match_timm_parameter_counts(name):
    timm_name, kw = TIMM_EQUIV[name]
    with torch.device("meta"):
        ours = vitrel.create_model(name, **kw)
        ref = timm.create_model(timm_name)
    n_ours = sum(p.numel() for p in ours.parameters())
    n_ref = sum(p.numel() for p in ref.parameters())
    # timm's ViT keeps a (zero-length) class-token slot in pos_embed; ours embeds patches only
    if "_vit_" in name:
        n_ref -= ref.embed_dim
    assert n_ours == n_ref
    assert ours.num_features == ref.num_features


def test_cifar_sizes():
    with torch.device("meta"):
        swin = vitrel.create_model("vitrel_swin_tiny_patch2_window4_32")
        vit = vitrel.create_model("vitrel_vit_small_patch4_32")
    # grids 16 -> 8 -> 4 -> 2 with window 4: stages 2 and 3 see their whole grid, unshifted
    grids = [Grid(16, 16), Grid(8, 8), Grid(4, 4), Grid(2, 2)]
    for stage, g in zip(swin.layers, grids):
        assert stage.build_grid == g
        for blk in stage.blocks:
            win, shift = window_and_shift(g, blk.window_size, blk.shifted)
            assert win == (min(4, g.h), min(4, g.w))
            assert blk.attn.pos.grid == Grid(*win)  # the scheme is built for the window grid
            assert shift == ((2, 2) if blk.shifted and g.h > 4 else (0, 0))
    assert vit.grid == Grid(8, 8) and vit.num_classes == 10 and vit.embed_dim == 384 and len(vit.blocks) == 12


# ---------------------------------------------------------------------------- model surface
def _tiny_vit(**kw):
    torch.manual_seed(0)
    args = dict(depth=2, embed_dim=32, num_heads=2)
    args.update(kw)
    return vitrel.create_model("vitrel_vit_tiny_patch4_32", **args)


def _tiny_swin(**kw):
    torch.manual_seed(0)
    args = dict(embed_dim=16, depths=(2, 2, 1, 1), num_heads=(1, 2, 2, 4))
    args.update(kw)
    return vitrel.create_model("vitrel_swin_tiny_patch2_window4_32", **args)


def test_vit_surface():
    m = _tiny_vit(reg_tokens=3, pos="rel2d_full", abs_pos="ape")
    x = torch.randn(2, 3, 32, 32)
    assert m.num_prefix_tokens == 4
    f = m.forward_features(x)
    assert f.shape == (2, 4 + 64, 32)
    assert m.forward_head(f, pre_logits=True).shape == (2, 32)
    assert torch.equal(m.forward_head(f), m(x))
    assert m.num_features == 32 and m.num_classes == 10
    nwd = m.no_weight_decay()
    assert {"cls_token", "reg_token", "abs_pos.pos_embed"} <= nwd
    assert {f"blocks.{i}.attn.pos.table" for i in range(2)} <= nwd
    names = dict(m.named_parameters())
    assert nwd <= set(names)
    assert not any("qkv" in n or "norm" in n for n in nwd)
    m.reset_classifier(5, global_pool="avg")
    assert m(x).shape == (2, 5) and m.num_classes == 5 and m.vitrel_cfg["num_classes"] == 5
    m.reset_classifier(0)
    assert m(x).shape == (2, 32)
    with pytest.raises(ValueError, match="class_token=True"):
        _tiny_vit(class_token=False, global_pool="token")
    avg = _tiny_vit(class_token=False, global_pool="avg")
    assert avg.num_prefix_tokens == 0 and isinstance(avg.fc_norm, torch.nn.LayerNorm)
    assert avg.forward_features(x).shape == (2, 64, 32)
    for attr in ("pretrained_cfg", "default_cfg"):
        assert getattr(m, attr)["architecture"] == "vitrel_vit_tiny_patch4_32"
    with pytest.raises(ValueError, match="multiple of the patch size"):
        m(torch.randn(1, 3, 30, 32))


def test_swin_surface():
    m = _tiny_swin(abs_pos="sincos2d")
    x = torch.randn(2, 3, 32, 32)
    f = m.forward_features(x)
    assert f.shape == (2, 2, 2, 128)  # NHWC, as timm's Swin
    assert m.forward_head(f, pre_logits=True).shape == (2, 128)
    nwd = m.no_weight_decay()
    tables = {n for n, _ in m.named_parameters() if n.endswith("attn.pos.table")}
    assert len(tables) == 6 and nwd == tables
    m.reset_classifier(3)
    assert m(x).shape == (2, 3)


def test_pos_spec_resolution():
    m = _tiny_vit(pos="ape")
    assert type(m.abs_pos).name == "ape" and all(type(b.attn.pos).name == "none" for b in m.blocks)
    m = _tiny_vit(pos={"name": "rel2d_bucket", "num_buckets": 8, "max_distance": 16})
    assert m.blocks[0].attn.pos.num_buckets == 8
    assert m.vitrel_cfg["pos"] == {"name": "rel2d_bucket", "num_buckets": 8, "max_distance": 16}
    with pytest.raises(ValueError, match="absolute"):
        _tiny_vit(pos="rel2d_full", abs_pos="rel2d_factored")
    with pytest.raises(ValueError, match="already an absolute"):
        _tiny_vit(pos="ape", abs_pos="sincos2d")
    with pytest.raises(ValueError, match="unknown position scheme"):
        _tiny_vit(pos="no_such_scheme")
    with pytest.raises(TypeError, match="by name or config"):
        _tiny_vit(pos=vitrel.build_pos("rel2d_full", num_heads=2, head_dim=16, grid=8))


class _Counter:
    def __init__(self, scheme: PositionScheme):
        self.n = 0
        orig = scheme.bias

        def bias(*a, **k):
            self.n += 1
            return orig(*a, **k)

        scheme.bias = bias


@pytest.mark.parametrize("share", [True, False])
def test_pos_share(share):
    m = _tiny_vit(depth=3, pos="rel2d_full", pos_share=share)
    tables = [n for n in m.state_dict() if n.endswith("table")]
    if share:
        assert tables == ["rel_pos.table"]
        assert all(b.attn.pos is None for b in m.blocks)  # the model owns the scheme, blocks get its state
        counters = [_Counter(m.rel_pos)]
    else:
        assert tables == [f"blocks.{i}.attn.pos.table" for i in range(3)]
        assert len({id(b.attn.pos) for b in m.blocks}) == 3
        counters = [_Counter(b.attn.pos) for b in m.blocks]
    m(torch.randn(2, 3, 32, 32)).sum().backward()
    assert sum(c.n for c in counters) == (1 if share else 3)  # one bias per forward when shared
    if share:  # the shared table gets the gradient of every block
        assert m.rel_pos.table.grad is not None and m.rel_pos.table.grad.abs().sum() > 0
        # a deep copy (EMA) has its own copy of the scheme, still shared by its blocks
        c = copy.deepcopy(m)
        assert c.rel_pos is not m.rel_pos and all(b.attn.pos is None for b in c.blocks)
        x = torch.randn(2, 3, 32, 32)
        torch.testing.assert_close(c(x), m(x))
        assert sum(p.numel() for p in c.parameters()) == sum(p.numel() for p in m.parameters())


def test_swin_pos_share_per_stage():
    m = _tiny_swin(pos="rel2d_factored", pos_share=True)
    counters = []
    for stage in m.layers:
        assert stage.rel_pos is not None and all(b.attn.pos is None for b in stage.blocks)
        counters.append(_Counter(stage.rel_pos))
    keys = [k for k in m.state_dict() if "table" in k]
    assert keys == [f"layers.{i}.rel_pos.{t}" for i in range(4) for t in ("table_h", "table_w")]
    m(torch.randn(1, 3, 32, 32)).sum().backward()
    assert [c.n for c in counters] == [1, 1, 1, 1]  # one bias per stage and forward


@pytest.mark.parametrize("arch", ["vit", "swin"])
@pytest.mark.parametrize("share", [True, False])
def test_grad_checkpointing_gives_same_outputs_and_grads(arch, share):
    m = (_tiny_vit if arch == "vit" else _tiny_swin)(pos="rel2d_full", pos_share=share, drop_path_rate=0.0).double()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    y0 = m(x)
    y0.square().sum().backward()
    g0 = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad(set_to_none=True)
    m.set_grad_checkpointing(True)
    y1 = m(x)
    y1.square().sum().backward()
    torch.testing.assert_close(y1, y0)
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.grad, g0[n], msg=n)


def test_stochastic_depth_and_layer_scale():
    m = _tiny_vit(depth=4, drop_path_rate=0.3, init_values=1e-5)
    rates = [b.drop_path1.drop_prob if hasattr(b.drop_path1, "drop_prob") else 0.0 for b in m.blocks]
    assert rates == pytest.approx([0.0, 0.1, 0.2, 0.3])
    assert torch.allclose(m.blocks[0].ls1.gamma, torch.full((32,), 1e-5))
    x = torch.randn(2, 3, 32, 32)
    m.eval()
    assert torch.equal(m(x), m(x))  # no randomness in eval
    m.train()
    torch.manual_seed(1)
    a = m(x)
    torch.manual_seed(2)
    assert not torch.equal(a, m(x))


# ---------------------------------------------------------------------------- Swin windows
def _ref_window_id(r: int, shift: int, win: int) -> int:
    """Shifted window of image row/column ``r``, straight from the definition (floor division)."""
    return math.floor((r - shift) / win)


@pytest.mark.parametrize(
    "h,w,window,shifted",
    [(8, 8, 4, True), (8, 8, 4, False), (6, 10, 4, True), (6, 10, 4, False), (12, 9, 4, True), (4, 4, 4, True)],
)
def test_shifted_windows_match_dense_reference(h, w, window, shifted):
    """Dense full-image attention with the window structure as a mask equals the block's attention
    (assembled from its windows), including exact zeros across the wrap-around seam and padding."""
    torch.manual_seed(0)
    heads, dim = 2, 8
    blk = SwinBlock(dim, heads, (window, window), shifted=shifted, pos="rel2d_full", build_grid=(h, w)).double()
    with torch.no_grad():
        blk.attn.pos.table.normal_(0, 1.0)
    x = torch.randn(2, h, w, dim, dtype=torch.float64)
    dense = blk.dense_attention(x)  # [B, heads, HW, HW]

    (wh, ww), (sh, sw) = window_and_shift(Grid(h, w), (window, window), shifted)
    if shifted and h > window:
        assert sh > 0  # the case really shifts
    rows = [r for r in range(h) for _ in range(w)]
    cols = [c for _ in range(h) for c in range(w)]
    allowed = torch.zeros(h * w, h * w, dtype=torch.bool)
    for i in range(h * w):
        for j in range(h * w):
            allowed[i, j] = _ref_window_id(rows[i], sh, wh) == _ref_window_id(rows[j], sh, wh) and _ref_window_id(
                cols[i], sw, ww
            ) == _ref_window_id(cols[j], sw, ww)
    # reference probabilities: q k^T / sqrt(d) + table[dh, dw] on the full image, masked
    xn = blk.norm1(x).reshape(2, h * w, dim)
    qkv = xn @ blk.attn.qkv.weight.t() + blk.attn.qkv.bias
    q, k, _ = qkv.reshape(2, h * w, 3, heads, dim // heads).permute(2, 0, 3, 1, 4)
    table = blk.attn.pos.table  # [2 wh - 1, 2 ww - 1, heads]
    r, c = torch.tensor(rows), torch.tensor(cols)
    dh, dw = r[:, None] - r[None, :], c[:, None] - c[None, :]
    th, tw = (table.shape[0] - 1) // 2, (table.shape[1] - 1) // 2
    bias = table[(dh.clamp(-th, th) + th), (dw.clamp(-tw, tw) + tw)].permute(2, 0, 1)
    logits = q @ k.transpose(-1, -2) / math.sqrt(dim // heads) + bias
    ref = logits.masked_fill(~allowed, float("-inf")).softmax(-1)
    torch.testing.assert_close(dense, ref.detach())
    assert (dense[..., ~allowed] == 0).all()  # exactly zero across the seam / between windows
    assert (dense[..., allowed] > 0).all()
    torch.testing.assert_close(dense.sum(-1), torch.ones(2, heads, h * w, dtype=torch.float64))


def test_seam_pairs_are_masked_in_the_window_mask():
    # 8x8, window 4, shift 2: in the rolled map the last window row holds image rows 6,7 | 0,1
    m = shifted_window_mask(Grid(8, 8), (4, 4), (2, 2))
    assert m.shape == (4, 16, 16)
    last = m[3]  # bottom-right window: 4 quadrants of 2x2, none may see another
    quad = torch.tensor([(r // 2) * 2 + (c // 2) for r in range(4) for c in range(4)])
    assert torch.equal(last == 0, quad[:, None] == quad[None, :])
    assert torch.equal(m[0], torch.zeros(16, 16))  # top-left window: no seam
    assert shifted_window_mask(Grid(8, 8), (4, 4), (0, 0)) is None
    pad = shifted_window_mask(Grid(6, 6), (4, 4), (0, 0))  # padding only
    assert pad is not None and torch.isinf(pad).any()


# ---------------------------------------------------------------------------- equal to timm
def _from_timm(ref: torch.nn.Module, ours: torch.nn.Module, table_key: str) -> None:
    """Load timm's weights into ours: flat ``[(2H-1)(2W-1), heads]`` tables -> ``[2H-1, 2W-1, heads]``."""
    sd = {}
    own = ours.state_dict()
    for k, v in ref.state_dict().items():
        if k.endswith(table_key):
            k = k.replace(table_key, "pos.table")
            v = v.reshape(own[k].shape)
        sd[k.replace("head.fc.", "head.")] = v
    ours.load_state_dict(sd, strict=True)


def test_swin_equals_timm_swin():
    """Same weights -> same outputs as timm's Swin (rel2d_full, grid a multiple of the window, shrinking
    windows in the last stages)."""
    args = dict(img_size=64, embed_dim=16, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4), window_size=4)
    ref = timm.create_model("swin_tiny_patch4_window7_224", num_classes=7, drop_path_rate=0.0, **args).double().eval()
    ours = vitrel.create_model(
        "vitrel_swin_tiny_patch4_window7_224", pos="rel2d_full", num_classes=7, drop_path_rate=0.0, **args
    )
    ours = ours.double().eval()
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "relative_position_bias_table" in n:
                p.normal_(0, 1.0)  # large, so a wrong table layout would show
    _from_timm(ref, ours, "relative_position_bias_table")
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    torch.testing.assert_close(ours(x), ref(x))


def test_vit_equals_timm_vit_relpos():
    args = dict(img_size=64, embed_dim=32, depth=2, num_heads=2)
    ref = timm.create_model("vit_relpos_small_patch16_224", rel_pos_type="bias", num_classes=5, **args)
    ours = vitrel.create_model(
        "vitrel_vit_small_patch16_224",
        pos="rel2d_full",
        class_token=False,
        global_pool="avg",
        qkv_bias=False,
        init_values=1e-6,
        num_classes=5,
        **args,
    )
    ref, ours = ref.double().eval(), ours.double().eval()
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.normal_(0, 0.3 if "table" in n or "gamma" in n else 0.05)
    _from_timm(ref, ours, "rel_pos.relative_position_bias_table")
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    torch.testing.assert_close(ours(x), ref(x))
