"""A study run that fails (here a scheme the recipe cannot build, a run out of memory) is recorded and the sweep goes
on: the results file and the report name it, the command exits nonzero, a rerun retries it; an interrupt still stops
the study at once. In one process and with ``--jobs`` workers (smoke budget)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from vitrel.pos.tables import EXTEND_RULES

pytestmark = pytest.mark.slow

#: a study variant that always fails at build for any recipe (rel2d_full takes the rules of EXTEND_RULES)
BROKEN = "+study.variants.broken=['pos=rel2d_full','pos.extend=bogus']"
WHY = f"ValueError: rel2d_full: extend must be one of {EXTEND_RULES}, got 'bogus'"


def study_main(out: Path, schemes: str, *extra: str) -> dict:
    import vitrel.study

    argv = ["--budget", "smoke", "--schemes", schemes, "--archs", "vit", "--out", str(out), "--progress", "none"]
    return vitrel.study.main([*argv, "--threads", "1", "--cost-rounds", "0", *extra])


def test_a_failing_run_is_recorded_the_others_finish_and_a_rerun_retries_it(tmp_path, capsys):
    with pytest.raises(SystemExit, match=r"^1 run\(s\) of study_smoke failed; rerun the same command to retry them$"):
        study_main(tmp_path, "broken,none", BROKEN)
    out = capsys.readouterr().out
    data = json.loads((tmp_path / "study_smoke.json").read_text())
    assert [r["scheme"] for r in data["runs"]] == ["none"]  # the run after the failed one too
    ((failure),) = data["failed"]
    log = tmp_path / "study_smoke_failed" / "vit_broken_seed0.log"
    assert {k: failure[k] for k in ("arch", "scheme", "seed", "error", "log")} == {
        "arch": "vit", "scheme": "broken", "seed": 0, "error": WHY, "log": str(log),
    }  # fmt: skip
    assert "Traceback" in log.read_text() and WHY in log.read_text()
    assert f"1 of 2 runs failed (in {tmp_path}/study_smoke.json and .md):\n  vit broken seed 0: {WHY}" in out
    md = (tmp_path / "study_smoke.md").read_text()
    assert "; **1 failed** (below)" in md and f"| vit | broken | 0 | {WHY} | `{log}` |" in md
    assert "| broken (failed) | learned bias | - | **failed** | **failed** |" in md  # the cell: failed, not missing
    assert "| none | none |" in md

    with pytest.raises(SystemExit, match="1 run.s. of study_smoke failed"):  # the same command: retried, fails again
        study_main(tmp_path, "broken,none", BROKEN)
    assert "1 runs to do (1 of them failed before: retried)" in capsys.readouterr().out
    again = json.loads((tmp_path / "study_smoke.json").read_text())
    assert again["runs"] == data["runs"] and [f["scheme"] for f in again["failed"]] == ["broken"]


def _failing(schemes: dict[str, BaseException]):
    """``run_one`` that raises ``schemes[<scheme>]`` for those schemes, else trains."""
    from vitrel.study import cli

    real = cli.run_one

    def run_one(cfg, *a, **k):
        if cfg.pos.name in schemes:
            raise schemes[cfg.pos.name]
        return real(cfg, *a, **k)

    return run_one


def test_an_interrupt_stops_the_study_and_a_retried_run_that_succeeds_clears_its_failure(tmp_path, monkeypatch):
    """Ctrl-C (Lightning turns it into SystemExit) stops the sweep at once: a failure (here out of memory) is recorded
    and the sweep goes on, an interrupt is not a failure; the runs and failures so far are kept. The rerun trains
    the failed run, and its failure is gone."""
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    with monkeypatch.context() as mp:
        mp.setattr("vitrel.study.cli.run_one", _failing({"rel2d_full": oom, "ape": KeyboardInterrupt()}))
        with pytest.raises(KeyboardInterrupt):
            study_main(tmp_path, "none,rel2d_full,ape,alibi2d")
    data = json.loads((tmp_path / "study_smoke.json").read_text())
    assert [r["scheme"] for r in data["runs"]] == ["none"]  # alibi2d (after the interrupt) not run
    assert [(f["scheme"], f["error"]) for f in data["failed"]] == [
        ("rel2d_full", "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    ]
    state = study_main(tmp_path, "none,rel2d_full")  # the rerun: it trains now, the failure is gone
    assert [r["scheme"] for r in state["runs"]] == ["none", "rel2d_full"] and state["failed"] == []
    assert not (tmp_path / "study_smoke_failed").exists()
    assert "failed" not in (tmp_path / "study_smoke.md").read_text()


def test_jobs_workers_record_failures_and_the_study_merges_them(tmp_path):
    """A ``--jobs`` worker (``--shard i/N``, run here in this process; the spawned workers: test_study.py's
    ``jobs2``) whose run fails records it in its shard and ends well; the study merges the shard's failures with its
    own runs (a failing worker stopped the study before, its shard and the other's left unmerged)."""
    study_main(tmp_path, "broken,none", BROKEN, "--shard", "0/2")  # worker 0 of 2: broken; ends without raising
    shard = tmp_path / "study_smoke.shard0.json"
    assert [f["scheme"] for f in json.loads(shard.read_text())["failed"]] == ["broken"]
    shard.write_text(json.dumps({**json.loads(shard.read_text()), "wall_s": 1000.0}))  # (a worker of 1000 s)
    study_main(tmp_path, "none", BROKEN)  # the study (worker 1's share, here itself) merges worker 0's shard
    data = json.loads((tmp_path / "study_smoke.json").read_text())
    assert 1000.0 < data["wall_s"] < 1300.0  # the interrupted run's time, then this one's
    assert [r["scheme"] for r in data["runs"]] == ["none"]
    assert [(f["scheme"], f["error"]) for f in data["failed"]] == [("broken", WHY)]
    assert not list(tmp_path.glob("*.shard*")) and "| broken (failed) |" in (tmp_path / "study_smoke.md").read_text()


def test_a_nan_loss_is_a_failed_run_and_sigterm_stops_the_study(tmp_path):
    """The variants train with a callback of the training tests: ``nan`` poisons a weight (NaNGuard ends the run,
    recorded as failed), ``term`` sends this process SIGTERM (the study stops at once: ``rel2d_full`` is not run;
    the runs and failures so far are kept)."""
    nan = "+study.variants.nan=['pos=ape','+callbacks.poison={_target_:tests.train_helpers.PoisonWeights,at_step:1}']"
    term = "+study.variants.term=['pos=ape','+callbacks.sig={_target_:tests.train_helpers.SendSignal,at_step:1}']"
    with pytest.raises(SystemExit) as stopped:
        study_main(tmp_path, "nan,none,term,rel2d_full", nan, term)
    assert stopped.value.code == 128 + 15  # (SIGTERM's, not the failures' exit)
    data = json.loads((tmp_path / "study_smoke.json").read_text())
    assert [r["scheme"] for r in data["runs"]] == ["none"]
    ((failure),) = data["failed"]
    assert failure["scheme"] == "nan" and failure["error"].startswith("NonFiniteLossError: non-finite training loss")


def test_a_crash_while_merging_shards_loses_no_run(tmp_path, monkeypatch):
    """The study writes the runs it merged from ``--jobs`` shards before it removes the shards: a crash between the
    two (here at the removal) leaves them in ``<name>.json``."""
    study_main(tmp_path, "none", "--shard", "0/2")
    shard = tmp_path / "study_smoke.shard0.json"
    real = Path.unlink

    def crash(self, *a, **k):
        if self == shard:
            raise RuntimeError("crash")
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "unlink", crash)
    with pytest.raises(RuntimeError, match="crash"):
        study_main(tmp_path, "none", "--max-runs", "0")
    assert [r["scheme"] for r in json.loads((tmp_path / "study_smoke.json").read_text())["runs"]] == ["none"]


