"""Parameter groups (timm's ``param_groups_weight_decay`` with vitrel's no-decay rules) and the warmup +
cosine schedule, also as the LightningModule builds them from the config's ``_partial_`` nodes."""

from __future__ import annotations

import functools
from pathlib import Path

import lightning as L
import pytest
import torch

import vitrel
from vitrel.config import ConfigError
from vitrel.train.module import ClassifierModule
from vitrel.train.optim import (
    EPS_IN_WEIGHT_DTYPE,
    FLOAT16_EPS,
    WarmupCosine,
    check_float16_eps,
    param_groups,
    warmup_cosine,
)

POS = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "conf" / "pos").glob("*.yaml"))


def _names(model, group) -> set[str]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)] for p in group["params"]}


def test_param_groups_skip_decay_for_tables_norms_biases():
    m = vitrel.create_model("vitrel_vit_tiny_patch4_32", pos="rel2d_full", depth=1, embed_dim=32, num_heads=2)
    groups = param_groups(m)
    assert len(groups) == 2 and "weight_decay" not in groups[0] and groups[1]["weight_decay"] == 0.0
    decay, no_decay = _names(m, groups[0]), _names(m, groups[1])
    assert "blocks.0.attn.pos.table" in no_decay and "cls_token" in no_decay
    assert "blocks.0.norm1.weight" in no_decay and "blocks.0.attn.qkv.bias" in no_decay
    assert "blocks.0.attn.qkv.weight" in decay and "head.weight" in decay
    assert decay | no_decay == {n for n, _ in m.named_parameters()} and not decay & no_decay
    opt = torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.05)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.0]  # the decay group takes the optimizer's


@pytest.mark.parametrize("arch", ["vit", "swin"])
@pytest.mark.parametrize("pos", POS)
def test_param_groups_are_the_vitrel_rule(arch, pos):
    """No decay exactly for ``ndim <= 1`` and the names ``model.no_weight_decay()`` returns (exact names)."""
    if arch == "vit":
        m = vitrel.create_model("vitrel_vit_tiny_patch4_32", pos=pos, depth=1, embed_dim=32, num_heads=2)
    else:
        kw = dict(embed_dim=16, depths=[1, 1], num_heads=[2, 2])
        m = vitrel.create_model("vitrel_swin_tiny_patch2_window4_32", pos=pos, **kw)
    nwd = m.no_weight_decay()
    names = [n for n, p in m.named_parameters() if p.requires_grad]
    assert set(nwd) <= set(names), "no_weight_decay() names parameters exactly"
    want_no = [n for n, p in m.named_parameters() if p.requires_grad and (p.ndim <= 1 or n in nwd)]
    want_decay = [n for n in names if n not in want_no]
    groups = param_groups(m)
    got = [sorted(_names(m, g)) for g in groups]
    assert got == [sorted(g) for g in (want_decay, want_no) if g]
    order = {id(p): i for i, (_, p) in enumerate(m.named_parameters())}
    for g in groups:  # each group in named_parameters() order (the optimizer state's layout)
        assert [order[id(p)] for p in g["params"]] == sorted(order[id(p)] for p in g["params"])


def test_warmup_cosine_schedule():
    s = WarmupCosine(total_steps=110, warmup_steps=10, lr=1e-3, min_lr=1e-5, warmup_lr=1e-6)
    assert s.lr_at(0) == pytest.approx(1e-6)
    assert s.lr_at(5) == pytest.approx(1e-6 + (1e-3 - 1e-6) * 0.5)
    assert s.lr_at(10) == pytest.approx(1e-3)
    assert s.lr_at(60) == pytest.approx(1e-5 + (1e-3 - 1e-5) * 0.5)
    assert s.lr_at(110) == pytest.approx(1e-5)
    assert s(60) == pytest.approx(s.lr_at(60) / 1e-3)
    with pytest.raises(ValueError, match="warmup_steps"):
        WarmupCosine(total_steps=5, warmup_steps=-1, lr=1e-3)
    longer = WarmupCosine(total_steps=5, warmup_steps=10, lr=1e-3)  # a run shorter than its warmup: the same ramp
    assert [longer.lr_at(k) for k in range(5)] == pytest.approx([1e-4 * k for k in range(5)])


