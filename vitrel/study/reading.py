"""Reading the study's runs: summary rows (mean, sample std and 95 % interval over seeds, paired differences
against ``none`` and ``ape``), the verdict on each of ``study.claims``, the Markdown report, and the files
written after every run (JSON, CSV, Markdown, the pictures of ``vitrel.study.plots``)."""

from __future__ import annotations

import csv
import io
import json
import math
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vitrel.pos.base import FAMILIES
from vitrel.pos.registry import UnknownSchemeError, get_pos_class
from vitrel.stats import chain_verdict, mean_ci, paired_diff, verdict
from vitrel.study.runs import TEST_ON_OOD, same_images


def variant_parts(label: str, variants: Mapping[str, Any] | None = None) -> tuple[str, list[str], list[str]]:
    """A study entry as ``(trained entry, its training overrides, scoring overrides)``.

    A registered scheme ``s``: ``(s, ["pos=s"], [])``. A ``study.variants`` label whose value is a list of
    overrides: trained with them. A label whose value is ``{trained_as: <entry>, score_with: [overrides]}``: a
    *scored variant*, the same trained weights as ``<entry>`` (a scheme or a trained variant) rebuilt with the
    extra overrides for scoring (an option that acts at call time only, e.g. RoPE scaling with ``factor: auto``
    or a table's ``extend`` rule): its differences to ``<entry>`` are within one trained model."""
    v = (variants or {}).get(label)
    if v is None:
        return label, [f"pos={label}"], []
    if isinstance(v, Mapping):
        if set(v) != {"trained_as", "score_with"}:
            raise ValueError(
                f"study variant {label!r}: a mapping takes exactly trained_as and score_with, got {sorted(v)}"
            )
        base, score = str(v["trained_as"]), [str(o) for o in v["score_with"]]
        if isinstance((variants or {}).get(base), Mapping):
            raise ValueError(
                f"study variant {label!r}: trained_as {base!r} is itself a scored variant; name a trained entry"
            )
        return base, variant_parts(base, variants)[1], score
    return label, [str(o) for o in v], []


def scheme_key(label: str, variants: Mapping[str, Any] | None = None) -> tuple:
    """Where a scheme (a registered name, or a ``study.variants`` label: the scheme of its ``pos=`` override)
    goes in the tables: by family in the order of ``FAMILIES`` (from the registry), a variant after its
    scheme, then by name."""
    pos = variant_parts(label, variants)[1] if label in (variants or {}) else ()
    base = next((o.split("=", 1)[1] for o in pos if o.startswith("pos=")), label)
    try:
        family = FAMILIES.index(get_pos_class(base).family)
    except (UnknownSchemeError, ValueError):
        family = len(FAMILIES)
    return family, base, label != base, label


def _family(label: str, variants: Mapping[str, Any] | None = None) -> str:
    """The family of a study entry's scheme (``-`` for a name the registry does not know)."""
    base = next((o.split("=", 1)[1] for o in variant_parts(label, variants)[1] if o.startswith("pos=")), label)
    try:
        return get_pos_class(base).family
    except UnknownSchemeError:
        return "-"


def acc_metrics(study: dict) -> list[str]:
    """The accuracy columns of a study: every evaluation set, the fine-tuned one, then the differences
    ``study.derived`` (``name: [a, b]``: ``a``'s accuracy minus ``b``'s, within each run)."""
    ft = study.get("finetune")
    accs = [f"{k}_acc" for k in study["evals"]] + ([f"ft_{ft['eval']}_acc"] if ft else [])
    return accs + list(study.get("derived") or {})


def _on_test_images(study: dict, name: str) -> bool:
    """Whether accuracy ``name`` (an eval, or ``ft_<eval>``) is scored on the ``test`` eval's images."""
    ft = study.get("finetune")
    return (ft["eval"] if ft and name == f"ft_{ft['eval']}" else name) == "test"


def _acc_beside(r: dict, study: dict, m: str, other: str):
    """Run ``r``'s accuracy ``m`` on the images accuracy ``other`` is scored on: ``test`` beside an eval on the
    other images is ``<TEST_ON_OOD>_acc`` (None in a run without it, and for ``ft_test`` there)."""
    if same_images(study) or not _on_test_images(study, m) or _on_test_images(study, other):
        return r.get(f"{m}_acc")
    return r.get(f"{TEST_ON_OOD}_acc") if m == "test" else None


