"""The study's command line (``python bench/study.py``, ``python -m vitrel.study``): the selection, resuming
from the results file, ``--jobs`` worker processes, the runs, the throughput timing once the selection is
complete. See ``vitrel.study`` (and ``docs/study.md``)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import hashlib
import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from hydra.errors import HydraException, InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from vitrel.bench import machine_info, source_commit
from vitrel.pos import get_pos_class, list_pos
from vitrel.study.overrides import check_entries_compose, override_error, refuse_run_keys
from vitrel.study.reading import atomic_write, check_reading, claims, scheme_key, variant_parts, write_results
from vitrel.study.runs import (
    BUDGETS,
    ROOT,
    compose,
    eval_sets,
    finetune_cfg,
    materialise,
    measure_cost,
    rebuilt,
    recipe,
    run_one,
    save_pos,
    score,
)


def int_at_least(low: int):
    """An ``argparse`` type: an integer >= ``low`` (``--jobs 0`` is an error, not one job; ``--max-runs -1`` one,
    not a slice that drops the last run)."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {n}")
        return n

    return parse


positive_int = int_at_least(1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from vitrel import study

    ap = argparse.ArgumentParser(description=study.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", choices=BUDGETS, default="cpu", help="conf/experiment/study_<budget>.yaml")
    ap.add_argument("--schemes", default=None, help="comma-separated (default: study.default_schemes, else all)")
    ap.add_argument("--archs", default=None, help="comma-separated (default: all of the recipe's study.archs)")
    seeds = "number of seeds (default: the recipe's study.seeds)"
    ap.add_argument("--seeds", type=positive_int, default=None, help=seeds)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"), help="results folder (default bench/results)")
    ap.add_argument("--name", default=None, help="results file stem (default study_<budget>)")
    ap.add_argument("--data-root", default=None, help="Fashion-MNIST IDX folder (default: the usual places)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: all cores)")
    runs = "stop after this many new runs (resume later)"
    ap.add_argument("--max-runs", type=int_at_least(0), default=None, help=runs)
    ap.add_argument("--restart", action="store_true", help="discard earlier results of this study")
    ap.add_argument("--progress", choices=["auto", "rich", "lines", "none"], default="auto")
    ap.add_argument("--cost-rounds", type=int_at_least(0), default=5, help="rounds of the throughput timing")
    ap.add_argument("--cost-steps", type=positive_int, default=10, help="training steps per model and round")
    ap.add_argument(
        "--recost",
        action="store_true",
        help="train nothing; time every model of the results file again (one alternation; after busy cores)",
    )
    reread = "train nothing; write the report of the results file again with this vitrel (its own recipe, not checked)"
    ap.add_argument("--reread", action="store_true", help=reread)
    ap.add_argument("--jobs", type=positive_int, default=1, help="runs at once, one process each (pack a GPU)")
    ap.add_argument("--shard", default=None, help=argparse.SUPPRESS)  # i/N: a --jobs worker's share
    ap.add_argument("--memory-fraction", type=float, default=None, help=argparse.SUPPRESS)  # a worker's GPU share
    ap.add_argument("--taken", default=None, help=argparse.SUPPRESS)  # a --jobs worker: the folder of taken runs
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for every run (part of the recipe)")
    return ap.parse_args(argv)


def select(args: argparse.Namespace, study: dict) -> tuple[list[str], list[str], list[int]]:
    """The schemes (registered names and ``study.variants`` labels), architectures and seeds to run."""
    known = list_pos() + [v for v in study.get("variants") or {} if v not in list_pos()]
    schemes = study.get("default_schemes") or sorted(known, key=lambda s: scheme_key(s, study.get("variants")))
    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()] if args.schemes else schemes
    archs = [a.strip() for a in args.archs.split(",") if a.strip()] if args.archs else list(study["archs"])
    if bad := [s for s in schemes if s not in known]:
        raise SystemExit(f"unknown scheme(s) {bad}; known: {', '.join(known)}")
    try:
        check_reading(study)
        trained = {s: variant_parts(s, study.get("variants"))[0] for s in schemes}
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if bad := sorted({f"{s} (trained_as {t})" for s, t in trained.items() if t not in known}):
        raise SystemExit(f"scored variant(s) of an unknown entry: {', '.join(bad)}; known: {', '.join(known)}")
    if bad := [a for a in archs if a not in study["archs"]]:
        raise SystemExit(f"unknown architecture(s) {bad}; choose from {sorted(study['archs'])}")
    return schemes, archs, list(range(args.seeds if args.seeds is not None else study["seeds"]))


#: parts of the study block that only select or read runs: changing them keeps the finished runs
READING = ("claims", "default_schemes", "variants", "derived")


#: a command-line override of a ``READING`` key (``++study.claims.mine.better=[a,b]``, ``~study.derived``)
_READING_OVERRIDE = re.compile(rf"^(\+\+|\+|~)?study\.({'|'.join(READING)})([.=]|$)")


def _run_part(recipe: dict) -> dict:
    """What the finished runs depend on: the recipe less ``READING``, in its keys and its command's overrides
    (variants are checked per run)."""
    study = {k: v for k, v in (recipe.get("study") or {}).items() if k not in READING}
    if "overrides" not in recipe:
        return {**recipe, "study": study}
    return {**recipe, "study": study, "overrides": [o for o in recipe["overrides"] if not _READING_OVERRIDE.match(o)]}


def scheme_settings(recipe: dict, arch: str, label: str) -> dict:
    """The position settings of a run of study entry ``label`` on ``arch`` under ``recipe``: ``pos`` of its
    composition (the scheme's ``conf/pos`` file, a variant's overrides and ``score_with``, the command's
    ``++pos.<key>=``), resolved. Each run records them (``pos_settings``), and :func:`check_recipe` compares them:
    the recipe (``NOT_RECIPE``) leaves ``pos`` out."""
    _, train, score_with = variant_parts(label, recipe["study"].get("variants"))
    cfg = compose(recipe["budget"], [*recipe["overrides"], *recipe["study"]["archs"][arch], *train, *score_with])
    return OmegaConf.to_container(cfg.pos, resolve=True)


def _changed_pos(run: dict, settings: Callable[[str, str], dict]) -> list[str]:
    """The ``pos.<key>``s whose value in ``run``'s ``pos_settings`` is not ``settings``' now (a run recorded
    without them, by an older vitrel: none)."""
    if run.get("pos_settings") is None:
        return []
    try:
        now = settings(run["arch"], run["scheme"])
    except Exception as e:  # noqa: BLE001  (an entry or architecture that no longer composes)
        return [f"pos ({type(e).__name__}: it no longer composes)"]
    was = run["pos_settings"]
    return [f"pos.{k}" for k in sorted(was.keys() | now.keys()) if was.get(k) != now.get(k)]


def check_recipe(path: Path, old: dict, recipe: dict, settings: Callable[[str, str], dict]) -> None:
    """Refuse the runs of ``old`` (a results or ``--jobs`` shard file's state, read from ``path``) unless they were
    made with ``recipe`` (less ``READING``; per run, a variant's overrides and the position settings it recorded,
    against ``settings(arch, entry)``: :func:`scheme_settings`)."""
    new_part, old_part = _run_part(recipe), _run_part(old.get("recipe") or {})
    diff = [k for k in new_part if old_part.get(k) != new_part[k]]
    diff += [f"study.{k}" for k in new_part["study"] if old_part["study"].get(k) != new_part["study"][k]]
    variants = recipe["study"].get("variants") or {}
    diff += [
        f"variant {r['scheme']}"
        for r in old.get("runs", [])
        if r.get("pos_overrides") is not None and variants.get(r["scheme"]) != r["pos_overrides"]
    ]
    if not diff:  # (the settings of an entry whose variant or recipe changed: said by those)
        diff += [f"{k} of {r['scheme']}" for r in old.get("runs", []) for k in _changed_pos(r, settings)]
    if diff:
        made, given = (old.get("recipe") or {}).get("overrides"), recipe["overrides"]
        made = f"; it was made with the overrides {made}, this command gives {given}" if "overrides" in diff else ""
        raise SystemExit(
            f"{path} holds a study made with another recipe (differs in: {', '.join(dict.fromkeys(diff))}{made}); "
            "rerun with --restart to discard it, or give another --name"
        )


def load_state(path: Path, state: dict, restart: bool, settings: Callable[[str, str], dict]) -> dict:
    """The earlier runs of this study (its recipe must be the same: :func:`check_recipe`), or none with
    ``restart``."""
    if path.exists() and not restart:
        old = json.loads(path.read_text())
        check_recipe(path, old, state["recipe"], settings)
        keep = ("runs", "failed", "wall_s", "cost", "cost_rounds", "cost_steps", "cost_load", "commands")
        state.update({k: old[k] for k in keep if k in old})
    elif restart:
        if gone := study_files(path.parent, path.stem):
            names = ", ".join(p.name for p in gone)
            print(f"--restart: removed {len(gone)} file(s) of {path.stem} in {path.parent}: {names}")
        for p in gone:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    return state


def study_files(out: Path, name: str) -> list[Path]:
    """The files and folders study ``name`` writes in ``out`` (results, pictures, positions, work and failure
    folders, ``--jobs`` shards, unfinished atomic writes), not another study's whose name starts with ``name``."""
    own = [f"{name}.{e}" for e in ("json", "csv", "md", "png")]
    own += [f"{name}_{e}" for e in ("diffs.png", "curves.png", "pos.safetensors", "work", "failed")]
    paths = [out / f for f in own] + [out / f".{f}.tmp" for f in own]
    shard = re.compile(rf"{re.escape(name)}(_pos)?\.shard\d+\.(json|safetensors)")
    paths += [p for p in out.glob(f"{glob.escape(name)}*.shard*") if shard.fullmatch(p.name)]
    return [p for p in paths if p.exists()]


def merge_shards(out: Path, name: str, state: dict, settings: Callable[[str, str], dict]) -> None:
    """Take the runs, failures and position tensors of ``--jobs`` workers' shard files into ``state`` (made with its
    recipe, else refused); remove each shard once ``<name>.json`` (and the position file) hold what it held. The wall
    time is the longest worker's (each counts from the results' own): an interrupted run's parent recorded none."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from vitrel.models.ckpt_files import follow_umask

    done = {(r["arch"], r["scheme"], r["seed"]) for r in state["runs"]}
    shards = {path: json.loads(path.read_text()) for path in sorted(out.glob(f"{name}.shard*.json"))}
    for path, shard in shards.items():  # (a worker of an interrupted --jobs run had its recipe: check all first)
        check_recipe(path, shard, state["recipe"], settings)
    for shard in shards.values():
        for r in shard.get("runs", []):
            if (r["arch"], r["scheme"], r["seed"]) not in done:
                state["runs"].append(r)
                done.add((r["arch"], r["scheme"], r["seed"]))
        for f in shard.get("failed", []):
            set_failed(state, f)
        state["wall_s"] = max(state.get("wall_s", 0.0), shard.get("wall_s", 0.0))
    state["failed"] = [f for f in state.get("failed", []) if _key(f) not in done]  # (a retry that succeeded)
    if shards:  # the merged runs on disk before their shards go (a crash in between loses nothing)
        atomic_write(out / f"{name}.json", json.dumps(state, indent=1))
    for path in shards:
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
        follow_umask(main_pos.with_name(f".{main_pos.name}.tmp"))  # (safetensors writes 0600)
        os.replace(main_pos.with_name(f".{main_pos.name}.tmp"), main_pos)
        path.unlink()


def _key(run: dict) -> tuple[str, str, int]:
    return run["arch"], run["scheme"], run["seed"]


def set_failed(state: dict, failure: dict) -> None:
    """Record ``failure`` (a run that raised) in ``state["failed"]``, in place of an earlier one of the same run."""
    state["failed"] = [f for f in state.get("failed", []) if _key(f) != _key(failure)] + [failure]


def record_failure(state: dict, log: Path, run: dict, exc: Exception) -> str:
    """Record the run ``run`` (arch, scheme, seed, ...) as failed with ``exc``: its one-line message in the state,
    its traceback in ``log``. Returns the message."""
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    why = exc.__cause__ if isinstance(exc, InstantiationException) and exc.__cause__ else exc  # (Hydra's wrapper)
    first = next((line.strip() for line in str(why).splitlines() if line.strip()), "")
    error = f"{type(why).__name__}: {first}" if first else type(why).__name__
    set_failed(state, {**run, "error": error, "log": str(log), "finished": time.strftime("%Y-%m-%d %H:%M:%S")})
    return error


def take(taken: Path, unit: tuple[str, str, int]) -> bool:
    """Whether this worker takes ``unit`` (``(arch, trained entry, seed)``): the first to create its file in
    ``taken`` does (``O_EXCL``: one winner across processes). A fixed share of the list left one worker idle while
    the other ran the slow entries (the extrapolation study: LieRE, the scored RoPE variants)."""
    try:
        os.close(os.open(taken / "_".join(map(str, unit)), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def run_jobs(args: argparse.Namespace, argv: list[str], jobs: int, taken: Path) -> None:
    """``jobs`` worker processes of this command (``python -m vitrel.study``, this vitrel first on the path), each
    taking the next run of the to-do list no worker has taken (:func:`take`, in the folder ``taken``; worker ``i``
    writes ``--shard i/jobs``'s files) with ``cores / jobs`` threads and, on a GPU, ``0.95 / jobs`` of its memory
    (``--memory-fraction``: ``torch.cuda.set_per_process_memory_fraction``); their output is prefixed ``[i]``. Waits
    for all."""
    threads = max(1, (args.threads or os.cpu_count() or 1) // jobs)
    base = [a for a in argv if a != "--restart"]
    path = os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")) if p)
    procs = []
    for i in range(jobs):
        cmd = [sys.executable, "-u", "-m", "vitrel.study", *base, "--jobs", "1", "--shard", f"{i}/{jobs}"]
        cmd += ["--threads", str(threads), "--memory-fraction", f"{0.95 / jobs:.4f}", "--taken", str(taken)]
        procs.append(
            subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                bufsize=1,
                env={**os.environ, "PYTHONPATH": path},
            )
        )

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


@contextlib.contextmanager
def _quiet_training_logs():
    """Lightning's and vitrel's INFO lines and the warnings every run repeats, silenced while the study runs (its
    own progress lines say what a run did); the levels and warning filters are restored after."""
    names = ("lightning.pytorch", "lightning.fabric", "lightning", "vitrel")
    levels = {n: logging.getLogger(n).level for n in names}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(does not have many workers|resampl|LeafSpec|val_dataloader).*")
        for n in names:
            logging.getLogger(n).setLevel(logging.WARNING)
        try:
            yield
        finally:
            for n, level in levels.items():
                logging.getLogger(n).setLevel(level)


def main(argv: list[str] | None = None, prog: str = "python bench/study.py") -> dict:
    """Run the study ``argv`` selects (``parse_args``); ``prog``: how the command is recorded. Returns its state
    (what the results JSON holds)."""
    with _quiet_training_logs():
        return _run(argv, prog)


def _reread(out: Path, name: str, command: str, overrides: list[str]) -> dict:
    """``--reread``: the report files of ``<out>/<name>.json`` written again from its runs and its recipe (the
    reading of this vitrel: new columns, claims read again), nothing trained or timed."""
    path = out / f"{name}.json"
    if overrides:
        raise SystemExit(f"--reread reads {path} with its own recipe; it takes no overrides ({' '.join(overrides)})")
    if not path.exists():
        raise SystemExit(f"--reread: no results file {path}")
    state = json.loads(path.read_text())
    try:
        check_reading(state["recipe"]["study"])
    except ValueError as e:
        raise SystemExit(f"--reread: {path}: {e}") from None
    state["commands"] = list(dict.fromkeys([*state.get("commands", []), command]))
    write_results(state, out, name)
    print(f"{name}: {len(state['runs'])} runs read again: {out}/{name}.*")
    return state


def _run(argv: list[str] | None, prog: str) -> dict:
    args, t_start = parse_args(argv), time.perf_counter()
    argv = sys.argv[1:] if argv is None else list(argv)
    getattr(sys.stdout, "reconfigure", lambda **_: None)(line_buffering=True)  # progress lines in logs at once
    name, out = args.name or f"study_{args.budget}", Path(args.out)
    if args.reread:
        return _reread(out, name, f"{prog} " + " ".join(argv), args.overrides)
    refuse_run_keys(prog, args.overrides)
    shard = tuple(int(v) for v in args.shard.split("/")) if args.shard else None
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    if args.threads or device.type == "cpu":
        torch.set_num_threads(args.threads or os.cpu_count() or 1)
    if args.memory_fraction is not None and device.type == "cuda":  # a --jobs worker: its share of the GPU
        torch.cuda.set_per_process_memory_fraction(args.memory_fraction, device.index)
    try:
        rec = recipe(args.budget, args.overrides)
    except HydraException as e:  # (a Hydra traceback otherwise)
        raise SystemExit(override_error(prog, args.budget, args.overrides, e)) from None
    study, (schemes, archs, seeds) = rec["study"], select(args, rec["study"])
    command = f"{prog} " + " ".join(a for a in argv if a != "--restart")
    state = dict(budget=args.budget, recipe=rec, command=command, wall_s=0.0, runs=[])
    settings = functools.cache(functools.partial(scheme_settings, rec))  # (arch, entry): its pos, composed once
    state = load_state(out / f"{name}.json", state, args.restart and shard is None, settings)
    if shard is None:
        merge_shards(out, name, state, settings)  # what workers of an interrupted --jobs run finished
        state["commands"] = list(dict.fromkeys([*state.get("commands", []), command]))
    wall_before, state["machine"] = state["wall_s"], machine_info(device)
    done = {(r["arch"], r["scheme"], r["seed"]) for r in state["runs"]}
    todo = [(a, s, seed) for seed in seeds for a in archs for s in schemes if (a, s, seed) not in done]
    held, left = len(seeds) * len(archs) * len(schemes) - len(todo), len(todo)
    todo = todo[: args.max_runs] if args.max_runs is not None else todo
    todo = [] if args.recost else todo  # (a timing only)
    why = "--recost" if args.recost else "--max-runs"
    skipped = [f"{held} of the selection already done"] * bool(held or left == len(todo))
    skipped += [f"{left - len(todo)} of the selection left for a later run by {why}"] * (left > len(todo))
    retried = len({_key(f) for f in state.get("failed", [])} & set(todo))
    if shard is not None:
        state_name, state["runs"], state["failed"] = f"{name}.shard{shard[0]}", [], []
    trains = {**_run_part(rec), "variants": study.get("variants")}  # (not the reading: a claim added keeps the folder)
    work = out / f"{name}_work" / hashlib.sha256(json.dumps(trains, sort_keys=True).encode()).hexdigest()[:10]
    common = [*args.overrides, f"trainer.accelerator={device.type}", f"progress_bar={args.progress}"]
    common += [f"data.root={args.data_root}"] * bool(args.data_root)
    common += ["trainer.precision=32-true"] * (device.type == "cpu")  # the recipes' bf16 is for GPUs
    variants = study.get("variants") or {}
    parts = {s: variant_parts(s, variants) for s in schemes}
    check_entries_compose(prog, args.budget, args.overrides, [(a, s) for a, s, _ in todo], settings)
    trainings = len({(a, parts[s][0], seed) for a, s, seed in todo})  # (a scored variant shares its entry's)
    print(
        f"{name}: {len(todo)} runs to do"
        + f" ({retried} of them failed before: retried)" * bool(retried)
        + f" in {trainings} trainings (scored variants share theirs)" * (trainings != len(todo)),
        f"({', '.join(skipped)}) on",
        state["machine"]["description"],
    )
    if study.get("finetune") and (scored := [s for s, p in parts.items() if p[2]]):
        raise SystemExit(
            f"scored variants {scored} (trained_as) have no fine-tune; this recipe sets study.finetune: leave them "
            "out of --schemes, or add the override ~study.finetune (no fine-tune)"
        )

    def run_overrides(arch: str, scheme: str, seed: int) -> list[str]:
        _, train, score_with = variant_parts(scheme, variants)
        return [*common, *study["archs"][arch], *train, *score_with, f"seed={seed}"]

    def run_cfg(arch: str, scheme: str, seed: int) -> DictConfig:
        return compose(args.budget, run_overrides(arch, scheme, seed), work / f"{arch}_{scheme}_seed{seed}")

    # one training per (arch, trained entry, seed): a scored variant shares its entry's (in this process)
    units: dict[tuple[str, str, int], list[str]] = {}
    for arch, scheme, seed in todo:
        units.setdefault((arch, parts[scheme][0], seed), []).append(scheme)
    if shard is not None and args.taken is None:  # (a worker run by hand: a fixed share)
        units = dict(list(units.items())[shard[0] :: shard[1]])
    if args.jobs > 1 and shard is None and len(units) > 1:
        taken = work / "taken"
        shutil.rmtree(taken, ignore_errors=True)  # (an interrupted run's: its unfinished runs are to do again)
        taken.mkdir(parents=True)
        try:
            run_jobs(args, argv, min(args.jobs, len(units)), taken)
        finally:
            shutil.rmtree(taken, ignore_errors=True)
        merge_shards(out, name, state, settings)
        units = {}
    data: dict = {}
    commit = source_commit()  # the code this process runs (read once: a checkout changed meanwhile is not it)

    def save() -> None:
        if shard is not None:
            atomic_write(out / f"{state_name}.json", json.dumps(state, indent=1))
        else:
            write_results(state, out, name)

    def failed(arch: str, labels: list[str], seed: int, exc: Exception) -> None:
        """Record runs ``labels`` as failed with ``exc`` (not KeyboardInterrupt, SystemExit: those stop the study)."""
        for scheme in labels:
            log = out / f"{name}_failed" / f"{arch}_{scheme}_seed{seed}.log"
            run = dict(arch=arch, scheme=scheme, seed=seed, commit=commit, machine=state["machine"]["description"])
            print(f"    {scheme}: FAILED {record_failure(state, log, run, exc)} (traceback: {log})")
        state["wall_s"] = wall_before + time.perf_counter() - t_start
        save()
        if device.type == "cuda":  # (an out-of-memory run: free what it held for the next)
            torch.cuda.empty_cache()

    try:
        for i, ((arch, trained, seed), labels) in enumerate(units.items()):
            if args.taken is not None and not take(Path(args.taken), (arch, trained, seed)):
                continue  # another worker's
            try:
                cfg = run_cfg(arch, trained, seed)
            except Exception as e:  # (a run's own overrides that do not compose)
                failed(arch, labels, seed, e)
                continue
            if not data:
                data = {k: materialise(v) for k, v in eval_sets(study, instantiate(cfg.data), paired=True).items()}
                print("evaluation sets:", ", ".join(f"{k} {tuple(v[0].shape)}" for k, v in data.items()))
            scored = [s for s in labels if s != trained]
            also = f" (scored as {', '.join(scored)} too)" if scored and trained in labels else ""
            also = f" (trained for {', '.join(scored)})" if trained not in labels else also
            print(f"[{i + 1}/{len(units)}] {arch} {trained} seed {seed}{also}")
            resumed = (Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt").exists()
            try:
                ft_cfg = finetune_cfg(cfg, study, run_overrides(arch, trained, seed), args.budget)
                record, model = run_one(cfg, study, data, device, ft_cfg)
            except Exception as e:  # this run's failure (build, NaN loss, out of memory): record it, go on
                failed(arch, labels, seed, e)
                continue
            if trained not in labels and (why := retrained_apart(state, (arch, trained, seed), record)):
                failed(arch, labels, seed, RuntimeError(why))  # (not paired with another training than its entry's)
                labels = []
            for scheme in labels:
                if scheme == trained:
                    rec, m = record, model
                else:  # the same weights, rebuilt with score_with
                    try:
                        m = rebuilt(run_cfg(arch, scheme, seed), model, device)
                        accs, eval_s = score(m, study, data, device, str(cfg.trainer.precision).startswith("bf16"))
                    except Exception as e:
                        failed(arch, [scheme], seed, e)
                        continue
                    rec = {**record, **accs, "eval_s": eval_s, "trained_as": trained}
                family = get_pos_class(cfg.pos.name).family
                run = dict(arch=arch, scheme=scheme, seed=seed, family=family, pos_overrides=variants.get(scheme))
                run["pos_settings"] = settings(arch, scheme)  # (checked when the study resumes)
                run.update(commit=commit, machine=state["machine"]["description"])  # which code, where: per run
                state["runs"].append({**run, **rec, "resumed": resumed})
                state["failed"] = [f for f in state.get("failed", []) if _key(f) != _key(run)]  # (a retry)
                (out / f"{name}_failed" / f"{arch}_{scheme}_seed{seed}.log").unlink(missing_ok=True)
                state["wall_s"] = wall_before + time.perf_counter() - t_start
                if seed == seeds[0]:
                    pos = f"{name}_pos.shard{shard[0]}" if shard is not None else f"{name}_pos"
                    save_pos(out / f"{pos}.safetensors", f"{arch}/{scheme}", m)
                save()
                accs = "  ".join(f"{k[:-4]} {100 * v:.1f}%" for k, v in rec.items() if k.endswith("_acc"))
                who = f"{scheme}: " if len(labels) > 1 or scheme != trained else ""
                speed = f"{record['train_img_s'] or math.nan:.0f} img/s, {record['peak_mem_mb']:.0f} MB"
                print(f"    {who}{accs}  |  {speed}")
            for d in (cfg.paths.output_dir, ft_cfg.paths.output_dir if ft_cfg is not None else None):
                if d:
                    shutil.rmtree(d, ignore_errors=True)
    finally:
        for d in (work, work.parent, out / f"{name}_failed"):
            with contextlib.suppress(OSError):
                d.rmdir()
    if shard is not None:
        return state
    # the selection complete: every model's throughput, timed in alternation (once)
    finished = {(r["arch"], r["scheme"], r["seed"]) for r in state["runs"]}
    wanted = [(a, s) for a in archs for s in schemes]
    complete = all((a, s, seed) in finished for a, s in wanted for seed in seeds)
    timed = [f"{a}/{s}" for a, s in wanted] if complete else []
    if args.recost:  # every model timed before, with the selection's: one alternation, replacing the old figures
        timed = list(dict.fromkeys([*state.get("cost", {}), *timed]))
    elif all(k in state.get("cost", {}) for k in timed):
        timed = []
    if timed and args.cost_rounds > 0:
        state["cost_load"] = " ".join(f"{x:.1f}" for x in os.getloadavg())  # (busy cores before the timing)
        print(f"cost: timing {len(timed)} models in alternation ({args.cost_rounds} rounds)")
        cfgs = {k: run_cfg(*k.split("/"), 0) for k in timed}
        cost = measure_cost(cfgs, device, args.cost_rounds, args.cost_steps)
        state.update(cost={**state.get("cost", {}), **cost}, cost_rounds=args.cost_rounds, cost_steps=args.cost_steps)
    elif args.recost:
        raise SystemExit(
            f"--recost: nothing to time in {out}/{name}.json (no model timed before, the selection not complete)"
            if args.cost_rounds > 0
            else "--recost with --cost-rounds 0 times nothing"
        )
    state["wall_s"] = wall_before + time.perf_counter() - t_start
    state["load"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    if state["runs"] or state.get("failed"):  # (also what --jobs workers did, merged)
        write_results(state, out, name)
    where = (
        f"{out}/{name}.*"
        if state["runs"] or state.get("failed")
        else f"no runs of {name} in {out} yet, nothing written"
    )
    print(f"done in {time.perf_counter() - t_start:.0f} s (in all {state['wall_s'] / 60:.1f} min): {where}")
    for v in claims(state) if complete else ():
        print(f"  {v['arch']}: {v['title']}: {v['verdict']}")
    selected = {(a, s, seed) for a, s in wanted for seed in seeds}
    if bad := [f for f in state.get("failed", []) if _key(f) in selected]:
        print(f"{len(bad)} of {len(selected)} runs failed (in {out}/{name}.json and .md):")
        for f in bad:
            print(f"  {f['arch']} {f['scheme']} seed {f['seed']}: {f['error']} (traceback: {f['log']})")
        raise SystemExit(f"{len(bad)} run(s) of {name} failed; rerun the same command to retry them")
    return state


def retrained_apart(state: dict, key: tuple[str, str, int], record: dict) -> str | None:
    """Why scored variants of the entry ``key`` (arch, trained scheme, seed), trained again for them in a later
    command (its run recorded, its checkpoint gone), cannot be paired with the recorded run: a training that ended
    elsewhere (another final training loss: another device, thread count or code); None when it is the same one.
    Paired, a variant's difference to its entry would hold two trainings' noise, where the study says it holds none
    (an audit's: 2 threads against the entry's 1 gave a loss apart in the 7th digit)."""
    prior = next((r for r in state["runs"] if (r["arch"], r["scheme"], r["seed"]) == key), None)
    old, new = (prior or {}).get("final_train_loss"), record.get("final_train_loss")
    if prior is None or old is None or new is None or old == new:
        return None
    arch, trained, seed = key
    return (
        f"{arch} {trained} seed {seed}, trained again to score its variants, ended elsewhere than its recorded run "
        f"(final training loss {new!r} against {old!r}; on {state['machine']['description']}, the run's on "
        f"{prior.get('machine')}): a scored variant is paired with its entry's own training; score it with the "
        "entry's device and --threads, or retrain both in one command (--restart)"
    )
