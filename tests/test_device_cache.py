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


def test_kept_tensor_not_read_into_a_captured_graph(monkeypatch):
    """While a CUDA graph is captured, a kept tensor is not returned (the cache may drop it later, and its memory be
    handed out again while the graph still reads it): the call makes its own, and the kept one serves again after."""
    monkeypatch.setattr(device_cache, "keeps", lambda device: True)
    capture = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capture[0])
    made = []

    @per_device(maxsize=2)
    def offsets(n, device):
        made.append(n)
        return torch.arange(n)  # (no CUDA here: the device is only the key)

    cuda = torch.device("cuda")
    kept = offsets(3, cuda)
    capture[0] = True
    assert offsets(3, cuda) is not kept and made == [3, 3]
    assert offsets(3, torch.device("cpu")) is not kept  # (a CPU tensor: no graph reads it; its own key)
    capture[0] = False
    assert offsets(3, cuda) is kept and made == [3, 3, 3]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU")
def test_kept_tensor_not_read_while_a_graph_is_captured():
    """The same under a real capture (``torch.cuda.graph``): the graph gets a tensor of its own."""

    @per_device(maxsize=2)
    def ones(n, device):
        return torch.ones(n, device=device)

    dev = torch.device("cuda")
    kept = ones(4, dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        inside = ones(4, dev)
    assert inside is not kept and ones(4, dev) is kept and ones.cache_info().currsize == 1


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
