"""Console entry points (``vitrel-train``, ``vitrel-eval``): ``train.py`` / ``eval.py`` with the repository conf/."""

from __future__ import annotations

from pathlib import Path

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


def train_main() -> None:
    import hydra

    import vitrel.config  # noqa: F401  (registers the config schemas conf/ names, before Hydra composes)
    from vitrel.train.run import train
    from vitrel.train.utils import quiet_third_party

    quiet_third_party()
    hydra.main(version_base="1.3", config_path=conf_dir(), config_name="train")(train)()


def eval_main() -> None:
    import hydra

    import vitrel.config  # noqa: F401
    from vitrel.train.evaluate import evaluate
    from vitrel.train.utils import quiet_third_party

    quiet_third_party()
    hydra.main(version_base="1.3", config_path=conf_dir(), config_name="eval")(evaluate)()
