"""Old import path of the fused bias kernel, kept for one release: :mod:`vitrel.kernels.triton`."""

from vitrel.kernels.triton import *  # noqa: F403
from vitrel.kernels.triton import __all__  # noqa: F401
