"""ImageNet from shards: the writers (webdataset tars + timm's _info.json, parquet + README dataset_info),
``ImageNetDataModule(source=...)`` through ``timm.data.create_dataset``, and the split of every epoch over
2 DDP ranks (gloo, CPU) x 2 loader workers.

The images are solid colours: red = 4 x the sample's index, green = 80 x its class, so a batch's centre
pixels name the samples it holds. The multi-process runs are subprocesses with a timeout, so that a DDP
hang (a rank left waiting on uneven shards) fails the test instead of blocking it. Run directly, this
file is the body of those subprocesses (``fit`` and ``iterate``).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import shutil
import signal
import socket
from pathlib import Path

import lightning as L
import pytest
import torch
from PIL import Image

from tests.preloaded import preloaded
from vitrel.data import ImageNetDataModule
from vitrel.data.base import ResumableDataLoader
from vitrel.data.imagenet import ClassFoldersMismatchError
from vitrel.data.shards import ShardCountError, ShardLoader, epoch_samples_per_rank, main, write_hf, write_wds

REPO = Path(__file__).resolve().parents[2]
CLASSES = ("n0001", "n0002", "n0003")
PER_CLASS, VAL_PER_CLASS = 20, 4
N = len(CLASSES) * PER_CLASS  # 60 training samples
SIZE, B = 16, 5


def make_tree(root: Path) -> None:
    for split, n, offset in (("train", PER_CLASS, 0), ("val", VAL_PER_CLASS, 0)):
        for c, name in enumerate(CLASSES):
            (root / split / name).mkdir(parents=True)
            for k in range(n):
                i = offset + c * n + k
                Image.new("RGB", (SIZE, SIZE), (4 * i, 80 * c, 7)).save(root / split / name / f"{name}_{k}.png")


def ids_of(x: torch.Tensor, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225)) -> tuple[list[int], list[int]]:
    """``(sample index, class)`` of each image of a normalised batch (from its centre pixel)."""
    px = x[:, :2, SIZE // 2, SIZE // 2] * torch.tensor(std[:2])[None] + torch.tensor(mean[:2])[None]
    rgb = (px * 255).round()
    return (rgb[:, 0] / 4).round().long().tolist(), (rgb[:, 1] / 80).round().long().tolist()


def module(root, source, **kw) -> ImageNetDataModule:
    args = dict(root=root, source=source, img_size=SIZE, augment=False, batch_size=B, num_workers=2)
    return ImageNetDataModule(**{**args, "pin_memory": False, **kw})


def fit_only_trainer(root, **kw) -> L.Trainer:
    """A CPU trainer that only fits (no validation, logger, progress bar or summary), its folder ``root``."""
    quiet = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)
    return L.Trainer(accelerator="cpu", limit_val_batches=0, num_sanity_val_steps=0, **quiet, **kw)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    base = tmp_path_factory.mktemp("shards")
    make_tree(base / "tree")
    main(["write-wds", str(base / "tree"), str(base / "wds15"), "--shard-size", "15"])  # 4 train shards of 15
    write_wds(base / "tree", base / "wds13", shard_size=13)  # 5 shards: 13, 13, 13, 13, 8
    write_wds(base / "tree", base / "wds20", shard_size=20)  # 3 shards
    write_wds(base / "tree", base / "wds5", shard_size=5)  # val: 3 shards (5, 5, 2)
    write_hf(base / "tree", base / "hf13", shard_size=13)  # 5 parquet files
    return base


# ---------------------------------------------------------------------------------------------------
# writers, read back by timm's readers


def test_write_wds_info_and_timm_reads_every_sample(data):
    from timm.data import create_dataset

    info = json.loads((data / "wds13" / "_info.json").read_text())
    assert info["classes"] == list(CLASSES)
    train = info["splits"]["train"]
    assert train["num_samples"] == N and train["shard_lengths"] == [13, 13, 13, 13, 8]
    assert all((data / "wds13" / f).is_file() for f in train["filenames"])
    assert info["splits"]["validation"]["num_samples"] == len(CLASSES) * VAL_PER_CLASS
    ds = create_dataset("wds/imagenet", root=str(data / "wds13"), split="train")
    seen = {}
    for img, target in ds:
        r, g, _ = img.getpixel((0, 0))
        seen[r // 4] = (target, g // 80)
    assert sorted(seen) == list(range(N))  # each sample once, and its .cls is its class
    assert all(t == c == i // PER_CLASS for i, (t, c) in seen.items())


def test_write_hf_reads_offline_map_style_and_streamed(data, tmp_path):
    from timm.data import create_dataset

    ds = create_dataset(f"hfds/{data / 'hf13'}", root=str(tmp_path), split="train")
    assert len(ds) == N and ds.reader.class_to_idx == {c: i for i, c in enumerate(CLASSES)}
    pairs = [(img.getpixel((0, 0))[0] // 4, t) for img, t in (ds[i] for i in range(N))]
    assert sorted(pairs) == [(i, i // PER_CLASS) for i in range(N)]
    it = create_dataset(f"hfids/{data / 'hf13'}", root=str(tmp_path), split="validation")
    assert it.reader.num_samples == len(CLASSES) * VAL_PER_CLASS  # README.md's num_examples, no download
    # the map-style source takes the folder path's samplers: a seeded, resumable order (ExactResume)
    dm = module(tmp_path, f"hfds/{data / 'hf13'}", num_workers=0)
    dm.train_order_seed = 1
    loader = dm.train_dataloader()
    assert isinstance(loader, ResumableDataLoader) and len(loader.dataset) == N and dm.class_names == list(CLASSES)


def test_writers_refuse_class_folders_the_folder_path_refuses(tmp_path, capsys):
    """A val class folder that train lacks was left out of the shards without a word (13 val images, 12 written), and an
    empty train class folder became a class no sample has; ``data=imagenet`` refuses both trees. So do the writers
    now, ``python -m vitrel.data.shards`` with the message alone."""
    tree = tmp_path / "tree"
    for split, name in (("train", "a"), ("train", "b"), ("val", "a"), ("val", "kiwi")):
        (tree / split / name).mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (SIZE, SIZE), (9, 9, 9)).save(tree / split / name / "x.png")
    for write in (write_wds, write_hf):
        with pytest.raises(ClassFoldersMismatchError, match=r"val has class folders not in .*train: \['kiwi'\]"):
            write(tree, tmp_path / "out", shard_size=4)
    with pytest.raises(SystemExit, match=r"^python -m vitrel.data.shards: ClassFoldersMismatchError: .*'kiwi'"):
        main(["write-wds", str(tree), str(tmp_path / "out")])
    shutil.rmtree(tree / "val" / "kiwi")
    (tree / "train" / "b" / "x.png").rename(tree / "train" / "b" / "x.txt")
    with pytest.raises(ClassFoldersMismatchError, match=r"train has class folders without image files: \['b'\]"):
        write_wds(tree, tmp_path / "out", shard_size=4)
    (tree / "train" / "b" / "x.txt").rename(tree / "train" / "b" / "x.png")
    assert write_wds(tree, tmp_path / "out", shard_size=4)["splits"]["validation"]["num_samples"] == 1


def test_vitrel_data_leaves_the_shards_module_to_python_m():
    """``python -m vitrel.data.shards`` printed "RuntimeWarning: 'vitrel.data.shards' found in sys.modules after import
    of package 'vitrel.data' ... may result in unpredictable behaviour": importing ``vitrel.data`` (which Python does
    before it runs the module as ``__main__``) imported it, through ``imagenet.py``."""
    import importlib
    import sys

    saved = {k: v for k, v in sys.modules.items() if k == "vitrel.data" or k.startswith("vitrel.data.")}
    try:
        for k in saved:
            del sys.modules[k]
        importlib.import_module("vitrel.data")
        assert "vitrel.data.shards" not in sys.modules
    finally:
        for k in [k for k in sys.modules if k == "vitrel.data" or k.startswith("vitrel.data.")]:
            del sys.modules[k]
        sys.modules.update(saved)
        sys.modules["vitrel"].data = saved["vitrel.data"]  # (the import set the new one on the package)


# ---------------------------------------------------------------------------------------------------
# the datamodule


def test_imagefolder_path_unchanged(data):
    dm = ImageNetDataModule(root=data / "tree", img_size=SIZE, augment=False, batch_size=B, num_workers=0)
    loader = dm.train_dataloader()
    assert dm.source is None and not dm.iterable and type(loader) is torch.utils.data.DataLoader
    assert len(loader.dataset) == N and dm.num_classes == 3


def test_config_builds_the_wds_module(data):
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(REPO / "conf" / "data" / "imagenet_wds.yaml")
    cfg.pop("defaults")  # the schema entry of Hydra's defaults list (vitrel/config.py), not an argument
    cfg.root, cfg.num_workers, cfg.batch_size, cfg.pin_memory = str(data / "wds15"), 0, 2, False
    dm = instantiate(cfg)
    assert dm.source == "wds/imagenet" and dm.class_names == list(CLASSES)
    x, y = next(iter(dm.val_dataloader()))
    assert x.shape == (2, 3, 224, 224) and y.max() < 3
    assert OmegaConf.load(REPO / "conf" / "data" / "imagenet.yaml").source is None


def test_epoch_covers_whole_batches_per_worker_on_uneven_shards(data):
    """5 shards (13, 13, 13, 13, 8) over 2 workers: each yields ceil(60 / 2) = 30 samples (6 batches), the
    worker with the shorter shards repeating its own, the two workers' samples disjoint; with batches of 7
    the share is rounded up to whole batches."""
    dm = module(data / "wds13", "wds/imagenet")
    loader = dm.train_dataloader()
    assert isinstance(loader, ShardLoader) and len(loader) == epoch_samples_per_rank(N, 1, 2, B) // B == 12
    streams: list[list[int]] = [[], []]
    for k, (x, y) in enumerate(loader):  # in order: batch k comes from worker k % 2
        ids, classes = ids_of(x)
        assert classes == y.tolist()
        streams[k % 2] += ids
    assert [len(s) for s in streams] == [30, 30]
    assert not set(streams[0]) & set(streams[1])
    # 30 a worker is not a whole number of batches of 7: rounded up to 35, and the loader's length says so
    loader = module(data / "wds13", "wds/imagenet", batch_size=7).train_dataloader()
    assert len(loader) == sum(1 for _ in loader) == epoch_samples_per_rank(N, 1, 2, 7) // 7 == 10


def test_fewer_wds_shards_than_workers_is_refused(data):
    """In Python a ``ShardCountError`` (a ``ValueError``); in ``train.py`` one line, as the other data errors (it was
    Hydra's traceback through Lightning's)."""
    from vitrel.train.user_errors import one_line_errors

    with pytest.raises(ShardCountError, match="3 shards for 1 ranks x 4 loader workers"):
        module(data / "wds20", "wds/imagenet", num_workers=4).train_dataloader()
    with pytest.raises(SystemExit) as stop, one_line_errors("train.py"):
        module(data / "wds20", "wds/imagenet", num_workers=4).train_dataloader()
    assert str(stop.value).startswith("train.py: ShardCountError: ") and "\n" not in str(stop.value)


def test_bad_source_and_options_are_refused(data):
    with pytest.raises(ValueError, match="source must be one of"):
        module(data / "wds15", "webdataset")
    with pytest.raises(ValueError, match="val_fraction"):
        module(data / "wds15", "wds/imagenet", val_fraction=0.1)
    with pytest.raises(ValueError, match="split 'nope' is not in"):
        module(data / "wds15", "wds/imagenet", train_split="nope").num_classes  # noqa: B018


def test_resume_is_stated_not_exact(data, caplog):
    dm = module(data / "wds15", "wds/imagenet")
    dm.train_order_seed = 3  # what ExactResume sets
    with caplog.at_level(logging.WARNING, logger="vitrel.data.imagenet"):
        dm.train_dataloader()
    assert "resumed mid-epoch is not exact" in caplog.text


@pytest.mark.slow
def test_mid_epoch_resume_restarts_the_epoch_stream_as_documented(data, tmp_path):
    """What docs/data.md says a mid-epoch resume does on shards: Lightning warns, the interrupted epoch's
    stream starts again from its beginning and the epoch ends after the batches it still owed (8 of 12
    after a checkpoint at step 4), so its first 20 samples are seen twice and 20 others not at all."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(**kw):
        L.seed_everything(0)
        probe = Probe(str(tmp_path))
        trainer = fit_only_trainer(tmp_path, max_epochs=1, **kw.pop("trainer", {"enable_checkpointing": False}))
        trainer.fit(probe, datamodule=module(data / "wds15", "wds/imagenet"), **kw)
        return [rec[2] for rec in probe.seen]

    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1, filename="{step}")
    full = fit(trainer=dict(callbacks=[ckpt]))
    assert len(full) == 12 and sorted(i for b in full for i in b) == list(range(N))
    with pytest.warns(UserWarning, match="not resumable"):
        resumed = fit(ckpt_path=str(tmp_path / "step=4.ckpt"))
    assert len(resumed) == 8
    assert resumed[:4] == full[:4]  # the stream starts again: the epoch's first 20 samples, again
    assert len({i for b in full[:4] + resumed for i in b}) == 40  # 20 of the 60 not seen in this epoch


