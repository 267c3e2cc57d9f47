"""``module/mixup=naflex``: timm's ``NaFlexMixup`` on NaFlex batches (``data.packing``). The mixed batch is the one
timm's NaFlex loader would make, which mixes the images before cutting them into patches: the same images, pairs and
soft targets; each mixer refuses the other's batches."""

from __future__ import annotations

import functools
import math
import random

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from timm.data import Mixup
from timm.data.naflex_mixup import NaFlexMixup
from timm.data.naflex_transforms import Patchify
from timm.loss import SoftTargetCrossEntropy

import vitrel
from tests.train_helpers import FAST, compose
from vitrel.config import ConfigError
from vitrel.data.packing import PackingCollator
from vitrel.models.naflex import parse_naflex
from vitrel.train.mixing import MIXUP_NAFLEX, NAFLEX_MIXUP_IMAGES, mix_naflex
from vitrel.train.module import ClassifierModule
from vitrel.train.run import train

P = 4
SHORT = ["trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "test=false", "logger=none"]
TINY = ["model.embed_dim=32", "model.depth=1", "model.num_heads=2"]


def naflex_batch(mode: str, seed: int = 0, n: int = 7) -> tuple[dict, torch.Tensor, list[torch.Tensor]]:
    """A NaFlex batch of ``n`` random images of several sizes and aspect ratios (``P`` x ``P`` patches, as the
    data module makes them: timm's ``Patchify``, then vitrel's collator), its targets, and the images in its order."""
    g = torch.Generator().manual_seed(seed)
    images = [
        torch.randn(3, P * int(torch.randint(1, 5, (), generator=g)), P * int(torch.randint(1, 5, (), generator=g)),
                    generator=g, dtype=torch.float64)
        for _ in range(n)
    ]  # fmt: skip
    labels = torch.randint(0, 5, (n,), generator=g)
    x, y = PackingCollator(24, mode)([(Patchify(P)(img), labels[i]) for i, img in enumerate(images)])
    return x, y, [images[i] for i in x["image_index"].tolist()]


def seeded(seed: int) -> None:
    random.seed(seed)  # (NaFlexMixup's choice to mix, its pairing shuffle and CutMix box)
    torch.manual_seed(seed)  # (its lambda and its choice of CutMix)


@pytest.mark.parametrize("mode", ["pack", "pad"])
@pytest.mark.parametrize("alphas", [(0.8, 0.0), (0.0, 1.0)], ids=["mixup", "cutmix"])
def test_a_mixed_naflex_batch_is_timms_mix_of_its_images(mode, alphas):
    """The batch's images put back from the mixed patches are timm's NaFlexMixup of the images the batch was cut
    from, with its soft targets; the rows, segments, coordinates and padding are the batch's."""
    mixer = NaFlexMixup(num_classes=5, mixup_alpha=alphas[0], cutmix_alpha=alphas[1], label_smoothing=0.1)
    for seed in range(3):
        x, y, images = naflex_batch(mode, seed)
        seeded(seed)
        want, want_targets = mixer([img.clone() for img in images], y)
        seeded(seed)
        out, targets = mix_naflex(mixer, x, y, P)
        got = parse_naflex(out).images(P)
        assert len(got) == len(want) == len(images)
        assert any(not torch.equal(a, b) for a, b in zip(got, images, strict=True))  # (something was mixed)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(targets, torch.stack(want_targets), rtol=0, atol=0)
        assert set(out) == set(x)
        for k in set(x) - {"patches"}:
            assert out[k] is x[k], k
        padding = ~x["patch_valid"]
        assert torch.equal(out["patches"][padding], x["patches"][padding])


def test_mixed_pairs_match_their_targets():
    """Straight from the definition, on images each of one value: a mixed image holds its own value and its
    partner's, in the shares its target gives their labels (one label per image here)."""
    x, _, images = naflex_batch("pack", 1, n=6)
    x["patches"] = x["patches"].clone()
    values = torch.arange(1.0, 7.0, dtype=torch.float64)
    flat = parse_naflex(x)
    for i in range(6):  # image i filled with the value i + 1
        x["patches"][flat.image == i] = values[i]
    y = torch.arange(6)
    mixer = NaFlexMixup(num_classes=6, mixup_alpha=1.0, cutmix_alpha=0.0)
    seeded(0)
    out, targets = mix_naflex(mixer, x, y, P)
    for i, img in enumerate(parse_naflex(out).images(P)):
        share = targets[i]
        mean = float(img.mean())
        want = float((share.double() * values).sum())  # (the targets are float32)
        assert math.isclose(mean, want, rel_tol=1e-6), (i, mean, share)
        assert math.isclose(float(share.sum()), 1.0, rel_tol=1e-6)


def test_the_training_step_scores_the_mixed_batch_with_soft_targets():
    """The module's loss on a NaFlex batch under NaFlexMixup is timm's SoftTargetCrossEntropy of the model's logits
    on the mixed batch, as for timm's Mixup on image tensors."""
    torch.manual_seed(0)
    model = vitrel.create_model("vitrel_vit_tiny_patch4_32", pos="rope2d_mixed", embed_dim=32, depth=1, num_heads=2,
                                num_classes=5).double()  # fmt: skip
    mixer = functools.partial(NaFlexMixup, mixup_alpha=0.8, cutmix_alpha=1.0)
    module = ClassifierModule(model, num_classes=5, label_smoothing=0.1, mixup=mixer)
    x, y, _ = naflex_batch("pack", 2)
    for seed in range(3):
        seeded(seed)
        with pytest.warns(UserWarning, match="self.log"):  # (no trainer to log to)
            loss = module.training_step((x, y), 0)
        seeded(seed)
        mixed, target = mix_naflex(module.mixup_fn, x, y, P)
        want = SoftTargetCrossEntropy()(model(mixed).float(), target)
        torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)


