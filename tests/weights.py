"""Weights under which a model's attention is far from uniform, for tests that compare two computations of it."""

from __future__ import annotations

import math

import torch
from torch import nn


def lively(model: nn.Module, seed: int = 1) -> nn.Module:
    """Redraw ``model``'s weights in place at the scale of PyTorch's default init and return it.

    Matrices: N(0, 1 / fan_in); biases, position tables and scales: moved by N(0, 0.5^2); norms kept. Under timm's
    init (``trunc_normal(0.02)``, tables at zero) attention is almost uniform and a position scheme moves a small
    model's logits by less than a test's tolerance (a 2-block ViT with rel2d_full: 6e-6), so a scheme dropped, or
    a gradient computed wrongly, passes unseen; here schemes move the logits by 1e-3 to 0.9."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p[0].numel()))
            elif not name.rsplit(".", 1)[0].endswith(("norm", "norm1", "norm2")):
                p.add_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def reloaded_as_written(model: nn.Module, path, **stored) -> nn.Module:
    """``model``'s weights in a training checkpoint at ``path`` whose stored ``vitrel_cfg`` has ``stored`` over the
    model's (``vitrel_format=5, pos={...}``: as an older vitrel wrote it), loaded back by ``vitrel.load_model``."""
    import vitrel

    cfg = {**model.vitrel_cfg, **stored}
    torch.save({"state_dict": {"model." + k: v for k, v in model.state_dict().items()}, "vitrel_cfg": cfg}, path)
    return vitrel.load_model(path).eval()