# ---------------------------------------------------------------------------------------------------
# 2 DDP ranks x 2 workers (forked, killed after a timeout: a hang fails)


def free_port() -> int:
    """A free TCP port for a process group."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_isolated(target, *args, timeout: float = 240) -> None:
    """``target(*args)`` in a fresh process (forked from a server that has run no test: tests/preloaded.py), in its
    own process group: it forks the ranks and their loader workers, which a pytest worker that has already run
    autograd must not do (torch refuses autograd in a child forked after its threads started); killed with them if
    it runs past ``timeout`` s: a hang fails the test instead of blocking."""
    ctx = multiprocessing.get_context(preloaded())
    proc = ctx.Process(target=_in_own_group, args=(target, *args))
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        os.killpg(proc.pid, signal.SIGKILL)
        proc.join()
        pytest.fail(f"{target.__name__}{args} hung (> {timeout} s)")
    assert proc.exitcode == 0, f"{target.__name__}{args} failed (exit code {proc.exitcode}; its error is above)"


def _in_own_group(target, *args) -> None:
    os.setsid()
    target(*args)


def _in_turn(calls) -> None:
    """``target(*args, port)`` for each ``(target, args)`` of ``calls`` in turn, a free port each (the ranks of one
    are gone before the next forks its own)."""
    for target, args in calls:
        target(*args, free_port())


@pytest.fixture(scope="module")
def ddp_runs(data, tmp_path_factory):
    """The three multi-process bodies (``_fit``, ``_iterate``, then ``_validate``) in one fresh process
    (:func:`run_isolated`, one for all), each writing to its own folder; the tests below read them (none writes
    there)."""
    fit, iterate, val = (tmp_path_factory.mktemp(f"ddp_{name}") for name in ("fit", "iterate", "validate"))
    run_isolated(
        _in_turn,
        [
            (_fit, (str(data / "wds15"), "wds/imagenet", str(fit), 2)),
            (_iterate, (str(data), str(iterate))),
            (_validate, (str(data / "wds5"), str(val))),
        ],
        timeout=480,
    )
    return fit, iterate, val


@pytest.mark.slow
def test_ddp_training_epochs_cover_every_sample_once(ddp_runs):
    """Lightning, 2 ranks (gloo) x 2 workers, 4 shards of 15, batch 5, 2 epochs: each rank trains 6 steps
    an epoch, the 60 samples each seen exactly once an epoch, and the ranks' shares change with the epoch
    (timm's shard shuffle is seeded by seed + the trainer's epoch)."""
    out = ddp_runs[0]
    seen = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for epoch in (0, 1):
        per_rank = [[rec for rec in s if rec[0] == epoch] for s in seen]
        assert [len(r) for r in per_rank] == [epoch_samples_per_rank(N, 2, 2, B) // B] * 2 == [6, 6]
        ids = [i for r in per_rank for rec in r for i in rec[2]]
        assert sorted(ids) == list(range(N))  # no sample twice, none left out
        assert all(rec[3] == [i // PER_CLASS for i in rec[2]] for r in per_rank for rec in r)  # labels
    shares = [[{i for rec in s if rec[0] == e for i in rec[2]} for e in (0, 1)] for s in seen]
    assert shares[0][0] != shares[0][1]


@pytest.mark.slow
def test_ddp_uneven_shards_equal_batches_disjoint_workers(ddp_runs):
    """torch.distributed (gloo), 2 ranks x 2 workers iterating the training loader of 5 uneven shards (wds)
    and 5 parquet files (hfids): every rank the same number of batches, every worker 15 samples, and no
    sample in two workers' streams (a worker repeats its own shards to fill its share)."""
    out = ddp_runs[1]
    for name in ("wds", "hfids"):
        streams = json.loads((out / f"{name}.json").read_text())  # [rank][worker] -> ids
        assert [len(s) for rank in streams for s in rank] == [15] * 4, name
        distinct = [set(s) for rank in streams for s in rank]
        assert sum(len(s) for s in distinct) == len(set().union(*distinct)), name  # disjoint


