"""``data.num_segments`` through what users run: ``train.py data=video_folder data.num_segments=2`` writes a
checkpoint whose model joins 2 clips an input; ``eval.py`` and ``predict.py`` take the model's segments and score
each video as its clips by hand (decoded with PyAV, the segment starts from the equation, joined along time); a data
setting that differs, and a model that takes one clip, are one error each."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import vitrel
from tests.train.test_video_predict import CLASSES, TINY, class_videos
from tests.train_helpers import FAST, compose
from vitrel.config import ConfigError
from vitrel.inference import load_predictor, predict_folder
from vitrel.train.evaluate import evaluate
from vitrel.train.run import train

av = pytest.importorskip("av", reason="PyAV not installed: pip install -e '.[video]'")

FRAMES, STRIDE, K = 4, 2, 2  # a clip: 4 frames 2 apart (7 frames); 2 segments an input


@pytest.fixture(scope="module")
def segments_run(tmp_path_factory) -> tuple[Path, Path]:
    """``(videos root, last.ckpt)`` of ``train.py data=video_folder data.num_segments=2`` (in-process) on 30 x 40
    videos of 9 to 30 frames: parts of 4 to 15 frames, shorter and longer than a clip."""
    root = class_videos(tmp_path_factory.mktemp("videos"), lambda c, k: 9 + 19 * k + 2 * c)
    run = tmp_path_factory.mktemp("segments_run")
    over = [*TINY, f"data.root={root}", f"data.stride={STRIDE}", f"data.num_segments={K}"]
    train(compose(run, over))
    return root, run / "checkpoints" / "last.ckpt"


def probs_by_hand(ckpt: Path, path: Path) -> torch.Tensor:
    """softmax(model(input)) in float64, the input made by hand: every frame decoded with PyAV; the video of ``n``
    frames in 2 parts of ``P = n // 2``; clip ``i`` from ``i P + (P - span) // 2`` when ``P >= span`` (its part's
    centre), else evenly spread over the video (``i (n - span) // (K - 1)``); frames ``STRIDE`` apart (the last
    repeated past the end); each frame resized (shorter side to floor(16 / 0.875), bicubic), centre-cropped to 16 x 16,
    normalised with ImageNet's statistics; the two clips joined along time."""
    import torchvision.transforms.functional as TF
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

    with av.open(str(path)) as container:
        decoded = [torch.from_numpy(f.to_ndarray(format="rgb24")).permute(2, 0, 1) for f in container.decode(video=0)]
    n, span = len(decoded), (FRAMES - 1) * STRIDE + 1
    part = n // K
    if part >= span:
        starts = [i * part + (part - span) // 2 for i in range(K)]
    else:
        starts = [i * max(n - span, 0) // (K - 1) for i in range(K)]
    mean = torch.tensor(IMAGENET_DEFAULT_MEAN, dtype=torch.float64)[:, None, None]
    std = torch.tensor(IMAGENET_DEFAULT_STD, dtype=torch.float64)[:, None, None]
    frames = []
    for s in starts:
        for t in range(FRAMES):
            f = decoded[min(s + t * STRIDE, n - 1)]
            f = TF.resize(f, [math.floor(16 / 0.875)], TF.InterpolationMode.BICUBIC, antialias=True)
            frames.append((TF.center_crop(f, [16, 16]).double() / 255 - mean) / std)
    model = vitrel.load_model(ckpt).double().eval()
    with torch.no_grad():
        return model(torch.stack(frames, 1)[None]).softmax(-1)[0]


def test_the_run_stores_its_segments_and_eval_py_scores_them_as_by_hand(segments_run, tmp_path, caplog):
    """The checkpoint's model splits 2 clips an input and its data config says so; ``eval.py`` without
    ``data.num_segments`` takes the model's (logged) and its loss is the mean of -log p(label) by hand."""
    root, ckpt = segments_run
    assert vitrel.load_model(ckpt).num_segments == K
    assert torch.load(ckpt, weights_only=True)["hyper_parameters"]["data_config"]["num_segments"] == K
    over = [f"ckpt_path={ckpt}", "data=video_folder", f"data.root={root}", "data.num_workers=0", "split=val"]
    over += ["data.pin_memory=false", "progress_bar=none", "trainer.accelerator=cpu"]
    with caplog.at_level("INFO"):
        metrics = evaluate(compose(tmp_path, over, config_name="eval"))
    assert f"data.num_segments={K}" in caplog.text
    losses = []
    for c, cls in enumerate(CLASSES):
        for k in range(2):
            losses.append(-probs_by_hand(ckpt, root / "val" / cls / f"{cls}_{k}.avi")[c].log())
    assert metrics["val/loss"] == pytest.approx(torch.stack(losses).mean().item(), rel=1e-4)
    with pytest.raises(ConfigError, match=f"data.num_segments=1 but .* encodes {K} clip.*set data.num_segments={K}"):
        evaluate(compose(tmp_path / "one", [*over, "data.num_segments=1"], config_name="eval"))
    three = ["data.num_segments=3", "+model_overrides.num_segments=3"]  # (the pool takes any number of tokens)
    with pytest.warns(UserWarning, match="num_segments=3"):
        evaluate(compose(tmp_path / "three", [*over, *three], config_name="eval"))
    assert json.loads((tmp_path / "three" / "eval_metrics.json").read_text())["num_segments"] == 3


def test_predict_py_joins_the_segments_the_model_takes(segments_run):
    root, ckpt = segments_run
    res = predict_folder(load_predictor(ckpt), root / "val", topk=2, progress=False)
    assert len(res.rows) == 4
    for r in res.rows:
        want = probs_by_hand(ckpt, root / "val" / r["filename"])
        got = torch.tensor([r["prob_0"], r["prob_1"]], dtype=torch.float64)
        torch.testing.assert_close(got, want.topk(2).values, rtol=0, atol=1e-5)


def test_a_video_swin_is_refused_segments_before_anything_is_built(segments_run, tmp_path):
    over = ["data=video_folder", f"data.root={segments_run[0]}", "data.num_segments=2", "pos=rel3d_full", *FAST]
    over += ["model=vitrel_swin3d_tiny_patch122_window444_32"]
    with pytest.raises(ConfigError, match=r"data.num_segments=2 joins 2 clips .*\(vitrel_vit_video_\*\)"):
        train(compose(tmp_path, over))


def test_a_program_exported_from_the_run_predicts_as_the_checkpoint(segments_run, tmp_path):
    """``python -m vitrel.export last.ckpt OUT --pt2``: the program traces 2 joined clips and keeps one clip's
    frames in its data config; predict.py on the ``.pt2`` gives the checkpoint's probabilities by hand."""
    from vitrel.export import load_program
    from vitrel.export import main as export_main

    root, ckpt = segments_run
    assert export_main([str(ckpt), str(tmp_path / "export"), "--pt2"]) == 0
    prog = tmp_path / "export" / "model.pt2"
    assert load_program(prog)[1]["num_frames"] == FRAMES and load_program(prog)[1]["num_segments"] == K
    res = predict_folder(load_predictor(prog), root / "val", topk=2, progress=False)
    for r in res.rows[1::2]:
        want = probs_by_hand(ckpt, root / "val" / r["filename"])
        got = torch.tensor([r["prob_0"], r["prob_1"]], dtype=torch.float64)
        torch.testing.assert_close(got, want.topk(2).values, rtol=0, atol=1e-5)
