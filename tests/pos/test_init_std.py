"""A learned table's ``init_std`` (``pos.init_std=``): a negative or zero one is refused by name, for every scheme that
takes the option; a checkpoint written when a negative one was taken still loads."""

from __future__ import annotations

import pytest
import torch

import vitrel
from tests.weights import reloaded_as_written
from vitrel.pos.registry import get_pos_class, list_pos, parse_pos, scheme_options

TAKES_INIT_STD = [n for n in list_pos() if "init_std" in scheme_options(get_pos_class(n))]
VIDEO = {n for n in TAKES_INIT_STD if get_pos_class(n).grid_dims == 3}


def _build(name: str, **options):
    grid = (2, 3, 4) if name in VIDEO else (3, 4)
    return parse_pos({"name": name, **options}).build(num_heads=2, head_dim=8, grid=grid, embed_dim=16)


def test_the_learned_tables_are_covered():
    assert {"rel2d_full", "rel2d_factored", "rel3d_full", "shaw2d_full", "shaw1d", "rel2d_bucket", "ape"} <= set(
        TAKES_INIT_STD
    )


@pytest.mark.parametrize("name", TAKES_INIT_STD)
@pytest.mark.parametrize("std", [-0.02, 0.0])
def test_an_init_std_not_positive_is_refused_naming_the_scheme(name, std):
    with pytest.raises(ValueError, match=rf"{name}: init_std .*{std}"):
        _build(name, init_std=std)


def test_a_negative_init_std_is_refused_by_create_model():
    with pytest.raises(
        ValueError, match=r"rel2d_full: init_std is the spread of the table's initial values, > 0; got -0.02"
    ):
        vitrel.create_model("vitrel_vit_tiny_patch4_32", pos={"name": "rel2d_full", "init_std": -0.02})


def test_a_checkpoint_written_with_a_negative_init_std_loads(tmp_path):
    """Before ``vitrel_format`` 7 a negative ``init_std`` was taken: a stored spec drops it (it only set the initial
    values, which the stored weights replace), and the model loads with its weights."""
    torch.manual_seed(0)
    model = vitrel.create_model("vitrel_vit_tiny_patch4_32", pos="rel2d_full").eval()
    pos = {"name": "rel2d_full", "init_std": -0.02, "extend": "grow"}
    back = reloaded_as_written(model, tmp_path / "old.ckpt", vitrel_format=6, pos=pos)
    assert "init_std" not in back.vitrel_cfg["pos"]
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(back(x), model(x), rtol=0, atol=0)


def test_a_run_written_under_the_previous_format_resumes_with_the_same_model():
    """A training checkpoint of format 6 (before this refusal) holds the model configured now: a resume compares its
    configuration as upgraded to the current format, so the format number alone is no difference."""
    from vitrel.train.resume import check_same_model

    model = vitrel.create_model("vitrel_vit_tiny_patch4_32", pos="rel2d_full")
    state = {"model." + k: v for k, v in model.state_dict().items()}
    check_same_model({"vitrel_cfg": {**model.vitrel_cfg, "vitrel_format": 6}, "state_dict": state}, model, "old.ckpt")
