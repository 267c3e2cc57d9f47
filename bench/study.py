"""The position-scheme study's command: ``vitrel.study`` (``python bench/study.py --help``, ``docs/study.md``).

    python bench/study.py --budget cpu              # 2 CPU cores, about 90 min -> bench/results/study_cpu.*
    python bench/study.py --budget gpu --jobs 8     # one GPU lease: every scheme and variant -> study_gpu.*
    python bench/study.py --budget trained --jobs 8 # one GPU, ~10 min, the claims' schemes at >= 85 % (docs/gpu.md)
    python bench/study.py --budget smoke --schemes none,rel2d_full --out /tmp/study   # seconds (tests)

The code is the framework's (``vitrel/study/``); this file is its entry point, as ``python -m vitrel.study``.
"""

import os

# OpenMP threads that sleep rather than spin when they wait (read when torch loads): on a shared CPU a spinning
# team of threads loses most of its time to anything else running (4x slower here with 2 busy cores).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from vitrel.study import main  # noqa: E402

if __name__ == "__main__":
    main()
