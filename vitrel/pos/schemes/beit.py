"""BEiT's relative bias: Swin's table between patches and three learned terms per head for the prefix tokens.

``rel2d_beit`` (Bao et al., BEiT, 2021; the authors' microsoft/unilm ``beit/modeling_finetune.py``, timm's
``beit.py``)::

    A_ij = q_i . k_j / sqrt(d) + B_h[dh_ij + H - 1, dw_ij + W - 1]   i, j patches (rel2d_full)
                               + c_h[0]                               i prefix, j patch
                               + c_h[1]                               i patch,  j prefix
                               + c_h[2]                               i, j prefix

``c = prefix_terms [3, heads]`` in BEiT's order (the last three rows of its flat table: cls to token, token to cls,
cls to cls). BEiT has one class token; several prefix tokens (registers) share the three terms. Built without prefix
tokens (a Swin, ``class_token=False``) it has no terms and is ``rel2d_full``. Only a dense bias carries them (no
offset table: ``flex`` and ``triton`` refuse the scheme, ``auto`` picks ``sdpa``). The table follows the option
``extend`` as ``rel2d_full``'s; the prefix terms do not depend on the grid. The authors start the table at zero;
here it is drawn as ``rel2d_full``'s (``init_std``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from vitrel.layout.geometry import Grid, pad_prefix
from vitrel.pos.registry import register_pos
from vitrel.pos.schemes.bias2d import FullTable, full_bias

__all__ = ["Rel2dBeit", "beit_bias"]


def beit_bias(patches: Tensor, prefix_terms: Tensor | None, num_prefix_tokens: int) -> Tensor:
    """``[heads, n, n]`` bias between patches and ``prefix_terms [3, heads]`` -> ``[heads, P + n, P + n]`` with the
    prefix rows and columns filled as BEiT's (module docstring); zero there without terms (a scheme built without
    prefix tokens, as iRPE's prefix bucket)."""
    p = num_prefix_tokens
    if prefix_terms is None:
        return pad_prefix(patches, p)
    if not p:
        return patches
    heads, n = patches.shape[0], patches.shape[-1]
    c = prefix_terms.to(patches.dtype).t()[:, :, None, None]  # [heads, 3, 1, 1]
    top = torch.cat([c[:, 2].expand(heads, p, p), c[:, 0].expand(heads, p, n)], dim=-1)
    rest = torch.cat([c[:, 1].expand(heads, n, p), patches], dim=-1)
    return torch.cat([top, rest], dim=1)


@register_pos("rel2d_beit")
class Rel2dBeit(FullTable):
    """BEiT's ``(2H-1) x (2W-1)`` bias table per head with three terms for the class token (``prefix_terms``)."""

    no_weight_decay_keys = ("table", "prefix_terms")

    def __init__(self, *, init_std: float = 0.02, **kw) -> None:
        super().__init__(init_std=init_std, **kw)
        self.prefix_terms: nn.Parameter | None = None
        if self.num_prefix_tokens:  # (built without prefix tokens, as in a Swin, it is rel2d_full)
            self.prefix_terms = nn.Parameter(torch.zeros(3, self.num_heads))
            nn.init.trunc_normal_(self.prefix_terms, std=init_std)

    def bias(self, grid: Grid, num_prefix_tokens: int = 0) -> Tensor:
        return beit_bias(full_bias(self.table_for(grid), grid), self.prefix_terms, num_prefix_tokens)
