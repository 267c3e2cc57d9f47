"""The module's epoch means of the loss weigh each batch by its images and pass a NaN through."""

from __future__ import annotations

import torch
from torch import nn

from vitrel.train.module import ClassifierModule


def test_loss_means_weigh_batches_by_images_and_keep_nan():
    module = ClassifierModule(nn.Linear(4, 3), num_classes=3)
    for mean in (module.train_loss, module.val_loss, module.test_loss):
        mean.update(torch.tensor(1.0), weight=3)  # a batch of 3 images, then a last batch of 1
        mean.update(torch.tensor(2.0), weight=1)
        assert mean.compute().item() == 1.25  # (3 x 1 + 1 x 2) / 4 images; a mean over batches is 1.5
        mean.update(torch.tensor(float("nan")), weight=2)
        assert mean.compute().isnan()  # NaNGuard sees it (not dropped)
