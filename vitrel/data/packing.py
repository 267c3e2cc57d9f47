"""Variable-size images as timm's NaFlex batches: aspect-preserving resizes to a token budget, and packing.

Per image, timm's NaFlex transforms (:func:`naflex_transform`): training takes a random crop of random area and
aspect ratio, resized to the most tokens the budget allows (``RandomResizedCropToSequence``; ``size_scale`` scales
that size down at random, per image, so the batch holds images of many sizes), evaluation resizes the whole image
keeping its aspect ratio (``ResizeToSequence``; ``max_ratio=1.0``: never up, so images that fit the budget keep
their native size); then ``Patchify`` makes the per-image dict ``{"patches" [n, P*P*C], "patch_coord" [n, 2],
"patch_valid" [n]}``.

Per batch, :class:`PackingCollator` makes the batch dict the models take (``vitrel.models.naflex``)::

    {"patches": [R, seq_len, P*P*C], "patch_coord": [R, seq_len, 2] (y, x), "patch_valid": [R, seq_len] bool,
     "segment_ids": [R, seq_len] long (pack mode: the 0-based index of a token's image within its row),
     "seq_len": seq_len, "padding_fraction": 0-d float tensor, "image_index": [num_images] long}

and the targets ``[num_images]`` in the order the model returns its logits: row-major over rows, then segments.
``image_index[k]`` is the position, in the list the collator got, of the ``k``-th image (to put predictions back
in input order). ``mode="pack"`` places the images greedily, first fit, into rows of at most ``seq_len`` tokens
(each image's tokens contiguous, padding at the end of each row); ``mode="pad"``: one image per row (timm's
``NaFlexCollator``, after the length check). An image with more than ``seq_len`` tokens is an error naming both
numbers (timm's collator would cut it silently). ``padding_fraction`` is the share of the ``R * seq_len`` slots
that are padding.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "NAFLEX_AUGMENT_KEYS",
    "PACKING_MODES",
    "PackingError",
    "PackingCollator",
    "check_packing",
    "first_fit",
    "naflex_transform",
    "parse_packing",
]

#: ``data.packing``: None / False = the ordinary image tensors; "pad": NaFlex dicts, one image per row; "pack"
#: (or True): NaFlex dicts, several images per row
PACKING_MODES = ("pad", "pack")

#: ``data.augment_kwargs`` the NaFlex training transforms take besides ``scale``, ``ratio`` and ``hflip``: the options
#: of timm's ``transforms_imagenet_train`` after its crop
NAFLEX_AUGMENT_KEYS = (
    "vflip",
    "color_jitter",
    "color_jitter_prob",
    "force_color_jitter",
    "grayscale_prob",
    "gaussian_blur_prob",
    "auto_augment",
    "re_prob",
    "re_mode",
    "re_count",
)


class PackingError(ValueError):
    """A sample the collator cannot place (longer than a row, empty, or not a NaFlex per-image dict)."""


def parse_packing(packing: bool | str | None) -> str | None:
    """``data.packing`` -> None (off), ``"pad"`` or ``"pack"``."""
    if packing is None or packing is False or packing in ("none", "off", "false"):
        return None
    if packing is True or packing in ("true", "on"):
        return "pack"
    if packing not in PACKING_MODES:
        raise ValueError(f"data.packing must be false, true, 'pad' or 'pack', got {packing!r}")
    return str(packing)


def first_fit(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """Greedy first fit: each item, in order, goes to the first row with room for it (else a new row).
    Returns the rows as lists of item indices (each in arrival order). Raises :class:`PackingError` for an
    item longer than ``seq_len`` or without tokens."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    rows: list[list[int]] = []
    room: list[int] = []
    for i, n in enumerate(lengths):
        n = int(n)
        if n > seq_len:
            raise PackingError(
                f"image {i} has {n} patch tokens, more than data.seq_len={seq_len} (a row holds at most seq_len "
                f"tokens): raise data.seq_len to at least {n}, or lower the per-image budget data.max_tokens"
            )
        if n < 1:
            raise PackingError(f"image {i} has no valid patch tokens")
        for r, free in enumerate(room):
            if n <= free:
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(seq_len - n)
    return rows


