"""What a user runs after training, on video: a video model started from an image checkpoint that train.py wrote
(inflation), then fine-tuned by train.py (model=from_checkpoint)."""

from __future__ import annotations

import pytest
import torch

import vitrel
from tests.train_helpers import FAST, TINY_VIT, compose
from vitrel.models.data_config import stored_data_config
from vitrel.models.inflate import inflate_image_model
from vitrel.train.run import train

SHORT = ["trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1"]
SHORT += ["trainer.limit_test_batches=1", "logger=none"]


@pytest.fixture(scope="module")
def image_run(tmp_path_factory):
    """``python train.py model=vit_tiny_fmnist +model.class_token=false pos=rel2d_full`` (tiny, two steps): its
    ``last.ckpt``."""
    out = tmp_path_factory.mktemp("image_run")
    train(compose(out, [*TINY_VIT, "+model.class_token=false", "pos=rel2d_full", *FAST, *SHORT]))
    return out / "checkpoints" / "last.ckpt"


def _video_of(image_cfg: dict) -> torch.nn.Module:
    """The video ViT matching the image run's model (widths, patches, 28-px frames), ``rel3d_full``."""
    keys = ("embed_dim", "depth", "num_heads", "mlp_ratio", "patch_size", "img_size", "in_chans", "num_classes")
    args = {k: image_cfg[k] for k in keys}
    return vitrel.create_model("vitrel_vit_video_tiny_patch4_32", pos="rel3d_full", num_frames=4, **args)


@pytest.mark.parametrize("source", ["checkpoint", "model"])
def test_an_inflated_model_keeps_the_image_runs_preprocessing(image_run, source):
    """The image run normalised Fashion-MNIST with its own mean and std: the inflated video model carries them (and
    the class names, with the head) in ``pretrained_cfg``, as ``vitrel.load_model`` of the checkpoint does, so that a
    fine-tune or ``predict.py`` normalises frames as the image model saw them, not with the architecture's 0.5 / 0.5.
    On a clip of identical frames the inflated model then gives the image model's logits (float64)."""
    image = vitrel.load_model(image_run).eval()
    stored = stored_data_config(image_run)
    vid = inflate_image_model(image_run if source == "checkpoint" else image, _video_of(image.vitrel_cfg))
    assert image.pretrained_cfg["mean"] == pytest.approx(stored["mean"]) and stored["mean"] != [0.5]
    for key in ("mean", "std", "interpolation", "crop_pct", "crop_mode"):
        assert vid.pretrained_cfg[key] == image.pretrained_cfg[key], key
    assert list(vid.pretrained_cfg["label_names"]) == stored["class_names"]
    assert vid.pretrained_cfg["input_size"] == (1, 28, 28) and vid.pretrained_cfg["num_frames"] == 4
    frame = torch.rand(2, 1, 28, 28, dtype=torch.float64)
    with torch.no_grad():
        clip = frame[:, :, None].expand(-1, -1, 4, -1, -1)
        torch.testing.assert_close(vid.double().eval()(clip), image.double()(frame), rtol=1e-10, atol=1e-10)
    fresh = inflate_image_model(image_run, _video_of(image.vitrel_cfg), head=False)  # another label set: no names
    assert "label_names" not in fresh.pretrained_cfg and fresh.pretrained_cfg["mean"] == image.pretrained_cfg["mean"]
