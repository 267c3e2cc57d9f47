"""A kernel launch as data (name, grid, arguments, options), run by the op and compiled ahead of time by bench/."""

from __future__ import annotations

import contextvars
from typing import NamedTuple

import torch

from vitrel.kernels.triton.device import jit_module

__all__ = ["KERNELS", "Launch", "batch_chunks", "kernel_fn"]


class Launch(NamedTuple):
    """One launch of a fused kernel: its name (:data:`KERNELS`), grid, every argument by name (``constexpr`` ones
    too) and launch options (``num_warps``, ``num_stages``; dropped in the interpreter). The op runs these;
    :func:`~vitrel.kernels.triton.op.plan` returns them, for ``bench/triton_aot.py`` to compile ahead of time."""

    kernel: str
    grid: tuple[int, ...]
    args: dict
    options: dict

    @classmethod
    def make(cls, kernel: str, grid: tuple[int, ...], positional: list, constexprs: dict, options: dict) -> Launch:
        fn = kernel_fn(kernel)
        if len(positional) + len(constexprs) != len(fn.arg_names):
            raise TypeError(f"{kernel}: {len(positional)} + {len(constexprs)} arguments for {len(fn.arg_names)}")
        return cls(kernel, grid, {**dict(zip(fn.arg_names, positional)), **constexprs}, options)

    def __call__(self) -> None:
        if self.args.get("TMA"):  # (tensor descriptors made in the kernel take global scratch from Triton's allocator)
            contextvars.copy_context().run(self._with_scratch)
        else:
            kernel_fn(self.kernel)[self.grid](**self.args, **self._options())

    def _options(self) -> dict:
        """The launch options on CUDA; none in the interpreter."""
        cuda = next(v for v in self.args.values() if isinstance(v, torch.Tensor)).device.type == "cuda"
        return self.options if cuda else {}

    def _with_scratch(self) -> None:
        """The launch with Triton's allocator set to torch's, in a copy of the caller's context (nothing left set)."""
        import triton

        device = self.args["Q"].device
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=device))
        kernel_fn(self.kernel)[self.grid](**self.args, **self._options())


#: the jit kernels by their launches' names: (module, function)
KERNELS = {
    "fwd": ("_fwd", "_fwd_kernel"), "fwd_tile": ("_fwd", "_fwd_tile_kernel"), "delta": ("_bwd", "_bwd_delta_kernel"),
    "dkdv": ("_bwd", "_bwd_dkdv_kernel"), "dq": ("_bwd", "_bwd_dq_kernel"), "dbias": ("_sums", "_bwd_dbias_kernel"),
    "tile": ("_sums", "_bwd_tile_kernel"), "table_grad": ("_sums", "_table_grad_kernel"),
}  # fmt: skip


def kernel_fn(kernel: str):
    """The jit function of launch name ``kernel``."""
    module, name = KERNELS[kernel]
    return getattr(jit_module(module), name)


#: the arguments of the fwd and dkdv kernels with a batch axis first (``TOK`` on a token layout)
_BATCHED = ("Q", "K", "V", "O", "LSE", "DO", "DELTA", "DK", "DV")


def batch_chunks(launch: Launch, batch: int, heads: int, grid_y_max: int) -> list[Launch]:
    """``launch`` (grid ``(tiles, batch x heads)``) as launches over shares of the batch of at most ``grid_y_max``
    programs on the grid's second axis (CUDA's limit); a share starts at a multiple of the mask's rows, or slices
    them where there is one per batch element."""
    if batch * heads <= grid_y_max:
        return [launch]
    a = launch.args
    names = [*_BATCHED, *(("TOK",) if a["LAYOUT"] else ()), *(("DQ",) if a.get("ATOMIC_DQ") else ())]
    rows = a["n_mask_b"] if a["MASK_KIND"] else 1
    if a["MASK_KIND"] and rows == batch:
        names.append("MASK")
        rows = 1
    step = grid_y_max // heads // rows * rows
    if step == 0:
        raise ValueError(f"rel_bias_attention: {heads} heads and {rows} mask rows exceed CUDA's grid ({grid_y_max})")
    out = []
    for b0 in range(0, batch, step):
        b1 = min(batch, b0 + step)
        args = {**a, **{k: a[k][b0:b1] for k in names if k in a}}
        out.append(launch._replace(grid=(launch.grid[0], (b1 - b0) * heads), args=args))
    return out