def with_derived(runs: list[dict], study: dict) -> list[dict]:
    """The runs with ``study.derived``'s within-run differences added (a position cost per model: the
    same trained model on held-out offsets against the training offsets), on the same images (``_acc_beside``)."""
    out = []
    for r in runs:
        r = dict(r)
        for name, (a, b) in (study.get("derived") or {}).items():
            va, vb = _acc_beside(r, study, a, b), _acc_beside(r, study, b, a)
            r[name] = None if va is None or vb is None else float(va) - float(vb)
        out.append(r)
    return out


def check_reading(study: dict) -> None:
    """Refuse ``study.derived`` / ``study.claims`` entries the reading cannot read, before any run (``ValueError``,
    naming the entry): a difference ``name: [a, b]`` of two accuracies (``study.evals``, ``ft_<eval>``), a claim
    with an ``eval`` (an accuracy or a difference) and one of ``better: [A, B, ...]`` or ``best: A``."""
    accs = [*study["evals"], *(f"ft_{e}" for e in study["evals"]), TEST_ON_OOD]  # (ft_: none without a fine-tune)
    for name, pair in (study.get("derived") or {}).items():
        if not isinstance(pair, Sequence) or isinstance(pair, str) or len(pair) != 2 or not set(pair) <= set(accs):
            raise ValueError(f"study.derived.{name} must be [a, b] of the accuracies {accs}, got {pair!r}")
    known = accs + list(study.get("derived") or {})
    for cid, c in (study.get("claims") or {}).items():
        where = f"study.claims.{cid}"
        if not isinstance(c, Mapping) or c.get("eval") not in known:
            got = c.get("eval") if isinstance(c, Mapping) else c
            raise ValueError(f"{where} needs eval: one of {known} (the accuracy the claim reads), got {got!r}")
        better, best = c.get("better"), c.get("best")
        chain = isinstance(better, Sequence) and not isinstance(better, str) and len(better) >= 2
        if (better is None) == (best is None) or (better is not None and not chain) or not isinstance(best or "", str):
            raise ValueError(f"{where} needs one of better: [A, B, ...] (A > B > ...) or best: A, got {dict(c)}")


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
    paired = [f"{TEST_ON_OOD}_acc"] * any(f"{TEST_ON_OOD}_acc" in r for r in runs)  # (the curves' 1x point)
    metrics = accs + paired + ["train_img_s", "peak_mem_mb", "fit_s"]
    archs = list(study["archs"])
    variants = study.get("variants")
    key = lambda k: (archs.index(k[0]) if k[0] in archs else 99, scheme_key(k[1], variants))  # noqa: E731
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
                row.update({f"{m}_vs_{base}_{k}": d[k] if ok else None for k in ("mean", "lo", "hi", "n")})
        rows.append({**row, "bench_img_s": cost.get(f"{arch}/{scheme}", {}).get("img_s")})
    return rows


def claims(state: dict) -> list[dict]:
    """The verdict on each of ``study.claims`` per architecture, from paired differences (``vitrel.stats``).

    ``better: [A, B, C]``: the links ``A - B`` and ``B - C``; ``best: A``: ``A - X`` for every other scheme
    ``X`` of the study (one whose runs all failed too). A ``better`` claim needs all its schemes, a ``best`` claim its
    ``A``; links with fewer than 2 shared seeds are not resolved.
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
                if any(a not in have or b not in have for a, b in pairs):
                    continue
            else:  # best: against every other scheme (not its own variants: study.variants of its scheme), those
                # whose runs all failed too (a link without seeds: not resolved, never a scheme left out)
                lost = {f["scheme"] for f in state.get("failed") or [] if f["arch"] == arch}
                others = sorted(have | lost, key=lambda x: scheme_key(x, study.get("variants")))
                own = {c["best"]}  # (a variant named best: against its scheme too, never itself)
                own |= {x for x in others if scheme_key(x, study.get("variants"))[1] == c["best"]}
                pairs = [(c["best"], x) for x in others if x not in own]
                if c["best"] not in have:
                    continue
            if not pairs:
                continue
            links = []
            for a, b in pairs:
                d = paired_diff(_by_seed(runs, arch, a, m), _by_seed(runs, arch, b, m))
                links.append(dict(a=a, b=b, mean=d["mean"], lo=d["lo"], hi=d["hi"], n=d["n"], verdict=verdict(d)))
            out.append(dict(claim=cid, title=c.get("title", cid), arch=arch, eval=c["eval"], links=links,
                            verdict=chain_verdict([x["verdict"] for x in links])))  # fmt: skip
    return out


def _provenance(runs: list[dict]) -> str:
    """``commit on machine: N runs`` for each distinct pair (runs from before commits were recorded: unrecorded)."""
    count = Counter((r.get("commit") or "unrecorded commit", r.get("machine") or "unrecorded machine") for r in runs)
    return "; ".join(f"`{c}` on {m}: {n} run{'s' * (n != 1)}" for (c, m), n in count.items()) or "no runs"


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


def _paired_cell(row: dict, column: str, seeds: int) -> str:
    """A paired difference of the report (``<column>_{mean,lo,hi,n}``), ``(k of n seeds)`` when fewer seeds than the
    study's were paired (as :func:`claim_links` says it)."""
    n = row.get(f"{column}_n")
    cell = _pp(*(row.get(f"{column}_{k}") for k in ("mean", "lo", "hi")))
    return cell + (f" ({n} of {seeds} seeds)" if n is not None and 0 < n < seeds else "")


