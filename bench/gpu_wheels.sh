#!/usr/bin/env bash
# The wheels a lent GPU machine needs beside its own packages (it has no network): timm 1.0.31 (it has 1.0.29; vitrel
# needs timm.models._input) and, for the training tests under `pytest -m cuda` (trainer=gpu), hydra-core, omegaconf
# and antlr4-python3-runtime 4.9.3 (no wheel on PyPI: built here from its pure-Python sdist); pytest-xdist and execnet
# (bench/gpu.py's kernel section runs its tests in 4 processes: Triton compiling each variant is most of its time);
# nvidia-cudnn-frontend 1.32.0 (`import cudnn`, for bench/cudnn_bias.py; manylinux_2_28 only, so its own line).
#   bash bench/gpu_wheels.sh            # -> .whl/ (git-ignored by its own .whl/.gitignore: a worktree's .git is a file)
# On the GPU machine: python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#                     export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
echo '*' > .whl/.gitignore
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
  -d .whl timm==1.0.31 hydra-core==1.3.2 omegaconf==2.3.0 pytest-xdist==3.8.0 execnet==2.1.2
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
  -d .whl nvidia-cudnn-frontend==1.32.0
python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
ls .whl
