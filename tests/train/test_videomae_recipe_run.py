"""``python train.py experiment=videomae_finetune`` (conf/experiment/videomae_finetune.yaml) on a few tiny videos in
class folders, from a VideoMAE pre-training checkpoint in the authors' layout (ViT-B's width, one block, made small):
the run fine-tunes their encoder with their recipe's pieces (RandAugment and erasing on the clips, mixup, layer-wise
learning-rate decay) and scores 5 clips x 3 crops a video."""

from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate

import vitrel
from tests.models.test_videomae_import import network_weights
from tests.train.test_video_first_hour import video_tree  # noqa: F401 (the fixture)
from tests.train_helpers import FAST, compose
from vitrel.train.run import train

pytest.importorskip("av", reason="PyAV not installed: pip install -e '.[video]'")


def test_the_recipe_fine_tunes_their_pretrained_encoder(video_tree, tmp_path):  # noqa: F811
    encoder = {k: v.float() for k, v in network_weights(6, dim=768, depth=1, head=False).items()}
    encoder = {k: v for k, v in encoder.items() if not k.startswith("fc_norm.")}
    pretraining = {f"encoder.{k}": v for k, v in encoder.items()} | {
        "encoder.norm.weight": torch.ones(768), "encoder.norm.bias": torch.zeros(768),
        "decoder.norm.weight": torch.ones(384), "encoder_to_decoder.weight": torch.zeros(384, 768),
    }  # fmt: skip
    path = tmp_path / "videomae_vitb_pretrain.pth"
    torch.save({"model": pretraining}, path)
    data = [f"data.root={video_tree}", "data.img_size=16", "data.num_frames=2", "data.stride=1", "data.batch_size=2"]
    data += ["data.pin_memory=false", "data.num_workers=0"]
    over = ["experiment=videomae_finetune", f"model.init_file={path}", "trainer=cpu", "trainer.max_epochs=1"]
    over += ["logger=none", *FAST[2:], *data]
    cfg = compose(tmp_path / "run", over)
    clips = instantiate(cfg.data).train_transform()  # (their training clips' augmentation)
    assert (clips.rand_augment.config, clips.erase.prob, clips.erase.mode) == ("rand-m7-n4-mstd0.5-inc1", 0.25, "pixel")
    with pytest.warns(UserWarning, match="architecture is vit_base's"):
        metrics = train(cfg)
    assert 0.0 <= metrics["test/acc1"] <= 1.0
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    state = torch.load(ckpt, weights_only=True)
    stored = state["hyper_parameters"]["data_config"]
    assert (stored["clips_per_video"], stored["spatial_crops"], stored["num_frames"]) == (5, 3, 2)
    lrs = sorted({g["initial_lr"] for g in state["optimizer_states"][0]["param_groups"]})
    assert len(lrs) == 3 and lrs[0] / lrs[-1] == pytest.approx(0.75**2)  # (layer decay: stem, the block, the head)
    m = vitrel.load_model(ckpt)
    assert (m.vitrel_cfg["embed_dim"], m.abs_pos.name, m.num_classes) == (768, "sincos1d", 2)
    assert m.vitrel_cfg["head_init_scale"] == 0.001  # (their init_scale)
