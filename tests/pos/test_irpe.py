"""iRPE (vitrel/pos/schemes/irpe.py) against the equations, the authors' code and their released configurations.

Authors' code: github.com/microsoft/Cream, commit 12aed81bb10a7b678c700dabd28d71b27f1d8830,
``iRPE/DeiT-with-iRPE/irpe.py`` (``piecewise_index``, ``_rp_2d_*``, ``get_bucket_ids_2d``, ``iRPE`` and
``iRPE_Cross``, ``get_rpe_config``), ``rpe_vision_transformer.py`` (``RPEAttention.forward``) and ``rpe_models.py``
(the released models' configurations). Their steps are rewritten below in float64 (the buckets in float32, as theirs).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import vitrel
from tests.reference import coords, scheme_qkv
from vitrel import Attention
from vitrel.pos.schemes.irpe import bucket_ids, piecewise_index

DIM, HEADS = 16, 2
D = DIM // HEADS
METHOD_RATIO = {"product": 1.9, "euc": 2.5, "quant": 3.0, "cross": 1.9}  # small ratios: every piece on small grids


def layer(name: str, grid, prefix: int, seed: int = 0, **opts) -> Attention:
    torch.manual_seed(seed)
    a = Attention(DIM, HEADS, pos={"name": name, **opts}, grid=grid, num_prefix_tokens=prefix).double()
    with torch.no_grad():
        for t in a.pos.parameters():
            t.normal_(0.0, 0.7)
    return a


def tokens(grid, prefix: int, seed: int = 1) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(2, prefix + grid[0] * grid[1], DIM, dtype=torch.float64, requires_grad=True)


# ------------------------------------------------------------------------ (1) naive float64 reference
def g(x: float, ratio: float) -> int:
    """The paper's Eq. 18, one number at a time: ``x`` within ``alpha`` kept; beyond, log-spaced up to ``beta``."""
    alpha, beta, gamma = ratio, 2 * ratio, 8 * ratio
    if abs(x) <= alpha:
        return round(x)
    far = round(alpha + math.log(abs(x) / alpha) / math.log(gamma / alpha) * (beta - alpha))
    return int(math.copysign(min(far, int(beta)), x))


def bucket(method: str, ratio: float, pi, pj) -> int:
    """The bucket of the pair (query at ``pi``, key at ``pj``), ``d = pi - pj``."""
    big = int(2 * ratio)
    dh, dw = pi[0] - pj[0], pi[1] - pj[1]
    if method == "product":
        return (g(dh, ratio) + big) * (2 * big + 1) + g(dw, ratio) + big
    if method == "euc":
        return g(round(math.sqrt(dh * dh + dw * dw)), ratio) + big
    if method == "quant":
        return g(dh * dh + dw * dw, ratio) + big
    return g(dh if method == "rows" else dw, ratio) + big


def tables(a: Attention, t: str) -> list[tuple[str, torch.Tensor]]:
    """``(method, table)`` of the term on ``t`` (cross: the rows' and the columns' tables)."""
    m, mod = a.pos.method, getattr(a.pos, f"rpe_{t}")
    parts = [("rows", mod.rp_rows), ("cols", mod.rp_cols)] if m == "cross" else [(m, mod)]
    return [(meth, next(p for p in part.parameters())) for meth, part in parts]


def encoding(a: Attention, t: str, pi, pj, head: int, prefix_pair: bool) -> torch.Tensor:
    """``r[b(i, j)]`` of the term on ``t`` for head ``head`` (summed over cross's two tables): the table's extra last
    bucket for a pair with a prefix token (zero when the table has none)."""
    out = 0
    for meth, table in tables(a, t):
        tab = table[head if table.shape[0] > 1 else 0]  # [d, nb] (q, k), [nb, d] (v) or [nb] (bias)
        width = tab.shape[-1] if t != "v" else tab.shape[0]
        nb_patch = (2 * int(2 * a.pos.ratio) + 1) ** (2 if meth == "product" else 1)
        if prefix_pair:
            if width == nb_patch:
                continue
            b = nb_patch
        else:
            b = bucket(meth, a.pos.ratio, pi, pj)
        out = out + (tab[b] if t == "v" else tab[..., b])
    return out if torch.is_tensor(out) else torch.zeros(D if a.pos.mode != "bias" else (), dtype=torch.float64)


