# vitrel: two commands for a fresh clone — `make train` and `make test`.
PY ?= python3
PIP := $(PY) -m pip
# torch/torchvision are pinned here (not in pyproject) to the releases this machine has on disk.
TORCH_PIN := torch==2.14.1 torchvision==0.29.1
PYTEST_WORKERS ?= 2

.PHONY: install hooks test train lint bench fmnist-full

install: hooks
	$(PIP) install -q $(TORCH_PIN)
	$(PIP) install -q -e ".[dev]" $(TORCH_PIN)

# git runs .githooks/ (commit-msg: subject <= 72 characters) when this folder is a git checkout's top; else nothing
hooks:
	@if command -v git >/dev/null 2>&1 && [ "$$(git rev-parse --show-toplevel 2>/dev/null)" = "$$(pwd -P)" ]; then \
		git config core.hooksPath .githooks && echo "git hooks: .githooks"; fi

test: install
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal --durations=15

train: install
	$(PY) train.py

lint:
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

bench: install
	$(PY) bench/attention.py

# run every notebook top to bottom (nbclient's `jupyter execute`, in the dev extras); the executed copies, with
# their outputs and figures, go to outputs/notebooks/ (notebooks/ keeps them without outputs); notebooks/README.md
.PHONY: notebooks
notebooks: install
	mkdir -p outputs/notebooks
	MPLBACKEND=Agg $(PY) -m jupyter execute --kernel_name=python3 --timeout=600 \
		--output='../outputs/notebooks/{notebook_name}' notebooks/*.ipynb

# Full Fashion-MNIST (60k/10k) from Debian, for the study in bench/study.py
fmnist-full:
	apt-get install -y dataset-fashion-mnist
