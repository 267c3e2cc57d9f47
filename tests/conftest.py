import os

import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("MPLBACKEND", "Agg")
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
