"""``vitrel.from_videomae`` (vitrel/models/videomae_import.py) against VideoMAE's network, written from the authors'
code (MCG-NJU/VideoMAE ``modeling_finetune.py``: ``PatchEmbed``, ``get_sinusoid_encoding_table``, ``Attention`` with
``q_bias`` / ``v_bias``, ``Block`` with and without ``gamma_1`` / ``gamma_2``, ``VisionTransformer`` with
``use_mean_pooling``), on checkpoints saved in their layouts: a fine-tuned ``{"model": ...}``, DeepSpeed's
``{"module": ...}``, and a pre-training checkpoint (``encoder.`` / ``decoder.`` keys, ``modeling_pretrain.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import vitrel
from vitrel.models.checkpoint import CheckpointError

DIM, HEADS, DEPTH, HIDDEN, CLASSES = 64, 2, 2, 128, 5


def sinusoid_table(n_position: int, d_hid: int) -> torch.Tensor:
    """Their ``get_sinusoid_encoding_table`` (float64 here; they store it as float32)."""

    def get_position_angle_vec(position):
        return [position / np.power(10000, 2 * (hid_j // 2) / d_hid) for hid_j in range(d_hid)]

    sinusoid_table = np.array([get_position_angle_vec(pos_i) for pos_i in range(n_position)])
    sinusoid_table[:, 0::2] = np.sin(sinusoid_table[:, 0::2])
    sinusoid_table[:, 1::2] = np.cos(sinusoid_table[:, 1::2])
    return torch.tensor(sinusoid_table, dtype=torch.float64)[None]


def authors_network(sd: dict[str, torch.Tensor], x: torch.Tensor, heads: int) -> torch.Tensor:
    """Their ``VisionTransformer.forward`` (``use_mean_pooling=True``, ``qkv_bias=True``, the fixed table, LayerNorm
    eps 1e-6 as their ``vit_*_patch16_224``) on clips ``[B, C, T, H, W]``: logits, or the pooled features without a
    head."""
    w = sd["patch_embed.proj.weight"]
    t, p = w.shape[2], w.shape[3]
    x = F.conv3d(x, w, sd["patch_embed.proj.bias"], stride=(t, p, p)).flatten(2).transpose(1, 2)
    B, N, C = x.shape
    x = x + sinusoid_table(N, C).type_as(x)
    for i in range(1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks."))):
        b = {k[len(f"blocks.{i}.") :]: v for k, v in sd.items() if k.startswith(f"blocks.{i}.")}
        y = F.layer_norm(x, (C,), b["norm1.weight"], b["norm1.bias"], 1e-6)
        qkv_bias = torch.cat((b["attn.q_bias"], torch.zeros_like(b["attn.v_bias"]), b["attn.v_bias"]))
        qkv = F.linear(y, b["attn.qkv.weight"], qkv_bias).reshape(B, N, 3, heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0] * (C // heads) ** -0.5, qkv[1], qkv[2]
        y = (q @ k.transpose(-2, -1)).softmax(dim=-1) @ v
        y = F.linear(y.transpose(1, 2).reshape(B, N, -1), b["attn.proj.weight"], b["attn.proj.bias"])
        x = x + (b["gamma_1"] * y if "gamma_1" in b else y)
        y = F.layer_norm(x, (C,), b["norm2.weight"], b["norm2.bias"], 1e-6)
        y = F.gelu(F.linear(y, b["mlp.fc1.weight"], b["mlp.fc1.bias"]))
        y = F.linear(y, b["mlp.fc2.weight"], b["mlp.fc2.bias"])
        x = x + (b["gamma_2"] * y if "gamma_2" in b else y)
    x = F.layer_norm(x.mean(1), (C,), sd["fc_norm.weight"], sd["fc_norm.bias"], 1e-6)
    return F.linear(x, sd["head.weight"], sd["head.bias"]) if "head.weight" in sd else x


def network_weights(seed: int, dim: int = DIM, depth: int = DEPTH, scale: bool = False, head: bool = True):
    """A random fine-tuned network in their parameter names (float64): 3 channels, tubelets of 2 x 4 x 4."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"patch_embed.proj.weight": (dim, 3, 2, 4, 4), "patch_embed.proj.bias": (dim,)}
    for i in range(depth):
        shapes.update({
            f"blocks.{i}.norm1.weight": (dim,), f"blocks.{i}.norm1.bias": (dim,),
            f"blocks.{i}.attn.q_bias": (dim,), f"blocks.{i}.attn.v_bias": (dim,),
            f"blocks.{i}.attn.qkv.weight": (3 * dim, dim),
            f"blocks.{i}.attn.proj.weight": (dim, dim), f"blocks.{i}.attn.proj.bias": (dim,),
            f"blocks.{i}.norm2.weight": (dim,), f"blocks.{i}.norm2.bias": (dim,),
            f"blocks.{i}.mlp.fc1.weight": (HIDDEN, dim), f"blocks.{i}.mlp.fc1.bias": (HIDDEN,),
            f"blocks.{i}.mlp.fc2.weight": (dim, HIDDEN), f"blocks.{i}.mlp.fc2.bias": (dim,),
        })  # fmt: skip
        if scale:
            shapes.update({f"blocks.{i}.gamma_1": (dim,), f"blocks.{i}.gamma_2": (dim,)})
    shapes.update({"fc_norm.weight": (dim,), "fc_norm.bias": (dim,)})
    if head:
        shapes.update({"head.weight": (CLASSES, dim), "head.bias": (CLASSES,)})
    return {k: torch.randn(s, generator=g, dtype=torch.float64) * 0.3 for k, s in shapes.items()}


