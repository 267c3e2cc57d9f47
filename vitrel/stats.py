"""Statistics of a study over seeds: means with confidence intervals, paired differences, verdicts.

With ``n`` seeds ``x_1..x_n`` of a cell (one accuracy per seed), the reported interval is Student's::

    mean = sum(x) / n,   s = sqrt(sum((x - mean)^2) / (n - 1)),   mean -/+ t_{(1 + level) / 2, n - 1} * s / sqrt(n)

A *paired* difference of schemes ``A`` and ``B`` takes ``d_k = A_k - B_k`` for every seed ``k`` both have (the
same seed gives both the same data order and augmentation) and reports the interval of the ``d_k`` the same
way: seed-to-seed variation shared by ``A`` and ``B`` cancels, so it is narrower than comparing two intervals.

A claim "``A`` is better than ``B``" is **reproduced** when the whole interval of ``A - B`` is above 0,
**contradicted** when it is below 0, and **not resolved** when it contains 0 (or fewer than two seeds).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from scipy.stats import t as student_t

__all__ = ["mean_ci", "paired_diff", "verdict", "chain_verdict", "REPRODUCED", "CONTRADICTED", "UNRESOLVED"]

REPRODUCED, CONTRADICTED, UNRESOLVED = "reproduced", "contradicted", "not resolved"


def mean_ci(values: Sequence[float], level: float = 0.95) -> dict:
    """``{"mean", "lo", "hi", "sd", "n"}`` of ``values`` (Student's t interval; lo/hi None below 2 values)."""
    xs = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    n = len(xs)
    if n == 0:
        return dict(mean=None, lo=None, hi=None, sd=None, n=0)
    mean = math.fsum(xs) / n
    if n < 2:
        return dict(mean=mean, lo=None, hi=None, sd=None, n=1)
    sd = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (n - 1))
    half = float(student_t.ppf((1 + level) / 2, n - 1)) * sd / math.sqrt(n)
    return dict(mean=mean, lo=mean - half, hi=mean + half, sd=sd, n=n)


def paired_diff(a: Mapping[int, float], b: Mapping[int, float], level: float = 0.95) -> dict:
    """Interval of ``a[k] - b[k]`` over the seeds ``k`` both have; ``seeds`` lists them."""
    seeds = sorted(set(a) & set(b))
    return {**mean_ci([a[k] - b[k] for k in seeds], level), "seeds": seeds}


def verdict(diff: Mapping) -> str:
    """ "A > B" from the interval of ``A - B`` (see the module docstring)."""
    lo, hi = diff.get("lo"), diff.get("hi")
    if lo is None or hi is None:
        return UNRESOLVED
    return REPRODUCED if lo > 0 else CONTRADICTED if hi < 0 else UNRESOLVED


def chain_verdict(verdicts: Sequence[str]) -> str:
    """A claim made of links (``A > B > C``, or ``A`` beats each other scheme): reproduced when every link
    is, contradicted when any link is, else not resolved."""
    if verdicts and all(v == REPRODUCED for v in verdicts):
        return REPRODUCED
    return CONTRADICTED if CONTRADICTED in verdicts else UNRESOLVED
