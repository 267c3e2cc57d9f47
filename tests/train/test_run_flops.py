"""A run's forward cost, ``gflops`` in its ``metrics.json`` and the sweep summary (:mod:`vitrel.train.flops`): one
forward of one image at the model's ``img_size``, checked against a count written from the architecture; null, with
one line saying why, where torch cannot count the forward; the run's metrics the same with and without the count."""

from __future__ import annotations

import csv
import json
import logging

import pytest
import torch
from omegaconf import OmegaConf

from tests.train_helpers import FAST, TINY_VIT, compose
from vitrel.models.vit import VisionTransformer
from vitrel.train.flops import UncountedError, forward_flops, run_gflops
from vitrel.train.hydra_callbacks import SweepSummary

SIDE, PATCH, CHANS, DIM, DEPTH, HEADS, MLP, CLASSES = 28, 4, 1, 32, 2, 2, 2.0, 10


def _vit(pos: str = "none", attn_impl: str = "auto", **kw) -> VisionTransformer:
    return VisionTransformer(
        img_size=SIDE, patch_size=PATCH, in_chans=CHANS, num_classes=CLASSES, embed_dim=DIM, depth=DEPTH,
        num_heads=HEADS, mlp_ratio=MLP, pos=pos, attn_impl=attn_impl, global_pool="avg", **kw,
    )  # fmt: skip


def hand_count() -> int:
    """The tiny ViT's forward on one image, 2 FLOPs per multiply-add: the patch embedding (a convolution), per block
    the qkv linear, per head ``q @ k^T`` and ``attn @ v`` (2 N^2 d each), the projection and the two MLP linears, and
    the head. Tokens: the patches and the class token (a model built with one, pooled by mean)."""
    grid = SIDE // PATCH
    n, d, hidden = grid * grid + 1, DIM // HEADS, int(DIM * MLP)
    embed = 2 * grid * grid * DIM * (CHANS * PATCH * PATCH)
    qkv, proj = 2 * n * DIM * 3 * DIM, 2 * n * DIM * DIM
    attention = HEADS * (2 * n * n * d + 2 * n * n * d)
    mlp = 2 * n * DIM * hidden + 2 * n * hidden * DIM
    return embed + DEPTH * (qkv + attention + proj + mlp) + 2 * DIM * CLASSES


@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_forward_flops_is_the_hand_count_and_leaves_the_model_and_rngs_alone(attn_impl, dtype):
    """Exact, in float32 and float64, with the attention's own products and through sdpa's CPU kernel; the model
    stays in train mode with the same weights, and the CPU's random stream where it was."""
    net = _vit(attn_impl=attn_impl).to(dtype).train()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    rng = torch.get_rng_state()
    assert forward_flops(net) == hand_count() == 2_329_216
    assert all(m.training for m in net.modules())
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)


