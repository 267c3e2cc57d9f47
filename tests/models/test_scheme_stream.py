"""A fair comparison of position schemes: with one seed, every layer outside the schemes starts alike whatever the
scheme, and the global generators are where ``pos=none`` leaves them (the dropout masks that follow alike); the schemes'
own parameters are still random, per block and per seed, with their init's spread (vitrel/pos/init_stream.py)."""

from __future__ import annotations

import pytest
import torch

import vitrel
from vitrel.pos.registry import parse_pos

VIT = ("vitrel_vit_tiny_patch4_32", dict(embed_dim=32, depth=2, num_heads=2))
SWIN = ("vitrel_swin_tiny_patch2_window4_32", dict(embed_dim=16, depths=[1, 1], num_heads=[2, 2]))
SCHEMES = ["rel2d_full", "rel2d_cpb", "rope2d_mixed", "ape", "shaw2d_factored", "fire2d"]


def _build(arch, pos, seed=0, **extra):
    name, kw = arch
    torch.manual_seed(seed)
    model = vitrel.create_model(name, pos=pos, num_classes=10, **kw, **extra)
    return model.state_dict(), torch.get_rng_state()


ARCHS = [(VIT, {}), (VIT, {"pos_share": True}), (SWIN, {})]


@pytest.mark.parametrize("arch,extra", ARCHS, ids=["vit", "share", "swin"])
def test_layers_outside_the_schemes_start_alike_whatever_the_scheme(arch, extra):
    ref, ref_rng = _build(arch, "none", **extra)
    for pos in SCHEMES:
        sd, rng = _build(arch, pos, **extra)
        assert set(ref) < set(sd), f"{pos}: keys of pos=none missing"
        diff = {k: (sd[k] - ref[k]).abs().max().item() for k in ref}
        assert max(diff.values()) == 0, f"{pos}: shared tensors differ from pos=none's: {diff}"
        assert torch.equal(rng, ref_rng), f"{pos}: the global generator is not where pos=none leaves it"


def test_scheme_parameters_random_per_block_and_seed_with_their_spread():
    a, _ = _build(VIT, "rel2d_full")
    b, _ = _build(VIT, "rel2d_full", seed=1)
    again, _ = _build(VIT, "rel2d_full")
    t0, t1 = a["blocks.0.attn.pos.table"], a["blocks.1.attn.pos.table"]
    assert torch.equal(t0, again["blocks.0.attn.pos.table"]), "one seed, one table"
    assert not torch.equal(t0, t1), "each block draws its own table"
    assert not torch.equal(t0, b["blocks.0.attn.pos.table"]), "another seed, another table"
    spec, sizes = parse_pos("rel2d_full"), dict(num_heads=16, head_dim=8, grid=(32, 32), num_prefix_tokens=1)
    torch.manual_seed(0)  # a large table (63 x 63 x 16): trunc-normal(0.02) as the class draws it by itself
    table = spec.build(**sizes).table
    torch.manual_seed(0)
    direct = spec.cls(**sizes).table  # (from the global generator)
    assert not torch.equal(table, direct)
    assert table.std().item() == pytest.approx(0.02, rel=0.02) == direct.std().item()
    assert abs(table.mean().item()) < 2e-4 and table.abs().max().item() < 0.12
