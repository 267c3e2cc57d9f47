"""The GPU measurements of one device in one command -> ``bench/results/gpu_<device>.md``.

    python bench/gpu.py                                  # on the GPU machine (bf16)
    python bench/gpu.py --device cpu --quick --out /tmp/gpu_cpu.md   # the same code path, small, on a CPU

Sections (each a subprocess or in-process measurement, the tables concatenated with the exact commands):

1. **Hazards**: the known failure cases, checked before anything is timed. cuDNN's SDPA backward with a
   float mask at sequence lengths = 64 mod 128 (a 24x24 grid; 8x8 Swin windows) must give finite
   gradients equal to the math backend's, for every SDPA backend the device offers; ``attn_impl=fold``
   and (CUDA) ``flex`` gradients equal ``sdpa``'s, and whether flex's table gradients (atomics) repeat bitwise.
2. **Attention**: ``bench/attention.py`` in bf16 at N = 196, 1024, 4096 for every relative scheme, plus
   ``@fold`` for the factored ones and (CUDA) ``@flex`` for every bias scheme: time and memory against plain
   SDPA; (CUDA) causal 1-D attention, flex's causal ``BlockMask`` against SDPA's causal float mask.
   **Content**: Shaw (``attn_impl="shaw"``: ``shaw2d_full``, ``shaw1d`` by query blocks sized by the free memory,
   ``shaw2d_factored`` one widened SDPA) and PaPE against plain SDPA at the same sizes; the SDPA backends that take
   the widened heads, and ``pytest -m cuda tests/kernels/test_shaw.py`` (flash runs them).
   **rotary**: the rotary schemes through ``sdpa`` and ``@triton`` (the fused rotation,
   :mod:`vitrel.kernels.triton.rope`).
3. **Models**: ``bench/models.py --amp``: training steps against timm's same-config models (``attn_impl=triton`` and
   ``sdpa`` in one alternation); **vitb**: ViT-B/16 compiled against timm's; **vitbp**: the same compiled step
   profiled (``bench/step_profile.py --compile``: wall against busy time, ours' fused kernels against timm's SDPA,
   kernel by kernel; ours through ``triton`` and ``sdpa``); **swinc**: Swin-T compiled against
   timm's, both with CUDA graphs (``mode="reduce-overhead"``, as ``trainer=gpu``'s fast step: its eager step is bound
   by the host, ``profile``).
4. **MFU**: ViT-S/16 at 224 with ``rel2d_factored`` (sdpa, fold and, on CUDA, flex), bf16 autocast, AdamW: the model's
   FLOPs of one training step (``torch.utils.flop_counter`` on the sdpa run; the fold computes the same
   function) times steps per second over the device's dense bf16 peak (``PEAK_BF16``; unknown devices
   report FLOP/s only).
5. **compile**: ``torch.compile`` of the default model, training step equal to eager, and its speed.
0. **diagnose**: the fused kernel's breakdown at N = 1025 and 4097 (``bench/triton_tune.py --diagnose``): forward
   with the bias read as whole tiles against gathered per score, without a table; forward + backward with and
   without the table's gradient; FlexAttention's.
6. **profile**: ``bench/step_profile.py --host``: ViT-B/16 (``rel2d_factored``), Swin-T and ViT-S training steps
   against timm's, eager, under ``torch.profiler``: each step's wall time against the device's busy time, and the
   kernels' time by category and by name, ours against timm's (where the step loses); then under ``cProfile``, the
   host's Python functions. **host**: ``bench/host_overhead.py``: the host's cost of one attention call per
   implementation, on a layer too small for the device.
7. **train**: the default recipe (``python train.py trainer=gpu``, 10 epochs) with the eager step and with the fast
   step (``conf/step/fast.yaml``): steps/s, the fit's wall time, test accuracy. Needs hydra-core (docs/gpu.md).

The sections run in the order of ``SECTIONS`` (their priority) within ``--budget`` seconds (default 480: one
command of a 15-minute GPU loan); a section that would start with less than ``MIN_SECTION_S`` left is not run.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import vitrel  # noqa: E402
from vitrel.bench import alternate  # noqa: E402
from vitrel.pos import list_pos  # noqa: E402

#: dense bf16 tensor-core peak, FLOP/s (vendor datasheets, SXM parts)
PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12, "L40S": 362.05e12}


def device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"CPU {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def peak_flops(name: str) -> float | None:
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# ------------------------------------------------------------------------------------------------ 1. hazards
def hazards(dev: torch.device, quick: bool) -> list[str]:
    """Finite, backend-consistent SDPA gradients with a float mask at N = 576 (= 64 mod 128) and at
    8x8 windows (64 tokens); fold gradients equal to sdpa's."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    lines = ["| case | backend | finite grads | max abs diff vs math |", "|---|---|---|---:|"]
    cases = [("24x24 grid, N=576", 576, 4), ("8x8 windows, N=64", 64, 64)]
    if quick:
        cases = [("8x8 windows, N=64", 64, 4)]
    backends = [SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION]
    if dev.type == "cuda":
        backends.append(SDPBackend.CUDNN_ATTENTION)
    for label, n, b in cases:
        g = torch.Generator(device="cpu").manual_seed(0)
        q, k, v = (torch.randn(b, 6, n, 64, generator=g).to(dev, dtype) for _ in range(3))
        mask = (0.5 * torch.randn(1, 6, n, n, generator=g)).to(dev, dtype)
        grads = {}
        for be in backends:
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            try:
                with sdpa_kernel([be]):
                    F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask).float().square().sum().backward()
            except RuntimeError as e:  # the backend does not take this case: say so
                lines.append(f"| {label} | {be.name} | not available ({str(e).splitlines()[0][:60]}) | - |")
                continue
            grads[be] = torch.cat([t.grad.float().flatten() for t in (qq, kk, vv)])
            ok = bool(torch.isfinite(grads[be]).all())
            diff = (grads[be] - grads[SDPBackend.MATH]).abs().max().item() if SDPBackend.MATH in grads else 0.0
            lines.append(f"| {label} | {be.name} | {'yes' if ok else '**NO**'} | {diff:.3g} |")
    # fold vs sdpa in a model, gradients into the tables
    torch.manual_seed(0)
    kw = dict(embed_dim=64, depth=2, num_heads=4, img_size=32)
    ref = vitrel.create_model("vitrel_vit_tiny_patch4_32", pos="rel2d_factored", **kw).to(dev)
    models = {"sdpa": ref}
    for impl in ("fold", "flex") if dev.type == "cuda" else ("fold",):  # flex has no backward on CPU
        models[impl] = vitrel.create_model("vitrel_vit_tiny_patch4_32", pos="rel2d_factored", attn_impl=impl, **kw)
        models[impl].to(dev).load_state_dict(ref.state_dict())
    x = torch.randn(8, 3, 32, 32, device=dev)
    out = {}

    def table_grads(m):
        with torch.autocast(dev.type, dtype=dtype, enabled=dev.type == "cuda"):
            y = m(x)
        tables = [p for n, p in m.named_parameters() if "table" in n]
        return torch.cat([t.flatten() for t in torch.autograd.grad(y.float().square().sum(), tables)])

    for name, m in models.items():
        out[name] = table_grads(m)
    for name in out:
        if name != "sdpa":
            d = (out[name] - out["sdpa"]).abs().max().item() / max(out["sdpa"].abs().max().item(), 1e-12)
            lines.append(
                f"\nattn_impl={name} vs sdpa, table gradients of a 2-block ViT ({dtype}): max relative diff {d:.3g}"
            )
    if "flex" in models:
        same = torch.equal(table_grads(models["flex"]), out["flex"])
        lines.append(f"\nflex table gradients bitwise equal on a second run: {'yes' if same else 'no (atomics)'}")
    return lines