def test_schemes_differ_by_the_work_torch_counts():
    """A bias added to the scores (``rel2d_factored``) or a rotation (``rope2d_mixed``) is not counted: the figure of
    ``pos=none``; Swin V2's CPB runs its MLP (2 -> 512 -> heads) over the (2 * 7 - 1)^2 offsets in every block."""
    none = forward_flops(_vit("none"))
    assert forward_flops(_vit("rel2d_factored")) == forward_flops(_vit("rope2d_mixed")) == none
    offsets, hidden = (2 * (SIDE // PATCH) - 1) ** 2, 512
    cpb_mlp = 2 * offsets * 2 * hidden + 2 * offsets * hidden * HEADS
    assert forward_flops(_vit("rel2d_cpb")) == none + DEPTH * cpb_mlp


@torch.library.custom_op("vitrel_test::double", mutates_args=())
def _double(x: torch.Tensor) -> torch.Tensor:
    return 2 * x


class _Custom(torch.nn.Module):
    """A linear layer, then a custom operator torch has no FLOP formula for."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _double(self.fc(x))


def test_flex_and_custom_operators_are_not_counted_and_say_why(caplog):
    """FlexAttention (which does not run under the counter) and a custom operator without a FLOP formula (whose work
    the count would leave out): null, one line each, never a figure without their work."""
    with pytest.raises(UncountedError, match="attn_impl='flex'"):
        forward_flops(_vit(attn_impl="flex"))

    with caplog.at_level(logging.INFO):
        assert run_gflops(_vit(attn_impl="flex")) is None
        with pytest.raises(UncountedError, match="vitrel_test::double"):
            forward_flops(_Custom(), torch.zeros(1, 4))
    said = [r.getMessage() for r in caplog.records if "gflops not counted" in r.getMessage()]
    assert said == [
        "gflops not counted (null in metrics.json): attn_impl='flex': compiled FlexAttention does not run under "
        "torch's FlopCounterMode"
    ]


def test_a_forward_that_fails_under_the_counter_is_a_warning_and_null():
    """A trained run keeps its record: the count's own failure is null and a warning naming the error (a module without
    a vitrel config gets a 224 x 224 RGB sample, which a 3-feature linear layer cannot take)."""
    with pytest.warns(UserWarning, match=r"gflops not counted \(null in metrics.json\): the forward .* raised"):
        assert run_gflops(torch.nn.Linear(3, 2)) is None


def test_the_run_records_its_gflops_and_the_count_changes_nothing_else(tmp_path, monkeypatch):
    """``metrics.json``'s ``gflops`` is the hand count / 10^9 (TINY_VIT, pos=none: the same network); a run without
    the count (its figure stubbed to null) has the same metrics, steps and weights."""
    import vitrel.train.run as run

    args = [*TINY_VIT, *FAST, "pos=none", "logger=none", "trainer.max_epochs=2", "trainer.limit_train_batches=3"]
    args += ["trainer.limit_val_batches=1", "trainer.limit_test_batches=1"]
    metrics = run.train(compose(tmp_path / "counted", args))
    record = json.loads((tmp_path / "counted" / "metrics.json").read_text())
    assert record["gflops"] == hand_count() / 1e9
    monkeypatch.setattr(run, "run_gflops", lambda model: None)
    assert run.train(compose(tmp_path / "plain", args)) == metrics
    plain = json.loads((tmp_path / "plain" / "metrics.json").read_text())
    assert plain["gflops"] is None and plain["metrics"] == record["metrics"]
    ckpts = [tmp_path / run_dir / "checkpoints" / "last.ckpt" for run_dir in ("counted", "plain")]
    weights = [torch.load(c, weights_only=True)["state_dict"] for c in ckpts]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_sweep_summary_has_a_gflops_column(tmp_path, capsys):
    """summary.csv: each job's figure as recorded (empty where null); the printed table: 4 significant digits."""
    sweep = tmp_path / "sweep"
    for job, (pos, gflops) in enumerate((("none", 0.002329216), ("rel2d_cpb", 0.003713664), ("flex", None))):
        d = sweep / str(job)
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "overrides.yaml").write_text(f"- pos={pos}\n")
        record = {"status": "finished", "metrics": {"test/acc1": 0.5}, "overrides": [f"pos={pos}"], "params": 1000}
        (d / "metrics.json").write_text(json.dumps({**record, "gflops": gflops, "epochs": 1}))
    SweepSummary().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}}))
    rows = list(csv.DictReader((sweep / "summary.csv").open()))
    assert [r["gflops"] for r in rows] == ["0.002329216", "0.003713664", ""]
    table = capsys.readouterr().out
    head = next(ln for ln in table.splitlines() if ln.startswith("job"))
    assert head.split()[:6] == ["job", "overrides", "test/acc1", "test/acc5", "test/loss", "val/acc1"]
    assert head.split()[6:8] == ["params", "gflops"]
    assert "0.002329" in table and "0.003714" in table
