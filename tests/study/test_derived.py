"""Within-run differences (``study.derived``, e.g. ``unseen_drop = unseen - test``) compare one trained model on
one set of images: ``test`` holds ``test_images`` images and the other sets ``ood_images`` others, so beside an
out-of-distribution set ``test`` is its accuracy on that set's images (``test_on_ood_images_acc``)."""

from __future__ import annotations

import csv
import json

import pytest

from vitrel.study.reading import summarise, with_derived


@pytest.mark.slow
def test_a_model_blind_to_position_loses_nothing_to_whole_patch_moves(tmp_path):
    """``none`` (no position, class token) on a whole-patch move sees its tokens permuted: the same images give the
    same accuracy, so ``unseen_patch - test`` is exactly 0 when both are scored on the same images. (It read the
    accuracy of 64 images minus that of 128 others: +3.1 points here.)"""
    from vitrel.study import main

    over = ["++study.evals.test.grid_step=4", "++study.derived.patch_move=[unseen_patch,test]", "study.finetune=null"]
    over += ["trainer.limit_train_batches=40"]
    argv = ["--budget", "smoke", "--schemes", "none", "--archs", "vit", "--out", str(tmp_path)]
    state = main([*argv, "--progress", "none", "--threads", "1", "--cost-rounds", "0", *over])
    (run,) = state["runs"]
    assert run["test_on_ood_images_acc"] == run["unseen_patch_acc"]  # the invariance: same images, same hits
    assert run["test_acc"] != run["unseen_patch_acc"]  # (128 other images: not the same accuracy)
    (row,) = state["summary"]
    assert row["patch_move_mean"] == 0.0
    assert row["unseen_drop_mean"] == run["unseen_acc"] - run["test_on_ood_images_acc"]  # float64, by hand
    with open(tmp_path / "study_smoke.csv") as f:
        (csv_row,) = list(csv.DictReader(f))
    assert float(csv_row["patch_move_mean"]) == 0.0
    assert float(csv_row["res80_drop_mean"]) == pytest.approx(run["res80_acc"] - run["test_on_ood_images_acc"])
    md = (tmp_path / "study_smoke.md").read_text()
    assert "`patch_move` = `unseen_patch` - `test`" in md and "show `-`" not in md
    assert json.loads((tmp_path / "study_smoke.json").read_text())["runs"][0] == run
    assert not (tmp_path / "study_smoke_diffs.png").exists()  # none alone: no paired difference to draw


def _study(**images) -> dict:
    return dict(archs={"vit": []}, evals={"test": {}, "unseen": {}}, derived={"drop": ["unseen", "test"]}, **images)


def test_a_run_without_the_paired_accuracy_has_no_difference():
    """A run recorded before ``test`` was scored on the other sets' images has no paired value: None (shown ``-``),
    not the difference of two image sets; where every set scores every test image, ``test_acc`` is the pair."""
    old = dict(arch="vit", scheme="none", seed=0, family="none", params=1, test_acc=0.75, unseen_acc=0.5)
    new = {**old, "seed": 1, "test_on_ood_images_acc": 0.625}
    study = _study(test_images=1000, ood_images=200)
    assert [r["drop"] for r in with_derived([old, new], study)] == [None, 0.5 - 0.625]
    (row,) = summarise(dict(runs=[old, new], recipe=dict(study=study)))
    assert row["drop_mean"] == -0.125 and row["drop_lo"] is None and row["test_acc_mean"] == 0.75
    assert with_derived([old], _study(test_images=None, ood_images=None))[0]["drop"] == 0.5 - 0.75