# ------------------------------------------------------------------------------------------------ 4. MFU
def mfu(dev: torch.device, quick: bool, steps: int) -> list[str]:
    from torch.utils.flop_counter import FlopCounterMode

    bf16 = dev.type == "cuda"
    size, batch, name = (32, 2, "vitrel_vit_tiny_patch4_32") if quick else (224, 128, "vitrel_vit_small_patch16_224")
    lines = [
        "| model | attn_impl | batch | step ms | TFLOP/step | TFLOP/s | MFU |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    peak = peak_flops(device_name(dev))
    model_flops = None  # the model's FLOPs, counted on the sdpa run (the fold computes the same function)
    for impl in ("sdpa", "fold", "flex") if dev.type == "cuda" else ("sdpa", "fold"):
        torch.manual_seed(0)
        m = vitrel.create_model(name, pos="rel2d_factored", attn_impl=impl, img_size=size).to(dev)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=dev.type == "cuda")
        x = torch.randn(batch, 3, size, size, device=dev)
        y = torch.randint(0, m.num_classes, (batch,), device=dev)

        def step(m=m, opt=opt, x=x, y=y):
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
                loss = F.cross_entropy(m(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        if model_flops is None:
            with FlopCounterMode(display=False) as fc:
                step()
            model_flops = fc.get_total_flops()
        flops = model_flops
        rounds, warmup = (2, 1) if quick else (5, 3)
        times = alternate({"s": step}, rounds=rounds, warmup=warmup, repeat=steps, device=dev)["s"]
        t = statistics.median(times)
        rate = flops / t
        util = f"{100 * rate / peak:.1f}%" if peak else "- (peak unknown)"
        lines.append(
            f"| {name} @ {size} | {impl} | {batch} | {1e3 * t:.1f} | {flops / 1e12:.3f} | {rate / 1e12:.1f} | {util} |"
        )
    return lines


# ------------------------------------------------------------------------------------------------ 5. compile
def compile_check(dev: torch.device, quick: bool) -> list[str]:
    torch.manual_seed(0)
    kw = dict(embed_dim=64, depth=4, num_heads=4, mlp_ratio=2.0, img_size=28, in_chans=1, num_classes=10)
    lines = ["| scheme | max diff (logits) | eager ms | compiled ms | compiled / eager |", "|---|---:|---:|---:|---:|"]
    schemes = ["rel2d_factored"] if quick else ["none", "rel2d_factored", "rel2d_full", "rope2d_mixed", "alibi2d"]
    for pos in schemes:
        m = vitrel.create_model("vitrel_vit_tiny_patch4_32", pos=pos, **kw).to(dev)
        c = torch.compile(m)
        x = torch.randn(256, 1, 28, 28, device=dev)
        with torch.no_grad():
            diff = (c(x) - m(x)).abs().max().item()

        def train(net, x=x):
            return lambda: net(x).square().mean().backward()

        times = alternate({"eager": train(m), "compiled": train(c)}, rounds=5, warmup=3, repeat=5, device=dev)
        te, tc = (statistics.median(times[k]) for k in ("eager", "compiled"))
        lines.append(f"| {pos} | {diff:.2g} | {1e3 * te:.2f} | {1e3 * tc:.2f} | {tc / te:.2f}x |")
    return lines


def train_recipe(dev: torch.device, quick: bool) -> list[str]:
    """The default recipe trained with ``step=eager`` and ``step=fast`` (``trainer=gpu``; on a CPU ``trainer=cpu``,
    the fast step without CUDA graphs): each run its own ``train.py`` process, its ``metrics.json`` read back. A run
    that fails gets its row in the table and the end of its stderr below it; the other run's row stays."""
    import json
    import tempfile

    trainer = "trainer=gpu" if dev.type == "cuda" else "trainer=cpu"
    # --quick: the code path only (1 epoch of 20 steps, the fast step uncompiled: a CPU compiles slowly)
    extra = ["trainer.max_epochs=1", "trainer.limit_train_batches=20", "module.compile=false"] if quick else []
    lines = ["| step | steps | fit s | steps/s | test acc | command |", "|---|---:|---:|---:|---:|---|"]
    failures: list[str] = []
    for step in ("eager", "fast"):
        argv = ["train.py", trainer, f"step={step}", "logger=none", "progress_bar=none"]
        argv += extra if step == "fast" else extra[:2]
        with tempfile.TemporaryDirectory() as d:
            env = {**child_env(), "HYDRA_FULL_ERROR": "1"}  # a failure's whole traceback, not Hydra's short form
            cmd = [sys.executable, *argv, f"hydra.run.dir={d}"]
            out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
            metrics = Path(d) / "metrics.json"
            r = json.loads(metrics.read_text()) if out.returncode == 0 and metrics.exists() else None
        command = f"`python {shlex.join(argv[:3])}`"
        if r is None:
            why = f"exit status {out.returncode}" if out.returncode else "no metrics.json"
            lines.append(f"| {step} | **failed** ({why}, below) | | | | {command} |")
            failures += [f"\n**{step} failed** ({why}): `python {shlex.join(argv)}`, the end of its stderr:\n",
                         "```", out.stderr[-3000:].rstrip(), "```"]  # fmt: skip
            continue
        rate = r["global_step"] / r["fit_s"]
        acc = r["metrics"].get("test/acc1", float("nan"))
        lines.append(f"| {step} | {r['global_step']} | {r['fit_s']:.1f} | {rate:.1f} | {100 * acc:.2f} % | {command} |")
    lines.append("\nfit s: the whole fit (compilation of the fast step included; 10 epochs, validation each epoch).")
    return lines + failures


def kernel_checks(dev: torch.device, quick: bool) -> list[str]:
    """``attn_impl="triton"`` on this device: the kernel tests (``pytest -m cuda``: bf16 against the float64
    reference), the table gradient bitwise repeatable, and FlexAttention compiling in bf16 with the per-device
    ``kernel_options``."""
    lines = []
    if dev.type == "cuda":
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-m",
            "cuda",
            "-p",
            "no:cacheprovider",
            "tests/kernels/test_triton_bias.py",
            "tests/kernels/test_triton_atomic.py",
            "tests/kernels/test_triton_rope.py",
        ]
        if importlib.util.find_spec("xdist") is not None:  # (bench/gpu_wheels.sh carries it) Triton compiles in up
            cmd += ["-n", str(min(8, os.cpu_count() or 1))]  # to 8 processes (the lent machines have 16 cores)
        env = {**child_env(), "TRITON_INTERPRET": "0"}
        # (within the section's limit, so the checks below and the section's table still come back; stopped, the
        # test workers too)
        t0 = time.perf_counter()
        code, stdout, stderr = run_section(cmd, KERNEL_TESTS_S, env)
        if code is None:
            tail = f"stopped after {KERNEL_TESTS_S} s ({stdout.count('.')} passed by then)"
        else:
            tail = stdout.strip().splitlines()[-1] if stdout.strip() else stderr[-500:]
        lines.append(f"`{shlex.join(cmd[1:])}`: {tail} ({time.perf_counter() - t0:.0f} s)\n")
        if code != 0:
            lines += ["```", stdout[-4000:], "```"]
    from vitrel.kernels.triton import rel_bias_attention

    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    grid = (32, 32) if not quick else (4, 4)
    n = 1 + grid[0] * grid[1]
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(4, 6, n, 64, generator=g).to(dev, dtype) for _ in range(3))
    table = torch.randn(6, 2 * grid[0] - 1, 2 * grid[1] - 1, generator=g).to(dev).requires_grad_()
    dts = [
        torch.autograd.grad(rel_bias_attention(q, k, v, table, grid, 1).float().square().sum(), table)[0] for _ in "ab"
    ]
    lines.append(f"triton table gradient bitwise equal on a second run ({grid[0]}x{grid[1]}, prefix 1): "
                 f"{'yes' if torch.equal(*dts) else '**no**'}\n")  # fmt: skip
    return lines