def _tokens(item: Any, i: int) -> tuple[Tensor, Tensor]:
    """``(patches [n, D], coords [n, 2])`` of one per-image dict, its valid tokens only."""
    if not isinstance(item, Mapping) or "patches" not in item or "patch_coord" not in item:
        raise PackingError(
            f"sample {i}: expected a NaFlex per-image dict with 'patches' [n, P*P*C] and 'patch_coord' [n, 2] "
            f"(timm.data.naflex_transforms.Patchify's output), got {type(item).__name__}"
        )
    patches, coord = item["patches"], item["patch_coord"]
    if patches.dim() != 2 or coord.shape != (patches.shape[0], 2):
        raise PackingError(
            f"sample {i}: 'patches' must be [n, P*P*C] and 'patch_coord' [n, 2] (flattened patches), got "
            f"{tuple(patches.shape)} and {tuple(coord.shape)}"
        )
    valid = item.get("patch_valid")
    if valid is not None and not bool(valid.all()):
        keep = valid.bool()
        patches, coord = patches[keep], coord[keep]
    return patches, coord


class PackingCollator:
    """``collate_fn``: a list of ``(NaFlex per-image dict, label)`` -> ``(batch dict, targets)`` (module docstring).

    Args:
        seq_len: tokens per row.
        mode: ``"pack"`` (greedy first fit, ``segment_ids``) or ``"pad"`` (one image per row).
        decreasing: pack the longest images first (first fit decreasing: fewer rows; the image order then follows
            the lengths).
    """

    def __init__(self, seq_len: int, mode: str = "pack", decreasing: bool = False) -> None:
        if int(seq_len) < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if mode not in PACKING_MODES:
            raise ValueError(f"mode must be one of {PACKING_MODES}, got {mode!r}")
        self.seq_len, self.mode, self.decreasing = int(seq_len), mode, bool(decreasing)

    def rows(self, lengths: Sequence[int]) -> list[list[int]]:
        """Which images go to which row (indices into ``lengths``), in the batch's image order."""
        if self.mode == "pad":
            first_fit(lengths, self.seq_len)  # the length checks
            return [[i] for i in range(len(lengths))]
        if not self.decreasing:
            return first_fit(lengths, self.seq_len)
        order = sorted(range(len(lengths)), key=lambda i: -int(lengths[i]))
        return [[order[j] for j in row] for row in first_fit([lengths[i] for i in order], self.seq_len)]

    def __call__(self, batch: Sequence[tuple[Mapping[str, Tensor], Any]]) -> tuple[dict[str, Any], Tensor]:
        if len(batch) == 0:
            raise PackingError("an empty batch")
        for i, sample in enumerate(batch):
            if isinstance(sample, Mapping) or not isinstance(sample, Sequence) or len(sample) != 2:
                got = f"a dict with keys {sorted(sample)}" if isinstance(sample, Mapping) else type(sample).__name__
                raise PackingError(
                    f"sample {i}: the packing collator takes (NaFlex per-image dict, label) pairs, got {got}: a "
                    "dataset for it returns (Patchify(...)(image), target)"
                )
        items = [_tokens(sample[0], i) for i, sample in enumerate(batch)]
        dims = {p.shape[1] for p, _ in items}
        if len(dims) != 1:
            raise PackingError(f"the images' patches differ in size ({sorted(dims)} values): one patch size per batch")
        lengths = [p.shape[0] for p, _ in items]
        rows = self.rows(lengths)
        n_rows, s, d = len(rows), self.seq_len, dims.pop()
        dtype = items[0][0].dtype if items[0][0].is_floating_point() else torch.float32
        patches = torch.zeros(n_rows, s, d, dtype=dtype)
        coord = torch.zeros(n_rows, s, 2, dtype=torch.long)
        valid = torch.zeros(n_rows, s, dtype=torch.bool)
        segment = torch.zeros(n_rows, s, dtype=torch.long)
        for r, row in enumerate(rows):
            at = 0
            for k, i in enumerate(row):
                p, c = items[i]
                n = p.shape[0]
                patches[r, at : at + n] = p
                coord[r, at : at + n] = c
                valid[r, at : at + n] = True
                segment[r, at : at + n] = k
                at += n
        order = [i for row in rows for i in row]
        labels = [batch[i][1] for i in order]
        targets = torch.stack(labels) if isinstance(labels[0], Tensor) else torch.tensor(labels, dtype=torch.int64)
        out: dict[str, Any] = {"patches": patches, "patch_coord": coord, "patch_valid": valid}
        if self.mode == "pack":
            out["segment_ids"] = segment
        out["seq_len"] = s
        out["padding_fraction"] = torch.tensor(1.0 - sum(lengths) / (n_rows * s), dtype=torch.float32)
        out["image_index"] = torch.tensor(order, dtype=torch.long)
        return out, targets

    def __repr__(self) -> str:
        return f"{type(self).__name__}(seq_len={self.seq_len}, mode={self.mode!r}, decreasing={self.decreasing})"