def _missing_runs(runs: list[dict], arch: str, schemes: list[str], seeds: list[int]) -> str:
    """The line under a paired-difference table with fewer pairs somewhere: each scheme's seeds without a run."""
    have = {s: {r["seed"] for r in runs if (r["arch"], r["scheme"]) == (arch, s)} for s in schemes}
    gone = [
        f"{s} seed{'s' * (len(m) > 1)} {', '.join(map(str, m))}" for s in schemes if (m := sorted(set(seeds) - have[s]))
    ]
    if not gone:  # (every run there, some without a score of an evaluation)
        return "Fewer seeds: a difference is over the seeds both schemes have a score of (some runs lack one)."
    return f"Fewer seeds: a difference is over the seeds both schemes have runs of; no run of {'; '.join(gone)}."


def claim_links(claim: dict, seeds: int) -> str:
    """A claim's links (``claims()``) in words: ``A - B`` in points with its interval, ``(k of n seeds)`` for a link
    decided on fewer than the study's ``seeds``, ``no shared seeds`` for one without any."""
    return "; ".join(
        f"{x['a']} - {x['b']} "
        + (_pp(x["mean"], x["lo"], x["hi"]) if x["n"] else "no shared seeds")
        + (f" ({x['n']} of {seeds} seeds)" if 0 < x["n"] < seeds else "")
        for x in claim["links"]
    )


