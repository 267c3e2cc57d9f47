"""Static resources of the fused bias kernel's compiled code for a GPU, measured without one: registers per thread,
the spill stack (bytes of local memory per thread; 0 means no register spills), shared memory, and the instructions
one warp issues per tile in the kernel's inner loop (from the SASS), from Triton's own compiler and ``cuobjdump``
(shipped with Triton).

    python bench/triton_resources.py --out bench/results/triton_resources_sm90.md   # any machine, no GPU needed

Each kernel is compiled as Triton's JIT compiles it for one call (``vitrel.kernels.triton.plan`` builds the call's
launches with a :class:`~vitrel.kernels.triton.config.KernelConfig`, ``triton_aot.compile_launch`` specializes them:
integers equal to 1 as constants, addresses and integers divisible by 16 declared so). The calls: the layer of
``bench/attention.py`` (6 heads of 64, 65,536 tokens per batch) at N = 1 + 64^2, with no table, the table read as bias
tiles or gathered per score, ``dq`` added by atomics (``deterministic=False``: the ``dkdv`` kernel), other tiles and
warp counts, a table with ``-inf`` entries and its visible-tile flags (LookHere's), four 32 x 32 images packed in each
row; then Swin-T's first stage (3 heads of 32, 7 x 7 windows, batch 128) with no mask, a float window mask and the
windows' region ids.

What it shows and a GPU timing only shows indirectly: spills read and write local memory in the inner loop, and
on Hopper a 64 x 64 tile's two matrix products take the tensor cores about 256 cycles per SM, so a loop whose
warps issue many more instructions than that per tile is bound by issuing them (each of the 4 warps of a program
issues on its own scheduler, at most one instruction a cycle). Instruction counts are a static measure: no stalls,
no memory latency, every branch of the loop counted.
"""

from __future__ import annotations

import argparse
import collections
import heapq
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the kernels must be JIT functions, not interpreted ones

import torch  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/triton_aot.py, beside this file

from dataclasses import replace  # noqa: E402

import triton_aot as aot  # noqa: E402

from vitrel.kernels import triton as tb  # noqa: E402
from vitrel.kernels.triton.config import Warps, cuda_config  # noqa: E402
from vitrel.layout.geometry import Grid  # noqa: E402
from vitrel.layout.tokens import segment_mask  # noqa: E402

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
#: the instruction classes reported per tile (SASS opcodes, before the first dot)
CLASSES = {
    "mma": ("HGMMA", "HMMA", "WARPGROUP"),  # (and the warp group's fences)
    "exp": ("MUFU",),
    "float": ("FADD", "FMUL", "FFMA", "FMNMX", "FSEL", "FSETP", "F2FP", "F2F", "I2F", "F2I"),
    "global": ("LDG", "LDGSTS", "STG", "LDGDEPBAR", "DEPBAR", "ATOM", "RED"),
    "smem": ("LDS", "STS", "LDSM", "STSM", "SHFL"),
    "local": ("LDL", "STL"),
}


