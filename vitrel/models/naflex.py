"""timm's NaFlex batch dict as vitrel's models take it: patches with coordinates, padding, and packed images.

A batch is the dict ``timm.models.naflexvit`` takes (timm's NaFlex data pipeline -- ``Patchify``,
``NaFlexMapDatasetWrapper``, ``NaFlexCollator`` -- feeds vitrel unchanged)::

    {"patches": [B, N, P*P*C]      flattened patches, each (P, P, C) (timm's default, channels last),
     "patch_coord": [B, N, 2]      (y, x): the patch's row and column in its image,
     "patch_valid": [B, N]         False for padding,
     "segment_ids": [B, N]         optional (packing): the 0-based index, within its row, of the image each token
                                   belongs to; ignored on padding}

Without ``segment_ids`` every row holds one image. T5X / seqio number packed segments from 1 with 0 for padding;
vitrel takes only the 0-based form (padding marked by ``patch_valid``). An ``attn_mask`` (which timm's NaFlexVit
lets override its masks) is refused; other keys (timm's collator adds ``seq_len``) are ignored. An image's grid is
``(max row + 1, max col + 1)`` of its tokens.

Rules, each checked with a clear error at the model's entrance (:func:`parse_naflex`, before any work): tensors or
numpy arrays; at least one image in the batch; whole patch coordinates; ``patch_valid`` bool (or 0 / 1); valid
tokens first in each row (padding at the end), each image's tokens contiguous and images numbered ``0, 1, ...`` in
order (no negative id on a valid token), no image without tokens, no coordinate twice in one image. Padding patches
are zeroed there: nothing a padding slot holds is ever read.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from timm.data.naflex_transforms import patchify_image
from torch import Tensor, nn

from vitrel.layout.geometry import Grid
from vitrel.layout.tokens import TokenLayout

__all__ = [
    "LatePrefix",
    "NaFlexBatch",
    "ModelInput",
    "input_form",
    "check_images",
    "read_input",
    "parse_naflex",
    "grid_batch",
    "images_batch",
    "embed_patches",
    "with_prefix",
    "LayoutFeatures",
    "layout_features",
    "drop_tokens",
    "token_drop_rates",
    "token_drop_keep_max",
    "check_token_drop",
]

REQUIRED = ("patches", "patch_coord", "patch_valid")
#: what an integer image (``torchvision.io.read_image``'s uint8) is told: its 0..255 values would be scored as given
_FLOAT_IMAGES = (
    "the model takes float images normalised as its data config says (timm.data.resolve_data_config(model=model) "
    "and timm.data.create_transform, or vitrel.inference.eval_transform), not raw 0..255 pixel values"
)


class NaFlexBatch(NamedTuple):
    """A checked NaFlex batch: ``patches [B, N, D]``, ``coords [B, N, 2]`` (long, ``(row, col)``; -1 on padding),
    ``segment [B, N]`` (long, -1 on padding), ``image [B, N]`` (the token's image in the batch, row-major over rows and
    segments; -1 on padding) and ``image_grids`` (each image's grid)."""

    patches: Tensor
    coords: Tensor
    segment: Tensor
    image: Tensor
    image_grids: tuple[Grid, ...]

    @property
    def num_images(self) -> int:
        return len(self.image_grids)

    def images(self, patch_size: int) -> list[Tensor]:
        """Each image ``[C, H_i, W_i]`` in the batch's order: its ``(P, P, C)`` patches put back at their coordinates
        (the inverse of :func:`images_batch` and of timm's ``patchify_image``). Every patch of each image's grid must
        be there: dropped tokens leave no whole image (an error naming the image)."""
        p = patch_size
        out = []
        for i, (h, w) in enumerate(self.image_grids):
            mine = self.image == i
            coords, patches = self.coords[mine], self.patches[mine]
            if len(coords) != h * w:
                raise ValueError(
                    f"image {i} of the NaFlex batch has {len(coords)} of the {h * w} patches of its {h}x{w} grid "
                    "(dropped tokens): it cannot be put back together"
                )
            img = patches.new_zeros(h, w, p, p, patches.shape[-1] // (p * p))
            img[coords[:, 0], coords[:, 1]] = patches.view(len(coords), p, p, -1)
            out.append(img.permute(4, 0, 2, 1, 3).flatten(3).flatten(1, 2))
        return out

    def layout(self, num_prefix_tokens: int = 0) -> TokenLayout:
        """The tokens' layout with no prefix tokens (``with_prefix`` inserts them per image)."""
        return TokenLayout.build(self.segment, self.coords, self.image, self.image_grids, num_prefix_tokens)


def input_form(x: Any) -> str:
    """What a model's input is: ``"naflex"`` (a NaFlex dict), ``"list"`` (a list or tuple of images ``[C, H_i, W_i]``)
    or ``"images"`` (a batch ``[B, C, H, W]``). The one place the question is asked: the models' entrance
    (:func:`read_input`) and the training step read this answer. Positive kinds, not "not a tensor": a ``torch.fx``
    Proxy stands for a tensor (``features_only`` with ``feature_cls="fx"``)."""
    if isinstance(x, Mapping):
        return "naflex"
    if isinstance(x, (list, tuple)):
        return "list"
    return "images"


def check_images(x: Any, what: str) -> None:
    """A ``ValueError`` when ``x`` is no batch of images ``[B, C, H, W]`` (a list or a NaFlex dict), for a method
    ``what`` that takes one grid only."""
    form = input_form(x)
    if form != "images":
        got = "a list of images" if form == "list" else "a NaFlex dict"
        raise ValueError(f"{what} takes a batch of images [B, C, H, W] (one size), got {got}: give it each image alone")


class ModelInput(NamedTuple):
    """A model's input, its form decided once at the entrance (:func:`read_input`): ``images [B, C, H, W]`` (one
    grid for the batch: the fast path) or ``batch`` (images of any sizes, as checked patches whose
    :meth:`NaFlexBatch.layout` both backbones read). Exactly one is set."""

    images: Tensor | None
    batch: NaFlexBatch | None


def read_input(x: Any, proj: nn.Conv2d, dynamic_img_pad: bool | None = None) -> ModelInput:
    """A model's input (a batch of images, a list of images of any sizes, or a NaFlex dict) -> :class:`ModelInput`:
    a list becomes the NaFlex dict of its images (:func:`images_batch`), a dict is checked (:func:`parse_naflex`) for
    the patch embedding's convolution ``proj`` (its patch size and channels; the patches taken onto its device).
    ``dynamic_img_pad``: the model's (timm's ViT argument): True pads each image of a list to whole patches, False
    refuses one that is not, naming the argument; None (a model without it, the Swin) refuses it."""
    form = input_form(x)
    if form == "images":
        return ModelInput(x, None)
    (p, _), c = proj.kernel_size, proj.in_channels
    if form == "list":
        hint = "" if dynamic_img_pad is None else "; or build the model with dynamic_img_pad=True to zero-pad it"
        x = images_batch(list(x), p, c, pad=bool(dynamic_img_pad), hint=hint)
    return ModelInput(None, parse_naflex(x, (p, c), proj.weight.device))


def parse_naflex(
    batch: Mapping[str, Any], patch_dim: int | tuple[int, int] | None = None, device: Any = None
) -> NaFlexBatch:
    """Check a NaFlex batch dict (module docstring) and derive each token's image and each image's grid: every check
    here, before any work, each error naming the key and the value. ``patch_dim``: the values per patch the model
    takes (``P*P*C``), or its ``(P, C)`` (the error then says whether the patch size or the channels differ). Numpy
    arrays are taken (as tensors on ``device``, default the CPU); padding patches are zeroed (nothing a padding slot
    holds is ever read)."""
    if not isinstance(batch, Mapping):
        raise ValueError(f"a NaFlex batch is a dict of tensors, got {type(batch).__name__}")
    missing = [k for k in REQUIRED if k not in batch]
    if missing:
        raise ValueError(f"a NaFlex batch needs the keys {list(REQUIRED)} (+ 'segment_ids' to pack); missing {missing}")
    if batch.get("attn_mask") is not None:  # (timm's NaFlexVit lets it override the mask of patch_valid)
        raise ValueError(
            "the NaFlex batch holds an 'attn_mask': vitrel builds its attention masks from 'patch_valid' and "
            "'segment_ids' and takes no mask of one's own (leave the key out)"
        )
    patches = _as_tensor("patches", batch["patches"], device)
    device = patches.device
    coord = _as_tensor("patch_coord", batch["patch_coord"], device)
    valid = _as_tensor("patch_valid", batch["patch_valid"], device)
    if patches.dim() != 3:
        raise ValueError(f"'patches' must be [B, N, P*P*C], got {tuple(patches.shape)}")
    if not patches.is_floating_point():
        raise ValueError(f"'patches' is {patches.dtype}: {_FLOAT_IMAGES}")
    b, n, d = patches.shape
    if b == 0 or n == 0:
        raise ValueError(f"the NaFlex batch holds no image: 'patches' is {tuple(patches.shape)} (no rows or no tokens)")
    if patch_dim is not None:
        _check_patch_dim(d, patch_dim)
    if tuple(coord.shape) != (b, n, 2) or tuple(valid.shape) != (b, n):
        raise ValueError(
            f"'patch_coord' must be [B, N, 2] and 'patch_valid' [B, N] for patches {tuple(patches.shape)}, got "
            f"{tuple(coord.shape)} and {tuple(valid.shape)}"
        )
    if valid.dtype != torch.bool:
        odd = valid[(valid != 0) & (valid != 1)]
        if odd.numel():
            raise ValueError(f"'patch_valid' must be bool (or 0 / 1), got the value {odd[0].item()!r}")
    valid = valid.bool()
    if not bool(valid.any()):
        raise ValueError(f"the NaFlex batch holds no image: 'patch_valid' is False on all {b} x {n} tokens")
    coord = _integer_coords(coord, valid)
    seg = batch.get("segment_ids")
    if seg is None:
        seg = torch.zeros(b, n, dtype=torch.long, device=device)
    else:
        seg = _as_tensor("segment_ids", seg, device)
        if tuple(seg.shape) != (b, n) or seg.dtype in (torch.bool,) or seg.is_floating_point():
            raise ValueError(f"'segment_ids' must be an integer [B, N] tensor, got {seg.dtype} {tuple(seg.shape)}")
        neg = valid & (seg < 0)
        if bool(neg.any()):
            r, t = (int(i) for i in neg.nonzero()[0])
            raise ValueError(
                f"row {r}: 'segment_ids' is {int(seg[r, t])} on token {t}, which 'patch_valid' marks valid: images are "
                "numbered 0, 1, ... (mark padding with patch_valid=False; its segment_ids are ignored)"
            )
    seg = torch.where(valid, seg.long(), torch.full_like(seg.long(), -1))
    coord = torch.where(valid[..., None], coord, torch.full_like(coord, -1))
    grids, image = _check_rows(seg.cpu(), coord.cpu(), valid.cpu())
    patches = patches.masked_fill(~valid[..., None], 0)  # padding is never read, whatever it held (NaN, 1e30)
    return NaFlexBatch(patches, coord, seg, image.to(device), grids)


def _check_patch_dim(d: int, patch_dim: int | tuple[int, int]) -> None:
    """``'patches'`` of ``d`` values each for a model taking ``patch_dim`` (``P*P*C`` or ``(P, C)``): an error saying,
    where ``d`` tells, the patch size or the channels the data has."""
    if isinstance(patch_dim, int):
        if d != patch_dim:
            raise ValueError(
                f"'patches' have {d} values per patch, the model's patch embedding takes {patch_dim} (P*P*C)"
            )
        return
    p, c = patch_dim
    if d == p * p * c:
        return
    q = math.isqrt(d // c) if d % c == 0 else 0
    if q * q * c == d:
        why = (
            f"the data's patches are {q}x{q} (of {c} channels), the model's {p}x{p}: cut the images into {p}x{p} "
            f"patches (Patchify({p}); data.patch_size={p})"
        )
    elif d % (p * p) == 0:
        why = (
            f"the data's {p}x{p} patches have {d // (p * p)} channel(s), the model takes {c}: convert the images to "
            f"{c} channel(s) before patchifying"
        )
    else:
        why = f"the model takes {p}x{p} patches of {c} channels, flattened (P, P, C)"
    raise ValueError(
        f"'patches' have {d} values per patch, the model's patch embedding takes {p * p * c} (P*P*C = {p}*{p}*{c}): "
        f"{why}"
    )


def _as_tensor(key: str, value: Any, device: Any) -> Tensor:
    """A NaFlex dict's entry as a tensor: a tensor as it is, a numpy array converted (onto ``device``)."""
    if isinstance(value, Tensor):
        return value
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value)).to(device)
    raise ValueError(f"the NaFlex batch's {key!r} must be a tensor (or a numpy array), got {type(value).__name__}")


def _integer_coords(coord: Tensor, valid: Tensor) -> Tensor:
    """``patch_coord`` as long; float coordinates are taken when they are whole numbers (on the valid tokens)."""
    if coord.dtype == torch.bool or coord.is_complex():
        raise ValueError(f"'patch_coord' must hold integer (row, col) patch indices, got {coord.dtype}")
    if coord.is_floating_point():
        c = coord[valid]
        bad = ~torch.isfinite(c) | (c != c.round())
        if bool(bad.any()):
            r, t = (int(i) for i in valid.nonzero()[int(bad.any(dim=-1).nonzero()[0])])
            raise ValueError(
                f"'patch_coord' must hold whole patch indices (row, col), got {coord[r, t].tolist()} at row {r}, "
                f"token {t}: coordinates count patches, not pixels or fractions of the image"
            )
    return coord.long()


def _check_rows(seg: Tensor, coord: Tensor, valid: Tensor) -> tuple[tuple[Grid, ...], Tensor]:
    """Each row's rules (module docstring); each image's grid and each token's image."""
    b, n = seg.shape
    grids: list[Grid] = []
    image = torch.full((b, n), -1, dtype=torch.long)
    for r in range(b):
        k = int(valid[r].sum())
        if not bool(valid[r, :k].all()):
            raise ValueError(f"row {r}: padding (patch_valid False) must come after the valid tokens")
        if k == 0:
            continue
        s, c = seg[r, :k], coord[r, :k]
        if int(s[0]) != 0:  # (no negative id on a valid token: parse_naflex)
            first = int(s[0])
            hint = " (T5X / seqio number from 1 with 0 for padding: subtract 1, mark padding with patch_valid)"
            raise ValueError(f"row {r}: segment ids must start at 0, got {first}" + (hint if first == 1 else ""))
        steps = s[1:] - s[:-1]
        if bool((steps < 0).any()) or bool((steps > 1).any()):
            bad = "an image with no tokens" if bool((steps > 1).any()) else "images out of order"
            raise ValueError(
                f"row {r}: {bad}: segment ids must run 0, 1, 2, ... with each image's tokens contiguous, got "
                f"{torch.unique_consecutive(s).tolist()}"
            )
        if bool((c < 0).any()):
            raise ValueError(f"row {r}: negative patch coordinates")
        for i in range(int(s[-1]) + 1):
            ci = c[s == i]
            h, w = int(ci[:, 0].max()) + 1, int(ci[:, 1].max()) + 1
            if torch.unique(ci[:, 0] * w + ci[:, 1]).numel() != ci.shape[0]:
                raise ValueError(f"row {r}, image {i}: a patch coordinate appears twice")
            image[r, :k][s == i] = len(grids)
            grids.append(Grid(h, w))
    return tuple(grids), image


def grid_batch(tokens: Tensor, grid: Grid) -> NaFlexBatch:
    """Tokens ``[B, H*W, C]`` of one full ``grid`` per row (raster order) as a :class:`NaFlexBatch`."""
    b, n, _ = tokens.shape
    p = torch.arange(n, device=tokens.device)
    coords = torch.stack([p // grid.w, p % grid.w], -1)[None].expand(b, -1, -1)
    segment = torch.zeros(b, n, dtype=torch.long, device=tokens.device)
    image = torch.arange(b, device=tokens.device)[:, None].expand(-1, n)
    return NaFlexBatch(tokens, coords, segment, image, (grid,) * b)


def images_batch(
    images: Sequence[Tensor], patch_size: int, in_chans: int | None = None, pad: bool = False, hint: str = ""
) -> dict[str, Tensor]:
    """A list of images ``[C, H_i, W_i]`` (sides multiples of ``patch_size``, or with ``pad`` zero-padded on the right
    and bottom to the next multiple, as timm's ``dynamic_img_pad``; ``C = in_chans`` when given, else one ``C`` for
    all) -> the NaFlex dict, one image per row, padded (timm's ``patchify_image``, as timm's NaFlex loader makes it).
    ``hint``: what the error for an image of no whole patches adds."""
    if not images:
        raise ValueError("an empty list of images")
    rows = []
    for i, img in enumerate(images):
        if not isinstance(img, Tensor):
            raise ValueError(f"image {i} of the list: expected a tensor [C, H, W], got {type(img).__name__}")
        if not img.is_floating_point():
            raise ValueError(f"image {i} of the list is {img.dtype}: {_FLOAT_IMAGES}")
        if img.dim() == 4 and img.shape[0] == 1:
            img = img[0]
        if img.dim() != 3:
            raise ValueError(f"image {i} of the list: a list of images takes tensors [C, H, W], got {tuple(img.shape)}")
        h, w = img.shape[-2:]
        if (h % patch_size or w % patch_size) and not pad or not (h and w):
            raise ValueError(
                f"image {i} of the list: {h}x{w} is not a positive multiple of the patch size {patch_size} (both sides "
                f"must be multiples of the patch size: crop or pad the image{hint})"
            )
        want, whose = (in_chans, "the model takes") if in_chans is not None else (images[0].shape[-3], "image 0 has")
        if img.shape[0] != want:
            raise ValueError(
                f"image {i} of the list has {img.shape[0]} channels, {whose} {want} (shape {tuple(img.shape)}): "
                "every image [C, H, W] needs the model's C (repeat a grey image's channel, drop an alpha channel)"
            )
        rows.append(patchify_image(img, (patch_size, patch_size), pad=pad))
    n = max(r[0].shape[0] for r in rows)
    return {
        "patches": torch.stack([F.pad(r[0], (0, 0, 0, n - r[0].shape[0])) for r in rows]),
        "patch_coord": torch.stack([F.pad(r[1], (0, 0, 0, n - r[1].shape[0])) for r in rows]).to(images[0].device),
        "patch_valid": torch.stack([F.pad(r[2], (0, n - r[2].shape[0])) for r in rows]).to(images[0].device),
    }


def check_token_drop(spec: Any) -> float | list[float]:
    """A ``token_drop`` rate in ``[0, 1)`` or a range ``(low, high)`` of them (stored as a list), checked: numbers only
    (a string such as ``"0.5"`` is refused, naming ``token_drop``, not read character by character)."""

    def number(v: Any) -> bool:
        return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))

    if number(spec):
        rates = [float(spec)]
    elif isinstance(spec, (str, bytes, Mapping)) or not isinstance(spec, Iterable):
        raise ValueError(
            f"token_drop must be a rate in [0, 1) or a pair (low, high), got {spec!r} ({type(spec).__name__})"
        )
    else:
        values = list(spec)
        if not all(number(v) for v in values):
            raise ValueError(f"token_drop as a range must be two numbers (low, high), got {spec!r}")
        rates = [float(v) for v in values]
        if len(rates) != 2 or rates[0] > rates[1]:
            raise ValueError(f"token_drop as a range must be (low, high) with low <= high, got {spec!r}")
    if not all(0.0 <= r < 1.0 for r in rates):
        raise ValueError(f"token_drop rates must be in [0, 1), got {spec!r}")
    return rates[0] if len(rates) == 1 else rates


def token_drop_rates(spec: float | Sequence[float], num_images: int, device: Any = None) -> Tensor:
    """The drop rate of each image: ``spec`` itself, or drawn uniformly from ``spec = (low, high)`` per image."""
    if isinstance(spec, (int, float)):
        return torch.full((num_images,), float(spec), device=device)
    lo, hi = (float(v) for v in spec)
    return lo + (hi - lo) * torch.rand(num_images, device=device)


def token_drop_keep_max(spec: float | Sequence[float], num_tokens: int, dtype: torch.dtype = torch.float32) -> int:
    """The most tokens ``token_drop`` keeps of an image of ``num_tokens`` (:func:`drop_tokens` at rates of ``dtype``,
    :func:`token_drop_rates`'): ``round((1 - low) * n)`` (at least 1) at its lowest rate, rounded up where ``low``
    in ``dtype`` may keep one more. A Python int of the config and the grid alone, so a compiled step's rows have one
    length per image size (:func:`drop_tokens`' ``length``), not one per draw of the rates."""
    low = float(spec) if isinstance(spec, (int, float)) else float(spec[0])
    # a rate drawn in dtype is at least low rounded to it: below low by at most eps * low
    slack = num_tokens * torch.finfo(dtype).eps
    return min(num_tokens, max(1, math.floor((1 - low) * num_tokens + 0.5 + slack)))


def embed_patches(proj: nn.Conv2d, patches: Tensor) -> Tensor:
    """The patch embedding's convolution applied to flattened ``(P, P, C)`` patches ``[B, N, P*P*C]`` -> ``[B, N, D]``:
    the same weights as a matrix (timm's NaFlex ``Linear`` form of a conv patch embedding)."""
    weight = proj.weight.permute(0, 2, 3, 1).flatten(1)  # [D, P*P*C], (ph, pw, c) order
    return F.linear(patches.to(weight.dtype), weight, proj.bias)


def with_prefix(x: Tensor, batch: NaFlexBatch, prefix: Tensor | None) -> tuple[Tensor, TokenLayout, Tensor]:
    """Patch tokens ``x [B, N, C]`` with ``prefix [P, C]`` (class and register tokens) inserted ahead of every image's
    patches -> ``[B, N + P * max images per row, C]``, its :class:`TokenLayout` (padding at the end of a row) and
    ``dest [B, N]``, where each input token went."""
    p = 0 if prefix is None else prefix.shape[0]
    b, n, c = x.shape
    if p == 0:
        return x, batch.layout(0), torch.arange(n, device=x.device)[None].expand(b, -1)
    seg, device = batch.segment, x.device
    valid = seg >= 0
    per_row = (seg.max(dim=1).values + 1).clamp(min=0)  # images per row
    m = n + p * int(per_row.max())
    pos = torch.arange(n, device=device)[None].expand(b, -1)
    dest = torch.where(valid, pos + p * (seg + 1), pos + p * per_row[:, None])  # patches and padding
    out = x.new_zeros(b, m, c)
    out.scatter_(1, dest[..., None].expand(-1, -1, c), x)
    coords = torch.full((b, m, 2), -1, dtype=torch.long, device=device)
    coords.scatter_(1, dest[..., None].expand(-1, -1, 2), batch.coords)
    segment = torch.full((b, m), -1, dtype=torch.long, device=device)
    segment.scatter_(1, dest, seg)
    image = torch.full((b, m), -1, dtype=torch.long, device=device)
    image.scatter_(1, dest, batch.image)
    # each image's prefix: at its first patch's place minus P
    first = valid & torch.cat([torch.ones_like(seg[:, :1], dtype=torch.bool), seg[:, 1:] != seg[:, :-1]], dim=1)
    rb, rt = first.nonzero(as_tuple=True)
    for k in range(p):
        at = dest[rb, rt] - p + k
        out[rb, at] = prefix[k].to(out.dtype)
        coords[rb, at] = torch.tensor([-1, k], device=device)
        segment[rb, at] = seg[rb, rt]
        image[rb, at] = batch.image[rb, rt]
    return out, TokenLayout.build(segment, coords, image, batch.image_grids, p), dest


class LatePrefix(NamedTuple):
    """Where the prefix tokens join a token layout late (a ViT's ``prefix_at``), :func:`with_prefix`'s answer: the
    ``tokens`` with every image's prefix tokens in place, their ``layout`` and ``dest``, where each patch token goes."""

    tokens: Tensor
    layout: TokenLayout
    dest: Tensor

    def __call__(self, x: Tensor) -> tuple[Tensor, TokenLayout]:
        """Patch tokens ``x [B, N, C]`` (on :func:`with_prefix`'s layout without prefix) -> with the prefix tokens
        ahead of each image's, and their layout."""
        idx = self.dest[..., None].expand(-1, -1, x.shape[-1])
        return self.tokens.to(x.dtype).scatter(1, idx, x), self.layout


class LayoutFeatures(dict):
    """``forward_features``' output for a token layout, timm's NaFlexVit dict: ``patches [B, N', C]`` (the normalised
    tokens), ``patch_valid [B, N' - P]`` (bool, the patch slots after the first ``P`` prefix tokens that hold a
    patch: timm's patch-only validity) and vitrel's ``layout`` (the :class:`TokenLayout`, which pools each image of
    any row). A packed batch (``segment_ids``: several images per row) has no ``patch_valid`` (no mask over a row
    pools its images apart): looking it up is a ``KeyError`` saying to pass the dict whole."""

    def __missing__(self, key: str) -> Any:
        if key == "patch_valid":
            raise KeyError(
                "'patch_valid': a packed batch (segment_ids) holds several images per row, which no patch mask pools "
                "apart: pass the features whole, forward_head(features) (or forward_head(**features))"
            )
        raise KeyError(key)


def layout_features(x: Tensor, layout: TokenLayout, packed: bool) -> LayoutFeatures:
    """Tokens ``x [B, N', C]`` on ``layout`` as :class:`LayoutFeatures` (``packed``: without ``patch_valid``)."""
    out = LayoutFeatures(patches=x, layout=layout)
    if not packed:  # one image per row: its prefix tokens first, then its patches, then padding (with_prefix)
        out["patch_valid"] = layout.valid[:, layout.num_prefix_tokens :]
    return out


def drop_tokens(
    batch: NaFlexBatch, rate: Tensor, generator: torch.Generator | None = None, length: int | None = None
) -> NaFlexBatch:
    """NaViT's token dropping: keep ``round((1 - rate_i) * n_i)`` (at least 1) of the ``n_i`` tokens of image ``i``
    (``rate [num_images]``), chosen uniformly, the kept tokens keeping their coordinates; the rows compacted (kept
    tokens first, in their order) and cut to their longest, or to ``length`` tokens (padding after the kept ones):
    a length fixed by the configuration (:func:`token_drop_keep_max`), so that ``torch.compile`` sees one shape,
    not one per draw. ``length`` must be at least the longest row's kept tokens (one image per row, the batch of a
    grid: :func:`token_drop_keep_max` of its rates)."""
    seg, image = batch.segment, batch.image
    valid = image >= 0
    counts = torch.bincount(image[valid], minlength=batch.num_images)
    keep_n = ((1 - rate.to(torch.float64)) * counts).round().long().clamp(min=1)
    score = torch.rand(seg.shape, generator=generator, device=seg.device if generator is None else "cpu").to(seg.device)
    score = torch.where(valid, score, torch.full_like(score, 2.0))
    # rank of each token within its image by score: keep the keep_n lowest
    order = torch.argsort(score.double() + 4 * image.clamp(min=0).double(), dim=1)  # by image, then score
    ranked_img = torch.gather(image, 1, order)
    same = F.pad(ranked_img[:, 1:] == ranked_img[:, :-1], (1, 0), value=False)
    pos = torch.arange(seg.shape[1], device=seg.device)[None].expand_as(seg)
    start = torch.where(same, torch.zeros_like(pos), pos).cummax(dim=1).values
    rank = torch.empty_like(pos).scatter_(1, order, pos - start)
    kept = valid & (rank < keep_n[image.clamp(min=0)])
    # compact: kept tokens first, in their order
    idx = torch.argsort((~kept).to(torch.int8), dim=1, stable=True)
    idx = idx[:, : int(kept.sum(1).max()) if length is None else length]
    take = kept.gather(1, idx)

    def pick(t: Tensor, fill: int) -> Tensor:
        g = t.gather(1, idx.view(*idx.shape, *([1] * (t.dim() - 2))).expand(-1, -1, *t.shape[2:]))
        return torch.where(take.view(*take.shape, *([1] * (t.dim() - 2))), g, torch.full_like(g, fill))

    return NaFlexBatch(
        pick(batch.patches, 0), pick(batch.coords, -1), pick(seg, -1), pick(image, -1), batch.image_grids
    )