def test_overrides_that_do_not_compose_are_one_line_with_the_form_that_does(tmp_path):
    """``pos.<key>=`` of a key the recipe's default scheme lacks: Hydra's reason in one line (not a traceback) and the
    ``++`` form, which sets the key on every run's scheme; nothing is written."""
    out = tmp_path / "o"
    msg = (
        r"^python bench/study.py: pos.mlp_weight_decay=true does not compose with experiment=study_smoke: Could not "
        r"override 'pos.mlp_weight_decay'; every run takes the overrides, so set a scheme option with "
        r"\+\+pos.mlp_weight_decay=true \("
    )
    with pytest.raises(SystemExit, match=msg):
        study_main(out, "rel2d_cpb", "pos.mlp_weight_decay=true")
    with pytest.raises(SystemExit, match=r"lrr=1 does not compose .*: Could not override 'module.optimizer.lrr'; To"):
        study_main(out, "none", "module.optimizer.lrr=1")
    assert not any(out.iterdir())


def test_seed_and_pos_among_the_overrides_are_refused_and_every_entry_composes_first(tmp_path):
    """``seed=5`` and ``pos=ape`` were taken, recorded in the recipe, and lost to each run's own ``seed=<k>`` and
    ``pos=<entry>``: the study trained seed 0 and ``none`` under a report naming seed 5 and ape. Refused, naming
    ``--seeds`` / ``--schemes``. A ``pos.<key>=`` one selected entry lacks (``none`` has no ``init_std``) failed as
    that entry's run after the others had trained: refused before any run, naming the entry; nothing is written."""
    out = tmp_path / "o"
    for given in ("seed=5", "pos=ape", "+seed=1"):
        with pytest.raises(SystemExit, match=rf"^python bench/study.py: {re.escape(given)}: the study sets each run"):
            study_main(out, "none", given)
    with pytest.raises(SystemExit, match=r"Could not override 'pos.init_std'.* \(entry none, vit\)$"):
        study_main(out, "rel2d_full,none", "pos.init_std=0.5")
    assert not out.exists() or not any(out.iterdir())


def test_a_scored_variant_under_a_fine_tune_is_refused_naming_the_override_that_runs_it(tmp_path):
    """A scored variant (``trained_as``) has no fine-tune: under a recipe with ``study.finetune`` it is refused, and
    the message names ``~study.finetune``, which runs it (the audit checked it)."""
    variant = "++study.variants.myv={trained_as:rel2d_full,score_with:['pos.extend=interpolate']}"
    with pytest.raises(SystemExit, match=r"have no fine-tune; .*add the override ~study.finetune \(no fine-tune\)$"):
        study_main(tmp_path / "o", "myv", variant)
