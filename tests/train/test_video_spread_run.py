"""``data.frame_sampling=spread`` through what users run: ``train.py data=video_folder data.frame_sampling=spread``
stores the sampling with its checkpoint; ``eval.py`` (without the clip keys) and ``predict.py`` score each video as
its views by hand (decoded with PyAV, frame ``t`` of view ``k`` at ``floor(N (2 t + k) / (2 T))``, the mean of the
two views' softmax); ``experiment=videomae_finetune_ssv2`` composes VideoMAE's SSv2 clips."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate

import vitrel
from tests.data.test_video import write_video
from tests.train.test_video_predict import CLASSES, TINY, class_videos
from tests.train_helpers import compose
from vitrel.inference import load_predictor, predict_folder
from vitrel.train.evaluate import evaluate
from vitrel.train.run import train

av = pytest.importorskip("av", reason="PyAV not installed: pip install -e '.[video]'")

FRAMES, VIEWS = 4, 2  # a clip: 4 frames, one from each quarter of the video; 2 views at evaluation


@pytest.fixture(scope="module")
def spread_run(tmp_path_factory) -> tuple[Path, Path]:
    """``(videos root, last.ckpt)`` of ``train.py data=video_folder data.frame_sampling=spread`` (in-process) on
    30 x 40 videos of 3 to 19 frames (a video shorter than a clip among them)."""
    root = class_videos(tmp_path_factory.mktemp("videos"), lambda c, k: 3 + 14 * k + 2 * c)
    run = tmp_path_factory.mktemp("spread_run")
    over = [*TINY, f"data.root={root}", "data.stride=1", "data.frame_sampling=spread", f"data.clips_per_video={VIEWS}"]
    train(compose(run, over))
    return root, run / "checkpoints" / "last.ckpt"


def probs_by_hand(ckpt: Path, path: Path) -> torch.Tensor:
    """The mean over the 2 views of softmax(model(view)) in float64, each view made by hand: every frame decoded
    with PyAV; of ``n`` frames, view ``k``'s frame ``t`` is ``floor(n (2 t + k) / (2 T))``; each frame resized (shorter
    side to floor(16 / 0.875), bicubic), centre-cropped to 16 x 16, normalised with ImageNet's statistics."""
    import torchvision.transforms.functional as TF
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

    with av.open(str(path)) as container:
        decoded = [torch.from_numpy(f.to_ndarray(format="rgb24")).permute(2, 0, 1) for f in container.decode(video=0)]
    n = len(decoded)
    mean = torch.tensor(IMAGENET_DEFAULT_MEAN, dtype=torch.float64)[:, None, None]
    std = torch.tensor(IMAGENET_DEFAULT_STD, dtype=torch.float64)[:, None, None]
    model = vitrel.load_model(ckpt).double().eval()
    probs = []
    for k in range(VIEWS):
        frames = []
        for t in range(FRAMES):
            f = decoded[(n * (VIEWS * t + k)) // (FRAMES * VIEWS)]
            f = TF.resize(f, [math.floor(16 / 0.875)], TF.InterpolationMode.BICUBIC, antialias=True)
            frames.append((TF.center_crop(f, [16, 16]).double() / 255 - mean) / std)
        with torch.no_grad():
            probs.append(model(torch.stack(frames, 1)[None]).softmax(-1)[0])
    return torch.stack(probs).mean(0)


def test_eval_py_scores_the_runs_spread_views_as_by_hand(spread_run, tmp_path, caplog):
    """The checkpoint stores the sampling; ``eval.py`` without the clip keys takes the run's (logged; the data
    group's stride 4 would be refused with it) and its loss is the mean of -log p(label) by hand."""
    root, ckpt = spread_run
    stored = torch.load(ckpt, weights_only=True)["hyper_parameters"]["data_config"]
    assert (stored["frame_sampling"], stored["frame_stride"], stored["clips_per_video"]) == ("spread", 1, VIEWS)
    over = [f"ckpt_path={ckpt}", "data=video_folder", f"data.root={root}", "data.num_workers=0", "split=val"]
    over += ["data.pin_memory=false", "progress_bar=none", "trainer.accelerator=cpu"]
    caplog.set_level("INFO", logger="lightning.pytorch")
    metrics = evaluate(compose(tmp_path, over, config_name="eval"))
    assert "data.frame_sampling=spread" in caplog.text
    losses = [
        -probs_by_hand(ckpt, root / "val" / cls / f"{cls}_{k}.avi")[c].log()
        for c, cls in enumerate(CLASSES)
        for k in (0, 1)
    ]
    assert metrics["val/loss"] == pytest.approx(torch.stack(losses).mean().item(), rel=1e-4)


def test_predict_py_scores_the_spread_views_from_the_checkpoint_and_its_export(spread_run, tmp_path):
    """``predict.py`` on the checkpoint and on its export folder (``python -m vitrel.export``: the sampling travels
    in the folder's data config): each video's probabilities by hand."""
    from vitrel.export import main as export_main

    root, ckpt = spread_run
    assert export_main([str(ckpt), str(tmp_path / "export")]) == 0
    for src in (ckpt, tmp_path / "export"):
        p = load_predictor(src)
        assert p.data_config["frame_sampling"] == "spread", src
        res = predict_folder(p, root / "val", topk=2, progress=False)
        assert len(res.rows) == 4
        for r in res.rows:
            want = probs_by_hand(ckpt, root / "val" / r["filename"])
            got = torch.tensor([r["prob_0"], r["prob_1"]], dtype=torch.float64)
            torch.testing.assert_close(got, want.topk(2).values, rtol=0, atol=1e-5)


def test_the_ssv2_recipe_composes_their_clips(tmp_path):
    """``experiment=videomae_finetune_ssv2``: a list file's videos, 16 frames spread, no flip, their RandAugment and
    erasing, 2 views x 3 crops at test, 30 epochs, their head scaled by 0.001, from their pre-training weights."""
    for c in range(2):
        write_video(tmp_path / f"v{c}.mkv", 20, "ffv1", "gray", hw=(16, 20))
    (tmp_path / "train.csv").write_text("v0.mkv 0\nv1.mkv 1\n")
    over = ["experiment=videomae_finetune_ssv2", f"data.root={tmp_path}", "data.train_list=train.csv"]
    over += ["data.val_list=train.csv", "data.num_workers=0", "data.pin_memory=false"]
    cfg = compose(tmp_path / "run", over)
    assert (cfg.trainer.max_epochs, cfg.model.init_from, cfg.model.head_init_scale) == (30, "videomae:vit_base", 0.001)
    dm = instantiate(cfg.data)
    assert (dm.frame_sampling, dm.num_frames, dm.stride, dm.clips_per_video, dm.spatial_crops) == (
        "spread",
        16,
        1,
        2,
        3,
    )
    tf = dm.train_transform()
    assert tf.rand_augment.config == "rand-m7-n4-mstd0.5-inc1" and tf.erase.mode == "pixel"
    assert dm.train_flip[1] == 0.0 and dm.clip_repeats == 2
