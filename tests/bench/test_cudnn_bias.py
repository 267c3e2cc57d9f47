"""bench/cudnn_bias.py (issue 58's measurement): its CPU pieces against naive references in float64 (the gather of
the relative table into the bias, the two sums of dBias back into it, the fp32 attention reference), the verdict's
rule, and the script's behaviour without a GPU. The measurement itself needs a Hopper GPU."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "cudnn_bias.py"


def load():
    spec = importlib.util.spec_from_file_location("vitrel_bench_cudnn_bias", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


GRIDS = [(1, 1), (1, 5), (3, 4), (4, 3), (5, 5)]


def naive_bias(table: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    hg, wg = grid
    n = hg * wg
    out = torch.empty(1, table.shape[0], n, n, dtype=table.dtype)
    for h in range(table.shape[0]):
        for i in range(n):
            for j in range(n):
                (ih, iw), (jh, jw) = divmod(i, wg), divmod(j, wg)
                out[0, h, i, j] = table[h, ih - jh + hg - 1, iw - jw + wg - 1]
    return out


@pytest.mark.parametrize("grid", GRIDS)
def test_gather_is_the_table_at_each_offset(grid):
    cb = load()
    hg, wg = grid
    table = torch.randn(3, 2 * hg - 1, 2 * wg - 1, dtype=torch.float64)
    bias = cb.gather_bias(table, cb.rel_index(grid))
    assert bias.shape == (1, 3, hg * wg, hg * wg)
    assert torch.equal(bias, naive_bias(table, grid))


@pytest.mark.parametrize("grid", GRIDS)
def test_both_sums_of_dbias_are_the_gathers_gradient(grid):
    """index_add_ and the deterministic diagonal sums give autograd's gradient of the gather (float64), and the naive
    loop's sum."""
    cb = load()
    hg, wg = grid
    table = torch.randn(2, 2 * hg - 1, 2 * wg - 1, dtype=torch.float64, requires_grad=True)
    index = cb.rel_index(grid)
    dbias = torch.randn(1, 2, hg * wg, hg * wg, dtype=torch.float64)
    (want,) = torch.autograd.grad(cb.gather_bias(table, index), table, dbias)
    loop = torch.zeros_like(want)
    for h in range(2):
        for i in range(hg * wg):
            for j in range(hg * wg):
                (ih, iw), (jh, jw) = divmod(i, wg), divmod(j, wg)
                loop[h, ih - jh + hg - 1, iw - jw + wg - 1] += dbias[0, h, i, j]
    torch.testing.assert_close(want, loop, rtol=1e-12, atol=1e-12)
    for got in (cb.scatter_index_add(dbias, index, grid), cb.scatter_diagonal(dbias, grid)):
        assert got.dtype == torch.float64 and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_sums_of_a_bf16_dbias_are_fp32():
    cb = load()
    dbias = torch.randn(1, 2, 9, 9).bfloat16()
    want = cb.scatter_index_add(dbias.double(), cb.rel_index((3, 3)), (3, 3)).float()
    for got in (cb.scatter_index_add(dbias, cb.rel_index((3, 3)), (3, 3)), cb.scatter_diagonal(dbias, (3, 3))):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want)


def test_reference_attention_and_its_gradients_are_sdpas():
    """The explicit reference (the GPU check's fp32 ground truth) against SDPA's math backend with a float mask that
    takes gradients, float64: output, dq, dk, dv and dBias."""
    cb = load()
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(2, 3, 16, 8, generator=g, dtype=torch.float64) for _ in range(4))
    bias = torch.randn(1, 3, 16, 16, generator=g, dtype=torch.float64)
    results = []
    for fn in (
        lambda q, k, v, b: cb.reference_attention(q, k, v, b, 8**-0.5),
        lambda q, k, v, b: F.scaled_dot_product_attention(q, k, v, attn_mask=b),
    ):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
        o = fn(*leaves)
        results.append([o, *torch.autograd.grad(o, leaves, do)])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_verdict_reads_the_path_rows():
    cb = load()
    det = "path: gather + frontend dBias (det. on) + `scatter_diagonal`"
    non = "path: gather + frontend dBias (det. off) + `index_add_`"

    def res(x4096_det, x4096_non, x1024_det, x1024_non):
        return {
            (4096, "SDPA"): 10.0,
            (4096, det): 10.0 * x4096_det,
            (4096, non): 10.0 * x4096_non,
            (1024, "SDPA"): 2.0,
            (1024, det): 2.0 * x1024_det,
            (1024, non): 2.0 * x1024_non,
        }

    assert "within the goal** (deterministic)" in cb.verdict(res(1.2, 1.1, 1.39, 1.3))
    assert "only without determinism" in cb.verdict(res(1.3, 1.2, 1.3, 1.3))
    text = cb.verdict(res(1.3, 1.3, 1.3, 1.3))
    assert "measured no" in text and "N = 4096: 1.30x deterministic, 1.30x not (goal <= 1.25x)" in text
    assert "undecided" in cb.verdict({(4096, "SDPA"): 1.0})


def run_script(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=300)


def test_help_runs_and_without_a_gpu_one_line_error(capsys):
    """The script run as a user runs it, without a GPU: one line on stderr, no traceback. --help and a size refused
    are argument parsing: checked in-process (``main``), each a ``SystemExit`` (a process would print its message
    alone), not two more processes importing torch."""
    out = run_script("--small")
    assert out.returncode != 0
    assert out.stderr.strip().splitlines() == [out.stderr.strip()] and "needs a CUDA GPU" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    cb = load()
    with pytest.raises(SystemExit) as help_:
        cb.main(["--help"])
    printed = capsys.readouterr().out
    assert help_.value.code == 0 and "--sizes" in printed and "dBias" in printed, printed
    with pytest.raises(SystemExit) as bad:
        cb.main(["--sizes", "200"])
    said = str(bad.value.code)
    assert "square" in said and said.splitlines() == [said], said


