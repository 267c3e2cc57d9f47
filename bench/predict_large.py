"""``predict.py`` on a large folder: images/s of its loop against a plain ``model(x)`` loop over the same tensors, and
its peak RSS, at several folder sizes (Fashion-MNIST test images written as PNG files).

    python bench/predict_large.py --ckpt outputs/train/runs/<run> --sizes 2000 20000 --rounds 3
    python bench/predict_large.py --ckpt <run> --sizes 2000 --rounds 3 --out bench/results/predict_large_cpu.md

Each round runs ``predict.py`` (a subprocess: its summary line's seconds, the loop's, and its peak RSS from
``os.wait4``) and, in this process, the plain loop: the files read and transformed once beforehand (the tensors
``predict.py`` builds), then ``model(x).softmax(-1)`` over batches of the same size in ``torch.inference_mode``. The
table holds the medians over rounds.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def write_images(n: int, folder: Path) -> Path:
    import numpy as np
    from PIL import Image

    from vitrel.data.fashion_mnist import SUBSET_PATH

    folder.mkdir(parents=True, exist_ok=True)
    with np.load(SUBSET_PATH) as z:
        x = z["x_test"]
    for i in range(n):
        Image.fromarray(x[i % len(x)]).save(folder / f"{i:05d}.png")
    return folder


def run_predict_py(ckpt: str, folder: Path, out: Path, batch_size: int, workers: int) -> tuple[float, float, float]:
    """(seconds of its loop, wall seconds, peak RSS in MiB) of one ``predict.py`` run."""
    args = [sys.executable, "predict.py", f"ckpt_path={ckpt}", f"input={folder}", f"results_file={out}"]
    args += [f"batch_size={batch_size}", f"num_workers={workers}", "progress_bar=none", f"hydra.run.dir={out.parent}"]
    t = time.perf_counter()
    p = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    text = p.stdout.read()
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t
    if status != 0:
        raise RuntimeError(text[-3000:])
    loop = float(re.search(r" in ([0-9.]+) s on ", text).group(1))
    return loop, wall, usage.ru_maxrss / 1024


def plain_loop(ckpt: str, folder: Path, batch_size: int) -> float:
    """Seconds of ``model(x).softmax(-1)`` over the folder's tensors, read beforehand."""
    import torch

    from vitrel.data.image_files import ImageFiles
    from vitrel.inference import eval_transform, find_images, load_predictor

    p = load_predictor(ckpt)
    files, _ = find_images(folder)
    ds = ImageFiles(files, eval_transform(p.data_config))
    x = torch.stack([ds[i][1] for i in range(len(ds))])
    with torch.inference_mode():
        t = time.perf_counter()
        for b in range(0, len(x), batch_size):
            p.model(x[b : b + batch_size]).float().softmax(-1)
        return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", required=True, help="a .ckpt, export folder or train.py run folder")
    ap.add_argument("--sizes", type=int, nargs="+", default=[2000, 20000])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--num-workers", type=int, default=0)
    ap.add_argument("--out", type=Path, help="a .md file for the table")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in a.sizes:
            folder = write_images(n, Path(tmp) / f"img{n}")
            runs = []
            for r in range(a.rounds):
                pred = run_predict_py(a.ckpt, folder, Path(tmp) / f"run{n}_{r}" / "p.csv", a.batch_size, a.num_workers)
                runs.append((*pred, plain_loop(a.ckpt, folder, a.batch_size)))
            loop, wall, rss, plain = (statistics.median(c) for c in zip(*runs))
            rows.append(f"| {n} | {n / loop:.0f} | {n / wall:.0f} | {n / plain:.0f} | {loop / plain:.2f} | {rss:.0f} |")
            print(rows[-1], flush=True)
    head = [
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU(s) ({platform.node()}); batch_size={a.batch_size}, "
        f"num_workers={a.num_workers}, {a.rounds} round(s), medians.",
        "",
        "| images | predict.py loop img/s | predict.py wall img/s | plain model(x) img/s | loop / plain time "
        "| peak RSS MiB |",
        "|---|---|---|---|---|---|",
    ]
    text = "\n".join([*head, *rows]) + "\n"
    print(text)
    if a.out:
        a.out.write_text(text)


if __name__ == "__main__":
    main()
