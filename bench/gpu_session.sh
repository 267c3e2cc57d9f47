#!/usr/bin/env bash
# A lent GPU machine's measurements as two commands of the device tool, each within its 10-minute limit and writing
# each table as soon as it has it (a command stopped at its limit still returns what it wrote):
#   here:    bash bench/gpu_wheels.sh                          # -> .whl/ (carry it: carry [".whl"])
#   on GPU:  bash bench/gpu_session.sh pass "$OUT"             # bench/gpu.py, every section (8 minutes)
#   on GPU:  bash bench/gpu_session.sh tune "$OUT"             # bench/triton_tune.py: launch configurations, dq by
#                                                              # atomics among them (at most 200 s), then the
#                                                              # steps' kernel profile (bench/gpu.py profile, 2 min)
#   on GPU:  bash bench/gpu_session.sh one "$OUT"              # a 15-minute lease in one command (9.5 minutes):
#                                                              # the pass's kernel checks, targets and the host's cost
#                                                              # of a call (370 s), the tuning at N = 4097 (90 s),
#                                                              # the steps' profile, kernels and host (110 s)
#   on GPU:  bash bench/gpu_session.sh two "$OUT"              # after one's retune (9 minutes): the kernel checks,
#                                                              # the host's cost of a call and of the steps first,
#                                                              # ViT-B compiled, every table at 3 sizes, the breakdown
#   on GPU:  bash bench/gpu_session.sh three "$OUT"            # after two, where 6 minutes are left: Swin-T
#                                                              # compiled (200 s), the forward's stages at N = 197
#                                                              # and 1025 (the tuning, 90 s)
#   on GPU:  bash bench/gpu_session.sh four "$OUT"             # the next lease's first command (9 minutes: 530 s
#                                                              # of limits and about 20 s of start): the kernel
#                                                              # checks and ViT-B compiled and profiled (dT in dq
#                                                              # the default: ours' kernels against timm's SDPA),
#                                                              # 360 s; then the table's gradient in dq against the
#                                                              # dbias kernel with dq by atomics (--in-dq, 110 s);
#                                                              # then the tiles at
#                                                              # N = 197 (ViT-B/16's; each row with its kernels'
#                                                              # busy time, 60 s). Swin-T compiled (never measured
#                                                              # to its end) is `three`'s, where 5 minutes are left
#   on GPU:  bash bench/gpu_session.sh rest "$OUT"             # tune (at most 150 s), then the sections the
#                                                              # pass's budget leaves (bench/gpu.py REST, 3 minutes)
#   on GPU:  bash bench/gpu_session.sh cudnn "$OUT"            # issue 58's measurement, bench/cudnn_bias.py: cuDNN's
#                                                              # attention with a bias and dBias against plain SDPA
#                                                              # (no row starts after 400 s; stopped at 500 s)
# The tables land in $OUT (the device tool returns that folder) as gpu_<device>.md, triton_tune_<device>.md,
# cudnn_bias_<device>.md; commit them under bench/results/ with the device named.
set -uo pipefail
part=${1:?pass, tune, one, two, three, four, rest or cudnn}
out=${2:-bench/results}
cd "$(dirname "$0")/.."
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())")
case $part in
  pass) python3 bench/gpu.py --budget 470 --out "$out/gpu_$gpu.md" ;;
  tune) timeout 200 python3 bench/triton_tune.py --out "$out/triton_tune_$gpu.md"
        python3 bench/gpu.py --sections profile --budget 120 --out "$out/gpu_${gpu}_profile.md" ;;
  one)  python3 bench/gpu.py --sections kernel attention forward host vitb --budget 370 --out "$out/gpu_$gpu.md"
        timeout 90 python3 bench/triton_tune.py --sides 64 --out "$out/triton_tune_$gpu.md"
        python3 bench/gpu.py --sections profile --budget 110 --out "$out/gpu_${gpu}_profile.md" ;;
  two)  python3 bench/gpu.py --sections kernel host profile vitb attention diagnose models --budget 540 \
          --out "$out/gpu_$gpu.md" ;;
  three) python3 bench/gpu.py --sections swinc --budget 200 --out "$out/gpu_${gpu}_swinc.md"
        timeout 90 python3 bench/triton_tune.py --sides 14 32 --head-dims 64 --no-windows \
          --out "$out/triton_tune_$gpu.md" ;;
  four) python3 bench/gpu.py --sections kernel vitbp --budget 360 --out "$out/gpu_$gpu.md"
        timeout 110 python3 bench/triton_tune.py --in-dq --out "$out/triton_in_dq_$gpu.md"
        timeout 60 python3 bench/triton_tune.py --sides 14 --head-dims 64 --no-windows \
          --out "$out/triton_tune_197_$gpu.md" ;;
  rest) timeout 150 python3 bench/triton_tune.py --out "$out/triton_tune_$gpu.md"
        python3 bench/gpu.py --sections $(python3 -c "import bench.gpu as g; print(*g.REST)") --budget 180 \
          --out "$out/gpu_${gpu}_rest.md" ;;
  cudnn) timeout 500 python3 bench/cudnn_bias.py --budget 400 --out "$out/cudnn_bias_$gpu.md" ;;
  *) echo "bench/gpu_session.sh: pass, tune, one, two, three, four, rest or cudnn, not $part" >&2; exit 2 ;;
esac
