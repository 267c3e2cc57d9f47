"""vitrel.stats against hand-computed examples."""

from __future__ import annotations

import math

import pytest

from vitrel.stats import CONTRADICTED, REPRODUCED, UNRESOLVED, chain_verdict, mean_ci, paired_diff, verdict

T975_2 = 4.302652729911275  # Student's t, 97.5 % quantile, 2 degrees of freedom (tables)


def test_mean_ci_by_hand():
    # mean 0.82; s = sqrt((0.02^2 + 0 + 0.02^2) / 2) = 0.02; half width t * s / sqrt(3)
    r = mean_ci([0.80, 0.82, 0.84])
    half = T975_2 * 0.02 / math.sqrt(3)
    assert r["n"] == 3 and r["mean"] == pytest.approx(0.82) and r["sd"] == pytest.approx(0.02)
    assert (r["lo"], r["hi"]) == (pytest.approx(0.82 - half), pytest.approx(0.82 + half))
    assert (round(r["lo"], 5), round(r["hi"], 5)) == (0.77032, 0.86968)
    assert mean_ci([0.5]) == dict(mean=0.5, lo=None, hi=None, sd=None, n=1)
    assert mean_ci([])["mean"] is None and mean_ci([0.1, float("nan"), 0.3])["n"] == 2
    wide = mean_ci([0.80, 0.82, 0.84], level=0.99)
    assert wide["lo"] < r["lo"] and wide["hi"] > r["hi"]


def test_paired_difference_uses_shared_seeds_only():
    a = {0: 0.80, 1: 0.85, 2: 0.90}
    b = {0: 0.78, 1: 0.82, 2: 0.86, 3: 0.50}  # seed 3 has no partner: left out
    d = paired_diff(a, b)  # d = 0.02, 0.03, 0.04: mean 0.03, s 0.01
    assert d["seeds"] == [0, 1, 2] and d["mean"] == pytest.approx(0.03) and d["sd"] == pytest.approx(0.01)
    assert d["lo"] == pytest.approx(0.03 - T975_2 * 0.01 / math.sqrt(3))
    assert verdict(d) == REPRODUCED  # [0.0052, 0.0548] above 0
    assert verdict(paired_diff(b, a)) == CONTRADICTED
    # unpaired, the two intervals overlap widely: pairing is what resolves it
    assert mean_ci(list(a.values()))["lo"] < mean_ci([0.78, 0.82, 0.86])["hi"]
    assert verdict(paired_diff({0: 0.8, 1: 0.9}, {0: 0.85, 1: 0.85})) == UNRESOLVED  # d = -0.05, +0.05
    assert verdict(paired_diff({0: 0.9}, {0: 0.1})) == UNRESOLVED  # one seed: no interval


def test_chain_verdict():
    assert chain_verdict([REPRODUCED, REPRODUCED]) == REPRODUCED
    assert chain_verdict([REPRODUCED, UNRESOLVED]) == UNRESOLVED
    assert chain_verdict([UNRESOLVED, CONTRADICTED]) == CONTRADICTED
    assert chain_verdict([]) == UNRESOLVED