def reference(a: Attention, x: torch.Tensor, grid, prefix: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The paper's equations, one pair at a time: logits ``[B, heads, N, N]`` and the layer's output."""
    q, k, v = scheme_qkv(a, x, grid)
    b, heads, n, d = q.shape
    pts = [None] * prefix + coords(*grid)
    on, bias_mode = a.pos.rpe_on, a.pos.mode == "bias"
    rows = []
    for i in range(n):
        row = []
        for j in range(n):
            pre = i < prefix or j < prefix
            cell = []
            for h in range(heads):
                s = (q[:, h, i] * k[:, h, j]).sum(-1)
                extra = 0
                if "k" in on:
                    rk = encoding(a, "k", pts[i], pts[j], h, pre)
                    extra = extra + (rk if bias_mode else (q[:, h, i] * rk).sum(-1))
                if "q" in on:
                    rq = encoding(a, "q", pts[j], pts[i], h, pre)  # b(j, i)
                    extra = extra + (rq if bias_mode else (k[:, h, j] * rq).sum(-1))
                cell.append(s / math.sqrt(d) + extra if bias_mode else (s + extra) / math.sqrt(d))
            row.append(torch.stack([c.expand(b) if c.dim() == 0 else c for c in cell], 1))
        rows.append(torch.stack(row, -1))
    logits = torch.stack(rows, -2)  # [B, heads, N, N]
    attn = logits.softmax(-1)
    out = attn @ v
    if "v" in on:
        rv = torch.stack(
            [
                torch.stack(
                    [
                        torch.stack([encoding(a, "v", pts[i], pts[j], h, i < prefix or j < prefix) for j in range(n)])
                        for i in range(n)
                    ]
                )
                for h in range(heads)
            ]
        )  # [heads, N, N, d]
        out = out + torch.einsum("bhij,hijd->bhid", attn, rv)
    y = a.proj(out.transpose(1, 2).reshape(b, n, heads * d))
    return logits, y


CASES = [
    ("irpe", {"method": "product", "rpe_on": "k"}),
    ("irpe", {"method": "product", "rpe_on": "qkv"}),
    ("irpe", {"method": "euc", "rpe_on": "qv", "shared_head": False}),
    ("irpe", {"method": "quant", "rpe_on": "kv"}),
    ("irpe", {"method": "cross", "rpe_on": "qkv", "shared_head": False}),
    ("irpe", {"method": "cross", "rpe_on": "qk", "shared_head": False}),
    ("irpe_bias", {"method": "product", "rpe_on": "qk", "shared_head": False}),
    ("irpe_bias", {"method": "cross", "rpe_on": "q"}),
]


def _params(opts):
    return {**opts, "ratio": METHOD_RATIO[opts["method"]]}


@pytest.mark.parametrize("grid,prefix", [((3, 4), 1), ((5, 3), 0), ((4, 4), 2)])
@pytest.mark.parametrize("name,opts", CASES, ids=[f"{n}-{o['method']}-{o['rpe_on']}" for n, o in CASES])
def test_logits_forward_and_gradients_equal_the_equations(name, opts, grid, prefix):
    a = layer(name, grid, prefix, **_params(opts))
    x = tokens(grid, prefix)
    want_logits, want = reference(a, x, grid, prefix)
    torch.testing.assert_close(a.logits(x, grid), want_logits, rtol=1e-10, atol=1e-10)
    got = a(x, grid)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    params = [x, *a.pos.parameters()]
    g_got = torch.autograd.grad(got.square().sum(), params)
    g_want = torch.autograd.grad(want.square().sum(), params)
    for u, w in zip(g_got, g_want):
        torch.testing.assert_close(u, w, rtol=1e-9, atol=1e-10)


def test_a_scheme_built_without_prefix_gives_their_pairs_no_term():
    """Called with a class token it has no bucket for: the pairs with it get zero terms (every vitrel scheme's rule)."""
    from vitrel.pos.registry import build_pos

    torch.manual_seed(0)
    scheme = build_pos({"name": "irpe", "rpe_on": "qkv", "init_std": 0.7}, num_heads=HEADS, head_dim=D, grid=(3, 3))
    a = Attention(DIM, HEADS, pos=scheme, grid=(3, 3), num_prefix_tokens=1).double()
    assert a.pos.rpe_k.lookup_table_weight.shape[-1] == 49  # no bucket for the class token's pairs
    x = tokens((3, 3), 1)
    _, want = reference(a, x, (3, 3), 1)
    torch.testing.assert_close(a(x, (3, 3)), want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("ratio", [1.9, 2.5, 3.0, 20.0, 33.0])
def test_the_piecewise_index_is_eq_18(ratio):
    x = torch.arange(-3000, 3001)
    want = torch.tensor([g(float(v), ratio) for v in x.tolist()])
    assert torch.equal(piecewise_index(x, ratio, 2 * ratio, 8 * ratio), want)
    assert piecewise_index(x, ratio, 2 * ratio, 8 * ratio).abs().max() == int(2 * ratio)


# ------------------------------------------------------------------------ (2) the authors' code, rewritten
def authors_index(rel: torch.Tensor, alpha: float, beta: float, gamma: float) -> torch.Tensor:
    """``piecewise_index``: the far part ``sign * clip(round(alpha + log(|x| / alpha) / log(gamma / alpha) * (beta -
    alpha)), max=beta)`` in float32, cast to long (towards zero); within ``alpha`` the offset itself (rounded)."""
    absolute = rel.abs()
    near = absolute <= alpha
    idx = rel.clone()
    if idx.is_floating_point():
        idx = idx.round().long()
    far = absolute[~near] / alpha
    val = (alpha + torch.log(far) / math.log(gamma / alpha) * (beta - alpha)).round().clip(max=beta)
    idx[~near] = (torch.sign(rel[~near]) * val).long()
    return idx


def authors_buckets(method: str, ratio: float, h: int, w: int, skip: int) -> torch.Tensor:
    """``get_bucket_ids_2d``: positions ``stack(rows, cols)``, ``diff = pos1 - pos2`` (query minus key), the method's
    index, ``+ beta_int`` (product: ``r * S + c`` of the shifted indices), then ``skip`` leading rows and columns of
    one extra bucket."""
    alpha, beta, gamma = ratio, 2 * ratio, 8 * ratio
    bi = int(beta)
    rows = torch.arange(h).view(h, 1).repeat(1, w)
    cols = torch.arange(w).view(1, w).repeat(h, 1)
    pos = torch.stack([rows, cols], 2).view(h * w, 1, 2)
    diff = pos - pos.view(1, h * w, 2)
    if method == "product":
        r = authors_index(diff[:, :, 0], alpha, beta, gamma) + bi
        c = authors_index(diff[:, :, 1], alpha, beta, gamma) + bi
        ids, nb = r * (2 * bi + 1) + c, (2 * bi + 1) ** 2
    else:
        dis = {
            "euc": lambda: diff.square().sum(2).float().sqrt().round(),
            "quant": lambda: diff.square().sum(2),
            "rows": lambda: diff[:, :, 0],
            "cols": lambda: diff[:, :, 1],
        }[method]()
        ids, nb = authors_index(dis, alpha, beta, gamma) + bi, 2 * bi + 1
    if skip:
        full = torch.full((skip + h * w, skip + h * w), nb, dtype=ids.dtype)
        full[skip:, skip:] = ids
        ids = full
    return ids


def authors_term(x: torch.Tensor, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``iRPE.forward_rpe_transpose`` in contextual mode: ``x @ lookup_table_weight`` per head ``[B, H, L, nb]``
    (the table broadcast when shared), read at each pair's bucket through the flattened buffer."""
    b, heads, n, d = x.shape
    lookup = torch.matmul(x.transpose(0, 1).reshape(-1, b * n, d), table).view(-1, b, n, table.shape[-1])
    lookup = lookup.transpose(0, 1)
    flat = (ids + torch.arange(0, n * table.shape[-1], table.shape[-1]).view(-1, 1)).flatten()
    return lookup.flatten(2)[:, :, flat].view(b, -1, n, n)


def authors_values(attn: torch.Tensor, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``iRPE.forward_rpe_no_transpose``: the table read at every pair ``[H, L, L, d]``, then ``attn @`` it by query."""
    heads = table.shape[0]
    n = ids.shape[0]
    weight = table[:, ids.flatten()].view(heads, n, n, -1)
    return torch.matmul(attn.permute(1, 2, 0, 3), weight).permute(2, 0, 1, 3)


def authors_module(a: Attention, t: str, x: torch.Tensor, grid, skip: int) -> torch.Tensor:
    mod = getattr(a.pos, f"rpe_{t}")
    parts = [("rows", mod.rp_rows), ("cols", mod.rp_cols)] if a.pos.method == "cross" else [(a.pos.method, mod)]
    out = 0
    for meth, part in parts:
        ids = authors_buckets(meth, a.pos.ratio, *grid, skip)
        if a.pos.mode == "bias":
            tb = part.lookup_table_bias
            out = out + tb[:, ids.flatten()].view(1, tb.shape[0], *ids.shape)
        elif t == "v":
            out = out + authors_values(x, part.lookup_table_weight, ids)
        else:
            out = out + authors_term(x, part.lookup_table_weight, ids)
    return out


def authors_attention(a: Attention, x: torch.Tensor, grid, skip: int) -> torch.Tensor:
    """``RPEAttention.forward``: ``q *= scale``; ``attn = q k^T + rpe_k(q) + rpe_q(k * scale)^T``; softmax;
    ``out = attn v + rpe_v(attn)``; the projection."""
    q, k, v = scheme_qkv(a, x, grid)
    scale = a.head_dim**-0.5
    q = q * scale
    attn = q @ k.transpose(-2, -1)
    if "k" in a.pos.rpe_on:
        attn = attn + authors_module(a, "k", q, grid, skip)
    if "q" in a.pos.rpe_on:
        attn = attn + authors_module(a, "q", k * scale, grid, skip).transpose(2, 3)
    attn = attn.softmax(-1)
    out = attn @ v
    if "v" in a.pos.rpe_on:
        out = out + authors_module(a, "v", attn, grid, skip)
    b, _, n, _ = q.shape
    return a.proj(out.transpose(1, 2).reshape(b, n, -1))


@pytest.mark.parametrize("grid", [(4, 5), (14, 14)])
@pytest.mark.parametrize("method", ["product", "euc", "quant", "rows", "cols"])
@pytest.mark.parametrize("ratio", [1.9, 20.0, 33.0])
def test_buckets_are_the_authors(method, ratio, grid):
    for skip in (0, 1):
        want = authors_buckets(method, ratio, *grid, skip)
        assert torch.equal(bucket_ids(method, ratio, *grid, skip, torch.device("cpu")), want)


@pytest.mark.parametrize("name,opts", CASES, ids=[f"{n}-{o['method']}-{o['rpe_on']}" for n, o in CASES])
def test_equals_the_authors_attention(name, opts):
    grid = (4, 3)
    a = layer(name, grid, 1, **_params(opts))
    x = tokens(grid, 1)
    want = authors_attention(a, x, grid, skip=1)
    got = a(x, grid)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    params = [x, *a.pos.parameters()]
    for u, w in zip(torch.autograd.grad(got.sum(), params), torch.autograd.grad(want.sum(), params)):
        torch.testing.assert_close(u, w, rtol=1e-9, atol=1e-10)


#: DeiT-S models of rpe_models.py: (ratio, method, rpe_on) and the buckets of each table (their skip=1: +1)
RELEASED = {
    "deit_small_patch16_224_ctx_product_50_shared_k": (1.9, "product", "k", 50),
    "deit_small_patch16_224_ctx_product_50_shared_qk": (1.9, "product", "qk", 50),
    "deit_small_patch16_224_ctx_product_50_shared_qkv": (1.9, "product", "qkv", 50),
    "deit_small_patch16_224_ctx_euc_20_shared_k": (20, "euc", "k", 82),
    "deit_small_patch16_224_ctx_quant_51_shared_k": (33, "quant", "k", 134),
    "deit_small_patch16_224_ctx_cross_56_shared_k": (20, "cross", "k", 82),
}


@pytest.mark.parametrize("model", list(RELEASED))
def test_the_authors_configurations_build_the_authors_tables(model):
    """DeiT-S (6 heads of 64, a class token) with each released configuration: one table per block, shared by the
    heads, of the authors' shape, starting at zero. The default options are the first (their DeiT-Ti/S/B ``_k``)."""
    ratio, method, on, nb = RELEASED[model]
    pos = {"name": "irpe", "ratio": ratio, "method": method, "rpe_on": on}
    m = vitrel.create_model("vitrel_vit_small_patch16_224", pos=pos, num_classes=10)
    shapes = {n.split("attn.pos.")[1]: tuple(t.shape) for n, t in m.named_parameters() if "blocks.0.attn.pos." in n}
    want = {}
    for t in on:
        shape = (1, nb, 64) if t == "v" else (1, 64, nb)
        keys = [f"rpe_{t}.rp_rows.", f"rpe_{t}.rp_cols."] if method == "cross" else [f"rpe_{t}."]
        want.update({f"{key}lookup_table_weight": shape for key in keys})
    assert shapes == want
    assert all(not t.any() for n, t in m.named_parameters() if ".attn.pos." in n)
    assert len({n.split(".attn.")[0] for n, _ in m.named_parameters() if ".attn.pos." in n}) == 12


def test_defaults_are_the_authors_first_release():
    from vitrel.pos.registry import parse_pos

    spec = parse_pos("irpe")
    s = spec.build(num_heads=6, head_dim=64, grid=(14, 14), num_prefix_tokens=1)
    assert (s.method, s.ratio, s.rpe_on, s.shared_head) == ("product", 1.9, "k", True)
    assert tuple(s.rpe_k.lookup_table_weight.shape) == (1, 64, 50)


@pytest.mark.parametrize(
    "name,opts,match",
    [
        ("irpe", {"method": "bucket"}, "method must be one of product, euc, quant, cross"),
        ("irpe", {"rpe_on": "kx"}, "rpe_on must be letters of 'qkv'"),
        ("irpe", {"rpe_on": "kk"}, "each once"),
        ("irpe_bias", {"rpe_on": "kv"}, "bias mode has no term on values: use pos=irpe"),
        ("irpe", {"ratio": 0.5}, "ratio must be >= 1"),
        ("irpe", {"init_std": 0.0}, "init_std"),
    ],
)
def test_bad_options_are_refused_by_name(name, opts, match):
    with pytest.raises(ValueError, match=match):
        Attention(DIM, HEADS, pos={"name": name, **opts}, grid=(3, 3), num_prefix_tokens=1)


def test_a_vit_trains_with_every_term():
    """A step of a ViT with iRPE on q, k and v moves every table (their gradients reach them through the model)."""
    torch.manual_seed(0)
    m = vitrel.create_model("vitrel_vit_tiny_patch4_32", pos={"name": "irpe", "rpe_on": "qkv"}, num_classes=10)
    F.cross_entropy(m(torch.randn(2, 3, 32, 32)), torch.tensor([1, 2])).backward()
    grads = {n: t.grad for n, t in m.named_parameters() if ".attn.pos." in n}
    assert grads and all(gr is not None and gr.abs().sum() > 0 for gr in grads.values())


@pytest.mark.parametrize("name,opts", [("irpe", {"rpe_on": "qkv"}), ("irpe_bias", {"rpe_on": "qk", "method": "cross"})])
def test_packed_images_each_get_their_own_terms(name, opts):
    """A NaFlex row packing images of three sizes gives each the logits it gets alone (the terms on queries, keys and
    values computed per image on its own grid), the tables random (the default zeros would hide a wrong term)."""
    from tests.layout.test_tokens import alone, images
    from tests.naflex_inputs import packed

    torch.manual_seed(0)
    pos = {"name": name, **opts, "init_std": 0.5}
    m = vitrel.create_model(
        "vitrel_vit_tiny_patch4_32", pos=pos, img_size=16, num_classes=5, depth=2, embed_dim=64, num_heads=4
    )
    m = m.double().eval()
    imgs = images()
    with torch.no_grad():
        torch.testing.assert_close(m(packed(imgs)), alone(m, imgs), rtol=0, atol=1e-10)
