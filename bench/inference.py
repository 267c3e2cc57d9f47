"""Inference throughput (images/s): eager vs ``torch.compile`` vs ``torch.export`` program, per scheme, against timm.

    python bench/inference.py                                   # CPU: both models, the default schemes
    python bench/inference.py --models default --schemes rel2d_full rope2d_mixed --rounds 9
    python bench/inference.py --device cuda --out bench/results/inference_h100.md

Models (configurations aligned with timm's; parameter counts printed):

* ``default``: the training default, ``conf/model/vit_tiny_fmnist.yaml`` (``vitrel_vit_tiny_patch4_32`` at
  width 64, 4 blocks of 4 heads, MLP ratio 2, mean pooling) on Fashion-MNIST's 28 x 28 grey images; timm:
  ``vit_tiny_patch16_224`` with the same sizes (its learned absolute embedding);
* ``vit_s16``: ``vitrel_vit_small_patch16_224`` at 224 x 224 (class token); timm: ``vit_small_patch16_224``.

For each model, every scheme and timm's model are run in the three modes, all timed in alternation
(round after round, after warm-up calls that include compilation), in ``torch.inference_mode``:
``eager``; ``compile``: ``torch.compile(model)`` (inductor, default mode); ``export``: the module of a
``torch.export`` program (ours: :func:`vitrel.export.export_program` with dynamic batch, height and width
where the scheme allows, i.e. the program that serves every resolution; timm's: dynamic batch). The
table shows the median images/s of each.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

import timm
import torch
from omegaconf import OmegaConf

import vitrel
from vitrel.bench import alternate, machine_info, medians
from vitrel.export import best_dynamic, export_program

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SCHEMES = ["ape", "rel2d_full", "rel2d_factored", "alibi2d", "rope2d_axial", "rope2d_mixed", "shaw2d_factored"]


def default_model_args() -> dict:
    """``conf/model/vit_tiny_fmnist.yaml`` without its Hydra keys, at Fashion-MNIST's size and channels."""
    cfg = OmegaConf.to_container(OmegaConf.load(ROOT / "conf/model/vit_tiny_fmnist.yaml"), resolve=False)
    for k in ("_target_", "_convert_", "pos", "init_from", "init_file"):
        cfg.pop(k, None)
    return dict(cfg, img_size=28, in_chans=1, num_classes=10)


MODELS = {
    "default": dict(
        ours=default_model_args,
        timm=lambda a: dict(
            name="vit_tiny_patch16_224",
            img_size=a["img_size"],
            patch_size=4,
            embed_dim=a["embed_dim"],
            depth=a["depth"],
            num_heads=a["num_heads"],
            mlp_ratio=a["mlp_ratio"],
            global_pool=a["global_pool"],
            in_chans=1,
            num_classes=10,
        ),
        batch=64,
    ),
    "vit_s16": dict(
        ours=lambda: dict(name="vitrel_vit_small_patch16_224", num_classes=1000),
        timm=lambda a: dict(name="vit_small_patch16_224", num_classes=1000),
        batch=8,
    ),
}


def n_params(m: torch.nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def build_set(key: str, schemes: list[str], device: torch.device) -> tuple[dict, torch.Tensor, dict]:
    spec = MODELS[key]
    args = spec["ours"]()
    name = args.pop("name")
    models = {}
    for s in schemes:
        torch.manual_seed(0)
        models[s] = vitrel.create_model(name, pos=s, **args).to(device).eval()
    targs = spec["timm"](dict(args, name=name))
    torch.manual_seed(0)
    models["timm"] = timm.create_model(targs.pop("name"), **targs).to(device).eval()
    a = models[schemes[0]].vitrel_cfg
    h, w = a["img_size"]
    x = torch.randn(spec["batch"], a["in_chans"], h, w, device=device)
    return models, x, targs


def callables(models: dict, x: torch.Tensor, modes: list[str]) -> tuple[dict, dict]:
    fns, notes = {}, {}
    for k, m in models.items():
        for mode in modes:
            t = time.perf_counter()
            if mode == "eager":
                f = m
            elif mode == "compile":
                f = torch.compile(m)
            else:
                if k == "timm":
                    dyn = ({0: torch.export.Dim("batch", min=1, max=4096)},)
                    f = torch.export.export(m, (x,), dynamic_shapes=dyn).module()
                    notes[k] = "batch"
                else:
                    notes[k] = best_dynamic(m)
                    f = export_program(m, x, dynamic=notes[k]).module()
            fns[(k, mode)] = lambda f=f: f(x)
            if mode == "export":
                print(f"  exported {k} in {time.perf_counter() - t:.0f} s", flush=True)
    return fns, notes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--schemes", nargs="+", default=DEFAULT_SCHEMES, help="'all': every scheme")
    modes = ["eager", "compile", "export"]
    ap.add_argument("--modes", nargs="+", default=modes, choices=modes)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls per callable (compilation happens here)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None, help="also write the Markdown table here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    schemes = vitrel.list_pos() if args.schemes == ["all"] else args.schemes
    device = torch.device(args.device)
    info = machine_info(device)
    load0 = os.getloadavg()
    head = [
        f"Machine: {info['description']}; torch {torch.__version__}, timm {timm.__version__}.",
        f"Command: `python {' '.join(sys.argv)}`",
        f"Load average (1, 5, 15 min) at start: {load0[0]:.2f}, {load0[1]:.2f}, {load0[2]:.2f}.",
    ]
    print("\n".join(head), flush=True)
    rows = []
    warnings.filterwarnings("ignore")
    with torch.inference_mode():
        for key in args.models:
            models, x, _ = build_set(key, schemes, device)
            print(f"{key}: input {tuple(x.shape)}; building compiled / exported callables", flush=True)
            fns, notes = callables(models, x, args.modes)
            names = [f"{k}|{mode}" for k, mode in fns]
            times = alternate(
                {n: fns[tuple(n.split("|"))] for n in names}, args.rounds, warmup=args.warmup, device=device
            )
            med = medians(times)
            for k, m in models.items():
                ips = {mode: x.shape[0] / med[f"{k}|{mode}"] for mode in args.modes}
                rows.append(dict(model=key, scheme=k, params=n_params(m), dynamic=notes.get(k, "-"), **ips))
            torch._dynamo.reset()
    load1 = os.getloadavg()
    head.append(f"Load average at end: {load1[0]:.2f}, {load1[1]:.2f}, {load1[2]:.2f}.")
    cols = [f"{m} img/s" for m in args.modes]
    lines = [
        "| model | scheme | params | " + " | ".join(cols) + " | export dynamic | compile / eager | export / eager |",
        "|---|---|---:|" + "---:|" * len(cols) + "---|---:|---:|",
    ]

    def ratio(r: dict, a: str) -> str:
        return f"{r[a] / r['eager']:.2f}x" if a in r and "eager" in r else "-"

    for r in rows:
        vals = " | ".join(f"{r[m]:.1f}" for m in args.modes)
        scheme = "timm (its APE)" if r["scheme"] == "timm" else r["scheme"]
        lines.append(
            f"| {r['model']} | {scheme} | {r['params']:,} | {vals} | {r['dynamic']} | {ratio(r, 'compile')} | "
            f"{ratio(r, 'export')} |"
        )
    text = "\n".join(head) + "\n\n" + "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