@pytest.mark.slow
def test_ddp_evaluation_of_uneven_shards_scores_each_sample_once(ddp_runs):
    """2 ranks x 2 workers over a validation split of 12 samples in shards of 5, 5, 2: every sample scored once, 7
    on rank 0 (shards 0 and 2, one a worker) and 5 on rank 1 (shard 1; its second worker idle), in the batches its
    loader's length says. timm's own reader gives each worker with a shard ceil(12 / 4) = 3 samples there: one sample
    scored twice, 4 left out (an audit's 8-image split on 2 ranks: a class of 4 scored 5 times, the other 3); with 2
    shards its rank 1 had none, ran no validation and the run hung. A split of fewer shards than ranks is refused
    (one line). The run's split size is the split's 12, not a rank's share (the closing line compared the images
    scored with it, and the fit's opening line counted one rank's share of each split)."""
    ranks = json.loads((ddp_runs[1] / "eval.json").read_text())
    ids = [i for r in ranks for i in r["ids"]]
    assert sorted(ids) == list(range(len(CLASSES) * VAL_PER_CLASS))
    assert [len(r["ids"]) for r in ranks] == [7, 5] and [r["batches"] for r in ranks] == [[2, 2], [1, 1]]
    assert ranks[0]["one_shard"].startswith("ShardCountError: wds/imagenet split 'validation' has 1 shards for 2 ranks")
    assert [r["split_size"] for r in ranks] == [12, 12]
    assert ranks[0]["sizes"].startswith(f"train {N} images, val 12 (")  # the fit's opening line


