"""Where a training step's time goes, kernel by kernel: vitrel's model against timm's of a ``bench/models.py`` pair.

    python bench/step_profile.py --device cuda --amp --batch-size 256 --attn-impl triton --pairs vitb_rel2d_factored
    python bench/step_profile.py --device cpu --img-size 32 --batch-size 2 --steps 1 --pairs vitb_rel2d_full

``bench/models.py`` says how much slower a step is; this says in which kernels. Each model of a pair takes
``--warmup`` steps, then ``--steps`` steps timed alone (wall time, the device synchronized after each; median), then
``--steps`` steps under ``torch.profiler``. On CUDA the profiler's kernels are summed by name (device time, each
kernel's own); on a CPU, the operators (their own CPU time: the code path of the GPU run, not its numbers). Written:

- the wall time of a step against the device's busy time (the kernels' sum): where the busy time is well below the
  wall time, the device waited on the host (Python, launches);
- the busy time per category of kernel (:data:`CATEGORIES`: vitrel's fused kernels, SDPA's, matrix products,
  ...), ours against timm's: the difference is where ours loses;
- ours' ``--top`` kernels by time;
- with ``--host``, the host's side: ``--steps`` more steps under ``cProfile``, each model's host time per step (the
  profiler's own cost included) and ours' ``--top`` Python functions by their own time (where the device waits on
  the host, the functions that keep it waiting).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/models.py, beside this file
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # vitrel, installed or not

from models import PAIRS, build  # noqa: E402

from vitrel.bench import profiled_kernel_times, sync, train_step  # noqa: E402

#: kernel (CUDA) or operator (CPU) name patterns, tried in this order; the first that matches names the category
CATEGORIES = [
    ("vitrel fused kernels", r"^_\w+_kernel$|^vitrel::"),  # the Triton kernels of vitrel/kernels, the custom ops
    ("inductor kernels", r"^triton_"),
    ("SDPA (flash, cuDNN, efficient)", r"flash|fmha|sdpa|scaled_dot_product|attention"),  # (cutlass's fmha too)
    ("matrix products", r"gemm|xmma|cutlass|nvjet|cublas|wgmma|conv|^sm\d\d_|aten::(mm|addmm|bmm|matmul|linear)"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("copies, memsets, indexing", r"memcpy|memset|copy|contiguous|index|gather|scatter|cat(_|$)|clone"),
    ("softmax, norms, reductions", r"softmax|norm|reduce|sum|mean|max"),
    ("elementwise", r"elementwise|vectorized|unrolled|gelu|add|sub|mul|div|sqrt|lerp|exp|pow|where|fill"),
]


def category(name: str) -> str:
    """The category of a kernel or operator name (:data:`CATEGORIES`; ``other`` where none matches)."""
    return next((cat for cat, pat in CATEGORIES if re.search(pat, name, re.IGNORECASE)), "other")


def profile_model(model: torch.nn.Module, args: argparse.Namespace, device: torch.device) -> dict:
    """Wall time of a step (median of ``--steps``) and its kernels' times (``--steps`` profiled steps)."""
    x = torch.randn(args.batch_size, 3, args.img_size, args.img_size, device=device)
    y = torch.randint(0, 1000, (args.batch_size,), device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05, fused=device.type == "cuda")
    step = train_step(torch.compile(model) if args.compile else model, opt, x, y, bf16=args.amp)
    for _ in range(args.warmup):
        step()
    walls = []
    for _ in range(args.steps):
        sync(device)
        t0 = time.perf_counter()
        step()
        sync(device)
        walls.append(time.perf_counter() - t0)
    res = dict(wall_ms=1e3 * statistics.median(walls), kernels=profiled_kernel_times(step, device, args.steps))
    if args.host:
        res["host"] = host_times(step, device, args.steps)
    return res


def host_times(step, device: torch.device, steps: int) -> dict:
    """``steps`` steps under ``cProfile``: the host's time per step (ms, the device synchronized at the end) and each
    function's own time per step, ``{"file:line(function)": (ms, calls)}``."""
    pr = cProfile.Profile()
    sync(device)
    t0 = time.perf_counter()
    pr.enable()
    for _ in range(steps):
        step()
    pr.disable()
    sync(device)
    wall = (time.perf_counter() - t0) / steps
    stats = pstats.Stats(pr).stats  # {(file, line, name): (primitive calls, calls, own s, cumulative s, callers)}
    own = {f"{Path(f).name}:{line}({name})": (1e3 * tt / steps, nc / steps) for (f, line, name), (_, nc, tt, _, _)
           in stats.items()}  # fmt: skip
    return dict(wall_ms=1e3 * wall, own=own)


def by_category(kernels: dict[str, tuple[float, float]]) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for name, (ms, _) in kernels.items():
        out[category(name)] += ms
    return out


