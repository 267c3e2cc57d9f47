"""What a training clip's augmentation costs: ``ClipTransform(train=True)`` on one uint8 clip (16 frames of 256 x 340,
Kinetics' and SSv2's sizes after the usual resize, to 224) with the crop and flip alone, with RandAugment
(``rand-m7-n4-mstd0.5-inc1``, V-JEPA 2's), with cube random erasing (0.25, ``pixel``), and with both; beside reading
the clip (PyAV, an H.264 file of 64 frames, 16 frames 4 apart); and a training view with reading, alone and with
``data.clip_repeats=2`` (the clip read once, transformed twice: the time per view). Alternated rounds in one
process, medians of each round's mean over ``--clips`` clips (the draws differ clip to clip: RandAugment applies 0
to 4 ops).

    PYTHONPATH=$PWD python bench/video_augment.py [--clips 20] [--rounds 7] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import tempfile
import time
from pathlib import Path

import torch

from vitrel import bench
from vitrel.data.video.clips import read_clip
from vitrel.data.video.sampling import clip_indices
from vitrel.data.video.transforms import ClipTransform

FRAMES, HEIGHT, WIDTH, SIZE = 16, 256, 340, 224
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
VARIANTS = {
    "crop + flip": {},
    "+ RandAugment": {"auto_augment": "rand-m7-n4-mstd0.5-inc1"},
    "+ erasing": {"re_prob": 0.25, "re_mode": "pixel"},
    "+ both (vjepa2_probe)": {"auto_augment": "rand-m7-n4-mstd0.5-inc1", "re_prob": 0.25, "re_mode": "pixel"},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clips", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)  # (a DataLoader worker's)
    with tempfile.TemporaryDirectory() as tmp:
        path = bench.h264_video(Path(tmp) / "clip.mp4", 64, HEIGHT, WIDTH)
        clip = read_clip(path, lambda n: clip_indices(n, FRAMES, 4, 0))
        assert clip.shape == (FRAMES, 3, HEIGHT, WIDTH), clip.shape

        def read():
            return read_clip(path, lambda n: clip_indices(n, FRAMES, 4, 0))

        steps = {"read (PyAV)": read}
        for label, kw in VARIANTS.items():
            tf = ClipTransform(SIZE, MEAN, STD, train=True, scale=(0.08, 1.0), hflip=0.0, **kw)
            steps[label] = lambda tf=tf: tf(clip)
        tfs = {
            "crop + flip": ClipTransform(SIZE, MEAN, STD, train=True, hflip=0.0),
            "both": ClipTransform(SIZE, MEAN, STD, train=True, hflip=0.0, **VARIANTS["+ both (vjepa2_probe)"]),
        }

        def views(tf: ClipTransform, repeats: int) -> list:  # (read once, transformed `repeats` times)
            clip = read()
            return [tf(clip) for _ in range(repeats)]

        for name, tf in tfs.items():  # (the time per view is printed)
            for r in (1, 2):
                steps[f"read + {name}, a view of {r}"] = lambda tf=tf, r=r: views(tf, r)
        times: dict[str, list[float]] = {k: [] for k in steps}
        torch.manual_seed(0)
        for _ in range(args.rounds):
            for label, fn in steps.items():
                t = time.perf_counter()
                for _ in range(args.clips):
                    fn()
                times[label].append((time.perf_counter() - t) / args.clips)
    base = statistics.median(times["crop + flip"])
    lines = [
        f"# A training clip's augmentation against reading it (CPU, one thread, medians of {args.rounds})",
        "",
        f"`PYTHONPATH=$PWD python bench/video_augment.py --clips {args.clips} --rounds {args.rounds}`; one clip of "
        f"{FRAMES} x {HEIGHT} x {WIDTH} to {SIZE}; {bench.machine_info()['description']}, torch {torch.__version__}, "
        f"commit {bench.source_commit()}, {datetime.date.today()}",
        "",
        "| step | ms a clip | / crop + flip |",
        "|---|---|---|",
    ]
    for label, ts in times.items():
        ms = statistics.median(ts) * 1e3 / (2 if label.endswith("of 2") else 1)
        lines.append(f"| {label} | {ms:.1f} | {ms / (base * 1e3):.2f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