@pytest.mark.slow
def test_lightning_validates_uneven_ranks_of_shards_under_ddp(ddp_runs):
    """``trainer.validate`` on 2 ranks (gloo) x 2 workers over the validation split of shards 5, 5, 2: the ranks run
    2 and 1 batches (7 and 5 samples) and end the pass together, each sample once, and a metric synced over the
    ranks counts all 12 (a rank without a batch hung such a run: test above)."""
    ranks = [json.loads((ddp_runs[2] / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [len(r["ids"]) for r in ranks] == [7, 5] and sorted(i for r in ranks for i in r["ids"]) == list(range(12))
    assert [r["counted"] for r in ranks] == [12, 12]


# ---------------------------------------------------------------------------------------------------
# the forked bodies


class Probe(L.LightningModule):
    """Records (epoch, step, sample indices, labels) of every training batch; writes them at the end."""

    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = out
        self.head = torch.nn.Linear(3, 3)
        self.seen: list = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        ids, _ = ids_of(x)
        self.seen.append([self.current_epoch, batch_idx, ids, y.tolist()])
        return torch.nn.functional.cross_entropy(self.head(x.mean((2, 3))), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_train_end(self) -> None:
        Path(self.out, f"rank{self.global_rank}.json").write_text(json.dumps(self.seen))


def _fit(root: str, source: str, out: str, epochs: int, port: int) -> None:
    torch.multiprocessing.start_processes(
        _fit_rank, args=(root, source, out, epochs, port), nprocs=2, start_method="fork"
    )


def _fit_rank(rank: int, root: str, source: str, out: str, epochs: int, port: int) -> None:
    """One DDP rank as a launcher (torchrun, SLURM) starts it: Lightning reads the rank from the environment
    (forked here, where Lightning's own fork launcher refuses a process that has touched CUDA)."""
    from datetime import timedelta

    from lightning.pytorch.strategies import DDPStrategy

    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0", LOCAL_RANK=str(rank))
    os.environ.update(env, RANK=str(rank))
    ddp = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=60))
    trainer = fit_only_trainer(out, devices=2, strategy=ddp, max_epochs=epochs, enable_checkpointing=False)
    trainer.fit(Probe(out), datamodule=module(root, source))


class ValProbe(L.LightningModule):
    """Records the sample indices of every validation batch and counts them over the ranks (torchmetrics, synced
    at the epoch's end); writes both at the end."""

    def __init__(self, out: str) -> None:
        super().__init__()
        import torchmetrics

        self.out, self.ids, self.count = out, [], torchmetrics.SumMetric()

    def validation_step(self, batch, batch_idx):
        x, _ = batch
        self.ids += ids_of(x)[0]
        self.count.update(torch.tensor(float(len(x))))

    def on_validation_epoch_end(self) -> None:
        counted = int(self.count.compute())
        Path(self.out, f"rank{self.global_rank}.json").write_text(json.dumps({"ids": self.ids, "counted": counted}))


def _validate(root: str, out: str, port: int) -> None:
    torch.multiprocessing.start_processes(_validate_rank, args=(root, out, port), nprocs=2, start_method="fork")


def _validate_rank(rank: int, root: str, out: str, port: int) -> None:
    from datetime import timedelta

    from lightning.pytorch.strategies import DDPStrategy

    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0", LOCAL_RANK=str(rank))
    os.environ.update(env, RANK=str(rank))
    ddp = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=60))
    quiet = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=out)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ddp, **quiet)
    trainer.validate(ValProbe(out), datamodule=module(root, "wds/imagenet"))


