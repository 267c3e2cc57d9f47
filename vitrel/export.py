"""``python -m vitrel.export CKPT OUTDIR``: a training checkpoint -> ``model.safetensors`` + ``config.json``.

The output directory loads with ``vitrel.load_model(OUTDIR)``, ``timm.create_model("local-dir:OUTDIR")``
or ``timm.create_model(<architecture>, pretrained=True, pretrained_cfg_overlay=dict(file=OUTDIR +
"/model.safetensors"))``, and is the layout the Hugging Face Hub expects.
"""

from __future__ import annotations

import argparse
import sys

from vitrel.models.checkpoint import CONFIG_NAME, WEIGHTS_NAME, CheckpointError, export_model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vitrel.export", description=__doc__.splitlines()[0])
    ap.add_argument("ckpt", help="training checkpoint (.ckpt) or exported weights")
    ap.add_argument("out_dir", help=f"output directory (gets {WEIGHTS_NAME} and {CONFIG_NAME})")
    ap.add_argument("--ema", action="store_true", help="export the EMA weights of the checkpoint")
    args = ap.parse_args(argv)
    try:
        out = export_model(args.ckpt, args.out_dir, use_ema=args.ema)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out / WEIGHTS_NAME} and {out / CONFIG_NAME}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
