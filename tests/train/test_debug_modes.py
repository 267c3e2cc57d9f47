"""``debug=<mode>`` wins over ``experiment=<recipe>`` (conf/train.yaml's defaults: debug last, as
lightning-hydra-template's): every key a debug file sets holds in the composed config with every experiment. Before,
the experiment came after and overrode them, silently (``debug=limit experiment=video`` trained 15 epochs, not 2) or
with a misleading error (``debug=fdr experiment=cifar10_vit``: ``callbacks.pos_images has no _target_``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.train_helpers import compose

CONF = Path(__file__).resolve().parents[2] / "conf"
# recipes that set what the debug files set: the epochs, the GPU trainer and its compiled step, mixup, a scheduler,
# label smoothing, the memory loader, pos_images every n epochs (each compose ~0.5 s: not all of conf/experiment)
EXPERIMENTS = ["cifar10_vit", "fmnist_quick"]


def _leaves(node, prefix: str = "") -> dict[str, object]:
    """``{dotted key: value}`` of a debug file's settings (its defaults list aside)."""
    out = {}
    for k, v in node.items():
        if k == "defaults":
            continue
        if isinstance(v, dict):
            out |= _leaves(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


@pytest.mark.parametrize("debug", sorted(p.stem for p in (CONF / "debug").glob("*.yaml")))
def test_a_debug_mode_wins_over_an_experiment(debug, tmp_path):
    raw = OmegaConf.to_container(OmegaConf.load(CONF / "debug" / f"{debug}.yaml"))
    want = _leaves(raw)
    logger = [d["override /logger"] for d in raw.get("defaults", []) if "override /logger" in d]
    for experiment in EXPERIMENTS:
        cfg = compose(tmp_path, [f"experiment={experiment}", f"debug={debug}"])
        got = {k: OmegaConf.select(cfg, k) for k in want}
        assert got == want, experiment
        if logger:  # (none: no logger at all; csv: the CSV logger alone)
            assert list(cfg.get("logger") or {}) == ([] if logger[0] == "none" else [logger[0]]), experiment


def test_debug_is_the_last_group_of_the_defaults():
    """Last of conf/train.yaml's defaults list, so no experiment, search or experiment_data file can override it."""
    defaults = OmegaConf.to_container(OmegaConf.load(CONF / "train.yaml"))["defaults"]
    assert defaults[-1] == {"debug": None}
