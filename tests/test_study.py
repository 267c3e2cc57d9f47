"""bench/study.py on the smoke budget (conf/experiment/study_smoke.yaml): output files and columns, resume, recipe
guard, the evaluation sets on the full-set data path."""

from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def study():
    spec = importlib.util.spec_from_file_location("vitrel_bench_study", ROOT / "bench" / "study.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(study, out: Path, *extra: str) -> dict:
    argv = ["--budget", "smoke", "--schemes", "none,rel2d_full", "--out", str(out), "--progress", "lines"]
    return study.main([*argv, "--threads", "1", *extra])


def test_smoke_study_writes_every_file_and_resumes(study, tmp_path, capsys):
    state = run(study, tmp_path, "--max-runs", "1")  # as if the study died after its first run
    assert len(state["runs"]) == 1
    first = dict(state["runs"][0])
    state = run(study, tmp_path)
    out = capsys.readouterr().out
    assert "3 runs to do (1 of the selection already done" in out
    assert "cost: timing 4 models in alternation" in out  # once the selection is complete
    assert len(state["runs"]) == 4
    assert state["runs"][0] == first  # kept as it was, not rerun
    assert {(r["arch"], r["scheme"], r["seed"]) for r in state["runs"]} == {
        (a, s, 0) for a in ("vit", "swin") for s in ("none", "rel2d_full")
    }

    name = "study_smoke"
    for ext in ("json", "csv", "md", "png"):
        assert (tmp_path / f"{name}.{ext}").stat().st_size > 0, ext
    assert (tmp_path / f"{name}_pos.safetensors").exists()
    assert not (tmp_path / f"{name}_work").exists()  # per-run checkpoints are removed once recorded

    data = json.loads((tmp_path / f"{name}.json").read_text())
    assert data["recipe"] == json.loads(json.dumps(study.recipe("smoke")))
    assert data["recipe"]["runs"]["swin"]["model"]["depths"] == [1, 1]  # the architecture's overrides
    assert data["machine"]["device"] == "cpu" and "CPU" in data["machine"]["description"]
    assert data["wall_s"] > 0 and data["command"].startswith("python bench/study.py --budget smoke")
    for r in data["runs"]:
        for key in ("test_acc", "center44_acc", "shift44_acc", "translate44_acc", "resize40_acc"):
            assert 0.0 <= r[key] <= 1.0
        assert r["params"] > 0 and r["train_img_s"] > 0 and r["peak_mem_mb"] > 0 and r["steps"] == 3

    with open(tmp_path / f"{name}.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["arch"], r["scheme"]) for r in rows] == [
        ("vit", "none"),
        ("vit", "rel2d_full"),
        ("swin", "none"),
        ("swin", "rel2d_full"),
    ]
    for col in (
        "family",
        "seeds",
        "params",
        "test_acc_mean",
        "test_acc_std",
        "center44_acc_mean",
        "shift44_acc_mean",
        "translate44_acc_mean",
        "resize40_acc_mean",
        "train_img_s_mean",
        "peak_mem_mb_mean",
    ):
        assert col in rows[0], col
    assert rows[1]["family"] == "learned bias" and rows[0]["seeds"] == "1" and rows[0]["test_acc_std"] == ""
    by_key = {(r["arch"], r["scheme"]): r for r in data["runs"]}
    assert float(rows[1]["test_acc_mean"]) == pytest.approx(by_key[("vit", "rel2d_full")]["test_acc"])

    md = (tmp_path / f"{name}.md").read_text()
    assert "| scheme | family | params | test | center44 | shift44 | translate44 | resize40 | img/s | peak MB |" in md
    assert "`conf/experiment/study_smoke.yaml`: fashion_mnist, 1 epochs of 3 batches of 64" in md
    assert "## vit" in md and "## swin" in md and data["machine"]["description"] in md

    from safetensors import safe_open

    with safe_open(str(tmp_path / f"{name}_pos.safetensors"), "pt") as f:
        keys = list(f.keys())
        meta = f.metadata()
    assert any(k.startswith("vit/rel2d_full/blocks.0.attn.pos.table") for k in keys)
    assert json.loads(meta["swin/rel2d_full"])["pos"] == {"name": "rel2d_full", "init_std": 0.02}

    assert sorted(data["cost"]) == ["swin/none", "swin/rel2d_full", "vit/none", "vit/rel2d_full"]
    assert all(len(c["rounds"]) == 5 and c["img_s"] > 0 for c in data["cost"].values())
    assert float(rows[0]["bench_img_s"]) == pytest.approx(data["cost"]["vit/none"]["img_s"])

    # nothing left to do: a rerun only rewrites the files (the throughput timing is kept)
    state = run(study, tmp_path)
    assert len(state["runs"]) == 4 and state["cost"] == data["cost"]
    out = capsys.readouterr().out
    assert "0 runs to do" in out and "cost: timing" not in out


def test_another_recipe_is_refused(study, tmp_path):
    run(study, tmp_path, "--max-runs", "1", "--archs", "vit")
    path = tmp_path / "study_smoke.json"
    data = json.loads(path.read_text())
    data["recipe"]["runs"]["vit"]["trainer"]["max_epochs"] = 7
    path.write_text(json.dumps(data))
    with pytest.raises(SystemExit, match="another recipe.*runs.*--restart"):
        run(study, tmp_path, "--archs", "vit")
    state = run(study, tmp_path, "--max-runs", "1", "--archs", "vit", "--restart")
    assert len(state["runs"]) == 1


def test_bad_selection_is_refused(study, tmp_path):
    with pytest.raises(SystemExit, match="unknown scheme"):
        study.main(["--budget", "smoke", "--schemes", "rel3d", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="unknown architecture"):
        study.main(["--budget", "smoke", "--archs", "convnet", "--out", str(tmp_path)])


def test_eval_sets_from_idx_files(study, tmp_path):
    """The full-set path (``subset="full"``) on generated IDX files, with the evaluation sets' geometry."""
    from hydra.utils import instantiate

    from vitrel.data import TranslatedDataset, write_idx

    rng = np.random.default_rng(0)
    for split, n in (("train", 40), ("t10k", 30)):
        write_idx(tmp_path / f"{split}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))
        write_idx(tmp_path / f"{split}-labels-idx1-ubyte", rng.integers(0, 10, n, dtype=np.uint8))
    over = ["data=fashion_mnist_full", f"data.root={tmp_path}", "study.test_images=null", "study.ood_images=10"]
    cfg = study.compose("smoke", over)
    dm = instantiate(cfg.data)
    data = {k: study.materialise(v) for k, v in study.eval_sets(cfg.study, dm).items()}
    assert list(data) == ["test", "center44", "shift44", "translate44", "resize40"]
    assert data["test"][0].shape == (30, 1, 28, 28)
    x, y = data["translate44"]
    assert x.shape == (10, 1, 44, 44) and y.shape == (10,)
    assert data["resize40"][0].shape == (10, 1, 40, 40)
    assert data["center44"][0].shape == data["shift44"][0].shape == (10, 1, 44, 44)
    # every out-of-distribution set scores the same 10 test images
    for k in ("center44", "shift44", "resize40"):
        assert data[k][1].tolist() == y.tolist()
    # the canvas holds the image once, the rest is black; centre: rows/cols 8..35
    black = (0.0 - 0.2860) / 0.3530
    assert ((x - black).abs() > 1e-6).sum(dim=(1, 2, 3)).max() <= 28 * 28
    c = data["center44"][0]
    idx = sorted(torch.randperm(30, generator=torch.Generator().manual_seed(2))[:10].tolist())  # study._subset
    torch.testing.assert_close(c[:, :, 8:36, 8:36], data["test"][0][idx])
    assert data["test"][1][idx].tolist() == y.tolist()
    assert ((c[:, :, :8] - black).abs() < 1e-6).all() and ((c[:, :, 36:] - black).abs() < 1e-6).all()
    # shift: whole patches (grid_step 4), and the same offsets as the study's former ShiftedDataset
    ds = TranslatedDataset(list(zip(range(50), range(50))), 44, seed=0, grid_step=4)
    offs = [ds.offset(i, (28, 28)) for i in range(50)]
    assert all(t % 4 == 0 and l % 4 == 0 and 0 <= t <= 16 and 0 <= l <= 16 for t, l in offs)
    assert len(set(offs)) > 10
    gens = [np.random.default_rng([0, i]) for i in range(50)]  # one generator per sample: top, then left
    assert offs == [(4 * int(g.integers(0, 5)), 4 * int(g.integers(0, 5))) for g in gens]
    for j, i in enumerate(idx):  # the shifted images are the test images at those offsets
        t, l = ds.offset(i, (28, 28))
        torch.testing.assert_close(data["shift44"][0][j, :, t : t + 28, l : l + 28], data["test"][0][i])


def test_recipes_compose_as_train_py_does(study):
    """Every budget composes; the runs are train.py's configs (experiment=study_<budget>) with the study's overrides."""
    assert study.BUDGETS == ["full", "short", "smoke"]
    for budget in study.BUDGETS:
        rec = study.recipe(budget)
        assert set(rec["runs"]) == {"vit", "swin"} and rec["study"]["evals"]["test"] == {}
        for cfg in rec["runs"].values():
            assert cfg["model"]["_target_"] == "vitrel.create_model" and cfg["test"] is False
            assert cfg["callbacks"]["model_checkpoint"] is None and cfg["logger"] == {}
    assert study.recipe("full")["runs"]["vit"]["trainer"]["max_epochs"] == 30
    assert study.recipe("short")["runs"]["swin"]["model"]["patch_size"] == 4
