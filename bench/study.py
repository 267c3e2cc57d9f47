"""The position-scheme study: every scheme, the same recipe and budget, several seeds, ViT and Swin.

    python bench/study.py --budget short     # CPU, about 30 min on 2 cores -> bench/results/study_short.*
    python bench/study.py --budget full      # one GPU: all 60k images, 30 epochs, 3 seeds -> study_full.*
    python bench/study.py --budget smoke --schemes none,rel2d_full --out /tmp/study   # seconds (tests)

Every run trains a model from scratch on Fashion-MNIST (``FashionMNISTDataModule(subset="full")``:
60k/10k from the configured root or ``/usr/share/datasets/fashion-mnist/``) with the framework's
:class:`~vitrel.train.ClassifierModule` (AdamW without decay on position tables, warmup + cosine,
label smoothing) and a Lightning ``Trainer``, then scores it on:

* ``test``: the test images at 28x28 (in distribution);
* ``translate<C>``: test images pasted at a seeded random offset into a black ``C x C`` canvas
  (``TranslatedDataset``), the model run on the larger grid; training never moves the images, so
  this is the translation generalisation relative position is supposed to give;
* ``shift<C>``: the same, with offsets that are multiples of the patch size (whole-patch moves: the
  patches are exactly the training ones, only their positions and the black surround change);
* ``center<C>``: the control: the image in the centre of the same canvas (also a whole-patch offset),
  so ``center`` vs ``test`` is the effect of the larger black surround alone and ``shift`` vs
  ``center`` the effect of the position alone;
* ``resize<S>``: test images upsampled (bilinear) to ``S x S`` (``ResizedDataset``), the model run on
  the larger grid: resolution generalisation.

For the windowed Swin a larger grid also changes which patches share a window (and a last stage that
is one global window at 28x28 becomes several windows), so its out-of-distribution scores mix the
position scheme with the window layout.

The model is evaluated as trained, on the larger grid: learned relative tables clamp offsets
beyond their range, ``ape`` is bicubic-resampled, fixed schemes (sin-cos, RoPE, ALiBi) are computed
for the new grid. No augmentation (it would teach translation invariance). Cost per run: parameters,
training throughput (images/s over the training steps after the first few: forward, backward and
optimizer step, no data loading), and peak memory (CUDA: ``max_memory_allocated`` over the fit; CPU:
weights + AdamW state + the profiler's peak of live allocations in one training step).

Results are written after every run into ``<out>/<name>.json`` (recipe, machine, every run,
summary), ``.csv`` (one row per architecture x scheme), ``.md`` (the tables) and ``.png`` (the plot),
plus ``<name>_pos.safetensors`` (the learned position parameters of the first seed, for the
notebooks). Rerunning the same command skips finished runs; a run interrupted mid-way restarts from
its last epoch checkpoint (``<out>/<name>_work/``). ``--budget`` is the one switch between recipes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import platform
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # the CPU memory profiler's start/stop lines
# OpenMP threads that sleep rather than spin when they wait: on a shared CPU a spinning team of
# threads loses most of its time to anything else running (4x slower here with 2 busy cores).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import lightning  # noqa: E402,F401  (import first: it sets its loggers' levels, which main() then lowers)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import vitrel  # noqa: E402
from vitrel.pos import PositionScheme, build_pos, list_pos  # noqa: E402

# ------------------------------------------------------------------------------------------ recipes
# Absolute baselines first, then the relative schemes by family (the order of the tables).
SCHEME_ORDER = (
    "none",
    "ape",
    "sincos2d",
    "rel2d_full",
    "rel2d_factored",
    "rel2d_cpb",
    "rel1d_bucket",
    "rel2d_bucket",
    "alibi1d",
    "alibi2d",
    "rope1d",
    "rope2d_axial",
    "rope2d_mixed",
    "shaw1d",
    "shaw2d_factored",
    "shaw2d_full",
)

_VIT = "vitrel_vit_tiny_patch4_32"  # patch 4: a 7x7 grid at 28x28, class-token pooling
_SWIN = "vitrel_swin_tiny_patch2_window4_32"
# Swin on the ViT's 7x7 grid of 4x4 patches: 4x4 windows (the grid padded to 8x8, padding masked), shifted
# every second block, then patch merging to a 4x4 grid (one window)
_SWIN_P4 = dict(patch_size=4, window_size=4, drop_path_rate=0.0)

BUDGETS: dict[str, dict[str, Any]] = {
    # a few seconds: the test suite
    "smoke": dict(
        subset="embedded",
        train_images=192,
        epochs=1,
        batch_size=64,
        seeds=1,
        lr=2e-3,
        weight_decay=0.05,
        warmup_epochs=0.0,
        min_lr=1e-5,
        label_smoothing=0.1,
        grad_clip=1.0,
        test_images=128,
        ood_images=64,
        translate=[44],
        center=[44],
        shift=[44],
        shift_step=4,
        resize=[40],
        timing_skip_steps=1,
        precision={"cpu": "32-true", "cuda": "32-true"},
        models={
            "vit": dict(name=_VIT, embed_dim=32, depth=1, num_heads=2, global_pool="token"),
            "swin": dict(name=_SWIN, **_SWIN_P4, embed_dim=16, depths=[1, 1], num_heads=[2, 2]),
        },
    ),
    # CPU, about 30 minutes in all on 2 cores
    "short": dict(
        subset="full",
        train_images=10240,
        epochs=1,
        batch_size=64,
        seeds=2,
        lr=3e-3,
        weight_decay=0.05,
        warmup_epochs=0.1,
        min_lr=1e-5,
        label_smoothing=0.1,
        grad_clip=1.0,
        test_images=5000,
        ood_images=1000,
        translate=[44],
        center=[44],
        shift=[44],
        shift_step=4,
        resize=[56],
        timing_skip_steps=5,
        precision={"cpu": "32-true", "cuda": "32-true"},
        models={
            "vit": dict(name=_VIT, embed_dim=48, depth=4, num_heads=4, global_pool="token"),
            "swin": dict(name=_SWIN, **_SWIN_P4, embed_dim=32, depths=[2, 2], num_heads=[2, 4]),
        },
    ),
    # one GPU: all the data, 30 epochs, 3 seeds, the README's ViT size
    "full": dict(
        subset="full",
        train_images=None,  # all 60,000
        epochs=30,
        batch_size=256,
        seeds=3,
        lr=1e-3,
        weight_decay=0.05,
        warmup_epochs=2.0,
        min_lr=1e-5,
        label_smoothing=0.1,
        grad_clip=1.0,
        test_images=None,
        ood_images=None,
        translate=[44, 60],  # 60: the centre offset (16 px) stays a whole number of patches
        center=[44, 60],
        shift=[44, 60],
        shift_step=4,
        resize=[40, 56],
        timing_skip_steps=20,
        precision={"cpu": "32-true", "cuda": "bf16-mixed"},
        models={
            "vit": dict(name=_VIT, embed_dim=128, depth=6, num_heads=4, global_pool="token"),
            "swin": dict(name=_SWIN, **_SWIN_P4, embed_dim=64, depths=[2, 4], num_heads=[4, 8]),
        },
    ),
}
EVAL_BATCH = 500
NATIVE = 28


def recipe_hash(recipe: dict) -> str:
    """Short digest of a recipe (names the folder of interrupted runs' checkpoints)."""
    import hashlib

    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:10]


