"""A data, model or scheme setting vitrel refuses (``data.batch_size=0``, ``model.num_heads=5``, ``pos.fov=60``) ends
``train.py`` and ``eval.py`` with one line, ``<script>: <key>: ValueError: <message>``, exit code 1: the ValueError
came to the user inside Hydra's ``InstantiationException`` ("Error executing job with overrides", "Error in call to
target", the message twice, ``full_key: data``), and the batch-size message said ``got 0, None`` without naming the
setting."""

from __future__ import annotations

import pytest
from hydra.errors import InstantiationException
from hydra.utils import instantiate

import vitrel
from tests.train_helpers import run_script_forked
from vitrel.models.checkpoint import save_pretrained
from vitrel.train.user_errors import one_line_errors

TRAIN = ["trainer.accelerator=cpu", "data.num_workers=0"]


@pytest.mark.parametrize(
    "setting, line",
    [
        ("data.batch_size=0", "data: ValueError: batch_size must be >= 1, got 0"),
        ("data.eval_batch_size=0", "data: ValueError: eval_batch_size must be >= 1, got 0"),
        ("data.val_fraction=1.5", "data: ValueError: val_fraction must be in [0, 1), got 1.5"),
        ("data.batch_augment.hflip=2", "data.batch_augment: ValueError: hflip must be a probability in [0, 1], got 2"),
        ("model.num_heads=5", "model: ValueError: embed_dim 64 is not divisible by num_heads 5"),
        ("pos=lookhere pos.fov=60", "model: ValueError: lookhere: fov must be one of [45, 90, 180], got 60"),
        ("model.drop_path_rate=2", "model: ValueError: drop_path_rate must be a number in [0, 1], got 2"),
    ],
)
def test_train_py_refuses_a_setting_in_one_line(tmp_path, setting, line):
    args = [*setting.split(), *TRAIN, f"hydra.run.dir={tmp_path / 'run'}"]
    r = run_script_forked("train.py", args, cwd=tmp_path)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stderr.strip().splitlines() == [f"train.py: {line}"], r.stderr[-3000:]
    assert "Error in call to target" not in r.stdout + r.stderr


def test_eval_py_refuses_a_data_setting_in_one_line(tmp_path):
    model = vitrel.create_model("vitrel_vit_tiny_patch4_32", embed_dim=16, depth=1, num_heads=2, num_classes=10)
    save_pretrained(model, tmp_path / "export")
    args = [f"ckpt_path={tmp_path / 'export'}", "data.batch_size=0", *TRAIN, f"hydra.run.dir={tmp_path / 'eval'}"]
    r = run_script_forked("eval.py", args, cwd=tmp_path)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1] == "eval.py: data: ValueError: batch_size must be >= 1, got 0"
    assert "Traceback" not in r.stderr and "Error in call to target" not in r.stdout + r.stderr


def test_a_library_value_error_keeps_its_traceback():
    """A ValueError that a library raises (numpy here; a damaged file's) is not a data setting: Hydra's error stays."""
    with pytest.raises(InstantiationException, match="negative dimensions"), one_line_errors("train.py"):
        instantiate({"_target_": "numpy.zeros", "shape": -1})


def test_a_video_folder_too_small_for_the_batch_is_one_line(tmp_path):
    """docs/video.md's ``experiment=video data=video_folder data.root=<videos>`` on a folder of 4 training clips ended
    in a Lightning traceback around the message, with the recipe's batch of 64 (Moving Fashion-MNIST's): the folder
    keeps its own batch_size 8, and a split too small for it is one line."""
    pytest.importorskip("av", reason="PyAV not installed: pip install -e '.[video]'")
    from tests.data.test_video import write_video

    for split in ("train", "val"):
        for cls in ("archery", "bowling"):
            for k in range(2):
                write_video(tmp_path / "v" / split / cls / f"{k}.avi", 8, "ffv1", "yuv420p", hw=(16, 16))
    args = ["experiment=video", "data=video_folder", f"data.root={tmp_path / 'v'}", *TRAIN]
    r = run_script_forked("train.py", [*args, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stderr.strip().splitlines() == [
        "train.py: SplitTooSmallError: data.batch_size=8 but the training split has 4 clips, and data.drop_last=true "
        "drops the incomplete batch: no training step is left. Set data.batch_size to at most 4, or "
        "data.drop_last=false"
    ], r.stderr[-3000:]
