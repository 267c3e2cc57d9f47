"""Static resources of the fused bias kernel's compiled code for a GPU, measured without one: registers per thread,
the spill stack (bytes of local memory per thread; 0 means no register spills) and shared memory, from Triton's own
compiler and ``cuobjdump`` (shipped with Triton), for each kernel, tile and warp count.

    python bench/triton_resources.py --out bench/results/triton_resources_sm90.md   # any machine, no GPU needed

What the interpreter cannot show and a GPU timing only shows indirectly: a kernel that spills registers to the stack
reads and writes local memory in its inner loop. The cases are the full grid's (bias tiles, no mask), the layer of
``bench/attention.py`` (heads of 64), the table's gradient on and off, and no table (plain attention) for reference;
then Swin's windows (heads of 32) with no mask, with a float window mask and with the windows' region ids.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the kernels must be JIT functions, not interpreted ones

import torch  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vitrel.kernels import triton_bias as tb  # noqa: E402

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
#: (kernel, tile, warps, flags): the forward's 64 x 64 tiles, the backward's square tiles of 64 and 32
CASES = [
    ("fwd", 64, 4, dict(HAS_TABLE=False, TILED=False)),
    ("fwd", 64, 4, dict(TILED=True)),
    ("fwd", 64, 8, dict(TILED=True)),
    ("dkdv", 64, 4, dict(HAS_TABLE=False, TILED=False)),
    ("dkdv", 64, 4, dict(TILED=True)),
    ("dkdv", 32, 4, dict(TILED=True)),
    ("dq", 64, 4, dict(HAS_TABLE=False, TILED=False, TABLE_GRAD=False)),
    ("dq", 64, 4, dict(TILED=True, TABLE_GRAD=False)),
    ("dq", 64, 4, dict(TILED=True, TABLE_GRAD=True)),
    ("dq", 64, 8, dict(TILED=True, TABLE_GRAD=True)),
    ("dq", 32, 4, dict(TILED=True, TABLE_GRAD=True)),
]

#: Swin's windows (Swin-T's heads of 32, 64-token tiles, 4 warps): no mask, the float mask ``[nW, n, n]`` read per
#: window (MASK_KIND 1), and the windows' region ids masked in the kernel (MASK_KIND 2)
WINDOW_CASES = [
    (kernel, 64, 4, dict(TILED=True, MASK_KIND=kind, **({"TABLE_GRAD": True} if kernel == "dq" else {})))
    for kind in (0, 1, 2)
    for kernel in ("fwd", "dkdv", "dq")
]


def resources(kernel: str, tile: int, warps: int, flags: dict, arch: int, head_dim: int) -> tuple[int, int, int]:
    """(registers, stack bytes, shared bytes) of one kernel compiled for ``sm_<arch>`` in bf16."""
    launch = dict(num_warps=warps, num_stages=2)
    compiled = tb.compile_kernel(kernel, arch, head_dim, tile=tile, launch=launch, **flags)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "k.cubin"
        path.write_bytes(compiled.asm["cubin"])
        out = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", str(path)], capture_output=True, text=True)
    line = next(x for x in out.stdout.splitlines() if "REG:" in x)
    usage = dict(kv.split(":", 1) for kv in line.split() if ":" in kv)
    return int(usage["REG"]), int(usage["STACK"]), int(compiled.metadata.shared)


def _row(lines: list[str], kernel: str, tile: int, warps: int, flags: dict, arch: int, head_dim: int) -> None:
    case = ", ".join(f"{k}={v}" for k, v in flags.items())
    regs, stack, shared = resources(kernel, tile, warps, flags, arch, head_dim)
    lines.append(f"| {kernel} | {tile} | {warps} | {case} | {regs} | {stack} | {shared} |")
    print(lines[-1], flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lines = [
        f"# Fused bias kernel: static resources for sm_{args.arch}, bf16, heads of {args.head_dim}",
        "",
        f"- Command: `python bench/triton_resources.py --arch {args.arch} --head-dim {args.head_dim}`; Triton "
        f"{triton.__version__}, torch {torch.__version__}; compiled ahead of time on a machine without a GPU, 2 stages",
        "- `stack`: bytes of local memory per thread (register spills); 0 is none",
        "",
        "| kernel | tile | warps | case | registers | stack B | shared B |",
        "|---|---:|---:|---|---:|---:|---:|",
    ]
    for kernel, tile, warps, flags in CASES:
        _row(lines, kernel, tile, warps, flags, args.arch, args.head_dim)
    lines += ["", "Swin's windows, heads of 32 (Swin-T's):", "", *lines[5:7]]
    for kernel, tile, warps, flags in WINDOW_CASES:
        _row(lines, kernel, tile, warps, flags, args.arch, 32)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