def check_packing(
    packing: str,
    seq_len: int | None,
    patch_size: int | None,
    max_tokens: int | None,
    size_scale: Sequence[float] | None,
    eval_max_ratio: float | None,
    loader: str,
    canvas_size: int | None,
) -> int:
    """Refuse data settings NaFlex batches (``data.packing``) cannot take, each error naming the key; return
    ``max_tokens`` (None: ``seq_len``)."""
    if seq_len is None or patch_size is None:
        raise ValueError(
            f"data.packing={packing} needs data.seq_len (tokens per row) and data.patch_size (the model's), "
            f"got seq_len={seq_len}, patch_size={patch_size}"
        )
    if seq_len < 1 or patch_size < 1:
        raise ValueError(f"data.seq_len and data.patch_size must be >= 1, got {seq_len}, {patch_size}")
    if max_tokens is None:
        max_tokens = seq_len
    if not 1 <= max_tokens <= seq_len:
        raise ValueError(
            f"data.max_tokens={max_tokens} (patches of one image) must be in [1, "
            f"data.seq_len={seq_len}]: a row holds at most seq_len tokens"
        )
    if size_scale is not None and not (len(size_scale) == 2 and 0 < size_scale[0] <= size_scale[1] <= 1):
        raise ValueError(f"data.size_scale must be [lo, hi] with 0 < lo <= hi <= 1, got {list(size_scale)}")
    if eval_max_ratio is not None and eval_max_ratio <= 0:
        raise ValueError(f"data.eval_max_ratio must be > 0 (or null), got {eval_max_ratio}")
    if loader == "memory":
        raise ValueError(
            f"data.packing={packing} makes NaFlex batches (images of their own sizes) per sample: use "
            "data.loader=workers (the memory loader holds one image size)"
        )
    if canvas_size is not None:
        raise ValueError("data.packing and data.canvas_size (the translation canvas) do not combine")
    return max_tokens


