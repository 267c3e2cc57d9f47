import os

# Triton's interpreter for the fused kernels' tests (tests/kernels/test_triton_bias.py) on a machine without a GPU: it
# must be on before anything imports triton.language (torch.export / inductor do), so it is set before torch is
# imported, for the whole session (CPU code does not use Triton otherwise)
if not os.path.exists("/dev/nvidia0") and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("MPLBACKEND", "Agg")
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
