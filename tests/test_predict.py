"""predict.py: top-k CSV for a folder of images from a .ckpt, an export folder or a .pt2 program."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

import vitrel
from vitrel.export import main as export_main
from vitrel.inference import NoImagesError, load_predictor, predict_folder, run_predict
from vitrel.models.checkpoint import save_pretrained

ROOT = Path(__file__).resolve().parents[1]
NAMES = [f"class_{i}" for i in range(10)]


def _model():
    torch.manual_seed(0)
    return vitrel.create_model("vitrel_vit_tiny_patch4_32", pos="rel2d_factored", embed_dim=32, depth=1, num_heads=2)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A training checkpoint as vitrel.train writes it, with a data configuration in its hyper-parameters."""
    m = _model()
    path = tmp_path_factory.mktemp("ckpt") / "last.ckpt"
    data = dict(img_size=32, mean=[0.5, 0.5, 0.5], std=[0.25, 0.25, 0.25], crop_pct=1.0, class_names=NAMES)
    torch.save(
        {
            "vitrel_cfg": m.vitrel_cfg,
            "state_dict": {f"model.{k}": v for k, v in m.state_dict().items()},
            "hyper_parameters": {"num_classes": 10, "data_config": data},
        },
        path,
    )
    return path


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """RGB PNG and JPEG files of several sizes, a grey PNG, a corrupt .jpg and a text file."""
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for i, (h, w) in enumerate([(32, 32), (40, 28), (64, 64)]):
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(root / f"rgb_{i}.png")
    Image.fromarray(rng.integers(0, 255, (50, 45, 3), dtype=np.uint8)).save(root / "photo.jpg", quality=90)
    Image.fromarray(rng.integers(0, 255, (30, 30), dtype=np.uint8), mode="L").save(root / "grey.png")
    (root / "broken.jpg").write_bytes(b"\xff\xd8\xff not really a jpeg")
    (root / "notes.txt").write_text("not an image")
    return root


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_predict_script_on_a_folder(ckpt, images, tmp_path):
    out = tmp_path / "pred.csv"
    cmd = [sys.executable, str(ROOT / "predict.py"), f"ckpt_path={ckpt}", f"input={images}", f"results_file={out}"]
    cmd += ["topk=3", "batch_size=2", f"hydra.run.dir={tmp_path / 'run'}"]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "predicted 5 of 6 image(s), skipped 1 unreadable file(s)" in res.stdout
    assert "skipped broken.jpg" in res.stderr
    rows = _rows(out)
    assert [r["filename"] for r in rows] == ["grey.png", "photo.jpg", "rgb_0.png", "rgb_1.png", "rgb_2.png"]
    assert list(rows[0]) == ["filename"] + [f"{c}_{i}" for i in range(3) for c in ("index", "label", "prob")]
    for r in rows:
        probs = [float(r[f"prob_{i}"]) for i in range(3)]
        assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1.0 + 1e-5
        assert r["label_0"] == NAMES[int(r["index_0"])]  # the class names stored with the checkpoint


def test_same_predictions_from_ckpt_export_folder_and_pt2(ckpt, images, tmp_path):
    out = tmp_path / "export"
    assert export_main([str(ckpt), str(out), "--pt2"]) == 0
    results = {}
    for src in (ckpt, out, out / "model.pt2"):
        p = load_predictor(src)
        res = predict_folder(p, images, topk=2, batch_size=4, progress=False)
        assert res.found == 6 and len(res.skipped) == 1 and len(res.rows) == 5
        results[str(src)] = res.rows
    a, b, c = results.values()
    for ra, rb, rc in zip(a, b, c):
        assert ra["index_0"] == rb["index_0"] == rc["index_0"]
        assert abs(ra["prob_0"] - rc["prob_0"]) < 1e-4 and abs(ra["prob_0"] - rb["prob_0"]) < 1e-4
    assert a[0]["label_0"] in NAMES and c[0]["label_0"] in NAMES  # the .pt2 keeps the data configuration


def test_imagefolder_tree_gives_class_names(tmp_path):
    """Without stored names, an ImageFolder tree with one folder per class names the classes."""
    m = _model()
    folder = tmp_path / "exported"
    save_pretrained(m, folder)
    tree = tmp_path / "tree"
    for i in range(10):
        (tree / f"c{i}").mkdir(parents=True)
    Image.new("RGB", (32, 32), (10, 200, 30)).save(tree / "c3" / "a.png")
    Image.new("L", (20, 20), 128).save(tree / "c7" / "b.jpg")
    res = predict_folder(load_predictor(folder), tree, topk=1, progress=False)
    assert [r["filename"] for r in res.rows] == ["c3/a.png", "c7/b.jpg"]
    assert all(r["label"] == f"c{r['index']}" for r in res.rows)


def test_empty_folder_is_one_clear_error(ckpt, tmp_path):
    empty = tmp_path / "empty"
    (empty / "sub").mkdir(parents=True)
    (empty / "readme.txt").write_text("no images here")
    cfg = OmegaConf.create(dict(ckpt_path=str(ckpt), input=str(empty), results_file=str(tmp_path / "p.csv")))
    with pytest.raises(NoImagesError, match="no images in"):
        run_predict(cfg)


def test_another_kernel_at_prediction_and_export(ckpt, images, tmp_path):
    """A model trained with a kernel of its own (``triton``) is scored and exported with another: ``predict.py``'s
    ``model_overrides`` and ``python -m vitrel.export --attn-impl`` (recorded in the export's ``config.json``), the
    same predictions as the checkpoint's; a ``.pt2`` program, fixed, refuses overrides."""
    import json

    m = _model()
    m.vitrel_cfg["attn_impl"] = "triton"  # (as trained with attn_impl=triton: the weights are the same)
    trained = tmp_path / "triton.ckpt"
    saved = torch.load(ckpt, weights_only=False)
    torch.save({**saved, "vitrel_cfg": m.vitrel_cfg}, trained)
    ref = predict_folder(load_predictor(ckpt), images, topk=2, progress=False).rows
    p = load_predictor(trained, model_overrides={"attn_impl": "sdpa"})
    assert p.model.attn_impl == "sdpa"
    assert predict_folder(p, images, topk=2, progress=False).rows == ref
    out = tmp_path / "export"
    assert export_main([str(trained), str(out), "--pt2", "--attn-impl", "sdpa"]) == 0
    assert json.loads((out / "config.json").read_text())["model_args"]["attn_impl"] == "sdpa"
    with pytest.raises(ValueError, match="torch.export program, fixed"):
        load_predictor(out / "model.pt2", model_overrides={"attn_impl": "sdpa"})
    cfg = OmegaConf.create(dict(ckpt_path=str(trained), input=str(images), results_file=str(tmp_path / "p.csv")))
    cfg.topk, cfg.progress_bar, cfg.model_overrides = 2, False, {"attn_impl": "sdpa"}
    run_predict(cfg)
    assert len(_rows(tmp_path / "p.csv")) == len(ref)
