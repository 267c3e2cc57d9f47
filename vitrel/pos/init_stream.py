"""A position scheme's initial draws from a random stream of its own (:func:`own_stream`).

A model builds its schemes between its other layers (a ViT builds each block's scheme inside the block). Were the
schemes' tables and frequencies drawn from torch's global generator, a scheme with parameters would move every draw
after it, so two runs of one seed with two schemes would start from different patch embeddings, blocks and heads, and
draw other dropout masks. Built under :func:`own_stream`, a scheme draws from a generator seeded from the global
generator's state, which it reads and leaves as it was: every layer outside the schemes starts as it does with
``pos=none``, whatever the scheme (``tests/models/test_scheme_stream.py``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["own_stream"]


@contextmanager
def own_stream(salt: str) -> Iterator[None]:
    """Draws inside come from the CPU generator (and, when the default device -- the one the scheme's tensors are made
    on -- is an accelerator, that device's generator) seeded from a hash of their states and ``salt`` (the scheme's
    kind and layer); the generators are back in their states at the exit, as if nothing had been drawn.
    Deterministic: the same global seed and the same draws before give the same scheme."""
    device = torch.get_default_device()
    accel = torch.get_device_module(device.type) if device.type not in ("cpu", "meta") else None
    h = hashlib.blake2b(torch.get_rng_state().numpy().tobytes(), digest_size=8)
    if accel is not None:
        h.update(accel.get_rng_state(device).numpy().tobytes())
    h.update(salt.encode())
    seed = int.from_bytes(h.digest(), "little") >> 1  # (a generator's seed: below 2**63)
    with torch.random.fork_rng(devices=[device] if accel else [], device_type=device.type if accel else None):
        torch.default_generator.manual_seed(seed)
        if accel is not None:
            accel.set_rng_state(torch.Generator(device).manual_seed(seed).get_state(), device)
        yield
