"""``python train.py -m pos=none,rel2d_full,rope2d_mixed,ape seed=0`` as a researcher comparing schemes runs it: every
job starts from the same patch embedding, blocks, norms and head (the weights at the start of training, each job's
own), only the schemes' own parameters differ (docs/sweeps.md)."""

from __future__ import annotations

import torch

from tests.train_helpers import FAST, TINY_VIT, run_script_forked

SCHEMES = ("none", "rel2d_full", "rope2d_mixed", "ape")
TINY = [*TINY_VIT, *FAST, "debug=fdr"]  # (one batch each, no checkpoints)


def test_a_seed_sweep_starts_every_scheme_from_the_same_weights(tmp_path):
    sweep = tmp_path / "sweep"
    save = "+callbacks.start={_target_: train_helpers.SaveWeights, dir: '${hydra:runtime.output_dir}'}"
    args = ["-m", f"pos={','.join(SCHEMES)}", "seed=0", *TINY, "test=false", save]
    r = run_script_forked("train.py", [*args, f"hydra.sweep.dir={sweep}"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    start = {pos: torch.load(sweep / str(job) / "start_rank0.pt") for job, pos in enumerate(SCHEMES)}
    ref = start["none"]
    for pos in SCHEMES[1:]:
        own = sorted(set(start[pos]) - set(ref))
        assert own and all(".pos." in k or k.startswith("abs_pos.") for k in own), own  # (the scheme's own)
        diff = {k: (start[pos][k] - ref[k]).abs().max().item() for k in ref}
        assert max(diff.values()) == 0, f"pos={pos} starts elsewhere than pos=none: {diff}"
