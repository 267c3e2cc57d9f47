"""One epoch of the default recipe through ``python train.py``'s path against a plain PyTorch loop.

Framework: ``vitrel.train.run.train`` on the composed ``conf/train.yaml`` (``trainer.max_epochs=1``, no
test; everything else as ``python train.py`` has it: the data module, the model, the LightningModule,
the default callbacks and logger, the Trainer), once with ``data.loader=memory`` and once with
``data.loader=workers``. The epoch (training plus validation and the end-of-epoch checkpoints) is timed
from inside, ``on_train_epoch_start`` to ``on_train_epoch_end``.

Plain loop: the same network (same seed), AdamW with the same parameter groups and settings, the
same warmup-cosine schedule, label-smoothed cross-entropy, gradient clipping, batch size and number of
steps, over the data set's normalised float tensors in memory (batches by index from ``randperm``),
then a validation pass (no grad) counting correct answers.

The variants take turns (``vitrel.bench.alternate``, zigzag), ``--rounds`` times; the table has
medians of the wall time and of the CPU time (the process's, plus its children's for the framework:
DataLoader workers, the W&B service), which a shared machine's load disturbs less. Then the loaders
alone (no model): training images/s of one epoch, memory vs workers, with augmentation off and on.

    OMP_NUM_THREADS=2 python bench/loader.py --rounds 5 --out bench/results/loader_cpu.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Callback

from vitrel.bench import alternate, machine_info
from vitrel.train.optim import param_groups
from vitrel.train.run import build_model, train

ROOT = Path(__file__).resolve().parents[1]


def load_average() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def cpu_seconds(tree: bool) -> float:
    """CPU seconds (user + system) used so far by this process, and with ``tree`` by its live descendants
    (``/proc``: DataLoader workers, the W&B service)."""
    if not tree:
        return time.process_time()
    tick, me, stats = os.sysconf("SC_CLK_TCK"), os.getpid(), {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                f = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(d.name)] = (int(f[1]), (int(f[11]) + int(f[12])) / tick)  # ppid, utime + stime
    total, todo = 0.0, [me]
    while todo:
        pid = todo.pop()
        total += stats.get(pid, (0, 0.0))[1]
        todo += [c for c, (ppid, _) in stats.items() if ppid == pid]
    return total


def compose_cfg(overrides: list[str], out: str):
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[*overrides, f"paths.output_dir={out}"])
    return cfg


class EpochTimer(Callback):
    """Wall seconds of each training epoch, validation and end-of-epoch checkpoints included."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.cpu: list[float] = []
        self.images = 0

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._t, self._c = time.perf_counter(), cpu_seconds(tree=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.images += len(batch[0])

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.seconds.append(time.perf_counter() - self._t)
        self.cpu.append(cpu_seconds(tree=True) - self._c)


def framework_epoch(overrides: list[str], record: dict) -> None:
    with tempfile.TemporaryDirectory() as out:
        cfg = compose_cfg(["trainer.max_epochs=1", "test=false", "progress_bar=none", *overrides], out)
        timer = EpochTimer()
        train(cfg, callbacks=[timer])
    record.setdefault("epoch_s", []).append(timer.seconds[0])
    record.setdefault("cpu_s", []).append(timer.cpu[0])
    record["images"] = timer.images


def plain_data(cfg) -> tuple[dict, object]:
    """The default data set's splits as normalised float tensors (the memory loader's values)."""
    dm = instantiate(cfg.data, loader="memory", augment=False)
    dm.setup("fit")
    out = {}
    for split in ("train", "val"):
        ds = dm.dataset(split)
        out[split] = ds.batch(torch.arange(len(ds)))
    return out, dm


def plain_epoch(cfg, data: dict, dm, record: dict) -> None:
    """One epoch of the same recipe as a plain loop; the whole call is the timed part (model built first)."""
    torch.manual_seed(int(cfg.seed))
    model = build_model(cfg.model, dm)
    lr = float(cfg.module.optimizer.lr)
    opt = instantiate(cfg.module.optimizer)(params=param_groups(model, None, lr))
    (x, y), (xv, yv) = data["train"], data["val"]
    bs, n = int(cfg.data.batch_size), len(x)
    steps = -(-n // bs)
    sched = instantiate(cfg.module.scheduler)(opt, total_steps=steps, steps_per_epoch=steps)
    smoothing, clip = float(cfg.module.label_smoothing), float(cfg.trainer.gradient_clip_val or 0)
    t, c = time.perf_counter(), cpu_seconds(tree=False)
    model.train()
    order = torch.randperm(n)
    for k in range(steps):
        idx = order[k * bs : (k + 1) * bs]
        loss = F.cross_entropy(model(x[idx]), y[idx], label_smoothing=smoothing)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
    model.eval()
    correct = 0
    with torch.no_grad():
        for k in range(0, len(xv), bs):
            correct += int((model(xv[k : k + bs]).argmax(-1) == yv[k : k + bs]).sum())
    record.setdefault("epoch_s", []).append(time.perf_counter() - t)
    record.setdefault("cpu_s", []).append(cpu_seconds(tree=False) - c)
    record["images"] = n


def loader_epoch(cfg, loader: str, augment: bool) -> float:
    """Training images/s of one epoch of the data module's loader alone (batches made, not used)."""
    dm = instantiate(cfg.data, loader=loader, augment=augment)
    dm.train_order_seed = 0
    dl = dm.train_dataloader()
    n, t = 0, time.perf_counter()
    for x, _ in dl:
        n += len(x)
    return n / (time.perf_counter() - t)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--loader-rounds", type=int, default=5)
    ap.add_argument("--no-workers", action="store_true", help="leave out the framework epoch with data.loader=workers")
    ap.add_argument("--out", type=Path, default=None, help="write the table (markdown) here")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of the recipe, as for train.py")
    args = ap.parse_args(argv)
    os.environ.setdefault("WANDB_MODE", "offline")

    cfg = compose_cfg(list(args.overrides), "unused")
    data, dm = plain_data(cfg)
    records: dict[str, dict] = {"plain": {}, "memory": {}}
    fns = {
        "plain": lambda: plain_epoch(cfg, data, dm, records["plain"]),
        "memory": lambda: framework_epoch([*args.overrides, "data.loader=memory"], records["memory"]),
    }
    if not args.no_workers:
        records["workers"] = {}
        fns["workers"] = lambda: framework_epoch([*args.overrides, "data.loader=workers"], records["workers"])
    load_before = load_average()
    print(f"load average before: {load_before}", flush=True)
    on_round = lambda r: print(f"round {r + 1}/{args.rounds}: load {load_average()}", flush=True)  # noqa: E731
    calls = alternate(fns, args.rounds, warmup=0, zigzag=True, on_round=on_round)
    load_mid = load_average()

    loader_ips: dict[str, list[float]] = {}
    for _ in range(args.loader_rounds):
        for loader in ("memory", "workers"):
            for augment in (False, True):
                loader_ips.setdefault(f"{loader}, augment={augment}", []).append(loader_epoch(cfg, loader, augment))
    load_after = load_average()

    med = {k: statistics.median(v["epoch_s"]) for k, v in records.items()}
    cpu = {k: statistics.median(v["cpu_s"]) for k, v in records.items()}
    rows = ["| path | wall s per epoch (median) | rounds (s) | train images/s | wall / plain loop "]
    rows[0] += "| CPU s per epoch (median) | CPU / plain loop | whole call s (median) |"
    rows.append("|---|---:|---|---:|---:|---:|---:|---:|")
    names = {
        "plain": "plain PyTorch loop (in-memory tensors)",
        "memory": "`train.py`, `data.loader=memory`",
        "workers": "`train.py`, `data.loader=workers`",
    }
    for k, rec in records.items():
        rs = ", ".join(f"{s:.1f}" for s in rec["epoch_s"])
        ips = rec["images"] / med[k]
        rows.append(
            f"| {names[k]} | {med[k]:.2f} | {rs} | {ips:.0f} | **{med[k] / med['plain']:.2f}x** "
            f"| {cpu[k]:.1f} | {cpu[k] / cpu['plain']:.2f}x | {statistics.median(calls[k]):.1f} |"
        )
    rows += ["", "| loader alone (one training epoch, no model) | images/s (median) | rounds |", "|---|---:|---|"]
    for k, v in loader_ips.items():
        rows.append(f"| {k} | {statistics.median(v):.0f} | {', '.join(f'{x:.0f}' for x in v)} |")
    info = machine_info("cpu")
    head = [
        f"Machine: {info.get('description', info)}",
        f"torch threads: {torch.get_num_threads()}; load average (1, 5, 15 min) before: {load_before}; "
        f"after the epochs: {load_mid}; at the end: {load_after}",
        f"Command: `{' '.join(['python', 'bench/loader.py', *(argv if argv is not None else sys.argv[1:])])}`",
        "",
    ]
    table = "\n".join(head + rows)
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