def markdown(state: dict) -> str:
    rec, rows, study, machine = state["recipe"], state["summary"], state["recipe"]["study"], state["machine"]
    evals, cfg = [m.removesuffix("_acc") for m in acc_metrics(study)], next(iter(rec["runs"].values()))
    key = {e: metric_key(study, e) for e in evals}
    t = cfg["trainer"]
    opt = {**cfg["module"]["optimizer"], **(cfg["module"]["scheduler"] or {})}
    n = {k: "all" if study[k] is None else f"{study[k]:,}" for k in ("test_images", "ood_images")}
    cost = f"the models taking turns ({state.get('cost_rounds')} rounds of {state.get('cost_steps')} steps, median"
    cost += f"; load average {state['cost_load']} before the last timing)" if state.get("cost_load") else ")"
    mem = "weights + AdamW state + profiler peak of one training step's forward and backward (CPU)"
    mem = "CUDA max_memory_allocated over the fit" if machine["device"] == "cuda" else mem
    failed = state.get("failed") or []
    seeds = sorted({r["seed"] for r in [*state["runs"], *failed]})
    precision, on_cpu = t["precision"], sum(r.get("device") == "cpu" for r in state["runs"])
    if on_cpu and not str(precision).startswith("32"):  # the command trains in 32-true on a CPU
        which = "every run" if on_cpu == len(state["runs"]) else f"{on_cpu} runs"
        precision = f"{precision} ({which} on a CPU: 32-true)"
    d = cfg["data"]
    ft = study.get("finetune")
    if d.get("canvas_size"):
        c = d["canvas_size"]
        inputs = f"each image in a {c}x{c} canvas at an offset of the `{d['canvas_mode']}` region"
    else:  # clips (or images at their size)
        side = d.get("img_size") or d.get("size")
        inputs = (
            f"clips of {d['num_frames']} frames of {side}x{side}" if d.get("num_frames") else "images at their size"
        )
    sets = list(study.get("evals") or ())
    notes = {  # (the translation study's sets, each said where the recipe has it)
        "`unseen` = at held-out offsets": any(e.startswith("unseen") for e in sets),
        "`_patch` / `_subpatch` = whole-patch / sub-patch moves only": any(e.endswith("patch") for e in sets),
        "`resN` = the test canvas resized to NxN, zero-shot": any(e.startswith("res") for e in sets),
    }
    what = study.get("eval_notes") or "; ".join(k for k, v in notes.items() if v)
    items = "clips as in training" if d.get("num_frames") else "images at the training offsets"
    lines = [
        f"# Position-scheme study on {study.get('dataset') or 'Fashion-MNIST'} (budget `{state['budget']}`)\n",
        "- Commands: " + ", ".join(f"`{c}`" for c in state.get("commands") or [state["command"]]),
        f"- Machine: {machine['description']}; torch {machine['torch']}"
        + (f"; load average {state['load']}" if state.get("load") else ""),
        f"- Wall time: {state['wall_s'] / 60:.1f} min in all ({len(state['runs'])} runs, seeds {seeds})"
        + (f"; **{len(failed)} failed** (below)" if failed else ""),
        "- Code and machine of the runs: " + _provenance(state["runs"]),
        f"- Recipe (resolved in the JSON): `conf/experiment/study_{state['budget']}.yaml`"
        + "".join(f" `{o}`" for o in rec["overrides"])
        + f": {d['name']}, {inputs}, {t['max_epochs']} epochs of {t['limit_train_batches'] or 'all'} batches of "
        f"{d['batch_size']}, {precision}, grad clip {t['gradient_clip_val']}, label smoothing "
        f"{cfg['module']['label_smoothing']}, no augmentation; "
        + ", ".join(f"{k} {v}" for k, v in opt.items() if k[0] != "_" and v is not None),
        f"- Accuracy in %: mean [95 % interval] over seeds (Student's t), on {n['test_images']} test {items} "
        f"(`test`) and another seeded {n['ood_images']} of the test split (`study.evals`: {what}"
        + (
            f"; `ft_{ft['eval']}` = after a fine-tune at {ft['img_size']}x{ft['img_size']}: "
            + " ".join(f"`{o}`" for o in ft["overrides"])
            if ft
            else ""
        )
        + ").",
        "- Paired differences (percentage points, same seeds) against `none` and `ape` are in the CSV/JSON "
        "(`<eval>_acc_vs_<base>_{mean,lo,hi,n}`, `n` the seeds paired); the claims below are read from them.",
        "- Cost: `img/s` = training images per second (forward, backward, AdamW step), "
        + (
            f"{cost}; `*`: not timed so, over the runs' own training steps after warm-up"
            if state.get("cost")
            else "over each run's training steps after warm-up"
        )
        + f"; `peak MB` = {mem}.\n",
    ]
    if derived := study.get("derived"):
        lacking = 0 if same_images(study) else sum(r.get(f"{TEST_ON_OOD}_acc") is None for r in state["runs"])
        lines[-1] = lines[-1].removesuffix("\n")
        lines += [
            "- Within-run differences in points, each on one set of images ("
            + ", ".join(f"`{k}` = `{a}` - `{b}`" for k, (a, b) in derived.items())
            + f"; `test` beside another set: its accuracy on that set's images, `{TEST_ON_OOD}_acc` in the JSON)"
            + (f"; {lacking} run(s) recorded without it show `-`: rerun them (`--restart`)" if lacking else "")
            + ".\n"
        ]
    verdicts = claims(state)
    if verdicts:
        lines += ["## Published claims\n", "| claim | arch | verdict | deciding differences, pp [95 % interval] |",
                  "|---|---|---|---|"]  # fmt: skip
        for v in verdicts:
            links = claim_links(v, len(seeds))
            lines.append(f"| {v['title']} (`{v['eval']}`) | {v['arch']} | **{v['verdict']}** | {links} |")
        lines.append("")
    if failed:
        lines += ["## Failed runs\n", "A rerun of the command retries them.\n",
                  "| arch | scheme | seed | error | traceback |", "|---|---|---:|---|---|"]  # fmt: skip
        for f in failed:
            error = f["error"].replace("|", "\\|")
            lines.append(f"| {f['arch']} | {f['scheme']} | {f['seed']} | {error} | `{f['log']}` |")
        lines.append("")
    for arch in dict.fromkeys(r["arch"] for r in [*rows, *failed]):
        sub = [r for r in rows if r["arch"] == arch]
        failed_seeds = Counter(f["scheme"] for f in failed if f["arch"] == arch)
        model = ", ".join(f"{k}={v}" for k, v in rec["runs"][arch]["model"].items() if k[0] != "_")
        head = ["scheme", "family", "params", *evals, "img/s", "peak MB"]
        lines += [f"## {arch}: {model}", "", "| " + " | ".join(head) + " |"]
        lines.append("|" + "|".join(["---"] * 3 + ["---:"] * (len(head) - 3)) + "|")
        for r in sub:
            thr, mem = r.get("bench_img_s") or r.get("train_img_s_mean"), r.get("peak_mem_mb_mean")
            own = "*" if state.get("cost") and not r.get("bench_img_s") else ""  # (not timed in alternation)
            few = f" ({r['seeds']} of {len(seeds)} seeds" if r["seeds"] < len(seeds) else ""  # (a study under way)
            few += f", {failed_seeds[r['scheme']]} failed" * bool(few and failed_seeds[r["scheme"]]) + ")" * bool(few)
            cells = [r["scheme"] + few, r["family"], f"{r['params'] / 1e3:.1f}k", *(_pct(r, key[e]) for e in evals)]
            cells += [f"{thr:.0f}{own}" if thr else "-", f"{mem:.0f}" if mem else "-"]
            lines.append("| " + " | ".join(cells) + " |")
        for scheme in [s for s in failed_seeds if s not in {r["scheme"] for r in sub}]:  # every seed failed
            family = _family(scheme, study.get("variants"))
            lines.append(
                f"| {scheme} (failed) | {family} | - | " + " | ".join(["**failed**"] * len(evals)) + " | - | - |"
            )
        for base in ("none", "ape"):
            if not any(r["scheme"] == base for r in sub):
                continue
            lines += ["", f"Paired differences against `{base}` ({arch}, pp [95 % interval]):", ""]
            lines += ["| scheme | " + " | ".join(evals) + " |", "|---|" + "---:|" * len(evals)]
            partial = False
            for r in sub:
                if r["scheme"] != base:
                    cells = [_paired_cell(r, f"{key[e]}_vs_{base}", len(seeds)) for e in evals]
                    partial |= any(c.endswith(" seeds)") for c in cells)
                    lines.append(f"| {r['scheme']} | " + " | ".join(cells) + " |")
            if partial:  # (an interval over fewer pairs looks like the others': say whose runs are missing)
                lines += ["", _missing_runs(state["runs"], arch, [r["scheme"] for r in sub], seeds)]
        lines.append("")
    return "\n".join(lines)