def widened_backends(dev: torch.device) -> list[str]:
    """Which SDPA backends take the widened heads of Shaw's factored path and PaPE at the attention section's shapes
    (``torch.backends.cuda.can_use_*``, bf16, heads of 64), and the pytest check that flash runs them (PaPE's call
    runs in float32 under autocast, on the memory-efficient kernel: the check runs it there)."""
    from tests.kernels.test_shaw import WIDENED

    lines = ["| scheme | grid | head dim | flash | cuDNN | memory-efficient |", "|---|---|---:|---|---|---|"]
    checks = [torch.backends.cuda.can_use_flash_attention, torch.backends.cuda.can_use_cudnn_attention,
              torch.backends.cuda.can_use_efficient_attention]  # fmt: skip
    for pos, side, width in WIDENED:
        q = torch.zeros(2, 6, side * side, width, device=dev, dtype=torch.bfloat16)
        params = torch.backends.cuda.SDPAParams(q, q, q, None, 0.0, False, False)
        ok = ["yes" if check(params) else "no" for check in checks]
        lines.append(f"| {pos if isinstance(pos, str) else pos} | {side}x{side} | {width} | {' | '.join(ok)} |")
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "tests/kernels/test_shaw.py"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=child_env())
    tail = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-500:]
    lines.append(f"\n`{shlex.join(cmd[1:])}`: {tail}\n")
    return lines + (["```", out.stdout[-3000:], "```"] if out.returncode else [])


