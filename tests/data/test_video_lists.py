"""data=video_list (vitrel/data/video/lists.py): "path label" lists (V-JEPA 2's, VideoMAE's) and Something-Something
v2's annotation files, written here in their formats over tiny real videos: the samples and labels are the files',
the clips those video_folder gives for the same files, each refusal one line naming what to fix, and train.py then
eval.py and predict.py on a list run."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate

from tests.data.test_video import data_config, needs_av, write_video
from vitrel.data import DatasetNotFoundError
from vitrel.data.video import VideoFolderDataModule, VideoListDataModule, VideoListError

# clips of 2 frames of 16 x 16, decoded in this process
SMALL = {"num_frames": 2, "stride": 1, "img_size": 16, "num_workers": 0, "pin_memory": False, "batch_size": 2}


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> Path:
    """root/clips/c<i>.mkv, 6 lossless videos of 5 to 10 frames (each frame its own brightness)."""
    root = tmp_path_factory.mktemp("lists")
    for i in range(6):
        write_video(root / "clips" / f"c{i}.mkv", 5 + i, hw=(16, 20))
    return root


def lists(root: Path, train: str, val: str) -> None:
    (root / "train.csv").write_text(train)
    (root / "val.csv").write_text(val)


def module(root: Path, **kwargs) -> VideoListDataModule:
    return VideoListDataModule(**{"root": root, "train_list": "train.csv", "val_list": "val.csv", **SMALL, **kwargs})


# ------------------------------------------------------------------------------------------------ "path label" lists
@needs_av
def test_a_path_label_list_gives_its_videos_and_labels(clips):
    """V-JEPA 2's / VideoMAE's lines: relative paths under data.root, absolute ones as they are, a blank line
    passed over; num_classes the largest label + 1 (label 1 never used), no names unless given."""
    lists(clips, f"clips/c0.mkv 0\n{clips}/clips/c1.mkv 2\n\nclips/c2.mkv 2\n", "clips/c3.mkv 0\n")
    dm = instantiate(data_config("video_list", root=clips, train_list="train.csv", val_list="val.csv"))
    assert type(dm) is VideoListDataModule and dm.name == "video_list"
    assert (dm.num_classes, dm.class_names) == (3, None)
    assert dm.raw_dataset("train") == [(f"{clips}/clips/c0.mkv", 0), (f"{clips}/clips/c1.mkv", 2),
                                       (f"{clips}/clips/c2.mkv", 2)]  # fmt: skip
    assert dm.raw_dataset("test") == [(f"{clips}/clips/c3.mkv", 0)]
    (clips / "names.txt").write_text("jump\nrun\nswim\n")
    named = module(clips, class_names="names.txt")
    assert (named.num_classes, named.class_names) == (3, ["jump", "run", "swim"])
    assert module(clips, class_names=["a", "b", "c", "d"]).num_classes == 4
    videos = module(clips, video_dir="clips")  # relative paths under root/video_dir
    lists(clips, "c0.mkv 0\nc1.mkv 1\n", "c3.mkv 1\n")
    assert videos.raw_dataset("train") == [(f"{clips}/clips/c0.mkv", 0), (f"{clips}/clips/c1.mkv", 1)]


@needs_av
def test_the_clips_are_video_folders_clips_of_the_same_files(clips, tmp_path):
    """The same files as class folders and as a list: equal evaluation samples (2 uniform clips per video), and
    equal training clips (random starts and crops) from the same seed."""
    import shutil

    order = [("a", 0), ("a", 1), ("b", 2), ("b", 3)]  # (the folders' order: class, then file name)
    for split, picked in (("train", order), ("val", order[1:3])):
        for cls, i in picked:
            (tmp_path / split / cls).mkdir(parents=True, exist_ok=True)
            shutil.copy(clips / "clips" / f"c{i}.mkv", tmp_path / split / cls / f"c{i}.mkv")
    lists(tmp_path, "".join(f"train/{c}/c{i}.mkv {'ab'.index(c)}\n" for c, i in order),
          "".join(f"val/{c}/c{i}.mkv {'ab'.index(c)}\n" for c, i in order[1:3]))  # fmt: skip
    kw = {**SMALL, "clips_per_video": 2, "augment": True}
    folder, listed = VideoFolderDataModule(root=tmp_path, **kw), module(tmp_path, **kw)
    a, b = folder.make_dataset("test"), listed.make_dataset("test")
    assert len(a) == len(b) == 2
    for i in range(2):
        assert a[i][0].shape == (2, 3, 2, 16, 16) and a[i][1] == b[i][1]
        assert torch.equal(a[i][0], b[i][0])
    a, b = folder.make_dataset("train", training=True), listed.make_dataset("train", training=True)
    for i in range(4):
        torch.manual_seed(i)
        x = a[i]
        torch.manual_seed(i)
        assert torch.equal(x[0], b[i][0]) and x[1] == b[i][1]


# ------------------------------------------------------------------------------------------------ SSv2's annotations
LABELS = {  # something-something-v2-labels.json's layout: template without brackets -> index, a string
    "Pushing something from right to left": "2",
    "Holding something next to something": "0",
    "Pushing something from left to right": "1",
}


def ssv2(root: Path, train: list[tuple[str, str]], val: list[tuple[str, str]]) -> None:
    """root/videos/<id>.webm (VP9) and the official annotation files, entries ``(id, template)``."""
    for vid, _ in [*train, *val]:
        if not (root / "videos" / f"{vid}.webm").exists():
            write_video(root / "videos" / f"{vid}.webm", 6, "libvpx-vp9", "yuv420p", hw=(16, 16))
    (root / "something-something-v2-labels.json").write_text(json.dumps(LABELS, indent=4))
    for name, entries in (("train", train), ("validation", val)):
        rows = [{"id": vid, "label": t.lower().replace("[", "").replace("]", ""), "template": t,
                 "placeholders": ["a pen", "a cup"][: t.count("[")]} for vid, t in entries]  # fmt: skip
        (root / f"something-something-v2-{name}.json").write_text(json.dumps(rows))


def ssv2_module(root: Path, **kwargs) -> VideoListDataModule:
    files = {"train_list": "something-something-v2-train.json", "val_list": "something-something-v2-validation.json"}
    files |= {"labels_file": "something-something-v2-labels.json", "video_dir": "videos"}
    return VideoListDataModule(root=root, **{**files, **SMALL, **kwargs})


@needs_av
def test_ssv2_annotations_give_ids_webm_files_and_the_templates_classes(tmp_path):
    ssv2(
        tmp_path,
        [("78687", "Holding [something] next to [something]"), ("42326", "Pushing [something] from left to right"),
         ("3", "Pushing [something] from right to left")],
        [("100", "Pushing [something] from right to left")],
    )  # fmt: skip
    dm = ssv2_module(tmp_path)
    assert dm.num_classes == 3
    assert dm.class_names == ["Holding something next to something", "Pushing something from left to right",
                              "Pushing something from right to left"]  # fmt: skip
    videos = tmp_path / "videos"
    assert dm.raw_dataset("train") == [
        (f"{videos}/78687.webm", 0),
        (f"{videos}/42326.webm", 1),
        (f"{videos}/3.webm", 2),
    ]
    assert dm.raw_dataset("test") == [(f"{videos}/100.webm", 2)]
    dm.setup("validate")
    clip, label = dm.dataset("val")[0]
    assert clip.shape == (3, 2, 16, 16) and label == 2


# ------------------------------------------------------------------------------------------------ refusals
def refused(dm: VideoListDataModule, error: type, match: str) -> str:
    with pytest.raises(error, match=match) as e:
        dm.setup("fit")
    return str(e.value)


@needs_av
def test_each_list_mistake_is_one_line_naming_it(clips):
    lists(clips, "clips/c0.mkv 0\nclips/c1.mkv 1\n", "clips/c2.mkv 1\n")
    refused(
        module(clips, train_list="nope.csv"), DatasetNotFoundError, rf"No file {clips}/nope.csv \(data.train_list\)"
    )
    refused(module(clips, video_dir="gone"), DatasetNotFoundError, rf"No folder {clips}/gone \(data.video_dir\)")
    for line in ("clips/c1.mkv one", "clips/c1.mkv 12 1", "clips/c1.mkv,1"):  # (TSN's "path frames label": 3 fields)
        lists(clips, f"clips/c0.mkv 0\n{line}\n", "clips/c2.mkv 1\n")
        said = refused(module(clips), VideoListError, rf"train.csv, line 2: '{line}' is not '<video path> <integer")
        assert said.startswith(f"{clips}/train.csv, line 2:") and "\n" not in said
    lists(clips, "clips/c0.mkv 0\nclips/c1.mkv 1\n", "clips/c2.mkv 1\nclips/c3.mkv 2\n")
    refused(module(clips), VideoListError, r"val.csv, line 2: label 2 is outside 0..1 \(2 classes: the largest label")
    refused(
        module(clips, num_classes=3, class_names=["a", "b"]), VideoListError, "data.num_classes: 3 but class names: 2"
    )
    lists(clips, "clips/c0.mkv -1\nclips/c1.mkv 1\n", "clips/c2.mkv 1\n")
    refused(module(clips), VideoListError, r"train.csv, line 1: label -1 is outside 0..1")
    lists(clips, "clips/c0.mkv 1\nclips/c1.mkv 1\n", "clips/c2.mkv 1\n")
    refused(module(clips), VideoListError, r"train.csv \(data.train_list\) has one class \(1\): a classifier needs two")
    lists(clips, "", "clips/c2.mkv 1\n")
    refused(module(clips), VideoListError, r"train.csv \(data.train_list\) lists no videos")


@needs_av
def test_listed_videos_that_do_not_exist_are_refused_at_setup(clips):
    """Named at setup (the first three, and how many), not by a DataLoader worker mid-epoch."""
    missing = "".join(f"clips/gone{i}.mkv {i % 2}\n" for i in range(5))
    lists(clips, f"clips/c0.mkv 0\n{missing}", "clips/c2.mkv 1\nclips/gone9.mkv 0\n")
    dm = module(clips)
    assert dm.num_classes == 2  # (the model is built before setup: the lists alone)
    said = refused(dm, VideoListError, rf"^5 of the 6 videos of {clips}/train.csv \(data.train_list\) do not exist: ")
    gone = ", ".join(f"{clips}/clips/gone{i}.mkv" for i in range(3))
    assert f"exist: {gone}, ... (relative paths are under {clips}: data.root/data.video_dir)" in said
    lists(clips, "clips/c0.mkv 0\nclips/c1.mkv 1\n", "clips/c2.mkv 1\nclips/gone9.mkv 0\n")
    with pytest.raises(VideoListError, match=rf"^1 of the 2 videos of {clips}/val.csv \(data.val_list\) do not exist"):
        module(clips).setup("validate")


@needs_av
def test_ssv2_mistakes_name_the_entry_or_the_missing_labels_file(tmp_path):
    ssv2(tmp_path, [("1", "Holding [something] next to [something]"), ("2", "Spinning [something]")],
         [("3", "Pushing [something] from left to right")])  # fmt: skip
    said = refused(ssv2_module(tmp_path), VideoListError, r"something-something-v2-train.json, entry 1 \(id 2\): ")
    assert said.endswith(
        f"its template 'Spinning something' (brackets removed) is not in {tmp_path}/something-something-v2-labels.json"
    )
    refused(ssv2_module(tmp_path, labels_file=None), VideoListError, r"annotation file: give data.labels_file=")
    (tmp_path / "something-something-v2-test.json").write_text(json.dumps([{"id": "4"}]))  # (no labels)
    no_labels = r"test.json, entry 0: \['id'\] has no 'id' and 'template' \(the test split's file has no labels"
    refused(ssv2_module(tmp_path, train_list="something-something-v2-test.json"), VideoListError, no_labels)


# ------------------------------------------------------------------------------------------------ train.py, eval.py
@needs_av
def test_train_py_then_eval_py_and_predict_py_on_a_list_run(clips, tmp_path):
    """``python train.py data=video_list ...`` (a tiny video ViT, CPU) stores the names file's class names; ``python
    eval.py ckpt_path=<its last.ckpt> data=video_list`` takes the lists from the run and scores the val list's
    videos; ``predict.py`` labels videos with the names. A mistake in a list ends train.py with its line alone."""
    from tests.train_helpers import FAST, run_script_forked

    root = tmp_path / "data"
    (root / "clips").mkdir(parents=True)
    for i in range(6):
        (root / "clips" / f"c{i}.mkv").symlink_to(clips / "clips" / f"c{i}.mkv")
    lists(root, "".join(f"clips/c{i}.mkv {i % 2}\n" for i in range(4)), "clips/c4.mkv 0\nclips/c5.mkv 1\n")
    (root / "names.txt").write_text("archery\nbowling\n")
    data = ["data=video_list", f"data.root={root}", "data.train_list=train.csv", "data.val_list=val.csv"]
    data += ["data.class_names=names.txt", "data.num_frames=2", "data.stride=1", "data.img_size=16"]
    data += ["data.pin_memory=false", "data.batch_size=2", "data.num_workers=0"]
    model = ["model=vit_video_tiny_fmnist", "model.embed_dim=16", "model.depth=1", "model.num_heads=2"]
    short = ["pos=rel3d_factored", "trainer.max_epochs=1", "trainer.limit_train_batches=1", "logger=none", *FAST[2:]]
    run = tmp_path / "run"
    r = run_script_forked("train.py", [*data, *model, *short, f"hydra.run.dir={run}"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    ckpt = run / "checkpoints" / "last.ckpt"
    stored = torch.load(ckpt, map_location="cpu", weights_only=True)["hyper_parameters"]["data_config"]
    assert stored["class_names"] == ["archery", "bowling"] and stored["num_frames"] == 2
    args = [f"ckpt_path={ckpt}", "data=video_list", "data.num_workers=0", "trainer.accelerator=cpu"]
    r = run_script_forked("eval.py", [*args, "progress_bar=none", f"hydra.run.dir={tmp_path}/eval"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    res = json.loads((tmp_path / "eval" / "eval_metrics.json").read_text())
    taken = res["data_from_run"]
    assert (taken["root"], taken["train_list"], taken["val_list"]) == (str(root), "train.csv", "val.csv")
    assert res["num_images"] == 2 and 0.0 <= res["metrics"]["test/acc1"] <= 1.0
    out = tmp_path / "pred.csv"
    args = [f"ckpt_path={ckpt}", f"input={root / 'clips'}", f"results_file={out}", "topk=2", "progress_bar=false"]
    r = run_script_forked("predict.py", [*args, f"hydra.run.dir={tmp_path}/pred"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 6 and all({r["label_0"], r["label_1"]} == {"archery", "bowling"} for r in rows)  # (names.txt)
    (root / "train.csv").write_text("clips/c0.mkv 0\nclips/c1.mkv\n")
    r = run_script_forked("train.py", [*data, *model, *short, f"hydra.run.dir={tmp_path}/bad"], cwd=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1] == (
        f"train.py: VideoListError: {root}/train.csv, line 2: 'clips/c1.mkv' is not '<video path> <integer label>' "
        "(one video a line, separated by a space, no header: V-JEPA 2's and VideoMAE's lists)"
    )
