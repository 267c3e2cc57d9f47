"""A researcher's own data set in the first hour: a ``LightningDataModule`` of their own named by a ``conf/data``
file (``hydra.searchpath``), as docs/data.md's "Your own data" has it, trained with ``train.py``, then its
checkpoint scored by ``eval.py``, predicted by ``predict.py`` and loaded by ``vitrel.load_model``. What it lacks or
gets wrong (its sizes, labels 1..C, float labels, no normalisation) is said in one line, not a traceback deep in
torch or a silent default."""

from __future__ import annotations

import json

import lightning as L
import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader, TensorDataset

import vitrel
from tests.train_helpers import FAST, TINY_VIT, compose, run_script_forked
from vitrel.inference import load_predictor, predict_folder
from vitrel.train.evaluate import evaluate
from vitrel.train.run import train

SHORT = ["trainer.max_epochs=2", "logger=none"]
NAMES = ["dark", "mid", "bright"]


class GreyData(L.LightningDataModule):
    """A user's own data module: grey images (1 channel) of ``size`` (H, W) as float tensors in 0-1, class ``c`` of
    brightness ``c / 2``, labels ``c + offset`` of ``dtype``; ``mean``, ``std`` (0 and 1: none applied) and
    ``class_names`` (``names``, else three) unless ``plain``; ``said``: an ``img_size`` other than its images';
    ``sized=False``: without ``num_classes`` / ``in_chans`` / ``img_size``. No ``img_size`` argument: its images are
    of its own size."""

    def __init__(
        self, size=(16, 16), offset=0, dtype="int64", plain=False, sized=True, said=None, names=None, seed=0, n=48,
        batch_size=16,
    ):  # fmt: skip
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        y = torch.arange(n) % 3
        self.x = (y.float()[:, None, None, None] / 2 + 0.05 * torch.randn(n, 1, *size, generator=g)).clamp(0, 1)
        self.y = (y + offset).to(getattr(torch, dtype))
        self.batch_size = batch_size
        if sized:
            self.num_classes, self.in_chans = 3, 1
            self.img_size = size[0] if size[0] == size[1] else list(size)  # (a side, or [H, W])
            self.img_size = self.img_size if said is None else said  # (said: another size than its images')
        if not plain:
            self.mean, self.std, self.class_names = (0.0,), (1.0,), list(names or NAMES)

    def _loader(self, shuffle=False):
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.batch_size, shuffle=shuffle)

    def train_dataloader(self):
        return self._loader(shuffle=True)

    def val_dataloader(self):
        return self._loader()

    test_dataloader = val_dataloader


@pytest.fixture(scope="module")
def conf(tmp_path_factory):
    """``my_conf/data/grey.yaml``: the user's config file of the data module, found by ``hydra.searchpath``."""
    root = tmp_path_factory.mktemp("my_conf")
    (root / "data").mkdir()
    (root / "data" / "grey.yaml").write_text(f"_target_: {__name__}.GreyData\nbatch_size: 16\n")
    return [f"hydra.searchpath=[file://{root}]", "data=grey"]


def _data(conf, size=(16, 16), **kwargs) -> list[str]:
    return [*conf, f"+data.size=[{size[0]},{size[1]}]", *(f"+data.{k}={v}" for k, v in kwargs.items())]


def _train(run, conf, size, epochs=2, **kwargs):
    """``train.py`` of the tiny ViT on ``GreyData`` (``epochs`` of 3 steps); its metrics.json."""
    train(compose(run, [*TINY_VIT, *FAST[2:4], *SHORT, f"trainer.max_epochs={epochs}", *_data(conf, size, **kwargs)]))
    return json.loads((run / "metrics.json").read_text())


@pytest.mark.parametrize("size", [(16, 16), (16, 24)])
def test_own_data_module_trains_then_eval_predict_and_load_model_take_its_checkpoint(conf, tmp_path, size):
    """Square and non-square images ([H, W]: the model built at that size): the run trains, ``eval.py`` scores its
    checkpoint on the same data at the size it was trained at (the data module takes no ``img_size``), ``predict.py``
    labels image files with its class names and normalisation, ``vitrel.load_model`` gives timm the data config."""
    saved = _train(tmp_path / "run", conf, size, epochs=15)  # (learned: predict.py's labels below are all right)
    assert saved["status"] == "finished" and saved["metrics"]["test/acc1"] == 1.0, saved["metrics"]
    metrics = evaluate(compose(tmp_path / "eval", [f"ckpt_path={tmp_path / 'run'}", *_data(conf, size)], "eval"))
    assert metrics["test/acc1"] == pytest.approx(saved["metrics"]["test/acc1"])
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    model = vitrel.load_model(ckpt)
    assert (model.pretrained_cfg["input_size"], model.pretrained_cfg["mean"]) == ((1, *size), (0.0,))
    files = tmp_path / "images"
    files.mkdir()
    for c in range(3):  # 8-bit grey PNGs of each class's brightness
        Image.fromarray(np.full(size, round(c / 2 * 255), np.uint8)).save(files / f"c{c}.png")
    rows = predict_folder(load_predictor(ckpt), files, topk=1, progress=False).rows
    assert [(r["filename"], r["label"]) for r in rows] == [("c0.png", "dark"), ("c1.png", "mid"), ("c2.png", "bright")]