def report(key: str, ours_name: str, timm_name: str, res: dict[str, dict], top: int, cpu: bool) -> list[str]:
    """The Markdown of one pair: wall against busy time, the categories side by side, ours' top kernels."""
    what = "operator (CPU: own time)" if cpu else "kernel"
    busy = {k: sum(ms for ms, _ in r["kernels"].values()) for k, r in res.items()}
    lines = [
        f"### {key}: {ours_name} against {timm_name}\n",
        "| model | step wall ms | busy ms (kernels' sum) | busy / wall |",
        "|---|---:|---:|---:|",
        *(f"| {k} | {r['wall_ms']:.2f} | {busy[k]:.2f} | {busy[k] / r['wall_ms']:.2f} |" for k, r in res.items()),
        "",
        f"Ours / timm (throughput, as `bench/models.py`'s): {res['timm']['wall_ms'] / res['ours']['wall_ms']:.2f}x "
        f"from the steps' wall times, {busy['timm'] / busy['ours']:.2f}x from their busy times.",
        "",
        "| category | ours ms / step | timm ms / step | ours - timm |",
        "|---|---:|---:|---:|",
    ]
    cats = {k: by_category(r["kernels"]) for k, r in res.items()}
    names = [c for c, _ in CATEGORIES] + ["other"]
    for c in sorted(names, key=lambda c: -max(cats["ours"].get(c, 0.0), cats["timm"].get(c, 0.0))):
        o, t = cats["ours"].get(c, 0.0), cats["timm"].get(c, 0.0)
        if o or t:
            lines.append(f"| {c} | {o:.3f} | {t:.3f} | {o - t:+.3f} |")
    lines.append(f"| all | {busy['ours']:.3f} | {busy['timm']:.3f} | {busy['ours'] - busy['timm']:+.3f} |")
    lines += ["", f"Ours' {top} dearest, by {what}:", "", f"| {what} | category | calls / step | ms / step | share |"]
    lines.append("|---|---|---:|---:|---:|")
    ranked = sorted(res["ours"]["kernels"].items(), key=lambda kv: -kv[1][0])[:top]
    for name, (ms, calls) in ranked:
        short = name if len(name) <= 90 else name[:87] + "..."
        lines.append(f"| `{short}` | {category(name)} | {calls:.0f} | {ms:.3f} | {ms / busy['ours']:.1%} |")
    if "host" in res["ours"]:
        hw = {k: r["host"]["wall_ms"] for k, r in res.items()}
        lines += ["", f"Under cProfile (its cost included): a step {hw['ours']:.1f} ms ours, {hw['timm']:.1f} ms timm. "
                  f"Ours' {top} dearest Python functions by own time:", "", "| function | calls / step | ms / step |",
                  "|---|---:|---:|"]  # fmt: skip
        ranked = sorted(res["ours"]["host"]["own"].items(), key=lambda kv: -kv[1][0])[:top]
        lines += [f"| `{name[:100]}` | {calls:.0f} | {ms:.3f} |" for name, (ms, calls) in ranked]
    return lines + [""]


def main(argv: list[str] | None = None) -> list[str]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", nargs="+", default=["vitb_rel2d_factored"], choices=list(PAIRS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--img-size", type=int, default=224)
    ap.add_argument("--steps", type=int, default=3, help="steps timed, then as many profiled")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--amp", action="store_true", help="bfloat16 autocast")
    ap.add_argument("--attn-impl", nargs="+", default=["auto"],
                    help="vitrel's attention implementations (sdpa, fold, triton, ...): a table each, timm's model "
                         "profiled once")  # fmt: skip
    ap.add_argument("--compile", action="store_true", help="torch.compile both models")
    ap.add_argument("--top", type=int, default=15, help="how many of ours' kernels to list")
    ap.add_argument("--host", action="store_true", help="also the host's time by Python function (cProfile)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    head = [
        f"{dev_name}, torch {torch.__version__}; batch {args.batch_size}, {args.img_size} px, amp={args.amp}, "
        f"compile={args.compile}, attn_impl={' '.join(args.attn_impl)}; wall: median of {args.steps} steps, kernels: "
        f"{args.steps} profiled steps\n"
    ]
    print("\n".join(head), flush=True)
    lines = list(head)
    for key in args.pairs:
        ours_spec, timm_spec = PAIRS[key]
        res = {}
        for who in ("timm", *args.attn_impl):  # (timm's first: each of ours' tables printed as soon as it is made)
            torch.manual_seed(0)
            ours = who != "timm"
            spec, impl = (ours_spec, who) if ours else (timm_spec, "auto")
            model = build(spec, args.img_size, device, ours, impl).train()
            res[who] = profile_model(model, args, device)
            del model
            if ours:
                ours_name = f"{ours_spec['name']} + {ours_spec['pos']} @{who}"
                pair = {"ours": res[who], "timm": res["timm"]}
                table = report(key, ours_name, timm_spec["name"], pair, args.top, device.type != "cuda")
                print("\n".join(table), flush=True)
                lines += table
    return lines


if __name__ == "__main__":
    main()