#: the sections and their time limits (seconds): each runs in its own process, its table written when it ends
#: in the order of their priority: ``--budget`` (the whole pass, default 8 minutes) cuts the pass where it runs out
SECTIONS = {"kernel": 150, "diagnose": 120, "attention": 200, "forward": 90, "models": 150, "vitb": 200, "vitbp": 210,
            "swinc": 240, "host": 90, "profile": 150, "train": 240, "rotary": 100, "content": 120, "hazards": 90,
            "mfu": 120, "compile": 120}  # fmt: skip
#: the sections after the fused kernel's targets (issue 32's: attention, forward, models, vitb, vitbp):
#: ``bench/gpu_session.sh rest`` runs them with the launch configurations in the same command
REST = ["swinc", "host", "profile", "train", "rotary", "content", "hazards", "mfu", "compile"]
#: the kernel section's pytest run (Triton compiles each variant on first use), inside the section's own limit
KERNEL_TESTS_S = 100
#: the least time worth starting a section with
MIN_SECTION_S = 20

#: the rotary schemes of the ``rotary`` section (LieRE with blocks of 8: its default, one block over the whole head, is
#: timed by the same kernel with larger blocks)
ROTARY = ["rope1d", "rope2d_axial", "rope2d_mixed", "rope2d_mixed:basis=cayley", "spiral_rope", "comrope",
          "liere:block_size=8"]  # fmt: skip


