"""The memory loader (data.loader=memory): same batches as the workers loader, batched augmentation,
resumable epochs, DDP shards, the memory budget, the generic array module."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hydra.utils import instantiate

import vitrel.data.fashion_mnist as fm
from tests.data.test_datamodules import CONF, data_config, make_cifar_files, make_fmnist_files, normalise
from vitrel.data import (
    ArrayDataModule,
    BatchAugment,
    CIFARDataModule,
    FashionMNISTDataModule,
    ImageNetDataModule,
    MemoryBudgetError,
    MemoryLoader,
    ResizedDataset,
    TensorImageDataset,
    TranslatedDataset,
)
from vitrel.data.augment import batch_pipeline, place

MEAN = torch.tensor([0.5]).view(-1, 1, 1)
STD = torch.tensor([0.25]).view(-1, 1, 1)


def batches(loader) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x.clone(), y.clone()) for x, y in loader]


def assert_same_batches(a, b) -> None:
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(ya, yb)
        torch.testing.assert_close(xa, xb, rtol=0, atol=0)


def both(make, **kw):
    """The same data module with each loader."""
    return make(loader="memory", **kw), make(loader="workers", num_workers=0, **kw)


# ---------------------------------------------------------------------------------------------------
# the memory path gives the workers path's batches (augmentation off)


@pytest.fixture(scope="module")
def fmnist_root(tmp_path_factory):
    """Fashion-MNIST IDX files (``subset="full"``) of 1250 training and 250 test images: batches of 200 give several
    full ones and a last partial one in each split (the embedded subset's 10,000 images, two epochs through the
    workers path's per-image transforms, took most of the tests' time, for the same property)."""
    root = tmp_path_factory.mktemp("fmnist")
    make_fmnist_files(root / "FashionMNIST" / "raw", n_train=1250, n_test=250, gz=False)
    return root


@pytest.mark.parametrize("kw", [{}, {"in_chans": 3}, {"val_fraction": 0.1}, {"canvas_size": 36}], ids=str)
def test_memory_and_workers_give_the_same_batches(kw, fmnist_root):
    mem, work = both(FashionMNISTDataModule, root=fmnist_root, subset="full", download=False, batch_size=200, **kw)
    for dm in (mem, work):
        dm.train_order_seed = 3  # the seeded order (ExactResume sets it)
    assert isinstance(mem.train_dataloader(), MemoryLoader) and isinstance(mem.dataset("test"), TensorImageDataset)
    for epoch in (0, 1):
        loaders = [dm.train_dataloader() for dm in (mem, work)]
        for dl in loaders:
            dl.sampler.set_epoch(epoch)
        if "canvas_size" in kw:  # training offsets are drawn differently: only the sizes agree
            assert [x.shape for x, _ in loaders[0]] == [x.shape for x, _ in loaders[1]]
        else:
            assert_same_batches(*map(batches, loaders))
    for split in ("val", "test"):
        a, b = (batches(getattr(dm, f"{split}_dataloader")()) for dm in (mem, work))
        assert_same_batches(a, b)
    if "canvas_size" in kw:
        assert isinstance(work.dataset("test"), TranslatedDataset)


def test_cifar_memory_and_workers_agree(tmp_path):
    data = make_cifar_files(tmp_path, 10, n_per_batch=7)
    mem, work = both(CIFARDataModule, root=tmp_path, num_classes=10, verify=False, batch_size=8, augment=False)
    for dm in (mem, work):
        dm.train_order_seed = 0
    assert_same_batches(batches(mem.train_dataloader()), batches(work.train_dataloader()))
    assert_same_batches(batches(mem.test_dataloader()), batches(work.test_dataloader()))
    x, y = next(iter(mem.test_dataloader()))
    want = torch.stack([normalise(data["test"][0][i].reshape(3, 32, 32), mem.mean, mem.std) for i in range(7)])
    torch.testing.assert_close(x, want, rtol=0, atol=0)
    assert y.tolist() == data["test"][1]


def test_memory_resize_is_close_to_the_workers_resize():
    mem, work = both(FashionMNISTDataModule, batch_size=64, img_size=40)
    (xm, ym), (xw, yw) = (next(iter(dm.test_dataloader())) for dm in (mem, work))
    assert xm.shape == xw.shape == (64, 1, 40, 40) and torch.equal(ym, yw)
    assert (xm - xw).abs().mean() < 0.02  # torchvision's tensor resize vs PIL's: close, not equal


def test_tensor_dataset_items_and_wrappers():
    dm = FashionMNISTDataModule(batch_size=16)
    ds = dm.dataset("test")
    x, y = ds[5]
    assert x.shape == (1, 28, 28) and isinstance(y, int)
    with np.load(FashionMNISTDataModule().data_dir) as z:
        torch.testing.assert_close(x, normalise(z["x_test"][5], dm.mean, dm.std), rtol=0, atol=0)
    up = ResizedDataset(ds, 56)
    assert up[5][0].shape == (1, 56, 56) and up[5][1] == y
    # the per-sample data sets stay available for the study's wrappers on either path
    assert torch.equal(dm.make_dataset("test")[5][0], x)
    raw = dm.raw_dataset("test")
    t = TranslatedDataset(raw, 40, seed=0, transform=dm.eval_transform(40))
    assert t[0][0].shape == (1, 40, 40)


# ---------------------------------------------------------------------------------------------------
# batched augmentation


def one_bright_pixel(n: int, size: int = 16, at: tuple[int, int] = (8, 8)) -> torch.Tensor:
    x = torch.zeros(n, 1, size, size, dtype=torch.uint8)
    x[:, 0, at[0], at[1]] = 255
    return x


def bright_at(x: torch.Tensor) -> list[tuple[int, int]]:
    flat = x[:, 0].flatten(1).argmax(1)
    return [(int(i) // x.shape[-1], int(i) % x.shape[-1]) for i in flat]


def sample(aug: BatchAugment, n: int, size: int = 16, seed: int = 0, channels: int = 1) -> dict:
    return aug.sample(n, (size, size), (size, size), channels, torch.Generator().manual_seed(seed))


def test_translation_moves_content_by_the_requested_range():
    aug = BatchAugment(translate=3)
    n = 2000
    p = sample(aug, n)
    x = batch_pipeline(one_bright_pixel(n), mean=MEAN, std=STD, img_size=16, params=p)
    assert x.shape == (n, 1, 16, 16) and x.dtype == torch.float32
    moved = torch.tensor(bright_at(x)) - torch.tensor([8, 8])
    torch.testing.assert_close(moved, p["shift"])  # content moves by (dy, dx)
    assert moved.abs().max() == 3 and set(moved[:, 0].tolist()) == set(range(-3, 4))  # the whole range, no more
    assert set(map(tuple, moved.tolist())) == {(a, b) for a in range(-3, 4) for b in range(-3, 4)}
    # what moves out of the frame is cut, what comes in is black (normalised 0)
    corner = batch_pipeline(one_bright_pixel(n, at=(0, 0)), mean=MEAN, std=STD, img_size=16, params=p)
    inside = (p["shift"] >= 0).all(1)
    assert torch.equal(corner.flatten(1).max(1).values > 0, inside)
    assert corner.min() == (0 - 0.5) / 0.25


def test_place_pastes_into_a_canvas_and_cuts():
    x = torch.arange(1, 7, dtype=torch.uint8).view(1, 1, 2, 3).repeat(3, 1, 1, 1)
    out = place(x, (4, 5), torch.tensor([0, 2, -1]), torch.tensor([1, 2, 3]))
    assert out.shape == (3, 1, 4, 5) and out.dtype == torch.uint8
    want0 = torch.zeros(4, 5, dtype=torch.uint8)
    want0[0:2, 1:4] = x[0, 0]
    assert torch.equal(out[0, 0], want0)
    want1 = torch.zeros(4, 5, dtype=torch.uint8)
    want1[2:4, 2:5] = x[0, 0]
    assert torch.equal(out[1, 0], want1)
    want2 = torch.zeros(4, 5, dtype=torch.uint8)
    want2[0:1, 3:5] = x[0, 0, 1:, :2]  # top row and right column cut off
    assert torch.equal(out[2, 0], want2)


class _Replay:
    """Python's ``random`` for timm's ``get_params``, drawing the given uniforms (``uniform`` from ``attempts``,
    ``randint`` from ``offsets``) as vitrel's batch draws map a uniform ``u``: ``lo + (hi - lo) u`` and
    ``lo + floor(u (hi - lo + 1))``."""

    def __init__(self, attempts: list[float], offsets: list[float]) -> None:
        self.attempts, self.offsets = attempts, offsets

    def uniform(self, lo: float, hi: float) -> float:
        return lo + (hi - lo) * self.attempts.pop(0)

    def randint(self, lo: int, hi: int) -> int:
        return lo + min(int(np.floor(self.offsets.pop(0) * (hi - lo + 1))), hi - lo)


@pytest.mark.parametrize(
    ("hw", "scale", "ratio"),
    [
        ((32, 32), (0.08, 1.0), (3 / 4, 4 / 3)),
        ((28, 40), (0.35, 1.0), (3 / 4, 4 / 3)),
        ((8, 64), (0.9, 1.0), (3 / 4, 4 / 3)),
    ],
)
def test_batch_crop_boxes_are_timms_random_resized_crop(monkeypatch, hw, scale, ratio):
    """The memory loader's crop boxes are timm's ``RandomResizedCropAndInterpolation.get_params`` fed the same
    uniforms: its 10 attempts (area, log aspect ratio), the first that fits, the offsets, and the central fallback
    (an 8 x 64 image at scale 0.9: no attempt fits). The batch draws the attempts of all samples first, then the
    offsets."""
    import timm.data.transforms as timm_transforms
    from PIL import Image

    from vitrel.data.augment import _crop_boxes

    n = 300
    boxes = _crop_boxes(n, hw, scale, ratio, torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(0)
    area, log_r, top, left = (torch.rand(*s, generator=g, dtype=torch.float64) for s in [(n, 10), (n, 10), (n,), (n,)])
    img = Image.new("L", hw[::-1])
    for i in range(n):
        attempts = [u.item() for pair in zip(area[i], log_r[i]) for u in pair]
        monkeypatch.setattr(timm_transforms, "random", _Replay(attempts, [top[i].item(), left[i].item()]))
        want = timm_transforms.RandomResizedCropAndInterpolation.get_params(img, scale, ratio)
        assert tuple(boxes[i].tolist()) == want, i


class _EraseReplay:
    """Python's ``random`` for timm's ``RandomErasing._erase`` of one sample, drawing the uniforms vitrel's batch drew:
    ``random()`` the on/off draw, the first ``randint`` the box count (when ``count > 1``), then box by box its
    attempts (``uniform``) until one fits and that box's two offsets (``randint``, as :class:`_Replay`)."""

    def __init__(self, on: float, k: int | None, attempts: list[list[float]], offsets: list[list[float]]) -> None:
        self.on, self.k, self.attempts, self.offsets, self.box = on, k, attempts, offsets, 0

    def random(self) -> float:
        return self.on

    def uniform(self, lo: float, hi: float) -> float:
        if not self.attempts[self.box]:  # (no attempt of the box fitted: timm goes on to the next box)
            self.box += 1
        return lo + (hi - lo) * self.attempts[self.box].pop(0)

    def randint(self, lo: int, hi: int) -> int:
        if self.k is not None:
            k, self.k = self.k, None
            return k
        u = self.offsets[self.box].pop(0)
        self.box += not self.offsets[self.box]
        return lo + min(int(np.floor(u * (hi - lo + 1))), hi - lo)


