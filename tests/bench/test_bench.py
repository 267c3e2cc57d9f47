"""vitrel.bench: the alternating timer's call order and counts, the memory probes."""

from __future__ import annotations

import os
import re

import pytest
import torch

from vitrel import bench


def test_alternate_takes_turns_and_counts_calls():
    calls: list[str] = []
    fns = {k: (lambda k=k: calls.append(k)) for k in "ab"}
    times = bench.alternate(fns, 3, warmup=1, repeat=2, zigzag=True)
    assert calls == list("ab" + "aabb" + "bbaa" + "aabb")
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3}
    assert all(t >= 0 for v in times.values() for t in v)
    assert set(bench.medians(times)) == {"a", "b"}


def test_memory_probes_and_train_step():
    model = torch.nn.Linear(64, 10)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    step = bench.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), x, y)
    before = model.weight.detach().clone()
    step()
    assert not torch.equal(before, model.weight)
    assert bench.saved_bytes(lambda: model(x.requires_grad_())) >= x.numel() * 4
    assert bench.peak_bytes(lambda: torch.ones(1024, 1024).sum(), "cpu") >= 1024 * 1024 * 4
    assert bench.train_step_bytes(model, x, y) >= 3 * 640 * 4
    info = bench.machine_info("cpu")
    assert info["device"] == "cpu" and "CPU" in info["description"]


def test_cpu_memory_probe_keeps_the_profiler_quiet():
    """kineto's trace start / stop lines (and its GPU probe error without a GPU) stay out of the output."""
    import os
    import subprocess
    import sys

    code = "import torch; from vitrel.bench import cpu_peak_bytes; print(cpu_peak_bytes(lambda: torch.ones(256).sum()))"
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=True)
    assert int(out.stdout.strip()) >= 1024
    assert "profiler_start" not in out.stderr and "gpuGetDeviceCount" not in out.stderr, out.stderr


def test_step_timer_in_a_fit():
    import lightning as L

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.cross_entropy(self.lin(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(40, 4), torch.randint(0, 2, (40,)))
    timer = bench.StepTimer(skip=2)
    assert timer.img_s is None
    trainer = L.Trainer(
        max_epochs=1,
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=8))
    assert timer.seen == 5 and timer.images == 3 * 8 and timer.img_s > 0