def child_env() -> dict[str, str]:
    """The environment of the scripts this pass runs: the repository first on ``PYTHONPATH`` (``bench/*.py`` import
    vitrel whether or not it is installed)."""
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), path) if p)}


#: the prefix of a section script's output lines as they come, on the section process's stderr (what
#: :func:`run_section` keeps of a section stopped at its time limit)
PARTIAL = "[partial] "


def run_script(argv: list[str]) -> tuple[str, str]:
    """Run ``python argv`` in the repository: its command and its output (stdout), each line of which is also written
    to this process's stderr as it comes (:data:`PARTIAL`), so that a section stopped at its time limit keeps the
    tables its script wrote; a failed script raises with the end of its stderr."""
    cmd = [sys.executable, *argv]
    t0 = time.perf_counter()
    lines = []
    with tempfile.TemporaryFile("w+") as err:
        env = {**child_env(), "PYTHONUNBUFFERED": "1"}
        with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True, env=env) as proc:
            for line in proc.stdout:
                lines.append(line)
                print(PARTIAL + line, end="", file=sys.stderr, flush=True)
            proc.wait()
        if proc.returncode:
            err.seek(0)
            raise SystemExit(f"{shlex.join(argv)} failed:\n{err.read()[-3000:]}")
    return "python " + shlex.join(argv), "".join(lines).strip() + f"\n\n({time.perf_counter() - t0:.0f} s)"


def run_section(cmd: list[str], limit: float, env: dict[str, str] | None = None) -> tuple[int | None, str, str]:
    """Run a section's process ``cmd`` (or the kernel section's tests) for at most ``limit`` seconds: ``(returncode,
    stdout, stderr)``, the return code None where it was stopped at the limit. Stopped, its whole process group is
    killed (the scripts or test workers it started too: a benchmark left running would share the device with the
    sections and commands after it, as a section stopped by ``subprocess.run``'s timeout left its script running),
    and its stdout and stderr hold what it wrote so far."""
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          start_new_session=True) as proc:  # fmt: skip
        try:
            out, err = proc.communicate(timeout=limit)
            return proc.returncode, out, err
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            return None, out, err


