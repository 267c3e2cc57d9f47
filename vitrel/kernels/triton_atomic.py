"""Old import path of ``attn_impl="triton_atomic"``, kept for one release: :mod:`vitrel.kernels.triton.attend`."""

from vitrel.kernels.triton.attend import TritonAtomicKernel

__all__ = ["TritonAtomicKernel"]