@pytest.mark.parametrize("scale", [False, True])
def test_a_fine_tuned_checkpoint_computes_their_function_and_gradients(scale, tmp_path):
    """Logits equal theirs in float64 at the built clip and at another length and size (their table made for the
    new token count, as their fine-tuning does), and so do the input's and a block's gradients; another scheme
    (``rel3d_full``, their weights without their table) differs."""
    sd = network_weights(0, scale=scale)
    path = tmp_path / "checkpoint.pth"
    torch.save({"model": sd, "epoch": 29}, path)
    m = vitrel.from_videomae(path, num_heads=HEADS, img_size=16, num_frames=4).eval()
    assert m.num_classes == CLASSES and m.blocks[0].attn.pos.name == "none" and m.abs_pos.name == "sincos1d"
    for shape in [(2, 3, 4, 16, 16), (1, 3, 6, 12, 20)]:
        x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
        ours, theirs = m(x), authors_network(sd, x, HEADS)
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10)
        (gx,) = torch.autograd.grad(ours.square().sum(), x)
        (want,) = torch.autograd.grad(theirs.square().sum(), x)
        torch.testing.assert_close(gx, want, rtol=1e-10, atol=1e-10)
    other = vitrel.from_videomae(path, num_heads=HEADS, img_size=16, num_frames=4, pos="rel3d_full").eval()
    x = torch.randn(2, 3, 4, 16, 16, dtype=torch.float64)
    assert (other(x) - authors_network(sd, x, HEADS)).abs().max() > 1e-3


def test_deepspeed_and_pretraining_layouts(tmp_path):
    """DeepSpeed's ``{"module": ...}`` reads as ``{"model": ...}``. A pre-training checkpoint gives the encoder their
    fine-tuning starts from: its blocks bit for bit, the encoder's final norm and the decoder left out, a new
    ``fc_norm`` and head; with those, their fine-tuning network's function."""
    sd = network_weights(1)
    a = vitrel.from_videomae({"module": sd}, num_heads=HEADS, img_size=16, num_frames=4)
    b = vitrel.from_videomae({"model": sd}, num_heads=HEADS, img_size=16, num_frames=4)
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())
    encoder = {k: v for k, v in network_weights(2, head=False).items() if not k.startswith("fc_norm.")}
    pre = {f"encoder.{k}": v for k, v in encoder.items()}
    pre |= {"encoder.norm.weight": torch.ones(DIM, dtype=torch.float64), "encoder.norm.bias": torch.zeros(DIM)}
    pre |= {"decoder.blocks.0.norm1.weight": torch.ones(8), "encoder_to_decoder.weight": torch.ones(8, DIM)}
    pre |= {"mask_token": torch.zeros(1, 1, 8)}
    m = vitrel.from_videomae({"model": pre}, num_heads=HEADS, num_classes=3, img_size=16, num_frames=4).eval()
    ours = m.state_dict()
    assert all(torch.equal(ours[k], v) for k, v in encoder.items()) and m.num_classes == 3
    assert "norm.weight" not in ours and ours["head.weight"].shape == (3, DIM)
    full = encoder | {k: ours[k] for k in ("fc_norm.weight", "fc_norm.bias", "head.weight", "head.bias")}
    x = torch.randn(2, 3, 4, 16, 16, dtype=torch.float64)
    torch.testing.assert_close(m(x), authors_network(full, x, HEADS), rtol=1e-10, atol=1e-10)
    features = vitrel.from_videomae({"model": pre}, num_heads=HEADS, img_size=16, num_frames=4)
    assert features.num_classes == 0