def test_gpu_bench_code_path_on_cpu(tmp_path):
    """bench/gpu.py's in-process sections run on a CPU (small sizes) and write their tables: the code the
    GPU run will execute, checked here (the numbers come from the GPU)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "gpu.py"
    spec = importlib.util.spec_from_file_location("vitrel_bench_gpu", path)
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    out = tmp_path / "gpu.md"
    # the sections' limits are for a GPU; on 2 busy cores (CI, beside another test worker) the code path gets 10 minutes
    limits = ["--section-limit", "600", "--budget", "1200"]
    gpu.main(["--device", "cpu", "--quick", "--sections", "hazards", "mfu", *limits, "--out", str(out)])
    text = out.read_text()
    assert "## Hazards" in text and "| 8x8 windows, N=64 | MATH | yes | 0 |" in text
    assert "attn_impl=fold vs sdpa" in text and "## MFU" in text and "| fold |" in text
    assert "(section hazards: " in text and "(section mfu: " in text  # each section timed, in its own process
    assert gpu.peak_flops("NVIDIA H100 80GB HBM3") == 989.4e12 and gpu.peak_flops("a CPU") is None
    # the pass runs the fused kernel's targets first; `bench/gpu_session.sh rest` the others, in SECTIONS' order
    order = list(gpu.SECTIONS)
    assert order[:7] == ["kernel", "diagnose", "attention", "forward", "models", "vitb", "vitbp"]
    assert gpu.REST == order[7:]


def test_gpu_section_stopped_at_its_limit_kills_its_scripts_and_keeps_their_output(tmp_path, capsys):
    """bench/gpu.py's sections: a script's output lines go to the section's stderr as they come (``run_script``), and
    a section stopped at its time limit (``run_section``) has its whole process group killed, the script it started
    too (``subprocess.run``'s timeout killed the section alone: its benchmark ran on beside the next sections), and
    keeps what the script wrote (``partial_output``)."""
    import importlib.util
    import sys
    import time
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "gpu.py"
    spec = importlib.util.spec_from_file_location("vitrel_bench_gpu_sections", path)
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    cmd, text = gpu.run_script(["-c", "print('| row 1 |'); print('| row 2 |')"])
    assert text.startswith("| row 1 |\n| row 2 |") and cmd.startswith("python -c")
    assert "[partial] | row 1 |" in capsys.readouterr().err
    pid_file = tmp_path / "pid"
    script = (  # a section whose script writes a row, then runs on (its pid kept, to look for it after)
        "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); print('| a row |', flush=True); "
        "time.sleep(120)"
    )
    section = (  # (run_script's way with its script's lines, without importing torch: a light section)
        "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]], "
        "stdout=subprocess.PIPE, text=True); [print('[partial] ' + x, end='', file=sys.stderr, flush=True) "
        "for x in p.stdout]"
    )
    t0 = time.perf_counter()
    code, _, err = gpu.run_section([sys.executable, "-c", section, script, str(pid_file)], limit=4)
    assert code is None and time.perf_counter() - t0 < 60 and gpu.partial_output(err) == "| a row |", err
    assert gpu.PARTIAL == "[partial] "  # (the prefix the section above writes)
    pid = int(pid_file.read_text())
    for _ in range(50):  # (killed: gone once its parent's group is reaped)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 9)
        raise AssertionError("the section's script outlived it")


def test_gpu_bench_train_section_reports_a_failed_run(monkeypatch):
    """bench/gpu.py's train section when a run fails (the fast step on the H100): the eager row stays, the failed
    run gets its row, and the end of its stderr comes back below the table (each train.py faked here)."""
    import importlib.util
    import json
    import subprocess
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "gpu.py"
    spec = importlib.util.spec_from_file_location("vitrel_bench_gpu", path)
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)

    def fake_run(cmd, **kwargs):
        run_dir = Path(next(a for a in cmd if a.startswith("hydra.run.dir=")).split("=", 1)[1])
        if "step=fast" in cmd:
            return subprocess.CompletedProcess(cmd, 1, "", "x" * 5000 + "\nRuntimeError: the fast step's error\n")
        metrics = {"global_step": 1560, "fit_s": 78.0, "metrics": {"test/acc1": 0.84}}
        (run_dir / "metrics.json").write_text(json.dumps(metrics))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(gpu.subprocess, "run", fake_run)
    text = "\n".join(gpu.train_recipe(torch.device("cpu"), quick=False))
    assert "| eager | 1560 | 78.0 | 20.0 | 84.00 % | `python train.py trainer=cpu step=eager` |" in text
    assert "| fast | **failed** (exit status 1, below) |" in text
    assert "RuntimeError: the fast step's error" in text and "x" * 2900 in text and "x" * 3000 not in text


@pytest.mark.slow
def test_attention_bench_inference_runs_flex_on_cpu(tmp_path, monkeypatch):
    """bench/attention.py --inference times forward passes only, so flex (no CPU backward) runs here; --causal
    (flex with the causal BlockMask, compiled). The script run as ``python bench/attention.py ...`` runs it, in this
    process (a child process spent its start and imports, a third of the test, on nothing the test checks)."""
    import runpy
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "att.md"
    cmd = ["bench/attention.py", "--inference", "--schemes", "rel2d_full", "rel2d_full@flex",
           "--tokens", "16", "--tokens-per-batch", "32", "--dim", "32", "--heads", "2", "--rounds", "1",
           "--warmup", "1", "--causal", "--out", str(out)]  # fmt: skip
    monkeypatch.chdir(root)
    monkeypatch.setattr(sys, "argv", cmd)
    runpy.run_path(str(root / cmd[0]), run_name="__main__")
    text = out.read_text()
    assert "forward only" in text and "causal" in text and "| 16 | 2 | rel2d_full@flex |" in text


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), reason="Triton's interpreter is off")
def test_triton_tune_kernel_launches_run_alone():
    """bench/triton_tune.py's per-launch breakdown (its ``diagnose``): the launches of one call with a GPU's launch
    configuration, the forward run first, each runnable alone (here through Triton's interpreter; timed on a GPU)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "triton_tune.py"
    spec = importlib.util.spec_from_file_location("vitrel_bench_triton_tune", path)
    tune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune)
    q = torch.randn(2, 2, 65, 64)
    launches = tune.kernel_launches(q, q, q, torch.randn(2, 15, 15), (8, 8), bias_read="tiles")
    assert list(launches) == ["fwd", "delta", "dkdv", "dq", "dbias"]
    assert torch.isfinite(launches["fwd"].args["O"]).all() and (launches["fwd"].args["LSE"] != 0).all()
    for launch in launches.values():
        launch()
    assert (launches["dkdv"].args["BM"], launches["dkdv"].args["BN"]) == (64, 64)  # (the H100's fastest: square)
    assert list(tune.kernel_launches(q, q, q, None, (8, 8))) == ["fwd", "delta", "dkdv", "dq"]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), reason="Triton's interpreter is off")
