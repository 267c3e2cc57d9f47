"""Files written by vitrel 0.1.0 (commit 839c787, before the structure change) still load and compute
the same function (tests/fixtures/README.md says how they were made)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import vitrel
from vitrel.pos import build_pos

FIX = Path(__file__).parents[1] / "fixtures"


def test_v0_training_checkpoint_live_and_ema_weights():
    ref = torch.load(FIX / "v0_vit_rel2d_factored_ema_out.pt", weights_only=True)
    for use_ema, key in ((False, "logits"), (True, "ema_logits")):
        m = vitrel.load_model(FIX / "v0_vit_rel2d_factored_ema.ckpt", use_ema=use_ema).eval()
        assert m.rel_pos is not None and all(b.attn.pos is None for b in m.blocks)  # shared scheme
        with torch.no_grad():
            torch.testing.assert_close(m(ref["x"]), ref[key])


def test_v0_checkpoint_without_data_config_warns_once_where_it_loads():
    """A checkpoint written before vitrel stored its data config: ``vitrel.load_model`` and timm's overlay route
    (``pretrained_cfg_overlay=dict(file=...)``) gave the architecture's default statistics (CIFAR's) in the model's
    ``pretrained_cfg`` without a word (``predict.py`` and the exports warned). One warning each now, naming the
    statistics, attributed to the caller's line."""
    import timm

    from vitrel.models.data_config import NoDataConfigWarning

    path = FIX / "v0_vit_rel2d_factored_ema.ckpt"
    for load in (
        lambda: vitrel.load_model(path),
        lambda: timm.create_model("vitrel_vit_tiny_patch4_32", pretrained=True, pretrained_cfg_overlay={"file": path}),
    ):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            load()
        said = [w for w in caught if w.category is NoDataConfigWarning]
        assert len(said) == 1 and said[0].filename == __file__, [(w.filename, str(w.message)) for w in caught]
        assert "stores no data config" in str(said[0].message) and "mean [0.47336" in str(said[0].message)


def test_v0_export_folder():
    ref = torch.load(FIX / "v0_swin_shaw2d_factored_out.pt", weights_only=True)
    m = vitrel.load_model(FIX / "v0_swin_shaw2d_factored").eval()
    with torch.no_grad():
        torch.testing.assert_close(m(ref["x"]), ref["logits"])


@pytest.mark.parametrize("name", ["shaw1d", "shaw2d_factored", "shaw2d_full"])
def test_old_option_name_max_distance_still_builds(name):
    """Configs written before the Shaw option became ``clip_distance`` (e.g. a checkpoint's stored pos)."""
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        old = build_pos({"name": name, "max_distance": 1}, num_heads=2, head_dim=8, grid=(3, 4))
    assert any("clip_distance" in str(x.message) for x in w)
    new = build_pos({"name": name, "clip_distance": 1}, num_heads=2, head_dim=8, grid=(3, 4))
    assert {k: v.shape for k, v in old.state_dict().items()} == {k: v.shape for k, v in new.state_dict().items()}
    with pytest.raises(ValueError, match="give clip_distance only"):
        build_pos({"name": name, "max_distance": 1, "clip_distance": 2}, num_heads=2, head_dim=8, grid=(3, 4))