@pytest.mark.parametrize(("hw", "prob", "count"), [((32, 32), 0.5, 1), ((28, 40), 0.9, 3), ((8, 64), 1.0, 2)])
def test_batch_erasing_is_timms_random_erasing(monkeypatch, hw, prob, count):
    """The memory loader's random erasing boxes are timm's ``RandomErasing`` (``re_count`` boxes at most, sharing the
    area, 10 attempts each) fed the same uniforms: the same pixels erased, sample by sample."""
    import timm.data.random_erasing as timm_erasing

    from vitrel.data.augment import _erase_boxes, erase

    n, (h, w) = 200, hw
    boxes, used = _erase_boxes(n, hw, prob, count, torch.Generator().manual_seed(0))
    ours = erase(torch.ones(n, 3, h, w), boxes, used) == 0
    g = torch.Generator().manual_seed(0)
    on, k = torch.rand(n, generator=g), torch.randint(1, count + 1, (n,), generator=g)
    area, ar = (torch.rand(n, count, 10, generator=g, dtype=torch.float64) for _ in range(2))
    top, left = (torch.rand(n, count, generator=g, dtype=torch.float64) for _ in range(2))
    theirs = timm_erasing.RandomErasing(probability=prob, mode="const", max_count=count, device="cpu")
    for i in range(n):
        attempts = [[u.item() for pair in zip(area[i, j], ar[i, j]) for u in pair] for j in range(count)]
        offsets = [[top[i, j].item(), left[i, j].item()] for j in range(count)]
        replay = _EraseReplay(on[i].item(), int(k[i]) if count > 1 else None, attempts, offsets)
        monkeypatch.setattr(timm_erasing, "random", replay)
        img = torch.ones(3, h, w)
        theirs(img)  # (in place)
        assert torch.equal(img == 0, ours[i]), i


