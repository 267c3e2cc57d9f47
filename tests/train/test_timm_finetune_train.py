"""Fine-tuning timm's weights with ``train.py model.init_from=timm:<name> model.init_file=<file> pos=<scheme>``: the
run's checkpoint keeps the source's layout, and ``eval.py`` scores the checkpoint as the run tested it.

ConViT (``pos=gpsa``): GPSA in the first blocks, the class token joining after them. BEiT (``pos=rel2d_beit``): the
class-token terms of its bias, layer scale, mean pooling."""

from __future__ import annotations

import json

import pytest
import timm
import torch
from safetensors.torch import save_file

import vitrel
from tests.data.test_datamodules import make_cifar_files
from tests.train_helpers import FAST, compose
from vitrel.train.evaluate import evaluate
from vitrel.train.run import train

TINY = {"img_size": 32, "patch_size": 4, "embed_dim": 8, "num_heads": 2, "depth": 2}


def _convit_layout(m) -> None:
    assert (m.vitrel_cfg["pos_depth"], m.vitrel_cfg["prefix_at"], m.vitrel_cfg["abs_pos"]) == (1, 1, "ape")
    assert [blk.attn.pos.name for blk in m.blocks] == ["gpsa", "none"] and m.global_pool == "token"


def _beit_layout(m) -> None:
    assert m.vitrel_cfg["pos"]["name"] == "rel2d_beit" and m.global_pool == "avg" and m.vitrel_cfg["fc_norm"]
    assert m.blocks[0].attn.pos.prefix_terms.shape == (3, 2) and m.blocks[1].ls1.gamma.shape == (8,)


SOURCES = {
    "convit_tiny": ({"local_up_to_layer": 1}, "gpsa", _convit_layout),
    "beit_base_patch16_224": ({"init_values": 0.1}, "rel2d_beit", _beit_layout),
}


@pytest.mark.parametrize("name", list(SOURCES))
def test_a_finetune_keeps_the_source_layout_and_eval_scores_it_as_tested(tmp_path, name):
    more, pos, check_layout = SOURCES[name]
    make_cifar_files(tmp_path / "cifar", 10, n_per_batch=8)
    torch.manual_seed(0)
    t = timm.create_model(name, **TINY, **more)
    save_file(t.state_dict(), str(tmp_path / "weights.safetensors"))
    data = ["data=cifar10", f"data.root={tmp_path / 'cifar'}", "data.verify=false", "data.val_fraction=0.0"]
    kw = "{" + ", ".join(f"{k}: {v}" for k, v in {**TINY, **more}.items()) + "}"
    model = [f"model.init_from=timm:{name}", f"model.init_file={tmp_path / 'weights.safetensors'}", f"pos={pos}"]
    model.append(f"+model.timm_kwargs={kw}")
    short = ["trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1"]
    short += ["trainer.limit_test_batches=2", "logger=none"]
    metrics = train(compose(tmp_path / "run", [*data, *model, *FAST, *short]))
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    check_layout(vitrel.load_model(ckpt))
    evaluate(compose(tmp_path / "eval", [f"ckpt_path={ckpt}", *data, "trainer.limit_test_batches=2"], "eval"))
    scored = json.loads((tmp_path / "eval" / "eval_metrics.json").read_text())["metrics"]
    assert scored["test/loss"] == metrics["test/loss"] and scored["test/acc5"] == metrics["test/acc5"]
