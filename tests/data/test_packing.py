"""vitrel.data.packing: the packing collator's invariants, timm's NaFlex per-image dicts, the DataModule's NaFlex
batches, the LightningModule on them (a stand-in model pooling per image), and the errors."""

from __future__ import annotations

import functools

import lightning as L
import pytest
import torch
from timm.data import Mixup
from timm.data.naflex_transforms import Patchify
from torch import nn

from vitrel.data import FashionMNISTDataModule
from vitrel.data.packing import PackingCollator, PackingError, first_fit, naflex_transform, parse_packing
from vitrel.models.naflex import parse_naflex
from vitrel.train.module import ClassifierModule

P, C = 4, 1


def random_images(n: int, seed: int, max_side: int = 12) -> list[torch.Tensor]:
    """``n`` images ``[C, h*P, w*P]`` of random grids (1..max_side patches a side), values unique per image."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        h, w = (int(v) for v in torch.randint(1, max_side + 1, (2,), generator=g))
        out.append(torch.rand(C, h * P, w * P, generator=g) + 10 * i)
    return out


def samples(images: list[torch.Tensor]) -> list[tuple[dict, int]]:
    """timm's Patchify output per image, as is, with a label."""
    patchify = Patchify(P)
    return [(patchify(img), i % 10) for i, img in enumerate(images)]


# ------------------------------------------------------------------------------------------ collator invariants
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("decreasing", [False, True])
def test_packing_invariants(seed, decreasing):
    """Every image exactly once with its own tokens, no row over seq_len, each row's segments 0, 1, ... contiguous
    with the padding at the end, targets in row-major image order, padding fraction = padding slots / all slots."""
    images = random_images(40, seed)
    batch = samples(images)
    seq_len = 150
    out, targets = PackingCollator(seq_len, "pack", decreasing=decreasing)(batch)
    patches, coord, valid, seg = out["patches"], out["patch_coord"], out["patch_valid"], out["segment_ids"]
    rows = patches.shape[0]
    assert patches.shape[1] == seq_len and valid.sum(1).max() <= seq_len
    order = out["image_index"].tolist()
    assert sorted(order) == list(range(len(images)))  # every image exactly once
    k = 0
    for r in range(rows):
        n = int(valid[r].sum())
        assert valid[r, :n].all() and not valid[r, n:].any()  # padding at the end
        s = seg[r, :n]
        assert int(s[0]) == 0
        steps = s[1:] - s[:-1]
        assert ((steps == 0) | (steps == 1)).all()  # contiguous, numbered 0, 1, ... in order
        for j in range(int(s[-1]) + 1):
            i = order[k]
            mine = s == j
            ref = batch[i][0]
            assert torch.equal(patches[r, :n][mine], ref["patches"])  # the image's own tokens, in order
            assert torch.equal(coord[r, :n][mine], ref["patch_coord"])
            assert int(targets[k]) == batch[i][1]
            k += 1
    assert k == len(images)
    tokens = sum(b[0]["patches"].shape[0] for b in batch)
    assert float(out["padding_fraction"]) == pytest.approx(1 - tokens / (rows * seq_len))
    assert out["seq_len"] == seq_len


