"""timm's NaFlexVit (``naflexvit_*``) read by ``vitrel.from_timm``: the same function on image tensors of any size and
on NaFlex batches, against timm's model with the same (perturbed) weights, for each of its pretrained settings."""

from __future__ import annotations

import pytest
import timm
import torch
import torch.nn.functional as F
from timm.data.naflex_transforms import patchify_image

import vitrel
from vitrel.models.timm_import import UnsupportedTimmModel

SMALL = dict(embed_dim=64, depth=2, num_heads=2, num_classes=5, pos_embed_grid_size=(6, 6))
SOURCES = {  # name: (the vitrel scheme's options besides its table grid)
    "naflexvit_base_patch16_gap": {"name": "ape"},  # bicubic, 4 registers, no class token, avg pool under fc_norm
    "naflexvit_base_patch16_par_gap": {"name": "ape", "ar_preserving": True},
    "naflexvit_base_patch16_parfac_gap": {"name": "ape_factored", "ar_preserving": True},
    "naflexvit_base_patch16_siglip": {"name": "ape", "interp_mode": "bilinear"},  # SigLIP 2's attention pool
    "naflexvit_base_patch16_radio_v3": {  # C-RADIO v3: no final norm, 7 registers
        "name": "ape",
        "interp_mode": "bilinear",
        "antialias": False,
        "align_corners": True,
        "ar_preserving": True,
    },
}


