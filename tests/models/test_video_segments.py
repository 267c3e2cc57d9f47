"""Segments: a video ViT of ``num_segments = K`` (vitrel/models/video_vit.py) encodes the ``K`` clips joined along
time in its input alone and pools their tokens together, V-JEPA 2's ``ClipAggregation``
(facebookresearch/vjepa2 ``evals/video_classification_frozen/modelcustom/vit_encoder_multiclip.py``, written out
below with ``use_pos_embed=False``, every config's) before their ``AttentiveClassifier``; ``from_vjepa2`` reads their
released probes with their segments; exports trace ``K T`` frames."""

from __future__ import annotations

import pytest
import torch

import vitrel
from tests.models.test_vjepa2_import import HEADS, authors_encoder, encoder_weights, released_layout
from tests.models.test_vjepa2_probe import CLASSES, PROBE_HEADS, authors_classifier, files, probe_weights  # noqa: F401

T, K = 4, 2  # frames a segment (2 tubelets), segments an input


def clip_aggregation(sd: dict[str, torch.Tensor], x: torch.Tensor, segments: int, heads: int) -> torch.Tensor:
    """Their ``ClipAggregation.forward`` on one spatial view, the ``segments`` clips of ``x [B, C, K T, H, W]``:
    every clip through the encoder (batched), each output ``reshape(B, T', S, D)``, ``cat(dim=1).flatten(1, 2)``."""
    clips = x.chunk(segments, dim=2)
    out = authors_encoder(sd, torch.cat(clips, dim=0), heads)  # their x = torch.cat(clips along the batch)
    B, t = x.shape[0], clips[0].shape[2] // 2  # (tubelets of 2 frames)
    parts = [out[i * B : (i + 1) * B].reshape(B, t, -1, out.shape[-1]) for i in range(segments)]
    return torch.cat(parts, dim=1).flatten(1, 2)


@pytest.mark.parametrize("index", [0, 1])
def test_segments_are_their_clip_aggregation_and_classifier(files, index):  # noqa: F811
    """Logits of ``from_vjepa2(..., num_segments=2)`` equal their two clips encoded alone, joined, through their
    classifier in float64 (probes of 3 blocks and of 1), and so do the gradients of the input and the probe's query;
    attending across both clips (``num_segments=1`` on the same frames) is another function."""
    enc, target, path, probes = files
    m = vitrel.from_vjepa2(enc, num_heads=HEADS, probe=path, probe_index=index, probe_heads=PROBE_HEADS, num_segments=K)
    m = m.double().eval()
    x = torch.randn(2, 3, K * T, 8, 12, dtype=torch.float64, requires_grad=True)
    sd = {k: v.clone().requires_grad_() for k, v in probes[index].items()}
    want = authors_classifier(sd, clip_aggregation(target, x, K, HEADS), PROBE_HEADS)
    got = m(x)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    w = torch.randn_like(want)
    g_got = torch.autograd.grad((got * w).sum(), [x, m.attn_pool.query_tokens])
    g_want = torch.autograd.grad((want * w).sum(), [x, sd["pooler.query_tokens"]])
    for name, a, b in zip(["input", "query"], g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=name)
    joint = vitrel.from_vjepa2(enc, num_heads=HEADS, probe=path, probe_index=index, probe_heads=PROBE_HEADS)
    assert (joint.double().eval()(x) - want).abs().max() > 1e-3


