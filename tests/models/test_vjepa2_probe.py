"""V-JEPA 2's attentive probes: ``vitrel.from_vjepa2(..., probe=...)`` (vitrel/models/vjepa2_import.py) and the pool
it builds (``attn_pool_type="attentive"``, vitrel/layers/attentive_pool.py) against their classifier, written from
the authors' code (facebookresearch/vjepa2 ``src/models/attentive_pooler.py``: ``AttentiveClassifier``,
``AttentivePooler``; ``src/models/utils/modules.py``: ``Block``, ``Attention``, ``CrossAttentionBlock``,
``CrossAttention``, ``MLP``), on probe files saved as their evaluation saves them (``{"classifiers": [state dicts of
DDP-wrapped classifiers], "opt", "scaler", "epoch"}``)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import vitrel
from tests.models.test_vjepa2_import import DIM, HEADS, authors_encoder, encoder_weights, released_layout
from vitrel.models.checkpoint import CheckpointError

PROBE_HEADS, CLASSES = 4, 5  # (a probe's heads are its own: 16 over ViT-g's 22 in theirs)


def _ln(x, sd, name):
    return F.layer_norm(x, (x.shape[-1],), sd[f"{name}.weight"], sd[f"{name}.bias"], 1e-5)  # nn.LayerNorm's default


def _mlp(x, sd, name):
    return F.linear(F.gelu(F.linear(x, sd[f"{name}.fc1.weight"], sd[f"{name}.fc1.bias"])), *_lin(sd, f"{name}.fc2"))


def _lin(sd, name):
    return sd[f"{name}.weight"], sd[f"{name}.bias"]


def authors_classifier(sd: dict[str, torch.Tensor], x: torch.Tensor, heads: int) -> torch.Tensor:
    """Their ``AttentiveClassifier.forward`` on tokens ``[B, N, C]``: the pooler's ``Block``s (``x + attn(norm1 x)``,
    ``x + mlp(norm2 x)``), the query repeated over the batch, ``CrossAttentionBlock`` (``q + xattn(q, norm1 x)``,
    ``q + mlp(norm2 q)``, no output projection), ``.squeeze(1)``, ``linear``."""
    B, N, C = x.shape
    d = C // heads
    for i in sorted({int(k.split(".")[2]) for k in sd if k.startswith("pooler.blocks.")}):
        b = f"pooler.blocks.{i}"
        qkv = F.linear(_ln(x, sd, f"{b}.norm1"), *_lin(sd, f"{b}.attn.qkv")).reshape(B, N, 3, heads, d)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        a = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d), dim=-1) @ v
        x = x + F.linear(a.transpose(1, 2).reshape(B, N, C), *_lin(sd, f"{b}.attn.proj"))
        x = x + _mlp(_ln(x, sd, f"{b}.norm2"), sd, f"{b}.mlp")
    c = "pooler.cross_attention_block"
    q = sd["pooler.query_tokens"].repeat(B, 1, 1)
    kv = F.linear(_ln(x, sd, f"{c}.norm1"), *_lin(sd, f"{c}.xattn.kv")).reshape(B, N, 2, heads, d)
    k, v = kv.permute(2, 0, 3, 1, 4)
    qh = F.linear(q, *_lin(sd, f"{c}.xattn.q")).reshape(B, 1, heads, d).permute(0, 2, 1, 3)
    a = torch.softmax(qh @ k.transpose(-2, -1) / math.sqrt(d), dim=-1) @ v
    q = q + a.transpose(1, 2).reshape(B, 1, C)
    q = q + _mlp(_ln(q, sd, f"{c}.norm2"), sd, f"{c}.mlp")
    return F.linear(q.squeeze(1), *_lin(sd, "linear"))


def probe_weights(seed: int, depth: int, dim: int = DIM, hidden: int = 3 * DIM) -> dict[str, torch.Tensor]:
    """A random probe in their parameter names (float64): ``depth - 1`` blocks and the cross-attention block."""
    g = torch.Generator().manual_seed(seed)

    def mlp(n):
        return {f"{n}.fc1.weight": (hidden, dim), f"{n}.fc1.bias": (hidden,), f"{n}.fc2.weight": (dim, hidden),
                f"{n}.fc2.bias": (dim,)}  # fmt: skip

    def norm(n):
        return {f"{n}.weight": (dim,), f"{n}.bias": (dim,)}

    shapes = {"pooler.query_tokens": (1, 1, dim)}
    for i in range(depth - 1):
        b = f"pooler.blocks.{i}"
        shapes |= norm(f"{b}.norm1") | norm(f"{b}.norm2") | mlp(f"{b}.mlp")
        shapes |= {f"{b}.attn.qkv.weight": (3 * dim, dim), f"{b}.attn.qkv.bias": (3 * dim,)}
        shapes |= {f"{b}.attn.proj.weight": (dim, dim), f"{b}.attn.proj.bias": (dim,)}
    c = "pooler.cross_attention_block"
    shapes |= norm(f"{c}.norm1") | norm(f"{c}.norm2") | mlp(f"{c}.mlp")
    shapes |= {f"{c}.xattn.q.weight": (dim, dim), f"{c}.xattn.q.bias": (dim,)}
    shapes |= {f"{c}.xattn.kv.weight": (2 * dim, dim), f"{c}.xattn.kv.bias": (2 * dim,)}
    shapes |= {"linear.weight": (CLASSES, dim), "linear.bias": (CLASSES,)}
    sd = {k: torch.randn(s, generator=g, dtype=torch.float64) * 0.3 for k, s in shapes.items()}
    return {k: 1 + v if ".norm" in k and k.endswith("weight") else v for k, v in sd.items()}


def probe_file(path, probes: list[dict[str, torch.Tensor]]):
    """Their evaluation's ``save_checkpoint``: the classifiers' state dicts (DDP's ``module.``) and the rest."""
    torch.save(
        {"classifiers": [{f"module.{k}": v for k, v in sd.items()} for sd in probes], "opt": [], "scaler": [None],
         "epoch": 20, "batch_size": 4, "world_size": 64},
        path,
    )  # fmt: skip
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("vjepa2_probe")
    enc = d / "vitl.pt"
    torch.save(released_layout(encoder_weights(0), target := encoder_weights(1)), enc)
    probes = [probe_weights(2, depth=3), probe_weights(3, depth=1)]
    return enc, target, probe_file(d / "ssv2-vitl-16x2x3.pt", probes), probes


@pytest.mark.parametrize("index", [0, 1])
def test_the_encoder_and_probe_are_the_authors_classifier(files, index):
    """Logits equal their encoder's tokens through their ``AttentiveClassifier`` in float64 (a probe of 3 blocks, one
    of 1), and so do the gradients of the clip and of every probe parameter."""
    enc, target, path, probes = files
    m = vitrel.from_vjepa2(enc, num_heads=HEADS, probe=path, probe_index=index, probe_heads=PROBE_HEADS)
    m = m.double().eval()
    assert m.vitrel_cfg["num_classes"] == CLASSES and m.vitrel_cfg["attn_pool_depth"] == (3, 1)[index]
    x = torch.randn(2, 3, 4, 8, 12, dtype=torch.float64, requires_grad=True)
    sd = {k: v.clone().requires_grad_() for k, v in probes[index].items()}
    want = authors_classifier(sd, authors_encoder(target, x, HEADS), PROBE_HEADS)
    got = m(x)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    w = torch.randn_like(want)
    names = [k for k in sd if k != "pooler.query_tokens"] + ["pooler.query_tokens"]
    ours = dict(m.named_parameters())
    ours = [ours[k.replace("pooler.", "attn_pool.", 1).replace("linear.", "head.", 1)] for k in names]
    g_got = torch.autograd.grad((got * w).sum(), [x, *ours])
    g_want = torch.autograd.grad((want * w).sum(), [x, *(sd[k] for k in names)])
    for name, a, b in zip(["clip", *names], g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=name)


def test_a_probe_with_timms_attention_pool_is_another_function(files):
    """The comparison above can fail: timm's ``AttentionPoolLatent`` (``map``'s other pool) with the same query, keys,
    values and MLP, and the probe read with fewer heads than it was trained with, each differ from their classifier."""
    enc, target, path, probes = files
    x = torch.randn(1, 3, 4, 8, 8, dtype=torch.float64)
    want = authors_classifier(probes[0], authors_encoder(target, x, HEADS), PROBE_HEADS)
    wrong_heads = vitrel.from_vjepa2(enc, num_heads=HEADS, probe=path, probe_heads=2).double().eval()
    assert (wrong_heads(x) - want).abs().max() > 1e-3
    latent = vitrel.from_vjepa2(enc, num_heads=HEADS, global_pool="map", attn_pool_num_heads=PROBE_HEADS,
                                attn_pool_mlp_ratio=3.0, num_classes=CLASSES).double().eval()  # fmt: skip
    p = probes[0]
    c = "pooler.cross_attention_block"
    ours = {"attn_pool.latent": p["pooler.query_tokens"], "head.weight": p["linear.weight"]}
    ours["head.bias"] = p["linear.bias"]
    for a, b in [("q", "xattn.q"), ("kv", "xattn.kv"), ("norm", "norm2"), ("mlp.fc1", "mlp.fc1"), ("mlp.fc2",) * 2]:
        ours |= {f"attn_pool.{a}.{t}": p[f"{c}.{b}.{t}"] for t in ("weight", "bias")}
    latent.load_state_dict(ours, strict=False)
    assert (latent(x) - want).abs().max() > 1e-3


def test_a_probe_model_saves_and_loads_as_any_vitrel_model(files, tmp_path):
    from vitrel.models.checkpoint import save_pretrained

    enc, _, path, _ = files
    m = vitrel.from_vjepa2(enc, num_heads=HEADS, probe=path, probe_heads=PROBE_HEADS).float().eval()
    back = vitrel.load_model(save_pretrained(m, tmp_path / "w")).eval()
    assert type(back.attn_pool).__name__ == "AttentivePool" and back.attn_pool.num_heads == PROBE_HEADS
    x = torch.randn(1, 3, 4, 8, 8)
    torch.testing.assert_close(back(x), m(x), rtol=0, atol=0)


def test_what_is_not_a_probe_is_one_error(files, tmp_path):
    enc, _, path, probes = files
    with pytest.raises(CheckpointError, match="no index 2"):
        vitrel.from_vjepa2(enc, num_heads=HEADS, probe=path, probe_index=2)
    with pytest.raises(CheckpointError, match="lacks"):  # their complete_block=False: a bare cross-attention
        bare = {k: v for k, v in probes[1].items() if ".norm" not in k and ".mlp." not in k}
        vitrel.from_vjepa2(enc, num_heads=HEADS, probe=probe_file(tmp_path / "bare.pt", [bare]))
    with pytest.raises(CheckpointError, match="no such file"):
        vitrel.from_vjepa2(enc, num_heads=HEADS, probe=tmp_path / "missing.pt")
    with pytest.raises(CheckpointError, match="wide"):
        vitrel.from_vjepa2(enc, num_heads=HEADS, probe={"classifiers": [probe_weights(4, 1, dim=32)]})
    with pytest.raises(ValueError, match="probe= gives the head"):
        vitrel.from_vjepa2(enc, num_heads=HEADS, probe=path, num_classes=3)


def test_a_released_probe_by_name_fetches_it_and_its_encoder(monkeypatch):
    """``probe="diving48_vit_large"`` asks for their files (no network here: the download is replaced by files of
    ViT-L's width) and builds at the probe's clip length (32 frames) with ViT-L's image size and heads."""
    enc = released_layout(encoder_weights(5, dim=1024, depth=1, hidden=16), encoder_weights(6, 1024, 1, 16))
    probe = {"classifiers": [probe_weights(7, depth=1, dim=1024, hidden=16)]}
    asked = []

    def fetch(url, map_location=None):
        asked.append(url)
        return probe if "/evals/" in url else enc

    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", fetch)
    m = vitrel.from_vjepa2(probe="diving48_vit_large")
    assert asked == [f"{vitrel.models.vjepa2_import.VJEPA2_URL}/{f}.pt" for f in ("evals/diving48-vitl-256", "vitl")]
    assert (m.vitrel_cfg["num_frames"], m.pretrained_cfg["input_size"][1:]) == (32, (256, 256))
    assert (m.vitrel_cfg["num_heads"], m.attn_pool.num_heads, m.num_classes) == (16, 16, CLASSES)


def test_eval_py_scores_a_saved_probe_over_clips_and_crops_as_their_classifier(files, tmp_path):
    """The user's path: the probe model saved (``save_pretrained``), then ``python eval.py ckpt_path=<folder>
    data=video_list ... data.clips_per_video=2 data.spatial_crops=3 data.crop_pct=1.0`` (in-process) on a list of
    videos. Its loss is, by hand in float64, the mean over videos of -log of the mean over the 6 views of softmax of
    their classifier over their encoder: each view's frames decoded with PyAV, the clip starts by
    vitrel/data/video/clips.py's rule, the 16 x 20 frames' columns 0, 2 and 4 onwards, ImageNet's statistics."""
    import av
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

    from tests.data.test_video import write_video
    from tests.train_helpers import compose
    from vitrel.models.checkpoint import save_pretrained
    from vitrel.train.evaluate import evaluate

    enc, target, path, probes = files
    m = vitrel.from_vjepa2(enc, num_heads=HEADS, probe=path, probe_heads=PROBE_HEADS, img_size=16, num_frames=2)
    folder = save_pretrained(m.float(), tmp_path / "probe")
    root = tmp_path / "data"
    labels = [0, 3, 1, 4]
    for i in range(4):
        write_video(root / f"v{i}.mkv", 5 + 2 * i, hw=(16, 20))
    (root / "train.csv").write_text("".join(f"v{i}.mkv {c}\n" for i, c in enumerate(labels)))
    (root / "val.csv").write_text("".join(f"v{i}.mkv {c}\n" for i, c in enumerate(labels)))
    data = ["data=video_list", f"data.root={root}", "data.train_list=train.csv", "data.val_list=val.csv"]
    data += ["data.num_frames=2", "data.stride=2", "data.img_size=16", "data.crop_pct=1.0", "data.num_workers=0"]
    data += ["data.clips_per_video=2", "data.spatial_crops=3", "data.pin_memory=false", f"data.num_classes={CLASSES}"]
    over = [f"ckpt_path={folder}", *data, "split=val", "progress_bar=none", "trainer.accelerator=cpu"]
    metrics = evaluate(compose(tmp_path / "eval", over, config_name="eval"))
    mean = torch.tensor(IMAGENET_DEFAULT_MEAN, dtype=torch.float64)[:, None, None]
    std = torch.tensor(IMAGENET_DEFAULT_STD, dtype=torch.float64)[:, None, None]
    losses = []
    for i, label in enumerate(labels):
        with av.open(str(root / f"v{i}.mkv")) as container:
            frames = [
                torch.from_numpy(f.to_ndarray(format="rgb24")).permute(2, 0, 1) for f in container.decode(video=0)
            ]
        delta = len(frames) - 3  # (a clip spans (2 - 1) * 2 + 1 frames)
        views = []
        for start in (0, delta):  # 2 clips: the first at the start, the last at the end
            clip = torch.stack([(frames[start + 2 * t].double() / 255 - mean) / std for t in range(2)], 1)
            views += [clip[..., left : left + 16] for left in (0, 2, 4)]  # [C, T, 16, 16] each
        x = torch.stack(views)  # [6, C, T, H, W]
        probs = authors_classifier(probes[0], authors_encoder(target, x, HEADS), PROBE_HEADS).softmax(-1)
        losses.append(-probs.mean(0)[label].log())
    assert metrics["val/loss"] == pytest.approx(torch.stack(losses).mean().item(), rel=1e-4)