def test_triton_tune_one_tile_reads_the_first_tile_everywhere():
    """bench/triton_tune.py --diagnose's kernels that read one bias tile for every tile (the bias's memory traffic out,
    their instructions kept) compute attention with the first tile's bias in every tile: the forward's output and
    ``dkdv``'s and ``dq``'s gradients (from the one-tile forward's log-sum-exp) against a dense reference in the
    interpreter, 145 tokens in 3 x 3 tiles of a GPU's 64 x 64."""
    import importlib.util
    import math
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "triton_tune.py"
    spec = importlib.util.spec_from_file_location("vitrel_bench_triton_tune_one", path)
    tune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune)
    g = torch.Generator().manual_seed(0)
    q, k, v, go = (torch.randn(1, 2, 145, 16, generator=g) for _ in range(4))
    launches = tune.tb.plan(q, k, v, torch.randn(2, 23, 23, generator=g), (12, 12), 1, bias_read="tiles")
    assert launches["fwd"].args["patterns"][0] == 9  # (n_pat, d_min, n_m)
    one = {name: tune._one_tile(launches[name]) for name in ("fwd", "dkdv", "dq")}
    one["fwd"]()
    launches["delta"].args["DO"].copy_(go)  # (plan's output gradient, read by delta, dkdv and dq)
    for name in ("delta", "dkdv", "dq"):
        (launches if name == "delta" else one)[name]()
    bias = launches["fwd"].args["BT"][:, 0].float().repeat(1, 3, 3)[:, :145, :145] / math.log2(math.e)  # (base 2)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = ((leaves[0] @ leaves[1].transpose(-1, -2)) * 16**-0.5 + bias).softmax(-1) @ leaves[2]
    torch.testing.assert_close(one["fwd"].args["O"], ref.detach(), atol=1e-5, rtol=1e-4)
    grads = torch.autograd.grad(ref, leaves, go)
    for key, want in zip(("DQ", "DK", "DV"), grads):
        got = (one["dq"] if key == "DQ" else one["dkdv"]).args[key]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-3, msg=key)