def test_frontend_graphs_validate_on_cpu():
    """Where cudnn-frontend is installed (an optional package, not a dependency): the forward and backward graphs
    (bias, dBias, deterministic on and off) pass the frontend's graph validation, which needs no GPU (plans do)."""
    pytest.importorskip("cudnn")
    cb = load()
    fe = cb.Frontend(handle=False, sm_version=90)
    q = torch.empty(2, 6, 196, 64, dtype=torch.bfloat16)
    bias = torch.empty(1, 6, 196, 196, dtype=torch.bfloat16)
    _, ports = fe.forward(q, q, q, bias, 0.125, plans=False)
    assert {"q", "k", "v", "bias", "o", "stats"} == set(ports)
    for det in (False, True):
        _, ports = fe.backward(q, q, q, bias, bias, 0.125, det, plans=False)
        assert {"dBias", "dq", "dk", "dv", "stats", "dO"} <= set(ports)


def test_cpu_code_path_writes_every_table_and_error_rows(tmp_path):
    """``--device cpu``: the GPU run's code (check, rows, table section, verdict) at a small size; the frontend's rows
    and the forced cuDNN backend are rows with their error, not a crash."""
    cb = load()
    out = tmp_path / "cudnn_bias.md"
    cb.main(
        ["--device", "cpu", "--sizes", "16", "--check-sizes", "16", "--tokens", "32", "--rounds", "1"]
        + ["--warmup", "0", "--repeat", "1", "--out", str(out)]
    )
    text = out.read_text()
    assert "## Check" in text and "## N = 16 (4x4), batch 2" in text and "### N = 16: the table [6, 7, 7]" in text
    assert "| SDPA, no mask (default backends) | " in text and "| 1.00x |" in text
    assert "| SDPA + bias with grad (vitrel's `sdpa` today) | " in text
    assert "| frontend, bias + dBias, deterministic on | - |" in text and "cudnn-frontend: CUDA only |" in text
    assert "| SDPA + bias (no grad) [CUDNN_ATTENTION] | - |" in text  # refused on a CPU: a row
    assert "| 16 | dBias -> table: `scatter_diagonal` (deterministic) |" in text
    assert "**Verdict: undecided** (no path or SDPA row at N = 4096, 1024)" in text


class FakeGraph:
    def __init__(self, kind: str, scale: float) -> None:
        self.kind, self.scale = kind, scale

    def get_workspace_size(self) -> int:
        return 0


class FakeFrontend:
    """cudnn_bias.Frontend's interface computed with torch on a CPU: the glue the GPU run depends on (each graph's
    variant pack holds exactly its ports; outputs land in the tensors given) without cuDNN."""

    def __init__(self, cb):
        self.cb, self.calls = cb, []

    def forward(self, q, k, v, bias, scale, plans=True):
        ports = ["q", "k", "v", "o", "stats", *(["bias"] if bias is not None else [])]
        return FakeGraph("fwd", scale), {p: p for p in ports}

    def backward(self, q, k, v, bias, dbias, scale, deterministic, plans=True):
        ports = ["q", "k", "v", "o", "dO", "stats", "dq", "dk", "dv"]
        ports += (["bias"] if bias is not None else []) + (["dBias"] if dbias is not None else [])
        return FakeGraph("bwd", scale), {p: p for p in ports}

    def execute(self, graph, ports, tensors):
        kind, scale, t = graph.kind, graph.scale, tensors
        assert set(t) == set(ports), (kind, sorted(t), sorted(ports))
        self.calls.append(kind)
        leaves = [t[n].double().requires_grad_() for n in ("q", "k", "v")]
        bias = t["bias"].double().requires_grad_() if "bias" in t else None
        o = self.cb.reference_attention(*leaves, bias, scale)
        if kind == "fwd":
            t["o"].copy_(o)
            return
        wrt = leaves + ([bias] if "dBias" in t else [])
        for name, grad in zip(("dq", "dk", "dv", "dBias"), torch.autograd.grad(o, wrt, t["dO"].double())):
            t[name].copy_(grad)


def test_frontend_rows_and_check_through_a_fake_frontend(tmp_path):
    cb = load()
    fe = FakeFrontend(cb)
    args = cb.argparse.Namespace(heads=2, head_dim=8, tokens=32, warmup=0, rounds=1, repeat=1, dev=torch.device("cpu"))
    rep = cb.Report(str(tmp_path / "t.md"), budget=1e9)
    cb.check(rep, fe, None, 2, 16, 2, 8, args.dev)
    results = {}
    cb.time_size(rep, fe, None, 16, args, results)
    text = (tmp_path / "t.md").read_text()
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    check_rows = [line for line in text.splitlines() if line.startswith("| 2 | 16 | frontend bias + dBias")]
    assert len(check_rows) == 2 and all(line.endswith("| yes | yes |") for line in check_rows), check_rows
    for name in ("frontend, no bias", "frontend, bias + dBias, deterministic on"):
        assert "| 0 / 0 |" in rows[name], rows[name]  # the graphs' workspaces
    det = "path: gather + frontend dBias (det. on) + `scatter_diagonal`"
    assert (16, det) in results and results[(16, "SDPA")] is not None
    assert "| yes | yes |" in rows[det], rows[det]  # finite, repeats bitwise
    assert fe.calls.count("fwd") == fe.calls.count("bwd") > 0
