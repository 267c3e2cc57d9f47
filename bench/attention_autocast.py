"""Every position scheme's attention layer under CPU autocast against float64: output and gradient errors.

One vitrel ``Attention`` layer per relative scheme (dim 192, 3 heads, a class token, random weights, seed 0; video
schemes on a ``T x H x W`` grid of as many patches), its scheme's zero-initialised parameters given small random
values (``--perturb``, std 0.02, as after some training). A forward and backward of ``<layer(x), g>`` under
``torch.autocast("cpu", dtype)`` against the same layer and inputs in float64; relative errors (norm of the
difference over the norm of the reference) of:

- ``out``: the layer's output;
- ``dqkv``: the gradient of the qkv projection's output (the q, k, v inputs of the scheme and the kernel);
- ``dx``: the gradient of the layer's input;
- ``dpos``: the gradient of each of the scheme's parameters (the worst of them, named in ``worst``).

``/none``: the ratio to ``pos=none``'s error (plain attention under the same autocast). The rows
``<scheme>:mlp-autocast`` (``rel2d_cpb``, ``fire1d``, ``fire2d``) are the scheme with its MLP run under autocast, as
before it ran in float32 (the method computing its table or bias replaced on that one instance). ``--time``: instead,
the time of a forward and backward of the layer under autocast (batch 8) for ``none``, each of ``--schemes`` (default
``rel2d_cpb``) and its ``:mlp-autocast``, median of ``--rounds`` rounds taken in turns::

    OMP_NUM_THREADS=2 PYTHONPATH=. python bench/attention_autocast.py --grids 14 --out /tmp/autocast.md
    OMP_NUM_THREADS=2 PYTHONPATH=. python bench/attention_autocast.py --time --grids 8 14 32 --dtypes bf16
    OMP_NUM_THREADS=2 PYTHONPATH=. python bench/attention_autocast.py --time --schemes fire1d fire2d --grids 14
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-300)).item()


OLD = ":mlp-autocast"


def _cpb_table_under_autocast(self, grid):
    """``Rel2dCpb._flat_table`` as it was: the MLP under the caller's autocast."""
    from vitrel.pos.schemes.cpb import _flat_coords

    w = self.mlp[0].weight
    return 16.0 * torch.sigmoid(self.mlp(_flat_coords(grid, self._ref, w.device, w.dtype)))


def _fire1d_bias_under_autocast(self, grid, num_prefix_tokens=0):
    """``Fire1d.bias`` as it was: the MLP under the caller's autocast."""
    from vitrel.layout.geometry import pad_prefix

    b = self.mlp(self.normalized_distances(grid.n).unsqueeze(-1)).permute(2, 0, 1)
    return pad_prefix(b.tril() if self.causal else b, num_prefix_tokens)


def _fire2d_table_under_autocast(self, grid):
    """``Fire2d._table_flat`` as it was: the MLP under the caller's autocast."""
    from vitrel.pos.schemes.fire import _signed_offsets

    w = self.mlp[0].weight
    sign, size = _signed_offsets(grid.h, grid.w, w.dtype, w.device)
    return self.mlp(sign * self.psi(size) / (self.psi(self.threshold()) + self.eps)).t()


#: scheme -> (method replaced, its version with the MLP under autocast)
OLD_METHODS = {
    "rel2d_cpb": ("_flat_table", _cpb_table_under_autocast),
    "fire1d": ("bias", _fire1d_bias_under_autocast),
    "fire2d": ("_table_flat", _fire2d_table_under_autocast),
}


def layer(pos: str, grid: tuple[int, ...], perturb: float):
    import types

    from vitrel import Attention

    name = pos.removesuffix(OLD)
    torch.manual_seed(0)
    a = Attention(192, 3, pos=name, grid=grid, num_prefix_tokens=1)
    if pos.endswith(OLD):
        method, fn = OLD_METHODS[name]
        setattr(a.pos, method, types.MethodType(fn, a.pos))
    with torch.no_grad():
        for p in a.pos.parameters():
            if perturb and not p.any():
                p.normal_(0, perturb)
    return a