def test_triton_tune_rows_run(monkeypatch, tmp_path):
    """bench/triton_tune.py's rows (what a GPU session times) run through the interpreter, each call once: a forward
    row and a backward row (with the table's gradient, without, ``dq`` by atomics) at head dim 64 and 128, and the
    ``dbias`` kernel's other tile's row and the forward's row without tensor descriptors, each a configuration handed
    to the call, none failed. (It
    caught the backward rows' loop variable shadowing the table every row differentiates.)"""
    import argparse
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "triton_tune.py"
    spec = importlib.util.spec_from_file_location("vitrel_bench_triton_tune_rows", path)
    tune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune)
    monkeypatch.setattr(tune, "alternate", lambda fns, *a, **kw: {k: [(f(), 1.0)[1]] for k, f in fns.items()})
    no_tma = {d: [r for r in f if r[-1] == "no TMA"] for d, (f, _) in tune.CONFIGS.items()}
    square = {d: [r for r in b if r[-1] in ("square dbias", "wide dbias")][:1] for d, (_, b) in tune.CONFIGS.items()}
    # (a row with the forward's keys and values read by address, one with the dbias kernel's other tile: wide at head
    # dim 64, whose default is square, square at 128)
    assert all(len(rows) == 1 for rows in (*no_tma.values(), *square.values()))
    assert square[64][0][-1] == "wide dbias" and square[128][0][-1] == "square dbias"
    rows = {d: (f[:1] + no_tma[d], b[:1] + square[d]) for d, (f, b) in tune.CONFIGS.items()}
    monkeypatch.setattr(tune, "CONFIGS", rows)
    lines: list[str] = []
    for hd in (64, 128):
        tune.tune_size(2, argparse.Namespace(rounds=1, out=None), lines, hd, device="cpu", tokens=5)
    assert len(lines) == 2 * (2 + 2 + 3 + 2) and not [x for x in lines if "failed" in x], lines
    assert sum("no TMA" in x for x in lines) == 2 and not [x for x in lines if "not run" in x], lines
    assert sum("square dbias" in x for x in lines) == 2 and sum("dbias 128 x 64 warps 8" in x for x in lines) == 2
    lines = []
    tune.tune_windows(argparse.Namespace(rounds=1, out=None), lines, device="cpu", images=0)
    # plain SDPA's fwd + bwd and fwd, the forward's rows (a window a program, the one-tile forward's), then each
    # fwd + bwd row with and without the table's gradient: the four kernels and the one-tile kernel's
    want = 2 + len(tune.WINDOWS_FWD) + 2 * len(tune.WINDOWS)
    assert len(lines) == want and not [x for x in lines if "failed" in x], lines
    assert sum("fwd a window a program" in x for x in lines) == 1
    assert sum("four bwd kernels" in x for x in lines) == 2 and sum("bwd warps 4 stages 1" in x for x in lines) == 2
    # the table's gradient in dq and in the dbias kernel (dq by atomics) (--in-dq): 5 x 5 (one pattern a tile: both
    # timed) and 16 tokens (one tile: no dq or dbias kernel, said so)
    lines = []
    out = tmp_path / "in_dq.md"
    tune.tune_in_dq(argparse.Namespace(rounds=1, out=out), lines, device="cpu", tokens=50, calls=[(5, 0), (4, 0)])
    assert out.read_text().splitlines() == lines  # (written as they come: the last rows, not taken, too)
    assert len(lines) == 2 * (2 + len(tune.IN_DQ_ROWS)) and sum("the dbias kernel" in x for x in lines) == 2
    assert not [x for x in lines if "failed" in x], lines
    for what in ("gradient in dq", "the dbias kernel"):
        rows = [x for x in lines if what in x]
        assert len(rows) == 2 and "not taken" not in rows[0] and "not taken" in rows[1], rows


def test_busy_seconds_leave_the_host_out():
    """``vitrel.bench.busy_seconds`` (the busy columns of ``bench/triton_tune.py`` and ``bench/attention.py``): a call
    that only waits on the host (50 ms of sleep, one tiny operator) is busy well under its wall time, a call of
    matrix products for milliseconds; on the CPU the operators' own times stand for the kernels'."""
    import time

    x = torch.randn(256, 256)
    idle = bench.busy_seconds(lambda: (time.sleep(0.05), x + 1), torch.device("cpu"), calls=3)
    assert 0 < idle < 0.02, idle  # (50 ms of wall a call; an operator preempted on a loaded CPU takes a few ms)
    busy = bench.busy_seconds(lambda: [x @ x for _ in range(20)], torch.device("cpu"), calls=3)
    assert busy > 1e-3, busy  # (0.67 GFLOP a call: milliseconds on any CPU)


