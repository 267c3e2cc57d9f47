"""The position-scheme study: the schemes on one recipe, several seeds, ViT and Swin, with intervals and verdicts.

    python bench/study.py --budget cpu              # 2 CPU cores, about 90 min -> bench/results/study_cpu.*
    python bench/study.py --budget gpu --jobs 8     # one GPU lease: every scheme and variant -> study_gpu.*
    python bench/study.py --budget smoke --schemes none,rel2d_full --out /tmp/study   # seconds (tests)

A thin layer over the training framework: budget ``B``'s recipe is ``conf/experiment/study_B.yaml`` (shared
parts in ``study_base.yaml``); a run is ``python train.py experiment=study_B pos=<scheme> seed=<k>
<study.archs.<arch>>`` (a ``study.variants`` label stands for a scheme with options), composed with Hydra's
compose API and trained by ``vitrel.train.run.train``. Fixed-canvas translation: every image is a 40x40
canvas, the 28x28 image at an offset from the ``seen`` block in training; the trained model is scored on
``study.evals`` (the seen offsets, the held-out ``unseen`` ones, whole-patch / sub-patch moves, the canvas
resized 1.5x / 2x), then fine-tuned at the larger size (``study.finetune``, from its last checkpoint through
``vitrel.load_model``) and scored again. Cost per run: parameters, training images/s, peak memory; once the
selection is complete, every model's throughput again, the models taking turns (``vitrel.bench.alternate``).

Reading (``vitrel.stats``): mean and 95 % interval over seeds per cell, paired differences against ``none``
and ``ape``, and a verdict on each of ``study.claims`` (reproduced / contradicted / not resolved).

Written after every run: ``<out>/<name>.json`` (recipe, machine, runs, summary, claims), ``.csv``, ``.md``,
``.png`` and ``<name>_pos.safetensors`` (the first seed's position parameters, for the notebooks). Rerunning
skips finished runs (claims and unused variants may change meanwhile); an interrupted run resumes from its last
checkpoint in ``<out>/<name>_work/``. ``--jobs N`` runs N worker processes (``--shard i/N``) that share the
to-do list and are merged into the same files.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import hashlib
import io
import json
import logging
import math
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

# OpenMP threads that sleep rather than spin when they wait: on a shared CPU a spinning team of
# threads loses most of its time to anything else running (4x slower here with 2 busy cores).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from hydra import compose as hydra_compose  # noqa: E402
from hydra import initialize_config_dir  # noqa: E402
from hydra.utils import instantiate  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from vitrel.bench import StepTimer, alternate, machine_info, train_step, train_step_bytes  # noqa: E402
from vitrel.pos import PositionScheme, get_pos_class, list_pos  # noqa: E402
from vitrel.stats import chain_verdict, mean_ci, paired_diff, verdict  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BUDGETS = sorted(p.stem.removeprefix("study_") for p in (ROOT / "conf" / "experiment").glob("study_*.yaml"))
BUDGETS = [b for b in BUDGETS if not b.startswith("base")]  # study_base*.yaml: shared parts
# absolute baselines first, then the relative schemes by family (the order of the tables)
SCHEME_ORDER = (
    "none ape sincos2d rel2d_full rel2d_factored rel2d_cpb rel1d_bucket rel2d_bucket alibi1d alibi2d "
    "rope1d rope2d_axial rope2d_mixed shaw1d shaw2d_factored shaw2d_full"
).split()
# a run's config minus these keys is its recipe (where things go, the display, which scheme and seed)
NOT_RECIPE = ("paths", "seed", "pos", "progress_bar", "ckpt_path", "resume", "task_name", "study")


def compose(budget: str, overrides: list[str], output_dir: str | Path = "<run folder>") -> DictConfig:
    """``conf/train.yaml`` + ``experiment=study_<budget>`` + ``overrides``, as ``python train.py`` composes it."""
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = hydra_compose("train", [f"experiment=study_{budget}", *overrides])
    cfg.paths.output_dir = str(output_dir)  # instead of Hydra's job folder
    return cfg


def recipe(budget: str, extra: list[str] = ()) -> dict:
    """The ``study`` block and each architecture's resolved run config (less the per-run keys)."""
    study = OmegaConf.to_container(compose(budget, list(extra)).study, resolve=True)
    runs = {}
    for arch, arch_overrides in study["archs"].items():
        cfg = OmegaConf.to_container(compose(budget, [*extra, *arch_overrides]), resolve=True)
        cfg["data"].pop("root", None), cfg["model"].pop("pos", None)
        runs[arch] = {k: v for k, v in cfg.items() if k not in NOT_RECIPE}
    return dict(budget=budget, overrides=list(extra), study=study, runs=runs)