def _timm(name: str, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    t = timm.create_model(name, **{**SMALL, **kw}).double().eval()
    with torch.no_grad():
        for p in t.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return t


def _naflex(sizes: list[tuple[int, int]], pad: int = 5) -> dict[str, torch.Tensor]:
    """timm's NaFlex dict of random images of ``sizes`` (16 px patches), each row padded to the longest plus ``pad``."""
    g = torch.Generator().manual_seed(3)
    rows = [patchify_image(torch.randn(3, h, w, dtype=torch.float64, generator=g), (16, 16)) for h, w in sizes]
    n = max(r[0].shape[0] for r in rows) + pad

    def stack(k: int) -> torch.Tensor:
        return torch.stack(
            [F.pad(r[k], (0, 0, 0, n - len(r[k])) if r[k].dim() == 2 else (0, n - len(r[k]))) for r in rows]
        )

    return {"patches": stack(0), "patch_coord": stack(1), "patch_valid": stack(2)}


@pytest.mark.parametrize("name", list(SOURCES))
def test_same_function_on_images_and_naflex_batches(name):
    t = _timm(name)
    m = vitrel.from_timm(t)
    assert m.vitrel_cfg["pos"] == "none"
    assert m.vitrel_cfg["abs_pos"] == {**SOURCES[name], "table_grid": [6, 6]}
    assert m.vitrel_cfg["img_size"] == [384, 384] if "radio" not in name else [512, 512]  # (the pretrained input)
    # timm resamples its table in float32: equal to that
    with torch.no_grad():
        for h, w in ((96, 96), (64, 64), (48, 112), (128, 32), (160, 160)):
            x = torch.randn(2, 3, h, w, dtype=torch.float64, generator=torch.Generator().manual_seed(h + w))
            torch.testing.assert_close(m(x), t(x), rtol=1e-6, atol=1e-6, msg=f"{h}x{w}")
        batch = _naflex([(64, 96), (112, 48), (96, 96)])
        torch.testing.assert_close(m(batch), t(batch), rtol=1e-6, atol=1e-6)
        # built at another input size the table stays on its own grid: the same function
        x = torch.randn(1, 3, 48, 80, dtype=torch.float64)
        torch.testing.assert_close(vitrel.from_timm(t, img_size=128)(x), t(x), rtol=1e-6, atol=1e-6)


def test_another_scheme_drops_the_embedding_and_says_so(caplog):
    t = _timm("naflexvit_base_patch16_gap")
    with caplog.at_level("INFO", logger="vitrel.models.timm_import"):
        m = vitrel.from_timm(t, pos="rope2d_axial")
    assert m.abs_pos is None and "dropped    embeds.pos_embed: absolute embedding" in caplog.text
    x = torch.randn(1, 3, 64, 64, dtype=torch.float64)
    assert (m(x) - t(x)).abs().max() > 1e-3  # (another function: RoPE in place of the embedding)
    with torch.no_grad():
        m.blocks[0].attn.qkv.weight.zero_()  # every block's tensors carried, not re-drawn
    assert torch.equal(m.blocks[1].attn.qkv.weight, t.blocks[1].attn.qkv.weight)


def test_abs_pos_naming_the_source_scheme_keeps_it_as_the_source_computes_it():
    """``abs_pos="ape"`` beside another scheme keeps a ViT's embedding; a NaFlexVit's keeps its table grid and
    resampling options too (the embedding equal to timm's on every grid), not a plain ape of the model's grid."""
    for name, spec in (
        ("naflexvit_base_patch16_radio_v3", "ape"),
        ("naflexvit_base_patch16_parfac_gap", "ape_factored"),
    ):
        t = _timm(name)
        m = vitrel.from_timm(t, pos="rope2d_axial", abs_pos=spec)
        assert m.vitrel_cfg["abs_pos"] == {**SOURCES[name], "table_grid": [6, 6]}
        with torch.no_grad():
            for g in ((5, 9), (12, 4)):
                ours = m.abs_pos.embed(g)
                theirs, _ = t.embeds(torch.zeros(1, 3, 16 * g[0], 16 * g[1], dtype=torch.float64))
                theirs = theirs[:, t.num_prefix_tokens :] - t.embeds.proj.bias
                torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_refused_settings_are_named():
    with pytest.raises(UnsupportedTimmModel, match="grid_sample"):
        vitrel.from_timm(_timm("naflexvit_base_patch16_gap", pos_embed_use_grid_sample=True))
    with pytest.raises(UnsupportedTimmModel, match="RoPE"):
        vitrel.from_timm(_timm("naflexvit_base_patch16_gap", rope_type="axial"))


def test_fine_tune_a_local_naflexvit_export_on_naflex_batches(tmp_path):
    """``train.py experiment=fmnist_naflex model.init_from=timm:<naflexvit> model.init_file=<folder>``: timm's files
    as written, packed batches of mixed sizes and aspect ratios; the checkpoint the run writes keeps the embedding's
    options."""
    from timm.models import save_for_hf

    from tests.train_helpers import FAST, compose
    from vitrel.train.run import train

    src = timm.create_model("naflexvit_base_patch16_par_gap", patch_size=4, in_chans=1, **{**SMALL, "depth": 1})
    save_for_hf(src, str(tmp_path / "timm_export"), safe_serialization=True)
    over = [
        "experiment=fmnist_naflex",
        "model.init_from=timm:naflexvit_base_patch16_par_gap",
        f"model.init_file={tmp_path / 'timm_export'}",
        "pos=rel2d_factored",
        "+model.abs_pos=ape",  # (the source's embedding kept, as it computes it)
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=2",
        "trainer.limit_val_batches=1",
        "trainer.limit_test_batches=1",
        "logger=none",
        *FAST,
    ]
    with pytest.warns(UserWarning, match="the architecture is naflexvit_base_patch16_par_gap's"):
        metrics = train(compose(tmp_path / "run", over))
    assert "test/acc1" in metrics
    m = vitrel.load_model(next((tmp_path / "run").rglob("last.ckpt")))
    assert (
        m.abs_pos.ar_preserving
        and tuple(m.abs_pos.table_grid) == (6, 6)
        and m.blocks[0].attn.pos.name == "rel2d_factored"
    )


@pytest.mark.parametrize("name", ["naflexvit_base_patch16_radio_v3", "naflexvit_base_patch16_parfac_gap"])
def test_exported_program_takes_every_aspect_ratio(name):
    """A ``torch.export`` program (``dynamic="hw"``) traced on a wide image equals timm on tall, wide and the table's
    own grid: the aspect-preserving resample has no branch on which side is longer."""
    from vitrel.export import export_program

    t = _timm(name, depth=1).float()
    m = vitrel.from_timm(t).eval()
    ep = export_program(m, torch.randn(2, 3, 64, 96))
    for h, w in ((64, 96), (128, 32), (96, 96), (48, 112)):
        x = torch.randn(2, 3, h, w)
        with torch.no_grad():
            torch.testing.assert_close(ep.module()(x), t(x), rtol=1e-5, atol=1e-5, msg=f"{h}x{w}")
