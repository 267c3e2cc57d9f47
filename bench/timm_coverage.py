"""Which of timm's pretrained ViT-family architectures ``vitrel.from_timm`` reads, and why not the others.

    python bench/timm_coverage.py --out bench/results/timm_coverage.md

Every architecture with pretrained weights in timm's registry whose name starts with one of ``--families`` is built on
the meta device (no weights, no memory, no network) and read as ``from_timm`` reads it
(:func:`vitrel.models.timm_import.timm_to_vitrel_args`, then the vitrel model built on the meta device and every
timm tensor placed, :func:`~vitrel.models.timm_import.transfer_timm_weights`): *read* (a vitrel scheme computes its
position encoding, so ``pos=None`` gives the same function), *give pos=* (the architecture is read, its position
encoding has no vitrel equal: ``from_timm(..., pos=...)`` carries everything else), or refused with the reason
``from_timm`` gives.
"""

from __future__ import annotations

import argparse
import collections
import platform
import sys
import warnings
from pathlib import Path

import timm
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vitrel.models.registry import build  # noqa: E402
from vitrel.models.timm_import import (  # noqa: E402
    UnsupportedTimmModel,
    source_abs_pos,
    timm_to_vitrel_args,
    transfer_timm_weights,
)

FAMILIES = "vit,deit,eva,beit,convit,swin,cait,flexivit,samvit,mvitv2,naflex"


def learned_gap(t: torch.nn.Module, ours: torch.nn.Module) -> int:
    """How many more numbers the vitrel model learns than timm's ``t``, less what the import folds on purpose: the
    absolute embedding's prefix slots (added to the class and register tokens) and ConViT's positional-logit biases
    (the softmax cancels them). 0: fine-tuning the import learns what timm's model learns."""
    folded = 0
    if type(t).__name__ == "ConVit":
        folded = sum(b.attn.pos_proj.bias.numel() for b in t.blocks if hasattr(b.attn, "pos_proj"))
    elif getattr(t, "pos_embed", None) is not None and not getattr(t, "no_embed_class", True):
        folded = t.num_prefix_tokens * t.pos_embed.shape[-1]
    return sum(p.numel() for p in ours.parameters()) - sum(p.numel() for p in t.parameters()) + folded


def classify(name: str) -> str:
    """``"read"``, ``"give pos="`` or the reason ``from_timm`` refuses timm's ``name``; a model read as the same
    function that learns other numbers than timm's is ``"read, learns N more numbers"``."""
    with torch.device("meta"):
        t = timm.create_model(name, pretrained=False)
    try:
        arch, args, native = timm_to_vitrel_args(t)
        if native == "__ape__":
            args.setdefault("abs_pos", source_abs_pos(t))
        ours = build(arch, pos="none" if native in ("__none__", "__ape__") else native, device="meta", **args)
        with warnings.catch_warnings():  # (copies into meta tensors are no-ops, and say so)
            warnings.simplefilter("ignore")
            transfer_timm_weights(t, ours)
    except UnsupportedTimmModel as e:
        said = str(e)
        if said.startswith("from_timm takes"):
            return f"another family ({type(t).__name__})"
        return said.split(": ", 1)[-1].split(";")[0].replace(name, "<name>")
    except Exception as e:  # noqa: BLE001 - a crash is a finding too
        return f"error: {type(e).__name__}: {e}"
    if native == "__none__":
        return "give pos="
    gap = learned_gap(t, ours)
    return "read" if gap == 0 else f"read, learns {gap:+d} numbers more than timm's"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", default=FAMILIES, help="name prefixes, comma-separated")
    ap.add_argument("--out", default=None, help="write the table here (markdown)")
    args = ap.parse_args()
    prefixes = tuple(args.families.split(","))
    names = sorted({n.split(".")[0] for n in timm.list_models(pretrained=True) if n.startswith(prefixes)})
    groups: dict[str, list[str]] = collections.defaultdict(list)
    for i, name in enumerate(names):
        groups[classify(name)].append(name)
        print(f"[{i + 1}/{len(names)}] {name}", file=sys.stderr)
    order = sorted(groups, key=lambda k: (k != "read", not k.startswith("read,"), k != "give pos=", -len(groups[k]), k))
    lines = [
        "# timm's pretrained ViT-family architectures through `vitrel.from_timm`",
        "",
        f"- Command: `python bench/timm_coverage.py{' --out ' + args.out if args.out else ''}`",
        f"- timm {timm.__version__}, torch {torch.__version__}, {platform.machine()}; name prefixes: {args.families}",
        f"- {len(names)} architectures: {len(groups['read'])} read as the same function, learning the numbers timm's"
        f" model learns (`read`), {sum(len(v) for k, v in groups.items() if k.startswith('read,'))} as the same "
        f"function learning others, {len(groups['give pos='])} read with another position scheme only (`pos=` "
        "needed), the rest refused for the reason given.",
        "",
        "| outcome | architectures | examples |",
        "|---|---:|---|",
    ]
    lines += [row(k, groups[k]) for k in order]
    sys.stdout.write("\n".join(lines) + "\n")
    if args.out:  # (the same table, to the results folder)
        Path(args.out).write_text("\n".join(lines) + "\n")


def row(outcome: str, names: list[str]) -> str:
    """A table row: the outcome, how many architectures, the first four."""
    shown = ", ".join(f"`{n}`" for n in names[:4]) + (", ..." if len(names) > 4 else "")
    return f"| {outcome.replace('|', '/')} | {len(names)} | {shown} |"


if __name__ == "__main__":
    main()