def _subset(ds, n: int | None, seed: int):
    idx = torch.randperm(len(ds), generator=torch.Generator().manual_seed(seed))[:n]
    return ds if n is None or n >= len(ds) else torch.utils.data.Subset(ds, sorted(idx.tolist()))


def eval_sets(study: dict, dm) -> dict[str, torch.utils.data.Dataset]:
    """``study.evals`` of the data module's test split: the in-distribution set (``test``: ``test_images``,
    seeded subset 1) and the others (the same ``ood_images`` test images each, seeded subset 2), each image
    in a black canvas at a seeded offset of the eval's region (``mode``, ``grid_step``, ``off_step``) and/or
    resized."""
    from vitrel.data import ResizedDataset, TranslatedDataset

    out = {}
    for name, e in study["evals"].items():
        ds, ood = dm.make_dataset("test"), name != "test"
        if "canvas" in e:
            c, mode = e["canvas"], e.get("mode", "random")
            ds = TranslatedDataset(
                dm.raw_dataset("test"), c, 0, dm.eval_transform(c), mode, grid_step=e.get("grid_step", 1),
                off_step=e.get("off_step", 1),
            )  # fmt: skip
        ds = _subset(ds, study["ood_images" if ood else "test_images"], seed=2 if ood else 1)
        out[name] = ResizedDataset(ds, e["resize"]) if "resize" in e else ds
    return out


def materialise(ds, batch: int = 1000) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*((x, torch.as_tensor(y)) for x, y in torch.utils.data.DataLoader(ds, batch_size=batch)))
    return torch.cat(xs), torch.cat(ys).long()


@torch.inference_mode()
def accuracy(model, x, y, device, batch: int, bf16: bool) -> float:
    hits = 0
    with torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
        for i in range(0, len(x), batch):
            hits += int((model.eval()(x[i : i + batch].to(device)).argmax(-1).cpu() == y[i : i + batch]).sum())
    return hits / len(x)


class Probe(StepTimer):
    """Times the training steps; keeps the trained network and the step count."""

    def on_fit_end(self, trainer, pl_module) -> None:
        self.model, self.steps, self.epochs = pl_module.model, trainer.global_step, trainer.current_epoch