@pytest.mark.parametrize(
    ("total", "warmup", "min_lr", "warmup_lr"), [(110, 10, 1e-5, 1e-6), (50, 0, 0.0, 0.0), (7, 3, 1e-2, 0.0)]
)
def test_warmup_cosine_is_timms_cosine_scheduler(total, warmup, min_lr, warmup_lr):
    """The schedule, stepped as Lightning steps it, is timm's ``CosineLRScheduler`` per update with the warmup before
    the cosine (``warmup_prefix=True``, ``t_initial = total - warmup``), float64 rates. Kept as vitrel's own for a torch
    ``LRScheduler`` (Lightning steps those; timm's need ``lr_scheduler_step`` overridden), ``LambdaLR``'s state dict
    in the checkpoints, and the resumed run's length (:class:`~vitrel.train.optim.WarmupCosineLR`)."""
    from timm.scheduler import CosineLRScheduler

    def optimizer():
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))], lr=0.5)

    ours_opt, timm_opt = optimizer(), optimizer()
    ours = warmup_cosine(ours_opt, total, warmup_steps=warmup, min_lr=min_lr, warmup_lr=warmup_lr)
    theirs = CosineLRScheduler(
        timm_opt, t_initial=total - warmup, lr_min=min_lr, warmup_t=warmup, warmup_lr_init=warmup_lr,
        warmup_prefix=True, t_in_epochs=False, cycle_limit=1,
    )  # fmt: skip
    for step in range(total + 3):
        theirs.step_update(num_updates=step)
        assert ours_opt.param_groups[0]["lr"] == pytest.approx(timm_opt.param_groups[0]["lr"], rel=1e-12, abs=1e-15)
        ours_opt.step(), ours.step()


def test_a_schedule_whose_ends_are_above_lr_is_refused():
    """``module.optimizer.lr=5e-6`` under the default ``min_lr=1e-5``: the "decay" would raise the rate from 5e-6 to
    1e-5 over the run (and a ``warmup_lr`` above ``lr`` would ramp it down); refused, naming the keys."""
    from vitrel.config import ConfigError

    with pytest.raises(ConfigError, match=r"min_lr=1e-05 is above lr=5e-06.*module\.scheduler\.min_lr"):
        WarmupCosine(total_steps=10, warmup_steps=2, lr=5e-6, min_lr=1e-5, warmup_lr=1e-6)
    with pytest.raises(ConfigError, match=r"warmup_lr=1e-06 is above lr=5e-07.*module\.scheduler\.warmup_lr"):
        WarmupCosine(total_steps=10, warmup_steps=2, lr=5e-7, min_lr=0.0, warmup_lr=1e-6)
    WarmupCosine(total_steps=10, warmup_steps=0, lr=5e-7, min_lr=0.0, warmup_lr=1e-6)  # no warmup: its rate unused
    flat = WarmupCosine(total_steps=10, warmup_steps=2, lr=1e-5, min_lr=1e-5, warmup_lr=1e-5)  # a constant rate
    assert {flat.lr_at(k) for k in range(11)} == {1e-5}


def test_train_refuses_a_rate_below_the_default_min_lr(tmp_path):
    from tests.train_helpers import FAST, TINY_VIT, compose
    from vitrel.config import ConfigError
    from vitrel.train.run import train

    run = [*TINY_VIT, *FAST, "logger=none", "trainer.max_steps=2", "module.optimizer.lr=5e-6"]
    with pytest.raises(ConfigError, match="module.scheduler.min_lr"):
        train(compose(tmp_path, run))