def test_intermediates_are_each_segments_joined_along_time():
    """``forward_intermediates`` and ``forward_features`` of a 2-segment model: the 1-segment model's of each clip,
    the second after the first in time (a ``(K T', H', W')`` grid)."""
    kw = dict(num_classes=3, num_frames=T, img_size=8, in_chans=3, pos="rope3d_axial", depth=2)
    torch.manual_seed(0)
    m = vitrel.create_model("vitrel_vit_video_tiny_patch4_32", num_segments=K, **kw).double().eval()
    one = vitrel.create_model("vitrel_vit_video_tiny_patch4_32", **kw).double().eval()
    one.load_state_dict(m.state_dict())
    x = torch.randn(2, 3, K * T, 8, 8, dtype=torch.float64)
    for fmt in ("NCTHW", "NTHWC", "NLC"):
        final, feats = m.forward_intermediates(x, indices=[0, 1], output_fmt=fmt)
        parts = [one.forward_intermediates(c, indices=[0, 1], output_fmt=fmt) for c in x.chunk(K, dim=2)]
        dim = 2 if fmt == "NCTHW" else 1
        for i, y in enumerate(feats):
            torch.testing.assert_close(y, torch.cat([p[1][i] for p in parts], dim=dim), rtol=0, atol=0, msg=fmt)
        torch.testing.assert_close(final, torch.cat([p[0] for p in parts], dim=1), rtol=0, atol=0)
        assert feats[-1].shape[dim] == K * parts[0][1][-1].shape[dim]
    torch.testing.assert_close(m.forward_features(x), final, rtol=0, atol=0)


def test_segments_errors():
    make = vitrel.create_model
    with pytest.raises(ValueError, match="class_token=False"):
        make("vitrel_vit_video_tiny_patch4_32", num_segments=2, class_token=True, global_pool="token")
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="num_segments must be an integer >= 1"):
            make("vitrel_vit_video_tiny_patch4_32", num_segments=bad)
    m = make("vitrel_vit_video_tiny_patch4_32", num_segments=4, num_frames=2, img_size=8, in_chans=3)
    with pytest.raises(ValueError, match=r"num_segments=4 takes \[B, C, 4 \* T, H, W\]"):
        m(torch.randn(1, 3, 6, 8, 8))


def test_a_released_probe_by_name_brings_its_segments_and_views(monkeypatch):
    """``probe="ssv2_vit_large"``: 2 segments of 16 frames 4 apart, 3 crops of the shorter side (their
    ``configs/inference/vitl/ssv2.yaml``), in the model and its data config; saved and loaded, both stay."""
    from vitrel.models.checkpoint import save_pretrained
    from vitrel.models.data_config import model_data_config

    enc = released_layout(encoder_weights(5, dim=1024, depth=1, hidden=16), encoder_weights(6, 1024, 1, 16))
    probe = {"classifiers": [probe_weights(7, depth=1, dim=1024, hidden=16)]}
    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", lambda url, **_: probe if "/evals/" in url else enc)
    m = vitrel.from_vjepa2(probe="ssv2_vit_large")
    dc = model_data_config(m)
    assert m.vitrel_cfg["num_segments"] == 2 and m.num_segments == 2
    want = dict(num_frames=16, num_segments=2, frame_stride=4, spatial_crops=3, clips_per_video=1, crop_pct=1.0)
    assert {k: dc[k] for k in want} == want
    diving = vitrel.from_vjepa2(probe="diving48_vit_large", num_segments=1)  # (given: wins over the probe's 4)
    assert diving.num_segments == 1 and model_data_config(diving)["frame_stride"] == 2
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        back = vitrel.load_model(save_pretrained(m, f"{d}/w"))
        assert back.num_segments == 2 and {k: model_data_config(back)[k] for k in want} == want


def test_an_export_traces_all_segments_and_keeps_one_clips_frames(tmp_path):
    """The example input holds ``K T`` frames; a program of every clip length (``dynamic="hw"``) takes whole tubelets
    of every segment and equals the model, and so does its ONNX model; its data config keeps one clip's frames."""
    from vitrel.export import example_input, export_program, program_data_config
    from vitrel.models.data_config import model_data_config

    torch.manual_seed(0)
    m = vitrel.create_model(
        "vitrel_vit_video_tiny_patch4_32", num_segments=K, num_frames=T, img_size=8, in_chans=3, num_classes=3, depth=1
    ).eval()
    x = example_input(m)
    assert x.shape == (2, 3, K * T, 8, 8)
    ep = export_program(m, x, "hw")
    y = torch.randn(1, 3, 2 * K * 2, 8, 12)  # (other clips: 4 frames a segment, a wider frame)
    torch.testing.assert_close(ep.module()(y), m(y), rtol=1e-5, atol=1e-5)
    with pytest.raises(AssertionError, match="% 2 == 0"):  # (7 frames: not 2 clips of whole tubelets)
        ep.module()(torch.randn(1, 3, 7, 8, 8))
    static = export_program(m, x, "batch")
    assert program_data_config(static, model_data_config(m))["num_frames"] == T
    ort = pytest.importorskip("onnxruntime")
    from vitrel.export import onnx_program

    onnx_program(m, x, "hw", program=ep).save(path := tmp_path / "m.onnx")
    session = ort.InferenceSession(str(path))
    got = session.run(None, {session.get_inputs()[0].name: y.numpy()})[0]
    torch.testing.assert_close(torch.from_numpy(got), m(y), rtol=1e-5, atol=1e-5)