def run_one(
    cfg: DictConfig, study: dict, data: dict, device: torch.device, ft_cfg: DictConfig | None = None
) -> tuple[dict, torch.nn.Module]:
    """Train ``cfg``, score the model on every evaluation set; with ``ft_cfg``, fine-tune it at the larger
    size (``ft_cfg.model`` loads the trained weights) and score that on ``study.finetune.eval``."""
    from vitrel.train.run import train

    probe = Probe(study["timing_skip_steps"], device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    metrics = train(cfg, callbacks=[probe])
    fit_s, model = time.perf_counter() - t0, probe.model.to(device)
    x, y = (t[: int(cfg.data.batch_size)] for t in data["test"])
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else train_step_bytes(model, x, y)
    t1, bf16 = time.perf_counter(), str(cfg.trainer.precision).startswith("bf16")
    accs = {f"{k}_acc": accuracy(model, *v, device, study["eval_batch_size"], bf16) for k, v in data.items()}
    loss, eval_s = metrics.get("train/loss_epoch"), time.perf_counter() - t1
    record = dict(params=sum(p.numel() for p in model.parameters()), **accs, train_img_s=probe.img_s)  # None: no step
    record.update(peak_mem_mb=peak / 2**20, fit_s=fit_s, eval_s=eval_s, steps=probe.steps, epochs=probe.epochs)
    record.update(final_train_loss=None if loss is None else float(loss), device=device.type)
    if ft_cfg is not None:
        ft_probe, t2 = Probe(study["timing_skip_steps"], device), time.perf_counter()
        train(ft_cfg, callbacks=[ft_probe])
        ev = study["finetune"]["eval"]
        record[f"ft_{ev}_acc"] = accuracy(ft_probe.model.to(device), *data[ev], device, study["eval_batch_size"], bf16)
        record.update(ft_fit_s=time.perf_counter() - t2, ft_steps=ft_probe.steps)
    return {**record, "finished": time.strftime("%Y-%m-%d %H:%M:%S")}, model


def finetune_cfg(cfg: DictConfig, study: dict, overrides: list[str], budget: str) -> DictConfig | None:
    """The fine-tune run of ``cfg``'s run: the same overrides plus ``study.finetune``'s, the input at
    ``finetune.img_size``, the model loaded from the run's last checkpoint (``vitrel.load_model``: learned
    tables and absolute embeddings resized to the new grid)."""
    ft = study.get("finetune")
    if not ft:
        return None
    run_dir = Path(cfg.paths.output_dir)
    over = [*overrides, *ft["overrides"], f"data.img_size={ft['img_size']}"]
    ft_cfg = compose(budget, over, run_dir.with_name(run_dir.name + "_ft"))
    last = str(run_dir / "checkpoints" / "last.ckpt")
    ft_cfg.model = OmegaConf.create({"_target_": "vitrel.load_model", "path": last, "architecture": cfg.model.name})
    return ft_cfg


def measure_cost(cfgs: dict[str, DictConfig], device, rounds: int, steps: int) -> dict[str, dict]:
    """Training images/s of every ``"arch/scheme"`` config (seed-0 initialisation, the recipe's batch of random
    images): ``steps`` training steps per model and round, the models taking turns; the median of the rounds."""
    from vitrel.train.run import build_model

    fns, bs = {}, 0
    for key, cfg in cfgs.items():
        dm, bs, g = instantiate(cfg.data), int(cfg.data.batch_size), torch.Generator().manual_seed(0)
        torch.manual_seed(0)
        model = build_model(cfg.model, dm).to(device).train()
        x = torch.randn(bs, *dm.input_size, generator=g).to(device)
        y = torch.randint(0, dm.num_classes, (bs,), generator=g).to(device)
        bf16 = str(cfg.trainer.precision).startswith("bf16")
        fns[key] = train_step(model, torch.optim.AdamW(model.parameters()), x, y, bf16)
    on_round = lambda r: print(f"cost: round {r + 1}/{rounds} timed")  # noqa: E731
    times = alternate(fns, rounds, warmup=2, repeat=steps, device=device, on_round=on_round)
    return {k: dict(img_s=bs / statistics.median(v), rounds=[bs / t for t in v]) for k, v in times.items()}


def save_pos(path: Path, key: str, model: torch.nn.Module) -> None:
    """Add the state of a model's position schemes under ``<key>/`` to a safetensors file (with its vitrel_cfg)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    tensors, meta = {}, {}
    if path.exists():
        with safe_open(str(path), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys() if not k.startswith(f"{key}/")}
            meta = dict(f.metadata() or {})
    for name, m in model.named_modules():
        for k, v in m.state_dict().items() if isinstance(m, PositionScheme) else ():
            tensors[f"{key}/{name}.{k}"] = v.detach().float().cpu().contiguous()
    meta[key] = json.dumps(model.vitrel_cfg)
    save_file(tensors, str(path.with_name(f".{path.name}.tmp")), metadata=meta)
    os.replace(path.with_name(f".{path.name}.tmp"), path)


def acc_metrics(study: dict) -> list[str]:
    """The accuracy columns of a study: every evaluation set, the fine-tuned one, then the differences
    ``study.derived`` (``name: [a, b]``: ``a``'s accuracy minus ``b``'s, within each run)."""
    ft = study.get("finetune")
    accs = [f"{k}_acc" for k in study["evals"]] + ([f"ft_{ft['eval']}_acc"] if ft else [])
    return accs + list(study.get("derived") or {})


def with_derived(runs: list[dict], study: dict) -> list[dict]:
    """The runs with ``study.derived``'s within-run differences added (a position cost per model: the
    same trained model on held-out offsets against the training offsets)."""
    out = []
    for r in runs:
        r = dict(r)
        for name, (a, b) in (study.get("derived") or {}).items():
            va, vb = r.get(f"{a}_acc"), r.get(f"{b}_acc")
            r[name] = None if va is None or vb is None else float(va) - float(vb)
        out.append(r)
    return out


def metric_key(study: dict, name: str) -> str:
    """The run key of an evaluation (``<name>_acc``) or of a derived difference (``<name>``)."""
    return name if name in (study.get("derived") or {}) else f"{name}_acc"


def _by_seed(runs: list[dict], arch: str, scheme: str, m: str) -> dict[int, float]:
    return {
        r["seed"]: float(r[m])
        for r in runs
        if (r["arch"], r["scheme"]) == (arch, scheme) and r.get(m) is not None and not math.isnan(float(r[m]))
    }


def summarise(state: dict) -> list[dict]:
    """One row per (architecture, scheme): mean, sample std and 95 % interval over seeds of every metric,
    the paired differences of the accuracies against ``none`` and ``ape`` (same seeds), the throughput."""
    cost, study = state.get("cost") or {}, state["recipe"]["study"]
    runs = with_derived(state["runs"], study)
    accs = acc_metrics(study)
    metrics = accs + ["train_img_s", "peak_mem_mb", "fit_s"]
    archs = list(study["archs"])
    key = lambda k: (archs.index(k[0]) if k[0] in archs else 99, _scheme_key(k[1]))  # noqa: E731
    keys = sorted({(r["arch"], r["scheme"]) for r in runs}, key=key)
    rows = []
    for arch, scheme in keys:
        rs = [r for r in runs if (r["arch"], r["scheme"]) == (arch, scheme)]
        row: dict[str, Any] = dict(arch=arch, scheme=scheme, family=rs[0]["family"], seeds=len(rs))
        row["params"] = rs[0]["params"]
        for m in metrics:
            ci = mean_ci(list(_by_seed(runs, arch, scheme, m).values()))
            row.update({f"{m}_mean": ci["mean"], f"{m}_std": ci["sd"], f"{m}_lo": ci["lo"], f"{m}_hi": ci["hi"]})
        for base in ("none", "ape"):
            for m in accs:
                d = paired_diff(_by_seed(runs, arch, scheme, m), _by_seed(runs, arch, base, m))
                ok = base != scheme and d["n"] > 0
                row.update({f"{m}_vs_{base}_{k}": d[k] if ok else None for k in ("mean", "lo", "hi")})
        rows.append({**row, "bench_img_s": cost.get(f"{arch}/{scheme}", {}).get("img_s")})
    return rows


def claims(state: dict) -> list[dict]:
    """The verdict on each of ``study.claims`` per architecture, from paired differences (``vitrel.stats``).

    ``better: [A, B, C]``: the links ``A - B`` and ``B - C``; ``best: A``: ``A - X`` for every other scheme
    ``X`` of the study. A claim needs all its schemes; links with fewer than 2 shared seeds are not resolved.
    """
    study = state["recipe"]["study"]
    runs = with_derived(state["runs"], study)
    out = []
    for cid, c in (study.get("claims") or {}).items():
        m = metric_key(study, c["eval"])
        for arch in dict.fromkeys(r["arch"] for r in runs):
            have = {r["scheme"] for r in runs if r["arch"] == arch}
            if "better" in c:
                pairs = list(zip(c["better"][:-1], c["better"][1:]))
            else:  # best: against every other scheme (not its own variants)
                pairs = [(c["best"], x) for x in sorted(have, key=_scheme_key) if not x.startswith(c["best"])]
            if not pairs or any(a not in have or b not in have for a, b in pairs):
                continue
            links = []
            for a, b in pairs:
                d = paired_diff(_by_seed(runs, arch, a, m), _by_seed(runs, arch, b, m))
                links.append(dict(a=a, b=b, mean=d["mean"], lo=d["lo"], hi=d["hi"], n=d["n"], verdict=verdict(d)))
            out.append(dict(claim=cid, title=c["title"], arch=arch, eval=c["eval"], links=links,
                            verdict=chain_verdict([x["verdict"] for x in links])))  # fmt: skip
    return out


def _scheme_key(s: str) -> tuple:
    base = next((b for b in sorted(SCHEME_ORDER, key=len, reverse=True) if s.startswith(b)), s)
    return (SCHEME_ORDER.index(base) if base in SCHEME_ORDER else 99, s)


def _pct(row: dict, m: str) -> str:
    mean, lo, hi = row.get(f"{m}_mean"), row.get(f"{m}_lo"), row.get(f"{m}_hi")
    if mean is None:
        return "-"
    return f"{100 * mean:.1f}" + ("" if lo is None else f" [{100 * lo:.1f}, {100 * hi:.1f}]")


def _pp(mean, lo, hi) -> str:
    """A difference in percentage points with its interval."""
    if mean is None:
        return "-"
    return f"{100 * mean:+.1f}" + ("" if lo is None else f" [{100 * lo:+.1f}, {100 * hi:+.1f}]")


def markdown(state: dict) -> str:
    rec, rows, study, machine = state["recipe"], state["summary"], state["recipe"]["study"], state["machine"]
    evals, cfg = [m.removesuffix("_acc") for m in acc_metrics(study)], next(iter(rec["runs"].values()))
    key = {e: metric_key(study, e) for e in evals}
    t = cfg["trainer"]
    opt = {**cfg["module"]["optimizer"], **(cfg["module"]["scheduler"] or {})}
    n = {k: "all" if study[k] is None else f"{study[k]:,}" for k in ("test_images", "ood_images")}
    cost = f"the models taking turns ({state.get('cost_rounds')} rounds of {state.get('cost_steps')} steps, median)"
    mem = "weights + AdamW state + profiler peak of one training step's forward and backward (CPU)"
    mem = "CUDA max_memory_allocated over the fit" if machine["device"] == "cuda" else mem
    seeds = sorted({r["seed"] for r in state["runs"]})
    d = cfg["data"]
    ft = study.get("finetune")
    lines = [
        f"# Position-scheme study on Fashion-MNIST (budget `{state['budget']}`)\n",
        "- Commands: " + ", ".join(f"`{c}`" for c in state.get("commands") or [state["command"]]),
        f"- Machine: {machine['description']}; torch {machine['torch']}"
        + (f"; load average {state['load']}" if state.get("load") else ""),
        f"- Wall time: {state['wall_s'] / 60:.1f} min in all ({len(state['runs'])} runs, seeds {seeds})",
        f"- Recipe (resolved in the JSON): `conf/experiment/study_{state['budget']}.yaml`"
        + "".join(f" `{o}`" for o in rec["overrides"])
        + f": {d['name']}, each image in a {d['canvas_size']}x{d['canvas_size']} canvas at an offset of the "
        f"`{d['canvas_mode']}` region, {t['max_epochs']} epochs of {t['limit_train_batches'] or 'all'} batches of "
        f"{d['batch_size']}, {t['precision']}, grad clip {t['gradient_clip_val']}, label smoothing "
        f"{cfg['module']['label_smoothing']}, no augmentation; "
        + ", ".join(f"{k} {v}" for k, v in opt.items() if k[0] != "_" and v is not None),
        f"- Accuracy in %: mean [95 % interval] over seeds (Student's t), on {n['test_images']} test images at "
        f"the training offsets (`test`) and {n['ood_images']} others (`study.evals`: `unseen` = at held-out "
        "offsets, `_patch` / `_subpatch` = whole-patch / sub-patch moves only; `resN` = the test canvas resized "
        "to NxN, zero-shot"
        + (
            f"; `ft_{ft['eval']}` = after a fine-tune at {ft['img_size']}x{ft['img_size']}: "
            + " ".join(f"`{o}`" for o in ft["overrides"])
            if ft
            else ""
        )
        + ").",
        "- Paired differences (percentage points, same seeds) against `none` and `ape` are in the CSV/JSON "
        "(`<eval>_acc_vs_<base>_{mean,lo,hi}`); the claims below are read from them.",
        "- Cost: `img/s` = training images per second (forward, backward, AdamW step), "
        + (cost if state.get("cost") else "over each run's training steps after warm-up")
        + f"; `peak MB` = {mem}.\n",
    ]
    verdicts = claims(state)
    if verdicts:
        lines += ["## Published claims\n", "| claim | arch | verdict | deciding differences, pp [95 % interval] |",
                  "|---|---|---|---|"]  # fmt: skip
        for v in verdicts:
            links = "; ".join(f"{x['a']} - {x['b']} {_pp(x['mean'], x['lo'], x['hi'])}" for x in v["links"])
            lines.append(f"| {v['title']} (`{v['eval']}`) | {v['arch']} | **{v['verdict']}** | {links} |")
        lines.append("")
    for arch in dict.fromkeys(r["arch"] for r in rows):
        sub = [r for r in rows if r["arch"] == arch]
        model = ", ".join(f"{k}={v}" for k, v in rec["runs"][arch]["model"].items() if k[0] != "_")
        head = ["scheme", "family", "params", *evals, "img/s", "peak MB"]
        lines += [f"## {arch}: {model}", "", "| " + " | ".join(head) + " |"]
        lines.append("|" + "|".join(["---"] * 3 + ["---:"] * (len(head) - 3)) + "|")
        for r in sub:
            thr, mem = r.get("bench_img_s") or r.get("train_img_s_mean"), r.get("peak_mem_mb_mean")
            cells = [r["scheme"], r["family"], f"{r['params'] / 1e3:.1f}k", *(_pct(r, key[e]) for e in evals)]
            lines.append("| " + " | ".join([*cells, f"{thr:.0f}" if thr else "-", f"{mem:.0f}" if mem else "-"]) + " |")
        for base in ("none", "ape"):
            if not any(r["scheme"] == base for r in sub):
                continue
            lines += ["", f"Paired differences against `{base}` ({arch}, pp [95 % interval]):", ""]
            lines += ["| scheme | " + " | ".join(evals) + " |", "|---|" + "---:|" * len(evals)]
            for r in sub:
                if r["scheme"] != base:
                    cells = [_pp(*(r.get(f"{key[e]}_vs_{base}_{k}") for k in ("mean", "lo", "hi"))) for e in evals]
                    lines.append(f"| {r['scheme']} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def atomic_write(path: Path, text: str) -> None:
    path.with_name(f".{path.name}.tmp").write_text(text)
    os.replace(path.with_name(f".{path.name}.tmp"), path)


def write_results(state: dict, out: Path, name: str) -> None:
    """JSON (everything), CSV (summary), Markdown and PNG, each written atomically."""
    from vitrel.viz import plot_study

    atomic = atomic_write

    state["summary"], state["claims"] = summarise(state), claims(state)
    atomic(out / f"{name}.json", json.dumps(state, indent=1))
    atomic(out / f"{name}.md", markdown(state))
    if state["summary"]:
        w = csv.DictWriter(buf := io.StringIO(), fieldnames=list(state["summary"][0]), lineterminator="\n")
        w.writeheader()
        w.writerows({k: ("" if v is None else v) for k, v in r.items()} for r in state["summary"])
        atomic(out / f"{name}.csv", buf.getvalue())
        fig = plot_study(state["summary"], title=f"{name}: {state['machine']['description']}", chance=0.1)
        fig.savefig(out / f".{name}.png.tmp", dpi=110, format="png")
        os.replace(out / f".{name}.png.tmp", out / f"{name}.png")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", choices=BUDGETS, default="cpu", help="conf/experiment/study_<budget>.yaml")
    ap.add_argument("--schemes", default=None, help="comma-separated (default: every registered scheme)")
    ap.add_argument("--archs", default=None, help="comma-separated (default: all of the recipe's study.archs)")
    ap.add_argument("--seeds", type=int, default=None, help="number of seeds (default: the recipe's study.seeds)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"), help="results folder (default bench/results)")
    ap.add_argument("--name", default=None, help="results file stem (default study_<budget>)")
    ap.add_argument("--data-root", default=None, help="Fashion-MNIST IDX folder (default: the usual places)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    ap.add_argument("--max-runs", type=int, default=None, help="stop after this many new runs (resume later)")
    ap.add_argument("--restart", action="store_true", help="discard earlier results of this study")
    ap.add_argument("--progress", choices=["auto", "rich", "lines", "none"], default="auto")
    ap.add_argument("--cost-rounds", type=int, default=5, help="rounds of the alternating throughput timing")
    ap.add_argument("--cost-steps", type=int, default=10, help="training steps per model and round")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once, one process each (pack a GPU)")
    ap.add_argument("--shard", default=None, help=argparse.SUPPRESS)  # i/N: a --jobs worker's share
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for every run (part of the recipe)")
    return ap.parse_args(argv)


def select(args: argparse.Namespace, study: dict) -> tuple[list[str], list[str], list[int]]:
    """The schemes (registered names and ``study.variants`` labels), architectures and seeds to run."""
    known = list_pos() + [v for v in study.get("variants") or {} if v not in list_pos()]
    schemes = study.get("default_schemes") or sorted(known, key=_scheme_key)
    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()] if args.schemes else schemes
    archs = [a.strip() for a in args.archs.split(",") if a.strip()] if args.archs else list(study["archs"])
    if bad := [s for s in schemes if s not in known]:
        raise SystemExit(f"unknown scheme(s) {bad}; known: {', '.join(known)}")
    if bad := [a for a in archs if a not in study["archs"]]:
        raise SystemExit(f"unknown architecture(s) {bad}; choose from {sorted(study['archs'])}")
    return schemes, archs, list(range(args.seeds if args.seeds is not None else study["seeds"]))


#: parts of the study block that only select or read runs: changing them keeps the finished runs
READING = ("claims", "default_schemes", "variants", "derived")


def _run_part(recipe: dict) -> dict:
    """What the finished runs depend on: the recipe less ``READING`` (variants are checked per run)."""
    return {**recipe, "study": {k: v for k, v in (recipe.get("study") or {}).items() if k not in READING}}


def load_state(path: Path, state: dict, restart: bool) -> dict:
    """The earlier runs of this study (its recipe must be the same), or none with ``restart``."""
    if path.exists() and not restart:
        old = json.loads(path.read_text())
        new_part, old_part = _run_part(state["recipe"]), _run_part(old.get("recipe") or {})
        diff = [k for k in new_part if old_part.get(k) != new_part[k]]
        diff += [f"study.{k}" for k in new_part["study"] if old_part["study"].get(k) != new_part["study"][k]]
        variants = state["recipe"]["study"].get("variants") or {}
        diff += [
            f"variant {r['scheme']}"
            for r in old.get("runs", [])
            if r.get("pos_overrides") is not None and variants.get(r["scheme"]) != r["pos_overrides"]
        ]
        if diff:
            raise SystemExit(
                f"{path} holds a study made with another recipe (differs in: {', '.join(dict.fromkeys(diff))}); "
                "rerun with --restart to discard it, or give another --name"
            )
        keep = ("runs", "wall_s", "cost", "cost_rounds", "cost_steps", "commands")
        state.update({k: old[k] for k in keep if k in old})
    elif restart:
        for p in path.parent.glob(f"{path.stem}*"):
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    return state


def merge_shards(out: Path, name: str, state: dict) -> None:
    """Take the runs (and position tensors) of ``--jobs`` workers' shard files into ``state``; remove them."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    done = {(r["arch"], r["scheme"], r["seed"]) for r in state["runs"]}
    for path in sorted(out.glob(f"{name}.shard*.json")):
        for r in json.loads(path.read_text()).get("runs", []):
            if (r["arch"], r["scheme"], r["seed"]) not in done:
                state["runs"].append(r)
                done.add((r["arch"], r["scheme"], r["seed"]))
        path.unlink()
    main_pos = out / f"{name}_pos.safetensors"
    for path in sorted(out.glob(f"{name}_pos.shard*.safetensors")):
        tensors, meta = {}, {}
        for p in (main_pos, path):
            if p.exists():
                with safe_open(str(p), "pt") as f:
                    tensors.update({k: f.get_tensor(k) for k in f.keys()})
                    meta.update(f.metadata() or {})
        save_file(tensors, str(main_pos.with_name(f".{main_pos.name}.tmp")), metadata=meta)
        os.replace(main_pos.with_name(f".{main_pos.name}.tmp"), main_pos)
        path.unlink()