def _iterate(base: str, out: str, port: int) -> None:
    torch.multiprocessing.start_processes(_iterate_rank, args=(base, out, port), nprocs=2, start_method="fork")


def _iterate_rank(rank: int, base: str, out: str, port: int) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    for name, source, root in (("wds", "wds/imagenet", f"{base}/wds13"), ("hfids", f"hfids/{base}/hf13", out)):
        loader = module(root, source).train_dataloader()
        streams: list[list[int]] = [[], []]
        for k, (x, _) in enumerate(loader):
            streams[k % 2] += ids_of(x)[0]
        batches = torch.tensor([len(loader), sum(map(len, streams)) // B])
        gathered = [torch.zeros_like(batches) for _ in range(2)]
        dist.all_gather(gathered, batches)  # a rank with fewer batches would fail here (or hang: the timeout)
        assert all(torch.equal(g, gathered[0]) for g in gathered), gathered
        both: list = [None, None]
        dist.all_gather_object(both, streams)
        if rank == 0:
            Path(out, f"{name}.json").write_text(json.dumps(both))
    _evaluate_rank(rank, f"{base}/wds5", out)
    dist.destroy_process_group()


def _evaluate_rank(rank: int, root: str, out: str) -> None:
    """The validation loader of 12 samples in shards of 5, 5, 2 on this rank: the samples it scores, its batches
    (its length, and those it yields), the split size the run reports."""
    import torch.distributed as dist

    from vitrel.train.progress import data_sizes
    from vitrel.train.summary import split_size

    dm = module(root, "wds/imagenet")
    dm.setup("fit")
    loader = dm.val_dataloader()
    batches = [ids_of(x)[0] for x, _ in loader]
    ids = [i for b in batches for i in b]
    both: list = [None, None]
    said = {"ids": ids, "batches": [len(loader), len(batches)], "split_size": split_size(loader)}
    said["sizes"] = data_sizes(dm)
    try:  # (wds13: the 12 validation samples in one shard)
        module(str(Path(root).parent / "wds13"), "wds/imagenet").val_dataloader()
    except ShardCountError as e:
        said["one_shard"] = f"{type(e).__name__}: {e}"
    dist.all_gather_object(both, said)
    if rank == 0:
        Path(out, "eval.json").write_text(json.dumps(both))


# ---------------------------------------------------------------------------------------------------
# a sample that cannot be decoded: named by shard and key, raised (default) or skipped and reported


@pytest.fixture(scope="module")
def bad_shards(tmp_path_factory):
    """2 classes x 4 training images in shards of 4 (wds tars and parquet files), one of them not an image."""
    base = tmp_path_factory.mktemp("bad_shards")
    tree = base / "tree"
    for split, n in (("train", 4), ("val", 1)):
        for c, name in enumerate(CLASSES[:2]):
            (tree / split / name).mkdir(parents=True)
            for k in range(n):
                Image.new("RGB", (SIZE, SIZE), (10 * k, 80 * c, 7)).save(tree / split / name / f"{name}_{k}.png")
    (tree / "train" / CLASSES[0] / f"{CLASSES[0]}_1.png").write_bytes(b"not an image")
    info = write_wds(tree, base / "wds", shard_size=4, seed=None)  # the file order: the bad one is sample 1
    write_hf(tree, base / "hf", shard_size=4, seed=None)
    return base, info


def _one_epoch(dm: ImageNetDataModule) -> int:
    dm.setup("fit")
    return sum(len(y) for _, y in dm.train_dataloader())


@pytest.mark.parametrize("source, where", [
    ("wds/imagenet", "shard {root}/imagenet-train-000000.tar, sample key '00000001'"),
    ("hfids/{root}", "data set {root}, split 'train', image 'n0001_1.png'"),
])  # fmt: skip
def test_an_undecodable_sample_is_named_and_raises_by_default(bad_shards, source, where):
    from vitrel.data.shards import BadSampleError

    base, _ = bad_shards
    root = base / ("wds" if source.startswith("wds") else "hf")
    dm = module(root, source.format(root=root), num_workers=0, batch_size=2)
    assert dm.on_bad_sample == "raise"
    with pytest.raises(BadSampleError, match="cannot decode the sample") as err:
        _one_epoch(dm)
    assert where.format(root=root) in str(err.value) and "on_bad_sample=skip" in str(err.value)


@pytest.mark.parametrize("source, where", [
    ("wds/imagenet", "shard {root}/imagenet-train-000000.tar, sample key '00000001'"),
    ("hfids/{root}", "data set {root}, split 'train', image 'n0001_1.png'"),
])  # fmt: skip
def test_skip_leaves_the_sample_out_and_reports_it_at_the_end_of_the_epoch(bad_shards, source, where, caplog):
    base, _ = bad_shards
    root = base / ("wds" if source.startswith("wds") else "hf")
    dm = module(root, source.format(root=root), num_workers=0, batch_size=2, on_bad_sample="skip")
    with caplog.at_level(logging.WARNING, logger="vitrel.data.shards"):
        assert _one_epoch(dm) == 8  # timm's readers fill the epoch from the worker's other samples
    named = where.format(root=root)
    assert f"skipped {named}: cannot decode it" in caplog.text
    assert f"skipped 1 undecodable sample(s) in this pass over the epoch: {named}" in caplog.text


def test_on_bad_sample_is_checked(bad_shards):
    with pytest.raises(ValueError, match="on_bad_sample must be one of"):
        module(bad_shards[0] / "wds", "wds/imagenet", on_bad_sample="ignore")


# ---------------------------------------------------------------------------------------------------
# 16-bit images in shards: scaled to 8 bits as in class folders, not clipped by the readers' convert("RGB")


@pytest.mark.parametrize("source", ["wds/imagenet", "hfids/{root}", "hfds/{root}"])
def test_16_bit_images_in_shards_are_scaled_not_clipped(tmp_path, source):
    """A 16-bit grey PNG (microscopy, medical) at 32768 of 65535 is mid-grey: timm's readers decoded it with
    ``convert("RGB")``, which clips at 255 (white); the batch's pixels are ``round(v * 255 / 65535)`` = 128, as
    ``data=imagenet`` folders give (:func:`vitrel.data.datasets.to_8bit`). Checked on every pixel of a
    16-px image, through the module's eval pipeline (resize to the same size: the values stay)."""
    import numpy as np

    from vitrel.data.shards import write_hf, write_wds

    tree = tmp_path / "tree"
    for split in ("train", "val"):
        for c, name in enumerate(CLASSES[:2]):
            (tree / split / name).mkdir(parents=True)
            for k in range(2):
                v = 32768 if c == 0 else 1000 * (k + 1)
                Image.fromarray(np.full((SIZE, SIZE), v, dtype=np.uint16)).save(tree / split / name / f"{name}_{k}.png")
    assert Image.open(tree / "val" / CLASSES[0] / f"{CLASSES[0]}_0.png").mode in ("I;16", "I")
    root = tmp_path / "shards"
    (write_wds if source.startswith("wds") else write_hf)(tree, root, shard_size=4, seed=None)
    dm = module(root, source.format(root=root), num_workers=0, batch_size=2)
    dm.setup("test")
    xs, ys = zip(*[(x, y) for x, y in dm.test_dataloader()])
    x, y = torch.cat(xs), torch.cat(ys)
    mean, std = torch.tensor(dm.mean)[:, None, None], torch.tensor(dm.std)[:, None, None]
    pixels = (x * std + mean) * 255
    want = {0: [128.0], 1: [round(1000 * 255 / 65535), round(2000 * 255 / 65535)]}
    for img, label in zip(pixels, y.tolist()):
        assert (img - img.flatten()[0]).abs().max() < 0.01, "one value per image"
        assert any(abs(float(img.flatten()[0]) - w) < 0.01 for w in want[label]), (label, float(img.flatten()[0]))


def test_a_brace_pattern_without_a_count_is_a_split_of_unknown_size(data):
    """A val split given as a brace pattern of tars without ``|<n>``: timm's reader says 0 samples, which the fit's
    ``data:`` line and ``eval.py`` gave as the split's size ("12 of its 0 images: trainer.limit_test_batches"); the
    size is unknown (``?``, None), and every sample is still read."""
    from vitrel.train.progress import data_sizes
    from vitrel.train.summary import split_size

    tars = sorted(p.name for p in (data / "wds15").glob("imagenet-validation-*.tar"))
    pattern = f"imagenet-validation-{{000000..{len(tars) - 1:06d}}}.tar"
    dm = module(data / "wds15", "wds/imagenet", num_workers=0, val_split=pattern)
    dm.setup("fit")
    assert "val ? (" in data_sizes(dm), data_sizes(dm)
    loader = dm.val_dataloader()
    assert split_size(loader) is None
    assert sum(len(y) for _, y in loader) == len(CLASSES) * VAL_PER_CLASS


def test_keys_with_dots_are_named_as_the_cause(bad_shards, tmp_path):
    """Shards of one's own whose file names have dots before the extension (``photo.v2_0001.png``): webdataset reads
    key ``photo``, extension ``v2_0001.png``, and the sample has no ``png`` nor ``cls``. The error said ``KeyError:
    'cls'`` and advised ``data.on_bad_sample=skip``, which leaves out every sample; it names the dots and the fix."""
    import io
    import tarfile

    from vitrel.data.shards import BadSampleError

    base, _ = bad_shards
    shutil.copytree(base / "wds", tmp_path / "wds")
    for tar in (tmp_path / "wds").glob("*.tar"):
        with tarfile.open(tar) as t:
            members = [(m, t.extractfile(m).read()) for m in t.getmembers() if m.isfile()]
        with tarfile.open(tar, "w") as t:
            for m, payload in members:
                key, ext = m.name.split(".", 1)
                info = tarfile.TarInfo(f"photo.{key}.{ext}")
                info.size = len(payload)
                t.addfile(info, io.BytesIO(payload))
    dm = module(tmp_path / "wds", "wds/imagenet", num_workers=0, batch_size=2)
    with pytest.raises(BadSampleError, match=r"sample key 'photo': .*webdataset cuts a file name at its first") as e:
        _one_epoch(dm)
    assert "on_bad_sample=skip" not in str(e.value) and "keys without dots" in str(e.value)


def test_a_training_brace_pattern_without_a_count_names_the_fix(data):
    """A training split given as a brace pattern without ``|<n>`` and no ``data.num_samples``: timm's reader stops
    with "Invalid split definition, num_samples not specified in train mode" (a traceback from timm); one error
    naming both fixes, which then work."""
    tars = sorted(p.name for p in (data / "wds15").glob("imagenet-train-*.tar"))
    pattern = f"imagenet-train-{{000000..{len(tars) - 1:06d}}}.tar"
    dm = module(data / "wds15", "wds/imagenet", num_workers=0, train_split=pattern)
    with pytest.raises(ValueError, match=r"states no number of samples .*\|<samples>'\", or give data.num_samples="):
        dm.setup("fit")
        dm.train_dataloader()
    dm = module(data / "wds15", "wds/imagenet", num_workers=0, train_split=pattern, num_samples=N)
    dm.setup("fit")
    assert sum(len(y) for _, y in dm.train_dataloader()) == N