def test_eval_py_takes_a_saved_released_probes_clips_from_the_model(monkeypatch, tmp_path):
    """``eval.py ckpt_path=<saved probe="ssv2_vit_large" model> data=video_list ...`` without any clip key scores
    with the probe's own: 2 segments, frames 4 apart, 3 crops (``eval_metrics.json``; crop_pct 1.0 is the video data's
    own default)."""
    import json

    from tests.data.test_video import write_video
    from tests.train_helpers import compose
    from vitrel.models.checkpoint import save_pretrained
    from vitrel.train.evaluate import evaluate

    enc = released_layout(encoder_weights(5, dim=1024, depth=1, hidden=16), encoder_weights(6, 1024, 1, 16))
    probe = {"classifiers": [probe_weights(7, depth=1, dim=1024, hidden=16)]}
    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", lambda url, **_: probe if "/evals/" in url else enc)
    m = vitrel.from_vjepa2(probe="ssv2_vit_large", img_size=32, num_frames=2)
    folder = save_pretrained(m, tmp_path / "probe")
    root = tmp_path / "data"
    for i in range(2):
        write_video(root / f"v{i}.mkv", 12 + 3 * i, hw=(32, 40))
    (root / "val.csv").write_text("v0.mkv 0\nv1.mkv 3\n")
    data = ["data=video_list", f"data.root={root}", "data.train_list=val.csv", "data.val_list=val.csv"]
    data += ["data.num_workers=0", "data.pin_memory=false", f"data.num_classes={CLASSES}", "data.batch_size=2"]
    over = [f"ckpt_path={folder}", *data, "split=val", "progress_bar=none", "trainer.accelerator=cpu"]
    evaluate(compose(tmp_path / "eval", over, config_name="eval"))
    got = json.loads((tmp_path / "eval" / "eval_metrics.json").read_text())
    want = dict(num_frames=2, num_segments=2, stride=4, clips_per_video=1, spatial_crops=3, img_size=32)
    assert {k: got[k] for k in want} == want
    assert {"num_segments", "stride", "spatial_crops"} <= set(got["data_from_run"])  # (taken, not the defaults)


def test_attention_distance_measures_each_segment_as_the_model_attends():
    """``vitrel.viz.attention_distance`` of a 2-segment model equals the 1-segment model's (same weights) on the clips
    apart, where the model attends; on the clips joined (attention across both) it is another figure."""
    from vitrel.viz import attention_distance

    kw = dict(num_classes=3, num_frames=T, img_size=8, in_chans=3, pos="rel3d_factored", depth=2)
    torch.manual_seed(0)
    m = vitrel.create_model("vitrel_vit_video_tiny_patch4_32", num_segments=K, **kw).double()
    one = vitrel.create_model("vitrel_vit_video_tiny_patch4_32", **kw).double()
    one.load_state_dict(m.state_dict())
    x = torch.randn(2, 3, K * T, 8, 8, dtype=torch.float64)
    px, fr = attention_distance(m, x, frames=True)
    apart = attention_distance(one, m.split_segments(x), frames=True)
    torch.testing.assert_close(px, apart[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fr, apart[1], rtol=1e-12, atol=1e-12)
    assert fr.max() < T and (attention_distance(one, x, frames=True)[1] - fr).abs().max() > 1e-3
