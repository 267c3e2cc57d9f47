"""Fine-tuning V-JEPA 2's encoder with ``train.py model.init_from=vjepa2:<encoder> model.init_file=<checkpoint>``
(docs/models.md): the run starts from the checkpoint's target encoder with its function, and ``eval.py`` scores the
run's checkpoint as the run tested it."""

from __future__ import annotations

import json

import pytest
import torch

import vitrel
from tests.models.test_vjepa2_import import authors_encoder, encoder_weights, released_layout
from tests.train.test_video_first_hour import SHORT, video_tree  # noqa: F401 (the fixture)
from tests.train_helpers import FAST, compose
from vitrel.train.evaluate import evaluate
from vitrel.train.run import train

DATA = ["data=video_folder", "data.num_frames=2", "data.stride=1", "data.img_size=16", "data.pin_memory=false"]
DATA += ["data.batch_size=4", "data.drop_last=false"]


@pytest.fixture
def vitl_checkpoint(tmp_path):
    """``vitl.pt`` in the authors' layout at ViT-L's width (1024: 16 heads), one block, 4-px patches."""
    sd = {k: v.float() for k, v in encoder_weights(3, dim=1024, depth=1, hidden=16).items()}
    sd["patch_embed.proj.weight"] = sd["patch_embed.proj.weight"] * 0.1  # (4-px patches, as the fixture's)
    path = tmp_path / "vitl.pt"
    torch.save(released_layout(sd, sd), path)
    return path, sd


def test_train_starts_from_their_encoder_and_eval_scores_it_as_tested(video_tree, vitl_checkpoint, tmp_path):  # noqa: F811
    path, sd = vitl_checkpoint
    model = [
        "model=vit_video_tiny_fmnist",
        "model.init_from=vjepa2:vit_large",
        f"model.init_file={path}",
        "pos=rope3d_vjepa2",
    ]
    data = [*DATA, f"data.root={video_tree}"]
    cfg = compose(tmp_path / "run", [*data, *model, *FAST[2:], "data.num_workers=0", *SHORT])
    with pytest.warns(UserWarning, match="architecture is vit_large's"):
        metrics = train(cfg)
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    m = vitrel.load_model(ckpt)
    assert m.blocks[0].attn.pos.name == "rope3d_vjepa2" and m.vitrel_cfg["embed_dim"] == 1024 and m.num_classes == 2
    # the run's first model was their encoder: the imported one at the data's sizes computes their function
    start = vitrel.create_model("vitrel_vit_video_tiny_patch4_32", init_from="vjepa2:vit_large", init_file=str(path))
    x = torch.randn(1, 3, 2, 16, 16)
    torch.testing.assert_close(start.eval().forward_features(x), authors_encoder(sd, x, 16).float())
    evaluate(compose(tmp_path / "eval", [f"ckpt_path={ckpt}", *data, "trainer.limit_test_batches=1"], "eval"))
    scored = json.loads((tmp_path / "eval" / "eval_metrics.json").read_text())["metrics"]
    assert scored["test/loss"] == pytest.approx(metrics["test/loss"], rel=1e-6)


def test_init_from_names_the_routes():
    with pytest.raises(ValueError, match="'vjepa2:<encoder>' \\(vit_large, vit_huge"):
        vitrel.create_model("vitrel_vit_video_tiny_patch4_32", init_from="vjepa:vit_large")
    with pytest.raises(ValueError, match="released encoders"):
        vitrel.create_model("vitrel_vit_video_tiny_patch4_32", init_from="vjepa2:vit_small", init_file="x.pt")
    with pytest.raises(ValueError, match="3 channels"):
        vitrel.create_model("vitrel_vit_video_tiny_patch4_32", init_from="vjepa2:vit_large", in_chans=1)
