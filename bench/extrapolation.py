"""Resolution extrapolation: every scheme x extension method, trained at the base size, scored zero-shot at 1x-4x.

    python bench/extrapolation.py                                  # CPU budget -> bench/results/study_extrapolation.*
    python bench/extrapolation.py --seeds 1 --schemes rope2d_axial,rope2d_axial_yarn   # a slice
    python bench/extrapolation.py --budget extrapolation_trained --jobs 8    # one GPU, trained (docs/gpu.md)

The study's ``extrapolation`` budget (``python bench/study.py --budget extrapolation``; recipe, claims and
the resolution factor of each eval, ``study.scales``, in ``conf/experiment/study_extrapolation.yaml``): the
same runs, resume, intervals, paired differences and verdicts, and, as for any recipe with ``study.scales``,
the curves ``<name>_curves.png`` (``vitrel.study.plots.plot_curves``). Every argument goes to the study.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as bench/study.py: before torch loads

from vitrel import study  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    return study.main(argv if "--budget" in argv else ["--budget", "extrapolation", *argv])


if __name__ == "__main__":
    main()