def test_a_run_at_lr_0_keeps_its_weights_and_a_negative_lr_is_one_config_error(tmp_path):
    """``module.optimizer.lr=0`` (how one checks a run's starting point; Lightning and timm take it) ended in a
    traceback, ``ValueError: lr must be > 0``. It now trains at rate 0 (with ``min_lr`` / ``warmup_lr`` at 0, which the
    refusal above asks for): after 1 step and after 3 the weights are the same. A negative rate is a ConfigError."""
    from tests.train_helpers import FAST, TINY_VIT, compose
    from vitrel.train.run import train

    zero = ["module.optimizer.lr=0", "module.scheduler.min_lr=0", "module.scheduler.warmup_lr=0"]
    weights = []
    for steps in (1, 3):
        run = [*TINY_VIT, *FAST, "logger=none", "test=false", f"trainer.max_steps={steps}", *zero]
        run += ["trainer.limit_val_batches=1"]
        train(compose(tmp_path / str(steps), run))
        weights.append(torch.load(tmp_path / str(steps) / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"])
    assert all(torch.equal(v, weights[1][k]) for k, v in weights[0].items() if k.startswith("model."))
    with pytest.raises(ConfigError, match=r"lr=-0.1 is negative: set module\.optimizer\.lr >= 0"):
        WarmupCosine(total_steps=10, warmup_steps=2, lr=-0.1)


def test_warmup_cosine_scheduler_factory():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=2e-3)
    sched = warmup_cosine(opt, total_steps=40, steps_per_epoch=8, warmup_epochs=0.5, min_lr=1e-5, warmup_lr=0.0)
    lam = sched.lr_lambdas[0]
    assert isinstance(lam, WarmupCosine) and (lam.total_steps, lam.warmup_steps, lam.lr) == (40, 4, 2e-3)
    assert opt.param_groups[0]["lr"] == 0.0
    lrs = []
    for _ in range(40):
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs[3] == pytest.approx(2e-3) and lrs[-1] == pytest.approx(1e-5)
    assert warmup_cosine(opt, total_steps=40, warmup_steps=7, warmup_epochs=3).lr_lambdas[0].warmup_steps == 7


def _fit(module: ClassifierModule, steps_per_epoch: int = 5, epochs: int = 2) -> L.Trainer:
    x, y = torch.randn(steps_per_epoch * 4, 1, 8, 8), torch.randint(0, 3, (steps_per_epoch * 4,))
    dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    trainer = L.Trainer(
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    trainer.fit(module, dl)
    return trainer


def test_module_builds_optimizer_and_schedule_from_partials():
    model = vitrel.create_model(
        "vitrel_vit_tiny_patch4_32", pos="rel2d_factored", img_size=8, in_chans=1, num_classes=3, depth=1,
        embed_dim=16, num_heads=2,
    )  # fmt: skip
    module = ClassifierModule(
        model,
        functools.partial(torch.optim.AdamW, lr=4e-3, weight_decay=0.1, betas=(0.8, 0.9)),
        functools.partial(warmup_cosine, warmup_epochs=1.0, min_lr=1e-4),
    )
    assert module.num_classes == 3  # from the model
    trainer = _fit(module)
    opt = trainer.optimizers[0]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0] and opt.defaults["betas"] == (0.8, 0.9)
    sched = trainer.lr_scheduler_configs[0]
    lam = sched.scheduler.lr_lambdas[0]
    assert sched.interval == "step" and (lam.total_steps, lam.warmup_steps, lam.lr) == (10, 5, 4e-3)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-4)  # the end of the cosine


def test_module_without_scheduler_keeps_the_rate():
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 3))
    module = ClassifierModule(model, functools.partial(torch.optim.SGD, lr=0.1), num_classes=3)
    trainer = _fit(module, epochs=1)
    assert trainer.optimizers[0].param_groups[0]["lr"] == 0.1 and not trainer.lr_scheduler_configs


def _swin_v2_authors_no_decay(model, skip_keywords) -> set[str]:
    """microsoft/Swin-Transformer ``optimizer.py`` ``set_weight_decay``, as written there: no decay for 1-D
    parameters, ``.bias`` names and names containing one of ``skip_keywords`` (``SwinTransformerV2``'s
    ``no_weight_decay_keywords()``: ``cpb_mlp``, ``logit_scale``, ``relative_position_bias_table``)."""
    return {
        n
        for n, p in model.named_parameters()
        if len(p.shape) == 1 or n.endswith(".bias") or any(k in n for k in skip_keywords)
    }


@pytest.mark.parametrize("arch", ["vit", "swin"])
def test_rel2d_cpb_mlp_gets_no_weight_decay_as_the_swin_v2_authors(arch):
    """The Swin V2 authors' training code exempts the CPB MLP (``cpb_mlp``) from weight decay by keyword; vitrel's
    ``rel2d_cpb`` is its ``pos.mlp``. ``mlp_weight_decay: true`` decays its weight matrices (before format 8)."""
    kw = (
        dict(depth=1, embed_dim=32, num_heads=2)
        if arch == "vit"
        else dict(embed_dim=16, depths=[1, 1], num_heads=[2, 2])
    )
    name = "vitrel_vit_tiny_patch4_32" if arch == "vit" else "vitrel_swin_tiny_patch2_window4_32"
    m = vitrel.create_model(name, pos="rel2d_cpb", **kw)
    groups = param_groups(m)
    no_decay = _names(m, groups[1])
    assert no_decay == _swin_v2_authors_no_decay(m, ("pos.mlp", "cls_token"))
    assert any(n.endswith("pos.mlp.0.weight") for n in no_decay) and any(
        n.endswith("pos.mlp.2.weight") for n in no_decay
    )
    old = vitrel.create_model(name, pos={"name": "rel2d_cpb", "mlp_weight_decay": True}, **kw)
    decay_old = _names(old, param_groups(old)[0])
    assert {n for n in decay_old if ".pos.mlp." in n} == {
        n for n, p in old.named_parameters() if ".pos.mlp." in n and p.ndim == 2
    }
    with pytest.raises(ValueError, match="mlp_weight_decay must be true or false"):
        vitrel.create_model(name, pos={"name": "rel2d_cpb", "mlp_weight_decay": "no"}, **kw)


