"""attn_impl="shaw": Shaw's fast paths as a registered kernel, their query blocks sized by the device's memory, and
the widened SDPA (shaw2d_factored, PaPE) at a head dim SDPA's fused kernels take.

Each block size is checked against the dense float64 reference of tests/pos/test_shaw.py (forward and the gradients
of the input and every table); on CUDA (``-m cuda``), that the flash backend runs the widened shapes of the GPU pass
(PaPE's, float32 under autocast: the memory-efficient backend).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import vitrel.pos.shaw_base as shaw_base
from tests.pos.test_shaw import _check, make, window_mask
from vitrel import Attention
from vitrel.kernels import get_kernel, resolve
from vitrel.kernels.registry import select_kernel
from vitrel.layout.heads import FLASH_MAX_HEAD_DIM, sdpa_width
from vitrel.pos import PositionScheme, build_pos, list_pos

SHAW = ["shaw1d", "shaw2d_factored", "shaw2d_full"]
#: the schemes with content terms: Shaw's and iRPE's contextual mode
CONTENT = [*SHAW, "irpe"]
BLOCKED = ["shaw1d", "shaw2d_full"]


def test_shaw_is_a_kernel_and_auto_picks_it_for_content_schemes_only():
    """The schemes no longer override ``attend``: ``attn_impl="shaw"`` runs their fast path and is what ``auto`` picks
    for them (Shaw's and iRPE's), on the CPU and on any GPU; every other scheme is refused by it, and ``sdpa``
    refuses them."""
    for name in list_pos("relative"):
        s = build_pos(name, num_heads=2, head_dim=8, grid=(3, 4))
        for device in (None, "NVIDIA H200", "NVIDIA H100 80GB HBM3"):
            assert (select_kernel(s, 4096, device) == "shaw") == (name in CONTENT), (name, device)
        if name in CONTENT:
            assert type(s).attend is PositionScheme.attend, name
            assert resolve("auto", s, 13, None).name == "shaw"
            with pytest.raises(ValueError, match=f"no SDPA computes {name}'s content terms.*attn_impl='shaw'"):
                s.prepare((3, 4), 1, kernel=get_kernel("sdpa"))
        else:
            assert f"{s.name} has no such terms" in get_kernel("shaw").refuses(s)


@pytest.mark.parametrize("name", SHAW)
def test_shaw_kernel_runs_the_content_attention(name, monkeypatch):
    """``attn_impl="shaw"`` (and ``auto``) call the scheme's ``content_attention`` on a grid, equal to the reference."""
    calls = []
    cls = type(make(name, (3, 4), 1).pos)
    real = cls.content_attention
    monkeypatch.setattr(cls, "content_attention", lambda self, *a: calls.append(1) or real(self, *a))
    for impl in ("shaw", "auto"):
        _check(make(name, (3, 4), 1, attn_impl=impl), (3, 4))
        assert calls
        calls.clear()