def test_flip_erase_crop_shapes_ranges_and_per_sample_randomness():
    aug = BatchAugment(translate=2, hflip=0.5, scale=(0.3, 1.0), re_prob=0.7, re_mode="rand", re_count=2)
    n = 64
    g = torch.Generator().manual_seed(1)
    imgs = torch.randint(0, 256, (n, 3, 20, 20), dtype=torch.uint8, generator=g)
    mean, std = torch.tensor([0.4, 0.5, 0.6]).view(-1, 1, 1), torch.tensor([0.2, 0.25, 0.3]).view(-1, 1, 1)
    p = aug.sample(n, (20, 20), (16, 16), 3, torch.Generator().manual_seed(0))
    assert p["flip"].float().mean().item() == pytest.approx(0.5, abs=0.2)
    assert 0.4 < p["erase_on"][:, 0].float().mean() < 0.95 and p["erase_fill"].shape == (n, 2, 3, 1, 1)
    boxes = p["crop"]
    assert (
        (boxes[:, 2:] > 0).all() and (boxes[:, 0] + boxes[:, 2] <= 20).all() and (boxes[:, 1] + boxes[:, 3] <= 20).all()
    )
    area = (boxes[:, 2] * boxes[:, 3]).float() / 400
    assert area.min() > 0.25 and area.max() <= 1.0 and area.std() > 0.1  # one crop per sample
    x = batch_pipeline(imgs, mean=mean, std=std, img_size=16, params=p, re_mode="rand")
    assert x.shape == (n, 3, 16, 16) and x.dtype == torch.float32 and torch.isfinite(x).all()
    lo, hi = (0 - mean) / std, (1 - mean) / std
    erased = p["erase_on"].any(1)
    kept = x[~erased]
    assert (kept >= lo - 1e-5).all() and (kept <= hi + 1e-5).all()  # normalised pixel range
    # the same image repeated gets different results per sample
    same = imgs[:1].expand(n, -1, -1, -1)
    y = batch_pipeline(same, mean=mean, std=std, img_size=16, params=p, re_mode="rand")
    assert len({tuple(v.flatten()[:50].tolist()) for v in y}) > n // 2