def test_step_profile_tables_on_cpu():
    """bench/step_profile.py, the code path of the GPU run's ``profile`` section on a CPU (ViT-S pair at 32 px):
    each model's wall and busy time, the categories side by side summing to the busy time, ours' dearest
    operators; and the GPU's kernel names in their categories (an FMHA kernel is SDPA's, not a matrix product)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "step_profile.py"
    spec = importlib.util.spec_from_file_location("vitrel_bench_step_profile", path)
    sp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sp)
    argv = ["--device", "cpu", "--img-size", "32", "--batch-size", "2", "--steps", "1", "--warmup", "0"]
    lines = sp.main([*argv, "--pairs", "vit_rel2d_full", "--top", "3", "--host"])
    assert lines[1].startswith("### vit_rel2d_full: vitrel_vit_small_patch16_224 + rel2d_full @auto against")
    walls = [row for row in lines if row.startswith(("| ours |", "| timm |"))]
    assert len(walls) == 2 and all(float(row.split("|")[2]) > 0 for row in walls)
    first = lines.index("| category | ours ms / step | timm ms / step | ours - timm |") + 2
    last = next(i for i, row in enumerate(lines) if row.startswith("| all |"))
    cats = {row.split("|")[1].strip(): row.split("|")[2:5] for row in lines[first:last]}
    total = lines[last].split("|")[2:5]
    assert float(cats["matrix products"][0]) > 0 and float(cats["matrix products"][1]) > 0
    for col in (0, 1):  # each model's categories sum to its busy time
        assert abs(sum(float(v[col]) for v in cats.values()) - float(total[col])) <= 0.001 * (len(cats) + 1)
    top = lines[lines.index("| operator (CPU: own time) | category | calls / step | ms / step | share |") + 2 :]
    assert len([row for row in top[:4] if row.startswith("| `")]) == 3
    # --host: the host's time a step under cProfile, each model's, and ours' dearest Python functions, dearest first
    host = next(row for row in lines if row.startswith("Under cProfile"))
    assert [float(x) for x in re.findall(r"([\d.]+) ms", host)][0] > 0 and "timm" in host
    funcs = lines[lines.index("| function | calls / step | ms / step |") + 2 :][:3]
    own = [float(row.split("|")[3]) for row in funcs]
    assert len(funcs) == 3 and all(row.startswith("| `") for row in funcs) and own == sorted(own, reverse=True)
    assert own[0] > 0.1  # (the dearest: the autograd engine or the optimizer, milliseconds a step)
    assert sp.category("_bwd_dkdv_kernel") == sp.category("vitrel::rel_bias_attention") == "vitrel fused kernels"
    assert sp.category("fmha_cutlassB_bf16_aligned_64x64_k64_sm80") == "SDPA (flash, cuDNN, efficient)"
    flash = "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits>"
    assert sp.category(flash) == "SDPA (flash, cuDNN, efficient)"
    assert sp.category("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_cublas") == "matrix products"
    assert sp.category("nvjet_hsh_128x256_64x4_2x1_v_bz_coopB_NNT") == "matrix products"
    assert sp.category("triton_poi_fused_add_native_layer_norm_0") == "inductor kernels"
    assert sp.category("void at::native::vectorized_layer_norm_kernel<c10::BFloat16, float>") == (
        "softmax, norms, reductions"
    )
    assert sp.category("Memcpy DtoD (Device -> Device)") == "copies, memsets, indexing"
    assert sp.category("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>") == "optimizer"
    assert sp.category("some_kernel_of_no_kind") == "other"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), reason="Triton's interpreter is off")
def test_host_overhead_tables_on_cpu(tmp_path):
    """bench/host_overhead.py, the code path of the GPU run's ``host`` section (here through Triton's interpreter, a
    3 x 3 grid): a row per layer with its time per call against plain SDPA's (1.00x for SDPA itself), the fused
    kernel's launches and torch operators per call, its dearest Python functions, dearest first; then the host's cost
    of each piece of one call, the forward's and backward's launches among them."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "host_overhead.py"
    spec = importlib.util.spec_from_file_location("vitrel_bench_host_overhead", path)
    ho = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ho)
    out = tmp_path / "host.md"
    lines = ho.main(
        ["--device", "cpu", "--grid", "3", "--repeat", "1", "--rounds", "1", "--top", "4", "--out", str(out)]
    )
    assert out.read_text() == "\n".join(lines) + "\n"
    rows = {row.split("|")[1].strip(): row.split("|")[2:6] for row in lines if row.startswith("| ") and "@" in row}
    assert list(rows) == ho.LAYERS and rows["none@sdpa"][1].strip() == rows["none@sdpa"][3].strip() == "1.00x"
    assert all(float(v[0]) > 0 and float(v[2]) > 0 for v in rows.values())
    launches = next(row for row in lines if "Triton launches" in row)
    assert int(re.search(r"(\d+) Triton launches", launches)[1]) >= 2  # (at least a forward and a backward)
    funcs = lines[lines.index("| function | calls / call | us / call |") + 2 :]
    own = [float(row.split("|")[3]) for row in funcs[: funcs.index("")]]
    assert len(own) == 4 and own == sorted(own, reverse=True) and own[0] > 100  # (the interpreter: ms a call)
    pieces = lines[lines.index("| piece | us / call |") + 2 :]
    pieces = {row.split("|")[1].strip(): float(row.split("|")[2]) for row in pieces}
    assert all(v > 0 for v in pieces.values()), pieces
    want = ["fwd_tile launch alone", "tile launch alone", "backward body", "eager", "table gradient from the tiles"]
    assert all(any(w in k for k in pieces) for w in want), list(pieces)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), reason="Triton's interpreter is off")
