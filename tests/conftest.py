import os
import sys

# Triton's interpreter for the fused kernels' tests (tests/kernels/test_triton_bias.py) on a machine without a GPU: it
# must be on before anything imports triton.language (torch.export / inductor do), so it is set before torch is
# imported, for the whole session (CPU code does not use Triton otherwise)
if not os.path.exists("/dev/nvidia0") and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"

# at most 2 torch (OpenMP) threads, and no more than the cores a test worker has: `make test`'s 2 workers on 2 cores
# with 2 threads each made OpenMP's spinning threads wait on each other (a ViT-tiny step 6 s instead of 0.15 s); set
# in the environment, so the scripts and notebooks the tests start get it too (a smaller OMP_NUM_THREADS is kept)
_threads = max(1, min(2, len(os.sched_getaffinity(0)) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
if os.environ.get("OMP_NUM_THREADS", "").isdigit():
    _threads = max(1, min(_threads, int(os.environ["OMP_NUM_THREADS"])))
os.environ["OMP_NUM_THREADS"] = str(_threads)

import torch  # noqa: E402

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("MPLBACKEND", "Agg")
torch.set_num_threads(max(1, min(_threads, torch.get_num_threads())))  # (were torch imported before this file)

# the interpreter without its repeated patching and its discarded overflow checks (tests/triton_interpreter.py)
if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.triton_interpreter import skip_discarded_overflow_checks, skip_repeated_patching

    skip_repeated_patching()
    skip_discarded_overflow_checks()


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def video_sweep(tmp_path_factory):
    """A tiny ``python train.py -m experiment=video`` run, shared by the tests of a session (worker) that read its
    folder (checkpoint, metrics): ``tests.train_helpers.train_video_sweep``."""
    from tests.train_helpers import train_video_sweep

    return train_video_sweep(tmp_path_factory.mktemp("video_sweep"))


@pytest.fixture(scope="session")
def one_torchlib_registry():
    """``torch.onnx.export``'s operator registry built once for the session's (worker's) ONNX exports, each call
    handed a copy of its own (tests/onnx_registry.py): about 1 s of every export otherwise. The ONNX tests' modules
    use it."""
    from tests.onnx_registry import share_torchlib_registry

    with pytest.MonkeyPatch.context() as mp:
        share_torchlib_registry(mp)
        yield


@pytest.fixture(autouse=True)
def _no_hydra_runtime_config_left():
    """``tests.train_helpers.compose`` registers Hydra's runtime config, as ``python train.py`` has it; left set, a
    later test in the same worker read that test's command-line overrides (the study's ``train()`` refused a
    ``pos=rel2d_full`` it was never given). Cleared after each test."""
    yield
    if "hydra.core.hydra_config" in sys.modules:
        from hydra.core.hydra_config import HydraConfig

        HydraConfig.instance().cfg = None