@pytest.mark.parametrize("seed", range(4))
def test_first_fit_is_first_fit(seed):
    """Each item in the first row that had room when it came; rows never over seq_len."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 50, (60,), generator=g).tolist()
    rows = first_fit(lengths, 64)
    where = {i: r for r, row in enumerate(rows) for i in row}
    assert sorted(where) == list(range(60))
    used = [0] * len(rows)
    for i, n in enumerate(lengths):
        first = next(r for r in range(len(rows)) if used[r] + n <= 64)
        assert where[i] == first
        used[first] += n
    assert max(used) <= 64
    assert first_fit([5, 4, 3, 2], 8) == [[0, 2], [1, 3]]


def test_pad_mode_one_image_per_row():
    batch = samples(random_images(7, 0, max_side=6))
    out, targets = PackingCollator(36, "pad")(batch)
    assert "segment_ids" not in out and out["patches"].shape[:2] == (7, 36)
    assert out["image_index"].tolist() == list(range(7))
    assert out["patch_valid"].sum(1).tolist() == [b[0]["patches"].shape[0] for b in batch]
    assert targets.tolist() == [b[1] for b in batch]


def test_timm_patchify_dicts_accepted_as_is():
    """timm's Patchify output goes in unchanged, and the packed batch passes the models' own check
    (``parse_naflex``) with each image's grid, in the targets' order."""
    images = random_images(25, 3, max_side=8)
    batch = samples(images)
    out, targets = PackingCollator(100)(batch)
    parsed = parse_naflex(out, patch_dim=P * P * C)
    grids = [(g.h, g.w) for g in parsed.image_grids]
    want = [(images[i].shape[1] // P, images[i].shape[2] // P) for i in out["image_index"].tolist()]
    assert grids == want and parsed.num_images == len(targets) == 25
    # timm's own naflex transform chain (ResizeToSequence + Patchify) from PIL images
    from torchvision.transforms.functional import to_pil_image

    tf = naflex_transform(train=False, patch_size=P, max_tokens=49, mean=(0.5,), std=(0.5,))
    pil = [to_pil_image(torch.rand(1, h, w)) for h, w in [(28, 28), (20, 36), (40, 12)]]
    out, _ = PackingCollator(100)([(tf(im), 0) for im in pil])
    sizes = [(g.h, g.w) for g in parse_naflex(out).image_grids]
    assert sizes[0] == (7, 7) and all(h * w <= 49 for h, w in sizes)


def test_naflex_training_transform_applies_timm_augment_kwargs():
    """data.augment_kwargs beyond scale / ratio / hflip (color_jitter, re_prob, ...) are applied as timm's NaFlex
    training pipeline applies them, not dropped; with none of them the images are exactly those of the crop alone;
    an option the NaFlex transforms do not take is an error naming it, before any image is read."""
    import random

    from torchvision.transforms.functional import to_pil_image

    pil = to_pil_image(torch.rand(1, 20, 36))
    base = dict(train=True, patch_size=P, max_tokens=49, mean=(0.5,), std=(0.5,), augment=True, size_scale=(0.5, 1.0))

    def draw(**kw) -> list[dict]:
        tf, out = naflex_transform(**base, **kw), []
        for seed in range(4):  # the same crop for each seed (the crop draws first)
            random.seed(seed)
            torch.manual_seed(seed)
            out.append(tf(pil))
        return out

    plain = draw()
    for kw in ({"color_jitter": 0.0}, {"re_prob": 0.0}):  # timm's "off" values: the very same images
        assert all(torch.equal(a["patches"], b["patches"]) for a, b in zip(plain, draw(**kw)))
    for kw in ({"color_jitter": 0.8}, {"re_prob": 1.0}, {"vflip": 1.0}):
        other = draw(**kw)
        assert [a["patch_coord"].tolist() for a in plain] == [b["patch_coord"].tolist() for b in other]  # same crops
        assert not any(torch.equal(a["patches"], b["patches"]) for a, b in zip(plain, other)), kw
    with pytest.raises(ValueError, match=r"data.augment_kwargs \['crop_pct'\] are not options of the NaFlex"):
        naflex_transform(**base, crop_pct=0.9)
    evaluation = naflex_transform(**{**base, "train": False}, color_jitter=0.8)  # evaluation: no augmentation
    assert torch.equal(evaluation(pil)["patches"], naflex_transform(**{**base, "train": False})(pil)["patches"])


# ------------------------------------------------------------------------------------------ errors
def test_image_longer_than_seq_len_is_a_clear_error():
    batch = samples([torch.rand(C, 8 * P, 8 * P), torch.rand(C, 2 * P, 2 * P)])
    for mode in ("pack", "pad"):
        with pytest.raises(PackingError, match=r"image 0 has 64 patch tokens, more than data.seq_len=50"):
            PackingCollator(50, mode)(batch)


def test_bad_samples_are_clear_errors():
    good = samples([torch.rand(C, 8, 8)])[0]
    with pytest.raises(PackingError, match="NaFlex per-image dict"):
        PackingCollator(10)([(torch.rand(C, 8, 8), 0)])
    with pytest.raises(PackingError, match="no valid patch tokens"):
        empty = {"patches": torch.zeros(0, P * P * C), "patch_coord": torch.zeros(0, 2, dtype=torch.long)}
        PackingCollator(10)([good, (empty, 1)])
    with pytest.raises(PackingError, match="one patch size per batch"):
        PackingCollator(10)([good, (Patchify(2)(torch.rand(C, 4, 4)), 1)])
    with pytest.raises(PackingError, match="empty batch"):
        PackingCollator(10)([])
    with pytest.raises(ValueError, match="mode must be one of"):
        PackingCollator(10, "squeeze")
    with pytest.raises(ValueError, match="data.packing must be"):
        parse_packing("squeeze")
    assert parse_packing(True) == "pack" and parse_packing(False) is None and parse_packing("pad") == "pad"


def dm(**kw) -> FashionMNISTDataModule:
    base = dict(packing="pack", seq_len=128, patch_size=P, loader="workers", num_workers=0, batch_size=32, seed=0)
    return FashionMNISTDataModule(**{**base, **kw})


def test_datamodule_packing_errors():
    with pytest.raises(ValueError, match="needs data.seq_len"):
        dm(seq_len=None)
    with pytest.raises(ValueError, match=r"data.max_tokens=200 .* data.seq_len=128"):
        dm(max_tokens=200)
    with pytest.raises(ValueError, match="use data.loader=workers"):
        dm(loader="memory")
    with pytest.raises(ValueError, match="size_scale"):
        dm(size_scale=[0.5, 2.0])


def test_datamodule_passes_timms_augment_options_to_the_naflex_transforms():
    """``data.augment_kwargs`` beyond scale / ratio / hflip reach the NaFlex training transforms of the data module
    (``+data.augment_kwargs.re_prob=1`` erases, as on the image path), and one they do not take is refused naming
    it; the data set's own defaults (Fashion-MNIST's ``color_jitter: 0.0``) pass."""
    import random

    img, _ = dm().raw_dataset("train")[0]

    def patches(d: FashionMNISTDataModule) -> torch.Tensor:
        random.seed(0)
        torch.manual_seed(0)
        return d.naflex_transform(train=True)(img)["patches"]

    plain, erased = patches(dm(augment=True)), patches(dm(augment=True, augment_kwargs={"re_prob": 1.0}))
    assert plain.shape == erased.shape and not torch.equal(plain, erased)
    assert torch.equal(plain, patches(dm(augment=True, augment_kwargs={"re_prob": 0.0})))
    with pytest.raises(ValueError, match=r"data.augment_kwargs \['crop_pct'\] are not options"):
        dm(augment=True, augment_kwargs={"crop_pct": 0.9}).naflex_transform(train=True)


# ------------------------------------------------------------------------------------------ DataModule
def test_datamodule_naflex_batches():
    """Training: mixed sizes (random per-image scale within the budget) packed into rows; evaluation: every
    Fashion-MNIST image at its native 28x28 (a 7x7 grid), two per 128-token row."""
    d = dm(max_tokens=64, size_scale=[0.3, 1.0])
    d.setup("fit")
    x, y = next(iter(d.train_dataloader()))
    parsed = parse_naflex(x, patch_dim=P * P * C)
    assert len(y) == parsed.num_images == 32
    assert len({(g.h, g.w) for g in parsed.image_grids}) > 3  # mixed sizes
    assert all(g.h * g.w <= 64 for g in parsed.image_grids)
    assert x["patches"].shape[0] < 32  # several images per row
    assert 0 <= float(x["padding_fraction"]) < 1
    xv, yv = next(iter(d.val_dataloader()))
    grids = {(g.h, g.w) for g in parse_naflex(xv).image_grids}
    assert grids == {(7, 7)} and xv["patches"].shape[0] == 16 and len(yv) == 32
    assert float(xv["padding_fraction"]) == pytest.approx(1 - 98 / 128)


# ------------------------------------------------------------------------------------------ LightningModule
class PoolPerImage(nn.Module):
    """Stand-in model: a linear map of each patch, averaged per image (row-major over rows, then segments)."""

    num_classes = 10

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(P * P * C, self.num_classes)

    def forward(self, x):
        b = parse_naflex(x)
        t = self.head(b.patches)
        keep = b.image >= 0
        out = t.new_zeros(b.num_images, self.num_classes).index_add_(0, b.image[keep], t[keep])
        return out / torch.bincount(b.image[keep], minlength=b.num_images)[:, None]


def test_module_trains_and_tests_on_packed_batches():
    """fit + test on NaFlex batches: the loss is the mean over images, metrics count images, the padding logged."""
    d = dm(max_tokens=64, size_scale=[0.3, 1.0])
    module = ClassifierModule(PoolPerImage())
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=1, limit_train_batches=3, limit_val_batches=2, limit_test_batches=2, logger=False,
        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, datamodule=d)
    m = trainer.callback_metrics
    assert {"train/loss", "train/padding", "val/acc1", "val/loss"} <= set(m)
    assert 0 <= float(m["train/padding"]) < 1
    res = trainer.test(module, datamodule=d, verbose=False)[0]
    assert 0 <= res["test/acc1"] <= 1
    # a packed batch counts its images (not its rows) in the epoch's loss
    x, y = next(iter(d.train_dataloader()))
    assert x["patches"].shape[0] < len(y)
    fresh = ClassifierModule(PoolPerImage())  # no trainer: self.log does nothing
    weights = []
    fresh.train_loss.update = lambda value, weight: weights.append(weight)
    fresh.training_step((x, y), 0)
    assert weights == [len(y)]


def test_module_mixup_with_naflex_is_a_clear_error():
    module = ClassifierModule(PoolPerImage(), mixup=functools.partial(Mixup, mixup_alpha=0.8))
    x, y = PackingCollator(64)(samples(random_images(4, 0, max_side=4)))
    with pytest.raises(ValueError, match=r"use module/mixup=naflex \(timm NaFlexMixup\), or module.mixup=null"):
        module.training_step((x, y), 0)


def test_module_wrong_logit_count_is_a_clear_error():
    """A model that returns one row per packed row (not per image) is caught."""

    class PerRow(PoolPerImage):
        def forward(self, x):
            return self.head(x["patches"]).mean(1)

    module = ClassifierModule(PerRow())
    x, y = PackingCollator(64)(samples(random_images(6, 0, max_side=4)))
    with pytest.raises(ValueError, match="one row per image"):
        module.validation_step((x, y), 0)


# ------------------------------------------------------------------------------------------ the recipe, end to end
def test_recipe_fmnist_naflex_trains_and_evaluates_at_native_sizes(tmp_path):
    """``python train.py experiment=fmnist_naflex`` (a tiny model, a few steps, token dropping on) with the real
    ViT on packed batches; then ``eval.py data=fashion_mnist_naflex`` scores the checkpoint at native sizes."""
    import json
    import math

    from tests.train_helpers import FAST, TINY_VIT, compose
    from vitrel.train.evaluate import evaluate
    from vitrel.train.run import train

    run = tmp_path / "run"
    short = ["trainer.max_epochs=1", "trainer.limit_train_batches=3", "trainer.limit_val_batches=2"]
    short += ["trainer.limit_test_batches=2", "logger=csv", "model.token_drop=[0.0,0.3]"]
    cfg = compose(run, ["experiment=fmnist_naflex", *TINY_VIT, *FAST, *short])
    assert cfg.data.packing == "pack" and cfg.data.seq_len == 128 and cfg.model.token_drop == [0.0, 0.3]
    metrics = train(cfg)
    assert {"test/acc1", "val/acc1", "train/loss_epoch", "train/padding_epoch"} <= set(metrics)
    assert all(math.isfinite(v) for v in metrics.values()) and 0 <= metrics["train/padding_epoch"] < 1
    assert json.loads((run / "metrics.json").read_text())["global_step"] == 3
    ckpt = run / "checkpoints" / "last.ckpt"
    out = tmp_path / "eval"
    over = [f"ckpt_path={ckpt}", "data=fashion_mnist_naflex", "trainer.accelerator=cpu", "trainer.limit_test_batches=2"]
    metrics = evaluate(compose(out, [*over, "progress_bar=none"], config_name="eval"))
    res = json.loads((out / "eval_metrics.json").read_text())
    assert res["packing"] == "pack" and 0.0 <= metrics["test/acc1"] <= 1.0 and math.isfinite(metrics["test/loss"])


def test_predict_at_native_sizes_puts_packed_predictions_back_in_file_order(tmp_path):
    """``predict.py seq_len=...``: images of several sizes, packed (first fit reorders them), each file's row equals
    the model on that image alone at its own size."""
    from PIL import Image

    import vitrel
    from vitrel.data.packing import PackingCollator
    from vitrel.inference import Predictor, naflex_eval_transform, predict_folder

    torch.manual_seed(0)
    model = vitrel.create_model(
        "vitrel_vit_tiny_patch4_32", pos="rope2d_mixed", num_classes=10, in_chans=1, img_size=28, embed_dim=32,
        depth=1, num_heads=2,
    ).eval()  # fmt: skip
    cfg = {"input_size": (1, 28, 28), "mean": (0.5,), "std": (0.5,), "interpolation": "bilinear"}
    sizes = [(32, 32), (16, 16), (32, 32), (8, 8), (12, 20)]  # 64, 16, 64, 4, 15 tokens: rows [0], [1, 3, 4], [2]
    g = torch.Generator().manual_seed(1)
    for k, (h, w) in enumerate(sizes):
        px = (torch.rand(h, w, generator=g) * 255).to(torch.uint8).numpy()
        Image.fromarray(px).save(tmp_path / f"img{k}.png")
    res = predict_folder(Predictor(model, cfg, "test"), tmp_path, topk=3, batch_size=8, progress=False, seq_len=64)
    assert [r["filename"] for r in res.rows] == [f"img{k}.png" for k in range(5)]
    tf = naflex_eval_transform(cfg, 4, 64)
    for k, row in enumerate(res.rows):
        with Image.open(tmp_path / f"img{k}.png") as img:
            x, _ = PackingCollator(64)([(tf(img), 0)])
        assert x["patch_valid"].sum() == sizes[k][0] * sizes[k][1] // 16  # its own size, not resized
        with torch.inference_mode():
            p = model(x).softmax(-1)[0]
        assert row["index_0"] == int(p.argmax()) and row["prob_0"] == pytest.approx(float(p.max()), abs=1e-5)
    with pytest.raises(ValueError, match="max_tokens=80 must be in"):
        predict_folder(Predictor(model, cfg, "t"), tmp_path, progress=False, seq_len=64, max_tokens=80)


def test_a_run_resumed_mid_epoch_logs_the_whole_epochs_padding(tmp_path):
    """``train/padding_epoch`` of an epoch resumed mid-way is the share over all of its batches, as in the run that was
    not stopped: it was Lightning's mean of logged values, which no checkpoint keeps, so the resumed batches' only
    (``bench/kill_resume.sh``, NaFlex under ``trainer.devices=2``: 0.085287 against 0.085381)."""
    import csv

    from tests.train_helpers import FAST, TINY_VIT, RaiseInForward, compose
    from vitrel.train.run import train

    over = ["experiment=fmnist_naflex", *TINY_VIT, *FAST, "trainer.max_epochs=1", "trainer.limit_train_batches=4"]
    over += ["trainer.limit_val_batches=1", "trainer.log_every_n_steps=1", "test=false", "logger=csv"]
    straight, mid = tmp_path / "straight", tmp_path / "mid"
    train(compose(straight, over))
    with pytest.raises(torch.OutOfMemoryError):  # in step 3's forward: last.ckpt of step 2, mid-epoch
        train(compose(mid, over), callbacks=[RaiseInForward(at_step=2)])
    assert torch.load(mid / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2
    train(compose(mid, over))

    def padding(run):
        with open(run / "csv" / "metrics.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        return [float(r["train/padding_step"]) for r in rows if r["train/padding_step"]], [
            float(r["train/padding_epoch"]) for r in rows if r["train/padding_epoch"]
        ]

    (steps, [want]), (resumed_steps, [got]) = padding(straight), padding(mid)
    assert resumed_steps == steps and len(steps) == 4 and len(set(steps)) > 1
    assert got == want
