"""``vitrel.from_irpe``: the iRPE authors' DeiT models (microsoft/Cream ``iRPE/DeiT-with-iRPE``, commit
12aed81: ``rpe_models.py``, ``rpe_vision_transformer.py``) as vitrel ViTs computing the same function. A checkpoint in
their layout is made here (timm's DeiT weights and the blocks' ``attn.rpe_*`` tables, random), and the reference is
timm's DeiT with each block's attention replaced by the authors' ``RPEAttention.forward``, rewritten in
``tests/pos/test_irpe.py``."""

from __future__ import annotations

import pytest
import timm
import torch

import vitrel
from tests.pos.test_irpe import authors_buckets, authors_term, authors_values
from vitrel.models.irpe_import import MODEL_ZOO, RELEASED

CASES = [
    "deit_tiny_patch16_224_ctx_product_50_shared_k",
    "deit_small_patch16_224_ctx_product_50_shared_qkv",
    "deit_small_patch16_224_ctx_cross_56_shared_k",
]


def authors_checkpoint(name: str, path) -> dict:
    """``{"model": state_dict}`` of ``name``: timm's DeiT (random, seeded) and random iRPE tables of the authors'
    shapes (one per block, shared by the heads; ``[1, head_dim, buckets]`` on q and k, ``[1, buckets, head_dim]``
    on v; cross: ``rp_rows`` and ``rp_cols``)."""
    deit, opts = RELEASED[name]
    torch.manual_seed(0)
    t = timm.create_model(deit, pretrained=False)
    sd = {k: v.double() for k, v in t.state_dict().items()}  # (float64: the comparison is exact to rounding)
    with torch.no_grad():
        sd["pos_embed"] = torch.randn_like(sd["pos_embed"]) * 0.1  # (timm's DeiT starts it small; a term to fold)
    ratio, method = opts.get("ratio", 1.9), opts.get("method", "product")
    side = 2 * int(2 * ratio) + 1
    nb = (side * side if method == "product" else side) + 1
    d = t.blocks[0].attn.head_dim
    for i in range(len(t.blocks)):
        for on in opts.get("rpe_on", "k"):
            shape = (1, nb, d) if on == "v" else (1, d, nb)
            parts = [".rp_rows", ".rp_cols"] if method == "cross" else [""]
            for part in parts:
                sd[f"blocks.{i}.attn.rpe_{on}{part}.lookup_table_weight"] = torch.randn(shape).double() * 0.5
    torch.save({"model": sd, "epoch": 299}, path)
    return sd


def authors_model(name: str, sd: dict) -> torch.nn.Module:
    """timm's DeiT with the weights, each block's attention the authors' ``RPEAttention.forward``."""
    deit, opts = RELEASED[name]
    ratio, method, on = opts.get("ratio", 1.9), opts.get("method", "product"), opts.get("rpe_on", "k")
    t = timm.create_model(deit, pretrained=False)
    t = t.double()
    t.load_state_dict({k: v for k, v in sd.items() if ".rpe_" not in k})
    t = t.eval()
    grid = (14, 14)

    def term(i: int, which: str, x: torch.Tensor) -> torch.Tensor:
        out = 0
        for part, meth in [(".rp_rows", "rows"), (".rp_cols", "cols")] if method == "cross" else [("", method)]:
            table = sd[f"blocks.{i}.attn.rpe_{which}{part}.lookup_table_weight"].double()
            ids = authors_buckets(meth, ratio, *grid, 1)
            out = out + (authors_values(x, table, ids) if which == "v" else authors_term(x, table, ids))
        return out

    def attention(i: int, a: torch.nn.Module):
        def forward(x: torch.Tensor, attn_mask=None, is_causal=False) -> torch.Tensor:
            b, n, c = x.shape
            q, k, v = a.qkv(x).reshape(b, n, 3, a.num_heads, c // a.num_heads).permute(2, 0, 3, 1, 4)
            q = q * a.scale
            attn = q @ k.transpose(-2, -1)
            if "k" in on:
                attn = attn + term(i, "k", q)
            if "q" in on:
                attn = attn + term(i, "q", k * a.scale).transpose(2, 3)
            attn = attn.softmax(-1)
            out = attn @ v
            if "v" in on:
                out = out + term(i, "v", attn)
            return a.proj(out.transpose(1, 2).reshape(b, n, c))

        return forward

    for i, blk in enumerate(t.blocks):
        blk.attn.forward = attention(i, blk.attn)
    return t


@pytest.mark.parametrize("name", CASES)
def test_a_released_model_is_the_same_function(name, tmp_path):
    path = tmp_path / f"{name}.pth"
    sd = authors_checkpoint(name, path)
    ours = vitrel.from_irpe(path).double().eval()
    ref = authors_model(name, sd)
    x = torch.randn(2, 3, 224, 224, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), rtol=1e-9, atol=1e-9)
    assert ours.vitrel_cfg["pos"]["name"] == "irpe" and ours.abs_pos is not None
    assert ours.pretrained_cfg["crop_pct"] == 0.875  # DeiT's evaluation (resize 256, crop 224)
    if name == CASES[0]:  # timm's backbone of the same network: its last block's map
        backbone = vitrel.from_irpe(path, features_only=True, out_indices=(11,)).double().eval()
        with torch.no_grad():
            (got,) = backbone(x)
            want = ours.forward_intermediates(x, indices=[11], intermediates_only=True)[0]
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_model_zoo_is_the_six_product_models_of_the_authors_readme():
    """The authors release weights for six of the nine models they define (their README's table): DeiT-Ti k, DeiT-S
    k / qk / qkv, DeiT-B k / qkv, all contextual product with 50 buckets."""
    zoo = {(RELEASED[n][0], RELEASED[n][1].get("rpe_on", "k")) for n in MODEL_ZOO}
    want = {("deit_tiny_patch16_224", "k"), ("deit_base_patch16_224", "k"), ("deit_base_patch16_224", "qkv")}
    assert zoo == want | {("deit_small_patch16_224", on) for on in ("k", "qk", "qkv")}
    assert all(RELEASED[n][1].get("method", "product") == "product" for n in MODEL_ZOO) and len(RELEASED) == 9


def test_refusals_name_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match="not one of the iRPE authors' models"):
        vitrel.from_irpe(tmp_path / "deit_small.pth")
    name = CASES[0]
    with pytest.raises(vitrel.CheckpointError, match="no such file"):
        vitrel.from_irpe(tmp_path / f"{name}.pth")
    sd = authors_checkpoint(name, tmp_path / "w.pth")
    torch.save({k: v for k, v in sd.items() if ".rpe_" not in k}, tmp_path / "plain.pth")
    with pytest.raises(vitrel.CheckpointError, match="holds no iRPE tables"):
        vitrel.from_irpe(tmp_path / "plain.pth", name)
    torch.save({"model": sd}, tmp_path / "small.pth")
    with pytest.raises(vitrel.CheckpointError, match="does not fit"):
        vitrel.from_irpe(tmp_path / "small.pth", "deit_small_patch16_224_ctx_product_50_shared_k")
    wrong = dict(sd)
    wrong["blocks.0.attn.rpe_k.lookup_table_weight"] = torch.zeros(1, 64, 82, dtype=torch.float64)
    torch.save({"model": wrong}, tmp_path / "tables.pth")
    with pytest.raises(vitrel.CheckpointError, match="are not those of"):
        vitrel.from_irpe(tmp_path / "tables.pth", name)
