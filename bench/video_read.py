"""What reading a training clip costs under each frame sampling: 16 frames 4 apart from a random start
(``data.frame_sampling=stride``, the default) against 16 frames spread over the whole video (``spread``, VideoMAE's
SSv2 clips), from H.264 files of 256 x 340 frames of several lengths (SSv2's ~45 frames to Kinetics' ~300). vitrel
decodes from a file's start up to a clip's last frame (no seeking), so a spread clip decodes the whole video.
Alternated rounds in one process (``vitrel.bench.alternate``), medians of each round's mean over ``--clips`` reads,
one thread (a DataLoader worker's).

    PYTHONPATH=$PWD python bench/video_read.py [--lengths 48 150 300] [--clips 10] [--rounds 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import tempfile
from pathlib import Path

import torch

from vitrel import bench
from vitrel.data.video.clips import read_clip
from vitrel.data.video.sampling import clip_indices, random_start, spread_indices

FRAMES, STRIDE = 16, 4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[48, 150, 300])
    ap.add_argument("--clips", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for length in args.lengths:
            path = bench.h264_video(Path(tmp) / f"{length}.mp4", length)

            def stride(path=path):
                return read_clip(path, lambda n: clip_indices(n, FRAMES, STRIDE, random_start(n, FRAMES, STRIDE)))

            def spread(path=path):
                return read_clip(path, lambda n: spread_indices(n, FRAMES, 1, train=True)[0])

            def many(fn):
                return lambda: [fn() for _ in range(args.clips)]

            times = bench.alternate({"stride": many(stride), "spread": many(spread)}, args.rounds, zigzag=True)
            ms = {k: statistics.median(v) * 1e3 / args.clips for k, v in times.items()}
            rows.append(f"| {length} | {ms['stride']:.1f} | {ms['spread']:.1f} | {ms['spread'] / ms['stride']:.2f} |")
    lines = [
        f"# Reading a training clip: frames {STRIDE} apart against spread over the video (CPU, one thread, medians "
        f"of {args.rounds})",
        "",
        f"`PYTHONPATH=$PWD python bench/video_read.py --lengths {' '.join(map(str, args.lengths))} --clips "
        f"{args.clips} --rounds {args.rounds}`; {FRAMES} frames of 256 x 340 (H.264, PyAV); "
        f"{bench.machine_info()['description']}, torch {torch.__version__}, commit {bench.source_commit()}, "
        f"{datetime.date.today()}",
        "",
        f"| video frames | stride {STRIDE}, random start (ms) | spread (ms) | spread / stride |",
        "|---|---|---|---|",
        *rows,
    ]
    bench.emit(lines, args.out)


if __name__ == "__main__":
    main()