def _layer(side: int = 64, heads: int = 6, head_dim: int = 64, prefix: int = 1) -> dict:
    n = prefix + side * side
    b = max(1, 65536 // n)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, heads, n, head_dim, generator=gen).to(torch.bfloat16) for _ in range(3))
    table = torch.randn(heads, 2 * side - 1, 2 * side - 1, generator=gen)
    return dict(q=q, k=k, v=v, table=table, grid=(side, side), num_prefix_tokens=prefix)


def _lookhere() -> dict:
    """The layer with a table whose entries are ``-inf`` off a band of rows (LookHere's views mask so), and the
    visible-tile flags that let the kernels skip the tiles it masks whole."""
    call = _layer()
    table = call["table"]
    table[:, :48] = table[:, 80:] = float("-inf")  # a query sees the keys within 15 rows
    call["blocks"] = tb.visible_tiles(table, Grid(64, 64), 1)
    return call


def _packed(images: int = 4, side: int = 32, heads: int = 6, head_dim: int = 64) -> dict:
    """The layer's 65,536 tokens as rows of 4,096 tokens, each packing four 32 x 32 images (a token layout)."""
    per, n = side * side, images * side * side
    b = 65536 // n
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, heads, n, head_dim, generator=gen).to(torch.bfloat16) for _ in range(3))
    t = torch.arange(n)
    tokens = torch.stack([t // per, t % per // side, t % side, torch.zeros_like(t)]).int().expand(b, 4, n)
    table = torch.randn(1, heads, 2 * side - 1, 2 * side - 1, generator=gen)
    return dict(q=q, k=k, v=v, table=table, grid=(side, side), tokens=tokens)


def _windows(mask_kind: int, images: int = 128, heads: int = 3, head_dim: int = 32) -> dict:
    """Swin-T's first stage: 56 x 56 tokens in 64 windows of 7 x 7; the last windows of a shifted block hold regions."""
    from vitrel.layout.windows import window_layout, window_regions

    n_w, n = 64, 49
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(images * n_w, heads, n, head_dim, generator=gen).to(torch.bfloat16) for _ in range(3))
    call = dict(q=q, k=k, v=v, table=torch.randn(heads, 13, 13, generator=gen), grid=(7, 7))
    if mask_kind:
        layout = window_layout(window_regions(Grid(56, 56), (7, 7), (3, 3)), (7, 7))
        if mask_kind == 2:
            call["regions"] = layout.segment
        else:
            call["mask"] = segment_mask(layout, torch.float32)[:, 0]
    return call


#: (label, call, plan options, kernels): the layer at N = 4097 (other tiles: only the kernels they change; head dim
#: 128: its own tiles), then Swin's windows; ``config``: changes to the GPU's configuration for the call
_FWD = ("fwd",)
_BWD = ("dkdv", "dq", "dbias", "tile")
_WIDE = {"dkdv_tile": (64, 128), "dq_tile": (128, 64), "wide": Warps(8, 2)}
CASES = [
    ("no table", lambda: {**_layer(), "table": None}, {}, None),
    ("table, bias tiles", _layer, {"bias_read": "tiles"}, None),
    ("table, gathered per score", _layer, {"bias_read": "gather"}, None),
    ("no table, dq by atomics", lambda: {**_layer(), "table": None}, {"deterministic": False}, ("dkdv",)),
    ("table, bias tiles, dq by atomics", _layer, {"bias_read": "tiles", "deterministic": False}, ("dkdv",)),
    ("table, bias tiles, wide dkdv and dq", _layer, {"bias_read": "tiles", "config": _WIDE}, ("dkdv", "dq")),
    ("table, bias tiles, bwd tile 32", _layer, {"bias_read": "tiles", "config": {"bwd_tile": 32}}, _BWD),
    ("table, bias tiles, bwd 8 warps", _layer, {"bias_read": "tiles", "config": {"bwd": Warps(8, 2)}}, _BWD),
    ("table, bias tiles, fwd 64 x 128", _layer, {"bias_read": "tiles", "config": {"fwd_tile": (64, 128)}}, _FWD),
    ("table, bias tiles, fwd 128 x 64, 8 warps", _layer,
     {"bias_read": "tiles", "config": {"fwd_tile": (128, 64), "fwd": Warps(8, 2)}}, _FWD),
    ("table, bias tiles, fwd 128 x 128, 8 warps", _layer,
     {"bias_read": "tiles", "config": {"fwd_tile": (128, 128), "fwd": Warps(8, 2)}}, _FWD),
    ("table, bias tiles, wide dbias", _layer,
     {"bias_read": "tiles", "config": {"dbias_tile": (128, 64), "wide": Warps(8, 2)}}, ("dbias",)),
    ("ViT-B/16 (14 x 14, a class token, 12 heads), table, bias tiles", lambda: _layer(14, 12), {"bias_read": "tiles"},
     None),
    ("ViT-B/16, table, bias tiles, dq by atomics (the dbias kernel sums the table's gradient)", lambda: _layer(14, 12),
     {"bias_read": "tiles", "deterministic": False}, ("dkdv", "dbias")),
    ("table, bias tiles, fwd without TMA", _layer, {"bias_read": "tiles", "config": {"tma_min_tiles": 1 << 30}},
     ("fwd",)),
    ("no table, fwd without TMA", lambda: {**_layer(), "table": None}, {"config": {"tma_min_tiles": 1 << 30}},
     ("fwd",)),
    ("table with -inf entries, visible-tile flags", _lookhere, {"bias_read": "tiles"}, None),
    ("N = 4096 (no prefix), table, bias tiles", lambda: _layer(prefix=0), {"bias_read": "tiles"}, _FWD),
    ("head dim 128, table, bias tiles", lambda: _layer(heads=3, head_dim=128), {"bias_read": "tiles"}, None),
    ("head dim 128, no table", lambda: {**_layer(heads=3, head_dim=128), "table": None}, {}, None),
    ("packed images (a token layout)", _packed, {}, None),
    ("windows, no mask", lambda: _windows(0), {}, None),
    ("windows, float mask", lambda: _windows(1), {}, None),
    ("windows, region ids", lambda: _windows(2), {}, None),
    ("windows, no mask, four backward kernels", lambda: _windows(0), {"config": {"bwd_one_tile_max": 0}}, _BWD),
    ("windows, region ids, four backward kernels", lambda: _windows(2), {"config": {"bwd_one_tile_max": 0}}, _BWD),
    ("windows, region ids, fixed table", lambda: _windows(2), {"table_grad": False}, ("tile",)),
    ("windows, no mask, a program a window's forward", lambda: _windows(0), {"config": {"fwd_one_tile_max": 0}},
     _FWD),
    ("windows, region ids, a program a window's forward", lambda: _windows(2), {"config": {"fwd_one_tile_max": 0}},
     _FWD),
]  # fmt: skip


def _plan(call: dict, opts: dict) -> dict:
    """``plan`` of a case: its options, and ``config`` (changes to the GPU's configuration at the call's head dim; a
    smaller backward tile takes the one-tile kernels' limits with it)."""
    opts = dict(opts)
    changes = opts.pop("config", {})
    base = cuda_config(call["q"].shape[-1])
    if "bwd_tile" in changes:
        one = min(changes["bwd_tile"], base.bwd_one_tile_max)
        changes = {"fwd_one_tile_max": one, "bwd_one_tile_max": one, **changes}
    return tb.plan(**call, **opts, config=replace(base, **changes))


def _instructions(sass: str) -> list[tuple[int, str, int | None, bool]]:
    """``(address, opcode, branch target, conditional)`` of each SASS instruction."""
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if not m:
            continue
        text = m.group(2).strip()
        pred = re.match(r"@!?U?P\w+\s+", text)
        body = text[pred.end() :] if pred else text
        # (a branch with a modifier, BRA.DIV: taken only where the warp diverged, so it may fall through)
        target = re.match(r"BRA(\.\w+)*\s+(?:`\(.*?\)\s*)?(?:\w+,\s*)?0x([0-9a-f]+)", body)
        cond = bool(pred) or bool(target and target.group(1))
        out.append((int(m.group(1), 16), body.split()[0].split(".")[0], target and int(target.group(2), 16), cond))
    return out


def inner_loop(sass: str) -> tuple[collections.Counter, collections.Counter]:
    """The opcodes of the innermost loop with matrix products (the body between a backward branch and its target) on
    its shortest and on its longest path through one tile's matrix products: what a warp issues for a visible tile
    that takes the loop's cheapest branches (an interior tile: no mask) and its dearest (a tile at an edge, with
    every mask)."""
    ins = _instructions(sass)
    loops = [(t, a) for a, _, t, _ in ins if t is not None and t < a]
    best = None
    for lo, hi in loops:
        body = [x for x in ins if lo <= x[0] <= hi]
        if any(op in MMA for _, op, _, _ in body) and (best is None or len(body) < len(best)):
            best = body
    if best is None:
        return collections.Counter(), collections.Counter()
    return _tile_path(best, min), _tile_path(best, max)


#: the matrix-product opcodes (one tile's products: the fewest any pass of a loop that does one holds)
MMA = ("HGMMA", "HMMA")


def _tile_path(body: list, pick) -> collections.Counter:
    """The opcodes on the shortest (``pick=min``) or longest (``max``) path from the loop's head to its back edge
    among those with the fewest matrix products above zero (one tile's: a compiler may copy the tile's code into two
    branches), forward edges only (the blocks in address order form a DAG)."""
    addrs = [a for a, _, _, _ in body]
    leaders = {addrs[0]} | {t for _, _, t, _ in body if t is not None and addrs[0] <= t <= addrs[-1]}
    leaders |= {addrs[i + 1] for i, (_, op, _, _) in enumerate(body[:-1]) if op == "BRA"}
    blocks: list[list] = []
    for x in body:
        if x[0] in leaders or not blocks:
            blocks.append([])
        blocks[-1].append(x)
    start = {blk[0][0]: i for i, blk in enumerate(blocks)}
    mma = [sum(op in MMA for _, op, _, _ in blk) for blk in blocks]
    best: list[dict] = [{} for _ in blocks]  # block -> {products so far: (instructions, previous state)}
    best[0][mma[0]] = (len(blocks[0]), None)
    for i, blk in enumerate(blocks):
        _, op, target, cond = blk[-1]
        nxt = [] if op == "BRA" and not cond else [i + 1]
        if target is not None and target in start and start[target] > i:
            nxt.append(start[target])
        for c, (n, _) in list(best[i].items()):
            for j in nxt:
                if j < len(blocks):
                    state, cand = c + mma[j], n + len(blocks[j])
                    if state not in best[j] or pick(cand, best[j][state][0]) == cand != best[j][state][0]:
                        best[j][state] = (cand, (i, c))
    tail = best[-1]
    c = min(k for k in tail if k > 0)
    path, at = [], (len(blocks) - 1, c)
    while at is not None:
        path.append(at[0])
        at = best[at[0]][at[1]][1]
    return collections.Counter(op for i in path for _, op, _, _ in blocks[i])


def measure(launch: tb.Launch, arch: int) -> dict:
    """Registers, stack and shared bytes, and the inner loop's instructions by class, of one launch."""
    compiled = aot.compile_launch(launch, arch)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "k.cubin"
        path.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", str(path)], capture_output=True, text=True)
        sass = subprocess.run([str(CUOBJDUMP), "-sass", str(path)], capture_output=True, text=True).stdout
    line = next(x for x in usage.stdout.splitlines() if "REG:" in x)
    res = dict(kv.split(":", 1) for kv in line.split() if ":" in kv)
    interior, edge = inner_loop(sass)
    out = {"regs": int(res["REG"]), "stack": int(res["STACK"]), "shared": int(compiled.metadata.shared)}
    out["serial"] = "yes" if aot.serialized_products(compiled, arch) else "no"
    out["interior"], out["edge"] = sum(interior.values()), sum(edge.values())
    a, warps = launch.args, launch.options["num_warps"]
    out["per 64x64"] = round(out["interior"] * warps / 4 / (a["BM"] * a.get("BN", a["BM"]) / 4096))
    for name, codes in CLASSES.items():
        out[name] = sum(interior[c] for c in codes)
    out["other"] = out["interior"] - sum(out[name] for name in CLASSES)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cols = ["regs", "stack", "shared", "serial", "interior", "edge", "per 64x64", *CLASSES, "other"]
    lines = [
        f"# Fused bias kernel: static resources and inner-loop instructions for sm_{args.arch}, bf16",
        "",
        f"- Command: `python bench/triton_resources.py --arch {args.arch}`; Triton {triton.__version__}, torch "
        f"{torch.__version__}; compiled ahead of time on a machine without a GPU, as the JIT compiles each call",
        "- `stack`: bytes of local memory per thread (register spills; 0 is none); `shared`: bytes; `serial`: whether "
        "ptxas serializes the kernel's tensor-core products (its note C7515: each waits for the one before; "
        "`triton_aot.serialized_products`); `interior`, "
        "`edge`: the instructions one warp issues for a visible tile in the inner loop, on its cheapest path (no mask: "
        "an interior tile of a full grid, or every tile where each tile pattern is one exact tile, as a window's) and "
        "its dearest (every mask: a tile at an edge, a shifted window's); "
        "`per 64x64`: the interior path's instructions per scheduler (4 a multiprocessor) for 64 x 64 scores, which "
        "compares tiles and warp counts; then the interior path's by class (`smem`: shared-memory loads, stores, "
        "shuffles)",
        "",
        "| call | kernel | tile | warps | " + " | ".join(cols) + " |",
        "|---|---|---|---:|" + "---:|" * len(cols),
    ]
    for label, call, opts, kernels in CASES:
        for name, launch in _plan(call(), opts).items():
            if name not in (kernels or (*_FWD, *_BWD)):  # (not the delta kernel: no products)
                continue
            a = launch.args
            tile = f"{a['BM']} x {a.get('BN', a['BM'])}"
            row = measure(launch, args.arch)
            cells = " | ".join(str(row[c]) for c in cols)
            lines.append(f"| {label} | {name} | {tile} | {launch.options['num_warps']} | {cells} |")
            print(lines[-1], flush=True)
            if args.out:
                Path(args.out).write_text("\n".join(lines) + "\n")
    lines += window_forward(args.arch)
    lines += dbias_schedule(args.arch)
    print("\n".join(lines[-16:]))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


def _sass(launch: tb.Launch, arch: int) -> str:
    compiled = aot.compile_launch(launch, arch)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "k.cubin"
        path.write_bytes(compiled.asm["cubin"])
        return subprocess.run([str(CUOBJDUMP), "-sass", str(path)], capture_output=True, text=True).stdout


def whole_program(sass: str) -> int:
    """The instructions one warp issues on the shortest path through a whole program, entry to its last ``EXIT``, with
    one tile's matrix products (its loops taken once): a program's cost where its loop runs once."""
    ins = _instructions(sass)
    end = max(i for i, x in enumerate(ins) if x[1] == "EXIT")
    return sum(_tile_path(ins[: end + 1], min).values())


def window_forward(arch: int) -> list[str]:
    """A Swin-T window's forward, a warp's instructions: a program a window (``fwd_one_tile_max`` 0: the whole program,
    its loop once) against the one-tile forward (its loop, one window, plus its program's set-up and end over the
    windows of its share)."""
    out = [
        "",
        "## A window's forward: instructions one warp issues per window (Swin-T's first stage)",
        "",
        "| window | a program a window (whole program) | `fwd_tile` (loop + program / windows a share) |",
        "|---|---:|---:|",
    ]
    for label, kind in (("no mask", 0), ("region ids", 2), ("float mask", 1)):
        each = _plan(_windows(kind), {"config": {"fwd_one_tile_max": 0}})["fwd"]
        tile = _plan(_windows(kind), {})["fwd"]
        sass = _sass(tile, arch)
        loop = sum(inner_loop(sass)[0].values())
        per_share = tile.args["B"] / tile.args["n_split"]
        share = loop + (whole_program(sass) - loop) / per_share
        rest = f"{loop} + the rest / {per_share:.1f}"
        out.append(f"| {label} | {whole_program(_sass(each, arch))} | {share:.0f} ({rest}) |")
    return out


def _span(work: list[int], slots: int) -> int:
    """When the last of ``work`` (programs' tile counts, in launch order) ends, each started on the first free slot."""
    free = [0] * slots
    for w in work:
        heapq.heappush(free, heapq.heappop(free) + w)
    return max(free)


def dbias_schedule(arch: int, sms: int = 132) -> list[str]:
    """The ``dbias`` kernel's span in tile-times (a model: every tile takes one, programs start in launch order on the
    first free slot of ``sms`` x the programs one SM holds, from the compiled kernel's registers and shared memory),
    its programs in pattern order against :func:`vitrel.kernels.triton.dbias_order` (longest first); ``dq`` by atomics,
    so the ``dbias`` kernel runs at every size."""
    out = [
        "",
        f"## `dbias` launch order: modeled span in tile-times ({sms} SMs)",
        "",
        "| N | programs | per SM | total tiles / slots | pattern order | longest first |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for side in (14, 32, 64):
        launch = _plan(_layer(side), {"bias_read": "tiles", "sms": sms, "deterministic": False})["dbias"]
        a, warps = launch.args, launch.options["num_warps"]
        res = measure(launch, arch)
        regs = -(-res["regs"] * 32 // 256) * 256 * warps  # registers a program holds (per warp, in 256s)
        per_sm = min(65536 // regs, 233472 // max(1, res["shared"]), 32 // warps)
        n_split, heads, batch = a["n_split"], a["H"], a["B"]
        grid_w = a["geo"][2]  # (prefix, rows, columns)
        pat = tb.tile_patterns(grid_w, a["N"], a["BM"], a["BN"])
        tiles = pat.tiles(a["N"], a["BM"], a["BN"], grid_w, a["CAUSAL"])
        share = [len(range(s, batch, n_split)) for s in range(n_split)]
        old = [int(tiles[p]) * share[s] for s in range(n_split) for _ in range(heads) for p in range(pat.n_pat)]
        order = tb.dbias_order(tiles, heads, n_split).long()
        new = [int(tiles[i // (heads * n_split)]) * share[i % n_split] for i in order.tolist()]
        slots = sms * per_sm
        out.append(f"| {a['N']} | {len(new)} | {per_sm} | {sum(new) / slots:.0f} | {_span(old, slots)} | "
                   f"{_span(new, slots)} |")  # fmt: skip
    return out


if __name__ == "__main__":
    main()