def eval_names(recipe: dict) -> list[str]:
    return [
        "test",
        *(f"center{c}" for c in recipe["center"]),
        *(f"shift{c}" for c in recipe["shift"]),
        *(f"translate{c}" for c in recipe["translate"]),
        *(f"resize{s}" for s in recipe["resize"]),
    ]


def pos_config(scheme: str) -> str | dict:
    """The scheme's ``conf/pos/<scheme>.yaml`` (the options ``python train.py pos=<scheme>`` uses)."""
    path = ROOT / "conf" / "pos" / f"{scheme}.yaml"
    if not path.exists():
        return scheme
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    if cfg.get("name") != scheme:
        raise ValueError(f"{path} names {cfg.get('name')!r}, expected {scheme!r}")
    return cfg


def build_model(recipe: dict, arch: str, scheme: str) -> nn.Module:
    m = dict(recipe["models"][arch])
    name = m.pop("name")
    return vitrel.create_model(name, pos=pos_config(scheme), num_classes=10, in_chans=1, img_size=NATIVE, **m)


def scheme_family(scheme: str) -> str:
    from vitrel.viz import scheme_family as fam

    return fam(build_pos(scheme, num_heads=4, head_dim=16, grid=(3, 3), embed_dim=64))


# ------------------------------------------------------------------------------------------ data
def materialise(ds, batch: int = 1000) -> tuple[Tensor, Tensor]:
    """A dataset of ``(tensor, label)`` as two tensors (the pipelines are deterministic)."""
    loader = torch.utils.data.DataLoader(ds, batch_size=batch, num_workers=0)
    xs, ys = zip(*((x, torch.as_tensor(y)) for x, y in loader))
    return torch.cat(xs), torch.cat(ys).long()