def run(a, x: torch.Tensor, g: torch.Tensor, grid, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Output and gradients of ``<a(x), g>`` (under autocast to ``dtype`` unless None)."""
    qkv = {}

    def keep(mod, inp, out):
        out.retain_grad()
        qkv["out"] = out

    h = a.qkv.register_forward_hook(keep)
    x = x.detach().clone().requires_grad_(True)
    try:
        if dtype is None:
            y = a(x, grid)
        else:
            with torch.autocast("cpu", dtype=dtype):
                y = a(x, grid)
    finally:
        h.remove()
    (y.double() * g).sum().backward()
    res = {"out": y.detach(), "dqkv": qkv["out"].grad, "dx": x.grad}
    res.update({f"pos.{n}": p.grad for n, p in a.pos.named_parameters() if p.grad is not None})
    return res


def errors(pos: str, grid: tuple[int, ...], dtype: torch.dtype, perturb: float) -> dict:
    a = layer(pos, grid, perturb)
    a64 = copy.deepcopy(a).double()
    torch.manual_seed(1)
    n = 1
    for s in grid:
        n *= s
    x = torch.randn(2, 1 + n, 192)
    g = torch.randn(2, 1 + n, 192, dtype=torch.float64)
    ref = run(a64, x.double(), g, grid, None)
    got = run(a, x, g, grid, dtype)
    e = {k: rel(got[k], ref[k]) for k in ("out", "dqkv", "dx")}
    pos_err = {k[4:]: rel(got[k], ref[k]) for k in ref if k.startswith("pos.")}
    e["dpos"], e["worst"] = max(((v, k) for k, v in pos_err.items()), default=(float("nan"), "-"))
    e["finite"] = all(torch.isfinite(v).all().item() for v in got.values())
    return e


def times(scheme: str, side: int, dtype: torch.dtype, rounds: int) -> dict[str, float]:
    import statistics

    from vitrel.bench import alternate

    grid = (side, side)
    layers = {s: layer(s, grid, 0.02).train() for s in ("none", scheme, scheme + OLD)}
    torch.manual_seed(1)
    x = torch.randn(8, 1 + side * side, 192)

    def step(a):
        def run():
            a.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=dtype):
                y = a(x, grid)
            y.float().square().mean().backward()

        return run

    t = alternate({k: step(a) for k, a in layers.items()}, rounds, warmup=2, zigzag=True)
    return {k: 1e3 * statistics.median(v) for k, v in t.items()}


def table(rows: list[dict]) -> str:
    head = "| grid | dtype | scheme | out | /none | dqkv | /none | dx | /none | dpos (worst) | /none(dqkv) | param |"
    lines = [head, "|---|---|---|" + "---:|" * 8 + "---|"]
    base = {(r["side"], r["dtype"]): r for r in rows if r["scheme"] == "none"}
    for r in rows:
        b = base[(r["side"], r["dtype"])]
        cells = [r["grid"], r["dtype"], r["scheme"] + ("" if r["finite"] else " (inf/nan)")]
        for k in ("out", "dqkv", "dx"):
            cells += [f"{r[k]:.1e}", f"{r[k] / b[k]:.1f}x"]
        cells += [f"{r['dpos']:.1e}", f"{r['dpos'] / b['dqkv']:.1f}x" if r["dpos"] == r["dpos"] else "-", r["worst"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    from vitrel.pos import get_pos_class, list_pos

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--grids", type=int, nargs="+", default=[14], help="square image grids (video: T=4 frames)")
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--schemes", nargs="+", default=None, help="default: every relative scheme (--time: rel2d_cpb)")
    ap.add_argument("--perturb", type=float, default=0.02, help="std given to all-zero scheme parameters (0: none)")
    ap.add_argument("--out", help="write the table here (markdown)")
    ap.add_argument("--time", action="store_true", help="time none, --schemes and their MLP under autocast instead")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    if args.time:
        from vitrel.bench import machine_info

        lines = [
            "| grid | dtype | scheme | none ms | scheme ms | mlp-autocast ms | scheme / mlp-autocast |",
            "|---|---|---|---:|---:|---:|---:|",
        ]
        for s in args.schemes or ["rel2d_cpb"]:
            if s not in OLD_METHODS:
                ap.error(f"--time: no {OLD} variant of {s!r} (one of {sorted(OLD_METHODS)})")
            for side in args.grids:
                for d in args.dtypes:
                    t = times(s, side, DTYPES[d], args.rounds)
                    lines.append(
                        f"| {side}x{side} | {d} | {s} | {t['none']:.1f} | {t[s]:.1f} | {t[s + OLD]:.1f} | "
                        f"{t[s] / t[s + OLD]:.3f}x |"
                    )
                print(lines[-1], file=sys.stderr, flush=True)
        text = f"{machine_info()['description']}, torch {torch.__version__}; median of {args.rounds} rounds\n\n"
        text += "\n".join(lines) + "\n"
        print(text)
        if args.out:
            Path(args.out).write_text(text)
        return
    schemes = args.schemes or list_pos("relative")
    schemes = ["none", *[s for s in schemes if s != "none"]]
    for s in OLD_METHODS:
        if s in schemes:
            schemes.insert(schemes.index(s) + 1, s + OLD)
    rows = []
    for side in args.grids:
        for d in args.dtypes:
            for s in schemes:
                cls = get_pos_class(s.split(":")[0])
                grid = (4, side // 2, side // 2) if cls.grid_dims == 3 else (side, side)
                rows.append(
                    {
                        "side": side,
                        "grid": "x".join(map(str, grid)),
                        "dtype": d,
                        "scheme": s,
                        **errors(s, grid, DTYPES[d], args.perturb),
                    }
                )
                print(s, d, side, file=sys.stderr, flush=True)
    from vitrel.bench import machine_info, source_commit

    text = (
        f"{machine_info()['description']}, torch {torch.__version__}; tree {source_commit(ROOT)}; "
        f"perturb {args.perturb}\n\n" + table(rows) + "\n"
    )
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