def test_timm_swin_v2_exempts_its_cpb_mlp_too():
    """What vitrel follows: timm's SwinTransformerV2 with timm's ``param_groups_weight_decay`` leaves every
    ``cpb_mlp`` parameter undecayed."""
    import timm
    from timm.optim import param_groups_weight_decay

    t = timm.create_model(
        "swinv2_tiny_window8_256",
        img_size=32,
        patch_size=2,
        window_size=4,
        embed_dim=16,
        depths=(1, 1),
        num_heads=(2, 2),
    )
    groups = param_groups_weight_decay(t, weight_decay=1.0, no_weight_decay_list=t.no_weight_decay())
    decayed = {n for g in groups if g["weight_decay"] for n in _names(t, g)}
    cpb = {n for n, _ in t.named_parameters() if "cpb_mlp" in n}
    assert cpb and not cpb & decayed


def test_a_rel2d_cpb_checkpoint_of_format_7_keeps_its_weight_decay(tmp_path):
    """A stored ``rel2d_cpb`` spec of format 7 (its MLP weight-decayed) loads with ``mlp_weight_decay: true``; a
    resume under today's default is refused naming the override that resumes it."""
    from tests.weights import reloaded_as_written
    from vitrel.models.checkpoint import CheckpointError
    from vitrel.train.resume import check_same_model

    model = vitrel.create_model("vitrel_vit_tiny_patch4_32", pos="rel2d_cpb", depth=1).eval()
    back = reloaded_as_written(model, tmp_path / "old.ckpt", vitrel_format=7, pos={"name": "rel2d_cpb"})
    assert back.vitrel_cfg["pos"]["mlp_weight_decay"] is True
    assert not any(".pos.mlp." in n for n in back.no_weight_decay())
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(back(x), model(x), rtol=0, atol=0)
    ckpt = torch.load(tmp_path / "old.ckpt", weights_only=True)
    with pytest.raises(CheckpointError, match=r"(?s)pos.mlp_weight_decay: checkpoint True.*pos.mlp_weight_decay=true"):
        check_same_model(ckpt, model, "old.ckpt")
    check_same_model(ckpt, back, "old.ckpt")


def _float16_steps(cls: type, steps: int = 10, **kw) -> torch.Tensor:
    """A float16 weight after ``steps`` of ``cls`` (lr 1e-3) on fixed gradients of scale 3e-3, one of them 0."""
    g = torch.randn(16, 16, generator=torch.Generator().manual_seed(0)) * 3e-3
    g[0, 0] = 0.0
    p = torch.nn.Parameter(torch.full((16, 16), 0.05, dtype=torch.float16))
    opt = cls([p], lr=1e-3, **kw)
    for _ in range(steps):
        p.grad = g.half()
        opt.step()
    return p.detach()


@pytest.mark.parametrize("cls", EPS_IN_WEIGHT_DTYPE, ids=lambda c: f"{c.__module__}.{c.__name__}")
def test_adam_type_optimizers_on_float16_weights_need_an_eps_float16_holds(cls):
    """Each optimizer the check knows: at its default eps (1e-8 to 1e-15, 0 in float16) its float16 weight turns inf or
    NaN within 10 steps (the square of a gradient below 5e-3 underflows, m / (0 + 0)), and it is refused before a
    step; at the suggested eps it stays finite and passes."""
    assert not torch.isfinite(_float16_steps(cls)).all()
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))
    with pytest.raises(ConfigError, match=r"eps=1e-\d+ rounds to 0 in float16.*module\.optimizer\.eps=0\.0001"):
        check_float16_eps(cls([p]))
    assert torch.isfinite(_float16_steps(cls, eps=FLOAT16_EPS)).all()
    check_float16_eps(cls([p], eps=FLOAT16_EPS))
    check_float16_eps(cls([torch.nn.Parameter(torch.zeros(2))]))  # float32 weights (16-mixed): the default is fine


@pytest.mark.parametrize("name", ["Lamb", "Lars", "Adafactor", "SGDP", "NvNovoGrad"])
def test_optimizers_that_step_in_float32_are_not_refused(name):
    """timm optimizers whose float16 step stays finite at their default eps (0 in float16 or not): not refused."""
    import timm.optim

    cls = getattr(timm.optim, name)
    assert torch.isfinite(_float16_steps(cls)).all()
    check_float16_eps(cls([torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))], lr=1e-3))
