#!/usr/bin/env bash
# A run killed with SIGKILL mid-epoch and resumed (resume=auto, the same command) against the same run uninterrupted:
# the user's path (train.py, its checkpoints, its CSV log), not the test suite's. Prints, per column of metrics.csv,
# the largest difference between the two runs, and the largest difference of the last checkpoints' weights.
#   bash bench/kill_resume.sh [OUT_DIR] [extra train.py overrides...]     (two runs of the recipe: ~10 min each, 2 cores)
#   DDP on CPU: bash bench/kill_resume.sh OUT trainer=ddp trainer.accelerator=cpu trainer.devices=2 trainer.precision=32-true
# The kill comes once last.ckpt holds step 30 (a step checkpoint every 15 steps; epochs of 141 steps).
set -euo pipefail
out=${1:-/tmp/vitrel_kill_resume}; shift || true
args=(experiment=fmnist_quick logger=csv trainer.max_epochs=2 callbacks.last_checkpoint.every_n_train_steps=15
      progress_bar=lines "$@")
rm -rf "$out" && mkdir -p "$out"
python train.py "${args[@]}" hydra.run.dir="$out/uninterrupted" > "$out/uninterrupted.log" 2>&1
setsid python train.py "${args[@]}" hydra.run.dir="$out/killed" > "$out/killed.log" 2>&1 &
pid=$!  # its own process group: a DDP run's other ranks are killed with it, as a node dies
step_of_last() {  # the global step of <run>/checkpoints/last.ckpt, or -1
  python -c "import sys, torch
try: print(torch.load(sys.argv[1], map_location='cpu', weights_only=False)['global_step'])
except Exception: print(-1)" "$out/killed/checkpoints/last.ckpt"
}
until [ "$(step_of_last)" -ge 30 ]; do sleep 1; done
kill -9 -- -"$pid"; wait "$pid" 2>/dev/null || true
echo "killed after the checkpoint of step $(step_of_last)"
python train.py "${args[@]}" hydra.run.dir="$out/killed" > "$out/resumed.log" 2>&1
python - "$out" <<'PY'
import sys
import numpy as np, pandas as pd, torch
out = sys.argv[1]
a, b = (pd.read_csv(f"{out}/{r}/csv/metrics.csv") for r in ("uninterrupted", "killed"))
print(f"metrics.csv rows: uninterrupted {len(a)}, killed and resumed {len(b)}")
for c in a.columns:
    if c in b and a[c].dtype.kind == "f" and len(a) == len(b):
        print(f"  {c:24s} max |difference| {np.nanmax(np.abs(a[c].to_numpy() - b[c].to_numpy())):.3g}")
sa, sb = (torch.load(f"{out}/{r}/checkpoints/last.ckpt", map_location="cpu", weights_only=False)["state_dict"]
          for r in ("uninterrupted", "killed"))
print(f"last.ckpt: {len(sa)} tensors, max |difference| {max((sa[k].float() - sb[k].float()).abs().max().item() for k in sa):.3g}")
PY