def test_flip_mirrors_and_erasing_fills_boxes():
    n = 400
    p = sample(BatchAugment(hflip=0.5), n)
    x = batch_pipeline(one_bright_pixel(n, at=(3, 4)), mean=MEAN, std=STD, img_size=16, params=p)
    want = [(3, 11) if f else (3, 4) for f in p["flip"].tolist()]
    assert bright_at(x) == want and 0 < sum(p["flip"].tolist()) < n
    aug = BatchAugment(re_prob=1.0, re_mode="const")
    p = sample(aug, n)
    x = batch_pipeline(torch.full((n, 1, 16, 16), 255, dtype=torch.uint8), mean=MEAN, std=STD, img_size=16, params=p)
    t, lft, h, w = p["erase"][:, 0].unbind(-1)
    erased_px = (x == 0).flatten(1).sum(1)  # const fill: 0 after normalisation (white is 2.0)
    on = p["erase_on"][:, 0]
    assert torch.equal(erased_px[on], (h * w)[on]) and (erased_px[~on] == 0).all() and on.float().mean() > 0.9
    area = (h * w)[on].float() / 256
    assert area.min() >= 0.01 and area.max() <= 0.4
    g = torch.Generator().manual_seed(0)
    px = batch_pipeline(
        torch.full((n, 1, 16, 16), 255, dtype=torch.uint8),
        mean=MEAN, std=STD, img_size=16, params=p, re_mode="pixel", noise=g,
    )  # fmt: skip
    assert torch.equal(px != 2.0, x == 0)  # the same boxes, filled with noise


