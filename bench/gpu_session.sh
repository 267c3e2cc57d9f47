#!/usr/bin/env bash
# A lent GPU machine's measurements as two commands of the device tool, each within its 10-minute limit and writing
# each table as soon as it has it (a command stopped at its limit still returns what it wrote):
#   here:    bash bench/gpu_wheels.sh                          # -> .whl/ (carry it: carry [".whl"])
#   on GPU:  bash bench/gpu_session.sh pass "$OUT"             # bench/gpu.py, every section (8 minutes)
#   on GPU:  bash bench/gpu_session.sh tune "$OUT"             # bench/triton_tune.py: launch configurations, dq by
#                                                              # atomics among them (at most 4 minutes)
# The tables land in $OUT (the device tool returns that folder) as gpu_<device>.md, triton_tune_<device>.md; commit
# them under bench/results/ with the device named.
set -uo pipefail
part=${1:?pass or tune}
out=${2:-bench/results}
cd "$(dirname "$0")/.."
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())")
case $part in
  pass) python3 bench/gpu.py --budget 470 --out "$out/gpu_$gpu.md" ;;
  tune) timeout 240 python3 bench/triton_tune.py --out "$out/triton_tune_$gpu.md" ;;
  *) echo "bench/gpu_session.sh: pass or tune, not $part" >&2; exit 2 ;;
esac
