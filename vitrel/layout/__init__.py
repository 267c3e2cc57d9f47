"""Where tokens sit: patch grids and their offsets (:mod:`~vitrel.layout.geometry`), token layouts of packed, padded and
token-dropped batches (:mod:`~vitrel.layout.tokens`), Swin's windows (:mod:`~vitrel.layout.windows`) and the head
widths the fused kernels take (:mod:`~vitrel.layout.heads`). The ground floor of the package: the position schemes
(:mod:`vitrel.pos`) and the attention kernels (:mod:`vitrel.kernels`) read it, and it imports neither."""

from vitrel.layout.geometry import Grid, as_grid
from vitrel.layout.tokens import TokenLayout

__all__ = ["Grid", "TokenLayout", "as_grid"]
