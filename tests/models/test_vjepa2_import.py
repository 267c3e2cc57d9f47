"""``vitrel.from_vjepa2`` (vitrel/models/vjepa2_import.py) against V-JEPA 2's encoder, written from the authors' code
(facebookresearch/vjepa2: ``src/models/vision_transformer.py``, ``src/models/utils/modules.py``, ``PatchEmbed3D``),
on checkpoints saved in their layout: ``{"encoder", "target_encoder", "predictor"}``, keys under ``module.backbone.``,
with the ``pos_embed`` their RoPE encoders store and never add."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import vitrel
from tests.pos.test_rope3d_vjepa2 import released_qk
from vitrel.layout.geometry import Grid3
from vitrel.models.checkpoint import CheckpointError

DIM, HEADS, DEPTH, HIDDEN = 64, 2, 2, 128  # head_dim 32: 5 rotary pairs an axis, 2 channels unrotated


def authors_encoder(sd: dict[str, torch.Tensor], x: torch.Tensor, heads: int) -> torch.Tensor:
    """Their ``VisionTransformer.forward`` with ``use_rope=True`` on clips ``[B, C, T, H, W]`` (no masks):
    ``PatchEmbed3D``, pre-norm ``Block``s (``RoPEAttention`` over the ``T' x H' x W'`` grid, GELU ``MLP``),
    ``self.norm``; LayerNorm eps 1e-6 (their ``vit_*``)."""
    w = sd["patch_embed.proj.weight"]
    t, p = w.shape[2], w.shape[3]
    grid = Grid3(x.shape[2] // t, x.shape[3] // p, x.shape[4] // p)
    x = F.conv3d(x, w, sd["patch_embed.proj.bias"], stride=(t, p, p)).flatten(2).transpose(1, 2)
    B, N, C = x.shape
    for i in range(1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks."))):
        b = {k[len(f"blocks.{i}.") :]: v for k, v in sd.items() if k.startswith(f"blocks.{i}.")}
        y = F.layer_norm(x, (C,), b["norm1.weight"], b["norm1.bias"], 1e-6)
        qkv = F.linear(y, b["attn.qkv.weight"], b["attn.qkv.bias"]).unflatten(-1, (3, heads, -1)).permute(2, 0, 3, 1, 4)
        q, k, v = released_qk(qkv[0], grid), released_qk(qkv[1], grid), qkv[2]
        a = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(C // heads), dim=-1) @ v
        x = x + F.linear(a.transpose(1, 2).reshape(B, N, C), b["attn.proj.weight"], b["attn.proj.bias"])
        y = F.layer_norm(x, (C,), b["norm2.weight"], b["norm2.bias"], 1e-6)
        y = F.linear(
            F.gelu(F.linear(y, b["mlp.fc1.weight"], b["mlp.fc1.bias"])), b["mlp.fc2.weight"], b["mlp.fc2.bias"]
        )
        x = x + y
    return F.layer_norm(x, (C,), sd["norm.weight"], sd["norm.bias"], 1e-6)


def encoder_weights(seed: int, dim: int = DIM, depth: int = DEPTH, hidden: int = HIDDEN) -> dict[str, torch.Tensor]:
    """A random encoder in their parameter names (float64), ``pos_embed`` included."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"patch_embed.proj.weight": (dim, 3, 2, 4, 4), "patch_embed.proj.bias": (dim,), "pos_embed": (1, 8, dim)}
    for i in range(depth):
        shapes.update({
            f"blocks.{i}.norm1.weight": (dim,), f"blocks.{i}.norm1.bias": (dim,),
            f"blocks.{i}.attn.qkv.weight": (3 * dim, dim), f"blocks.{i}.attn.qkv.bias": (3 * dim,),
            f"blocks.{i}.attn.proj.weight": (dim, dim), f"blocks.{i}.attn.proj.bias": (dim,),
            f"blocks.{i}.norm2.weight": (dim,), f"blocks.{i}.norm2.bias": (dim,),
            f"blocks.{i}.mlp.fc1.weight": (hidden, dim), f"blocks.{i}.mlp.fc1.bias": (hidden,),
            f"blocks.{i}.mlp.fc2.weight": (dim, hidden), f"blocks.{i}.mlp.fc2.bias": (dim,),
        })  # fmt: skip
    shapes.update({"norm.weight": (dim,), "norm.bias": (dim,)})
    sd = {k: torch.randn(s, generator=g, dtype=torch.float64) * 0.3 for k, s in shapes.items()}
    for k in sd:
        if "norm" in k and k.endswith("weight"):
            sd[k] = 1 + sd[k]
    return sd


def released_layout(encoder: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> dict:
    """A checkpoint as their training saves it (DDP's ``module.``, the ``backbone.`` of their wrapper)."""
    prefixed = lambda sd: {f"module.backbone.{k}": v for k, v in sd.items()}  # noqa: E731
    return {"encoder": prefixed(encoder), "target_encoder": prefixed(target), "predictor": {"x": torch.zeros(1)}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("vjepa2") / "vitl.pt"
    enc, target = encoder_weights(0), encoder_weights(1)
    torch.save(released_layout(enc, target), path)
    return path, enc, target


@pytest.mark.parametrize("clip", [(4, 8, 12), (6, 12, 8)])
def test_equals_the_authors_encoder(checkpoint, clip):
    """Features (every token, normalised) equal theirs in float64 at two clip shapes: the target encoder by default,
    the online one with ``key="encoder"``."""
    path, enc, target = checkpoint
    x = torch.randn(2, 3, *clip, dtype=torch.float64)
    for key, sd in ((None, target), ("encoder", enc)):
        m = vitrel.from_vjepa2(path, key=key, num_heads=HEADS).double().eval()
        torch.testing.assert_close(m.forward_features(x), authors_encoder(sd, x, HEADS), rtol=1e-10, atol=1e-10)
    # the documented fix (rope3d_axial) is another function of the same weights: the comparison can fail
    fixed = vitrel.from_vjepa2(path, num_heads=HEADS, pos="rope3d_axial").double().eval()
    assert (fixed.forward_features(x) - authors_encoder(target, x, HEADS)).abs().max() > 1e-3


def test_reads_the_architecture_and_the_preprocessing(checkpoint):
    path, _, _ = checkpoint
    m = vitrel.from_vjepa2(path, num_heads=HEADS, num_classes=7)
    cfg = m.vitrel_cfg
    assert (cfg["embed_dim"], cfg["depth"], cfg["num_heads"], cfg["tubelet_size"], cfg["patch_size"]) == (
        64,
        2,
        2,
        2,
        4,
    )
    assert cfg["mlp_ratio"] == 2.0 and cfg["class_token"] is False and cfg["pos"] == "rope3d_vjepa2"
    assert m(torch.randn(1, 3, 4, 8, 8, dtype=torch.float64)).shape == (1, 7)  # (built in the file's precision)
    dc = m.pretrained_cfg
    assert dc["mean"] == (0.485, 0.456, 0.406) and dc["num_frames"] == 16 and dc["crop_pct"] == 224 / 256


def test_released_widths_give_their_heads():
    """ViT-g's 1408 channels are their vit_giant_xformers' 22 heads of 64, not vit_giant's 16 of 88."""
    sd = encoder_weights(2, dim=1408, depth=1, hidden=16)
    m = vitrel.from_vjepa2({"target_encoder": sd})
    assert m.vitrel_cfg["num_heads"] == 22 and m.blocks[0].attn.pos.sections == (10, 10, 10)


def test_another_scheme_starts_from_their_weights(checkpoint):
    """A learned scheme gets fresh parameters, the rest is theirs."""
    path, _, target = checkpoint
    m = vitrel.from_vjepa2(path, num_heads=HEADS, pos="rel3d_factored")
    torch.testing.assert_close(m.blocks[1].mlp.fc1.weight.double(), target["blocks.1.mlp.fc1.weight"])
    assert any(".attn.pos." in k for k in m.state_dict())


def test_clear_errors(checkpoint, tmp_path):
    path, enc, _ = checkpoint
    with pytest.raises(CheckpointError, match="no such file"):
        vitrel.from_vjepa2(tmp_path / "missing.pt")
    with pytest.raises(CheckpointError, match="no 'ema'"):
        vitrel.from_vjepa2(path, key="ema", num_heads=HEADS)
    with pytest.raises(CheckpointError, match="give num_heads"):
        vitrel.from_vjepa2(path)
    with pytest.raises(CheckpointError, match="not a V-JEPA 2 encoder"):
        vitrel.from_vjepa2({"model": {"head.weight": torch.zeros(2, 2)}}, key="model")
    with pytest.raises(ValueError, match="released encoders"):
        vitrel.from_vjepa2(path, name="vit_small")
    with pytest.raises(CheckpointError, match="1024"):
        vitrel.from_vjepa2(path, name="vit_large")
    swiglu = dict(enc, **{"blocks.0.mlp.fc3.weight": torch.zeros(DIM, HIDDEN)})
    with pytest.raises(CheckpointError, match="SwiGLU"):
        vitrel.from_vjepa2({"encoder": swiglu}, num_heads=HEADS)


def test_saves_and_loads_as_a_vitrel_model(checkpoint, tmp_path):
    """An export folder of the import (what ``train.py model=from_checkpoint`` starts from) loads as the same
    function with the same scheme and preprocessing; another ``num_classes`` gives a new head."""
    path, _, _ = checkpoint
    m = vitrel.from_vjepa2(path, num_heads=HEADS).float().eval()
    vitrel.models.save_pretrained(m, tmp_path / "export")
    back = vitrel.load_model(tmp_path / "export", num_classes=5).eval()
    x = torch.randn(1, 3, 4, 8, 8)
    torch.testing.assert_close(back.forward_features(x), m.forward_features(x), rtol=0, atol=0)
    assert back.vitrel_cfg["pos"] == "rope3d_vjepa2" and back(x).shape == (1, 5)
    assert back.pretrained_cfg["crop_pct"] == 224 / 256 and back.pretrained_cfg["num_frames"] == 16


def test_features_only_gives_the_blocks_maps(checkpoint):
    """``features_only=True``: timm's backbone of the import, the blocks' tubelet maps ``[B, C, T', H', W']`` as
    the import's ``forward_intermediates``."""
    path, _, _ = checkpoint
    m = vitrel.from_vjepa2(path, num_heads=HEADS).eval()
    f = vitrel.from_vjepa2(path, num_heads=HEADS, features_only=True, out_indices=(0, 1)).eval()
    x = torch.randn(2, 3, 4, 8, 12, dtype=torch.float64)
    maps = f(x)
    assert [tuple(t.shape) for t in maps] == [(2, DIM, 2, 2, 3)] * 2
    for got, want in zip(maps, m.forward_intermediates(x, indices=[0, 1], intermediates_only=True)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
