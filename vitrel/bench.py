"""Timing and memory helpers shared by the benchmarks (``bench/attention.py``, ``bench/models.py``,
``bench/shaw_factored.py``) and the position-scheme study (``vitrel.study``).

On a shared machine the load drifts while a benchmark runs, so the variants being compared take turns:
:func:`alternate` runs every callable once (or ``repeat`` times) per round, round after round, and
returns each one's per-call times; compare medians (:func:`medians`) of the same run. Inside a Lightning
fit, :class:`StepTimer` times the training steps.
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F

__all__ = [
    "StepTimer",
    "alternate",
    "cpu_peak_bytes",
    "h264_video",
    "machine_info",
    "medians",
    "peak_bytes",
    "saved_bytes",
    "sync",
    "timed",
    "train_step",
    "train_step_bytes",
]


def sync(device: torch.device | str | None = None) -> None:
    """Wait for the device's queued work (CUDA); nothing on the CPU."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device | str | None = None) -> float:
    """Wall seconds of ``fn()``, synchronising the device before and after."""
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def alternate(
    fns: Mapping[str, Callable[[], Any]],
    rounds: int,
    *,
    warmup: int = 1,
    repeat: int = 1,
    device: torch.device | str | None = None,
    zigzag: bool = False,
    on_round: Callable[[int], None] | None = None,
) -> dict[str, list[float]]:
    """Seconds per call of every callable, timed in alternation: ``warmup`` untimed calls each (taking
    turns), then ``rounds`` rounds in which each callable runs ``repeat`` times in a row. ``zigzag``
    reverses the order every second round (for two variants: neither always runs first).
    Returns ``{name: [seconds per call, one per round]}``."""
    if rounds < 1 or repeat < 1:  # (nothing to take a median of)
        raise ValueError(f"rounds and repeat must be at least 1, got rounds={rounds}, repeat={repeat}")
    names = list(fns)
    for _ in range(warmup):
        for k in names:
            fns[k]()
    times: dict[str, list[float]] = {k: [] for k in names}

    def many(fn: Callable[[], Any]) -> None:
        for _ in range(repeat):
            fn()

    for r in range(rounds):
        for k in reversed(names) if zigzag and r % 2 else names:
            times[k].append(timed(lambda k=k: many(fns[k]), device) / repeat)
        if on_round is not None:
            on_round(r)
    return times