def test_query_block_size_fits_the_memory():
    """The pure size choice: free memory, N, heads, head dim (and batch, element size) -> queries per block, the most
    whose temporaries (``ROW_TEMPORARIES`` rows of ``N`` and ``4 d`` per query, head and image) fit
    ``MEMORY_SHARE`` of the free memory; at least 1, at most N (the whole layer)."""

    def row(n, heads, d, batch, elem):
        return batch * heads * (shaw_base.ROW_TEMPORARIES * n + 4 * d) * elem

    size = shaw_base.query_block_size
    for n, heads, d, batch, elem in [
        (4096, 6, 64, 16, 2),
        (1024, 6, 64, 64, 2),
        (196, 12, 64, 334, 4),
        (21, 3, 8, 4, 8),
    ]:
        r = row(n, heads, d, batch, elem)
        share = shaw_base.MEMORY_SHARE
        assert size(0, n, heads, d, batch, elem) == 1
        assert size(int(n * r / share) + 1, n, heads, d, batch, elem) == n  # the whole layer fits
        assert size(10**15, n, heads, d, batch, elem) == n
        for c in (1, 7, n // 3, n - 1):
            free = math.ceil(c * r / share)
            got = size(free, n, heads, d, batch, elem)
            assert got == max(1, c), (n, c, got)  # the most that fits: c fits, c + 1 does not
            assert got * r <= share * free < (got + 1) * r
    # on an H200 (bf16, the GPU pass's layer: 65,536 tokens a batch): N = 1024 at once, N = 4096 in tiles
    free = 140 * 2**30
    assert size(free, 1024, 6, 64, 64, 2) == 1024
    assert 1024 < size(free, 4096, 6, 64, 16, 2) < 4096


def test_query_blocks_cpu_default_and_option(monkeypatch):
    """On the CPU the blocks stay as they were (about 0.4 head_dim queries, checkpointed); a scheme's
    ``block_queries`` wins on every device; on CUDA (its free memory faked here) the size of :func:`query_block_size`,
    not checkpointed when it is the whole layer."""
    q = torch.randn(2, 3, 50, 64)
    assert shaw_base.query_blocks(q, 50, None) == (25, True)
    assert shaw_base.query_blocks(q[..., :8], 50, None) == (3, True)
    assert shaw_base.query_blocks(q, 50, 7) == (7, True)
    monkeypatch.setattr(shaw_base, "_free_bytes", lambda device: 10**12)
    assert shaw_base.query_blocks(q, 50, None) == (50, False)
    assert shaw_base.query_blocks(q, 50, 7) == (7, True)
    monkeypatch.setattr(shaw_base, "_free_bytes", lambda device: 10**5)
    c = shaw_base.query_block_size(10**5, 50, 3, 64, 2, 4)
    assert 1 <= c < 50 and shaw_base.query_blocks(q, 50, None) == (c, True)


def _free_for(c: int, m: Attention, batch: int, n: int) -> int:
    """The free memory for which the blocks of ``m``'s queries (float64) hold ``c`` queries."""
    row = batch * m.num_heads * (shaw_base.ROW_TEMPORARIES * n + 4 * m.head_dim) * 8
    return math.ceil(c * row / shaw_base.MEMORY_SHARE)


@pytest.mark.parametrize("name", BLOCKED)
@pytest.mark.parametrize(("prefix", "block"), [(0, 4), (0, 20), (1, 1), (1, 9), (1, 21)])
def test_memory_sized_blocks_equal_reference(name, prefix, block, monkeypatch):
    """Every block size the memory can choose (a grid row or a token, a few rows, a short last block, the whole
    layer at once: then not checkpointed) gives the float64 reference's output and gradients, with a window mask;
    the free memory of a CUDA device faked on the CPU."""
    grid, nw = (5, 4), 2
    batch, n = 2 * nw, prefix + 20
    m = make(name, grid, prefix, **({"clip_distance": (3, 2)} if name == "shaw2d_full" else {"clip_distance": 6}))
    monkeypatch.setattr(shaw_base, "_free_bytes", lambda device: _free_for(block, m, batch, n))
    ckpt = []
    real = shaw_base.checkpoint
    monkeypatch.setattr(shaw_base, "checkpoint", lambda *a, **kw: ckpt.append(1) or real(*a, **kw))
    _check(m, grid, batch=batch, mask=window_mask(nw, n))
    unit = grid[1] if name == "shaw2d_full" else 1
    blocks = math.ceil(20 / unit / max(1, block // unit))
    whole = block >= n
    assert len(ckpt) == (0 if whole else blocks)  # checkpointed blocks (logits: the eager path)
    assert (blocks == 1) == (block >= 20 - (20 % unit))  # (the sizes above reach every case)


def test_sdpa_width_arithmetic():
    """The head dim of widened queries and keys: the next multiple of 8 (what the flash, cuDNN and memory-efficient
    kernels take without padding of their own); flash takes it up to 256."""
    assert [sdpa_width(w) for w in (1, 7, 8, 9, 64, 70, 92, 128, 129, 192, 216)] == [
        8, 8, 8, 16, 64, 72, 96, 128, 136, 192, 216]  # fmt: skip
    assert all(sdpa_width(w) % 8 == 0 and 0 <= sdpa_width(w) - w < 8 for w in range(1, 600))
    assert FLASH_MAX_HEAD_DIM == 256


#: (scheme, grid side, widened head dim) of the GPU pass's layer (dim 384, 6 heads of 64) at N = 196, 1024, 4096:
#: shaw2d_factored 64 + H + W, PaPE compact 64 + 6, PaPE-RI 64 + 5, PaPE with 50 parabolas 64 + 3 * 50 + 2
WIDENED = [
    ("shaw2d_factored", 14, 96),
    ("shaw2d_factored", 32, 128),
    ("shaw2d_factored", 64, 192),
    ("pape", 14, 72),
    ("pape", 64, 72),
    ("pape_ri", 32, 72),
    ({"name": "pape", "channels": "parabolas"}, 14, 216),
]


class _Sdpa:
    """Records the tensors of every ``F.scaled_dot_product_attention`` call."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = F.scaled_dot_product_attention

        def spy(q, k, v, attn_mask=None, dropout_p=0.0, **kw):
            self.calls.append((q, k, v, attn_mask, dropout_p))
            return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, **kw)

        monkeypatch.setattr(F, "scaled_dot_product_attention", spy)


@pytest.mark.parametrize(("pos", "side", "width"), WIDENED)
def test_widened_sdpa_head_dims(pos, side, width, monkeypatch):
    """The widened SDPA call of each scheme at the GPU pass's shapes: one head dim for q, k and v, the expected
    width, which flash takes (at most 256, a multiple of 8), and no mask (flash takes none)."""
    m = Attention(128, 2, pos=pos, grid=(side, side))  # heads of 64, as the GPU pass's
    sdpa = _Sdpa(monkeypatch)
    with torch.no_grad():
        m(torch.randn(1, side * side, 128), (side, side))
    assert len(sdpa.calls) == 1
    q, k, v, mask, _ = sdpa.calls[0]
    assert q.shape[-1] == k.shape[-1] == v.shape[-1] == width
    assert width % 8 == 0 and width <= FLASH_MAX_HEAD_DIM and mask is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("pos", "side", "width"), WIDENED)
def test_widened_sdpa_runs_on_flash_cuda(pos, side, width, monkeypatch):
    """On CUDA under bf16 autocast the widened call is one SDPA backends' check says flash takes
    (``torch.backends.cuda.can_use_flash_attention``, its reasons warned otherwise), and forward and backward run
    with flash the only backend allowed (``sdpa_kernel``: SDPA raises when flash cannot run it). PaPE's call runs in
    float32 there (its channels cancel in bf16, vitrel/pos/schemes/pape.py): the memory-efficient backend's, alone."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    m = Attention(384, 6, pos=pos, grid=(side, side)).cuda()
    x = torch.randn(2, side * side, 384, device="cuda", requires_grad=True)
    sdpa = _Sdpa(monkeypatch)
    bf16 = m.pos.name == "shaw2d_factored"
    backend = SDPBackend.FLASH_ATTENTION if bf16 else SDPBackend.EFFICIENT_ATTENTION
    with torch.autocast("cuda", dtype=torch.bfloat16), sdpa_kernel([backend]):
        y = m(x, (side, side))
    y.float().square().mean().backward()
    q, k, v, mask, p = sdpa.calls[0]
    assert q.dtype == v.dtype == (torch.bfloat16 if bf16 else torch.float32) and q.shape[-1] == width
    params = torch.backends.cuda.SDPAParams(q, k, v, mask, p, False, False)
    check = torch.backends.cuda.can_use_flash_attention if bf16 else torch.backends.cuda.can_use_efficient_attention
    assert check(params, debug=True)
