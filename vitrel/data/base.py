"""Shared DataModule machinery: the contract, transforms (the setup per stage and the loaders:
:mod:`vitrel.data.loaders`; errors, the in-memory data set and the split: :mod:`vitrel.data.datasets`; the
resumable training order: :mod:`vitrel.data.sampling`; the last two re-exported here).

Every DataModule here follows one contract (the trainer and the evaluation scripts code against it):

* constructor kwargs ``root, batch_size=128, num_workers=2, img_size=None (native), augment,
  pin_memory=False, seed=0, val_fraction=None, download=True`` (plus a few optional extras);
* public attributes ``num_classes, in_chans, img_size, mean, std, class_names``;
* ``prepare_data()`` (downloads where allowed), ``setup(stage)``, ``train/val/test_dataloader()``;
* a seeded ``val_fraction`` of train as val (None: as ``conf/data``, 0.1; 0, val == test, for ImageNet, videos);
* ``make_dataset(split, img_size=None, transform=None)`` for scoring at another image size;
* ``loader``: ``"memory"`` (the data set held as uint8 tensors on the training device, batches by index,
  batched augmentation there: :mod:`vitrel.data.memory`) or ``"workers"`` (per-sample PIL pipeline in
  ``DataLoader`` worker processes: timm's transforms);
* ``train_order_seed``: None, or a seed: the training order of epoch ``e`` is then seeded by
  ``train_order_seed + e`` and the loader resumes mid-epoch exactly (the workers path: a
  :class:`ResumableDataLoader` over an :class:`EpochSampler` instead of a shuffled ``DataLoader``; the
  memory path is always seeded, by ``seed`` when this is None).

Subclasses implement ``_locate()`` (raises ``DatasetNotFoundError``) and either ``_load_arrays(split)``
(``split in {"train", "test"}``) returning ``(uint8 images [N, H, W(, C)], int labels [N])`` (data sets
that fit in memory: both loaders work; set ``memory_capable = True``) or ``_load_raw(split)`` returning a
dataset of raw ``(PIL image, int label)`` pairs (the workers loader only).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, Subset

from vitrel.data.augment import BatchAugment
from vitrel.data.datasets import (
    SPLITS,
    ArrayImageDataset,
    DatasetIntegrityError,
    DatasetNotFoundError,
    SplitMismatchError,
    check_same_split,
    seeded_split,
    split_record,
)
from vitrel.data.loaders import Loaders
from vitrel.data.memory import TensorImageDataset, to_uint8_nchw
from vitrel.data.normalisation import Normalisation
from vitrel.data.packing import PackingCollator, check_packing, naflex_transform, parse_packing
from vitrel.data.sampling import EpochSampler, ResumableDataLoader
from vitrel.data.transforms import (
    CANVAS_MODES,
    MappedDataset,
    TranslatedDataset,
    build_transform,
    fixed_canvas_offsets,
    plain_transform,
)

__all__ = [
    "DatasetNotFoundError",
    "DatasetIntegrityError",
    "SplitMismatchError",
    "ArrayImageDataset",
    "VisionDataModule",
    "seeded_split",
    "EpochSampler",
    "ResumableDataLoader",
]

LOADERS = ("memory", "workers")


class VisionDataModule(Normalisation, Loaders, L.LightningDataModule):
    """Base class. See the module docstring for the contract.

    Args:
        root: data directory (meaning per data set; None where a data set has other places to look).
        batch_size: training batch size (also eval, unless ``eval_batch_size``).
        num_workers: DataLoader workers (persistent when > 0; the workers loader only).
        img_size: side of the square image fed to the model; None = native (or ``canvas_size``).
        augment: training augmentation for the train split: timm's (``create_transform(is_training=True)``,
            ``augment_kwargs``) on the workers loader, ``batch_augment`` on the memory loader;
            False = plain resize + normalise everywhere.
        pin_memory: DataLoader ``pin_memory`` (workers loader; only when training on a CUDA device).
        seed: seed for subsetting/splitting, the per-sample canvas offsets of eval splits, and the memory
            loader's order and augmentation when no ``train_order_seed`` is set.
        val_fraction: this (seeded) fraction of train held out as val (0: val is test; None: the data set's).
        download: let ``prepare_data`` download the data where that is possible.
        eval_batch_size: batch size of val/test loaders (default ``batch_size``).
        drop_last: drop the last incomplete training batch.
        interpolation: resize interpolation (default per data set).
        mean, std: per-channel normalisation (None: the data set's own statistics; :mod:`vitrel.data.normalisation`).
        crop_pct: eval resize-then-centre-crop ratio (default per data set: 1.0 small sets, 0.875 ImageNet).
        augment_kwargs: overrides of the data set's default timm augmentation kwargs (``scale``,
            ``hflip``, ``color_jitter``, ``auto_augment``, ``re_prob``, ...): the workers loader's.
        canvas_size: paste every image into a black ``canvas_size`` canvas (translation study); train
            gets fresh offsets each time, val/test a fixed seeded offset per sample.
        canvas_mode: where the offsets come from: ``"random"`` (anywhere), ``"center"``, ``"seen"`` (the
            top-left block of offsets) or ``"unseen"`` (its complement): the study's fixed-canvas split.
        name: a label for logs/run names (the config's name; default: the data set's name).
        loader: ``"memory"`` or ``"workers"`` (see the module docstring); None = the data set's default.
        batch_augment: the memory loader's :class:`~vitrel.data.BatchAugment` (used when ``augment``);
            None = the data set's default (``default_batch_augment``).
        memory_budget_gb: the most the memory loader may hold on the device, in GiB; None = half of the
            memory free when the data is set up. Over it: :class:`~vitrel.data.memory.MemoryBudgetError`.
        packing: None / False: batches of image tensors. ``"pack"`` (or True) / ``"pad"``: batches of timm's NaFlex
            dicts (:mod:`vitrel.data.packing`): each image resized keeping its aspect ratio to at most ``max_tokens``
            patches, then several images per row of ``seq_len`` tokens (``"pack"``) or one (``"pad"``). The workers
            loader only; ``batch_size`` counts images.
        seq_len: tokens per row of a NaFlex batch (needed with ``packing``).
        patch_size: the model's patch size (needed with ``packing``).
        max_tokens: the most patches of one image (default ``seq_len``); at most ``seq_len``.
        size_scale: ``[lo, hi]``: training images at a random fraction (per image) of the largest size within
            ``max_tokens`` (mixed sizes to pack); None = that largest size.
        eval_max_ratio: evaluation resize factor cap (1.0: never enlarge, native sizes within the budget; None:
            fill the budget).
        size_choices: per-batch resolution in training (timm's ``input_size_choices`` idea): every training batch is
            resized, on its device after the transfer (either loader), to a square side drawn per batch from this
            list (seeded by ``seed`` and the global step, so every DDP rank draws the same side); validation and test
            stay at ``img_size``. None: every batch at ``img_size``.
    """

    #: set by subclasses
    dataset_name: str = ""
    native_size: int = 0
    fixed_size: bool = True  # all raw images share the native size (needed for ``canvas_size``)
    default_interpolation: str = "bilinear"
    default_crop_pct: float = 1.0
    default_augment_kwargs: dict[str, Any] = {}
    #: the data set comes as uint8 arrays (``_load_arrays``): the memory loader can hold it
    memory_capable: bool = False
    default_loader: str = "workers"
    default_val_fraction: float = 0.0  # val_fraction=None's (0: val is the test split)
    default_batch_augment: dict[str, Any] = {}
    #: None: the workers loader shuffles with a ``RandomSampler`` (the memory loader seeds its order with
    #: ``seed``). A seed: the order of epoch ``e`` is seeded by ``train_order_seed + e``, split over the
    #: attached trainer's ranks, and resumes mid-epoch exactly. Set by ``vitrel.train.callbacks.ExactResume``.
    train_order_seed: int | None = None

    def __init__(
        self,
        root: str | Path | None = None,
        batch_size: int = 128,
        num_workers: int = 2,
        img_size: int | None = None,
        augment: bool = False,
        pin_memory: bool = False,
        seed: int = 0,
        val_fraction: float | None = None,
        download: bool = True,
        eval_batch_size: int | None = None,
        drop_last: bool = False,
        interpolation: str | None = None,
        crop_pct: float | None = None,
        augment_kwargs: dict[str, Any] | None = None,
        canvas_size: int | None = None,
        canvas_mode: str = "random",
        name: str | None = None,
        loader: str | None = None,
        batch_augment: BatchAugment | None = None,
        memory_budget_gb: float | None = None,
        packing: bool | str | None = None,
        seq_len: int | None = None,
        patch_size: int | None = None,
        max_tokens: int | None = None,
        size_scale: Sequence[float] | None = None,
        eval_max_ratio: float | None = 1.0,
        size_choices: Sequence[int] | None = None,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
    ) -> None:
        super().__init__()
        for key, size in (("batch_size", batch_size), ("eval_batch_size", eval_batch_size)):
            if size is not None and size < 1:
                raise ValueError(f"{key} must be >= 1, got {size}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        val_fraction = self.default_val_fraction if val_fraction is None else val_fraction
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        if canvas_mode not in CANVAS_MODES:
            raise ValueError(f"canvas_mode must be one of {CANVAS_MODES}, got {canvas_mode!r}")
        if canvas_size is not None:
            if not self.fixed_size:
                raise ValueError(
                    f"canvas_size needs fixed-size images; {self.dataset_name} images vary in size. "
                    "Wrap make_dataset(...) output in vitrel.data.TranslatedDataset yourself instead."
                )
            if canvas_size < self.native_size:
                raise ValueError(f"canvas_size={canvas_size} is smaller than the {self.native_size}px images")
        loader = loader or self.default_loader
        if loader not in LOADERS:
            raise ValueError(f"loader must be one of {LOADERS}, got {loader!r}")
        if loader == "memory" and not self.memory_capable:
            raise ValueError(
                f"data.loader=memory holds a data set as uint8 tensors of one image size; {self.dataset_name} is "
                "streamed from image files of varying sizes: use data.loader=workers"
            )
        if loader == "memory" and augment and augment_kwargs:
            raise ValueError(
                f"data.augment_kwargs ({dict(augment_kwargs)}) are options of timm's per-sample transforms, used by "
                "data.loader=workers. The memory loader augments whole batches as data.batch_augment says "
                "(translate, hflip, scale, ratio, re_prob, re_mode, re_count); for timm's pipeline (auto_augment, "
                "color_jitter, ...) use data.loader=workers."
            )
        if batch_augment is not None and not isinstance(batch_augment, BatchAugment):
            raise TypeError(f"batch_augment must be a vitrel.data.BatchAugment, got {type(batch_augment).__name__}")
        if memory_budget_gb is not None and memory_budget_gb <= 0:
            raise ValueError(f"memory_budget_gb must be > 0 (or None: half the free memory), got {memory_budget_gb}")
        self.name = name or self.dataset_name
        self.root = None if root is None else Path(root).expanduser()
        self.batch_size = int(batch_size)
        self.eval_batch_size = int(eval_batch_size or batch_size)
        self.num_workers = int(num_workers)
        self.augment = bool(augment)
        self.pin_memory = bool(pin_memory)
        self.seed = int(seed)
        self.val_fraction = float(val_fraction)
        self.download = bool(download)
        self.drop_last = bool(drop_last)
        self.interpolation = interpolation or self.default_interpolation
        self.normalise_with(mean, std)
        self.crop_pct = float(crop_pct if crop_pct is not None else self.default_crop_pct)
        self.augment_kwargs = {**self.default_augment_kwargs, **dict(augment_kwargs or {})}
        self.canvas_size = None if canvas_size is None else int(canvas_size)
        self.canvas_mode = canvas_mode
        self.loader = loader
        self.batch_augment = batch_augment if batch_augment is not None else BatchAugment(**self.default_batch_augment)
        self.memory_budget_gb = memory_budget_gb
        self.packing = parse_packing(packing)
        self.seq_len = None if seq_len is None else int(seq_len)
        self.patch_size = None if patch_size is None else int(patch_size)
        self.max_tokens = None if max_tokens is None else int(max_tokens)
        self.size_scale = None if size_scale is None else tuple(float(v) for v in size_scale)
        self.eval_max_ratio = None if eval_max_ratio is None else float(eval_max_ratio)
        if self.packing is not None:
            self.max_tokens = check_packing(
                self.packing, self.seq_len, self.patch_size, self.max_tokens, self.size_scale, self.eval_max_ratio,
                self.loader, self.canvas_size,
            )  # fmt: skip
        self.size_choices = None if size_choices is None else tuple(int(v) for v in size_choices)
        if self.size_choices is not None:
            if not self.size_choices or min(self.size_choices) < 1:
                raise ValueError(f"data.size_choices must be a non-empty list of positive sides, got {size_choices}")
            if self.packing is not None:
                raise ValueError(
                    "data.size_choices resizes batches of image tensors; with data.packing every image already has its "
                    "own size (data.size_scale draws it): use one of them"
                )
        self.img_size = int(img_size if img_size is not None else (self.canvas_size or self.native_size))
        if self.img_size < 1:
            raise ValueError(f"img_size must be >= 1, got {self.img_size}")
        self._arrays: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._raw: dict[str, Dataset] = {}
        self._split_idx: tuple[np.ndarray, np.ndarray] | None = None
        self._datasets: dict[str, Dataset] = {}
        # set by subclasses: num_classes, in_chans, mean, std, class_names

    def naflex_transform(self, train: bool) -> Callable:
        """The per-sample pipeline of ``packing``: a PIL image -> timm's NaFlex per-image dict."""
        kw = self.augment_kwargs
        return naflex_transform(
            train=train,
            patch_size=int(self.patch_size),  # type: ignore[arg-type]
            max_tokens=int(self.max_tokens),  # type: ignore[arg-type]
            mean=self.mean,
            std=self.std,
            interpolation=self.interpolation,
            augment=self.augment and train,
            scale=tuple(kw.get("scale") or (0.08, 1.0)),
            ratio=tuple(kw.get("ratio") or (3 / 4, 4 / 3)),
            hflip=float(kw.get("hflip", 0.5)),
            size_scale=self.size_scale,
            eval_max_ratio=self.eval_max_ratio,
            **{k: v for k, v in kw.items() if k not in ("scale", "ratio", "hflip")},  # timm's others (re_prob, ...)
        )

    @property
    def collate_fn(self) -> PackingCollator | None:
        """The NaFlex batches' collator (``packing``), else None (torch's default)."""
        if self.packing is None:
            return None
        return PackingCollator(int(self.seq_len), self.packing)  # type: ignore[arg-type]

    # ---- subclass hooks -------------------------------------------------------------------------

    def _load_arrays(self, split: str) -> tuple[np.ndarray, np.ndarray]:  # split in ("train", "test")
        """``(uint8 images [N, H, W(, C)], int labels [N])`` of ``split`` (data sets held in memory)."""
        raise NotImplementedError

    def _load_raw(self, split: str) -> Dataset:  # split in ("train", "test")
        """Raw ``(PIL image, int label)`` pairs; by default ``ArrayImageDataset`` over ``_load_arrays``."""
        images, labels = self._raw_arrays(split)
        return ArrayImageDataset(images, labels, mode="RGB" if self.in_chans == 3 and images.ndim == 3 else None)

    def _locate(self) -> Any:
        """Find the data on disk or raise ``DatasetNotFoundError`` (listing every path tried)."""
        raise NotImplementedError

    # ---- data --------------------------------------------------------------------------------

    @property
    def input_size(self) -> tuple[int, int, int]:
        """``(in_chans, img_size, img_size)``."""
        return (self.in_chans, self.img_size, self.img_size)

    @property
    def train_flip(self) -> tuple[str, float]:
        """The key and probability of the training samples' left-right flip: the memory loader's
        ``data.batch_augment.hflip``, else ``data.augment_kwargs.hflip`` (timm's default 0.5); 0 without augment."""
        if self.loader == "memory":
            return "data.batch_augment.hflip", float(self.batch_augment.hflip) if self.augment else 0.0
        return "data.augment_kwargs.hflip", float(self.augment_kwargs.get("hflip", 0.5)) if self.augment else 0.0

    @property
    def device(self) -> torch.device:
        """The attached trainer's device (where the memory loader holds the data), else the CPU."""
        return self.trainer.strategy.root_device if self.trainer is not None else torch.device("cpu")

    def raw_dataset(self, split: str) -> Dataset:
        """Untransformed ``(PIL image, label)`` pairs of ``split`` (``val`` honours ``val_fraction``)."""
        ds, idx = self._source(split)
        return ds if idx is None else Subset(ds, idx.tolist())

    def _raw_arrays(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        if split not in self._arrays:
            images, labels = self._load_arrays(split)
            self._arrays[split] = (np.asarray(images), np.asarray(labels, dtype=np.int64))
        return self._arrays[split]

    def _raw_split(self, split: str) -> Dataset:
        if split not in self._raw:
            self._raw[split] = self._load_raw(split)
        return self._raw[split]

    def _split_of(self, split: str) -> tuple[str, np.ndarray | None]:
        """``(stored split, indices into it or None)`` of ``split`` (``val``: test, or the held-out part)."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if self.val_fraction <= 0.0:
            return ("test" if split == "val" else split), None
        if split == "test":
            return "test", None
        if self._split_idx is None:
            n = len(self._raw_arrays("train")[1]) if self.memory_capable else len(self._raw_split("train"))
            self._split_idx = seeded_split(n, self.val_fraction, self.seed)
        return "train", self._split_idx[0 if split == "train" else 1]

    def _source(self, split: str) -> tuple[Dataset, np.ndarray | None]:
        stored, idx = self._split_of(split)
        return self._raw_split(stored), idx

    # ---- the split a run holds out, kept in its checkpoints -------------------------------------

    def split_record(self) -> dict[str, Any]:
        """:func:`~vitrel.data.datasets.split_record` of this module's split (set up when it is not yet; without a
        held-out split ``_split_of`` gives no indices and reads nothing)."""
        (_, val), (_, train) = self._split_of("val"), self._split_of("train")
        return split_record(self.val_fraction, self.seed, train, val)

    def state_dict(self) -> dict[str, Any]:
        """Lightning keeps this in each checkpoint (under the class's name): the run's :meth:`split_record`."""
        return {"split": self.split_record()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A resumed fit checks that it holds out the split it was trained with (:meth:`check_split`)."""
        self.check_split(state_dict)

    def check_split(self, state: dict[str, Any] | None, where: str | Path | None = None) -> None:
        """Refuse a resume whose validation split differs from the one a checkpoint (``where``) kept in ``state``
        (:meth:`state_dict`): its val split would hold images the run trained on (a
        :class:`~vitrel.data.datasets.SplitMismatchError`). Not checked: a checkpoint without a split record (written
        before vitrel kept one), or no held-out split either time."""
        theirs = (state or {}).get("split")
        if theirs is not None and max(theirs.get("val_fraction", 0.0), self.val_fraction) > 0.0:
            check_same_split(theirs, self.split_record(), where)

    def train_transform(self, img_size: int | None = None) -> Callable:
        """Training pipeline (timm augmentation when ``augment``), including the canvas if configured; with
        ``packing`` (and no ``img_size``), timm's NaFlex training pipeline (:meth:`naflex_transform`)."""
        if self.packing is not None and img_size is None:
            return self.naflex_transform(train=True)
        return build_transform(
            train=True,
            augment=self.augment,
            img_size=img_size or self.img_size,
            mean=self.mean,
            std=self.std,
            interpolation=self.interpolation,
            crop_pct=self.crop_pct,
            augment_kwargs=self.augment_kwargs,
            canvas_size=self.canvas_size,
            canvas_mode=self.canvas_mode,
        )

    def eval_transform(self, img_size: int | None = None) -> Callable:
        """Plain resize/centre-crop + normalise at ``img_size`` (no canvas: see ``make_dataset``); with ``packing``
        (and no ``img_size``), each image at its own aspect ratio as a NaFlex dict (:meth:`naflex_transform`)."""
        if self.packing is not None and img_size is None:
            return self.naflex_transform(train=False)
        return plain_transform(img_size or self.img_size, self.mean, self.std, self.interpolation, self.crop_pct)

    def make_dataset(
        self,
        split: str,
        img_size: int | None = None,
        transform: Callable | None = None,
        canvas_size: int | None = None,
        canvas_seed: int | None = None,
    ) -> Dataset:
        """A torch Dataset of ``(tensor, label)`` for ``split`` with the *evaluation* pipeline, per sample.

        ``img_size``: model input size (default: ``canvas_size`` if given, else this module's ``img_size``).
        ``transform``: replaces the default pipeline; it receives the raw PIL image (after the canvas).
        ``canvas_size`` (default: this module's): paste each raw image into a black canvas at a fixed
        offset per sample, seeded by ``canvas_seed`` (default ``seed``); see ``TranslatedDataset``.
        """
        canvas = canvas_size if canvas_size is not None else self.canvas_size
        if canvas is not None and not self.fixed_size:
            raise ValueError(f"canvas_size needs fixed-size images; {self.dataset_name} images vary in size")
        size = img_size or (canvas_size if canvas_size is not None else self.img_size)
        if transform is None and self.packing is not None and img_size is None:
            tf = self.eval_transform()
        else:
            tf = transform if transform is not None else self.eval_transform(size)
        ds, idx = self._source(split)
        if idx is not None:
            ds = Subset(ds, idx.tolist())
        if canvas is None:
            return MappedDataset(ds, tf)
        seed = self.seed if canvas_seed is None else canvas_seed
        return TranslatedDataset(ds, canvas, seed=seed, transform=tf, mode=self.canvas_mode)

    def make_tensor_dataset(self, split: str) -> TensorImageDataset:
        """``split`` as uint8 tensors on the CPU with its evaluation pipeline (the memory loader's data set);
        eval splits with a canvas get the offsets ``make_dataset`` gives them."""
        stored, idx = self._split_of(split)
        images, labels = self._raw_arrays(stored)
        if idx is not None:
            images, labels = images[idx], labels[idx]
        x = to_uint8_nchw(images, self.in_chans)
        offsets = None
        if self.canvas_size is not None and split != "train":
            offsets = torch.from_numpy(
                fixed_canvas_offsets(len(x), tuple(x.shape[-2:]), self.canvas_size, self.seed, self.canvas_mode)
            )
        return TensorImageDataset(
            x,
            torch.from_numpy(labels),
            mean=tuple(self.mean),
            std=tuple(self.std),
            img_size=self.img_size,
            canvas_size=self.canvas_size,
            offsets=offsets,
            crop_pct=self.crop_pct,
            interpolation=self.interpolation,
        )

    # ---- Lightning hooks ----------------------------------------------------------------------

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Per-batch resolution (``size_choices``): a training batch resized on its device to the side drawn for
        this step; every other batch as it came, and a bare tensor (the model summary's ``example_input_array``, one
        sample at ``img_size``) too."""
        trainer = self.trainer
        if self.size_choices is None or trainer is None or not trainer.training or isinstance(batch, torch.Tensor):
            return batch
        side = self.batch_side(trainer.global_step)
        x, *rest = batch
        if x.shape[-1] != side or x.shape[-2] != side:
            x = F.interpolate(x, size=(side, side), mode="bilinear", align_corners=False, antialias=side < x.shape[-1])
        return (x, *rest)

    def batch_side(self, step: int) -> int:
        """The side of training step ``step``'s batch (``size_choices``), the same on every rank."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        return self.size_choices[int(torch.randint(len(self.size_choices), (), generator=g))]

    def prepare_data(self) -> None:
        """Download if the data is missing and ``download=True`` (subclasses that can download)."""

    def __repr__(self) -> str:
        packing = (
            f", packing={self.packing}, seq_len={self.seq_len}, max_tokens={self.max_tokens}" if self.packing else ""
        )
        return (
            f"{type(self).__name__}(root={self.root}, num_classes={self.num_classes}, in_chans={self.in_chans}, "
            f"img_size={self.img_size}, augment={self.augment}, batch_size={self.batch_size}, "
            f"val_fraction={self.val_fraction}, canvas_size={self.canvas_size}, loader={self.loader}{packing})"
        )

    #: Lightning's ``__str__`` lists its loaders' sizes and fails on a memory loader (not a DataLoader)
    __str__ = __repr__
