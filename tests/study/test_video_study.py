"""The study's ``video_extrapolation`` budget (conf/experiment/study_video_extrapolation.yaml): clips of 2T and 4T
frames and of twice the side, the same test motions in each, and the runner end to end at toy size."""

from __future__ import annotations

import json

import pytest
import torch
from hydra.utils import instantiate

TOY = [
    "data.train_images=16",
    "data.test_images=16",
    "data.batch_size=8",
    "trainer.limit_train_batches=2",
    "study.test_images=16",
    "study.ood_images=12",
    "study.archs.vit=['model=vit_video_tiny_fmnist','++model.embed_dim=16','++model.depth=1','++model.num_heads=2']",
]


@pytest.fixture(scope="module")
def study():
    import vitrel.study

    return vitrel.study


def test_video_recipe_composes_as_train_py_does(study):
    rec = study.recipe("video_extrapolation")
    run = rec["runs"]["vit"]
    assert run["data"]["name"] == "moving_fmnist" and run["data"]["canvas_size"] is None
    assert run["model"]["name"] == "vitrel_vit_video_tiny_patch4_32" and run["model"]["tubelet_size"] == 1
    assert run["test"] is False and run["callbacks"]["model_checkpoint"] is None
    s = rec["study"]
    assert s["evals"]["frames16"] == {"num_frames": 16} and s["evals"]["frames32"] == {"num_frames": 32}
    assert s["scales"] == {"test": 1.0, "frames16": 2.0, "frames32": 4.0} and s["chance"] == 0.5
    needed = {x for c in s["claims"].values() for x in c.get("better", [c.get("best")])}
    assert needed <= set(s["default_schemes"])


def test_eval_sets_render_the_same_motions_longer_and_larger(study):
    """``framesN``: the test motions with N frames (a forward clip's first 8 frames are the 8-frame clip's);
    ``res64``: the 8-frame clips at 64x64; every held-out set the same clips, in the same order."""
    cfg = study.compose("video_extrapolation", TOY)
    data = {k: study.materialise(v) for k, v in study.eval_sets(cfg.study, instantiate(cfg.data)).items()}
    assert data["test"][0].shape == (16, 1, 8, 32, 32)
    assert data["frames16"][0].shape == (12, 1, 16, 32, 32) and data["frames32"][0].shape == (12, 1, 32, 32, 32)
    assert data["res64"][0].shape == (12, 1, 8, 64, 64)
    y = data["frames16"][1]
    assert all(torch.equal(data[k][1], y) for k in ("frames32", "res64")) and 0 < int(y.sum()) < len(y)
    fwd = y == 0
    torch.testing.assert_close(data["frames32"][0][fwd, :, :16], data["frames16"][0][fwd], rtol=0, atol=0)
    bwd = data["frames16"][0][~fwd]  # a backward clip ends where its forward clip starts
    torch.testing.assert_close(data["frames32"][0][~fwd, :, -16:], bwd, rtol=0, atol=0)


@pytest.mark.slow
def test_video_study_runs_scores_every_set_and_reads_claims(study, tmp_path):
    argv = ["--budget", "video_extrapolation", "--schemes", "none,rel3d_factored", "--seeds", "1"]
    argv += ["--out", str(tmp_path), "--progress", "none", "--threads", "1", "--cost-rounds", "0", *TOY]
    state = study.main(argv)
    assert [r["scheme"] for r in state["runs"]] == ["none", "rel3d_factored"]
    for r in state["runs"]:
        assert all(0.0 <= r[f"{e}_acc"] <= 1.0 for e in ("test", "frames16", "frames32", "res64")), r
    md = (tmp_path / "study_video_extrapolation.md").read_text()
    assert md.startswith("# Position-scheme study on Moving Fashion-MNIST (budget `video_extrapolation`)")
    assert "moving_fmnist, clips of 8 frames of 32x32" in md and "`framesN` = the same test motions" in md
    assert (tmp_path / "study_video_extrapolation_curves.png").stat().st_size > 0
    data = json.loads((tmp_path / "study_video_extrapolation.json").read_text())
    assert data["summary"][0]["scheme"] == "none"


def test_accuracy_scores_a_video_of_several_clips_by_their_mean_softmax():
    """A study's accuracy on videos of K clips (data=video_folder, clips_per_video > 1) is eval.py's: the argmax of
    the mean of the clips' softmax, here where it differs from averaging logits and from the first clip alone."""
    from vitrel.study.runs import accuracy

    class Lookup(torch.nn.Module):  # a clip [C, T, H, W] of one value v -> the logits row LOGITS[v]
        def forward(self, x):
            return LOGITS[x.flatten(1)[:, 0].long()]

    # video 0 (clips 0, 1): the mean of softmax says class 1, the mean of logits class 0; video 1 (clips 2, 3): its
    # first clip alone says class 0
    LOGITS = torch.tensor([[2.0, 10.0, 0.0], [2.0, -20.0, 0.0], [1.0, 0.0, 0.0], [0.0, 5.0, 0.0]], dtype=torch.float64)
    CLIPS = torch.tensor([[0, 1], [2, 3]])  # [videos, clips]: the clips' LOGITS rows
    x = CLIPS.double()[:, :, None, None, None, None].expand(2, 2, 1, 2, 2, 2)
    y = torch.tensor([1, 1])
    probs = LOGITS.softmax(-1)[CLIPS].mean(1)  # [videos, classes], float64 by hand
    assert probs.argmax(-1).tolist() == y.tolist()
    assert LOGITS[CLIPS].mean(1).argmax(-1).tolist() == [0, 1]  # (averaged logits: video 0 missed)
    assert LOGITS[CLIPS[:, 0]].argmax(-1).tolist() == [1, 0]  # (first clips alone: video 1 missed)
    got = accuracy(Lookup(), x, y, torch.device("cpu"), batch=1, bf16=False)
    assert got == 1.0
