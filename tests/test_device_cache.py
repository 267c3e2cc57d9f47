"""vitrel.device_cache: integer-only tensors (index tables, offsets, coordinates) made once per arguments and device,
made outside inference mode, not kept for an unnamed device; and the schemes that keep theirs."""

from __future__ import annotations

import pytest
import torch

from vitrel import Attention, device_cache
from vitrel.device_cache import per_device


def test_kept_per_arguments_and_made_outside_inference_mode():
    made = []

    @per_device(maxsize=4)
    def offsets(n, device):
        made.append(n)
        return torch.arange(n, device=device)

    cpu = torch.device("cpu")
    with torch.inference_mode():
        first = offsets(3, cpu)
    assert not first.is_inference()  # (a later training step may save it for its backward)
    assert offsets(3, cpu) is first and made == [3]
    assert offsets(4, cpu) is not first and made == [3, 4]
    assert offsets(3, None) is not first and made == [3, 4, 3]  # (the default device may change: not kept)


def test_stream_asked_only_where_a_tensor_is_made(monkeypatch):
    """:func:`~vitrel.device_cache.keeps` (on CUDA: the current stream against the default one) is asked only where a
    tensor is made, not where a kept one is found; one made where it may not be kept is made again next time, and
    kept then if it may be; the least recently used goes past ``maxsize``."""
    asked, allowed, made = [], [False], []
    monkeypatch.setattr(device_cache, "keeps", lambda device: asked.append(device) or allowed[0])

    @per_device(maxsize=2)
    def offsets(n, device):
        made.append(n)
        return torch.arange(n, device=device)

    cpu = torch.device("cpu")
    first = offsets(3, cpu)  # (as on a graph's stream: not kept)
    assert offsets(3, cpu) is not first and made == [3, 3] and len(asked) == 2
    allowed[0] = True
    kept = offsets(3, cpu)
    assert [offsets(3, cpu) is kept for _ in range(5)] == [True] * 5 and len(asked) == 3 and made == [3, 3, 3]
    offsets(4, cpu), offsets(3, cpu), offsets(5, cpu)  # (3 used after 4: 4 goes)
    assert offsets.cache_info().currsize == 2 and offsets(3, cpu) is kept and made == [3, 3, 3, 4, 5]
    offsets(4, cpu)
    assert made == [3, 3, 3, 4, 5, 4] and offsets.cache_info().hits == 7
    offsets.cache_clear()
    assert offsets.cache_info() == (0, 0, 2, 0)


@pytest.mark.parametrize("name", ["rel2d_cpb", "fire2d", "rel2d_bucket", "rel1d_bucket"])
def test_scheme_called_in_inference_mode_then_trained(name):
    """A scheme's kept tensors made first under ``torch.inference_mode`` (an evaluation before training) serve a
    training step after it, whose backward saves them; and the table is the same either way."""
    torch.manual_seed(0)
    a = Attention(32, 2, pos=name, grid=(3, 4), num_prefix_tokens=1)
    x = torch.randn(2, 1 + 12, 32)
    with torch.inference_mode():
        evaluated = a.pos.offset_table(a.pos.grid).clone()
        a(x, grid=(3, 4))
    table = a.pos.offset_table(a.pos.grid)
    a(x.requires_grad_(), grid=(3, 4)).square().sum().backward()
    torch.testing.assert_close(table, evaluated, rtol=0, atol=0)
    assert all(p.grad is not None for p in a.pos.parameters())
