"""FLOPs as torch's ``FlopCounterMode`` counts them: a rule for sdpa's CPU kernel (Lightning's model summary counts
with it) and a network's forward on one sample (a run's ``gflops``).

torch counts the CUDA kernels of ``scaled_dot_product_attention`` (flash, memory-efficient, cuDNN) but has no formula
for the CPU one, ``aten._scaled_dot_product_flash_attention_for_cpu``: a CPU run's summary left the attention's
``q @ k^T`` and ``attn @ v`` out. :func:`count_cpu_attention` registers torch's own rule for them (through the public
``register_flop_formula``), once, and only where torch has none.

:func:`forward_flops` counts one forward of a network on one sample at its nominal size with it; :func:`run_gflops`
is the figure a run's ``metrics.json`` records (``gflops``), None where torch cannot count the forward."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from timm.layers import AttentionPoolLatent
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode, flop_registry, register_flop_formula

from vitrel.models.data_config import example_input, model_data_config

__all__ = ["UncountedError", "count_cpu_attention", "cpu_sdpa_flop", "eval_gflops", "forward_flops", "run_gflops"]

_CPU_SDPA = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def cpu_sdpa_flop(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, out_shape: Any = None, **kw) -> int:
    """``q [B, H, N, d] @ k^T`` and ``attn @ v [B, H, M, d_v]``: 2 FLOPs per multiply-add, as torch's CUDA rule."""
    b, h, n, d = query_shape
    m, dv = key_shape[-2], value_shape[-1]
    return 2 * b * h * n * m * d + 2 * b * h * n * m * dv


def count_cpu_attention() -> None:
    """Register :func:`cpu_sdpa_flop` for sdpa's CPU kernel unless torch already counts it."""
    if _CPU_SDPA not in flop_registry:
        register_flop_formula(_CPU_SDPA)(cpu_sdpa_flop)


#: the attention kernels whose work torch's ``FlopCounterMode`` cannot see, and why
UNCOUNTED_KERNELS = {
    "flex": "compiled FlexAttention does not run under torch's FlopCounterMode",
    "triton": "its fused Triton kernel is a custom operator torch has no FLOP formula for",
    "triton_atomic": "its fused Triton kernel is a custom operator torch has no FLOP formula for",
}


#: why a network with timm's attention pool (``global_pool="map"``) is not counted
ATTN_POOL_UNCOUNTED = (
    "global_pool='map': torch's FlopCounterMode fails without gradients on timm's AttentionPoolLatent (its module "
    "tracker on the latent query, a view made under no_grad), timm's own ViT's too"
)


def attn_pool_uncounted(model: nn.Module) -> str | None:
    """:data:`ATTN_POOL_UNCOUNTED` where ``model`` holds timm's ``AttentionPoolLatent``, else None."""
    return ATTN_POOL_UNCOUNTED if any(isinstance(m, AttentionPoolLatent) for m in model.modules()) else None


class UncountedError(ValueError):
    """The forward of a network holds work torch's ``FlopCounterMode`` cannot count (:func:`forward_flops`)."""


