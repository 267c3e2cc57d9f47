"""predict.py on long inputs: per-batch (not per-image) tensor reads, rows written as they are predicted, an
interrupted run keeping the rows it predicted."""

from __future__ import annotations

import csv
import io
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image
from torch.overrides import TorchFunctionMode

import vitrel
from vitrel.data.image_files import ImageFiles
from vitrel.inference import _top_rows
from vitrel.train.predict import run_predict


class _CountTorchCalls(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_top_rows_reads_a_batch_in_a_few_tensor_calls_not_one_per_image():
    # an element read from a CUDA tensor (int(c[j, r]), float(p[j, r])) syncs the GPU: 3 * k per image capped predict.py
    probs = torch.rand(256, 10, dtype=torch.float64).softmax(-1)
    with _CountTorchCalls() as mode:
        rows = _top_rows(probs, range(256), [f"{i}.png" for i in range(256)], None, 5)
    assert mode.calls < 10, mode.calls
    p, c = probs.topk(5, dim=-1)
    assert [r["index_0"] for _, r in rows] == c[:, 0].tolist()
    assert all(r[f"prob_{j}"] == round(float(p[i, j]), 6) for i, (_, r) in enumerate(rows) for j in range(5))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    m = vitrel.create_model("vitrel_vit_tiny_patch4_32", pos="rel2d_factored", embed_dim=32, depth=1, num_heads=2)
    path = tmp_path_factory.mktemp("ckpt") / "last.ckpt"
    data = dict(img_size=32, mean=[0.5] * 3, std=[0.25] * 3, crop_pct=1.0, class_names=[f"c{i}" for i in range(10)])
    state = {f"model.{k}": v for k, v in m.state_dict().items()}
    torch.save({"vitrel_cfg": m.vitrel_cfg, "state_dict": state, "hyper_parameters": {"data_config": data}}, path)
    return path


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for i in range(12):
        Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(root / f"{i:02d}.png")
    return root


@pytest.mark.parametrize("suffix", [".csv", ".json"])
def test_an_interrupted_run_keeps_the_rows_it_predicted(ckpt, images, tmp_path, monkeypatch, caplog, suffix):
    """predict.py kept every row in memory and wrote the file at the end: Ctrl-C (or a kill) at image 10,000 of 20,000
    left nothing. Rows are now written a batch at a time to <name>.partial<suffix>, renamed onto results_file at the
    end; an interrupted run leaves the rows so far there (valid JSON for .json) and says where."""
    out = tmp_path / f"p{suffix}"
    cfg = OmegaConf.create(dict(ckpt_path=str(ckpt), input=str(images), results_file=str(out)))
    cfg.progress_bar, cfg.topk, cfg.batch_size = "none", 2, 4
    run_predict(cfg)
    whole = out.read_text()
    full = list(csv.DictReader(io.StringIO(whole))) if suffix == ".csv" else json.loads(whole)
    assert [r["filename"] for r in full] == [f"{i:02d}.png" for i in range(12)]

    read = ImageFiles.__getitem__

    def stop_at_image_9(self, i):
        if i == 9:
            raise KeyboardInterrupt
        return read(self, i)

    monkeypatch.setattr(ImageFiles, "__getitem__", stop_at_image_9)
    with pytest.raises(KeyboardInterrupt), caplog.at_level(logging.WARNING):
        run_predict(cfg)
    partial = tmp_path / f"p.partial{suffix}"
    text = partial.read_text()
    got = list(csv.DictReader(io.StringIO(text))) if suffix == ".csv" else json.loads(text)
    assert got == full[:8]  # the two batches predicted, in file order, as the whole run wrote them
    assert out.read_text() == whole  # the previous results whole
    assert f"stopped after 8 prediction(s): they are in {partial}" in caplog.text
    monkeypatch.undo()
    run_predict(cfg)
    assert out.read_text() == whole and not partial.exists()
