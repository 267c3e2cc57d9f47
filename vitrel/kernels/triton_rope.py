"""Old import path of the fused rotary kernel, kept for one release: :mod:`vitrel.kernels.triton.rope`."""

from vitrel.kernels.triton.rope import rope_rotate, rotation_tables

__all__ = ["rope_rotate", "rotation_tables"]
