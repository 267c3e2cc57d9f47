"""predict.py against the run's own test, on a memory-loader run resized from 28 to 32 px.

    python bench/predict_vs_test.py [--out DIR] [--steps 40] [--images 500]

Trains the tiny ViT with ``train.py`` (embedded Fashion-MNIST, ``data.loader=memory``, ``data.img_size=32``, bicubic,
``crop_pct=0.875``, 3 channels), writes the first test images as PNG files, runs ``predict.py`` on them, and scores
the same weights on the run's own test batches (the data module's memory loader). Prints one JSON line: both
accuracies, the predictions that differ and the largest difference of the top-1 probability (the CSV rounds to 6
decimals). Train and predict run from the checkout this file is in.
"""

import argparse
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("outputs/bench/predict_vs_test"))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--images", type=int, default=500)
    args = ap.parse_args()
    out = args.out.resolve()
    sys.path.insert(0, str(REPO))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    data = ["data.img_size=32", "data.interpolation=bicubic", "data.crop_pct=0.875", "data.in_chans=3"]
    run = out / "run"
    train = ["model.embed_dim=32", "model.depth=2", "model.num_heads=2", "data.num_workers=0", "data.batch_size=32",
             "trainer.accelerator=cpu", "progress_bar=none", "callbacks.pos_images=null", "logger=none", *data,
             "+model.in_chans=3", f"trainer.max_steps={args.steps}", "trainer.limit_val_batches=1",
             f"hydra.run.dir={run}"]  # fmt: skip
    subprocess.run([sys.executable, "train.py", *train], cwd=REPO, env=env, check=True, capture_output=True)

    import numpy as np
    import torch
    from PIL import Image

    import vitrel
    from vitrel.data.fashion_mnist import SUBSET_PATH, FashionMNISTDataModule

    with np.load(SUBSET_PATH) as z:
        x, y = z["x_test"][: args.images], z["y_test"][: args.images]
    images = out / "images"
    images.mkdir(parents=True, exist_ok=True)
    for i, a in enumerate(x):
        Image.fromarray(a).save(images / f"{i:04d}.png")
    ckpt, csv_path = run / "checkpoints" / "last.ckpt", out / "predictions.csv"
    cmd = [sys.executable, "predict.py", f"ckpt_path={ckpt}", f"input={images}", f"results_file={csv_path}",
           "progress_bar=none", f"hydra.run.dir={out / 'predict'}"]  # fmt: skip
    subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True)
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    pred = np.array([int(r["index_0"]) for r in rows])
    p0 = np.array([float(r["prob_0"]) for r in rows])

    dm = FashionMNISTDataModule(num_workers=0, img_size=32, interpolation="bicubic", crop_pct=0.875, in_chans=3)
    dm.setup("test")
    xs = torch.cat([b[0] for b in dm.test_dataloader()])[: len(y)]
    with torch.no_grad():
        probs = vitrel.load_model(ckpt).eval()(xs).softmax(-1)
    ref = probs.argmax(-1).numpy()
    print(json.dumps({
        "run_test_acc": float((ref == y).mean()), "predict_acc": float((pred == y).mean()),
        "differ": int((ref != pred).sum()), "of": int(len(y)),
        "max_prob_diff": float(np.abs(probs.max(-1).values.numpy() - p0).max()),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
