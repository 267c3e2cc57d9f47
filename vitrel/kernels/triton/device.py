"""Where the Triton kernels run: CUDA, or CPU tensors through Triton's interpreter; their jit modules, loaded lazily."""

from __future__ import annotations

import functools
import importlib
import os

import torch

from vitrel.kernels.registry import KernelDeviceError

__all__ = ["check_device", "interpreter_on", "jit_module"]


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_device(device: torch.device, dtype: torch.dtype | None = None) -> None:
    """Raise unless the Triton kernels can run on ``device``: CUDA, or CPU with ``TRITON_INTERPRET=1`` where ``dtype``
    (the inputs', for kernels with products) is not bfloat16, whose ``tl.dot`` the interpreter computes wrongly; never
    float64 ``dtype``, which the kernels would compute in float32."""
    if dtype == torch.float64:
        raise KernelDeviceError(
            "attn_impl='triton' computes in float32 (its products and softmax), not float64: use attn_impl='sdpa' or "
            "'eager' for float64, or 'auto', which picks one of them"
        )
    if device.type == "cuda":
        return
    if device.type == "cpu" and interpreter_on():
        if dtype == torch.bfloat16:
            raise KernelDeviceError(
                "attn_impl='triton' on CPU runs in Triton's interpreter, whose products of bfloat16 tensors are wrong: "
                "use float32 or float16 on CPU (bfloat16 runs on CUDA), or attn_impl='sdpa'"
            )
        return
    raise KernelDeviceError(
        f"attn_impl='triton' runs Triton kernels on CUDA; on {device.type} tensors it needs Triton's interpreter: "
        "set TRITON_INTERPRET=1 in the environment before starting Python (slow: for tests at small sizes), or use "
        "attn_impl='sdpa' on this device"
    )


@functools.cache
def jit_module(name: str):
    """The jit module ``vitrel.kernels.triton.<name>``, imported on first use (after ``TRITON_INTERPRET`` is read)."""
    module = importlib.import_module(f"vitrel.kernels.triton.{name}")
    if interpreter_on():
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(tl.zeros, InterpretedFunction):
            raise RuntimeError(
                "TRITON_INTERPRET=1 was set after triton.language had been imported (importing timm, and so vitrel, "
                "imports it; so do torch.compile and torch.export), so Triton's own functions are not interpreted: "
                "set TRITON_INTERPRET=1 in the environment before starting Python"
            )
    return module