def _subset(ds, n: int | None, seed: int):
    if n is None or n >= len(ds):
        return ds
    idx = torch.randperm(len(ds), generator=torch.Generator().manual_seed(seed))[:n]
    return torch.utils.data.Subset(ds, sorted(idx.tolist()))


class ShiftedDataset(torch.utils.data.Dataset):
    """Raw ``(image, label)`` pairs pasted into a black ``canvas`` at a seeded offset that is a multiple
    of ``step`` pixels on each axis (``translate_canvas``), then ``transform``-ed. The offset of sample
    ``i`` is drawn from ``numpy.random.default_rng([seed, i])``, uniform over the aligned offsets."""

    def __init__(self, dataset, canvas: int, step: int, transform, seed: int = 0) -> None:
        self.dataset, self.canvas, self.step, self.transform, self.seed = dataset, canvas, step, transform, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def offset(self, index: int, hw: tuple[int, int]) -> tuple[int, int]:
        import numpy as np

        rng = np.random.default_rng([self.seed, int(index)])
        return tuple(self.step * int(rng.integers(0, (self.canvas - n) // self.step + 1)) for n in hw)

    def __getitem__(self, index: int):
        from vitrel.data import translate_canvas

        img, y = self.dataset[index]
        top, left = self.offset(index, (img.height, img.width))
        return self.transform(translate_canvas(img, self.canvas, top, left)), y


def load_data(recipe: dict, root: str | None) -> dict[str, tuple[Tensor, Tensor]]:
    """Train subset and every evaluation set, as tensors; the same for every run of the study."""
    from vitrel.data import FashionMNISTDataModule, ResizedDataset, TranslatedDataset

    dm = FashionMNISTDataModule(root=root, subset=recipe["subset"], num_workers=0, download=False, seed=0)
    out = {
        "train": materialise(_subset(dm.make_dataset("train"), recipe["train_images"], seed=0)),
        "test": materialise(_subset(dm.make_dataset("test"), recipe["test_images"], seed=1)),
    }
    for c in recipe["translate"]:
        out[f"translate{c}"] = materialise(
            _subset(dm.make_dataset("test", canvas_size=c, canvas_seed=0), recipe["ood_images"], seed=2)
        )
    for c in recipe["center"]:
        ds = TranslatedDataset(dm.raw_dataset("test"), c, transform=dm.eval_transform(c), mode="center")
        out[f"center{c}"] = materialise(_subset(ds, recipe["ood_images"], seed=2))
    for c in recipe["shift"]:
        ds = ShiftedDataset(dm.raw_dataset("test"), c, recipe["shift_step"], dm.eval_transform(c), seed=0)
        out[f"shift{c}"] = materialise(_subset(ds, recipe["ood_images"], seed=2))
    for s in recipe["resize"]:
        out[f"resize{s}"] = materialise(ResizedDataset(_subset(dm.make_dataset("test"), recipe["ood_images"], 2), s))
    return out


def train_loader(x: Tensor, y: Tensor, batch_size: int, seed: int):
    """Shuffled batches of in-memory tensors (one fancy index per batch)."""
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

    ds = TensorDataset(x, y)
    sampler = BatchSampler(RandomSampler(ds, generator=torch.Generator().manual_seed(seed)), batch_size, drop_last=True)
    return DataLoader(ds, sampler=sampler, batch_size=None, num_workers=0)


# ------------------------------------------------------------------------------------------ progress
class Reporter:
    """Progress: a rich display on a terminal, plain lines otherwise (logs, nohup)."""

    def __init__(self, total_runs: int, rich: bool | None = None) -> None:
        self.rich = sys.stdout.isatty() if rich is None else rich
        self.total = total_runs
        self.done = 0
        self._progress = None
        if self.rich:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
            )
            self._runs = self._progress.add_task("runs", total=total_runs)
            self._steps = self._progress.add_task("", total=1)
            self._progress.start()

    def log(self, msg: str) -> None:
        if self._progress is not None:
            self._progress.console.print(msg)
        else:
            print(msg, flush=True)

    def run_start(self, label: str, steps: int) -> None:
        if self._progress is not None:
            self._progress.update(self._steps, description=label, total=steps, completed=0)
        else:
            self.log(f"[{self.done + 1}/{self.total}] {label}: {steps} steps")

    def step(self, completed: int, loss: float) -> None:
        if self._progress is not None:
            self._progress.update(self._steps, completed=completed)

    def epoch(self, epoch: int, epochs: int, loss: float, img_s: float) -> None:
        msg = f"    epoch {epoch}/{epochs}: train loss {loss:.3f}, {img_s:.0f} img/s"
        if self._progress is None:
            self.log(msg)

    def run_end(self, msg: str) -> None:
        self.done += 1
        if self._progress is not None:
            self._progress.update(self._runs, completed=self.done)
        self.log(msg)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()


def step_timer(reporter: Reporter, skip: int, device: torch.device):
    import lightning as L

    class StepTimer(L.Callback):
        """Wall time of the training steps (forward, backward, optimizer), after ``skip`` warm-up steps."""

        def __init__(self) -> None:
            self.seconds, self.images, self.seen, self._t = 0.0, 0, 0, 0.0
            self._epoch_loss: list[float] = []

        def _sync(self) -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self._sync()
            self._t = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self._sync()
            dt = time.perf_counter() - self._t
            self.seen += 1
            if self.seen > skip:
                self.seconds += dt
                self.images += int(batch[0].shape[0])
            loss = float(outputs["loss"]) if isinstance(outputs, dict) else float("nan")
            self._epoch_loss.append(loss)
            reporter.step(trainer.global_step, loss)

        def on_train_epoch_end(self, trainer, pl_module) -> None:
            loss = statistics.fmean(self._epoch_loss) if self._epoch_loss else float("nan")
            self._epoch_loss = []
            reporter.epoch(trainer.current_epoch + 1, trainer.max_epochs, loss, self.img_s or float("nan"))

        @property
        def img_s(self) -> float | None:
            """None when no step was timed (a resumed run whose training had already finished)."""
            return self.images / self.seconds if self.seconds > 0 else None

    return StepTimer()


# ------------------------------------------------------------------------------------------ measuring
def cpu_peak_mb(model: nn.Module, x: Tensor, y: Tensor) -> float:
    """Weights + AdamW state (2 per weight) + the profiler's peak of live allocations during one
    training step's forward and backward (activations, gradients, temporaries), in MiB."""
    from attention import cpu_peak_bytes  # bench/attention.py

    model.train()
    model.zero_grad(set_to_none=True)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())

    def step() -> None:
        F.cross_entropy(model(x), y).backward()

    peak = cpu_peak_bytes(step)
    model.zero_grad(set_to_none=True)
    return (3 * weights + peak) / 2**20


@torch.inference_mode()
def accuracy(model: nn.Module, x: Tensor, y: Tensor, device: torch.device, autocast: bool) -> float:
    model.eval()
    correct = 0
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with ctx:
        for i in range(0, len(x), EVAL_BATCH):
            xb = x[i : i + EVAL_BATCH].to(device, non_blocking=True)
            correct += int((model(xb).argmax(-1).cpu() == y[i : i + EVAL_BATCH]).sum())
    return correct / len(x)


def pos_state(model: nn.Module) -> dict[str, Tensor]:
    """The state of every position scheme of a model (tables, frequencies, embeddings), by full name."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, PositionScheme):
            for k, v in m.state_dict().items():
                out[f"{name}.{k}"] = v.detach().float().cpu().contiguous()
    return out


def machine_info(device: torch.device) -> dict[str, Any]:
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


# ------------------------------------------------------------------------------------------ one run
def run_one(
    recipe: dict,
    arch: str,
    scheme: str,
    seed: int,
    data: dict[str, tuple[Tensor, Tensor]],
    device: torch.device,
    workdir: Path,
    reporter: Reporter,
) -> tuple[dict, nn.Module]:
    import lightning as L

    from vitrel.train.callbacks import LastCheckpoint
    from vitrel.train.module import ClassifierModule

    L.seed_everything(seed, workers=True, verbose=False)
    model = build_model(recipe, arch, scheme)
    params = sum(p.numel() for p in model.parameters())
    module = ClassifierModule(
        model,
        10,
        lr=recipe["lr"],
        weight_decay=recipe["weight_decay"],
        warmup_epochs=recipe["warmup_epochs"],
        min_lr=recipe["min_lr"],
        label_smoothing=recipe["label_smoothing"],
    )
    x, y = data["train"]
    loader = train_loader(x, y, recipe["batch_size"], seed)
    timer = step_timer(reporter, recipe["timing_skip_steps"], device)
    precision = recipe["precision"][device.type]
    trainer = L.Trainer(
        accelerator=device.type,
        devices=1,
        max_epochs=recipe["epochs"],
        precision=precision,
        gradient_clip_val=recipe["grad_clip"],
        logger=False,
        callbacks=[timer, LastCheckpoint(dirpath=str(workdir))],
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=str(workdir),
    )
    last = workdir / "last.ckpt"
    reporter.run_start(f"{arch} {scheme} seed {seed}", recipe["epochs"] * len(loader))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    trainer.fit(module, train_dataloaders=loader, ckpt_path=str(last) if last.exists() else None)
    fit_s = time.perf_counter() - t0
    model = module.model.to(device)
    if device.type == "cuda":
        peak_mb = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        peak_mb = cpu_peak_mb(model, x[: recipe["batch_size"]].to(device), y[: recipe["batch_size"]].to(device))
    t1 = time.perf_counter()
    accs = {
        f"{k}_acc": accuracy(model, *data[k], device, autocast=precision.startswith("bf16")) for k in eval_names(recipe)
    }
    loss = trainer.callback_metrics.get("train/loss_epoch")
    record = dict(
        arch=arch,
        scheme=scheme,
        seed=seed,
        family=scheme_family(scheme),
        params=params,
        **accs,
        train_img_s=timer.img_s,
        peak_mem_mb=peak_mb,
        fit_s=fit_s,
        eval_s=time.perf_counter() - t1,
        steps=trainer.global_step,
        epochs=trainer.current_epoch,
        final_train_loss=float(loss) if loss is not None else None,
        device=device.type,
        finished=time.strftime("%Y-%m-%d %H:%M:%S"),
    )
    return record, model


def measure_cost(
    recipe: dict, pairs: list[tuple[str, str]], device: torch.device, rounds: int, steps: int, reporter: Reporter
) -> dict[str, dict]:
    """Training throughput of every (arch, scheme), timed in alternation, round after round.

    On a shared machine the load drifts during a study, so the runs' own throughputs are not
    comparable between schemes; here every model (seed 0 initialisation, the recipe's batch) takes
    ``steps`` training steps (forward, loss, backward, AdamW step) per round, the models taking turns,
    and each gets the median of its rounds. Returns ``{"arch/scheme": {"img_s": ..., "rounds": [...]}}``.
    """
    bs = recipe["batch_size"]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(bs, 1, NATIVE, NATIVE, generator=g).to(device)
    y = torch.randint(0, 10, (bs,), generator=g).to(device)
    bf16 = recipe["precision"][device.type].startswith("bf16")

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def make_step(model: nn.Module, opt: torch.optim.Optimizer):
        def step() -> None:
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
                loss = F.cross_entropy(model(x).float(), y)
            loss.backward()
            opt.step()

        return step

    fns = {}
    for arch, scheme in pairs:
        torch.manual_seed(0)
        model = build_model(recipe, arch, scheme).to(device).train()
        fns[f"{arch}/{scheme}"] = make_step(model, torch.optim.AdamW(model.parameters(), lr=recipe["lr"]))
        for _ in range(2):
            fns[f"{arch}/{scheme}"]()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(rounds):
        for k, fn in fns.items():
            sync()
            t = time.perf_counter()
            for _ in range(steps):
                fn()
            sync()
            times[k].append((time.perf_counter() - t) / steps)
        reporter.log(f"cost: round {r + 1}/{rounds} timed")
    return {k: dict(img_s=bs / statistics.median(v), rounds=[bs / t for t in v]) for k, v in times.items()}


# ------------------------------------------------------------------------------------------ results
def summarise(runs: list[dict], recipe: dict, cost: dict | None = None) -> list[dict]:
    """One row per (architecture, scheme): mean and sample std over seeds (and the alternating
    throughput measurement, ``bench_img_s``, when there is one)."""
    metrics = [f"{k}_acc" for k in eval_names(recipe)] + ["train_img_s", "peak_mem_mb", "fit_s"]
    order = {s: i for i, s in enumerate(SCHEME_ORDER)}
    keys = sorted(
        {(r["arch"], r["scheme"]) for r in runs}, key=lambda k: (k[0] != "vit", k[0], order.get(k[1], 99), k[1])
    )
    rows = []
    for arch, scheme in keys:
        rs = sorted((r for r in runs if r["arch"] == arch and r["scheme"] == scheme), key=lambda r: r["seed"])
        row: dict[str, Any] = dict(
            arch=arch, scheme=scheme, family=rs[0]["family"], seeds=len(rs), params=rs[0]["params"]
        )
        for m in metrics:
            vals = [float(r[m]) for r in rs if r.get(m) is not None and not math.isnan(float(r[m]))]
            row[f"{m}_mean"] = statistics.fmean(vals) if vals else None
            row[f"{m}_std"] = statistics.stdev(vals) if len(vals) > 1 else None
        if cost is not None:
            row["bench_img_s"] = cost.get(f"{arch}/{scheme}", {}).get("img_s")
        rows.append(row)
    return rows


def _pct(row: dict, m: str) -> str:
    mean, std = row.get(f"{m}_mean"), row.get(f"{m}_std")
    if mean is None:
        return "-"
    return f"{100 * mean:.1f} ± {100 * std:.1f}" if std is not None else f"{100 * mean:.1f}"


def markdown(state: dict) -> str:
    recipe, rows = state["recipe"], state["summary"]
    evals = eval_names(recipe)
    n_runs = len(state["runs"])
    seeds = sorted({r["seed"] for r in state["runs"]})
    lines = [
        f"# Position-scheme study on Fashion-MNIST (budget `{state['budget']}`)",
        "",
        f"- Command: `{state['command']}`",
        f"- Machine: {state['machine']['description']}; torch {state['machine']['torch']}",
        f"- Wall time: {state['wall_s'] / 60:.1f} min in all ({n_runs} runs, seeds {seeds})",
        f"- Recipe: {_recipe_line(recipe)}",
        f"- Accuracy in %, mean ± sample std over seeds. `test`: {_n(recipe['test_images'], 10000)} test images at "
        f"28x28. `translate<C>`: {_n(recipe['ood_images'], 10000)} test images pasted at seeded random offsets into a "
        f"black CxC canvas; `shift<C>`: the same with offsets in whole patches ({recipe['shift_step']} px); "
        "`center<C>`: the image in the centre of the canvas (control: the black surround without the move). "
        "`resize<S>`: the same images upsampled (bilinear) to SxS. All four run the 28x28-trained model on the "
        "larger grid.",
        "- Cost: `img/s` = training images per second (forward, backward, AdamW step; batch "
        f"{recipe['batch_size']}), "
        + (
            f"timed with every model taking turns ({state['cost_rounds']} rounds of {state['cost_steps']} steps, "
            "median), so that load on the machine hits every scheme alike"
            if state.get("cost")
            else "over each run's training steps after warm-up"
        )
        + "; `peak MB` = "
        + (
            "CUDA max_memory_allocated over the fit."
            if state["machine"]["device"] == "cuda"
            else "weights + AdamW state + profiler peak of one training step's forward and backward (CPU)."
        ),
        "",
    ]
    for arch in dict.fromkeys(r["arch"] for r in rows):
        sub = [r for r in rows if r["arch"] == arch]
        m = recipe["models"][arch]
        lines += [f"## {arch}: {_model_line(m)}", ""]
        head = ["scheme", "family", "params", *evals, "img/s", "peak MB"]
        lines += ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 3 + ["---:"] * (len(head) - 3)) + "|"]
        for r in sub:
            thr = r.get("bench_img_s") or r.get("train_img_s_mean")
            mem = r.get("peak_mem_mb_mean")
            cells = [
                r["scheme"],
                r["family"],
                f"{r['params'] / 1e3:.1f}k",
                *(_pct(r, f"{e}_acc") for e in evals),
                f"{thr:.0f}" if thr else "-",
                f"{mem:.0f}" if mem else "-",
            ]
            lines.append("| " + " | ".join(cells) + " |")
        lines += ["", f"Family means ({arch}, mean over the schemes of a family of their seed means):", ""]
        lines += ["| family | schemes | " + " | ".join(evals) + " |", "|---|---|" + "---:|" * len(evals)]
        for fam in dict.fromkeys(r["family"] for r in sub):
            fr = [r for r in sub if r["family"] == fam]
            cells = []
            for e in evals:
                v = [r[f"{e}_acc_mean"] for r in fr if r.get(f"{e}_acc_mean") is not None]
                cells.append(f"{100 * statistics.fmean(v):.1f}" if v else "-")
            lines.append(f"| {fam} | {', '.join(r['scheme'] for r in fr)} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def _n(n: int | None, total: int) -> str:
    return f"{total:,}" if n is None else f"{n:,}"


def _model_line(m: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in m.items())


def _recipe_line(r: dict) -> str:
    return (
        f"{_n(r['train_images'], 60000)} training images ({r['subset']} set), {r['epochs']} epochs, batch "
        f"{r['batch_size']}, AdamW lr {r['lr']} wd {r['weight_decay']}, warmup {r['warmup_epochs']} epochs + cosine, "
        f"label smoothing {r['label_smoothing']}, grad clip {r['grad_clip']}, no augmentation"
    )


def write_results(state: dict, out: Path, name: str) -> None:
    """JSON (everything), CSV (summary), Markdown and PNG, each written atomically."""
    import csv
    import io

    from vitrel.viz import plot_study

    state["summary"] = summarise(state["runs"], state["recipe"], state.get("cost"))
    _atomic(out / f"{name}.json", json.dumps(state, indent=1))
    buf = io.StringIO()
    if state["summary"]:
        w = csv.DictWriter(buf, fieldnames=list(state["summary"][0]), lineterminator="\n")
        w.writeheader()
        w.writerows({k: ("" if v is None else v) for k, v in r.items()} for r in state["summary"])
    _atomic(out / f"{name}.csv", buf.getvalue())
    _atomic(out / f"{name}.md", markdown(state))
    if state["summary"]:
        fig = plot_study(state["summary"], title=f"{name}: {state['machine']['description']}", chance=0.1)
        tmp = out / f".{name}.png.tmp"
        fig.savefig(tmp, dpi=110, format="png")
        os.replace(tmp, out / f"{name}.png")


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_pos(path: Path, key: str, state: dict[str, Tensor], cfg: dict) -> None:
    """Add one model's position state under ``<key>/`` to a safetensors file (with its vitrel_cfg)."""
    from safetensors.torch import load_file, save_file

    tensors, meta = {}, {}
    if path.exists():
        from safetensors import safe_open

        tensors = load_file(str(path))
        with safe_open(str(path), "pt") as f:
            meta = dict(f.metadata() or {})
    tensors = {k: v for k, v in tensors.items() if not k.startswith(f"{key}/")}
    tensors.update({f"{key}/{k}": v for k, v in state.items()})
    meta[key] = json.dumps(cfg)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", choices=sorted(BUDGETS), default="short", help="the recipe (default: short)")
    ap.add_argument("--schemes", default=None, help="comma-separated (default: every registered scheme)")
    ap.add_argument("--archs", default="vit,swin", help="comma-separated subset of vit,swin")
    ap.add_argument("--seeds", type=int, default=None, help="number of seeds (default: the budget's)")
    ap.add_argument("--out", default=str(HERE / "results"), help="results folder (default bench/results)")
    ap.add_argument("--name", default=None, help="results file stem (default study_<budget>)")
    ap.add_argument("--data-root", default=None, help="Fashion-MNIST IDX folder (default: the usual places)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    ap.add_argument("--max-runs", type=int, default=None, help="stop after this many new runs (resume later)")
    ap.add_argument("--restart", action="store_true", help="discard earlier results of this study")
    ap.add_argument("--progress", choices=["auto", "rich", "lines"], default="auto")
    ap.add_argument("--cost-rounds", type=int, default=5, help="rounds of the alternating throughput timing")
    ap.add_argument("--cost-steps", type=int, default=10, help="training steps per model and round")
    ap.add_argument("--remeasure-cost", action="store_true", help="time the throughput again")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    recipe = BUDGETS[args.budget]
    name = args.name or f"study_{args.budget}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    elif device.type == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
    for lg in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(lg).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*(does not have many workers|validation_step|val_dataloader).*")
    warnings.filterwarnings("ignore", message=".*resampl.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")

    known = list_pos()
    schemes = [s for s in SCHEME_ORDER if s in known] + [s for s in known if s not in SCHEME_ORDER]
    if args.schemes:
        schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
        bad = [s for s in schemes if s not in known]
        if bad:
            raise SystemExit(f"unknown scheme(s) {bad}; known: {', '.join(known)}")
    archs = [a.strip() for a in args.archs.split(",") if a.strip()]
    bad = [a for a in archs if a not in recipe["models"]]
    if bad:
        raise SystemExit(f"unknown architecture(s) {bad}; choose from {sorted(recipe['models'])}")
    seeds = list(range(args.seeds if args.seeds is not None else recipe["seeds"]))

    path = out / f"{name}.json"
    command = "python bench/study.py " + " ".join(sys.argv[1:] if argv is None else argv)
    state: dict[str, Any] = dict(budget=args.budget, recipe=recipe, command=command, wall_s=0.0, runs=[])
    if path.exists() and not args.restart:
        old = json.loads(path.read_text())
        if old.get("recipe") != json.loads(json.dumps(recipe)):
            diff = sorted(k for k in set(recipe) | set(old.get("recipe", {})) if old["recipe"].get(k) != recipe.get(k))
            raise SystemExit(
                f"{path} holds a study made with another recipe (differs in: {', '.join(diff)}); "
                "rerun with --restart to discard it, or give another --name"
            )
        state.update(runs=old["runs"], wall_s=float(old.get("wall_s", 0.0)))
        state.update({k: old[k] for k in ("cost", "cost_rounds", "cost_steps") if k in old})
    elif args.restart:
        for p in out.glob(f"{name}*"):
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink()
    wall_before = state["wall_s"]
    state["machine"] = machine_info(device)
    done = {(r["arch"], r["scheme"], r["seed"]) for r in state["runs"]}
    todo = [(a, s, seed) for seed in seeds for a in archs for s in schemes if (a, s, seed) not in done]
    if args.max_runs is not None:
        todo = todo[: args.max_runs]
    skipped = len(seeds) * len(archs) * len(schemes) - len(todo)
    rich = {"auto": None, "rich": True, "lines": False}[args.progress]
    reporter = Reporter(len(todo), rich=rich)
    reporter.log(
        f"{name}: {len(todo)} runs to do ({skipped} of the selection already done or deferred) on "
        f"{state['machine']['description']}"
    )
    try:
        if todo:
            t = time.perf_counter()
            data = load_data(recipe, args.data_root)
            reporter.log(
                f"data ready in {time.perf_counter() - t:.1f} s: "
                + ", ".join(f"{k} {tuple(v[0].shape)}" for k, v in data.items())
            )
        for arch, scheme, seed in todo:
            workdir = out / f"{name}_work" / recipe_hash(recipe) / f"{arch}_{scheme}_seed{seed}"
            resumed = (workdir / "last.ckpt").exists()
            record, model = run_one(recipe, arch, scheme, seed, data, device, workdir, reporter)
            record["resumed"] = resumed
            state["runs"].append(record)
            state["wall_s"] = wall_before + time.perf_counter() - t_start
            if seed == seeds[0]:
                save_pos(out / f"{name}_pos.safetensors", f"{arch}/{scheme}", pos_state(model), model.vitrel_cfg)
            write_results(state, out, name)
            shutil.rmtree(workdir, ignore_errors=True)
            accs = "  ".join(
                f"{k.removesuffix('_acc')} {100 * v:.1f}%" for k, v in record.items() if k.endswith("_acc")
            )
            reporter.run_end(
                f"    {arch} {scheme} seed {seed}: {accs}  |  {record['train_img_s'] or float('nan'):.0f} img/s, "
                f"{record['peak_mem_mb']:.0f} MB, fit {record['fit_s']:.0f} s, eval {record['eval_s']:.0f} s"
            )
    finally:
        reporter.close()
        for d in (out / f"{name}_work" / recipe_hash(recipe), out / f"{name}_work"):
            with contextlib.suppress(OSError):
                d.rmdir()
    # the selection complete: time every model's throughput in alternation (once; --remeasure-cost again)
    finished = {(r["arch"], r["scheme"], r["seed"]) for r in state["runs"]}
    wanted = [(a, s) for a in archs for s in schemes]
    complete = all((a, s, seed) in finished for a, s in wanted for seed in seeds)
    cost = state.get("cost") or {}
    if complete and args.cost_rounds > 0 and (args.remeasure_cost or any(f"{a}/{s}" not in cost for a, s in wanted)):
        reporter.log(f"cost: timing {len(wanted)} models in alternation ({args.cost_rounds} rounds)")
        cost.update(measure_cost(recipe, wanted, device, args.cost_rounds, args.cost_steps, reporter))
        state.update(cost=cost, cost_rounds=args.cost_rounds, cost_steps=args.cost_steps)
        state["wall_s"] = wall_before + time.perf_counter() - t_start
        write_results(state, out, name)
    elif not todo and state["runs"]:
        write_results(state, out, name)
    reporter.log(
        f"done in {time.perf_counter() - t_start:.0f} s (study wall time so far {state['wall_s'] / 60:.1f} min); "
        f"results in {out}/{name}.{{json,csv,md,png}}"
    )
    return state


if __name__ == "__main__":
    main()
