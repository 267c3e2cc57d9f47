"""Fine-tuning ConViT's weights with ``train.py model.init_from=timm:convit_tiny model.init_file=<file> pos=gpsa``:
the run's checkpoint keeps ConViT's layout (GPSA in the first blocks, the class token joining after them), and
``eval.py`` scores the checkpoint as the run tested it."""

from __future__ import annotations

import json

import timm
import torch
from safetensors.torch import save_file

import vitrel
from tests.data.test_datamodules import make_cifar_files
from tests.train_helpers import FAST, compose
from vitrel.train.evaluate import evaluate
from vitrel.train.run import train

SMALL = {"img_size": 32, "patch_size": 4, "embed_dim": 8, "num_heads": 2, "depth": 2, "local_up_to_layer": 1}


def test_a_convit_finetune_keeps_its_layout_and_eval_scores_it_as_tested(tmp_path):
    make_cifar_files(tmp_path / "cifar", 10, n_per_batch=8)
    torch.manual_seed(0)
    t = timm.create_model("convit_tiny", **SMALL)
    save_file(t.state_dict(), str(tmp_path / "convit.safetensors"))
    data = ["data=cifar10", f"data.root={tmp_path / 'cifar'}", "data.verify=false", "data.val_fraction=0.0"]
    kw = "{" + ", ".join(f"{k}: {v}" for k, v in SMALL.items()) + "}"
    model = ["model.init_from=timm:convit_tiny", f"model.init_file={tmp_path / 'convit.safetensors'}", "pos=gpsa"]
    model.append(f"+model.timm_kwargs={kw}")
    short = ["trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1"]
    short += ["trainer.limit_test_batches=2", "logger=none"]
    metrics = train(compose(tmp_path / "run", [*data, *model, *FAST, *short]))
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    m = vitrel.load_model(ckpt)
    assert (m.vitrel_cfg["pos_depth"], m.vitrel_cfg["prefix_at"], m.vitrel_cfg["abs_pos"]) == (1, 1, "ape")
    assert [blk.attn.pos.name for blk in m.blocks] == ["gpsa", "none"] and m.global_pool == "token"
    evaluate(compose(tmp_path / "eval", [f"ckpt_path={ckpt}", *data, "trainer.limit_test_batches=2"], "eval"))
    scored = json.loads((tmp_path / "eval" / "eval_metrics.json").read_text())["metrics"]
    assert scored["test/loss"] == metrics["test/loss"] and scored["test/acc5"] == metrics["test/acc5"]
