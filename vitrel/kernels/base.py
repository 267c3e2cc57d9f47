"""What the kernels that read the bias by offset share (flex, triton): their base class and refusals."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from vitrel.kernels.registry import Kernel
from vitrel.layout.geometry import Grid
from vitrel.layout.tokens import TokenLayout, stack_tables

__all__ = ["OffsetTableKernel", "content_refusal", "table_refusal", "token_terms_refusal", "video_refusal"]


def token_terms_refusal(kernel: str, scheme, lacks: str) -> str | None:
    """Why a kernel that reads a fixed position input (flex, triton: the offset table; fold: the bias factors) cannot
    run ``scheme`` when the scheme's term depends on the query token (``has_token_terms``: PaPE), or None. ``lacks``:
    what such a scheme has none of, e.g. ``"no offset table"``."""
    if not scheme.has_token_terms:
        return None
    return (
        f"attn_impl={kernel!r}: {scheme.name}'s term depends on the query token ({lacks}); its fast path "
        "is one SDPA call on augmented queries and keys: use attn_impl='sdpa' or 'auto'"
    )


def video_refusal(kernel: str, what: str, scheme) -> str:
    """Why a kernel that reads 2-D offset tables only (triton) cannot run ``what`` (``scheme``, a video bias scheme,
    or a video grid of it)."""
    fold = ", 'fold'" if scheme.has_bias_factors else ""
    return (
        f"attn_impl={kernel!r} takes biases on image grids (H, W) only (its fused kernel reads a 2-D offset table), "
        f"not {what}: use attn_impl='sdpa', 'flex'{fold} or 'auto'"
    )


def content_refusal(kernel: str, scheme, lacks: str) -> str | None:
    """Why a kernel cannot run ``scheme`` when the scheme has content terms (Shaw's, iRPE's: only ``shaw`` and ``eager``
    compute), or None. ``lacks``: what such a scheme has none of, e.g. ``"no offset table to read"``."""
    if not scheme.has_content_terms:
        return None
    return (
        f"attn_impl={kernel!r}: {scheme.name} has {lacks} (its content terms q_i . r_ij, sum_j a_ij r_ij are "
        "computed by the content schemes' own kernel): use attn_impl='shaw' (what 'auto' picks) or 'eager'"
    )


def table_refusal(kernel: str, scheme) -> str | None:
    """Why a kernel that reads the bias by offset cannot run ``scheme`` (flex, triton), or None."""
    refusal = token_terms_refusal(kernel, scheme, "no offset table")
    refusal = refusal or content_refusal(kernel, scheme, "no offset table to read")
    if refusal is None and scheme.has_bias and not scheme.has_offset_table:
        refusal = (
            f"attn_impl={kernel!r} reads the bias by offset from the scheme's table; {scheme.name} has no such "
            "table (a scheme gets one by defining offset_table() and has_offset_table = True): use attn_impl='sdpa' "
            "or 'auto'"
        )
    return refusal


class OffsetTableKernel(Kernel):
    """A kernel that reads the bias by offset from the scheme's table (flex, triton): every bias scheme with an
    offset table, rotary schemes and none; the causal mask by index."""

    reads = frozenset({"table", "block_mask"})
    takes_dropout = False
    native_causal = True
    float64 = False

    @classmethod
    def refuses(cls, scheme):
        return table_refusal(cls.name, scheme) or super().refuses(scheme)

    @classmethod
    def skip_blocks(cls, table: Tensor, grid: Grid, num_prefix_tokens: int) -> Any:
        """What the kernel reads (``block_mask``) to skip the blocks a table's ``-inf`` entries mask whole, on a full
        grid; None: it reads nothing of the kind."""
        return None

    @classmethod
    def layout_blocks(cls, scheme, layout: TokenLayout, table: Tensor | None) -> Any:
        """The same on a token layout (``table``: one per distinct grid)."""
        return None

    @classmethod
    def inputs(cls, scheme, grid, num_prefix_tokens):
        table = scheme.offset_table(grid) if scheme.has_bias else None
        masked = table is not None and scheme.has_masked_offsets
        return {"table": table, "block_mask": cls.skip_blocks(table, grid, num_prefix_tokens) if masked else None}

    @classmethod
    def layout_inputs(cls, scheme, layout, mask):
        """One table per distinct image grid, centred in the largest extent (``grid``), read at each pair's offset."""
        table, out = None, {}
        if scheme.has_bias:
            table, out["grid"] = stack_tables([scheme.offset_table(g) for g in layout.grids])
        return {**out, "table": table, "block_mask": cls.layout_blocks(scheme, layout, table)}
