"""Device-resident data sets: uint8 tensors on the training device, batches by index, batched transforms.

``data.loader=memory`` (the default for Fashion-MNIST, CIFAR and :class:`~vitrel.data.ArrayDataModule`):
the DataModule loads each split once as a uint8 tensor ``[N, C, h, w]`` (:class:`TensorImageDataset`)
and moves it to the trainer's device (the GPU when training on one). A :class:`MemoryLoader` takes
batch ``k`` of an epoch as ``images[order[k B:(k + 1) B]]`` from the same seeded per-epoch order as the
worker path's :class:`~vitrel.data.base.EpochSampler` (rank ``r`` of ``W`` taking ``order[r::W]``) and
runs the whole batch through :func:`vitrel.data.augment.batch_pipeline`: no worker processes, no
per-sample Python.

With augmentation off, the batches equal those of ``data.loader=workers`` (same images, labels, order
and values) at the native size and with the canvas (``canvas_size``; the evaluation offsets are those of
:class:`~vitrel.data.TranslatedDataset`); a resize to another ``img_size`` uses torchvision's tensor
resize where the worker path resizes PIL images (close, not bit-equal).

The loader is resumable mid-epoch (``state_dict``: ``{"epoch", "batches", "batch_size", "num_replicas"}``); the
augmentation of an epoch is drawn from ``(seed, epoch)``, so a resumed epoch gets the parameters it would have had.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset
from torchvision.transforms import InterpolationMode

from vitrel.data.augment import BatchAugment, batch_pipeline
from vitrel.data.transforms import offset_region

__all__ = [
    "TensorImageDataset",
    "MemoryLoader",
    "ResumableLoader",
    "MemoryBudgetError",
    "memory_budget_bytes",
    "to_uint8_nchw",
    "eval_images",
]


class MemoryBudgetError(MemoryError):
    """A data set does not fit the memory budget of the device it should be held on."""


class ResumableLoader:
    """What :class:`~vitrel.train.callbacks.ExactResume` needs of a training loader: ``state_dict()``
    (``{"epoch", "batches", "batch_size", "num_replicas"}``: its position in the epoch, counted in batches of
    ``batch_size`` samples of each of ``num_replicas`` ranks) and ``load_state_dict(state)`` (the next iteration of
    that epoch starts after those batches). A position means the same samples only at the same batch size and number
    of ranks (:func:`~vitrel.train.callbacks.check_resume_position`)."""

    def state_dict(self) -> dict[str, int]:
        raise NotImplementedError

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        raise NotImplementedError


def to_uint8_nchw(images: np.ndarray | Tensor, channels: int | None = None) -> Tensor:
    """uint8 images ``[N, H, W]``, ``[N, H, W, C]`` (numpy's layout) -> a contiguous ``[N, C, H, W]``
    tensor; a single channel is repeated to ``channels`` when asked (grayscale fed as RGB)."""
    x = torch.as_tensor(images)
    if x.dtype != torch.uint8 or x.ndim not in (3, 4):
        raise ValueError(f"images must be uint8 [N, H, W(, C)], got {x.dtype} {tuple(x.shape)}")
    x = x[:, None] if x.ndim == 3 else x.permute(0, 3, 1, 2)
    if channels is not None and x.shape[1] != channels:
        if x.shape[1] != 1:
            raise ValueError(f"cannot make {channels}-channel images from {x.shape[1]} channels")
        x = x.expand(-1, channels, -1, -1)
    return x.contiguous()


def _available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:  # Linux: MemAvailable
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def memory_budget_bytes(device: torch.device, budget_gb: float | None = None) -> int:
    """Bytes a data module may hold on ``device``: ``budget_gb`` if given, else half of what is free
    now (CUDA: ``torch.cuda.mem_get_info``; CPU: ``MemAvailable``)."""
    if budget_gb is not None:
        return int(budget_gb * 2**30)
    return _available_bytes(device) // 2


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GB", 2**30), ("MB", 2**20), ("kB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def check_budget(name: str, sizes: dict[str, int], device: torch.device, budget_gb: float | None) -> None:
    """Raise :class:`MemoryBudgetError` when the splits' ``sizes`` (bytes) exceed the budget on ``device``."""
    need, budget = sum(sizes.values()), memory_budget_bytes(device, budget_gb)
    if need <= budget:
        return
    parts = " + ".join(f"{k} {_fmt_bytes(v)}" for k, v in sizes.items())
    how = f"data.memory_budget_gb={budget_gb}" if budget_gb is not None else "half of the free memory"
    raise MemoryBudgetError(
        f"{name} needs {_fmt_bytes(need)} as uint8 tensors ({parts}) on {device}, more than the memory budget of "
        f"{_fmt_bytes(budget)} ({how}). Use data.loader=workers (streams samples through DataLoader workers), "
        "or raise data.memory_budget_gb."
    )


class TensorImageDataset(Dataset):
    """A split held as uint8 tensors: ``images [N, C, h, w]``, ``labels [N]`` (int64), plus what its
    evaluation pipeline needs (normalisation, model input size, canvas and fixed per-sample offsets).

    ``batch(idx)`` -> ``(x [B, C, S, S] float32, y [B])`` through :func:`~vitrel.data.augment.batch_pipeline`
    (with ``params``: augmented); ``self[i]`` is one sample of it, so wrappers such as
    :class:`~vitrel.data.ResizedDataset` work on it as on the worker path's data sets.
    """

    def __init__(
        self,
        images: Tensor,
        labels: Tensor,
        *,
        mean: tuple[float, ...],
        std: tuple[float, ...],
        img_size: int,
        canvas_size: int | None = None,
        offsets: Tensor | None = None,
        crop_pct: float = 1.0,
        interpolation: str = "bilinear",
    ) -> None:
        if images.dtype != torch.uint8 or images.ndim != 4:
            raise ValueError(f"images must be uint8 [N, C, H, W], got {images.dtype} {tuple(images.shape)}")
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        if offsets is not None and (canvas_size is None or offsets.shape != (len(images), 2)):
            raise ValueError("offsets need a canvas_size and one (top, left) per image")
        self.images, self.labels = images, labels.long()
        self.mean_t = torch.tensor(mean, dtype=torch.float32, device=images.device).view(-1, 1, 1)
        self.std_t = torch.tensor(std, dtype=torch.float32, device=images.device).view(-1, 1, 1)
        self.mean, self.std = tuple(mean), tuple(std)
        self.img_size, self.canvas_size, self.offsets = int(img_size), canvas_size, offsets
        self.crop_pct, self.interpolation = float(crop_pct), str(interpolation)

    def __len__(self) -> int:
        return len(self.images)

    @property
    def device(self) -> torch.device:
        return self.images.device

    @property
    def nbytes(self) -> int:
        return self.images.numel() * self.images.element_size() + self.labels.numel() * 8

    @property
    def frame_hw(self) -> tuple[int, int]:
        """Size the images are placed in before resizing: the canvas, or their own."""
        return (self.canvas_size,) * 2 if self.canvas_size else tuple(self.images.shape[-2:])

    def to(self, device: torch.device | str) -> TensorImageDataset:
        """The same split on ``device`` (self when it is there already)."""
        device = torch.device(device)
        if self.images.device == device:
            return self
        return TensorImageDataset(
            self.images.to(device),
            self.labels.to(device),
            mean=self.mean,
            std=self.std,
            img_size=self.img_size,
            canvas_size=self.canvas_size,
            offsets=None if self.offsets is None else self.offsets.to(device),
            crop_pct=self.crop_pct,
            interpolation=self.interpolation,
        )

    def batch(
        self,
        idx: Tensor,
        params: dict | None = None,
        offsets: Tensor | None = None,
        re_mode: str = "const",
        noise: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Images ``idx`` through the pipeline; ``offsets`` (canvas) default to the split's fixed ones."""
        idx = idx.to(self.device)
        if offsets is None and self.offsets is not None:
            offsets = self.offsets[idx]
        x = batch_pipeline(
            self.images[idx],
            mean=self.mean_t,
            std=self.std_t,
            img_size=self.img_size,
            frame_hw=self.frame_hw if self.canvas_size else None,
            offsets=offsets,
            params=params,
            crop_pct=self.crop_pct,
            interpolation=InterpolationMode(self.interpolation),
            re_mode=re_mode,
            noise=noise,
        )
        return x, self.labels[idx]

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        x, y = self.batch(torch.tensor([int(index)]))
        return x[0], int(y[0])


def eval_images(
    images: Tensor,
    *,
    mean: tuple[float, ...],
    std: tuple[float, ...],
    img_size: int,
    crop_pct: float = 1.0,
    interpolation: str = "bilinear",
) -> Tensor:
    """uint8 images ``[B, C, h, w]`` -> the model's float input ``[B, C, img_size, img_size]`` as the memory loader's
    evaluation batches make them (:meth:`TensorImageDataset.batch`, no canvas): normalised, then the shorter side
    resized to ``img_size / crop_pct`` by torchvision on the float tensor and the centre cropped. ``predict.py`` and the
    exports prepare a memory-loader run's images with it (PIL's resize gives other pixels)."""
    labels = torch.zeros(len(images), dtype=torch.int64, device=images.device)
    kw = dict(mean=mean, std=std, img_size=img_size, crop_pct=crop_pct, interpolation=interpolation)
    return TensorImageDataset(images, labels, **kw).batch(torch.arange(len(images)))[0]


def _seed(*parts: int) -> int:
    """A 63-bit seed mixed from integers (numpy's SeedSequence), for independent streams."""
    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(2, np.uint64)[0] >> 1)


class MemoryLoader(ResumableLoader):
    """Batches of a :class:`TensorImageDataset` by index, on the data set's device.

    Training (``sampler`` an :class:`~vitrel.data.base.EpochSampler`): the order of epoch ``e`` is the
    sampler's (seeded ``seed + e``; rank ``r`` of ``W`` takes ``order[r::W]``, padded to equal length as
    ``DistributedSampler`` does); Lightning calls ``sampler.set_epoch`` each epoch. ``augment`` draws
    every position's parameters for the epoch from ``(augment_seed, e)``; the canvas offsets (when the
    data set has a canvas) are drawn there too, uniform over ``canvas_mode``'s region (or centred). Evaluation
    (``sampler=None``): ``0..N-1``, rank ``r`` taking ``r::W`` (no padding), the split's fixed offsets.
    """

    batch_sampler = None  # what Lightning looks for beside ``sampler`` (batches are made here)

    def __init__(
        self,
        dataset: TensorImageDataset,
        batch_size: int,
        *,
        sampler=None,
        drop_last: bool = False,
        augment: BatchAugment | None = None,
        augment_seed: int = 0,
        canvas_mode: str = "random",
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        self.dataset, self.batch_size, self.sampler = dataset, int(batch_size), sampler
        self.drop_last, self.augment, self.augment_seed = bool(drop_last), augment, int(augment_seed)
        self.canvas_mode = canvas_mode
        self.num_replicas, self.rank = int(num_replicas), int(rank)
        self.batches_yielded = 0
        self._resume_at: tuple[int, int] | None = None

    @property
    def train(self) -> bool:
        return self.sampler is not None

    @property
    def epoch(self) -> int:
        return int(self.sampler.epoch) if self.sampler is not None else 0

    def _num_samples(self) -> int:
        if self.sampler is not None:
            return len(self.sampler)
        return len(range(self.rank, len(self.dataset), self.num_replicas))

    def __len__(self) -> int:
        n = self._num_samples()
        return n // self.batch_size if self.drop_last and self.train else -(-n // self.batch_size)

    def order(self) -> Tensor:
        """This rank's indices for the current epoch (a CPU int64 tensor)."""
        if self.sampler is not None:
            return torch.as_tensor(self.sampler.indices(), dtype=torch.int64)
        return torch.arange(self.rank, len(self.dataset), self.num_replicas)

    def epoch_params(self) -> dict:
        """This rank's rows of the epoch's augmentation parameters (and canvas offsets), CPU tensors."""
        ds, out = self.dataset, {}
        if not self.train:
            return out
        world, n_rank = self.num_replicas, self._num_samples()
        total = n_rank * world  # positions of the (padded) epoch order, rank r taking r::world
        g = torch.Generator().manual_seed(_seed(self.augment_seed, self.epoch, 1))
        if self.augment is not None:
            frame = ds.frame_hw
            params = self.augment.sample(total, frame, (ds.img_size,) * 2, ds.images.shape[1], g)
            out = {k: v[self.rank :: world] for k, v in params.items()}
        if ds.canvas_size:
            h, w = ds.images.shape[-2:]
            c = ds.canvas_size
            if self.canvas_mode == "center":
                offsets = torch.tensor([(c - h) // 2, (c - w) // 2]).expand(total, 2)
            elif self.canvas_mode == "random":
                offsets = torch.stack([torch.randint(0, c - h + 1, (total,), generator=g),
                                       torch.randint(0, c - w + 1, (total,), generator=g)], -1)  # fmt: skip
            else:  # uniform over a region's offsets
                region = torch.from_numpy(offset_region((h, w), c, self.canvas_mode))
                offsets = region[torch.randint(0, len(region), (total,), generator=g)]
            out["offsets"] = offsets[self.rank :: world]
        return out

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        start = 0
        if self._resume_at is not None and self._resume_at[0] == self.epoch:
            start = self._resume_at[1]
        self._resume_at = None
        self.batches_yielded = start
        device, bs = self.dataset.device, self.batch_size
        order = self.order().to(device)  # the epoch's indices and parameters go to the device once
        params = {name: v.to(device) for name, v in self.epoch_params().items()}
        offsets = params.pop("offsets", None)
        re_mode = self.augment.re_mode if self.augment is not None else "const"
        noise = None
        for k in range(start, len(self)):
            sl = slice(k * bs, (k + 1) * bs)
            if re_mode == "pixel" and "erase" in params:
                noise = torch.Generator(device).manual_seed(_seed(self.augment_seed, self.epoch, 2, self.rank, k))
            p = {name: v[sl] for name, v in params.items()}
            off = None if offsets is None else offsets[sl]
            x, y = self.dataset.batch(order[sl], p or None, off, re_mode, noise)
            self.batches_yielded = k + 1
            yield x, y

    def state_dict(self) -> dict[str, int]:
        if not self.train:
            return {}
        return {
            "epoch": self.epoch,
            "batches": int(self.batches_yielded),
            "batch_size": self.batch_size,
            "num_replicas": self.num_replicas,
        }

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        if state_dict and self.train:
            self._resume_at = (int(state_dict["epoch"]), int(state_dict["batches"]))
