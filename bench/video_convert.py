"""Time turning decoded video frames into RGB arrays on one swscale thread against FFmpeg's automatic count.

``vitrel.data.video.clips.read_frames`` converts on one thread (``to_ndarray(..., threads=1)``): a DataLoader
worker forked from a process holding converted frames hung freeing their threads. This measures what that costs.
Each repeat decodes the whole video once per setting (alternating) and times the conversions alone; it prints the
median time per frame and the ratio.

    python bench/video_convert.py --size 256x340 --frames 64 --repeats 7
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import av
import numpy as np


def write(path: Path, frames: int, h: int, w: int) -> None:
    rng = np.random.default_rng(0)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=25)
        stream.height, stream.width, stream.pix_fmt = h, w, "yuv420p"
        for _ in range(frames):
            img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")))
        container.mux(stream.encode())


def convert_seconds(path: Path, threads: int) -> float:
    spent = 0.0
    with av.open(str(path)) as container:
        for frame in container.decode(video=0):
            t = time.perf_counter()
            frame.to_ndarray(format="rgb24", threads=threads)
            spent += time.perf_counter() - t
    return spent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="256x340", help="HxW of the frames")
    p.add_argument("--frames", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args()
    h, w = (int(s) for s in a.size.split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "v.mp4"
        write(path, a.frames, h, w)
        times = {0: [], 1: []}
        for _ in range(a.repeats):
            for threads in (0, 1):
                times[threads].append(convert_seconds(path, threads) / a.frames)
    auto, one = (statistics.median(times[t]) for t in (0, 1))
    print(
        f"{platform.processor() or platform.machine()}, PyAV {av.__version__}, {h}x{w}, {a.frames} frames, "
        f"median of {a.repeats}"
    )
    print(
        f"threads=0 (auto): {auto * 1e6:.0f} us/frame; threads=1: {one * 1e6:.0f} us/frame; "
        f"one / auto = {one / auto:.2f}"
    )


if __name__ == "__main__":
    main()
