"""How a data module sets up its splits per stage and serves them: :class:`Loaders`, a mixin of
:class:`~vitrel.data.VisionDataModule`. ``loader="memory"``: the splits' uint8 tensors held on the trainer's device
within the memory budget, batched by :class:`~vitrel.data.memory.MemoryLoader`; ``loader="workers"``: per-sample
pipelines in ``DataLoader`` worker processes (an :class:`~vitrel.data.sampling.EpochSampler` when the training order
is seeded, each evaluation image once over the ranks)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Subset

from vitrel.data.datasets import SPLITS, SplitTooSmallError
from vitrel.data.memory import MemoryLoader, TensorImageDataset, check_budget
from vitrel.data.sampling import EpochSampler, EvalSampler, ResumableDataLoader
from vitrel.data.transforms import MappedDataset

__all__ = ["Loaders"]


class Loaders:
    """Mixin of :class:`~vitrel.data.VisionDataModule`: Lightning's ``setup`` and ``train/val/test_dataloader``, and
    :meth:`dataset`, the data set behind each loader. Reads the module's settings (``loader``, batch sizes, seeds,
    ``memory_budget_gb``, ...) and builds the splits with its ``make_dataset`` / ``make_tensor_dataset``."""

    def _missing_splits(self, stage: str | None) -> list[str]:
        """The splits ``stage`` needs that are not set up yet."""
        wanted = {
            "fit": ("train", "val"),
            "validate": ("val",),
            "test": ("test",),
            "predict": ("test",),
            None: SPLITS,
        }
        if stage not in wanted:
            raise ValueError(f"unknown stage {stage!r}")
        return [split for split in wanted[stage] if split not in self._datasets]

    def setup(self, stage: str | None = None) -> None:
        missing = self._missing_splits(stage)
        if self.loader == "memory":
            self._setup_memory(missing)
            return
        for split in missing:
            if split == "train":
                ds, idx = self._source("train")
                if idx is not None:
                    ds = Subset(ds, idx.tolist())
                self._datasets["train"] = MappedDataset(ds, self.train_transform())
            else:
                self._datasets[split] = self.make_dataset(split)

    def _setup_memory(self, splits: list[str]) -> None:
        """Build the splits' tensors once (val shares the test split's when it is the test split), then
        hold them all on the device."""
        for split in splits:
            twin = {"val": "test", "test": "val"}.get(split)
            if self.val_fraction <= 0.0 and twin in self._datasets:
                self._datasets[split] = self._datasets[twin]
            else:
                self._datasets[split] = self.make_tensor_dataset(split)
        self._hold_on(self.device, check=bool(splits))

    def _hold_on(self, device: torch.device, check: bool = False) -> None:
        """Move every held split to ``device``, checking first (or when ``check``) that they fit its budget."""
        groups: dict[int, list[str]] = {}
        for split, d in self._datasets.items():
            if isinstance(d, TensorImageDataset):
                groups.setdefault(id(d), []).append(split)
        if not check and all(self._datasets[names[0]].device == device for names in groups.values()):
            return
        sizes = {"/".join(names): self._datasets[names[0]].nbytes for names in groups.values()}
        check_budget(self.name, sizes, device, self.memory_budget_gb)
        for names in groups.values():
            moved = self._datasets[names[0]].to(device)  # type: ignore[union-attr]
            for split in names:
                self._datasets[split] = moved

    def dataset(self, split: str) -> Dataset:
        """The dataset behind ``<split>_dataloader()`` (sets up on first use): per-sample ``(tensor, label)``
        (workers), or the split's :class:`TensorImageDataset` on the device (memory; unaugmented)."""
        if split not in self._datasets:
            self.setup({"train": "fit", "val": "validate", "test": "test"}[split])
        if self.loader == "memory":
            self._hold_on(self.device)  # set up before a trainer (and its device) was attached
        return self._datasets[split]

    @property
    def train_batch_size(self) -> int:
        """The samples a training batch is collated from (``batch_size``; fewer where a sample is several views)."""
        return self.batch_size

    @property
    def train_collate_fn(self) -> Any:
        """The training batches' collate (``collate_fn``)."""
        return self.collate_fn

    def _ranks(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)

    def _loader(self, split: str) -> DataLoader | MemoryLoader:
        train = split == "train"
        ds = self.dataset(split)
        world, rank = self._ranks()
        if not train and len(ds) < world:  # (each sample once: a rank without one would stop the run in Lightning)
            raise SplitTooSmallError(
                f"the {split} split has {len(ds)} samples for {world} ranks, which evaluate each sample once: a rank "
                "would have none. Evaluate on fewer devices (trainer.devices)"
                + (", or hold out more of train (data.val_fraction)" if split == "val" and self.val_fraction else "")
            )
        if isinstance(ds, TensorImageDataset):
            if not train:
                return MemoryLoader(ds, self.eval_batch_size, num_replicas=world, rank=rank)
            seed = int(self.train_order_seed if self.train_order_seed is not None else self.seed)
            return MemoryLoader(
                ds,
                self.batch_size,
                sampler=EpochSampler(ds, shuffle=True, seed=seed, num_replicas=world, rank=rank),
                drop_last=self.drop_last,
                augment=self.batch_augment if self.augment else None,
                augment_seed=seed,
                canvas_mode=self.canvas_mode,
                num_replicas=world,
                rank=rank,
            )
        kwargs: dict[str, Any] = dict(
            collate_fn=self.train_collate_fn if train else self.collate_fn,
            batch_size=self.train_batch_size if train else self.eval_batch_size,
            drop_last=self.drop_last and train,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory and self.device.type == "cuda",
            persistent_workers=self.num_workers > 0,
        )
        if train and self.train_order_seed is not None:
            sampler = EpochSampler(ds, shuffle=True, seed=int(self.train_order_seed), num_replicas=world, rank=rank)
            return ResumableDataLoader(ds, sampler=sampler, **kwargs)
        if not train:  # workers' base seed from a generator of its own, not torch's global one (a resumed run makes
            # its first evaluation iterator where the run it resumes did not: the draw shifted dropout, mixup...)
            kwargs["generator"] = torch.Generator().manual_seed(int(self.seed))
            # each image once over the ranks (Lightning's own DistributedSampler repeats some to even them out)
            kwargs["sampler"] = EvalSampler(ds, num_replicas=world, rank=rank) if world > 1 else None
        return DataLoader(ds, shuffle=train, **kwargs)

    def train_dataloader(self) -> DataLoader | MemoryLoader:
        return self._loader("train")

    def val_dataloader(self) -> DataLoader | MemoryLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader | MemoryLoader:
        return self._loader("test")
