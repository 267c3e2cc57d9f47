"""``python -m vitrel.study ...``: the study's command (``vitrel.study``; the same as ``python bench/study.py``)."""

from vitrel.study.cli import main

main(prog="python -m vitrel.study")