def test_each_mixer_refuses_the_other_batches():
    model = vitrel.create_model("vitrel_vit_tiny_patch4_32", embed_dim=32, depth=1, num_heads=2, num_classes=5)
    x, y, _ = naflex_batch("pack")
    timm_mixup = ClassifierModule(model, num_classes=5, mixup=functools.partial(Mixup, mixup_alpha=0.8))
    with pytest.raises(ValueError, match=f"^{MIXUP_NAFLEX}$".replace("(", r"\(").replace(")", r"\)")):
        timm_mixup.training_step((x, y), 0)
    naflex = ClassifierModule(model, num_classes=5, mixup=functools.partial(NaFlexMixup))
    with pytest.raises(ValueError, match="^module/mixup=naflex"):
        naflex.training_step((torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])), 0)
    assert NAFLEX_MIXUP_IMAGES.endswith("take module/mixup=default (timm Mixup)")


class EnabledAtEachEpoch(Callback):
    """Records, at each epoch's first batch, whether the module's NaFlexMixup mixes."""

    seen: list[tuple[int, bool]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            type(self).seen.append((trainer.current_epoch, pl_module.mixup_fn.mixup_enabled))


def test_train_py_trains_naflex_batches_with_naflex_mixup_until_its_off_epoch(tmp_path):
    """``experiment=fmnist_naflex module/mixup=naflex``: a finite loss; ``module.mixup.mixup_off_epoch=1`` mixes in
    the first epoch only (timm's loader calls ``set_epoch`` each epoch; the module does)."""
    EnabledAtEachEpoch.seen = []
    callback = "+callbacks.enabled={_target_: tests.train.test_naflex_mixup.EnabledAtEachEpoch}"
    over = ["experiment=fmnist_naflex", "module/mixup=naflex", "module.mixup.mixup_off_epoch=1", *TINY, *FAST, *SHORT]
    metrics = train(compose(tmp_path, [*over, "trainer.max_epochs=2", callback]))
    assert math.isfinite(metrics["train/loss_epoch"])
    assert EnabledAtEachEpoch.seen == [(0, True), (1, False)]


@pytest.mark.parametrize(
    ("data", "mixup", "says"),
    [
        ("experiment=fmnist_naflex", "default", MIXUP_NAFLEX),
        ("data=fashion_mnist", "naflex", NAFLEX_MIXUP_IMAGES),
    ],
    ids=["naflex-batches-timm-mixup", "image-batches-naflex-mixup"],
)
def test_a_mixer_that_does_not_take_the_batches_is_refused_before_training(tmp_path, data, mixup, says):
    cfg = compose(tmp_path, [data, f"module/mixup={mixup}", *TINY, *FAST, *SHORT])
    with pytest.raises(ConfigError) as err:
        train(cfg)
    assert str(err.value) == says
    assert not (tmp_path / "checkpoints").exists()
