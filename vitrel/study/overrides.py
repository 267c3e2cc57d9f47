"""The study command's Hydra overrides (``python bench/study.py ... <overrides>``), checked before any run trains:
keys each run sets itself (:func:`refuse_run_keys`), every selected entry's composition with them
(:func:`check_entries_compose`), and one message for those that do not compose (:func:`override_error`)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

from hydra.errors import HydraException

from vitrel.train.utils import override_key

__all__ = ["check_entries_compose", "override_error", "refuse_run_keys"]


def override_error(prog: str, budget: str, overrides: list[str], e: Exception) -> str:
    """One message for overrides that do not compose with the recipe: Hydra's reason, and for a ``pos.<key>=`` the
    ``++`` form (every run takes the overrides, over each scheme's ``conf/pos`` file, with or without the key)."""
    pos = [o.split("=", 1) for o in overrides if re.match(r"\+?pos\.\w+=", o)]
    drop = ("hydra.cc", "To append") if pos else ("hydra.cc",)
    reason = [line.strip().rstrip(".") for line in str(e).splitlines() if line.strip()]
    msg = f"{prog}: {' '.join(overrides)} does not compose with experiment=study_{budget}: " + "; ".join(
        line for line in reason if not any(d in line for d in drop)
    )
    if pos:
        msg += (
            "; every run takes the overrides, so set a scheme option with "
            + ", ".join(f"++pos.{k.lstrip('+').split('.', 1)[1]}={v}" for k, v in pos)
            + " (its value whether or not a scheme's conf/pos file has the key; --schemes those that take it)"
        )
    return msg


def refuse_run_keys(prog: str, overrides: list[str]) -> None:
    """``seed=`` and ``pos=`` among the study's overrides: each run's own (``--seeds``, ``--schemes``) came after
    them and won, so a study given ``seed=5`` trained seeds 0, 1 ... under a recipe recording ``seed=5``: refused."""
    own = [o for o in overrides if override_key(o) in ("seed", "pos")]
    if own:
        raise SystemExit(
            f"{prog}: {' '.join(own)}: the study sets each run's seed and scheme itself (--seeds N: seeds 0 to N-1; "
            "--schemes a,b: entries of conf/pos or the recipe's study.variants); a scheme's option is pos.<key>=..."
        )


def check_entries_compose(
    prog: str,
    budget: str,
    overrides: list[str],
    entries: Iterable[tuple[str, str]],
    settings: Callable[[str, str], dict],
) -> None:
    """Each ``(arch, entry)`` of ``entries`` composes with ``overrides`` (``settings``: the study's
    :func:`~vitrel.study.cli.scheme_settings` of the recipe): else one :func:`override_error` naming the entry, before
    any run trains. A ``pos.<key>=`` that one scheme lacks failed as that scheme's run, after the others had trained,
    and again at each rerun."""
    for arch, entry in dict.fromkeys(entries):
        try:
            settings(arch, entry)
        except HydraException as e:
            raise SystemExit(f"{override_error(prog, budget, overrides, e)} (entry {entry}, {arch})") from None
        except Exception:  # noqa: BLE001, S112  (not the composition: the run's own failure, recorded as it runs)
            continue
