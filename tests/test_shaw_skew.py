"""The skew functional API of ``vitrel.pos.schemes.shaw1d`` against naive gathers and loops (float64).

``skew``/``unskew`` against their index definitions; ``shaw_attention`` against a loop reference of
``A_ij = (q_i . k_j + q_i . r^K[clip(j - i - o)]) * scale (+ causal mask)``,
``out_i = sum_j a_ij (v_j + r^V[clip(j - i - o)])`` for full, causal and cross attention, forward and
gradients, with offsets beyond ``clip_distance`` / the table checked to get the edge embedding.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from tests.reference import shaw_attention
from vitrel.pos.schemes.shaw1d import expand_table, offset_range, shaw_logits, shaw_values
from vitrel.pos.shaw_base import skew, unskew

torch.manual_seed(0)
DT = torch.float64


@pytest.mark.parametrize("n_q,n_k", list(itertools.product([1, 2, 4, 5], [1, 3, 5])))
def test_skew_unskew_match_naive(n_q, n_k):
    for length, shift in itertools.product([1, 3, n_q + n_k - 1, 9], range(-3, n_q + 4)):
        x = torch.randn(2, 3, n_q, length, dtype=DT)
        s = skew(x, n_k, shift)
        assert s.shape == (2, 3, n_q, n_k)
        a = torch.randn(2, 3, n_q, n_k, dtype=DT)
        p = unskew(a, length, shift)
        assert p.shape == (2, 3, n_q, length)
        ref_p = torch.zeros_like(p)
        for i in range(n_q):
            for j in range(n_k):
                m = j - i + shift
                if 0 <= m < length:
                    assert torch.equal(s[..., i, j], x[..., i, m]), (n_q, n_k, length, shift, i, j)
                    ref_p[..., i, m] += a[..., i, j]
        assert torch.equal(p, ref_p), (n_q, n_k, length, shift)


def test_skew_is_gather_when_all_offsets_present():
    """With ``L = n_q + n_k - 1`` and ``shift = n_q - 1`` every entry is valid: skew == gather."""
    n_q, n_k = 6, 4
    length = n_q + n_k - 1
    x = torch.randn(5, n_q, length, dtype=DT)
    idx = torch.arange(n_k)[None, :] - torch.arange(n_q)[:, None] + n_q - 1
    torch.testing.assert_close(skew(x, n_k, n_q - 1), x.gather(-1, idx.expand(5, n_q, n_k)), rtol=0, atol=0)
    # the adjoint identity <skew(x), a> == <x, unskew(a)>
    a = torch.randn(5, n_q, n_k, dtype=DT)
    torch.testing.assert_close((skew(x, n_k, n_q - 1) * a).sum(), (x * unskew(a, length, n_q - 1)).sum())


def test_skew_causal_memory_efficient_huang():
    """Causal self attention needs only ``L = n`` offsets (-(n-1)..0): the lower triangle is exact."""
    n = 5
    r_min, length = offset_range(n, n, 0, causal=True)
    assert (r_min, length) == (-(n - 1), n)
    x = torch.randn(n, length, dtype=DT)
    s = skew(x, n, n - 1)
    for i in range(n):
        for j in range(i + 1):
            assert s[i, j] == x[i, j - i + n - 1]


def naive_shaw(q, k, v, rel_k, rel_v, causal, clip_distance, q_offset, scale=None):
    """Loops straight from the equation."""
    n_q, d = q.shape[-2:]
    n_k = k.shape[-2]
    half = (rel_k.shape[0] - 1) // 2
    kc = half if clip_distance is None else clip_distance
    if q_offset is None:
        q_offset = n_k - n_q if causal else 0
    scale = 1 / math.sqrt(d) if scale is None else scale
    logit_rows, outs = [], []
    for i in range(n_q):
        row = []
        for j in range(n_k):
            r = max(-kc, min(kc, j - (i + q_offset))) + half
            val = ((q[..., i, :] * k[..., j, :]).sum(-1) + (q[..., i, :] * rel_k[r]).sum(-1)) * scale
            if causal and j > i + q_offset:
                val = torch.full_like(val, float("-inf"))
            row.append(val)
        logit_rows.append(torch.stack(row, -1))
    logits = torch.stack(logit_rows, -2)
    a = logits.softmax(-1)
    for i in range(n_q):
        o = 0
        for j in range(n_k):
            r = max(-kc, min(kc, j - (i + q_offset))) + half
            o = o + a[..., i, j, None] * (v[..., j, :] + rel_v[r])
        outs.append(o)
    return logits, torch.stack(outs, -2)


CASES = [
    # (n_q, n_k, causal, table half K, clip_distance, q_offset)
    (5, 5, False, 4, None, None),  # full self attention, every offset in the table
    (5, 5, True, 4, None, None),  # causal self attention
    (6, 6, False, 2, None, None),  # offsets beyond the table clamp to its edge
    (6, 6, True, 3, 1, None),  # causal, clipped at clip_distance < K
    (3, 7, False, 3, 2, None),  # cross, n_q < n_k
    (7, 3, False, 3, None, None),  # cross, n_q > n_k
    (3, 7, True, 5, None, None),  # causal cross: queries are the last 3 positions
    (4, 6, False, 4, 3, 2),  # explicit q_offset
    (4, 6, True, 6, None, 1),  # causal with an explicit q_offset
]


@pytest.mark.parametrize("n_q,n_k,causal,half,clip_distance,q_offset", CASES)
def test_shaw_attention_matches_naive(n_q, n_k, causal, half, clip_distance, q_offset):
    d = 4
    q = torch.randn(2, 2, n_q, d, dtype=DT, requires_grad=True)
    k = torch.randn(2, 2, n_k, d, dtype=DT, requires_grad=True)
    v = torch.randn(2, 2, n_k, d, dtype=DT, requires_grad=True)
    rel_k = torch.randn(2 * half + 1, d, dtype=DT, requires_grad=True)
    rel_v = torch.randn(2 * half + 1, d, dtype=DT, requires_grad=True)
    inputs = [q, k, v, rel_k, rel_v]
    kw = dict(causal=causal, clip_distance=clip_distance, q_offset=q_offset)
    ref_logits, ref = naive_shaw(*inputs, **kw)
    out = shaw_attention(*inputs, **kw)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    w = torch.randn_like(ref)
    ref_g = torch.autograd.grad((ref * w).sum(), inputs)
    got_g = torch.autograd.grad((out * w).sum(), inputs)
    for name, g, rg in zip("q k v rel_k rel_v".split(), got_g, ref_g):
        torch.testing.assert_close(g, rg, rtol=1e-10, atol=1e-12, msg=lambda s, name=name: f"grad {name}: {s}")
    # the content logit term alone, where it is defined (not the masked causal entries)
    qo = q_offset if q_offset is not None else (n_k - n_q if causal else 0)
    s = shaw_logits(q, rel_k, n_k, q_offset=qo, causal=causal, clip_distance=clip_distance)
    plain = q @ k.transpose(-2, -1) / math.sqrt(d)
    visible = torch.isfinite(ref_logits)
    torch.testing.assert_close((plain + s / math.sqrt(d))[visible], ref_logits[visible])


def test_gradcheck_tiny():
    q = torch.randn(1, 3, 2, dtype=DT, requires_grad=True)
    k = torch.randn(1, 4, 2, dtype=DT, requires_grad=True)
    v = torch.randn(1, 4, 2, dtype=DT, requires_grad=True)
    rk = torch.randn(5, 2, dtype=DT, requires_grad=True)
    rv = torch.randn(5, 2, dtype=DT, requires_grad=True)
    for causal in (False, True):
        assert torch.autograd.gradcheck(
            lambda *t, c=causal: shaw_attention(*t, causal=c, clip_distance=1), (q, k, v, rk, rv)
        )


def test_clipping_gives_edge_embedding():
    """Offsets with |r| > clip_distance use exactly the edge rows r^K[+-clip_distance]."""
    n, d, half, md = 7, 3, 4, 2
    table = torch.arange((2 * half + 1) * d, dtype=DT).reshape(2 * half + 1, d)  # distinct rows
    q = torch.eye(d, dtype=DT).repeat(n, 1)[:n]  # q_i picks one coordinate
    s = shaw_logits(q, table, n, clip_distance=md)
    for i in range(n):
        for j in range(n):
            r = j - i
            row = table[half + max(-md, min(md, r))]
            assert s[i, j] == q[i] @ row, (i, j)
            if r > md:
                assert s[i, j] == q[i] @ table[half + md]
            if r < -md:
                assert s[i, j] == q[i] @ table[half - md]
    e = expand_table(table, -6, 13, md)
    assert torch.equal(e[:4], table[half - md].expand(4, d)) and torch.equal(e[-4:], table[half + md].expand(4, d))
    # values: uniform weights over keys beyond the clip distance pick the edge value row only
    a = torch.zeros(1, n, dtype=DT)
    a[0, 5:] = 0.5  # offsets 5 and 6 from query 0, both beyond md
    torch.testing.assert_close(shaw_values(a, table, clip_distance=md)[0], table[half + md])


def test_errors():
    q = torch.randn(1, 4, 2)
    with pytest.raises(ValueError, match="clip_distance"):
        shaw_logits(q, torch.randn(5, 2), 4, clip_distance=3)
    with pytest.raises(ValueError, match="2K\\+1"):
        shaw_logits(q, torch.randn(4, 2), 4)
    with pytest.raises(ValueError, match="q_offset"):
        shaw_attention(q, q[:, :2], q[:, :2], torch.randn(5, 2), torch.randn(5, 2), causal=True)
    with pytest.raises(ValueError, match="match"):
        shaw_attention(q, q, q, torch.randn(5, 3), torch.randn(5, 2))