def test_host_ops_counts_a_step_by_source(tmp_path):
    """bench/host_ops.py: the operators of a forward and backward of vitrel's model and timm's (ViT-S's pair, 32 px),
    ours by source, dearest first: the fused kernel's host work among them (its launches counted, not run, and its
    ``Launch`` restored afterwards), and the backward's own."""
    import importlib.util
    from pathlib import Path

    from vitrel.kernels import triton as fused

    path = Path(__file__).resolve().parents[2] / "bench" / "host_ops.py"
    spec = importlib.util.spec_from_file_location("vitrel_bench_host_ops", path)
    ho = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ho)
    call = fused.Launch.__call__
    out = tmp_path / "ops.md"
    lines = ho.main(["--pairs", "vit_rel2d_full", "--img-size", "32", "--top", "40", "--out", str(out)])
    assert fused.Launch.__call__ is call
    assert out.read_text() == "\n".join(lines) + "\n"
    total = next(row for row in lines if row.startswith("Operators a forward and backward"))
    ours, timm = (int(v) for v in re.findall(r"(?:ours|timm) (\d+)", total))
    rows = {r.split("|")[1].strip().strip("`"): int(r.split("|")[2]) for r in lines if r.startswith("| `")}
    assert ours > 100 and timm > 100 and sum(rows.values()) <= ours
    assert list(rows.values()) == sorted(rows.values(), reverse=True)
    kernel = ("planning.py:", "op.py:", "patterns.py:")  # (the fused kernel's host modules, vitrel/kernels/triton/)
    assert rows["backward (autograd)"] > 0 and any(k.startswith(kernel) for k in rows), rows
    assert any(k.endswith("(backward)") and k.startswith(kernel) for k in rows), rows