def test_augmentation_is_deterministic_from_the_seed_and_new_each_epoch():
    dm = FashionMNISTDataModule(batch_size=100, augment=True, batch_augment=BatchAugment(translate=2, hflip=0.5))
    dm.train_order_seed = 7

    def epoch(e, dm=dm):
        dl = dm.train_dataloader()
        dl.sampler.set_epoch(e)
        return batches(dl)

    first = epoch(0)
    assert_same_batches(first, epoch(0))
    other = epoch(1)
    assert not torch.equal(first[0][0], other[0][0])
    dm.train_order_seed = 8
    assert not torch.equal(first[0][0], epoch(0)[0][0])
    # augmented, not the plain images of the same order
    dm.augment = False
    dm.train_order_seed = 7
    plain = epoch(0)
    assert [torch.equal(a[1], b[1]) for a, b in zip(first, plain)] == [True] * len(first)
    assert not torch.equal(first[0][0], plain[0][0])


# ---------------------------------------------------------------------------------------------------
# resume, ranks


def test_memory_loader_resumes_the_epoch_with_its_augmentation():
    dm = FashionMNISTDataModule(batch_size=256, augment=True, batch_augment=BatchAugment(translate=2, re_prob=0.5))
    dm.train_order_seed = 0
    full = dm.train_dataloader()
    full.sampler.set_epoch(2)
    whole = batches(full)
    first = dm.train_dataloader()
    first.sampler.set_epoch(2)
    it = iter(first)
    for _ in range(5):
        next(it)
    state = first.state_dict()
    assert state == {"epoch": 2, "batches": 5, "batch_size": 256, "num_replicas": 1}
    resumed = dm.train_dataloader()  # a new process: a new loader
    resumed.load_state_dict(state)
    resumed.sampler.set_epoch(2)
    assert_same_batches(batches(resumed), whole[5:])
    assert resumed.state_dict()["batches"] == len(whole) and len(batches(resumed)) == len(whole)


def test_ddp_ranks_take_disjoint_shards_of_the_same_order():
    dm = FashionMNISTDataModule(batch_size=64, augment=True, batch_augment=BatchAugment(translate=2, hflip=0.5))
    ds = dm.dataset("train")
    one = MemoryLoader(ds, 128, sampler=_sampler(ds, 1, 0), augment=dm.batch_augment, augment_seed=5)
    two = [
        MemoryLoader(
            ds, 64, sampler=_sampler(ds, 2, r), augment=dm.batch_augment, augment_seed=5, num_replicas=2, rank=r
        )
        for r in (0, 1)
    ]
    orders = [dl.order() for dl in two]
    assert len(set(orders[0].tolist()) & set(orders[1].tolist())) == 0
    assert sorted(torch.cat(orders).tolist()) == list(range(len(ds)))
    assert torch.equal(torch.stack(orders, 1).flatten(), one.order())  # rank r takes order[r::2]
    # and each sample gets the augmentation it gets in one process
    b1, (b20, b21) = next(iter(one)), (next(iter(dl)) for dl in two)
    torch.testing.assert_close(b1[0][0::2], b20[0], rtol=0, atol=0)
    torch.testing.assert_close(b1[0][1::2], b21[0], rtol=0, atol=0)
    ev = [MemoryLoader(ds, 1000, num_replicas=2, rank=r) for r in (0, 1)]
    assert sorted(torch.cat([dl.order() for dl in ev]).tolist()) == list(range(len(ds)))


def _sampler(ds, world, rank):
    from vitrel.data.base import EpochSampler

    return EpochSampler(ds, shuffle=True, seed=5, num_replicas=world, rank=rank)


# ---------------------------------------------------------------------------------------------------
# bad input, configs, the generic module


