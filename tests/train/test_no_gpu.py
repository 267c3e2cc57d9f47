"""A GPU trainer (conf/trainer: gpu, ddp, ddp_spawn, multi_node) on a machine without a GPU: one line naming what was
asked and the CPU settings, not Lightning's MisconfigurationException inside Hydra's traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.train_helpers import CONF, TINY_VIT, compose, run_script_forked
from vitrel.train.run import train
from vitrel.train.utils import AcceleratorUnavailableError, check_accelerator

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU")

SHORT = [*TINY_VIT, "logger=none", "progress_bar=none", "trainer.max_epochs=1"]


def test_trainer_gpu_without_a_gpu_is_one_line(tmp_path):
    """``python train.py trainer=gpu``: one line, before the run folder gets anything."""
    proc = run_script_forked("train.py", [*SHORT, "trainer=gpu", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = (proc.stdout + proc.stderr).strip()
    assert "Traceback" not in out and "MisconfigurationException" not in out, out[-3000:]
    last = out.splitlines()[-1]
    assert last.startswith(
        "train.py: AcceleratorUnavailableError: trainer=gpu (trainer.accelerator=gpu) asks for a GPU"
    ), last
    assert "train on the CPU with trainer=cpu (trainer.accelerator=cpu alone keeps trainer=gpu's bf16" in last, last
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_every_gpu_trainer_option_says_what_to_run(tmp_path):
    """The options of conf/trainer that ask for a GPU, and trainer.accelerator=cuda on the default trainer."""
    gpu_options = sorted(p.stem for p in (CONF / "trainer").glob("*.yaml") if _accelerator(p) == "gpu")
    assert gpu_options == ["ddp", "ddp_spawn", "gpu", "multi_node"]
    for option in gpu_options:
        with pytest.raises(AcceleratorUnavailableError) as e:
            train(compose(tmp_path / option, [*SHORT, f"trainer={option}"]))
        msg = str(e.value)
        assert msg.startswith(f"trainer={option} (trainer.accelerator=gpu) asks for a GPU"), msg
        if option != "gpu":  # the DDP options: their settings for processes on the CPU (conf/trainer/ddp.yaml)
            assert "trainer.accelerator=cpu trainer.devices=2 trainer.precision=32-true" in msg, msg
    with pytest.raises(AcceleratorUnavailableError, match=r"^trainer.accelerator=cuda asks for a CUDA GPU.*: train "):
        train(compose(tmp_path / "cuda", [*SHORT, "trainer.accelerator=cuda"]))
    for fixed in ("trainer=cpu", "trainer=gpu trainer.accelerator=cpu", "trainer=ddp trainer.accelerator=cpu"):
        check_accelerator(compose(tmp_path / "cpu", [*SHORT, *fixed.split()]).trainer)


def _accelerator(path: Path) -> str | None:
    """``accelerator`` of a conf/trainer option, following its defaults (ddp_spawn and multi_node extend ddp)."""
    node = OmegaConf.load(path)
    if "accelerator" in node:
        return node.accelerator
    parents = [d for d in node.get("defaults", []) if isinstance(d, str) and d != "_self_"]
    return _accelerator(path.with_name(f"{parents[-1]}.yaml")) if parents else None


def test_eval_with_a_gpu_trainer_says_what_to_run(tmp_path):
    """``eval.py trainer=gpu`` (conf/eval.yaml has the same trainer group): the same error, before the checkpoint is
    read (here there is none)."""
    from vitrel.train.evaluate import evaluate

    cfg = compose(tmp_path / "eval", [f"ckpt_path={tmp_path / 'none.ckpt'}", "trainer=gpu"], config_name="eval")
    with pytest.raises(AcceleratorUnavailableError, match=r"^trainer=gpu \(trainer.accelerator=gpu\) asks for a GPU"):
        evaluate(cfg)
    cfg = compose(tmp_path / "eval", [f"ckpt_path={tmp_path / 'none.ckpt'}", "trainer.accelerator=gpu"], "eval")
    with pytest.raises(AcceleratorUnavailableError, match=r"none on this machine.*: evaluate on the CPU with trainer"):
        evaluate(cfg)  # (not "train on the CPU")
