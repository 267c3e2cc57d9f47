"""The study (vitrel.study, run as bench/study.py) on the smoke budget (conf/experiment/study_smoke.yaml):
output files and columns, resume, recipe guard, the evaluation sets on the full-set data path, the default
selection read from the registry."""

from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from vitrel.bench import source_commit

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def study():
    import vitrel.study

    return vitrel.study


@pytest.fixture(scope="module")
def recipe(study):
    """``study.recipe(budget)``, composed once a budget for the module's tests (a copy each call: about 3 Hydra
    compositions a budget, 17 calls of 6 budgets)."""
    import copy

    made = {}

    def get(budget: str) -> dict:
        if budget not in made:
            made[budget] = study.recipe(budget)
        return copy.deepcopy(made[budget])

    return get


def test_bench_study_is_the_framework_command():
    """bench/study.py (the documented command) runs vitrel.study's main: one way to run the study."""
    import vitrel.study

    spec = importlib.util.spec_from_file_location("vitrel_bench_study", ROOT / "bench" / "study.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main is vitrel.study.main


def test_schemes_default_to_the_registry_ordered_by_family(study, recipe):
    """A registered scheme is in the default selection, placed by its family, with no list to edit."""
    import vitrel
    from vitrel.pos.base import FAMILIES
    from vitrel.pos.registry import get_pos_class

    rec = recipe("gpu")  # default_schemes: null
    schemes, _, _ = study.select(study.parse_args(["--budget", "gpu"]), rec["study"])
    assert set(vitrel.list_pos()) <= set(schemes) and set(rec["study"]["variants"]) <= set(schemes)
    fams = [FAMILIES.index(get_pos_class(s).family) for s in schemes if s in vitrel.list_pos()]
    assert fams == sorted(fams) and schemes[0] == "none"
    mixed = schemes.index("rope2d_mixed")  # the variants follow their scheme
    assert schemes[mixed + 1 : mixed + 4] == ["rope2d_mixed_avgpool", "rope2d_mixed_dinov3", "rope2d_mixed_string"]


EVALS = ["test", "unseen", "unseen_patch", "unseen_subpatch", "res60", "res80", "ft_res60"]


def run(study, out: Path, *extra: str) -> dict:
    argv = ["--budget", "smoke", "--schemes", "none,rel2d_full", "--out", str(out), "--progress", "lines"]
    return study.main([*argv, "--threads", "1", *extra])


#: the smoke study's timing: the timing's code at 16 steps, not 5 x 10 x 4 models
COST = ["--cost-rounds", "2", "--cost-steps", "2"]


@pytest.fixture(scope="module")
def smoke(study, tmp_path_factory):
    """The smoke study run in two goes, as if it died after its first run (``--max-runs 1``), then resumed: its
    folder, the first go's run, the second go's state and what the second go printed. Shared by the tests that read
    it (test_jobs_give_the_results_of_one_process: its ViT runs are those of one process)."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("smoke")
    first = run(study, out, *COST, "--max-runs", "1")["runs"]
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        state = run(study, out, *COST)
    return out, first, state, printed.getvalue()


def test_smoke_study_writes_every_file_and_resumes(study, recipe, smoke, capsys):
    tmp_path, first, state, out = smoke
    assert len(first) == 1
    first = dict(first[0])
    assert "3 runs to do (1 of the selection already done" in out
    assert "cost: timing 4 models in alternation" in out  # once the selection is complete
    assert len(state["runs"]) == 4
    assert state["runs"][0] == first  # kept as it was, not rerun
    assert {(r["arch"], r["scheme"], r["seed"]) for r in state["runs"]} == {
        (a, s, 0) for a in ("vit", "swin") for s in ("none", "rel2d_full")
    }

    name = "study_smoke"
    for ext in ("json", "csv", "md", "png"):
        assert (tmp_path / f"{name}.{ext}").stat().st_size > 0, ext
    assert (tmp_path / f"{name}_pos.safetensors").exists()
    assert not (tmp_path / f"{name}_work").exists()  # per-run checkpoints are removed once recorded

    data = json.loads((tmp_path / f"{name}.json").read_text())
    assert data["recipe"] == json.loads(json.dumps(recipe("smoke")))
    assert data["recipe"]["runs"]["swin"]["model"]["depths"] == [1, 1]  # the architecture's overrides
    assert data["machine"]["device"] == "cpu" and "CPU" in data["machine"]["description"]
    assert data["wall_s"] > 0 and data["command"].startswith("python bench/study.py --budget smoke")
    for r in data["runs"]:
        for key in EVALS:
            assert 0.0 <= r[f"{key}_acc"] <= 1.0
        assert r["params"] > 0 and r["train_img_s"] > 0 and r["peak_mem_mb"] > 0 and r["steps"] == 3
        assert r["ft_steps"] == 2 and r["ft_fit_s"] > 0  # the fine-tune at 60x60 (study_smoke.yaml)
        assert r["commit"] == source_commit() and r["machine"] == data["machine"]["description"]  # per run
    assert f"`{source_commit()}` on {data['machine']['description']}" in (tmp_path / f"{name}.md").read_text()

    with open(tmp_path / f"{name}.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["arch"], r["scheme"]) for r in rows] == [
        ("vit", "none"),
        ("vit", "rel2d_full"),
        ("swin", "none"),
        ("swin", "rel2d_full"),
    ]
    for col in (
        "family",
        "seeds",
        "params",
        "test_acc_mean",
        "test_acc_std",
        "test_acc_lo",
        "test_acc_hi",
        *(f"{e}_acc_mean" for e in EVALS),
        "unseen_acc_vs_none_mean",
        "res80_acc_vs_ape_lo",
        "train_img_s_mean",
        "peak_mem_mb_mean",
    ):
        assert col in rows[0], col
    assert rows[1]["family"] == "learned bias" and rows[0]["seeds"] == "1" and rows[0]["test_acc_std"] == ""
    by_key = {(r["arch"], r["scheme"]): r for r in data["runs"]}
    assert float(rows[1]["test_acc_mean"]) == pytest.approx(by_key[("vit", "rel2d_full")]["test_acc"])

    md = (tmp_path / f"{name}.md").read_text()
    columns = [*EVALS, "unseen_drop", "res80_drop"]  # then study.derived: within-run differences
    assert "| scheme | family | params | " + " | ".join(columns) + " | img/s | peak MB |" in md
    assert "`conf/experiment/study_smoke.yaml`: fashion_mnist, each image in a 40x40 canvas at an offset of the" in md
    assert "Paired differences against `none` (vit, pp [95 % interval])" in md
    assert "## vit" in md and "## swin" in md and data["machine"]["description"] in md

    from safetensors import safe_open

    with safe_open(str(tmp_path / f"{name}_pos.safetensors"), "pt") as f:
        keys = list(f.keys())
        meta = f.metadata()
    assert any(k.startswith("vit/rel2d_full/blocks.0.attn.pos.table") for k in keys)
    assert json.loads(meta["swin/rel2d_full"])["pos"] == {"name": "rel2d_full", "init_std": 0.02, "extend": "grow"}

    assert sorted(data["cost"]) == ["swin/none", "swin/rel2d_full", "vit/none", "vit/rel2d_full"]
    assert all(len(c["rounds"]) == 2 and c["img_s"] > 0 for c in data["cost"].values())
    assert float(rows[0]["bench_img_s"]) == pytest.approx(data["cost"]["vit/none"]["img_s"])

    # nothing left to do: a rerun only rewrites the files (the throughput timing is kept)
    capsys.readouterr()
    state = run(study, tmp_path, *COST)
    assert len(state["runs"]) == 4 and state["cost"] == data["cost"]
    out = capsys.readouterr().out
    assert "0 runs to do" in out and "cost: timing" not in out


def test_another_recipe_is_refused(study, tmp_path):
    run(study, tmp_path, "--max-runs", "1", "--archs", "vit")
    path = tmp_path / "study_smoke.json"
    data = json.loads(path.read_text())
    data["recipe"]["runs"]["vit"]["trainer"]["max_epochs"] = 7
    path.write_text(json.dumps(data))
    with pytest.raises(SystemExit, match="another recipe.*runs.*--restart"):
        run(study, tmp_path, "--archs", "vit")
    # what only reads or selects runs (claims, variants no run used) may change: the runs are kept
    data["recipe"]["runs"]["vit"]["trainer"]["max_epochs"] = 1
    data["recipe"]["study"]["claims"] = {}
    data["runs"][0].update(scheme="rope2d_mixed_dinov3", pos_overrides=["pos=rope2d_mixed"])
    path.write_text(json.dumps(data))
    with pytest.raises(SystemExit, match="another recipe.*variant rope2d_mixed_dinov3"):
        run(study, tmp_path, "--archs", "vit")  # a finished run of a variant whose overrides changed
    data["runs"][0].update(scheme="none", pos_overrides=None)
    path.write_text(json.dumps(data))
    assert len(run(study, tmp_path, "--archs", "vit", "--max-runs", "0")["runs"]) == 1
    state = run(study, tmp_path, "--max-runs", "1", "--archs", "vit", "--restart")
    assert len(state["runs"]) == 1


def test_claims_added_by_an_override_keep_the_finished_runs(study, tmp_path):
    """An override that only reads the runs (``study.claims``, ``study.derived``) was compared with the recorded
    overrides whole, so adding a claim on the command line was refused as another recipe. It now reads the finished
    runs; an override that trains differently is still refused."""
    base = ["--archs", "vit", "--cost-rounds", "0"]
    run(study, tmp_path, "--max-runs", "1", *base)
    claim = "++study.claims.mine={better: [rel2d_full, none], eval: again}"
    state = run(study, tmp_path, "--max-runs", "0", *base, claim, "++study.derived.again=[res60,test]")
    assert len(state["runs"]) == 1 and "mine" in state["recipe"]["study"]["claims"]
    assert "mine" in (tmp_path / "study_smoke.md").read_text()
    for bad, why in [
        ("++study.claims.mine={better: [rel2d_full, none]}", "study.claims.mine needs eval: one of"),
        ("++study.claims.mine={best: [rel2d_full], eval: test}", "study.claims.mine needs one of better"),
        ("++study.derived.again=[res60,nowhere]", r"study.derived.again must be \[a, b\] of the accuracies"),
    ]:
        with pytest.raises(SystemExit, match=why):  # (a KeyError once every run was done)
            run(study, tmp_path, "--max-runs", "0", *base, bad)
    with pytest.raises(SystemExit, match=r"another recipe \(differs in: overrides, runs"):
        run(study, tmp_path, "--max-runs", "0", *base, "trainer.max_epochs=2")


def test_reread_writes_the_report_of_old_results_again(study, tmp_path, capsys):
    """Results made under another recipe (an older vitrel's) could not be read by this one's reading without training
    again. ``--reread`` writes the report from the results file's runs and recipe, trains nothing; it refuses
    overrides and a missing file."""
    run(study, tmp_path, "--max-runs", "1", "--archs", "vit", "--cost-rounds", "0")
    path = tmp_path / "study_smoke.json"
    data = json.loads(path.read_text())
    data["recipe"]["runs"]["vit"]["trainer"]["max_epochs"] = 7  # (another recipe: a plain rerun refuses it)
    data["recipe"]["study"]["claims"] = {"c": {"best": "none", "eval": "test"}}
    data.pop("summary")
    path.write_text(json.dumps(data))
    (tmp_path / "study_smoke.md").unlink()
    state = run(study, tmp_path, "--reread")
    assert len(state["runs"]) == 1 and state["summary"][0]["test_acc_mean"] == data["runs"][0]["test_acc"]
    assert state["commands"][-1].endswith("--reread") and "1 runs read again" in capsys.readouterr().out
    assert json.loads(path.read_text())["summary"] == state["summary"] and (tmp_path / "study_smoke.md").exists()
    assert state["recipe"]["runs"]["vit"]["trainer"]["max_epochs"] == 7
    with pytest.raises(SystemExit, match="--reread reads .* it takes no overrides"):
        run(study, tmp_path, "--reread", "trainer.max_epochs=2")
    with pytest.raises(SystemExit, match="--reread: no results file"):
        run(study, tmp_path, "--reread", "--name", "other")


def test_finished_runs_of_other_scheme_settings_are_refused(study, tmp_path):
    """conf/pos/rel2d_full.yaml's ``init_std`` changed between two goes of a study: the recipe leaves ``pos`` out
    (``NOT_RECIPE``) and only a variant's overrides were checked, so the second go was accepted and the scheme's row
    averaged runs of two ``init_std``. Each run records its resolved position settings; a finished run whose entry
    now composes other ones is refused, naming the key. Unchanged settings, and runs recorded before they were (no
    ``pos_settings``), resume."""
    state = run(study, tmp_path, "--max-runs", "1", "--archs", "vit", "--schemes", "rel2d_full", "--cost-rounds", "0")
    (done,) = state["runs"]
    assert done["pos_settings"] == {"name": "rel2d_full", "init_std": 0.02, "extend": "grow"}
    path = tmp_path / "study_smoke.json"
    data = json.loads(path.read_text())
    again = ["--archs", "vit", "--schemes", "rel2d_full", "--max-runs", "0", "--cost-rounds", "0"]
    assert len(run(study, tmp_path, *again)["runs"]) == 1  # the same settings: kept
    data["runs"][0]["pos_settings"]["init_std"] = 2.0  # (as if the run was made with init_std: 2.0 in the file)
    path.write_text(json.dumps(data))
    with pytest.raises(SystemExit, match=r"another recipe \(differs in: pos\.init_std of rel2d_full\); rerun with"):
        run(study, tmp_path, *again)
    del data["runs"][0]["pos_settings"]  # (results of an older vitrel: nothing to compare, kept)
    path.write_text(json.dumps(data))
    assert len(run(study, tmp_path, *again)["runs"]) == 1


def test_bad_selection_is_refused(study, tmp_path, capsys):
    """Refused with its reason; the logger levels and warning filters the study sets while it runs are restored (a
    study called in-process left Lightning's INFO lines off for the rest of the process)."""
    import logging
    import warnings

    names = ("lightning.pytorch", "lightning.fabric", "lightning", "vitrel")
    levels, filters = {n: logging.getLogger(n).level for n in names}, list(warnings.filters)
    with pytest.raises(SystemExit, match="unknown scheme"):
        study.main(["--budget", "smoke", "--schemes", "rel3d", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="unknown architecture"):
        study.main(["--budget", "smoke", "--archs", "convnet", "--out", str(tmp_path)])
    study.main(["--budget", "smoke", "--out", str(tmp_path / "empty"), "--max-runs", "0"])  # no runs: no files
    assert "no runs of study_smoke in" in capsys.readouterr().out and not list((tmp_path / "empty").iterdir())
    assert {n: logging.getLogger(n).level for n in names} == levels and warnings.filters == filters


@pytest.mark.parametrize(
    "args, says",
    [
        (["--jobs", "0"], "1, got 0"),
        (["--jobs", "-2"], "1, got -2"),
        (["--threads", "0"], "1, got 0"),
        (["--cost-steps", "0"], "1, got 0"),
        (["--seeds", "0"], "1, got 0"),
        (["--max-runs", "-1"], "0, got -1"),
        (["--cost-rounds", "-1"], "0, got -1"),
    ],
)
def test_counts_below_their_least_are_refused(study, tmp_path, capsys, args, says):
    """``--jobs 0`` / ``-2`` ran as one job without a word, ``--max-runs -1`` dropped the last run (a slice), and
    ``--seeds 0`` ran nothing: argparse's error, naming the option, before any work."""
    with pytest.raises(SystemExit) as exit_:
        study.main(["--budget", "smoke", "--out", str(tmp_path / "out"), *args])
    assert exit_.value.code == 2
    assert f"argument {args[0]}: must be an integer >= {says}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _marked_idx_files(root: Path, n_train: int, n_test: int) -> None:
    """Fashion-MNIST IDX files whose images are black but for a white top-left pixel (it marks the offset)."""
    from vitrel.data import write_idx

    for split, n in (("train", n_train), ("t10k", n_test)):
        x = np.zeros((n, 28, 28), dtype=np.uint8)
        x[:, 0, 0] = 255
        write_idx(root / f"{split}-images-idx3-ubyte", x)
        write_idx(root / f"{split}-labels-idx1-ubyte", (np.arange(n) % 10).astype(np.uint8))


def _offsets(x: torch.Tensor) -> set[tuple[int, int]]:
    """(top, left) of the white pixel of each canvas in ``x`` ``[B, 1, H, W]``."""
    flat = x.flatten(1).argmax(1)
    return {(int(i) // x.shape[-1], int(i) % x.shape[-1]) for i in flat}


def test_fixed_canvas_split_puts_train_and_test_offsets_in_disjoint_regions(study, tmp_path):
    """The full-set path (``subset="full"``) on generated IDX files: every training offset in the seen block,
    every held-out offset outside it; whole-patch and sub-patch sets as named; the resized sets' sizes."""
    from hydra.utils import instantiate

    from vitrel.data.transforms import offset_region

    _marked_idx_files(tmp_path, 256, 300)
    over = ["data=fashion_mnist_full", f"data.root={tmp_path}", "study.test_images=null", "study.ood_images=200"]
    cfg = study.compose("smoke", over)
    dm = instantiate(cfg.data)
    seen = {tuple(o) for o in offset_region((28, 28), 40, "seen")}
    assert seen == {(t, l) for t in range(7) for l in range(7)}
    dm.setup("fit")
    train = set()
    for epoch in range(3):
        loader = dm.train_dataloader()
        loader.sampler.set_epoch(epoch)
        train |= set().union(*(_offsets(x) for x, _ in loader))
    assert train <= seen and len(train) > 35  # drawn from the whole seen block, nothing outside it
    data = {k: study.materialise(v) for k, v in study.eval_sets(cfg.study, dm).items()}
    assert list(data) == ["test", "unseen", "unseen_patch", "unseen_subpatch", "res60", "res80"]
    assert data["test"][0].shape == (300, 1, 40, 40) and data["unseen"][0].shape == (200, 1, 40, 40)
    assert data["res60"][0].shape == (200, 1, 60, 60) and data["res80"][0].shape == (200, 1, 80, 80)
    assert _offsets(data["test"][0]) <= seen
    unseen = _offsets(data["unseen"][0])
    assert unseen and not unseen & (seen | train) and all(t > 6 or l > 6 for t, l in unseen)
    assert len(unseen) > 50  # spread over the region (120 offsets)
    patch, sub = _offsets(data["unseen_patch"][0]), _offsets(data["unseen_subpatch"][0])
    assert patch and all(t % 4 == 0 and l % 4 == 0 and (t > 6 or l > 6) for t, l in patch)
    assert sub and all((t % 4 or l % 4) and (t > 6 or l > 6) for t, l in sub)
    # every held-out set scores the same 200 test images, in the same order
    for k in ("unseen_patch", "unseen_subpatch", "res60", "res80"):
        assert data[k][1].tolist() == data["unseen"][1].tolist()


def test_recipes_compose_as_train_py_does(study, recipe):
    """Every budget composes; the runs are train.py's configs (experiment=study_<budget>) with the study's overrides."""
    assert study.BUDGETS == [
        "cpu", "extrapolation", "extrapolation_trained", "gpu", "smoke", "trained", "video_extrapolation",
    ]  # fmt: skip
    for budget in study.BUDGETS[:-1]:  # the image budgets (video_extrapolation: tests/study/test_video_study.py)
        rec = recipe(budget)
        archs = {"vit"} if budget.startswith("extrapolation") else {"vit", "swin"}  # Swin's windows: a fixed window
        assert set(rec["runs"]) == archs and rec["study"]["evals"]["test"] == {"canvas": 40, "mode": "seen"}
        for cfg in rec["runs"].values():
            assert cfg["model"]["_target_"] == "vitrel.create_model" and cfg["test"] is False
            assert cfg["callbacks"]["model_checkpoint"] is None and cfg["logger"] == {}
            assert (cfg["data"]["canvas_size"], cfg["data"]["canvas_mode"]) == (40, "seen")
    cpu = recipe("cpu")
    assert cpu["runs"]["swin"]["model"]["patch_size"] == 4 and cpu["runs"]["vit"]["data"]["subset"] == "full"
    assert cpu["study"]["seeds"] == 3 and len(cpu["study"]["default_schemes"]) == 8
    assert recipe("gpu")["study"]["default_schemes"] is None  # every scheme and variant


def test_trained_budgets_compose_with_the_fast_step(recipe):
    """The GPU budgets at a trained size (study_trained.yaml, study_extrapolation_trained.yaml): all 60k images,
    8 epochs of 256, bf16, the fast step; the extrapolation one keeps its recipe's entries, evals and claims."""
    for budget in ("trained", "extrapolation_trained"):
        run = next(iter(recipe(budget)["runs"].values()))
        assert run["data"]["subset"] == "full" and run["data"]["batch_size"] == 256 and run["data"]["drop_last"]
        assert run["trainer"]["max_epochs"] == 8 and run["trainer"]["limit_train_batches"] is None
        assert run["trainer"]["precision"] == "bf16-mixed" and run["module"]["sync_free"]
        assert run["module"]["compile"] == {"mode": "reduce-overhead", "dynamic": False}
        assert run["model"]["embed_dim"] == 128 and run["model"]["depth"] == 6
    base, trained = recipe("extrapolation")["study"], recipe("extrapolation_trained")["study"]
    assert trained["claims"] == base["claims"] and trained["default_schemes"] == base["default_schemes"]
    assert trained["evals"] == base["evals"] and trained["test_images"] is None
    needed = {s for c in recipe("trained")["study"]["claims"].values() for s in c.get("better", [c.get("best")])}
    assert needed <= set(recipe("trained")["study"]["default_schemes"])


def test_trained_budget_runs_at_a_tiny_size(study, tmp_path):
    """The runner takes the trained budget (here on the embedded subset, a tiny ViT, 2 steps, the eager step: a CPU
    cannot compile 72 models in a test) and writes its tables; a rerun skips the finished run."""
    tiny = ["data=fashion_mnist", "trainer.limit_train_batches=2", "trainer.max_epochs=1", "data.batch_size=16",
            "study.test_images=32", "study.ood_images=16", "study.timing_skip_steps=0", "step=eager",
            "study.archs.vit=['model=vitrel_vit_tiny_patch4_32','++model.embed_dim=16','++model.depth=1',"
            "'++model.num_heads=2']",
            "study.finetune.overrides=['trainer.max_epochs=1','trainer.limit_train_batches=1']"]  # fmt: skip
    argv = ["--budget", "trained", "--schemes", "none", "--archs", "vit", "--seeds", "1", "--out", str(tmp_path)]
    argv += ["--progress", "none", "--threads", "1", "--cost-rounds", "0", *tiny]
    state = study.main(argv)
    assert [(r["arch"], r["scheme"], r["seed"]) for r in state["runs"]] == [("vit", "none", 0)]
    assert {"test_acc", "unseen_acc", "res80_acc", "ft_res60_acc"} <= set(state["runs"][0])
    assert all((tmp_path / f"study_trained.{ext}").exists() for ext in ("json", "csv", "md"))
    md = (tmp_path / "study_trained.md").read_text()  # the recipe's bf16 is for GPUs: the CPU ran 32-true
    assert "batches of 16, bf16-mixed (every run on a CPU: 32-true), grad clip" in md
    again = study.main(argv)
    assert again["runs"] == state["runs"]  # skipped: nothing rerun


def test_variants_are_schemes_with_options(study, recipe, tmp_path):
    """A variant label runs its scheme with the options it names (DINOv3 coordinates, average pooling)."""
    rec = recipe("smoke")
    args = study.parse_args(["--budget", "smoke", "--schemes", "rope2d_mixed_dinov3,none"])
    schemes, archs, seeds = study.select(args, rec["study"])
    assert schemes == ["rope2d_mixed_dinov3", "none"] and seeds == [0]
    over = [*rec["study"]["archs"]["vit"], *rec["study"]["variants"]["rope2d_mixed_dinov3"]]
    cfg = study.compose("smoke", over)
    assert cfg.pos.name == "rope2d_mixed" and cfg.pos.coords == "normalized" and cfg.pos.rescale == 2.0
    cfg = study.compose("smoke", [*rec["study"]["archs"]["vit"], *rec["study"]["variants"]["rope2d_mixed_avgpool"]])
    assert cfg.model.global_pool == "avg"


def _state(accs: dict[tuple[str, str], list[float]], claims: dict) -> dict:
    runs = [
        dict(arch=a, scheme=s, seed=k, family="f", params=1, test_acc=v, res80_acc=v)
        for (a, s), vs in accs.items()
        for k, v in enumerate(vs)
    ]
    study_cfg = dict(
        archs={"vit": []}, evals={"test": {}, "res80": {}}, claims=claims, derived={"drop": ["res80", "test"]}
    )
    study_cfg["variants"] = {"rope2d_mixed_dinov3": ["pos=rope2d_mixed", "pos.coords=normalized"]}  # (as recipes)
    return dict(runs=runs, recipe=dict(study=study_cfg))


def test_claims_are_decided_by_paired_intervals(study):
    claims = {
        "chain": dict(title="rel > abs > none", better=["rel2d_full", "ape", "none"], eval="test"),
        "best": dict(title="rope best", best="rope2d_mixed", eval="res80"),
    }
    accs = {
        ("vit", "none"): [0.70, 0.72, 0.71],
        ("vit", "ape"): [0.80, 0.83, 0.81],  # ape - none = 0.10, 0.11, 0.10: clearly above 0
        ("vit", "rel2d_full"): [0.81, 0.84, 0.82],  # rel - ape = 0.01 each seed: sd 0, interval [0.01, 0.01]
        ("vit", "rope2d_mixed"): [0.78, 0.86, 0.80],  # vs ape: -0.02, +0.03, -0.01: not resolved
        ("vit", "rope2d_mixed_dinov3"): [0.1, 0.1, 0.1],  # its own variant: not a competitor
    }
    out = {c["claim"]: c for c in study.claims(_state(accs, claims))}
    assert out["chain"]["verdict"] == "reproduced" and [x["verdict"] for x in out["chain"]["links"]] == [
        "reproduced",
        "reproduced",
    ]
    assert out["chain"]["links"][0]["mean"] == pytest.approx(0.01)
    best = out["best"]
    assert {x["b"] for x in best["links"]} == {"none", "ape", "rel2d_full"} and best["verdict"] == "not resolved"
    accs[("vit", "rel2d_full")] = [0.79, 0.82, 0.80]  # rel - ape = -0.01 each seed: contradicted
    out = {c["claim"]: c for c in study.claims(_state(accs, claims))}
    assert out["chain"]["verdict"] == "contradicted"
    # a claim on a within-run difference: drop = res80 - test (here 0 for every run): the same, not resolved
    claims["drop"] = dict(title="drop", better=["rel2d_full", "none"], eval="drop")
    out = {c["claim"]: c for c in study.claims(_state(accs, claims))}
    assert out["drop"]["links"][0]["mean"] == 0.0 and out["drop"]["verdict"] == "not resolved"
    del accs[("vit", "ape")]  # a claim needs all its schemes
    assert "chain" not in {c["claim"] for c in study.claims(_state(accs, claims))}


@pytest.fixture(scope="module")
def jobs2(study, tmp_path_factory):
    """One ``--jobs 2`` study (the vit runs: 2 worker processes), shared by the tests that read it (none writes to
    it): its state, its folder and the worker command lines it started."""
    import subprocess

    cmds = []

    class Recorded(subprocess.Popen):
        def __init__(self, cmd, *a, **k):
            if "vitrel.study" in cmd:
                cmds.append(list(cmd))
            super().__init__(cmd, *a, **k)

    out = tmp_path_factory.mktemp("jobs2")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("vitrel.study.cli.subprocess.Popen", Recorded)
        state = run(study, out, "--archs", "vit", "--jobs", "2", "--cost-rounds", "0")
    return state, out, cmds


def test_jobs_pack_runs_into_worker_processes(jobs2):
    """--jobs 2: two worker processes share the to-do list; their runs and position tensors are merged."""
    state, out, cmds = jobs2
    assert len(cmds) == 2
    assert sorted(r["scheme"] for r in state["runs"]) == ["none", "rel2d_full"]
    assert not list(out.glob("*.shard*"))
    from safetensors import safe_open

    with safe_open(str(out / "study_smoke_pos.safetensors"), "pt") as f:
        assert set(f.metadata()) == {"vit/none", "vit/rel2d_full"}
    assert json.loads((out / "study_smoke.json").read_text())["runs"] == state["runs"]


def test_jobs_workers_take_the_next_run_not_a_fixed_share(study, jobs2, tmp_path):
    """A --jobs worker takes whichever run no worker has taken yet (a file in the parent's ``taken`` folder), so a
    worker that finishes early goes on with the rest; a fixed share (runs ``i::N``) left one idle while the other
    ran the slow entries. Here worker 1 of 2, alone, takes both runs (a fixed share: rel2d_full only); then
    worker 0, with both taken, runs nothing. The parent removes the folder after its workers."""
    _, out, cmds = jobs2
    assert all(c[c.index("--taken") + 1] == str(cmds[0][cmds[0].index("--taken") + 1]) for c in cmds)
    assert not list(out.rglob("taken"))
    taken = tmp_path / "taken"
    taken.mkdir()
    one = run(study, tmp_path, "--archs", "vit", "--shard", "1/2", "--taken", str(taken), "--cost-rounds", "0")
    assert [r["scheme"] for r in one["runs"]] == ["none", "rel2d_full"]
    assert sorted(p.name for p in taken.iterdir()) == ["vit_none_0", "vit_rel2d_full_0"]
    zero = run(study, tmp_path, "--archs", "vit", "--shard", "0/2", "--taken", str(taken), "--cost-rounds", "0")
    assert zero["runs"] == []


def test_jobs_give_the_results_of_one_process(jobs2, smoke):
    """--jobs 2 (worker processes, each told its share of a GPU's memory) gives every run the accuracies and
    final loss of --jobs 1 (the smoke study's ViT runs) for the same seeds (CPU, one thread each: bitwise)."""
    many, _, cmds = jobs2
    one = dict(runs=[r for r in smoke[2]["runs"] if r["arch"] == "vit"])
    assert sorted(r["scheme"] for r in one["runs"]) == ["none", "rel2d_full"]
    assert len(cmds) == 2 and all(c[c.index("--memory-fraction") + 1] == "0.4750" for c in cmds)
    keys = [k for k in one["runs"][0] if k.endswith("_acc")] + ["final_train_loss", "steps", "params"]
    assert len(keys) > 5
    by_run = {r["scheme"]: {k: r[k] for k in keys} for r in one["runs"]}
    assert {r["scheme"]: {k: r[k] for k in keys} for r in many["runs"]} == by_run


def test_source_commit_is_dirty_for_code_not_for_results(tmp_path):
    import subprocess

    def git(*a):
        subprocess.run(
            ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *a],
            check=True,
            capture_output=True,
        )

    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "bench" / "results" / "r.json").write_text("{}\n")
    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "c")
    head = subprocess.run(
        ["git", "-C", str(tmp_path), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert source_commit(tmp_path / "pkg") == head
    (tmp_path / "bench" / "results" / "r.json").write_text('{"runs": []}\n')  # the study's own output
    assert source_commit(tmp_path / "pkg") == head
    (tmp_path / "pkg" / "a.py").write_text("x = 2\n")  # code
    assert source_commit(tmp_path / "pkg") == head + "+dirty"
    assert source_commit(tmp_path.parent / "no_such_checkout_here") is None


def test_runs_of_an_interrupted_jobs_run_with_another_recipe_are_refused(study, tmp_path):
    """A ``--jobs`` worker's shard file (``--shard i/N``: what the workers run) left by an interrupted study with
    another recipe: its runs were merged into the next study, whatever its recipe (here 1 training step, not 3),
    when no results file was there to refuse it. Refused now, naming the file; nothing merged or written."""
    argv = ["--budget", "smoke", "--schemes", "none", "--archs", "vit", "--out", str(tmp_path), "--progress", "none"]
    argv += ["--threads", "1", "--cost-rounds", "0"]
    study.main([*argv, "--shard", "0/2", "trainer.limit_train_batches=1"])
    shard = tmp_path / "study_smoke.shard0.json"
    assert [r["steps"] for r in json.loads(shard.read_text())["runs"]] == [1]
    with pytest.raises(SystemExit, match=r"study_smoke.shard0.json holds a study made with another recipe \(differs "
                       r"in: overrides, runs; it was made with the overrides \['trainer.limit_train_batches=1'\], "
                       r"this command gives \[\]\); rerun with --restart"):  # fmt: skip
        study.main([*argv, "--max-runs", "0"])
    assert shard.exists() and not (tmp_path / "study_smoke.json").exists()
    state = study.main([*argv, "--max-runs", "0", "trainer.limit_train_batches=1"])  # its own recipe: merged
    assert [r["steps"] for r in state["runs"]] == [1] and not shard.exists()


def test_a_study_under_way_marks_what_its_rows_lack(study, tmp_path, capsys):
    """The report's img/s column: the alternating timing where a model had it, else its runs' own throughput, which
    the header said was the alternating timing too. Such a cell is marked ``*`` and the header says so. A row with
    fewer seeds than the study's says how many (its interval looked like the others')."""
    argv = ["--budget", "smoke", "--archs", "vit", "--out", str(tmp_path), "--progress", "none", "--threads", "1"]
    argv += ["--cost-rounds", "1", "--cost-steps", "1"]
    study.main([*argv, "--schemes", "none", "--seeds", "2"])  # complete: timed in alternation
    state = study.main([*argv, "--schemes", "ape", "--seeds", "2", "--max-runs", "1"])  # incomplete: not timed
    assert sorted(state["cost"]) == ["vit/none"]
    rows = {r["scheme"]: r for r in state["summary"]}
    md = (tmp_path / "study_smoke.md").read_text()
    assert "(1 rounds of 1 steps, median; load average " in md
    assert " before the last timing); `*`: not timed so, over the runs' own training steps" in md
    none_row = next(line for line in md.splitlines() if line.startswith("| none |"))
    ape_row = next(line for line in md.splitlines() if line.startswith("| ape (1 of 2 seeds) |"))
    assert none_row.split(" | ")[-2] == f"{rows['none']['bench_img_s']:.0f}"
    assert ape_row.split(" | ")[-2] == f"{rows['ape']['train_img_s_mean']:.0f}*"
    assert (tmp_path / "study_smoke_diffs.png").stat().st_size > 0  # none and another scheme: paired differences

    # --recost: the file's timed model and the now complete selection's, in one alternation; nothing trained again
    before, _ = state["cost"]["vit/none"]["rounds"], capsys.readouterr()
    state = study.main([*argv, "--schemes", "ape", "--seeds", "1", "--recost"])
    out = capsys.readouterr().out
    assert "0 runs to do" in out and "cost: timing 2 models in alternation (1 rounds)" in out, out
    assert sorted(state["cost"]) == ["vit/ape", "vit/none"] and state["cost"]["vit/none"]["rounds"] != before
    assert len(state["runs"]) == 3
    with pytest.raises(SystemExit, match=r"--recost: nothing to time in .*other\.json \(no model timed before"):
        study.main([*argv, "--schemes", "ape", "--seeds", "2", "--name", "other", "--recost"])  # (and no run)
    assert not (tmp_path / "other.json").exists()


def test_best_leaves_out_its_own_variants_only(study):
    """``best: pape`` against every other scheme: ``pape_ri`` is another registered scheme (its name starts with
    ``pape``, which left it out); a ``study.variants`` label of the scheme (trained or scored) is its own."""
    accs = {("vit", s): [0.5, 0.6, 0.7] for s in ("pape", "pape_ri", "pape_interp", "pape_big", "none")}
    state = _state(accs, {"best": dict(title="pape best", best="pape", eval="test")})
    state["recipe"]["study"]["variants"] = {
        "pape_interp": {"trained_as": "pape", "score_with": ["pos.x=1"]},
        "pape_big": ["pos=pape", "pos.y=2"],
    }
    (claim,) = study.claims(state)
    assert [x["b"] for x in claim["links"]] == ["none", "pape_ri"]


def test_best_naming_a_variant_never_compares_it_with_itself(study):
    """``best: pape_interp`` (a ``study.variants`` label): its links held ``pape_interp - pape_interp`` (+0.0, never
    resolved), so the claim could never be reproduced. It is against every other scheme, its own scheme included."""
    accs = {("vit", s): [0.5, 0.6, 0.7] for s in ("pape", "pape_interp", "none")}
    accs[("vit", "pape_interp")] = [0.8, 0.9, 1.0]
    state = _state(accs, {"best": dict(title="interp best", best="pape_interp", eval="test")})
    state["recipe"]["study"]["variants"] = {"pape_interp": {"trained_as": "pape", "score_with": ["pos.x=1"]}}
    (claim,) = study.claims(state)
    assert sorted(x["b"] for x in claim["links"]) == ["none", "pape"]
    assert claim["verdict"] == "reproduced"


def test_best_is_not_reproduced_while_a_competitor_failed(study):
    """``best: A`` is A against every other scheme of the study: a scheme whose runs all failed is one of them (its
    link has no seeds: not resolved), not left out so that A is declared best without it."""
    accs = {("vit", "none"): [0.70, 0.72, 0.71], ("vit", "rope2d_mixed"): [0.80, 0.83, 0.81]}
    state = _state(accs, {"best": dict(title="rope best", best="rope2d_mixed", eval="test")})
    (claim,) = study.claims(state)
    assert claim["verdict"] == "reproduced"  # rope - none: 0.10, 0.11, 0.10
    state["failed"] = [dict(arch="vit", scheme="rel2d_full", seed=k, error="E") for k in range(3)]
    state["failed"].append(dict(arch="swin", scheme="ape", seed=0, error="E"))  # another architecture's: not this one's
    (claim,) = study.claims(state)
    links = {x["b"]: (x["n"], x["verdict"]) for x in claim["links"]}
    assert links == {"none": (3, "reproduced"), "rel2d_full": (0, "not resolved")}
    assert claim["verdict"] == "not resolved"


def test_report_marks_claim_links_with_fewer_seeds_or_none(study):
    """The report's claims table: a link decided on fewer seeds than the study's says so, and a link to a scheme
    whose runs all failed says it has no shared seeds (not a bare ``-``)."""
    from vitrel.bench import machine_info
    from vitrel.study.reading import markdown, summarise
    from vitrel.study.runs import recipe

    rec = recipe("smoke")
    rec["study"]["claims"] = {"best": dict(title="rope best", best="rope2d_mixed", eval="test")}
    accs = {("vit", "none"): [0.70, 0.72, 0.71], ("vit", "rope2d_mixed"): [0.80, 0.83]}  # rope: 2 of 3 seeds
    runs = _state(accs, {})["runs"]
    for r in runs:
        r.update({f"{e}_acc": r["test_acc"] for e in rec["study"]["evals"]}, peak_mem_mb=1.0, train_img_s=1.0)
    failed = [dict(arch="vit", scheme="rel2d_full", seed=k, error="E", log="x.log") for k in range(3)]
    state = dict(budget="smoke", recipe=rec, command="c", wall_s=1.0, runs=runs, failed=failed)
    state.update(machine=machine_info(), summary=summarise(state))
    md = markdown(state)
    assert "rope2d_mixed - none +10.5 [" in md and "] (2 of 3 seeds); rope2d_mixed - rel2d_full no shared seeds |" in md
    # the paired-difference table too (it showed the interval over 2 seeds as the others'), and whose runs are missing
    (row,) = [line for line in md.splitlines() if line.startswith("| rope2d_mixed | +10.5 [")]
    assert row.count("(2 of 3 seeds)") == len(rec["study"]["evals"]), row  # (every eval)
    assert "no run of rope2d_mixed seed 2." in md
    assert summarise(state)[1]["test_acc_vs_none_n"] == 2  # (the CSV / JSON column)


def test_restart_discards_this_study_only(tmp_path, capsys):
    """``--restart`` (``load_state(..., restart=True)``) removes the study's own files, not another study's whose name
    starts with this one's (``--budget extrapolation --restart`` beside ``study_extrapolation_trained.*``)."""
    from vitrel.study.cli import load_state, scheme_settings

    ours = ["s.json", "s.csv", "s.md", "s.png", "s_diffs.png", "s_curves.png", "s_pos.safetensors", "s.shard1.json"]
    ours += ["s_pos.shard0.safetensors", ".s.json.tmp"]
    theirs = ["s_trained.json", "s_trained.md", "s_trained_pos.safetensors", "s2.json", "s2_diffs.png", "other.json"]
    for f in ours + theirs:
        (tmp_path / f).write_text("{}")
    for d in ("s_work", "s_failed", "s_trained_work", "s_trained_failed"):
        (tmp_path / d / "x").mkdir(parents=True)
    load_state(tmp_path / "s.json", {}, restart=True, settings=scheme_settings)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(theirs + ["s_trained_work", "s_trained_failed"])
    assert capsys.readouterr().out.startswith(f"--restart: removed 12 file(s) of s in {tmp_path}: s.json, s.csv,")


def test_notebook_03_claims_cell_reads_a_link_without_seeds():
    """notebooks/03_study_results.ipynb's claims table (its second code cell) on a results file whose claim has a link
    to a scheme whose runs all failed (mean None): the report's words, not a TypeError on ``100 * None``."""
    nb = json.loads((ROOT / "notebooks" / "03_study_results.ipynb").read_text())
    cell = "".join([c for c in nb["cells"] if c["cell_type"] == "code"][1]["source"])
    link = lambda b, n, m: dict(a="rope2d_mixed", b=b, n=n, mean=m, lo=m and m - 0.01, hi=m and m + 0.01)  # noqa: E731
    claim = dict(title="rope best", eval="test", arch="vit", verdict="not resolved")
    claim["links"] = [link("none", 2, 0.1), link("rel2d_full", 0, None)]
    runs = [dict(seed=k) for k in range(2)]
    shown = []
    studies = {"study_x": dict(claims=[claim], runs=runs, failed=[dict(seed=2)])}
    exec(cell, dict(studies=studies, display=shown.append, Markdown=str))  # noqa: S102
    assert (
        "rope2d_mixed - none +10.0 [+9.0, +11.0] (2 of 3 seeds); rope2d_mixed - rel2d_full no shared seeds" in shown[0]
    )


def test_start_line_tells_done_runs_from_deferred_ones(study, tmp_path, capsys):
    """The study's first line separates the runs a results file already holds from those ``--max-runs`` leaves for a
    later run (it said "N already done or deferred" for both)."""
    argv = ["--budget", "smoke", "--schemes", "none,rel2d_full", "--out", str(tmp_path), "--cost-rounds", "0"]
    study.main([*argv, "--max-runs", "0", "--progress", "none"])
    assert (
        "study_smoke: 0 runs to do (4 of the selection left for a later run by --max-runs) on"
        in capsys.readouterr().out
    )


@pytest.mark.parametrize("ema_eval", [True, False])
def test_a_study_scores_the_weights_its_run_tests(ema_eval):
    """Under ``module/ema=default`` the study scored the raw weights while ``train.py``'s test, ``eval.py`` and the
    fine-tune's ``load_model`` took the EMA copy (26.5 % at res80 against eval.py's 25.7 % on one run)."""
    import functools
    from types import SimpleNamespace

    from timm.utils import ModelEmaV3

    from vitrel.study.runs import Probe
    from vitrel.train.module import ClassifierModule

    net = torch.nn.Sequential(torch.nn.Linear(4, 3))
    ema = functools.partial(ModelEmaV3, decay=0.9)
    module = ClassifierModule(net, num_classes=3, ema=ema, ema_eval=ema_eval)
    probe = Probe()
    probe.on_fit_end(SimpleNamespace(global_step=3, current_epoch=1), module)
    assert probe.model is (module.ema_model.module if ema_eval else net) and probe.steps == 3
