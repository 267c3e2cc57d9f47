"""Tensors that depend on integers and a device only (index tables, offsets, coordinates), made once and kept.

A training step calls every layer's position scheme and fused kernel with the same grid, and each rebuilt its
integer tensors every call: on a GPU each of those operators is a launch and its host work (about 17 us a call on
the H100 machine's host, ``bench/results/host_overhead_h100.md``), where eager steps of small models were bound by the
host. :func:`per_device` keeps them, where that is safe (:func:`keeps`).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import NamedTuple

import torch


def keeps(device: torch.device) -> bool:
    """Whether a tensor made on ``device`` now may be kept for later calls (:func:`per_device`): on the CPU, and on
    CUDA on the device's default stream. CUDA graphs are captured, and ``torch.compile``'s CUDA graph trees warm up,
    on streams of their own whose allocations go to the graph's private pool, whose blocks the trees hand out again
    when they restore a recorded state: a tensor kept from there could be overwritten. There, each call makes its
    own (a captured graph replays that work anyway); a tensor made on the default stream is outside any graph's
    pool, and a graph reads it as it reads a parameter."""
    return device.type != "cuda" or torch.cuda.current_stream(device) == torch.cuda.default_stream(device)


def capturing(device) -> bool:
    """Whether a CUDA graph is being captured on ``device``'s current stream (one call into CUDA, no stream objects)."""
    return torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()


class CacheInfo(NamedTuple):
    """:func:`per_device`'s counts, as :func:`functools.lru_cache`'s ``cache_info()``."""

    hits: int
    misses: int
    maxsize: int
    currsize: int


def per_device(maxsize: int):
    """A function of hashable arguments (integers, dtypes) and, last, a device, whose tensors depend on nothing else:
    its results cached per arguments (the ``maxsize`` used most recently), made outside inference mode (a tensor made
    under :func:`torch.inference_mode` could not be saved for a later training step's backward), and made afresh
    while ``torch.compile`` traces (the graph computes them, with symbolic sizes where it has them). Callers must not
    modify what it returns.

    A result is kept only where it was made on a stream that :func:`keeps`, and a result kept is returned without
    comparing streams, unless a CUDA graph is being captured (:func:`capturing`: a graph must not read a kept tensor,
    whose memory, once the cache drops it, could be handed out again while the graph still reads it; there each call
    makes its own, in the graph's pool). So a call that finds its tensors asks CUDA one cheap question: on the H100
    machine's host, each :func:`keeps` made two ``torch.cuda.Stream`` objects, and a fused-kernel call looked up
    eleven tensors (``bench/results/gpu_h100_vitb.md``'s profile: ``streams.py`` and ``_get_device_index`` 145 us
    of a 4,202 us profiled call)."""

    def deco(fn):
        def make(*args):
            with torch.inference_mode(False):
                return fn(*args)

        cache: OrderedDict = OrderedDict()
        counts = [0, 0]  # hits, misses

        @functools.wraps(fn)
        def get(*args):
            if torch.compiler.is_compiling():
                return fn(*args)
            device = args[-1]  # (None: the default device, which may change: not kept)
            if device is None or capturing(device):  # (a graph's: neither read nor kept, made in its pool)
                return make(*args)
            found = cache.get(args)
            if found is not None:
                counts[0] += 1
                cache.move_to_end(args)
                return found
            counts[1] += 1
            out = make(*args)
            if keeps(torch.device(device)):
                cache[args] = out
                if len(cache) > maxsize:
                    cache.popitem(last=False)
            return out

        get.cache_info = lambda: CacheInfo(counts[0], counts[1], maxsize, len(cache))

        def cache_clear():
            cache.clear()
            counts[:] = [0, 0]

        get.cache_clear = cache_clear
        return get

    return deco