def test_gpu_session_commands_name_what_exists():
    """bench/gpu_session.sh's parts (a lease's commands, run where no mistake can be fixed in time) name only
    bench/gpu.py's sections and bench/triton_tune.py's and bench/cudnn_bias.py's options, and each part's budgets fit
    the device tool's 10-minute limit a command, with the start's half minute."""
    import importlib.util
    import shlex
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("vitrel_bench_gpu", root / "bench" / "gpu.py")
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    tune_src = (root / "bench" / "triton_tune.py").read_text()
    cudnn_src = (root / "bench" / "cudnn_bias.py").read_text()
    script = (root / "bench" / "gpu_session.sh").read_text().replace("\\\n", " ")
    parts = re.findall(r"^\s+(\w+)\)\s(.*?);;", script, flags=re.M | re.S)
    assert {p for p, _ in parts} >= {"pass", "tune", "one", "two", "three", "four", "rest", "cudnn"}, parts
    for part, body in parts:
        seconds = 0.0
        for command in body.splitlines():
            words = shlex.split(command.replace('"', "").replace("$(", "(").strip())
            if "bench/gpu.py" in words:
                args = words[words.index("bench/gpu.py") + 1 :]
                if "--sections" in args and "(python3" not in args:
                    names = args[args.index("--sections") + 1 :]
                    names = names[: next((i for i, w in enumerate(names) if w.startswith("--")), len(names))]
                    assert names and set(names) <= set(gpu.SECTIONS), (part, names)
                seconds += float(args[args.index("--budget") + 1])
            if "bench/triton_tune.py" in words:
                flags = [w for w in words[words.index("bench/triton_tune.py") + 1 :] if w.startswith("--")]
                assert all(f'"{f}"' in tune_src for f in flags), (part, flags)
                seconds += float(words[words.index("timeout") + 1]) if "timeout" in words else 200
            if "bench/cudnn_bias.py" in words:  # stopped by its timeout; its --budget (rows started) below it
                flags = [w for w in words[words.index("bench/cudnn_bias.py") + 1 :] if w.startswith("--")]
                assert all(f'"{f}"' in cudnn_src for f in flags), (part, flags)
                limit = float(words[words.index("timeout") + 1])
                assert float(words[words.index("--budget") + 1]) + 60 <= limit, (part, words)
                seconds += limit
        # (the device tool stops a command at 600 s; the wheels' install, the device's name and the imports before
        # bench/gpu.py's budget starts take about 20-30 s of it)
        assert 0 < seconds <= 570, (part, seconds)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--seq-len", "64"], "--seq-len 64 is shorter than the largest image"),
        (["--images", "16", "--batch", "32"], "--images 16 makes no batch of --batch 32"),
        (["--rounds", "0"], "--rounds must be at least 1"),
    ],
)
def test_packing_bench_refuses_options_it_cannot_run_with_its_own_names(argv, says):
    """bench/packing.py with a --seq-len below the largest image, fewer --images than one --batch, or no rounds: one
    line naming the bench's own option, before any model is built (not a PackingError about `data.seq_len` from the
    collator, nor statistics' "mean requires at least one data point")."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "packing.py"
    spec = importlib.util.spec_from_file_location("vitrel_bench_packing", path)
    packing = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(packing)
    with pytest.raises(SystemExit, match=re.escape(says)):
        packing.main(["--images", "32", "--batch", "32", "--depth", "1", "--schemes", "none", *argv])


def test_no_rounds_is_refused_before_anything_runs(monkeypatch):
    """``alternate`` with ``rounds`` or ``repeat`` below 1 (a bench's ``--rounds 0``) times nothing: refused at once,
    not statistics' "no median for empty data" after the warm-up; bench/attention.py names its option."""
    import runpy
    import sys

    calls: list[str] = []
    with pytest.raises(ValueError, match="rounds and repeat must be at least 1, got rounds=0, repeat=1"):
        bench.alternate({"a": lambda: calls.append("a")}, 0)
    assert calls == []
    monkeypatch.setattr(sys, "argv", ["bench/attention.py", "--rounds", "0", "--tokens", "16", "--schemes", "none"])
    with pytest.raises(SystemExit, match="--rounds must be at least 1, got 0"):
        runpy.run_path("bench/attention.py", run_name="__main__")


def test_gpsa_paths_times_both_forms_of_the_same_layer(tmp_path):
    """bench/gpsa_paths.py: the split form it times equals the layer (checked in the script before timing) and the
    table has a row per case."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "gpsa_paths.py"
    spec = importlib.util.spec_from_file_location("vitrel_bench_gpsa_paths", path)
    gp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gp)
    out = tmp_path / "paths.md"
    lines = gp.main(["--cases", "3:2,2:3", "--rounds", "1", "--width", "16", "--heads", "2", "--out", str(out)])
    assert out.read_text() == "\n".join(lines) + "\n"
    assert [r.split("|")[1:3] for r in lines[-2:]] == [[" 10 ", " 2 "], [" 5 ", " 3 "]]