def test_over_the_memory_budget_is_a_clear_error():
    dm = FashionMNISTDataModule(memory_budget_gb=1e-4, val_fraction=0.0)  # 107 kB
    with pytest.raises(MemoryBudgetError) as exc:
        dm.setup("fit")
    msg = str(exc.value)
    assert "Fashion-MNIST needs 9.1 MB as uint8 tensors (train 7.6 MB + val 1.5 MB) on cpu" in msg
    assert "memory budget of 104.9 kB" in msg and "data.loader=workers" in msg and "data.memory_budget_gb" in msg
    FashionMNISTDataModule(memory_budget_gb=1e-4, loader="workers").setup("fit")  # streams: no budget


def test_memory_loader_refusals_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="data.loader=workers"):
        ImageNetDataModule(root=tmp_path, loader="memory")
    with pytest.raises(ValueError, match="augment_kwargs .* data.batch_augment .* data.loader=workers"):
        FashionMNISTDataModule(augment=True, augment_kwargs={"auto_augment": "rand-m9"})
    with pytest.raises(ValueError, match="loader must be one of"):
        FashionMNISTDataModule(loader="gpu")
    with pytest.raises(ValueError, match="hflip"):
        BatchAugment(hflip=2.0)


def test_configs_choose_the_loader(tmp_path, monkeypatch):
    monkeypatch.setenv("VITREL_DATA_ROOT", str(tmp_path))
    monkeypatch.setattr(fm, "DEBIAN_DIR", tmp_path / "no_debian")
    make_fmnist_files(tmp_path / "FashionMNIST" / "raw")
    for name in ("fashion_mnist", "fashion_mnist_full", "cifar10", "cifar100"):
        cfg = data_config(name)
        assert cfg.loader == "memory" and cfg.batch_augment._target_ == "vitrel.data.BatchAugment", name
    assert data_config("imagenet").loader == "workers"
    cfg = data_config("fashion_mnist_full")
    cfg.augment, cfg.batch_augment.re_prob = True, 0.25
    dm = instantiate(cfg)
    assert dm.loader == "memory" and dm.batch_augment == BatchAugment(translate=2, hflip=0.5, re_prob=0.25)
    x, _ = next(iter(dm.train_dataloader()))
    assert x.shape == (36, 1, 28, 28)  # the 40 images of the generated files, 4 held out (val_fraction 0.1)


def test_array_data_module(tmp_path):
    rng = np.random.default_rng(0)
    train = (rng.integers(0, 256, (50, 12, 12, 3), dtype=np.uint8), np.arange(50) % 4)
    test = (rng.integers(0, 256, (20, 12, 12, 3), dtype=np.uint8), np.arange(20) % 4)
    dm = ArrayDataModule(train=train, test=test, batch_size=8, val_fraction=0.0)
    assert (dm.num_classes, dm.in_chans, dm.img_size, dm.loader) == (4, 3, 12, "memory")
    np.testing.assert_allclose(dm.mean, train[0].reshape(-1, 3).mean(0) / 255, rtol=1e-6)
    assert dm.batch_augment.hflip == 0.0  # no mirroring by default
    np.savez(tmp_path / "set.npz", x_train=train[0], y_train=train[1], x_test=test[0], y_test=test[1])
    mem, work = both(ArrayDataModule, path=tmp_path / "set.npz", batch_size=8)
    assert_same_batches(batches(mem.test_dataloader()), batches(work.test_dataloader()))
    x, y = next(iter(mem.train_dataloader()))
    assert x.shape == (8, 3, 12, 12) and y.max() < 4
    with pytest.raises(ValueError, match="either path"):
        ArrayDataModule(train=train)


def test_data_module_prints_with_either_loader():
    """f"{dm}" (Lightning's __str__ sizes its loaders and fails on a memory loader) shows the settings."""
    for loader in ("memory", "workers"):
        dm = FashionMNISTDataModule(subset="embedded", loader=loader, num_workers=0)
        assert f"{dm}" == repr(dm) and f"loader={loader}" in str(dm)


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (CONF.parent / "experiment").glob("*.yaml")))
def test_every_experiment_builds_its_data_module(tmp_path, experiment):
    """Recipes that ask for timm's per-sample augmentation (augment_kwargs) run on the workers loader."""
    from tests.train_helpers import compose

    cfg = compose(tmp_path, [f"experiment={experiment}", f"data.root={tmp_path}"])
    dm = instantiate(cfg.data)
    assert dm.loader in ("memory", "workers")
    if cfg.data.get("augment_kwargs"):
        assert dm.loader == "workers"