def test_refusals_name_what_does_not_fit(tmp_path):
    sd = network_weights(3)
    with pytest.raises(CheckpointError, match="width 64 is none of VideoMAE's"):
        vitrel.from_videomae({"model": sd})
    with pytest.raises(CheckpointError, match="64 wide, VideoMAE's vit_small 384"):
        vitrel.from_videomae({"model": sd}, "vit_small")
    with pytest.raises(CheckpointError, match="learned pos_embed"):
        vitrel.from_videomae({"model": sd | {"pos_embed": torch.zeros(1, 32, DIM)}}, num_heads=HEADS)
    with pytest.raises(CheckpointError, match="use_mean_pooling=False"):
        vitrel.from_videomae({"model": sd | {"norm.weight": torch.ones(DIM)}}, num_heads=HEADS)
    with pytest.raises(CheckpointError, match="no such file"):
        vitrel.from_videomae(tmp_path / "missing.pth")
    with pytest.raises(CheckpointError, match=r"the checkpoint has no 'ema' \(it holds \['model'\]\)"):
        vitrel.from_videomae({"model": sd}, key="ema", num_heads=HEADS)
    with pytest.raises(ValueError, match="VideoMAE's checkpoints are on cloud drives"):
        vitrel.create_model("vitrel_vit_video_tiny_patch4_32", init_from="videomae:vit_small")


def test_init_from_route_reads_their_file_at_their_width(tmp_path):
    """``create_model(init_from="videomae:vit_small", init_file=...)``: ViT-S's width (384, 6 heads), the data's
    classes as a new head, the model saved and loaded as any vitrel model computes the same."""
    sd = {k: v.float() for k, v in network_weights(4, dim=384, depth=1).items()}
    path = tmp_path / "vit_s.pth"
    torch.save({"model": sd}, path)
    m = vitrel.create_model(
        "vitrel_vit_video_tiny_patch4_32", init_from="videomae:vit_small", init_file=str(path), num_classes=2,
        img_size=16, num_frames=4,
    ).eval()  # fmt: skip
    assert (m.vitrel_cfg["embed_dim"], m.vitrel_cfg["num_heads"], m.num_classes) == (384, 6, 2)
    assert m.pretrained_cfg["mean"] == pytest.approx((0.485, 0.456, 0.406)) and m.pretrained_cfg["num_frames"] == 4
    vitrel.models.save_pretrained(m, tmp_path / "export")
    again = vitrel.load_model(tmp_path / "export").eval()
    x = torch.randn(1, 3, 4, 16, 16)
    torch.testing.assert_close(again(x), m(x))


