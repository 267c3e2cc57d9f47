"""Training-step throughput of vitrel backbones against timm's equivalents (same configuration).

One training step = forward + cross-entropy + backward + AdamW step, on random images. The two models
of a pair are timed alternately in the same run (one step of ours, one of timm's, ...), after warm-up
steps; the table shows the median over the timed steps, images/s, and ours/timm.

    python bench/models.py --batch-size 8 --steps 5 --device cpu --threads 1
    python bench/models.py --batch-size 64 --steps 20 --device cuda --amp

Pairs (configurations aligned so the parameter counts agree within 1%):

* ``vitrel_vit_small_patch16_224`` + ``rel2d_full`` (per block, no class token, avg pool + fc_norm,
  no qkv bias, layer scale 1e-6) vs timm ``vit_relpos_small_patch16_224`` (``rel_pos_type="bias"``)
* ``vitrel_swin_tiny_patch4_window7_224`` + ``rel2d_full`` vs timm ``swin_tiny_patch4_window7_224``
* ``vitrel_vit_small_patch16_224`` + ``rope2d_mixed`` (per block, class token, layer scale 1e-5) vs
  timm ``vit_small_patch16_rope_mixed_224``
"""

from __future__ import annotations

import argparse

import timm
import torch

import vitrel
from vitrel.bench import alternate, medians, train_step

#: vitrel's ViT-S/16 with a scheme of its own in every block, as timm's relative-position and RoPE ViTs have
VIT_S_PER_BLOCK = dict(name="vitrel_vit_small_patch16_224", pos_share=False)

PAIRS = {
    "vit_rel2d_full": (
        dict(
            VIT_S_PER_BLOCK,
            pos="rel2d_full",
            class_token=False,
            global_pool="avg",
            qkv_bias=False,
            init_values=1e-6,
        ),
        dict(name="vit_relpos_small_patch16_224", rel_pos_type="bias"),
    ),
    "swin_rel2d_full": (
        dict(name="vitrel_swin_tiny_patch4_window7_224", pos="rel2d_full", drop_path_rate=0.1),
        dict(name="swin_tiny_patch4_window7_224", drop_path_rate=0.1),
    ),
    "vit_rope2d_mixed": (
        dict(
            VIT_S_PER_BLOCK,
            pos="rope2d_mixed",
            class_token=True,
            global_pool="token",
            qkv_bias=True,
            init_values=1e-5,
        ),
        dict(name="vit_small_patch16_rope_mixed_224"),
    ),
    # timm's absolute ViT-B/16 against vitrel's with a factored / full relative bias (the GPU baseline's comparison:
    # relative position should cost nothing); parameter counts differ by the tables and the missing abs embedding
    "vitb_rel2d_factored": (
        dict(name="vitrel_vit_base_patch16_224", pos="rel2d_factored"),
        dict(name="vit_base_patch16_224"),
    ),
    "vitb_rel2d_full": (
        dict(name="vitrel_vit_base_patch16_224", pos="rel2d_full"),
        dict(name="vit_base_patch16_224"),
    ),
}


def n_params(m: torch.nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def build(spec: dict, img_size: int, device: torch.device, ours: bool, attn_impl: str = "auto") -> torch.nn.Module:
    spec = dict(spec)
    name = spec.pop("name")
    if ours:
        return vitrel.create_model(name, img_size=img_size, num_classes=1000, attn_impl=attn_impl, **spec).to(device)
    return timm.create_model(name, img_size=img_size, num_classes=1000, **spec).to(device).train()


def run_pair(key: str, args, device: torch.device) -> list[dict]:
    """A row per ``--attn-impl`` for pair ``key``: vitrel's model with that implementation against timm's, every model
    of the pair timed in one alternation (timm's once, so each row's ratio reads the same timm steps)."""
    ours_spec, timm_spec = PAIRS[key]
    models = {}
    for impl in args.attn_impl:
        torch.manual_seed(0)
        models[impl] = build(ours_spec, args.img_size, device, True, impl).train()
    models["timm"] = build(timm_spec, args.img_size, device, False)
    x = torch.randn(args.batch_size, 3, args.img_size, args.img_size, device=device)
    y = torch.randint(0, 1000, (args.batch_size,), device=device)
    steps = {}
    graphs = args.compile and args.compile_mode == "reduce-overhead"
    for k, m in models.items():
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4, weight_decay=0.05, fused=device.type == "cuda")
        model = torch.compile(m, mode=args.compile_mode) if args.compile else m
        steps[k] = train_step(model, opt, x, y, bf16=args.amp, graphs=graphs)
    med = medians(alternate(steps, args.steps, warmup=args.warmup, device=device, zigzag=len(steps) == 2))
    ips = {k: args.batch_size / v for k, v in med.items()}
    params = {k: n_params(m) for k, m in models.items()}
    return [
        dict(
            pair=key,
            ours=ours_spec["name"] + f" + {ours_spec['pos']}" + (f" @{impl}" if impl != "auto" else ""),
            timm=timm_spec["name"],
            params_ours=params[impl],
            params_timm=params["timm"],
            params_diff=abs(params[impl] - params["timm"]) / params["timm"],
            ips_ours=ips[impl],
            ips_timm=ips["timm"],
            ratio=ips[impl] / ips["timm"],
        )
        for impl in args.attn_impl
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per model")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--img-size", type=int, default=224)
    ap.add_argument("--amp", action="store_true", help="bfloat16 autocast")
    ap.add_argument("--attn-impl", nargs="+", default=["auto"],
                    help="vitrel's attention implementations (sdpa, fold, flex, triton, auto): a row each")  # fmt: skip
    ap.add_argument("--compile", action="store_true", help="torch.compile both models (the timed steps are compiled)")
    ap.add_argument("--compile-mode", default=None, choices=[None, "reduce-overhead", "max-autotune"],
                    help="torch.compile's mode for both models (reduce-overhead: CUDA graphs, as trainer=gpu's fast "
                         "step compiles; each step marked as one)")  # fmt: skip
    ap.add_argument("--pairs", nargs="+", default=list(PAIRS), choices=list(PAIRS))
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 is steadiest on a shared CPU)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(
        f"device={device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
        f"{torch.get_num_threads()} threads) batch={args.batch_size} img={args.img_size} "
        f"steps={args.steps} warmup={args.warmup} amp={args.amp} compile={args.compile} "
        f"{f'compile_mode={args.compile_mode} ' if args.compile_mode else ''}"
        f"attn_impl={' '.join(args.attn_impl)} "
        f"torch={torch.__version__} timm={timm.__version__}"
    )
    rows = [row for k in args.pairs for row in run_pair(k, args, device)]
    hdr = f"| {'ours':50} | {'timm':34} | {'params ours':>12} | {'params timm':>12} | {'img/s ours':>10} | "
    hdr += f"{'img/s timm':>10} | {'ours/timm':>9} |"
    print(hdr)
    print("|" + "|".join("-" * (len(c)) for c in hdr.split("|")[1:-1]) + "|")
    for r in rows:
        flag = "" if r["params_diff"] <= 0.01 else " (!)"
        print(
            f"| {r['ours']:50} | {r['timm']:34} | {r['params_ours']:>12,} | {r['params_timm']:>12,}{flag} | "
            f"{r['ips_ours']:>10.2f} | {r['ips_timm']:>10.2f} | {r['ratio']:>8.2f}x |"
        )


if __name__ == "__main__":
    main()
