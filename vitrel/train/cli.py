"""Console entry points (``vitrel-train``, ``vitrel-eval``): ``train.py`` / ``eval.py`` with the repository conf/."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["train_main", "eval_main", "conf_dir"]


def conf_dir() -> str:
    """The ``conf/`` folder next to the ``vitrel`` package (a source checkout or an editable install)."""
    d = Path(__file__).resolve().parents[2] / "conf"
    if not (d / "train.yaml").exists():
        raise FileNotFoundError(
            f"no Hydra configs at {d}: the console scripts need a source checkout (pip install -e .); "
            "otherwise run train.py from the repository"
        )
    return str(d)


def _one_line(task: Callable[[Any], Any], script: str) -> Callable[[Any], Any]:
    """``task`` under :func:`~vitrel.train.utils.one_line_errors` (``functools.wraps``: Hydra sees ``task``)."""
    from vitrel.train.utils import one_line_errors

    @functools.wraps(task)
    def run(cfg: Any) -> Any:
        with one_line_errors(script):
            return task(cfg)

    return run


def train_main() -> None:
    import hydra

    import vitrel.config  # noqa: F401  (registers the config schemas conf/ names, before Hydra composes)
    from vitrel.train.run import train
    from vitrel.train.utils import quiet_third_party

    quiet_third_party()
    hydra.main(version_base="1.3", config_path=conf_dir(), config_name="train")(_one_line(train, "vitrel-train"))()


def eval_main() -> None:
    import hydra

    import vitrel.config  # noqa: F401
    from vitrel.train.evaluate import evaluate
    from vitrel.train.utils import quiet_third_party

    quiet_third_party()
    hydra.main(version_base="1.3", config_path=conf_dir(), config_name="eval")(_one_line(evaluate, "vitrel-eval"))()
