"""NaFlex inputs for tests, made by timm's own ``patchify_image``."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from timm.data.naflex_transforms import patchify_image


def packed(
    imgs: list[torch.Tensor], rows: Sequence[Sequence[int]] = ((0, 1), (2,)), pad: int = 3
) -> dict[str, torch.Tensor]:
    """timm's NaFlex dict with ``segment_ids``: the images ``rows[r]`` packed into row ``r`` (4 px patches), each row
    padded to the longest plus ``pad`` slots (by default images 0 and 1 in row 0, image 2 in row 1)."""
    per_row = []
    for r in rows:
        parts = [patchify_image(imgs[i], (4, 4)) for i in r]
        seg = torch.cat([torch.full((p[0].shape[0],), s) for s, p in enumerate(parts)])
        per_row.append([torch.cat([p[k] for p in parts]) for k in range(3)] + [seg])
    n = max(r[0].shape[0] for r in per_row) + pad

    def stack(k: int) -> torch.Tensor:
        pads = [(0, 0, 0, n - r[k].shape[0]) if r[k].dim() == 2 else (0, n - r[k].shape[0]) for r in per_row]
        return torch.stack([F.pad(r[k], p) for r, p in zip(per_row, pads)])

    return {"patches": stack(0), "patch_coord": stack(1), "patch_valid": stack(2), "segment_ids": stack(3)}