def h264_video(path: str | Path, frames: int, height: int = 256, width: int = 340) -> Path:
    """An H.264 file (PyAV) of ``frames`` frames of ``height x width`` moving gradients and noise (something for the
    encoder to keep, so that decoding costs what a real video's does), at 25 frames a second."""
    import av
    import numpy as np

    rng = np.random.default_rng(0)
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=25)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        ramp = np.linspace(0, 200, width)[None, :, None] * np.ones((height, 1, 3))
        for i in range(frames):
            img = np.roll(ramp, 4 * i, axis=1) + rng.integers(0, 40, (height, width, 3))
            for packet in stream.encode(av.VideoFrame.from_ndarray(img.astype(np.uint8), format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return Path(path)


def kernel_times(prof: torch.profiler.profile, device: torch.device, steps: int) -> dict[str, tuple[float, float]]:
    """``{name: (ms per step, calls per step)}`` of a profile over ``steps`` steps: each CUDA kernel's (or on a CPU
    each operator's) own time."""
    rows = {}
    for e in prof.key_averages():
        if device.type == "cuda":
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = e.self_device_time_total
        else:
            us = e.self_cpu_time_total
        if us > 0:
            rows[e.key] = (us / 1e3 / steps, e.count / steps)
    return rows


def profiled_kernel_times(fn: Callable[[], Any], device: torch.device, calls: int) -> dict[str, tuple[float, float]]:
    """:func:`kernel_times` of ``calls`` calls of ``fn`` under ``torch.profiler`` (the CPU, and CUDA on a GPU), the
    device synchronized at the end."""
    kind = torch.profiler.ProfilerActivity
    activities = [kind.CPU, *([kind.CUDA] if device.type == "cuda" else [])]
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # (kineto's start / stop lines: quiet unless a level is set)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        sync(device)
    return kernel_times(prof, device, calls)


def busy_seconds(fn: Callable[[], Any], device: torch.device, calls: int = 5) -> float:
    """Seconds the device is busy per call of ``fn``: its kernels' own times summed (:func:`kernel_times`; on a CPU
    its operators'), over ``calls`` profiled calls after one unprofiled. The host's time (Python, launches) is left
    out, so a call whose wall time is its host's (a short sequence: ``bench/triton_tune.py``'s rows at N = 197, whose
    wall time barely grew from N = 197 to 1025, ``bench/results/triton_tune_h100_dq_grad.md``) still shows what its
    kernels cost."""
    fn()
    sync(device)
    return sum(ms for ms, _ in profiled_kernel_times(fn, device, calls).values()) / 1e3


def emit(lines: list[str], out: str | Path | None = None) -> list[str]:
    """A benchmark's Markdown ``lines``: printed, and written to ``out`` where given; returned."""
    print("\n".join(lines), flush=True)
    if out:
        Path(out).write_text("\n".join(lines) + "\n")
    return lines


def medians(times: Mapping[str, list[float]]) -> dict[str, float]:
    return {k: statistics.median(v) for k, v in times.items()}


def train_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    bf16: bool = False,
    graphs: bool = False,
) -> Callable[[], None]:
    """One training step as a callable: forward (bfloat16 autocast if ``bf16``), cross-entropy, backward,
    optimizer step. ``graphs``: ``model`` is compiled with CUDA graphs (``mode="reduce-overhead"``), so each step
    first marks a new step (``torch.compiler.cudagraph_mark_step_begin``, as the training module's fast step)."""

    def step() -> None:
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        opt.zero_grad(set_to_none=True)
        ctx = torch.autocast(x.device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        with ctx:
            loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()

    return step


class StepTimer(L.Callback):
    """Lightning callback: wall time of the training steps (forward, backward, optimizer step; not the data
    loading) after ``skip`` warm-up steps. ``img_s``: images per second, None when no step was timed."""

    def __init__(self, skip: int = 0, device: torch.device | str | None = None) -> None:
        self.skip, self.device = skip, device
        self.seconds, self.images, self.seen, self._t = 0.0, 0, 0, 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        sync(self.device)
        self._t = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        sync(self.device)
        self.seen += 1
        if self.seen > self.skip:
            self.seconds += time.perf_counter() - self._t
            self.images += len(batch[0])

    @property
    def img_s(self) -> float | None:
        return self.images / self.seconds if self.seconds > 0 else None


def saved_bytes(fn: Callable[[], Any]) -> int:
    """Bytes of the tensors autograd saves for backward during ``fn()`` (distinct storages)."""
    seen: dict[int, int] = {}

    def pack(t):
        try:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        except Exception:  # noqa: BLE001 - some saved objects have no storage
            pass
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


def cpu_peak_bytes(fn: Callable[[], Any]) -> int:
    """Peak of live allocations during ``fn()`` from the profiler's memory events (CPU)."""
    from torch.profiler import ProfilerActivity, profile

    # kineto logs every trace's start and stop, and on a machine without a GPU an error probing for one (three
    # lines a run of the study): quiet unless the user set a level (read when the profiler first starts)
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    # op events carry their own (self) allocations, "[memory]" events the frees outside any op
    deltas = [
        (e.time_range.start, e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage)
        for e in prof.events()
    ]
    deltas.sort(key=lambda t: t[0])
    live = peak = 0
    for _, d in deltas:
        live += d
        peak = max(peak, live)
    return peak


def peak_bytes(fn: Callable[[], Any], device: torch.device | str) -> int:
    """Peak memory ``fn()`` adds: CUDA ``max_memory_allocated`` above what was allocated before; CPU
    :func:`cpu_peak_bytes`."""
    device = torch.device(device)
    if device.type != "cuda":
        return cpu_peak_bytes(fn)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    sync(device)
    return torch.cuda.max_memory_allocated(device) - base


def train_step_bytes(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """Memory of a training step on the CPU: weights + AdamW state (two tensors per weight) + the profiler's
    peak of live allocations during forward and backward (activations, gradients, temporaries)."""
    model.train().zero_grad(set_to_none=True)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    peak = cpu_peak_bytes(lambda: F.cross_entropy(model(x), y).backward())
    model.zero_grad(set_to_none=True)
    return 3 * weights + peak


def source_commit(path: str | Path | None = None) -> str | None:
    """The git commit of the checkout holding ``path`` (default: this package), ``+dirty`` when its tracked files
    differ from it (``git status --porcelain --untracked-files=no``) outside ``bench/results/`` (where the study
    itself writes: a resumed study is not dirty for its own results); None outside a git checkout."""
    import subprocess

    where = str(Path(path) if path is not None else Path(__file__).resolve().parent)

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", where, *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    head = git("rev-parse", "--short", "HEAD")
    if head is None:
        return None
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ":(top)", ":(top,exclude)bench/results")
    return head + ("+dirty" if changed else "")


def machine_info(device: torch.device | str = "cpu") -> dict[str, Any]:
    """The machine in words (``description``) and parts: CPU model, cores, torch threads, GPU, versions."""
    device = torch.device(device)
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    threads = torch.get_num_threads()
    desc = f"CPU: {cpu}, {os.cpu_count()} cores ({threads} torch threads)"
    desc = f"GPU: {gpu}; {desc}" if gpu else f"{desc}, no GPU"
    return dict(
        description=desc,
        cpu=cpu,
        cpu_count=os.cpu_count(),
        torch_threads=threads,
        device=device.type,
        gpu=gpu,
        torch=torch.__version__,
        python=platform.python_version(),
        platform=platform.platform(),
    )