class _OpsWithoutFormula(TorchFunctionMode):
    """The operators called outside torch's own namespaces (``aten``, ``prims``) that have no FLOP formula: custom
    kernels (``torch.ops.vitrel.rel_bias_attention``), whose work the count would leave out."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        packet = getattr(func, "overloadpacket", func)  # (an operator's overload: its packet, the registry's key)
        if hasattr(packet, "overloads") and packet not in flop_registry:  # (a torch.ops operator)
            namespace, _, name = str(packet).partition(".")
            if namespace not in ("aten", "prims"):
                self.seen.add(f"{namespace}::{name}")
        return func(*args, **(kwargs or {}))


def _uncounted_kernels(model: nn.Module) -> list[str]:
    """The ``attn_impl`` of ``model``'s layers (its ``vitrel_cfg``'s when no layer sets one) that torch cannot count."""
    named = {m.attn_impl for m in model.modules() if isinstance(getattr(m, "attn_impl", None), str)}
    named = named or {str((getattr(model, "vitrel_cfg", None) or {}).get("attn_impl", "auto"))}
    return sorted(named & UNCOUNTED_KERNELS.keys())


def forward_flops(model: nn.Module, example: Tensor | None = None) -> int:
    """FLOPs of one forward of ``model`` on ``example`` as torch's ``FlopCounterMode`` counts them: 2 per multiply-add
    of the matmuls, convolutions and attention products (sdpa's CPU kernel too: :func:`count_cpu_attention`); norms,
    softmax, bias adds and elementwise ops are not counted.

    ``example`` defaults to one zero sample at the model's nominal size (its ``img_size``, ``in_chans``, a video
    model's ``num_frames``: :func:`~vitrel.models.data_config.model_data_config`), in the dtype and on the device of its
    weights. It runs in eval mode without gradients; the modules' train / eval modes and the CPU's and the device's
    random streams are left as they were. An :class:`UncountedError` where torch cannot count the forward: FlexAttention
    or the Triton kernels named by ``attn_impl``, timm's attention pool (checked before running), or a custom operator
    without a FLOP formula (seen while counting)."""
    kernels = _uncounted_kernels(model)
    if kernels:
        raise UncountedError("; ".join(f"attn_impl={k!r}: {UNCOUNTED_KERNELS[k]}" for k in kernels))
    if attn_pool_uncounted(model):
        raise UncountedError(ATTN_POOL_UNCOUNTED)
    p = next((p for p in model.parameters() if p.is_floating_point()), None)
    if example is None:
        example = example_input(model_data_config(model))
        if p is not None:
            example = example.to(device=p.device, dtype=p.dtype)
    count_cpu_attention()
    modes = {m: m.training for m in model.modules()}
    devices = [example.device] if example.device.type == "cuda" else []
    counter, custom = FlopCounterMode(display=False), _OpsWithoutFormula()
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad(), counter, custom:
            model.eval()
            model(example)
    finally:
        for m, training in modes.items():
            m.train(training)
    if custom.seen:
        raise UncountedError(f"{', '.join(sorted(custom.seen))}: a custom operator torch has no FLOP formula for")
    return int(counter.get_total_flops())


def run_gflops(model: nn.Module, example: Tensor | None = None, record: str = "metrics.json") -> float | None:
    """A run's ``gflops``: :func:`forward_flops` of ``model`` on ``example`` (default: at its nominal size), in units of
    10^9; None, said in one log line, where it cannot be counted (:class:`UncountedError`, or a forward that failed
    under the counter: a warning naming the error, so that the run's ``record`` is still written)."""
    try:
        return forward_flops(model, example) / 1e9
    except UncountedError as e:
        rank_zero_info(f"gflops not counted (null in {record}): {e}")
    except Exception as e:  # noqa: BLE001 - a run that trained keeps its record; the count's failure is said
        rank_zero_warn(f"gflops not counted (null in {record}): the forward under FlopCounterMode raised {e!r}")
    return None


def eval_gflops(model: torch.nn.Module, dm: Any, naflex_size: Sequence[int] | None = None) -> float | None:
    """``gflops`` of one forward of one sample at the size scored (:func:`~vitrel.train.flops.run_gflops`, as train.py's
    ``metrics.json`` counts it at the size trained): ``data.img_size`` (a video's ``data.num_frames``); NaFlex
    batches of images of one size: ``naflex_size``, the ``[H, W]`` they were scored at; of many sizes: one image at
    the model's nominal size."""
    from timm.layers import to_2tuple

    from vitrel.train.data_contract import is_video_data

    example = None
    packed = getattr(dm, "packing", None)
    size = naflex_size if packed else getattr(dm, "img_size", None)
    if size is not None:
        c, (h, w) = int(dm.in_chans), to_2tuple(size)
        example = torch.zeros(1, c, int(dm.num_frames), h, w) if is_video_data(dm) else torch.zeros(1, c, h, w)
        p = next((p for p in model.parameters() if p.is_floating_point()), None)
        example = example.to(device=p.device, dtype=p.dtype) if p is not None else example
    return run_gflops(model, example, record="eval_metrics.json")
