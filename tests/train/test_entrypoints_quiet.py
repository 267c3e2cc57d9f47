"""What ``python train.py`` and ``python eval.py`` print and log: no third-party notices that say nothing to a user
(filtered by the entry points, ``vitrel.train.utils.quiet_third_party``), the table-resize warning once per load
(naming the rule, attributed to the script, not to torch), and the run's log in ``<run folder>/<task>.log``."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from tests.train_helpers import FAST, ROOT, TINY_VIT, run_script

pytestmark = pytest.mark.slow

#: what the notices that the entry points filter say (each printed on every run before)
NOISE = {
    "Lightning's litlogger tip": "litlogger",
    "Lightning's litmodels tip": "litmodels",
    "torch's LeafSpec deprecation (from Lightning)": "LeafSpec",
    "W&B's anonymous-mode notice": "anonymous setting",
    "a warning attributed to torch's module.py": "torch/nn/modules/module.py",
}
RESIZED = "resized relative-position tables"


def _noise(text: str) -> list[str]:
    return [what for what, says in NOISE.items() if says in text]


def test_train_then_eval_at_another_size_print_no_noise_and_log_to_the_run_folder(tmp_path):
    run = tmp_path / "run"
    args = [*TINY_VIT, *FAST, "logger=wandb", "trainer.max_epochs=1", "trainer.limit_train_batches=2"]
    args += ["trainer.limit_val_batches=1", "trainer.limit_test_batches=1", "trainer.log_every_n_steps=1"]
    r = run_script("train.py", [*args, f"hydra.run.dir={run}"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert not _noise(r.stdout + r.stderr), r.stderr[-4000:]
    # the run's log: vitrel's and Lightning's messages (Lightning's loggers no longer bypass the log file)
    log = (run / "train.log").read_text()
    assert f"run folder {run}" in log and "Seed set to 0" in log and "`Trainer.fit` stopped" in log, log
    params = json.loads((run / "metrics.json").read_text())["params"]  # (exact: "0.02M" for every tiny scheme)
    assert f"({params:,} parameters), data " in log, log
    # the closing summary is the console's (docs/training.md)
    assert "test accuracy" in r.stdout and "test accuracy" not in log, log

    # 7x7 -> 10x10 patches: each block's two tables grow (4 tables), one warning
    ev = tmp_path / "eval"
    args = [f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}", "data.img_size=40", "trainer.limit_test_batches=1"]
    e = run_script("eval.py", [*args, "progress_bar=none", f"hydra.run.dir={ev}"], cwd=tmp_path)
    assert e.returncode == 0, e.stdout[-2000:] + e.stderr[-4000:]
    assert not _noise(e.stdout + e.stderr), e.stderr[-4000:]
    lines = [ln for ln in e.stderr.splitlines() if RESIZED in ln]
    assert len(lines) == 1, e.stderr
    assert "extend='grow'" in lines[0] and "option `extend`" in lines[0] and "(13, 2) -> (19, 2)" in lines[0]
    assert lines[0].startswith(f"{ROOT / 'eval.py'}:"), lines[0]  # the script, not torch
    assert "Seed set to 0" in (ev / "eval.log").read_text()


def test_resize_warning_once_per_load_in_a_library_call():
    """``load_state_dict`` of a 4-block model at another size: one warning (not one per table), attributed to the
    caller's line, and again for the next load (Python's default filter keys on the calling line)."""
    import vitrel

    kw = dict(embed_dim=32, depth=4, num_heads=2, pos="rel2d_factored")
    small = vitrel.create_model("vitrel_vit_tiny_patch4_32", img_size=16, **kw)
    big = vitrel.create_model("vitrel_vit_tiny_patch4_32", img_size=28, **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        for _ in range(2):
            big.load_state_dict(small.state_dict())  # the same line twice: shown once
    resized = [w for w in caught if RESIZED in str(w.message)]
    assert len(resized) == 1, [str(w.message) for w in caught]
    assert resized[0].filename == __file__, resized[0].filename
    assert "(7, 2) -> (13, 2)" in str(resized[0].message)
    torch.testing.assert_close(big.blocks[3].attn.pos.table_h[3:10], small.blocks[3].attn.pos.table_h)  # grown
