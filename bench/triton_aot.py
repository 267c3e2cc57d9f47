"""Ahead-of-time compilation of the fused kernels for a CUDA architecture, with no GPU (Triton's compiler and
ptxas): each launch as Triton's JIT specializes it, its shared memory, and whether ptxas serializes its products.

Used by ``bench/triton_resources.py`` and the kernel tests; needs Triton's CUDA backend and ``TRITON_INTERPRET``
unset (the kernels must be JIT functions).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from vitrel.kernels.triton import plan, visible_tiles
from vitrel.kernels.triton.config import ROPE_CUDA
from vitrel.kernels.triton.device import jit_module
from vitrel.kernels.triton.launch import Launch, kernel_fn
from vitrel.kernels.triton.rope import _pow2, _prec
from vitrel.layout.geometry import Grid

__all__ = ["compile_bias_kernels", "compile_launch", "compile_rope_kernels", "serialized_products"]


#: Triton's names of the tensors' element types
_TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32"}


def compile_launch(launch: Launch, arch: int = 90):
    """Compile ``launch``'s kernel ahead of time for CUDA compute capability ``arch`` (no GPU needed: Triton's own
    compiler and ptxas), specialized as Triton's JIT specializes it for that call: integer arguments equal to 1 become
    constants, and integers and tensor addresses divisible by 16 are declared so (what lets the compiler vectorize
    loads); the backend's own rules (``get_int_specialization``, ``get_tensor_specialization``, ``parse_attr``).
    Returns Triton's compiled kernel (its ``metadata``, its ``asm``). Needs Triton's CUDA backend and
    ``TRITON_INTERPRET`` unset (the kernels must be JIT functions)."""
    import triton
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource

    fn = kernel_fn(launch.kernel)
    constexprs, attrs = {}, {}

    def specialize(path: tuple[int, ...], value, is_constexpr: bool = False):
        """The type of the argument at ``path`` (a tuple's elements each by their own path), its constant or
        attributes recorded."""
        if isinstance(value, tuple) and not is_constexpr:
            return tuple(specialize((*path, j), v) for j, v in enumerate(value))
        if is_constexpr or (isinstance(value, int) and not isinstance(value, bool) and value == 1):
            constexprs[path] = value
            return "constexpr"
        if isinstance(value, Tensor):
            ty, spec = "*" + _TRITON_TYPES[value.dtype], BaseBackend.get_tensor_specialization(value, align=True)
        elif isinstance(value, float):
            ty, spec = "fp32", ""
        else:
            ty = "i32" if -(2**31) <= value < 2**31 else "i64"
            spec = BaseBackend.get_int_specialization(value, align=True)
        if spec:
            attrs[path] = BaseBackend.parse_attr(spec)
        return ty

    signature = {p.name: specialize((i,), launch.args[p.name], p.is_constexpr) for i, p in enumerate(fn.params)}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(launch.options))


def serialized_products(compiled, arch: int = 90) -> bool:
    """Whether ptxas serializes the tensor-core products of a kernel ``compiled`` for ``arch`` (:func:`compile_launch`):
    its performance note C7515 ("wgmma.mma_async instructions are serialized"), where each product waits for the one
    before instead of overlapping it and the work between them (the softmax), as Hopper's asynchronous products are
    meant to. Triton runs the same ptxas (shipped with it) and drops the note; this runs it again on the kernel's PTX
    and reads it. No GPU needed."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as d:
        ptx = os.path.join(d, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        suffix = "a" if arch >= 90 else ""
        cmd = [get_ptxas(arch).path, f"-arch=sm_{arch}{suffix}", ptx, "-o", os.path.join(d, "kernel.cubin")]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return "C7515" in out.stdout + out.stderr


def compile_bias_kernels(
    arch: int = 90,
    head_dim: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    layout: bool = False,
    regions: bool = False,
    deterministic: bool = True,
) -> dict[str, int]:
    """The three kernels of a small call compiled ahead of time for ``arch`` (:func:`compile_launch`), with a table,
    a mask and the table's gradient: each kernel's shared memory in bytes. The call: a full grid's (8 x 8 and a prefix
    token, visible-tile flags, bias tiles, a float mask); ``layout``: two images packed in a token layout;
    ``regions``: a batch of 7 x 7 windows with their region ids instead of a float mask; not ``deterministic``:
    ``dq`` by atomics (no ``dq`` kernel on a full grid). Catches what the interpreter lets through (types, layouts,
    shared memory)."""
    gen = torch.Generator().manual_seed(0)
    gh = gw = 7 if regions else 8
    p = 0 if regions or layout else 1
    n, b, h = p + gh * gw, 4, 2
    q, k, v = (torch.randn(b, h, n, head_dim, generator=gen).to(dtype) for _ in range(3))
    table = torch.randn(h, 2 * gh - 1, 2 * gw - 1, generator=gen)
    if layout:
        t = torch.arange(n)
        seg = (t >= 40).int()
        t = t - 40 * seg
        tokens = torch.stack([seg, t // 5, t % 5, torch.zeros_like(t)]).int().expand(b, 4, n)
        launches = plan(
            q, k, v, table[None], (gh, gw), mask=torch.zeros(1, n, n), tokens=tokens, deterministic=deterministic
        )
    else:
        blocks = visible_tiles(table, Grid(gh, gw), p)
        extra = {"regions": torch.arange(n).remainder(3).expand(2, n)} if regions else {"mask": torch.zeros(1, n, n)}
        launches = plan(
            q, k, v, table, (gh, gw), p, blocks=blocks, bias_read="tiles", deterministic=deterministic, **extra
        )
    return {name: compile_launch(launch, arch).metadata.shared for name, launch in launches.items()}


def compile_rope_kernels(
    arch: int = 90, head_dim: int = 64, block_size: int = 8, dtype: str = "bf16"
) -> dict[str, int]:
    """Compile the kernels ahead of time for CUDA compute capability ``arch`` (no GPU needed: Triton's own compiler
    and ptxas), with the launch configuration a GPU would use for ``head_dim`` (pairs with STRING's basis and every
    gradient, or a fixed rotation's; blocks of ``block_size``); returns each kernel's shared memory in bytes. Catches
    what the interpreter lets through (types, layouts, ``tl.dot`` shapes). Needs Triton's CUDA backend and
    ``TRITON_INTERPRET`` unset (the kernels must be JIT functions)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ks, bd, bb = jit_module("_rope_kernels"), _pow2(head_dim), _pow2(block_size)
    io = {name: f"*{dtype}" for name in ("Q", "K", "OQ", "OK", "GQ", "GK", "DQ", "DK")}
    pairs = dict(D=head_dim, BN=ROPE_CUDA.pairs_tokens, BH=max(16, _pow2(head_dim // 2)), BD=max(16, bd),
                 HAS_BASIS=True, PREC=_prec(torch.float32, torch.bfloat16))  # fmt: skip
    bwd = dict(pairs, NEED_DP=True, NEED_X=True, TABLE_BATCH=False, NEED_DT=True)
    fixed = dict(bwd, HAS_BASIS=False, NEED_DT=False, NEED_DP=False, NEED_X=False)
    blocks = dict(D=head_dim, BS=block_size, BN=ROPE_CUDA.block_tokens(bd, bb), BD=bd, BB=bb)
    cases = {
        "pairs_fwd": (ks._pairs_fwd_kernel, pairs),
        "pairs_bwd": (ks._pairs_bwd_kernel, bwd),
        "pairs_bwd_fixed": (ks._pairs_bwd_kernel, fixed),
        "blocks_fwd": (ks._blocks_fwd_kernel, blocks),
        "blocks_bwd": (ks._blocks_bwd_kernel, dict(blocks, TABLE_BATCH=False, NEED_DT=True)),
    }
    shared = {}
    for name, (fn, consts) in cases.items():
        scalar = {"B", "H", "N"}  # the other capitalised arguments are pointers: q, k and their grads, tables (fp32)
        sig = {
            a: "constexpr" if a in consts else ("i32" if a in scalar or a.islower() else io.get(a, "*fp32"))
            for a in fn.arg_names
        }
        src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(c),): v for c, v in consts.items()})
        target, options = GPUTarget("cuda", arch, 32), ROPE_CUDA.warps.options()
        shared[name] = triton.compile(src, target=target, options=options).metadata.shared
    return shared
