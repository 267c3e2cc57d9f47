"""ONNX export with and without onnxscript's optimizer (``torch.onnx.export(..., optimize=...)``).

    python bench/onnx_optimize.py --out bench/results/onnx_optimize_cpu.md
    python bench/onnx_optimize.py --models vitrel_vit_small_patch16_224 --schemes rel2d_full alibi2d --rounds 9

:func:`vitrel.export.onnx_program` converts with torch's default, ``optimize=True``: onnxscript folds constants
and fuses the graph before it is saved, which is most of a conversion's time. This measures what that buys an
ONNX Runtime user: for each model and scheme, one ``torch.export`` program (:func:`~vitrel.export.export_program`
at ``best_dynamic``'s sizes) converted both ways; the conversion's seconds (one conversion each), the file's size,
the graph's nodes, ONNX Runtime's session creation (CPU provider) and its run time on a batch of 2, both files
timed in alternation (median of ``--rounds``), and each output's largest difference from eager.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

import vitrel
from vitrel.bench import alternate, emit, machine_info, medians, source_commit
from vitrel.export import ONNX_OPSET, best_dynamic, export_program


def convert(ep: torch.export.ExportedProgram, optimize: bool):
    """``ep`` through the dynamo exporter as :func:`vitrel.export.onnx_program` calls it, but ``optimize``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.onnx.export(
            ep, input_names=["images"], output_names=["logits"], opset_version=ONNX_OPSET, dynamo=True,
            verbose=False, optimize=optimize,
        )  # fmt: skip


def measure(name: str, pos: str, side: int, rounds: int, threads: int, folder: Path) -> list[str]:
    import onnxruntime as ort

    torch.manual_seed(0)
    model = vitrel.create_model(name, pos=pos).eval()
    x = torch.randn(2, 3, side, side)
    with torch.no_grad():
        ref = model(x).numpy()
    ep = export_program(model, x, dynamic=best_dynamic(model))
    rows, sessions = {}, {}
    for optimize in (True, False):
        start = time.perf_counter()
        program = convert(ep, optimize)
        seconds = time.perf_counter() - start
        path = folder / f"{name}_{pos}_{int(optimize)}.onnx"
        program.save(str(path))
        size = sum(f.stat().st_size for f in folder.glob(path.name + "*"))  # (with any external data file)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        start = time.perf_counter()
        sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        created = time.perf_counter() - start
        diff = float(np.abs(sess.run(None, {"images": x.numpy()})[0] - ref).max())
        sessions[optimize] = sess
        rows[optimize] = [seconds, size / 2**20, len(program.model.graph), created, diff]
    feed = {"images": x.numpy()}
    times = medians(
        alternate({k: (lambda s=s: s.run(None, feed)) for k, s in sessions.items()}, rounds, warmup=2, zigzag=True)
    )
    lines = []
    for optimize, (seconds, mib, nodes, created, diff) in rows.items():
        ratio = times[optimize] / times[True]
        lines.append(
            f"| {name} | {pos} | {optimize} | {seconds:.1f} | {mib:.1f} | {nodes} | {created:.2f} | "
            f"{1e3 * times[optimize]:.1f} ({ratio:.2f}x) | {diff:.1e} |"
        )
    return lines


def main(argv: list[str] | None = None) -> list[str]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    models = ["vitrel_vit_small_patch16_224", "vitrel_swin_tiny_patch4_window7_224"]
    p.add_argument("--models", nargs="+", default=models)
    p.add_argument("--schemes", nargs="+", default=["rel2d_full"])
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=1, help="ONNX Runtime's and torch's intra-op threads")
    p.add_argument("--out", default=None, help="write the Markdown table here too")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    lines = [
        f"# ONNX export with and without onnxscript's optimizer ({machine_info()['description']})",
        "",
        f"Commit {source_commit()}, torch {torch.__version__}; images {args.img_size} x {args.img_size}, batch 2; "
        f"ONNX Runtime CPU provider, {args.threads} thread(s); run time: median of {args.rounds} alternated rounds "
        "(ratio against optimize=True); conversion: one each.",
        "",
        "| model | scheme | optimize | convert s | file MiB | nodes | session s | run ms | max abs diff |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models:
            for pos in args.schemes:
                lines += measure(name, pos, args.img_size, args.rounds, args.threads, Path(folder))
    return emit(lines, args.out)


if __name__ == "__main__":
    main()