def test_a_data_module_without_its_sizes_is_one_line_naming_them(conf, tmp_path):
    """A data module without ``num_classes`` / ``in_chans`` / ``img_size``: ``train.py`` names them in one line
    (it was an ``AttributeError`` traceback, one attribute at a time)."""
    args = [*TINY_VIT, *FAST[2:4], *SHORT, *_data(conf, sized=False), f"hydra.run.dir={tmp_path}/r"]
    r = run_script_forked("train.py", args, cwd=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("train.py: ConfigError: GreyData has no num_classes, in_chans, img_size: "), last


def test_labels_1_to_c_are_one_line_saying_so(conf, tmp_path):
    """Labels ``1..C`` with ``num_classes=C``: one line naming the targets and the fix (it was torch's ``IndexError:
    Target 3 is out of bounds`` from ``F.cross_entropy``, under a traceback)."""
    args = [*TINY_VIT, *FAST[2:4], *SHORT, *_data(conf, offset=1), f"hydra.run.dir={tmp_path}/r"]
    r = run_script_forked("train.py", args, cwd=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("train.py: TargetError: the batch holds targets 1..3, but the model has 3 classes"), last
    assert last.endswith('labels 1..3? subtract 1 (docs/data.md, "Your own data")'), last


@pytest.mark.parametrize(("offset", "dtype"), [(0, "float32"), (-100, "int64")])
def test_float_targets_and_the_ignore_index_are_refused(conf, tmp_path, offset, dtype):
    """Float labels (torch's ``expected target dtype to be Long``), and ``-100`` (``F.cross_entropy``'s
    ``ignore_index``, which the loss leaves out: torchmetrics' input check stopped the eager step, the fast step's
    metrics have none): refused at the first batch, naming them."""
    from vitrel.train.data_contract import TargetError

    with pytest.raises(TargetError, match="float" if offset == 0 else r"targets -100\.\.-98"):
        _train(tmp_path, conf, (16, 16), offset=offset, dtype=dtype)


def test_the_fast_step_refuses_float_targets_without_reading_the_device():
    """The fast step (``sync_free``) skipped the target check (its range reads the device): float labels were torch's
    ``RuntimeError: expected target dtype to be Long or Byte``. Their type and dtype need no read: refused by name."""
    from vitrel.train.data_contract import TargetError
    from vitrel.train.module import ClassifierModule

    module = ClassifierModule(torch.nn.Linear(4, 3), num_classes=3, sync_free=True)
    with pytest.raises(TargetError, match=r"targets are float \(torch.float32\)"):
        module.training_step((torch.zeros(2, 4), torch.tensor([0.0, 2.0])), 0)


def test_eval_refuses_targets_out_of_range(conf, tmp_path):
    """``eval.py`` on data whose labels are shifted (1..C) from those the model was trained on: refused, not an
    index error."""
    from vitrel.train.data_contract import TargetError

    _train(tmp_path / "run", conf, (16, 16))
    with pytest.raises(TargetError, match="labels 1..3"):
        evaluate(compose(tmp_path / "eval", [f"ckpt_path={tmp_path / 'run'}", *_data(conf, offset=1)], "eval"))


def test_a_data_module_without_mean_and_std_is_warned_of(conf, tmp_path):
    """No ``mean`` / ``std``: the checkpoints store no preprocessing, so ``predict.py`` would normalise with the
    architecture's defaults; ``train.py`` says so (it said nothing)."""
    with pytest.warns(UserWarning, match="GreyData has no mean and std: the checkpoints store no preprocessing"):
        _train(tmp_path, conf, (16, 16), plain=True)


def test_images_of_another_size_than_the_data_module_says_are_refused(conf, tmp_path):
    """Images of 32 px from a data module whose ``img_size`` says 16: the model (built at 16, run on any grid) trained
    on them silently, and its checkpoints said 16 (``predict.py`` resized files to 16, ``eval.py`` reported 16).
    Refused at the first batch, naming both."""
    from vitrel.models.input_size import InputSizeError

    with pytest.raises(InputSizeError, match=r"GreyData's (train|val) images are 1x32x32 .* say 1x16x16"):
        _train(tmp_path, conf, (32, 32), said=16)


def test_a_subclass_of_vitrels_data_modules_is_checked_as_ones_own():
    """A data module of one's own written as a subclass of one of vitrel's (here ``ArrayDataModule``, whose
    loaders give 32 px, saying 16) was taken for vitrel's: its batches and its class names were not checked."""
    from vitrel.config import ConfigError
    from vitrel.data import ArrayDataModule
    from vitrel.models.input_size import InputSizeError
    from vitrel.train.data_contract import CheckOwnBatches, check_data_module

    class Mine(ArrayDataModule):
        def setup(self, stage: str | None = None) -> None:
            super().setup(stage)
            self.img_size = 16  # (a bug of one's own: the loaders give 32 px)

    x, y = np.zeros((6, 32, 32), np.uint8), np.arange(6) % 3
    mine = Mine(train=(x, y), test=(x, y))
    mine.setup("fit")
    check = CheckOwnBatches(mine)
    with pytest.raises(InputSizeError, match=r"Mine's train images are 1x32x32 .* say 1x16x16"):
        check.on_train_batch_start(None, None, (torch.zeros(2, 1, 32, 32), torch.zeros(2)), 0)
    mine.class_names = ["a", "b"]  # (for 3 classes: refused as any data module's own)
    with pytest.raises(ConfigError, match="Mine has 2 class_names for its 3 classes"):
        check_data_module(mine)
    ours = CheckOwnBatches(ArrayDataModule(train=(x, y), test=(x, y)))
    ours.on_train_batch_start(None, None, (torch.zeros(2, 1, 16, 16), torch.zeros(2)), 0)  # (vitrel's: not checked)


def test_class_names_of_another_number_than_the_classes_are_refused(conf, tmp_path):
    """Two ``class_names`` for three classes: stored as they were, so ``predict.py`` labelled the third class ``2``;
    refused before the run, as ``ArrayDataModule`` now refuses them."""
    from vitrel.config import ConfigError
    from vitrel.data import ArrayDataModule

    with pytest.raises(ConfigError, match="GreyData has 2 class_names for its 3 classes"):
        _train(tmp_path, conf, (16, 16), names="[dark,mid]")
    x, y = np.zeros((6, 8, 8), np.uint8), np.arange(6) % 3
    with pytest.raises(ValueError, match="2 class_names for 3 classes"):
        ArrayDataModule(train=(x, y), test=(x, y), class_names=["a", "b"])


def test_names_as_targets_are_refused_saying_what_to_do():
    """A data set that returns class names as labels: the default collate gives a list of str, which
    ``F.cross_entropy`` refused with ``TypeError: cross_entropy_loss(): argument 'target' must be Tensor, not list``."""
    from vitrel.train.data_contract import TargetError, check_targets

    with pytest.raises(TargetError, match=r"targets are a list of str, not a tensor of class indices 0..2: map"):
        check_targets(["cat", "dog"], 3)


def test_eval_on_another_file_of_ones_own_takes_none_of_the_runs_data_settings(conf, tmp_path):
    """Two data files of one's own without a ``name`` (the set trained on, and another with ``seed: 7``): ``eval.py``
    on the second took the run's ``data.seed=0`` as "the data settings of last.ckpt's run" and scored the first set,
    silently. Without a name it takes none of them."""
    folder = tmp_path / "conf"
    (folder / "data").mkdir(parents=True)
    for name, seed in (("a", 0), ("b", 7)):
        (folder / "data" / f"{name}.yaml").write_text(f"_target_: {__name__}.GreyData\nseed: {seed}\n")
    search = f"hydra.searchpath=[file://{folder}]"
    args = [*TINY_VIT, *FAST[2:4], *SHORT, search, "data=a", f"hydra.run.dir={tmp_path / 'run'}"]
    r = run_script_forked("train.py", args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    evaluate(compose(tmp_path / "eval", [f"ckpt_path={tmp_path / 'run'}", search, "data=b"], "eval"))
    saved = json.loads((tmp_path / "eval" / "eval_metrics.json").read_text())
    assert saved["data_from_run"] == {}, saved["data_from_run"]


def test_a_name_in_the_file_of_a_class_without_one_is_not_passed_to_it(tmp_path):
    """docs/data.md's file sets ``name: mine`` (how ``eval.py`` knows the run's data) for a class whose ``__init__``
    takes no ``name``: ``TypeError: ... unexpected keyword argument 'name'`` before; the name is vitrel's, not passed.
    ``train.py`` records it; ``eval.py`` with the same file builds it too."""
    folder = tmp_path / "conf"
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "mine.yaml").write_text(f"_target_: {__name__}.GreyData\nname: mine\nseed: 3\n")
    conf = [f"hydra.searchpath=[file://{folder}]", "data=mine"]
    result = train(compose(tmp_path / "run", [*TINY_VIT, *FAST[2:4], *SHORT, *conf]))
    assert "val/acc1" in result and json.loads((tmp_path / "run" / "metrics.json").read_text())["data"] == "mine"
    evaluate(compose(tmp_path / "eval", [f"ckpt_path={tmp_path / 'run'}", *conf], "eval"))
    saved = json.loads((tmp_path / "eval" / "eval_metrics.json").read_text())
    assert saved["num_images"] == 48
