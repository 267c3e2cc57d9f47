"""Score a sweep's Fashion-MNIST checkpoints on test images resized to other aspect ratios.

    python bench/naflex_aspect.py --sweep <hydra sweep folder> [--sizes 28x28 20x36 36x20 16x44] [--view crop]

Every job of the sweep (``<sweep>/<n>/checkpoints/last.ckpt``, its overrides from ``.hydra/overrides.yaml``) scores
the 2,000 embedded test images, each brought from 28 x 28 to every ``HxW`` of ``--sizes`` (multiples of the patch)
after the run's normalisation (torchvision, on the float tensor, antialiased; ``data.interpolation`` of the run):
``--view squash`` resizes the whole image (its content squashed to that aspect ratio), ``--view crop`` resizes its
largest centred crop of that aspect ratio (the content's aspect kept, as the training crops of the NaFlex recipe).
Prints, and writes with ``--out``, a table of test accuracy per job and size, then the mean and standard deviation
over seeds of every other override. Written for the ``experiment=fmnist_naflex`` sweep of
``bench/results/naflex_abs_pos_fmnist_cpu.md``: its training images have mixed aspect ratios, where an embedding's
``ar_preserving`` matters, and its test images are square.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import yaml
from torchvision.transforms import InterpolationMode
from torchvision.transforms import functional as TF

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vitrel  # noqa: E402
from vitrel.data.fashion_mnist import load_embedded_subset  # noqa: E402
from vitrel.models.data_config import data_config_for  # noqa: E402


def size(text: str) -> tuple[int, int]:
    h, _, w = text.partition("x")
    return int(h), int(w)


def accuracy(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor, batch: int = 500) -> float:
    with torch.inference_mode():
        right = sum(int((model(images[i : i + batch]).argmax(-1) == labels[i : i + batch]).sum())
                    for i in range(0, len(images), batch))  # fmt: skip
    return right / len(images)


def view(x: torch.Tensor, h: int, w: int, how: str, mode: InterpolationMode) -> torch.Tensor:
    """Images ``x [B, C, s, s]`` at ``h x w``: resized whole (``"squash"``) or their largest centred crop of aspect
    ``w / h`` resized (``"crop"``)."""
    if how == "crop":
        s = x.shape[-1]
        ch, cw = (s, round(s * w / h)) if w <= h else (round(s * h / w), s)
        x = TF.center_crop(x, [ch, cw])
    return x if (h, w) == tuple(x.shape[-2:]) else TF.resize(x, [h, w], interpolation=mode, antialias=True)


def score(ckpt: Path, sizes: list[tuple[int, int]], how: str = "squash", limit: int | None = None) -> dict[str, float]:
    """Test accuracy of the checkpoint ``ckpt`` at each of ``sizes`` (``how``: :func:`view`'s; ``limit``: the first
    test images only)."""
    model = vitrel.load_model(ckpt).eval()
    cfg = data_config_for(ckpt, model)
    x, y = load_embedded_subset("test")
    x, y = torch.from_numpy(x[:limit]).float()[:, None] / 255.0, torch.from_numpy(y[:limit]).long()
    x = (x - torch.tensor(cfg["mean"])[:, None, None]) / torch.tensor(cfg["std"])[:, None, None]
    mode = InterpolationMode(cfg.get("interpolation", "bilinear"))
    out = {}
    for h, w in sizes:
        out[f"{h}x{w}"] = accuracy(model, view(x, h, w, how, mode), y)
    return out


def overrides(job: Path) -> tuple[str, str]:
    """(the job's overrides but its seed, its seed) from Hydra's record."""
    over = yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text())
    seed = next((o.split("=", 1)[1] for o in over if o.startswith("seed=")), "-")
    keep = [o for o in over if not o.startswith(("seed=", "experiment=", "logger=", "progress_bar=", "pos="))]
    return " ".join(keep), seed


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", type=Path, required=True)
    ap.add_argument("--sizes", nargs="+", type=size, default=[(28, 28), (20, 36), (36, 20), (16, 44)])
    ap.add_argument("--view", choices=("squash", "crop"), default="squash", help="the whole image, or a centred crop")
    ap.add_argument("--limit", type=int, default=None, help="score the first N test images only")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    jobs = sorted((p.parent.parent for p in args.sweep.glob("*/checkpoints/last.ckpt")), key=lambda p: int(p.name))
    if not jobs:
        raise SystemExit(f"no <job>/checkpoints/last.ckpt under {args.sweep}")
    names = [f"{h}x{w}" for h, w in args.sizes]
    rows, groups = [], {}
    for job in jobs:
        acc = score(job / "checkpoints" / "last.ckpt", args.sizes, args.view, args.limit)
        over, seed = overrides(job)
        rows.append(f"| {job.name} | `{over}` | {seed} | " + " | ".join(f"{acc[n]:.4f}" for n in names) + " |")
        groups.setdefault(over, []).append(acc)
    lines = [f"| job | overrides | seed | {' | '.join(names)} |", "|---|---|---|" + "---:|" * len(names), *rows, ""]
    lines += [f"| overrides | seeds | {' | '.join(names)} |", "|---|---:|" + "---:|" * len(names)]
    for over, accs in groups.items():
        cell = [f"{statistics.mean(a[n] for a in accs):.4f}" + (
            f" ± {statistics.stdev(a[n] for a in accs):.4f}" if len(accs) > 1 else "") for n in names]  # fmt: skip
        lines.append(f"| `{over}` | {len(accs)} | " + " | ".join(cell) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return text


if __name__ == "__main__":
    main()
