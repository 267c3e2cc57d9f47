"""``module=probe_grid`` (vitrel/train/probe_grid.py): many probes on one frozen backbone. A probe's logits are the
model's through its own head; a grid of two probes trains each exactly as a probe trained alone at its settings
(``module.freeze_backbone=true``, the same steps); ``train.py module=probe_grid`` picks the best probe on val, and
the checkpoint's model holds it: ``load_model``'s head is that probe's, ``eval.py`` scores it as the run's val did."""

from __future__ import annotations

import csv
import functools
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import vitrel
from tests.train.test_video_predict import TINY, class_videos
from tests.train_helpers import compose
from vitrel.config import ConfigError
from vitrel.train.evaluate import evaluate
from vitrel.train.module import ClassifierModule
from vitrel.train.probe_grid import ProbeGridModule, check_probes
from vitrel.train.run import train

TWO = [{"lr": 0.05, "weight_decay": 0.0}, {"lr": 0.01, "weight_decay": 0.0}]


def _vit(pool: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return vitrel.create_model(
        "vitrel_vit_tiny_patch4_32", num_classes=3, embed_dim=16, depth=1, num_heads=2, global_pool=pool,
        class_token=pool == "token", drop_path_rate=0.2,
    )  # fmt: skip


def _fit(module: L.LightningModule, steps: int = 4) -> None:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 3, 32, 32, generator=g), torch.randint(3, (16,), generator=g))
    trainer = L.Trainer(
        max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=1, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(module, DataLoader(data, batch_size=4), DataLoader(data, batch_size=4))  # (val: at the end)


@pytest.mark.parametrize("pool", ["map", "token"])
def test_each_probe_trains_as_a_probe_trained_alone(pool):
    """Probe ``i`` of a grid, after 4 AdamW steps, equals bit for bit the head of the same model probed alone at
    probe ``i``'s learning rate (``freeze_backbone``); the backbone does not move; at the start a probe's logits are
    the model's. (A validation at the end: a fit of the grid must validate.)"""
    grid = ProbeGridModule(_vit(pool), functools.partial(torch.optim.AdamW, lr=1.0), probes=TWO,
                           data_config={"input_size": [3, 32, 32]})  # fmt: skip
    x = torch.randn(2, 3, 32, 32)
    grid.model.eval()
    torch.testing.assert_close(grid.probe_logits(grid.model.forward_features(x), 1), grid.model(x), rtol=0, atol=0)
    backbone = {k: v.clone() for k, v in grid.model.state_dict().items()}
    _fit(grid)
    for i, setting in enumerate(TWO):
        alone = ClassifierModule(
            _vit(pool), functools.partial(torch.optim.AdamW, **setting), freeze_backbone=True,
            data_config={"input_size": [3, 32, 32]},
        )  # fmt: skip
        _fit(alone)
        head = {k: v for k, v in alone.model.named_parameters() if v.requires_grad}
        assert head and set(head) == set(grid.probes[i].by_name())
        for name, p in grid.probes[i].by_name().items():
            assert torch.equal(p, head[name]), (i, name)
    in_head = grid.probes[0].by_name()  # (val copied the best probe there)
    assert all(torch.equal(v, backbone[k]) for k, v in grid.model.state_dict().items() if k not in in_head)


def test_validation_copies_the_best_probe_into_the_models_head():
    """Three probes whose heads answer class 0, class 2 and class 2 (their biases), on images all of class 2: val
    scores each (0, 1, 1), picks probe 1 (the first of the tie), logs its top-1 and loss, and the model's head is
    then probe 1's weights."""
    grid = ProbeGridModule(_vit("map"), probes=[*TWO, TWO[0]], data_config={"input_size": [3, 32, 32]})
    with torch.no_grad():
        for i, cls in enumerate((0, 2, 2)):
            bias = grid.probes[i].weights["head__bias"]
            bias.zero_()[cls] = 50.0
    data = TensorDataset(torch.randn(6, 3, 32, 32), torch.full((6,), 2))
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    (res,) = trainer.validate(grid, DataLoader(data, batch_size=4), verbose=False)
    assert (res["val/best_probe"], res["val/acc1"], res["val/probe_acc1/0"], res["val/probe_acc1/2"]) == (1, 1, 0, 1)
    assert res["val/loss"] < 1e-6
    own = dict(grid.model.named_parameters())
    assert all(torch.equal(own[k], v) for k, v in grid.probes[1].by_name().items())


def test_refusals_name_the_setting():
    with pytest.raises(ValueError, match=r"does not take module.ema \(module/ema=null\), module.compile"):
        ProbeGridModule(_vit("map"), probes=TWO, ema=lambda m: m, compile=True)
    with pytest.raises(ValueError, match="does not take module.freeze_backbone=false"):
        ProbeGridModule(_vit("map"), probes=TWO, freeze_backbone=False)
    grid = ProbeGridModule(_vit("map"), probes=TWO, data_config={"input_size": [3, 32, 32]})
    for val, every in ((0, 1), (1.0, 5)):  # (no batch of val; a validation after the last epoch only)
        grid._trainer = SimpleNamespace(limit_val_batches=val, check_val_every_n_epoch=every, max_epochs=3)
        with pytest.raises(ConfigError, match="chooses its probe on val, which this fit never runs"):
            grid.setup("fit")
    with pytest.raises(ValueError, match="module.probes must be a non-empty list"):
        check_probes([])
    with pytest.raises(ValueError, match=r"module.probes\[1\] must be \{lr: <rate>, weight_decay: <decay>\}"):
        check_probes([TWO[0], {"lr": 0.1}])
    with pytest.raises(ValueError, match=r"module.probes\[0\]: lr must be > 0"):
        check_probes([{"lr": 0.0, "weight_decay": 0.1}])


def test_train_py_keeps_the_best_probe_in_the_checkpoints_model(tmp_path):
    """``train.py module=probe_grid`` with two probes, on video clips of 2 evaluation views, every val batch scored:
    ``val/best_probe`` is the first probe of the highest ``val/probe_acc1/<i>``; the checkpoint's ``model.*`` head is
    its weights (``probes.*`` keeps both, trained apart); ``load_model`` gives that head; ``eval.py`` on the checkpoint
    scores ``val/acc1`` and ``val/loss`` as the run's last validation did."""
    pytest.importorskip("av", reason="PyAV not installed: pip install -e '.[video]'")
    root = class_videos(tmp_path / "videos", lambda c, k: 6 + 8 * k + 2 * c)
    probes = "[{lr:0.05,weight_decay:0.0},{lr:1.0e-9,weight_decay:0.0}]"
    over = [*TINY, f"data.root={root}", "data.clips_per_video=2", "module=probe_grid", f"module.probes={probes}"]
    over += ["trainer.max_epochs=3", "trainer.limit_val_batches=1.0", "model.global_pool=map"]
    metrics = train(compose(tmp_path / "run", over))
    accs = [metrics["val/probe_acc1/0"], metrics["val/probe_acc1/1"]]
    best = int(metrics["val/best_probe"])
    assert best == accs.index(max(accs)) and metrics["val/acc1"] == max(accs)
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    state = torch.load(ckpt, weights_only=True)
    assert state["hyper_parameters"]["probes"] == [{"lr": 0.05, "weight_decay": 0.0}, {"lr": 1e-9, "weight_decay": 0.0}]
    sd = state["state_dict"]
    chosen = {k.split("weights.", 1)[1].replace("__", "."): v for k, v in sd.items() if k.startswith(f"probes.{best}.")}
    assert chosen and all(torch.equal(sd[f"model.{k}"], v) for k, v in chosen.items())
    assert not all(torch.equal(sd[f"probes.{1 - best}.weights.{k.replace('.', '__')}"], v) for k, v in chosen.items())
    m = vitrel.load_model(ckpt)
    assert all(torch.equal(m.state_dict()[k], v) for k, v in chosen.items())
    over = [f"ckpt_path={ckpt}", "data=video_folder", f"data.root={root}", "data.num_workers=0", "split=val"]
    over += ["data.pin_memory=false", "progress_bar=none", "trainer.accelerator=cpu"]
    scored = evaluate(compose(tmp_path / "eval", over, config_name="eval"))
    assert scored["val/acc1"] == pytest.approx(metrics["val/acc1"], abs=1e-6)
    assert scored["val/loss"] == pytest.approx(metrics["val/loss"], rel=1e-5)
    with open(tmp_path / "run" / "probes.csv", newline="") as f:  # (callbacks.probe_table: the run folder's table)
        rows = list(csv.DictReader(f))
    assert [(r["lr"], r["chosen"]) for r in rows] == [("0.05", str(best == 0)), ("1e-09", str(best == 1))]
    assert [float(r["val_acc1"]) for r in rows] == pytest.approx(accs) and (tmp_path / "run" / "probes.png").is_file()


def test_a_grid_killed_mid_epoch_resumes_bit_for_bit(tmp_path):
    """A probe grid on a train.py checkpoint, SIGTERM in epoch 1's second step (after epoch 0's validation chose a
    probe), then the same command again (it resumes): every tensor of the checkpoint (the model with the chosen
    probe's head, each probe's weights) and each probe's optimizer state equal an uninterrupted run's bit for bit."""
    from tests.train_helpers import FAST, TINY_VIT, straight_and_resumed

    src = tmp_path / "src"
    short = ["trainer.limit_train_batches=3", "trainer.limit_val_batches=1", "test=false", "logger=none"]
    train(compose(src, [*TINY_VIT, *FAST, *short, "trainer.max_epochs=1"]))
    probes = "[{lr:0.05,weight_decay:0.1},{lr:0.001,weight_decay:0.0}]"
    over = ["model=from_checkpoint", f"model.path={src / 'checkpoints' / 'last.ckpt'}", "+model.drop_path_rate=0.2"]
    over += ["module=probe_grid", f"module.probes={probes}", "step=eager", *FAST, *short, "trainer.max_epochs=2"]
    a, b = straight_and_resumed([*over, "callbacks.model_checkpoint=null"], tmp_path, at_step=4)
    assert a["state_dict"].keys() == b["state_dict"].keys() and any(k.startswith("probes.1.") for k in a["state_dict"])
    assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])
    (oa,), (ob,) = a["optimizer_states"], b["optimizer_states"]
    assert len(oa["param_groups"]) == len(ob["param_groups"]) >= 2
    assert [g["lr"] for g in oa["param_groups"]] == [g["lr"] for g in ob["param_groups"]]
    for i, s in oa["state"].items():
        assert all(torch.equal(v, ob["state"][i][k]) for k, v in s.items())