def partial_output(stderr: str) -> str:
    """The script output lines (:data:`PARTIAL`) in a section process's ``stderr``."""
    return "".join(line[len(PARTIAL) :] + "\n" for line in stderr.splitlines() if line.startswith(PARTIAL)).strip()


def section(name: str, args: argparse.Namespace) -> list[str]:
    """The Markdown of one section."""
    dev = torch.device(args.device)
    tokens = ["64", "196"] if args.quick else ["196", "1024", "4096"]
    tpb = ["--tokens-per-batch", "128" if args.quick else "65536"]
    dtype = ["--dtype", "bf16"] if dev.type == "cuda" else []
    rounds = ["--rounds", "3" if args.quick else "7"]
    att = ["bench/attention.py", "--device", args.device, *dtype, "--tokens", *tokens, *tpb, *rounds]
    image = [s for s in list_pos("relative") if vitrel.pos.get_pos_class(s).grid_dims == 2]  # (image grids here)
    schemes = [s for s in image if s != "none"]
    tables = [s for s in schemes if vitrel.pos.get_pos_class(s).has_offset_table]
    if name == "kernel":
        return ["## Triton kernel checks\n", *kernel_checks(dev, args.quick)]
    if name == "diagnose":  # the fused kernel's breakdown: bias tiles against the per-score gather, dT, no table
        if dev.type != "cuda":
            return ["## Fused kernel breakdown: CUDA only\n"]
        c, text = run_script(["bench/triton_tune.py", "--diagnose", "--sides", "32", "64", "--rounds", "5"])
        return ["## Fused kernel breakdown (bench/triton_tune.py --diagnose)\n", f"`{c}`\n", text]
    if name == "attention":  # every offset-table scheme through sdpa and triton; the factored fold; lookhere's fovs;
        # dq by atomics (triton_atomic) for a trained table, a fixed one and LookHere's. SDPA named: a scheme alone is
        # bench/attention.py's attn_impl="auto", which the device's rules may send to triton or fold (as e5a7949's run
        # did: its rows without "@" were those kernels again where a rule took them)
        atomic = ["rel2d_full@triton_atomic", "alibi2d@triton_atomic", "lookhere@triton_atomic"]
        folds = ["rel2d_factored@fold", "rel2d_bucket@fold"]  # (the tables that factor: auto folds the first)
        full = [*(f"{s}@sdpa" for s in tables), *(f"{s}@triton" for s in tables), *atomic, *folds,
                "lookhere:fov=45@triton"]  # fmt: skip
        sel = ["rel2d_full@sdpa", "rel2d_full@triton", atomic[0], "rel2d_factored@fold"] if args.quick else full
        c, text = run_script([*att, "--schemes", *sel])
        return ["## Attention layer, forward + backward\n", f"`{c}`\n", text]
    if name == "content":  # Shaw's kernel and PaPE (content-dependent terms) against plain SDPA
        sel = ["shaw2d_full", "shaw2d_factored"] if args.quick else ["shaw2d_full", "shaw1d", "shaw2d_factored", "pape"]
        c, text = run_script([*att[:-2], "--rounds", "3" if args.quick else "5", "--schemes", *sel])
        backends = widened_backends(dev) if dev.type == "cuda" else []
        return ["## Shaw and PaPE, forward + backward\n", f"`{c}`\n", text, *backends]
    if name == "rotary":  # every rotary scheme through sdpa (torch ops) and triton (the fused rotation, then attention)
        sel = ["rope2d_axial@sdpa", "rope2d_axial@triton"] if args.quick else [
            *(f"{s}@sdpa" for s in ROTARY), *(f"{s}@triton" for s in ROTARY)
        ]  # fmt: skip
        c, text = run_script([*att, "--schemes", *sel])
        return ["## Rotary schemes, forward + backward (sdpa against the fused rotation)\n", f"`{c}`\n", text]
    if name == "forward":
        sel = ["rel2d_full@sdpa", "rel2d_full@triton", "rel2d_factored@sdpa", "rel2d_factored@triton",
               "rel2d_factored@fold", "alibi2d@triton"]  # fmt: skip
        c, text = run_script([*att, "--inference", "--schemes", *sel])
        return ["## Attention layer, forward only\n", f"`{c}`\n", text]
    if name == "models":  # Swin-T and ViT-S/rel2d_full training steps against timm, eager, vitrel with triton
        extra = ["--img-size", "64", "--batch-size", "2", "--steps", "1"] if args.quick else ["--batch-size", "128"]
        c, text = run_script(["bench/models.py", "--device", args.device, *(["--amp"] * (dev.type == "cuda")),
                              *extra, "--steps", "10", "--attn-impl", "triton", "sdpa", "--pairs", "swin_rel2d_full",
                              "vit_rel2d_full"])  # fmt: skip
        return ["## Training steps against timm (attn_impl=triton and sdpa, in one alternation)\n", f"`{c}`\n", text]
    if name == "vitb":  # ViT-B/16 compiled against timm's absolute one, compiled
        extra = ["--img-size", "32", "--batch-size", "2"] if args.quick else ["--batch-size", "256"]
        c, text = run_script(["bench/models.py", "--device", args.device, *(["--amp"] * (dev.type == "cuda")),
                              *extra, "--steps", "10", "--compile", "--attn-impl", "triton", "--pairs",
                              "vitb_rel2d_factored", "vitb_rel2d_full"])  # fmt: skip
        return ["## ViT-B/16 compiled against timm (attn_impl=triton)\n", f"`{c}`\n", text]
    if name == "vitbp":  # ViT-B/16 compiled, where its step's time goes: ours' fused kernels against timm's SDPA
        # (triton_atomic beside triton: dq by atomics and the table's gradient in dkdv, FlashAttention-2's products;
        # sdpa: auto's choice at N = 197, sdpa on the H100 from the layer's wall times, which were likely the host's
        # there; triton on a CPU only under Triton's interpreter)
        small = ["--img-size", "32", "--batch-size", "2", "--steps", "1"]
        extra = small if args.quick else ["--batch-size", "256", "--steps", "6"]
        impls = ["triton", "triton_atomic", "sdpa"] if dev.type == "cuda" else ["sdpa"]
        c, text = run_script(["bench/step_profile.py", "--device", args.device, *(["--amp"] * (dev.type == "cuda")),
                              *extra, "--compile", "--attn-impl", *impls, "--pairs",
                              "vitb_rel2d_factored"])  # fmt: skip
        return ["## ViT-B/16 compiled, where the step's time goes (bench/step_profile.py --compile)\n", f"`{c}`\n",
                text]  # fmt: skip
    if name == "swinc":  # Swin-T compiled against timm's, compiled: the eager step is bound by the host (profile)
        extra = ["--img-size", "32", "--batch-size", "2"] if args.quick else ["--batch-size", "128"]
        # (triton only on a GPU: three compiled models, sdpa's too, did not finish in 170 s at 79f5727;
        # on a CPU sdpa, triton running only under the interpreter). Both with CUDA graphs, as trainer=gpu's fast
        # step compiles: no host in the step at all, the custom op's Python included
        impls = ["triton"] if dev.type == "cuda" else ["sdpa"]
        c, text = run_script(["bench/models.py", "--device", args.device, *(["--amp"] * (dev.type == "cuda")),
                              *extra, "--steps", "10", "--compile", "--compile-mode", "reduce-overhead",
                              "--attn-impl", *impls, "--pairs", "swin_rel2d_full"])  # fmt: skip
        return ["## Swin-T compiled with CUDA graphs against timm's (attn_impl=triton, mode=reduce-overhead)\n",
                f"`{c}`\n", text]  # fmt: skip
    if name == "profile":  # where vitrel's training step loses to timm's, kernel by kernel, and the host's Python
        # (ViT-B/16, Swin-T, ViT-S; eager)
        extra = ["--img-size", "32", "--batch-size", "2", "--steps", "1"] if args.quick else ["--batch-size", "128"]
        impl = "triton" if dev.type == "cuda" else "sdpa"  # (triton on a CPU: only under Triton's interpreter)
        pairs = ["--pairs", "vitb_rel2d_factored", "swin_rel2d_full", "vit_rel2d_full", "--host"]
        c, text = run_script(["bench/step_profile.py", "--device", args.device, *(["--amp"] * (dev.type == "cuda")),
                              *extra, "--attn-impl", impl, *pairs])  # fmt: skip
        return ["## Where the training step's time goes, kernel by kernel (bench/step_profile.py)\n", f"`{c}`\n", text]
    if name == "host":  # the host's cost of one attention call, per implementation (a layer too small for the GPU)
        if dev.type != "cuda":
            return ["## The host's cost of an attention call: CUDA only (on a CPU, bench/host_overhead.py --grid 3)\n"]
        extra = ["--repeat", "20", "--rounds", "2"] if args.quick else []
        c, text = run_script(["bench/host_overhead.py", "--device", args.device, *extra])
        return ["## The host's cost of an attention call (bench/host_overhead.py)\n", f"`{c}`\n", text]
    if name == "hazards":
        return ["## Hazards\n", *hazards(dev, args.quick)]
    if name == "mfu":
        return ["## MFU\n", *mfu(dev, args.quick, 2 if args.quick else args.steps)]
    if name == "compile":
        return ["## torch.compile\n", *compile_check(dev, args.quick)]
    if name == "train":
        return ["## The default recipe: eager step against the fast step\n", *train_recipe(dev, args.quick)]
    raise SystemExit(f"unknown section {name!r}; known: {', '.join(SECTIONS)}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="small sizes (a check of the code path, not numbers)")
    ap.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS))
    ap.add_argument("--steps", type=int, default=10, help="timed steps per round (MFU)")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for the whole pass (sections in order)")
    ap.add_argument("--out", default=None, help="default bench/results/gpu_<device>.md")
    ap.add_argument("--section-limit", type=float, default=None, help="seconds per section, not its own limit")
    ap.add_argument("--inner", default=None, help=argparse.SUPPRESS)  # one section, in this process, to stdout
    args = ap.parse_args(argv)
    if args.inner:
        print("\n".join(section(args.inner, args)))
        return
    dev = torch.device(args.device)
    name = device_name(dev)
    out = Path(args.out or ROOT / "bench" / "results" / f"gpu_{name.split()[-1].lower()}.md")
    cmd = "python bench/gpu.py " + " ".join(sys.argv[1:] if argv is None else argv)
    doc = [f"# GPU measurements: {name}\n", f"- Command: `{cmd}`", f"- torch {torch.__version__}, {time.ctime()}\n"]
    own = ["--device", args.device, "--steps", str(args.steps), *(["--quick"] * args.quick)]
    start = time.perf_counter()
    for sec in args.sections:
        print(f"== {sec}", flush=True)
        t0 = time.perf_counter()
        limit = min(args.section_limit or SECTIONS[sec], args.budget - (t0 - start))
        if limit < MIN_SECTION_S:
            body = f"## {sec}: not run (the pass's --budget {args.budget:.0f} s was spent)"
        else:
            code, stdout, stderr = run_section([sys.executable, __file__, *own, "--inner", sec], limit)
            if code is None:  # (what its script wrote so far kept)
                partial = partial_output(stderr)
                body = f"## {sec}: stopped at its time limit ({limit:.0f} s)" + (
                    f"; what it wrote before:\n\n{partial}" if partial else ""
                )
            elif code:
                body = f"## {sec}: failed\n\n```\n{stderr[-3000:]}\n```"
            else:
                body = stdout.strip()
        doc += [body, f"\n(section {sec}: {time.perf_counter() - t0:.0f} s)\n"]
        print(doc[-2][:2000], doc[-1], sep="\n", flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(doc) + "\n")  # after every section: nothing lost if a later one fails
    print(f"written {out}")


if __name__ == "__main__":
    main()