def _hf_model(cls_name: str, **config):
    """Hugging Face transformers' VideoMAE port at a small size (its default layer_norm_eps, 1e-12), every weight
    random (float64)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.VideoMAEConfig(
        image_size=16, patch_size=4, num_frames=4, tubelet_size=2, hidden_size=DIM, num_hidden_layers=DEPTH,
        num_attention_heads=HEADS, intermediate_size=HIDDEN, qkv_bias=True, use_mean_pooling=True, **config,
    )  # fmt: skip
    torch.manual_seed(7)
    m = getattr(transformers, cls_name)(cfg).double().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return m


def test_hugging_faces_port_reads_as_the_same_function(tmp_path, monkeypatch):
    """A ``VideoMAEForVideoClassification`` saved with ``save_pretrained``: its folder (heads and sizes from
    ``config.json``) gives its logits in float64 (at its one clip size: its patch embedding takes no other), read
    with the authors' eps; a ``VideoMAEForPreTraining`` folder and a bare ``VideoMAEModel``'s give its encoder's
    tokens; ``"hf-hub:<repo>"``
    reads the folder the hub download gives. The port is compared with the authors' eps (1e-6; its own are 1e-12
    and 1e-5) and their table in float64 (the port stores it in float32): each alone moves these logits by 1e-7 to
    1e-6."""
    hf = _hf_model("VideoMAEForVideoClassification", num_labels=CLASSES)
    hf.save_pretrained(tmp_path / "hf")
    m = vitrel.from_videomae(tmp_path / "hf").eval()
    assert (m.vitrel_cfg["num_heads"], m.vitrel_cfg["norm_eps"], m.num_classes) == (HEADS, 1e-6, CLASSES)
    hf.videomae.embeddings.position_embeddings = sinusoid_table(32, DIM)
    for norm in (mod for mod in hf.modules() if isinstance(mod, torch.nn.LayerNorm)):
        norm.eps = 1e-6
    x = torch.randn(2, 3, 4, 16, 16, dtype=torch.float64)
    with torch.no_grad():
        want = hf(pixel_values=x.permute(0, 2, 1, 3, 4)).logits  # (theirs takes [B, T, C, H, W])
        torch.testing.assert_close(m(x), want, rtol=1e-10, atol=1e-10)
    pre = _hf_model("VideoMAEForPreTraining", decoder_hidden_size=16, decoder_num_hidden_layers=1,
                    decoder_num_attention_heads=2, decoder_intermediate_size=32)  # fmt: skip
    pre.save_pretrained(tmp_path / "pre")
    pre.videomae.embeddings.position_embeddings = sinusoid_table(32, DIM)
    for norm in (mod for mod in pre.modules() if isinstance(mod, torch.nn.LayerNorm)):
        norm.eps = 1e-6
    enc = vitrel.from_videomae(tmp_path / "pre" / "model.safetensors", num_heads=HEADS, num_classes=3)
    pre.videomae.save_pretrained(tmp_path / "bare")  # (a VideoMAEModel: its blocks under encoder.layer.)
    bare = vitrel.from_videomae(tmp_path / "bare", num_classes=3)
    with torch.no_grad():
        tokens = pre.videomae(pixel_values=x.permute(0, 2, 1, 3, 4)).last_hidden_state
        torch.testing.assert_close(enc.eval().forward_features(x), tokens, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(bare.eval().forward_features(x), tokens, rtol=1e-10, atol=1e-10)
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo, **kw: str(tmp_path / "hf"))
    hub = vitrel.from_videomae("hf-hub:MCG-NJU/videomae-base-finetuned-kinetics").eval()
    torch.testing.assert_close(hub(x), m(x), rtol=0, atol=0)


def test_an_imported_network_exports_for_every_clip_size(tmp_path, one_torchlib_registry):
    """``python -m vitrel.export <saved from_videomae model> out --pt2 --onnx``: the program (and ONNX Runtime's
    model) equal the model at the traced clip and at another length and frame size (their table made for each
    token count)."""
    from tests.models.test_video_export import assert_programs_match, exported
    from vitrel.export import best_dynamic

    m = vitrel.from_videomae({"model": network_weights(8)}, num_heads=HEADS, img_size=16, num_frames=4).float().eval()
    assert best_dynamic(m) == "hw"
    vitrel.models.save_pretrained(m, tmp_path / "videomae")
    out = exported(tmp_path / "videomae", tmp_path / "out")
    assert_programs_match(m, out, [(2, 3, 4, 16, 16), (1, 3, 6, 12, 20)])


def test_videomae_v2s_giant_reads_as_their_function():
    """VideoMAE V2's ViT-g/14 (OpenGVLab/VideoMAEv2 ``vit_giant_patch14_224``: width 1408, 16 heads, MLP 48/11,
    14-px patches; their ``modeling_finetune.py`` has v1's modules), one block, in DeepSpeed's ``{"module": ...}``:
    their function (written above from v1's code); their cosine attention is refused by name."""
    g = torch.Generator().manual_seed(9)
    sd = network_weights(9, dim=1408, depth=1)
    sd["patch_embed.proj.weight"] = torch.randn(1408, 3, 2, 14, 14, generator=g, dtype=torch.float64) * 0.02
    sd["blocks.0.mlp.fc1.weight"] = torch.randn(6144, 1408, generator=g, dtype=torch.float64) * 0.02
    sd["blocks.0.mlp.fc1.bias"] = torch.randn(6144, generator=g, dtype=torch.float64) * 0.02
    sd["blocks.0.mlp.fc2.weight"] = torch.randn(1408, 6144, generator=g, dtype=torch.float64) * 0.02
    m = vitrel.from_videomae({"module": sd}, "vit_giant", img_size=28, num_frames=2).eval()
    assert (m.vitrel_cfg["patch_size"], m.blocks[0].mlp.fc1.out_features) == (14, 6144)
    x = torch.randn(1, 3, 2, 28, 28, dtype=torch.float64)
    torch.testing.assert_close(m(x), authors_network(sd, x, 16), rtol=1e-10, atol=1e-10)
    with pytest.raises(CheckpointError, match="cosine attention"):
        vitrel.from_videomae({"module": sd | {"blocks.0.attn.scale": torch.zeros(16, 1, 1)}}, "vit_giant")
