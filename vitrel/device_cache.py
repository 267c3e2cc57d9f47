"""Tensors that depend on integers and a device only (index tables, offsets, coordinates), made once and kept.

A training step calls every layer's position scheme and fused kernel with the same grid, and each rebuilt its
integer tensors every call: on a GPU each of those operators is a launch and its host work (about 17 us a call on
the H100 machine's host, ``bench/results/host_h100_68e2e96.md``), where eager steps of small models were bound by the
host. :func:`per_device` keeps them, where that is safe (:func:`keeps`).
"""

from __future__ import annotations

import functools

import torch


def keeps(device: torch.device) -> bool:
    """Whether a tensor made on ``device`` now may be kept for later calls (:func:`per_device`): on the CPU, and on
    CUDA on the device's default stream. CUDA graphs are captured, and ``torch.compile``'s CUDA graph trees warm up,
    on streams of their own whose allocations go to the graph's private pool, whose blocks the trees hand out again
    when they restore a recorded state: a tensor kept from there could be overwritten. There, each call makes its
    own (a captured graph replays that work anyway); a tensor made on the default stream is outside any graph's
    pool, and a graph reads it as it reads a parameter."""
    return device.type != "cuda" or torch.cuda.current_stream(device) == torch.cuda.default_stream(device)


def per_device(maxsize: int):
    """A function of hashable arguments (integers, dtypes) and, last, a device, whose tensors depend on nothing else:
    its results cached per arguments where :func:`keeps`, else made afresh; made outside inference mode (a tensor
    made under :func:`torch.inference_mode` could not be saved for a later training step's backward), and made afresh
    while ``torch.compile`` traces (the graph computes them, with symbolic sizes where it has them). Callers must not
    modify what it returns."""

    def deco(fn):
        def make(*args):
            with torch.inference_mode(False):
                return fn(*args)

        cached = functools.lru_cache(maxsize=maxsize)(make)

        @functools.wraps(fn)
        def get(*args):
            if torch.compiler.is_compiling():
                return fn(*args)
            device = args[-1]  # (None: the default device, which may change: not kept)
            return cached(*args) if device is not None and keeps(torch.device(device)) else make(*args)

        get.cache_info, get.cache_clear = cached.cache_info, cached.cache_clear
        return get

    return deco