def run_jobs(args: argparse.Namespace, argv: list[str], jobs: int) -> None:
    """``jobs`` worker processes of this command, worker ``i`` running runs ``i::jobs`` of the to-do list
    (``--shard i/jobs``) with ``cores / jobs`` threads; their output is prefixed ``[i]``. Waits for all."""
    threads = max(1, (args.threads or os.cpu_count() or 1) // jobs)
    base = [a for a in argv if a != "--restart"]
    procs = []
    for i in range(jobs):
        cmd = [sys.executable, "-u", str(Path(__file__).resolve()), *base, "--jobs", "1", "--shard", f"{i}/{jobs}"]
        cmd += ["--threads", str(threads)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1))

    def relay(i: int, proc: subprocess.Popen) -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            print(f"[{i}] {line}", end="")

    threads_ = [threading.Thread(target=relay, args=(i, p), daemon=True) for i, p in enumerate(procs)]
    for t in threads_:
        t.start()
    codes = [p.wait() for p in procs]
    for t in threads_:
        t.join()
    if any(codes):
        raise SystemExit(f"study workers exited with {codes}; rerun the same command to resume")


def main(argv: list[str] | None = None) -> dict:
    args, t_start = parse_args(argv), time.perf_counter()
    argv = sys.argv[1:] if argv is None else list(argv)
    getattr(sys.stdout, "reconfigure", lambda **_: None)(line_buffering=True)  # progress lines in logs at once
    name, out = args.name or f"study_{args.budget}", Path(args.out)
    shard = tuple(int(v) for v in args.shard.split("/")) if args.shard else None
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    if args.threads or device.type == "cpu":
        torch.set_num_threads(args.threads or os.cpu_count() or 1)
    for lg in ("lightning.pytorch", "lightning.fabric", "lightning", "vitrel"):
        logging.getLogger(lg).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*(does not have many workers|resampl|LeafSpec|val_dataloader).*")
    rec = recipe(args.budget, args.overrides)
    study, (schemes, archs, seeds) = rec["study"], select(args, rec["study"])
    command = "python bench/study.py " + " ".join(a for a in argv if a != "--restart")
    state = dict(budget=args.budget, recipe=rec, command=command, wall_s=0.0, runs=[])
    state = load_state(out / f"{name}.json", state, args.restart and shard is None)
    if shard is None:
        merge_shards(out, name, state)  # what workers of an interrupted --jobs run finished
        state["commands"] = list(dict.fromkeys([*state.get("commands", []), command]))
    wall_before, state["machine"] = state["wall_s"], machine_info(device)
    done = {(r["arch"], r["scheme"], r["seed"]) for r in state["runs"]}
    todo = [(a, s, seed) for seed in seeds for a in archs for s in schemes if (a, s, seed) not in done]
    todo = todo[: args.max_runs] if args.max_runs is not None else todo
    skipped = len(seeds) * len(archs) * len(schemes) - len(todo)
    if shard is not None:
        todo, state_name, state["runs"] = todo[shard[0] :: shard[1]], f"{name}.shard{shard[0]}", []
    print(
        f"{name}: {len(todo)} runs to do ({skipped} of the selection already done or deferred) on",
        state["machine"]["description"],
    )
    work = out / f"{name}_work" / hashlib.sha256(json.dumps(rec, sort_keys=True).encode()).hexdigest()[:10]
    common = [*args.overrides, f"trainer.accelerator={device.type}", f"progress_bar={args.progress}"]
    common += [f"data.root={args.data_root}"] * bool(args.data_root)
    common += ["trainer.precision=32-true"] * (device.type == "cpu")  # the recipes' bf16 is for GPUs
    variants = study.get("variants") or {}

    def run_overrides(arch: str, scheme: str, seed: int) -> list[str]:
        pos = variants[scheme] if scheme in variants else [f"pos={scheme}"]
        return [*common, *study["archs"][arch], *pos, f"seed={seed}"]

    def run_cfg(arch: str, scheme: str, seed: int) -> DictConfig:
        return compose(args.budget, run_overrides(arch, scheme, seed), work / f"{arch}_{scheme}_seed{seed}")

    if args.jobs > 1 and shard is None and len(todo) > 1:
        run_jobs(args, argv, min(args.jobs, len(todo)))
        merge_shards(out, name, state)
        todo = []
    data: dict = {}
    try:
        for i, (arch, scheme, seed) in enumerate(todo):
            cfg = run_cfg(arch, scheme, seed)
            if not data:
                data = {k: materialise(v) for k, v in eval_sets(study, instantiate(cfg.data)).items()}
                print("evaluation sets:", ", ".join(f"{k} {tuple(v[0].shape)}" for k, v in data.items()))
            print(f"[{i + 1}/{len(todo)}] {arch} {scheme} seed {seed}")
            resumed = (Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt").exists()
            ft_cfg = finetune_cfg(cfg, study, run_overrides(arch, scheme, seed), args.budget)
            record, model = run_one(cfg, study, data, device, ft_cfg)
            family = get_pos_class(cfg.pos.name).family
            run = dict(arch=arch, scheme=scheme, seed=seed, family=family, pos_overrides=variants.get(scheme))
            state["runs"].append({**run, **record, "resumed": resumed})
            state["wall_s"] = wall_before + time.perf_counter() - t_start
            if shard is not None:
                if seed == seeds[0]:
                    save_pos(out / f"{name}_pos.shard{shard[0]}.safetensors", f"{arch}/{scheme}", model)
                atomic_write(out / f"{state_name}.json", json.dumps(state, indent=1))
            else:
                if seed == seeds[0]:
                    save_pos(out / f"{name}_pos.safetensors", f"{arch}/{scheme}", model)
                write_results(state, out, name)
            for d in (cfg.paths.output_dir, ft_cfg.paths.output_dir if ft_cfg is not None else None):
                if d:
                    shutil.rmtree(d, ignore_errors=True)
            accs = "  ".join(f"{k[:-4]} {100 * v:.1f}%" for k, v in record.items() if k.endswith("_acc"))
            print(f"    {accs}  |  {record['train_img_s'] or math.nan:.0f} img/s, {record['peak_mem_mb']:.0f} MB")
    finally:
        for d in (work, work.parent):
            with contextlib.suppress(OSError):
                d.rmdir()
    if shard is not None:
        return state
    # the selection complete: every model's throughput, timed in alternation (once)
    finished = {(r["arch"], r["scheme"], r["seed"]) for r in state["runs"]}
    wanted = [(a, s) for a in archs for s in schemes]
    complete = all((a, s, seed) in finished for a, s in wanted for seed in seeds)
    if complete and args.cost_rounds > 0 and any(f"{a}/{s}" not in state.get("cost", {}) for a, s in wanted):
        print(f"cost: timing {len(wanted)} models in alternation ({args.cost_rounds} rounds)")
        cfgs = {f"{a}/{s}": run_cfg(a, s, 0) for a, s in wanted}
        cost = measure_cost(cfgs, device, args.cost_rounds, args.cost_steps)
        state.update(cost={**state.get("cost", {}), **cost}, cost_rounds=args.cost_rounds, cost_steps=args.cost_steps)
    state["wall_s"] = wall_before + time.perf_counter() - t_start
    state["load"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    if state["runs"] and (complete or not todo):
        write_results(state, out, name)
    print(f"done in {time.perf_counter() - t_start:.0f} s (in all {state['wall_s'] / 60:.1f} min): {out}/{name}.*")
    for v in claims(state) if complete else ():
        print(f"  {v['arch']}: {v['title']}: {v['verdict']}")
    return state


if __name__ == "__main__":
    main()