def naflex_transform(
    *,
    train: bool,
    patch_size: int,
    max_tokens: int,
    mean: Sequence[float],
    std: Sequence[float],
    interpolation: str = "bilinear",
    augment: bool = False,
    scale: Sequence[float] = (0.08, 1.0),
    ratio: Sequence[float] = (3 / 4, 4 / 3),
    hflip: float = 0.5,
    size_scale: Sequence[float] | None = None,
    eval_max_ratio: float | None = 1.0,
    **augment_kwargs: Any,
) -> Callable[[Any], dict[str, Tensor]]:
    """A PIL image -> timm's NaFlex per-image dict (module docstring), with timm's NaFlex transforms.

    Training: ``RandomResizedCropToSequence`` (with ``augment``: crops of area ``scale`` and aspect ratio ``ratio``
    of the image's, and a flip with probability ``hflip``; without: the whole image), its size times a factor drawn
    from ``size_scale`` (None: the largest that fits ``max_tokens``). Evaluation: ``ResizeToSequence`` (the whole
    image, aspect ratio kept, at most ``max_tokens``, scaled by at most ``eval_max_ratio``: 1.0 never enlarges, so
    an image within the budget keeps its native size, rounded up to whole patches; None fills the budget).

    ``augment_kwargs``: timm's other training augmentations (:data:`NAFLEX_AUGMENT_KEYS`: ``color_jitter``,
    ``auto_augment``, ``re_prob``, ...), applied with ``augment`` as ``timm.data.create_transform(naflex=True)``
    applies them (after the crop and resize, at the image's final size; ``color_jitter`` 0 or None: none). Any other
    key is a ``ValueError`` naming it.
    """
    from timm.data.naflex_transforms import Patchify, RandomResizedCropToSequence, ResizeToSequence
    from torchvision import transforms as T

    if patch_size < 1 or max_tokens < 1:
        raise ValueError(f"patch_size and max_tokens must be >= 1, got {patch_size}, {max_tokens}")
    unknown = sorted(set(augment_kwargs) - set(NAFLEX_AUGMENT_KEYS))
    if unknown:
        raise ValueError(
            f"data.augment_kwargs {unknown} are not options of the NaFlex (data.packing) training transforms: they "
            f"take scale, ratio, hflip and {', '.join(NAFLEX_AUGMENT_KEYS)}"
        )
    steps: list[Any] = []
    if train:
        crop = (tuple(scale), tuple(ratio)) if augment else ((1.0, 1.0), (1.0, 1.0))
        resize = RandomResizedCropToSequence(
            patch_size=patch_size,
            max_seq_len=max_tokens,
            scale=crop[0],
            ratio=crop[1],
            interpolation=interpolation,
            final_scale_range=None if size_scale is None else tuple(size_scale),
        )
        if augment:  # timm's NaFlex training pipeline, its crop replaced by the one with size_scale
            return _timm_naflex_train(resize, patch_size, max_tokens, mean, std, interpolation, hflip, augment_kwargs)
        steps.append(resize)
    else:
        steps.append(
            ResizeToSequence(patch_size, max_seq_len=max_tokens, max_ratio=eval_max_ratio, interpolation=interpolation)
        )
    steps += [T.ToTensor(), T.Normalize(mean=list(mean), std=list(std)), Patchify(patch_size)]
    return T.Compose(steps)


def _timm_naflex_train(
    resize: Any,
    patch_size: int,
    max_tokens: int,
    mean: Sequence[float],
    std: Sequence[float],
    interpolation: str,
    hflip: float,
    augment_kwargs: Mapping[str, Any],
) -> Callable[[Any], dict[str, Tensor]]:
    """timm's ``transforms_imagenet_train(naflex=True, patchify=True)`` with ``resize`` as its crop."""
    import math

    from timm.data.naflex_transforms import RandomResizedCropToSequence
    from timm.data.transforms_factory import transforms_imagenet_train
    from torchvision import transforms as T

    kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in augment_kwargs.items()}
    if not kw.get("color_jitter"):  # timm's default is 0.4; 0 adds a do-nothing ColorJitter
        kw["color_jitter"] = None
    primary, secondary, final = transforms_imagenet_train(
        img_size=patch_size * math.isqrt(max_tokens),  # (auto_augment's translation: a square within the budget)
        hflip=hflip,
        interpolation=interpolation,
        mean=tuple(mean),
        std=tuple(std),
        naflex=True,
        patch_size=patch_size,
        max_seq_len=max_tokens,
        patchify=True,
        separate=True,
        **kw,
    )
    if not isinstance(primary.transforms[0], RandomResizedCropToSequence):
        raise RuntimeError(f"timm's NaFlex training transforms start with {primary.transforms[0]!r}, not the crop")
    from vitrel.data.timm_compat import black_posterize

    return black_posterize(T.Compose([resize, *primary.transforms[1:], *secondary.transforms, *final.transforms]))