def atomic_write(path: Path, text: str) -> None:
    path.with_name(f".{path.name}.tmp").write_text(text)
    os.replace(path.with_name(f".{path.name}.tmp"), path)


def _save_png(fig, path: Path) -> None:
    fig.savefig(path.with_name(f".{path.name}.tmp"), dpi=110, format="png")
    os.replace(path.with_name(f".{path.name}.tmp"), path)


def write_results(state: dict, out: Path, name: str) -> None:
    """JSON (everything), CSV (summary), Markdown and PNG, each written atomically; with ``none`` in the study also
    ``<name>_diffs.png`` (the paired differences against it), with ``study.scales`` (eval -> resolution factor)
    ``<name>_curves.png``, accuracy against the factor."""
    from vitrel.study.plots import plot_curves, plot_study, plot_study_diffs

    state["summary"], state["claims"] = summarise(state), claims(state)
    atomic_write(out / f"{name}.json", json.dumps(state, indent=1))
    atomic_write(out / f"{name}.md", markdown(state))
    if state["summary"]:
        w = csv.DictWriter(buf := io.StringIO(), fieldnames=list(state["summary"][0]), lineterminator="\n")
        w.writeheader()
        w.writerows({k: ("" if v is None else v) for k, v in r.items()} for r in state["summary"])
        atomic_write(out / f"{name}.csv", buf.getvalue())
        title = f"{name}: {state['machine']['description']}"
        chance = state["recipe"]["study"].get("chance") or 0.1  # (Fashion-MNIST's ten classes)
        _save_png(plot_study(state["summary"], title=title, chance=chance), out / f"{name}.png")
        if {r["scheme"] for r in state["summary"]} > {"none"}:  # what the claims read: paired differences
            _save_png(plot_study_diffs(state["summary"], base="none", title=title), out / f"{name}_diffs.png")
        if scales := state["recipe"]["study"].get("scales"):
            label = state["recipe"]["study"].get("scale_label") or "resolution factor"
            _save_png(plot_curves(state["summary"], scales, title, label), out / f"{name}_curves.png")
