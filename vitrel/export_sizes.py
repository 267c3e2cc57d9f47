"""The sizes a ``torch.export`` program takes (its input's guards), and a module that checks them first.

:func:`program_input_shape` and :func:`program_input_sizes` read a program's input sizes, :func:`describe_sizes` says
one in words, :class:`SizeCheckedProgram` runs a program after checking its input against them (what
:func:`vitrel.inference.load_predictor` returns for a ``.pt2``). ``vitrel.export`` re-exports them all.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor, nn

__all__ = ["program_input_shape", "program_input_sizes", "describe_sizes", "SizeCheckedProgram"]


def program_input_shape(ep: torch.export.ExportedProgram) -> tuple[int | None, ...]:
    """The shape of the program's input (images or clips), each size an ``int`` where the program fixes it, None
    where it is dynamic."""
    name = ep.graph_signature.user_inputs[0]
    node = next(n for n in ep.graph.nodes if n.op == "placeholder" and n.name == name)
    return tuple(s if isinstance(s, int) else None for s in node.meta["val"].shape)


def program_input_sizes(ep: torch.export.ExportedProgram) -> tuple[int | range, ...]:
    """The sizes the program's input takes, dimension by dimension: an ``int`` where the program fixes it, else the
    ``range`` its guards allow (a ``"hw"`` program of 4 px patches: height and width ``range(4, 4097, 4)``, whole
    patches up to :data:`vitrel.export.MAX_SIDE`; the batch ``range(1, 65537)``)."""
    name = ep.graph_signature.user_inputs[0]
    node = next(n for n in ep.graph.nodes if n.op == "placeholder" and n.name == name)
    out: list[int | range] = []
    for s in node.meta["val"].shape:
        if isinstance(s, int):
            out.append(s)
            continue
        expr = s.node.expr
        step, sym = expr.as_coeff_Mul()  # (export's ``patch * Dim(...)``: 4*s52)
        bounds = ep.range_constraints.get(expr) or ep.range_constraints[sym]
        scale = 1 if expr in ep.range_constraints else int(step)
        lo = int(bounds.lower) * scale
        hi = int(bounds.upper) * scale if bounds.upper.is_finite else sys.maxsize
        out.append(range(lo, hi + 1, int(step)))
    return tuple(out)


def describe_sizes(r: int | range | None) -> str:
    """One dimension of :func:`program_input_sizes` in words: ``4``, ``2..1024 in steps of 2``, ``any``."""
    if r is None or isinstance(r, int):
        return "any" if r is None else str(r)
    top = "" if r.stop > sys.maxsize else f"..{r[-1]}"
    return f"{r.start}{top}" + (f" in steps of {r.step}" if r.step > 1 else "")


class SizeCheckedProgram(nn.Module):
    """A loaded ``.pt2``'s module (``ep.module()``) that checks its input against the sizes the program takes
    (:func:`program_input_sizes`; ``None``: any) before running it, in one ``ValueError`` instead of torch's ``Guard
    failed``: a ``"batch"`` / ``"static"`` program's other image size (``x.size()[2] == 28``) names both sizes and the
    fix; a ``"hw"`` program's side that is not whole patches (``x.size()[2] % 4 == 0``) names the size, the patch and
    the sizes the program takes (a ``dynamic_img_pad`` ViT's program, of any side: the largest). What
    :func:`vitrel.inference.load_predictor` returns for a ``.pt2``; torch's own module is left as it is.
    ``num_classes``: the last size of the program's first output where it is a number (a classifier's, as timm's
    models have it), else None."""

    def __init__(self, module: nn.Module, shape: tuple[int | range | None, ...], source: str) -> None:
        super().__init__()
        self.program, self.shape, self.source = module, tuple(shape), source
        out = next(n for n in module.graph.nodes if n.op == "output").args[0]
        last = out[0].meta.get("val").shape[-1] if out and hasattr(out[0], "meta") and "val" in out[0].meta else None
        self.num_classes = last if isinstance(last, int) else None

    def forward(self, x: Tensor) -> Tensor:
        want, got = self.shape, tuple(x.shape)
        ok = [w is None or (g in w if isinstance(w, range) else g == w) for w, g in zip(want, got)]
        if len(got) == len(want) and all(ok):
            return self.program(x)
        same_rank = len(got) == len(want)
        if same_rank and len(want) == 5 and isinstance(want[2], int) and all(ok[:2] + ok[3:]):
            raise ValueError(  # a video program of one clip length (its scheme compares the grid with the built one)
                f"{self.source} takes clips of {want[2]} frames (a program of one clip length), got {got[2]}: give it "
                f"{want[2]}-frame clips (the predictor's data_config does), or export again with --num-frames "
                f"{got[2]} (one program per clip length) or with --dynamic hw where the model allows it "
                "(vitrel.export.best_dynamic)"
            )
        (h, w), (gh, gw) = want[-2:], got[-2:]
        if same_rank and all(ok[:-2]) and isinstance(h, int) and isinstance(w, int):
            kind = "frames" if len(want) == 5 else "images"  # (a video program: [B, C, T, H, W])
            raise ValueError(
                f"{self.source} takes {h}x{w} {kind} (a program of one {kind[:-1]} size), got {gh}x{gw}: resize them "
                f"to {h}x{w} (the predictor's data_config does), or export again with --dynamic hw where the model "
                "allows it (vitrel.export.best_dynamic)"
            )
        if same_rank and all(ok[:-2]) and isinstance(h, range) and isinstance(w, range) and h.step == w.step == 1:
            raise ValueError(  # (a dynamic_img_pad ViT's "hw" program: any side up to its largest)
                f"{self.source} takes images of any side from {h.start} to {max(h[-1], w[-1])} px (padded to whole "
                f"patches in the program), got {gh}x{gw}: resize them to at most {max(h[-1], w[-1])} px a side"
            )
        whole = isinstance(h, range) and isinstance(w, range) and gh % h.step == 0 and gw % w.step == 0
        if same_rank and all(ok[:-2]) and whole:  # (whole patches, but a side beyond the program's range)
            near = "x".join(str(min(max(g, r.start), r[-1])) for g, r in ((gh, h), (gw, w)))
            raise ValueError(
                f"{self.source} takes images of whole {h.step} px patches from {h.start} to {h[-1]} px high and "
                f"{w.start} to {w[-1]} px wide, got {gh}x{gw}: resize them into that range, e.g. {near}"
            )
        if same_rank and all(ok[:-2]) and isinstance(h, range) and isinstance(w, range):
            near = "x".join(str(min(max(g // r.step * r.step, r.start), r[-1])) for g, r in ((gh, h), (gw, w)))
            raise ValueError(
                f"{self.source} takes images whose sides are whole patches of {h.step} px ({describe_sizes(h)} px "
                f"high, {describe_sizes(w)} px wide), got {gh}x{gw}: resize or crop them to whole patches, e.g. {near} "
                "(the predictor's data_config resizes to its input_size)"
            )
        shown = ", ".join(describe_sizes(w) for w in want)
        raise ValueError(f"{self.source} takes input of shape [{shown}], got {list(got)}")
