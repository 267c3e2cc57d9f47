"""predict.py: top-k CSV for a folder of images from a .ckpt, an export folder or a .pt2 program."""

from __future__ import annotations

import csv
import logging
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from omegaconf import OmegaConf
from PIL import Image, ImageOps

import vitrel
import vitrel.train.predict as predict_module
from vitrel.export import main as export_main
from vitrel.inference import NoImagesError, PredictSettingsError, load_predictor, predict_folder
from vitrel.models.checkpoint import save_pretrained
from vitrel.train.predict import run_predict

ROOT = Path(__file__).resolve().parents[2]
NAMES = [f"class_{i}" for i in range(10)]


def _model():
    torch.manual_seed(0)
    return vitrel.create_model("vitrel_vit_tiny_patch4_32", pos="rel2d_factored", embed_dim=32, depth=1, num_heads=2)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A training checkpoint as vitrel.train writes it, with a data configuration in its hyper-parameters."""
    m = _model()
    path = tmp_path_factory.mktemp("ckpt") / "last.ckpt"
    data = dict(img_size=32, mean=[0.5, 0.5, 0.5], std=[0.25, 0.25, 0.25], crop_pct=1.0, class_names=NAMES)
    torch.save(
        {
            "vitrel_cfg": m.vitrel_cfg,
            "state_dict": {f"model.{k}": v for k, v in m.state_dict().items()},
            "hyper_parameters": {"num_classes": 10, "data_config": data},
        },
        path,
    )
    return path


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """RGB PNG and JPEG files of several sizes, a grey PNG, a corrupt .jpg and a text file."""
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for i, (h, w) in enumerate([(32, 32), (40, 28), (64, 64)]):
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(root / f"rgb_{i}.png")
    Image.fromarray(rng.integers(0, 255, (50, 45, 3), dtype=np.uint8)).save(root / "photo.jpg", quality=90)
    Image.fromarray(rng.integers(0, 255, (30, 30), dtype=np.uint8), mode="L").save(root / "grey.png")
    (root / "broken.jpg").write_bytes(b"\xff\xd8\xff not really a jpeg")
    (root / "notes.txt").write_text("not an image")
    return root


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_predict_script_on_a_folder(ckpt, images, tmp_path):
    out = tmp_path / "pred.csv"
    from tests.train_helpers import run_script_forked

    args = [f"ckpt_path={ckpt}", f"input={images}", f"results_file={out}", "topk=3", "batch_size=2"]
    res = run_script_forked("predict.py", [*args, f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "predicted 5 of 6 image(s), skipped 1 unreadable file(s)" in res.stdout
    # one logged line for the skipped file, not a Python warning with its source line under it
    said = [line for line in res.stdout.splitlines() if "broken.jpg" in line]
    assert len(said) == 1 and "] skipped broken.jpg: " in said[0], res.stdout[-3000:]
    assert "broken.jpg" not in res.stderr and "warnings.warn" not in res.stderr, res.stderr[-3000:]
    # not a terminal: progress as log lines (a tqdm bar's carriage returns garble a log), as train.py's and eval.py's
    assert "\r" not in res.stderr and "] predict: batch 3/3" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]
    rows = _rows(out)
    assert [r["filename"] for r in rows] == ["grey.png", "photo.jpg", "rgb_0.png", "rgb_1.png", "rgb_2.png"]
    assert list(rows[0]) == ["filename"] + [f"{c}_{i}" for i in range(3) for c in ("index", "label", "prob")]
    for r in rows:
        probs = [float(r[f"prob_{i}"]) for i in range(3)]
        assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1.0 + 1e-5
        assert r["label_0"] == NAMES[int(r["index_0"])]  # the class names stored with the checkpoint


def test_predict_script_fails_when_it_could_read_no_image(ckpt, images, tmp_path):
    """A run that found image files and read none (here the one it was given) exits 1 with one line naming the
    file and why, not 0 with a results file of its header only."""
    from tests.train_helpers import run_script_forked

    out = tmp_path / "pred.csv"
    args = [f"ckpt_path={ckpt}", f"input={images / 'broken.jpg'}", f"results_file={out}"]
    res = run_script_forked("predict.py", [*args, f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT)
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    said = res.stderr.strip().splitlines()[-1]
    assert said.startswith("predict.py: none of the 1 images under ") and "broken.jpg: " in said, res.stderr[-3000:]
    assert "Traceback" not in res.stderr and _rows(out) == []


def test_same_predictions_from_ckpt_export_folder_and_pt2(ckpt, images, tmp_path):
    out = tmp_path / "export"
    assert export_main([str(ckpt), str(out), "--pt2"]) == 0
    results = {}
    for src in (ckpt, out, out / "model.pt2"):
        p = load_predictor(src)
        res = predict_folder(p, images, topk=2, batch_size=4, progress=False)
        assert res.found == 6 and len(res.skipped) == 1 and len(res.rows) == 5
        results[str(src)] = res.rows
    a, b, c = results.values()
    for ra, rb, rc in zip(a, b, c):
        assert ra["index_0"] == rb["index_0"] == rc["index_0"]
        assert abs(ra["prob_0"] - rc["prob_0"]) < 1e-4 and abs(ra["prob_0"] - rb["prob_0"]) < 1e-4
    assert a[0]["label_0"] in NAMES and c[0]["label_0"] in NAMES  # the .pt2 keeps the data configuration


def test_a_program_of_one_size_is_fed_that_size_and_one_of_one_batch_is_refused(ckpt, images, tmp_path):
    """``python -m vitrel.export CKPT OUT --pt2 --dynamic batch --img-size 48``: a program of 48 px images, whose stored
    data config says the trained 32; ``predict.py`` fed it 32 px images and failed in torch's "Guard failed:
    x.size()[2] == 48". Now it resizes to the program's size (as the .ckpt at ``img_size=48``); a ``--dynamic static``
    program (a fixed batch of 2) is refused, naming the export options that work."""
    out = tmp_path / "b48"
    assert export_main([str(ckpt), str(out), "--pt2", "--dynamic", "batch", "--img-size", "48"]) == 0
    got = predict_folder(load_predictor(out / "model.pt2"), images, topk=2, batch_size=4, progress=False).rows
    ref = load_predictor(ckpt, model_overrides={"img_size": 48})
    ref = predict_folder(ref, images, topk=2, batch_size=4, progress=False).rows
    assert [r["index_0"] for r in got] == [r["index_0"] for r in ref] and len(got) == 5
    assert max(abs(a["prob_0"] - b["prob_0"]) for a, b in zip(got, ref)) < 1e-4
    out = tmp_path / "static"
    assert export_main([str(ckpt), str(out), "--pt2", "--dynamic", "static"]) == 0
    with pytest.raises(ValueError, match=r"model.pt2 takes a fixed batch of 2 .*: export with --dynamic hw or batch"):
        load_predictor(out / "model.pt2")


def test_a_16bit_image_is_predicted_as_its_8bit_scaling(ckpt, tmp_path):
    """A 16-bit grey PNG (medical, microscopy) was clipped to white by PIL's ``convert`` (99.6 % of a ramp's pixels at
    255): it is predicted as the same picture saved with 8 bits, ``round(v * 255 / 65535)``."""
    v = np.arange(0, 65536, 64, dtype=np.uint16)[: 32 * 32].reshape(32, 32)
    Image.fromarray(v).save(tmp_path / "a16.png")
    Image.fromarray(np.rint(v * (255 / 65535)).astype(np.uint8), mode="L").save(tmp_path / "b8.png")
    rows = predict_folder(load_predictor(ckpt), tmp_path, topk=10, batch_size=2, progress=False).rows
    assert [r["filename"] for r in rows] == ["a16.png", "b8.png"]
    a, b = rows
    assert [a[f"index_{i}"] for i in range(10)] == [b[f"index_{i}"] for i in range(10)]
    assert [a[f"prob_{i}"] for i in range(10)] == pytest.approx([b[f"prob_{i}"] for i in range(10)], abs=1e-6)


#: EXIF orientation -> the stored pixels of an upright picture ``a`` (the EXIF spec's meanings, in numpy: 6 is a
#: photo a viewer turns 90 degrees clockwise, so stored turned 90 degrees anticlockwise)
STORED = {
    2: lambda a: a[:, ::-1],
    3: lambda a: a[::-1, ::-1],
    4: lambda a: a[::-1],
    5: lambda a: a.transpose(1, 0, 2),
    6: lambda a: np.rot90(a, 1),
    7: lambda a: np.rot90(a, 2).transpose(1, 0, 2),
    8: lambda a: np.rot90(a, -1),
}


def _rows_by_name(rows: list[dict]) -> dict[str, dict]:
    return {r.pop("filename"): r for r in [dict(r) for r in rows]}


def test_phone_photos_are_scored_as_stored_with_a_warning_or_upright_on_request(ckpt, tmp_path, caplog):
    """A phone photo stores its pixels turned and an EXIF orientation saying how to show them; predict.py read the
    pixels as stored (as the training data sets, timm and torchvision's decode_image by default do) without a word:
    a quarter turn changed the top-1 class of 89 % of 500 Fashion-MNIST test images for a 4-epoch train.py run
    (accuracy 66 % -> 10 %). As stored is still the default (what training saw), counted in one warning line;
    ``apply_exif_orientation=True`` scores each photo as the upright picture (exactly, for lossless files)."""
    up = np.random.default_rng(0).integers(0, 255, (20, 12, 3), dtype=np.uint8)
    Image.fromarray(up).save(tmp_path / "upright.png")
    for o, turn in STORED.items():
        stored = Image.fromarray(np.ascontiguousarray(turn(up)))
        exif = Image.Exif()
        exif[0x0112] = o
        stored.save(tmp_path / f"photo_{o}.png", exif=exif)
        stored.save(tmp_path / f"as_stored_{o}.png")
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(np.ascontiguousarray(STORED[6](up))).save(tmp_path / "phone.jpg", quality=90, exif=exif)
    with Image.open(tmp_path / "phone.jpg") as img:  # (PIL's turn of the JPEG, as a lossless file: its reference)
        ImageOps.exif_transpose(img).save(tmp_path / "phone_upright_ref.png")
    p = load_predictor(ckpt)
    res = predict_folder(p, tmp_path, topk=10, batch_size=4, progress=False)
    rows = _rows_by_name(res.rows)
    assert res.turned == [("phone.jpg", 6)] + [(f"photo_{o}.png", o) for o in STORED]
    for o in STORED:
        assert rows[f"photo_{o}.png"] == rows[f"as_stored_{o}.png"]  # (the pixels as stored: training's read)
    assert rows["phone.jpg"] != rows["phone_upright_ref.png"]
    warned = [r.getMessage() for r in caplog.records if "EXIF orientation" in r.getMessage()]
    assert len(warned) == 1 and re.search(r"^8 image\(s\) .* \(e.g. phone.jpg: 6\): scored as stored", warned[0])
    assert "apply_exif_orientation=true" in warned[0]
    res = predict_folder(p, tmp_path, topk=10, batch_size=4, progress=False, apply_exif_orientation=True)
    upright = _rows_by_name(res.rows)
    for o in STORED:
        assert upright[f"photo_{o}.png"] == upright["upright.png"] == rows["upright.png"]
        assert upright[f"as_stored_{o}.png"] == rows[f"as_stored_{o}.png"]  # (no EXIF: as it is)
    assert upright["phone.jpg"] == upright["phone_upright_ref.png"] and len(res.turned) == 8


def test_a_class_folder_tree_never_names_the_classes(tmp_path, caplog):
    """Without stored names, the labels are the indices (timm's ``inference.py`` without a class map), with one
    warning: the input's sorted class folders need not be the trained order (``dark, mid, bright`` trained as 0, 1, 2
    sort as ``bright, dark, mid``: every label was wrong before). ``class_names`` given: those, one per class."""
    m = _model()
    folder = tmp_path / "exported"
    save_pretrained(m, folder)
    tree = tmp_path / "tree"
    for i in range(10):
        (tree / f"c{9 - i}").mkdir(parents=True)
    Image.new("RGB", (32, 32), (10, 200, 30)).save(tree / "c3" / "a.png")
    Image.new("L", (20, 20), 128).save(tree / "c7" / "b.jpg")
    res = predict_folder(load_predictor(folder), tree, topk=1, progress=False)
    assert [r["filename"] for r in res.rows] == ["c3/a.png", "c7/b.jpg"]
    assert all(r["label"] == str(r["index"]) for r in res.rows)
    assert sum("stores no class names" in r.getMessage() for r in caplog.records) == 1
    header = predict_module.write_results(res.rows, tmp_path / "p.csv").read_text().splitlines()[0]
    assert header == "filename,index,label,prob"  # topk=1: timm's columns, unsuffixed (docs/export.md)
    given = [f"n{i}" for i in range(10)]
    res = predict_folder(load_predictor(folder), tree, topk=1, progress=False, class_names=given)
    assert all(r["label"] == f"n{r['index']}" for r in res.rows)
    with pytest.raises(PredictSettingsError, match="class_names has 3 names; the model has 10 classes"):
        predict_folder(load_predictor(folder), tree, topk=1, progress=False, class_names=given[:3])


def test_predict_py_takes_class_names_as_a_list_or_a_file(ckpt, images, tmp_path):
    """``class_names=[...]`` or a file of one name a line (timm's class map) replaces the stored names."""
    cfg = OmegaConf.create(dict(ckpt_path=str(ckpt), input=str(images), results_file=str(tmp_path / "p.csv")))
    cfg.progress_bar, cfg.device, cfg.topk = False, "cpu", 1
    names = tmp_path / "names.txt"
    names.write_text("".join(f"file_{i}\n" for i in range(10)))
    for given, prefix in ((None, "class_"), ([f"list_{i}" for i in range(10)], "list_"), (str(names), "file_")):
        run_predict(OmegaConf.merge(cfg, dict(class_names=given)))
        rows = _rows(tmp_path / "p.csv")
        assert rows and all(r["label"] == f"{prefix}{r['index']}" for r in rows), rows
    with pytest.raises(FileNotFoundError, match="class_names=.*: no such file"):
        run_predict(OmegaConf.merge(cfg, dict(class_names=str(tmp_path / "missing.txt"))))


def test_class_names_of_another_length_are_refused_before_an_image_is_read(ckpt, images, tmp_path, monkeypatch):
    """``class_names`` of 3 names for a 10-class model, from a ``.ckpt`` and from a ``.pt2`` (whose classes are its
    output's size): refused in one line before the model reads a file (after the first batch's forward before)."""
    out = tmp_path / "export"
    assert export_main([str(ckpt), str(out), "--pt2"]) == 0
    monkeypatch.setattr(predict_module, "predict_folder", lambda *a, **k: pytest.fail("an image was read"))
    for src in (ckpt, out / "model.pt2"):
        cfg = dict(ckpt_path=str(src), input=str(images), results_file=str(tmp_path / "p.csv"), device="cpu")
        with pytest.raises(PredictSettingsError, match=r"^class_names has 3 names; the model has 10 classes$"):
            run_predict(OmegaConf.create({**cfg, "progress_bar": False, "class_names": ["a", "b", "c"]}))
    assert not (tmp_path / "p.csv").exists()


def test_max_tokens_without_seq_len_is_refused(ckpt, images):
    """``max_tokens`` bounds the patches of an image scored at its own size, which only ``seq_len`` asks for: alone (a
    run without packing) it was ignored without a word."""
    with pytest.raises(ValueError, match=r"max_tokens=64 needs seq_len .*: give seq_len=<n> \(at least 64\)"):
        predict_folder(load_predictor(ckpt), images, max_tokens=64, progress=False)


def test_empty_folder_is_one_clear_error(ckpt, images, tmp_path):
    """``predict_folder`` raises :class:`NoImagesError`; ``predict.py`` prints its reason alone (as for a bad
    checkpoint), as for an input that is a file, or a checkpoint that is not there (tracebacks before)."""
    import importlib.util

    empty = tmp_path / "empty"
    (empty / "sub").mkdir(parents=True)
    (empty / "readme.txt").write_text("no images here")
    cfg = OmegaConf.create(dict(ckpt_path=str(ckpt), input=str(empty), results_file=str(tmp_path / "p.csv")))
    with pytest.raises(NoImagesError, match=r"no images in .*empty \(looked for \.png"):
        predict_folder(load_predictor(ckpt), empty, progress=False)
    with pytest.raises(FileNotFoundError, match="no images or videos in"):
        run_predict(cfg)
    spec = importlib.util.spec_from_file_location("predict_script", ROOT / "predict.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    main = script.main.__wrapped__  # the script's body under hydra.main, given a config
    for given, said in [
        (dict(input=str(empty)), f"predict.py: no images or videos in {empty} (looked for .png"),
        (dict(input=str(empty / "readme.txt")), f"predict.py: input {empty / 'readme.txt'} is none of the images or"),
        (dict(ckpt_path=str(tmp_path / "gone.ckpt"), input=str(images)), f"predict.py: no checkpoint at {tmp_path}"),
        (dict(topk=0), "predict.py: topk must be an integer >= 1, got 0"),  # (a setting: no traceback either)
    ]:
        with pytest.raises(SystemExit) as exit_:
            main(OmegaConf.merge(cfg, given))
        assert str(exit_.value.code).startswith(said), exit_.value.code
    assert not (tmp_path / "p.csv").exists()


def test_a_missing_input_or_an_empty_tree_is_refused_before_the_model_loads(ckpt, images, tmp_path, monkeypatch):
    """A mistyped ``input=``, a folder whose tree holds no file at all, or only files that are neither images nor
    videos, or such a file, was reported after the model had loaded (seconds, and the checkpoint's own warnings
    printed first): each is checked first, the model never loaded. A tree holding a link (to a folder of images) is
    not judged: it is read as before."""
    import vitrel.train.predict as predict

    def cfg(given: Path):
        return OmegaConf.create(dict(ckpt_path=str(ckpt), input=str(given), results_file=str(tmp_path / "p.csv")))

    with monkeypatch.context() as m:
        m.setattr(predict, "load_predictor", lambda *a, **k: pytest.fail("the model was loaded"))
        with pytest.raises(FileNotFoundError, match=r"input .*gone does not exist: give a folder of images or videos"):
            run_predict(cfg(tmp_path / "gone"))
        (tmp_path / "tree" / "a" / "b").mkdir(parents=True)
        (tmp_path / "tree" / "c").mkdir()
        with pytest.raises(FileNotFoundError, match=r"no images or videos in .*tree: neither it nor its sub-folders"):
            run_predict(cfg(tmp_path / "tree"))
        # other files only (a macOS copy's metadata, images in a hidden folder alone): the files counted and one named
        for name in ("a/notes.txt", "a/b/._x.png", "c/.ipynb_checkpoints/y.png"):
            (tmp_path / "tree" / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / "tree" / name).write_bytes(b"x")
        said = r"no images or videos in .*tree \(looked for \.png, .*\.mp4.*\): its tree holds 2 other file\(s\)"
        with pytest.raises(FileNotFoundError, match=said + r", e\.g\. a/b/\._x\.png"):
            run_predict(cfg(tmp_path / "tree"))
        with pytest.raises(FileNotFoundError, match=r"input .*notes.txt is none of the images or videos taken"):
            run_predict(cfg(tmp_path / "tree" / "a" / "notes.txt"))
    assert not (tmp_path / "p.csv").exists()
    (tmp_path / "tree" / "c" / "linked").symlink_to(images, target_is_directory=True)
    assert run_predict(cfg(tmp_path / "tree"))["images"] == 5  # (the fixture's, broken.jpg skipped)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_a_gpu_is_one_line_naming_device_cpu(ckpt, images, tmp_path):
    """``predict.py device=cuda`` on a machine without a GPU ended in torch's traceback ("Found no NVIDIA driver"),
    after the checkpoint was read; ``device=gpu`` in torch's list of device types. Now one line each, first thing."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("predict_script", ROOT / "predict.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    cfg = OmegaConf.create(dict(ckpt_path=str(ckpt), input=str(images), results_file=str(tmp_path / "p.csv")))
    with pytest.raises(SystemExit) as exit_:
        script.main.__wrapped__(OmegaConf.merge(cfg, dict(device="cuda")))
    said = "predict.py: device=cuda asks for a CUDA GPU, and PyTorch sees none on this "
    assert str(exit_.value.code).startswith(said) and "device=cpu" in str(exit_.value.code), exit_.value.code
    with pytest.raises(ValueError, match=r"device=gpu is not a device: auto, cpu, cuda, cuda:<n>"):
        run_predict(OmegaConf.merge(cfg, dict(device="gpu")))
    assert not (tmp_path / "p.csv").exists()


def test_another_kernel_at_prediction_and_export(ckpt, images, tmp_path):
    """A model trained with a kernel of its own (``triton``) is scored and exported with another: ``predict.py``'s
    ``model_overrides`` and ``python -m vitrel.export --attn-impl`` (recorded in the export's ``config.json``), the
    same predictions as the checkpoint's; a ``.pt2`` program, fixed, refuses overrides."""
    import json

    m = _model()
    m.vitrel_cfg["attn_impl"] = "triton"  # (as trained with attn_impl=triton: the weights are the same)
    trained = tmp_path / "triton.ckpt"
    saved = torch.load(ckpt, weights_only=False)
    torch.save({**saved, "vitrel_cfg": m.vitrel_cfg}, trained)
    ref = predict_folder(load_predictor(ckpt), images, topk=2, progress=False).rows
    p = load_predictor(trained, model_overrides={"attn_impl": "sdpa"})
    assert p.model.attn_impl == "sdpa"
    assert predict_folder(p, images, topk=2, progress=False).rows == ref
    out = tmp_path / "export"
    assert export_main([str(trained), str(out), "--pt2", "--attn-impl", "sdpa"]) == 0
    assert json.loads((out / "config.json").read_text())["model_args"]["attn_impl"] == "sdpa"
    with pytest.raises(ValueError, match="torch.export program, fixed"):
        load_predictor(out / "model.pt2", model_overrides={"attn_impl": "sdpa"})
    cfg = OmegaConf.create(dict(ckpt_path=str(trained), input=str(images), results_file=str(tmp_path / "p.csv")))
    cfg.topk, cfg.progress_bar, cfg.model_overrides = 2, False, {"attn_impl": "sdpa"}
    run_predict(cfg)
    assert len(_rows(tmp_path / "p.csv")) == len(ref)


def test_a_num_classes_override_that_resets_the_trained_head_is_refused(ckpt, images):
    """``+model_overrides.num_classes=5`` (the classes of one's folder, say) rebuilt the model with a fresh random
    head and predicted with it, labelled with the checkpoint's class names, with a warning only. Refused now, naming
    the override; the stored count is accepted."""
    with pytest.raises(ValueError, match=r"num_classes=5 .* trained head of 10 classes .* untrained one"):
        load_predictor(ckpt, model_overrides={"num_classes": 5})
    ref = predict_folder(load_predictor(ckpt), images, topk=2, progress=False).rows
    same = load_predictor(ckpt, model_overrides={"num_classes": 10})
    assert predict_folder(same, images, topk=2, progress=False).rows == ref


def test_the_input_folder_is_walked_once(ckpt, images, monkeypatch):
    """``predict_folder`` walked its input twice: the images, then again after scoring to count the other files (a
    second pass over a large folder, 0.25 s for 20,000 files here, more on a network disk). One walk now, the count
    the same."""
    import vitrel.data.input_files as input_files

    walks = []
    walk = input_files.walk_files
    monkeypatch.setattr(input_files, "walk_files", lambda *a, **k: walks.append(a) or walk(*a, **k))
    res = predict_folder(load_predictor(ckpt), images, topk=1, progress=False)
    assert len(walks) == 1 and res.passed_over == 1 and res.found == 6  # (broken.jpg: found, skipped)


def test_one_file_is_predicted_by_its_name_and_other_files_are_counted(ckpt, images, tmp_path):
    """``input=<one image>`` was refused ("input must be a folder"): it is the one row, named by its file name, equal
    to its row from the folder. The files of a folder that are not images (``notes.txt``) were passed over without a
    word: counted in the result, the summary and the printed line."""
    p = load_predictor(ckpt)
    folder = predict_folder(p, images, topk=3, progress=False)
    assert folder.passed_over == 1  # notes.txt (broken.jpg is an image file: skipped, not passed over)
    one = predict_folder(p, images / "rgb_1.png", topk=3, progress=False)
    assert one.rows == [r for r in folder.rows if r["filename"] == "rgb_1.png"] and one.found == 1
    assert one.passed_over == 0
    cfg = OmegaConf.create(dict(ckpt_path=str(ckpt), input=str(images), results_file=str(tmp_path / "p.csv")))
    cfg.progress_bar = False
    summary = run_predict(cfg)
    assert summary["passed_over"] == 1 and summary["images"] == 5
    summary = run_predict(OmegaConf.merge(cfg, dict(input=str(images / "rgb_1.png"))))
    assert [r["filename"] for r in _rows(tmp_path / "p.csv")] == ["rgb_1.png"] and summary["passed_over"] == 0
    with pytest.raises(NoImagesError, match=r"notes.txt is not one of the images the model takes \(.png"):
        predict_folder(p, images / "notes.txt", progress=False)
    with pytest.raises(FileNotFoundError, match=r"input .*gone does not exist"):
        predict_folder(p, images / "gone", progress=False)


def test_topk_above_the_number_of_classes_gives_all_with_one_logged_line(ckpt, images, caplog):
    """``topk=20`` for a model of 10 classes wrote 10 columns of each without a word: now one logged line says so
    (a line of predict.py's log, not a Python warning)."""
    caplog.set_level("WARNING", logger="vitrel.inference")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = predict_folder(load_predictor(ckpt), images, topk=20, batch_size=2, progress=False).rows
    assert not [w for w in caught if "topk=" in str(w.message) or "skipped" in str(w.message)]
    said = [r.getMessage() for r in caplog.records if "topk=" in r.getMessage()]
    assert said == ["topk=20 is more than the model's 10 classes: each row has all 10"]
    assert [r.getMessage()[:19] for r in caplog.records if "skipped" in r.getMessage()] == ["skipped broken.jpg:"]
    assert list(rows[0]) == ["filename"] + [f"{c}_{i}" for i in range(10) for c in ("index", "label", "prob")]


def test_results_file_json_folder_and_other_suffixes(ckpt, images, tmp_path, monkeypatch):
    """``results_file=p.json`` got CSV text; ``results_file=<a folder>`` ended, after every image was scored, in
    IsADirectoryError's traceback. Now JSON is written for ``.json`` (the CSV's rows, numbers as numbers), a folder or
    another suffix is one line before the model is read, and a write that fails leaves the previous file whole."""
    import json

    import vitrel.train.predict as vp

    cfg = OmegaConf.create(dict(ckpt_path=str(ckpt), input=str(images), results_file=str(tmp_path / "p.csv")))
    cfg.progress_bar, cfg.topk = False, 2
    run_predict(cfg)
    before = (tmp_path / "p.csv").read_text()
    run_predict(OmegaConf.merge(cfg, dict(results_file=str(tmp_path / "p.json"))))
    got = json.loads((tmp_path / "p.json").read_text())
    assert [{k: str(v) for k, v in r.items()} for r in got] == _rows(tmp_path / "p.csv")
    assert isinstance(got[0]["prob_0"], float) and isinstance(got[0]["index_0"], int)
    for given, said in [
        (tmp_path, f"results_file={tmp_path} is a folder: give a file in it, e.g. results_file="),
        (tmp_path / "p.txt", f"results_file={tmp_path / 'p.txt'}: predict.py writes .csv (CSV), .json"),
    ]:
        late = OmegaConf.merge(cfg, dict(results_file=str(given), ckpt_path=str(tmp_path / "absent.ckpt")))
        with pytest.raises(ValueError, match="^" + re.escape(said)):  # (before the absent checkpoint is read)
            run_predict(late)

    def fail(self, rows):
        raise OSError("disk full")

    monkeypatch.setattr(csv.DictWriter, "writerows", fail)
    with pytest.raises(OSError, match="disk full"):
        vp.write_results([{"filename": "a.png", "index": 1}], tmp_path / "p.csv")
    assert (tmp_path / "p.csv").read_text() == before and sorted(f.name for f in tmp_path.glob(".p.csv*")) == []


# ---------------------------------------------------------------------------- a checkpoint train.py wrote
TRAIN = ["model.embed_dim=32", "model.depth=2", "model.num_heads=2", "data.num_workers=0", "data.batch_size=16"]
TRAIN += ["trainer.accelerator=cpu", "progress_bar=none", "callbacks.pos_images=null", "logger=none", "test=false"]
TRAIN += ["trainer.max_epochs=1", "trainer.limit_train_batches=20", "trainer.limit_val_batches=1"]
#: resized from the native 28 px, as a user asks for a model's size: the memory loader (Fashion-MNIST's default)
#: resizes normalised tensors with torchvision, which predict.py must do too (PIL's resize moved top-1 classes)
RESIZED = ["data.img_size=32", "data.interpolation=bicubic", "data.crop_pct=0.875"]
FMNIST_MEAN, FMNIST_STD = 0.2860, 0.3530


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """``last.ckpt`` of a few steps of the default recipe (Fashion-MNIST, grey 28 x 28 resized to 32), written by
    ``train.py`` (forked from the preloaded server: :func:`tests.train_helpers.run_script_forked`)."""
    from tests.train_helpers import run_script_forked

    run = tmp_path_factory.mktemp("train")
    res = run_script_forked("train.py", [*TRAIN, *RESIZED, f"hydra.run.dir={run}"], cwd=run)
    assert res.returncode == 0, res.stderr[-3000:]
    return run / "checkpoints" / "last.ckpt"


def test_timms_save_for_hf_of_a_trained_model_reloads_through_timm(trained, fmnist_test, tmp_path):
    """``timm.models.save_for_hf`` of a train.py model (docs/models.md, timm's writers) writes the model's
    ``pretrained_cfg`` with vitrel's own data fields (here ``resize``: the memory loader's run), which timm's
    ``PretrainedCfg`` does not take: ``timm.create_model("local-dir:...", pretrained=True)`` raised ``TypeError``.
    Now it gives the same function and preprocessing, and predict.py the same rows from the folder as from the
    checkpoint."""
    from timm.models import save_for_hf

    model = vitrel.load_model(trained).eval()
    assert model.pretrained_cfg["resize"] == "tensor"
    save_for_hf(model, tmp_path / "hf", safe_serialization=True)
    back = timm.create_model(f"local-dir:{tmp_path / 'hf'}", pretrained=True).eval()
    keys = ("input_size", "mean", "std", "interpolation", "crop_pct", "resize", "label_names")
    assert {k: back.pretrained_cfg.get(k) for k in keys} == {k: model.pretrained_cfg.get(k) for k in keys}
    x = torch.randn(2, 1, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(back(x), model(x), rtol=0, atol=0)
    folder = fmnist_test[0]
    rows = [predict_folder(load_predictor(p), folder, topk=2, progress=False).rows for p in (trained, tmp_path / "hf")]
    assert rows[0] == rows[1] and len(rows[0]) == 200


@pytest.fixture(scope="module")
def fmnist_test(tmp_path_factory) -> tuple[Path, np.ndarray, np.ndarray]:
    """The first 200 test images of the embedded Fashion-MNIST subset as PNG files, with the arrays and labels."""
    from vitrel.data.fashion_mnist import SUBSET_PATH

    with np.load(SUBSET_PATH) as z:
        x, y = z["x_test"][:200], z["y_test"][:200]
    root = tmp_path_factory.mktemp("fmnist")
    for i, a in enumerate(x):
        Image.fromarray(a).save(root / f"{i:04d}.png")
    return root, x, y


def test_train_py_checkpoint_stores_its_data_config(trained):
    from vitrel.data.fashion_mnist import FASHION_MNIST_CLASSES

    dc = torch.load(trained, weights_only=True)["hyper_parameters"]["data_config"]
    assert dc["input_size"] == [1, 32, 32] and dc["interpolation"] == "bicubic" and dc["crop_pct"] == 0.875
    assert dc["resize"] == "tensor"  # (the memory loader's: predict.py resizes as it did)
    assert dc["mean"] == pytest.approx([FMNIST_MEAN]) and dc["std"] == pytest.approx([FMNIST_STD])
    assert dc["class_names"] == list(FASHION_MNIST_CLASSES)
    # vitrel.load_model: in the model's pretrained_cfg, where timm looks
    from timm.data import resolve_data_config

    resolved = resolve_data_config(model=vitrel.load_model(trained))
    assert resolved["mean"] == pytest.approx((FMNIST_MEAN,)) and resolved["std"] == pytest.approx((FMNIST_STD,))
    assert resolved["input_size"] == (1, 32, 32) and resolved["interpolation"] == "bicubic"


def test_predict_py_equals_the_lightning_model_on_a_train_py_checkpoint(trained, fmnist_test, tmp_path):
    """predict.py's configuration and run (in-process: the command line is test_predict_script_on_a_folder's) on PNG
    files of test images: the probabilities of the trained LightningModule on the run's own test batches (what its
    test and eval.py score: the memory loader's, resized 28 -> 32 px by torchvision), so the same accuracy; the CSV
    names the classes. With PIL's resize (before), top-1 classes differed (13 of 500 in a 40-step run)."""
    from tests.train_helpers import compose
    from vitrel.data.fashion_mnist import FASHION_MNIST_CLASSES, FashionMNISTDataModule
    from vitrel.train.module import ClassifierModule

    root, arrays, labels = fmnist_test
    out = tmp_path / "pred.csv"
    args = [f"ckpt_path={trained}", f"input={root}", f"results_file={out}", "topk=3", "progress_bar=false"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_predict(compose(tmp_path / "run", args, config_name="predict"))
    assert not [w for w in caught if "stores no data config" in str(w.message)]
    rows = _rows(out)
    assert len(rows) == len(labels)

    module = ClassifierModule.load_from_checkpoint(trained, model=vitrel.load_model(trained), weights_only=True)
    # the run's own test batches: its data module (the memory loader: tensors resized by torchvision)
    dm = FashionMNISTDataModule(num_workers=0, img_size=32, interpolation="bicubic", crop_pct=0.875, batch_size=100)
    dm.setup("test")
    x = torch.cat([b[0] for b in dm.test_dataloader()])[: len(arrays)]
    with torch.no_grad():
        probs = module.eval()(x).softmax(-1)
    top_p, top_i = probs.topk(3, dim=-1)
    assert [int(r["index_0"]) for r in rows] == top_i[:, 0].tolist()
    got = torch.tensor([[float(r[f"prob_{k}"]) for k in range(3)] for r in rows])
    torch.testing.assert_close(got, top_p, rtol=0, atol=2e-6)  # (the CSV rounds to 6 decimals)
    acc_predict = np.mean([int(r["index_0"]) == y for r, y in zip(rows, labels)])
    assert acc_predict == (top_i[:, 0].numpy() == labels).mean()
    assert all(r["label_0"] == FASHION_MNIST_CLASSES[int(r["index_0"])] for r in rows)


def test_old_checkpoint_without_data_config_warns_once(trained, fmnist_test, tmp_path):
    """A checkpoint without ``hyper_parameters["data_config"]`` (written before vitrel stored it): one warning,
    naming the statistics used (the architecture's defaults: CIFAR's, averaged to the model's one channel)."""
    old = torch.load(trained, weights_only=True)
    del old["hyper_parameters"]["data_config"]
    path = tmp_path / "old.ckpt"
    torch.save(old, path)
    root, _, _ = fmnist_test
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = load_predictor(path)
        predict_folder(p, root, topk=1, progress=False)
    said = [str(w.message) for w in caught if "stores no data config" in str(w.message)]
    assert len(said) == 1, said
    mean = sum((0.4914, 0.4822, 0.4465)) / 3
    assert p.data_config["mean"] == pytest.approx([mean]) and f"mean [{p.data_config['mean'][0]}]" in said[0]
    assert p.class_names is None


def test_export_of_a_train_py_checkpoint_carries_its_data_config(trained, fmnist_test, tmp_path):
    """``python -m vitrel.export``: config.json's pretrained_cfg holds the training data's statistics (timm's
    ``resolve_data_config`` on the ``local-dir:`` model reads them) and the class names; predictions from the export
    folder and its ``.pt2`` equal the checkpoint's."""
    import json

    import timm
    from timm.data import resolve_data_config

    from vitrel.data.fashion_mnist import FASHION_MNIST_CLASSES

    out = tmp_path / "export"
    assert export_main([str(trained), str(out), "--pt2"]) == 0
    pcfg = json.loads((out / "config.json").read_text())["pretrained_cfg"]
    assert pcfg["mean"] == pytest.approx([FMNIST_MEAN]) and pcfg["std"] == pytest.approx([FMNIST_STD])
    assert pcfg["label_names"] == list(FASHION_MNIST_CLASSES)
    resolved = resolve_data_config(model=timm.create_model(f"local-dir:{out}", pretrained=True))
    assert resolved["mean"] == pytest.approx((FMNIST_MEAN,)) and resolved["std"] == pytest.approx((FMNIST_STD,))
    assert tuple(resolved["input_size"]) == (1, 32, 32) and resolved["crop_pct"] == 0.875
    root, _, _ = fmnist_test
    ref = predict_folder(load_predictor(trained), root, topk=1, progress=False).rows
    for src in (out, out / "model.pt2"):
        assert load_predictor(src).data_config["resize"] == "tensor"  # (resized as the run's memory loader did)
        rows = predict_folder(load_predictor(src), root, topk=1, progress=False).rows
        assert [r["index"] for r in rows] == [r["index"] for r in ref]
        assert [r["label"] for r in rows] == [r["label"] for r in ref]
        assert max(abs(a["prob"] - b["prob"]) for a, b in zip(rows, ref)) < 1e-5


def test_a_non_square_program_of_a_memory_loader_run_is_fed_its_height_and_width(trained, fmnist_test, tmp_path):
    """``python -m vitrel.export <run> --pt2 --dynamic batch --img-size 28 36`` of a memory-loader run (the default
    data): ``predict.py`` on its ``model.pt2`` resized images to 36 x 36 (the width only) and stopped on the program's
    size check; ``eval_transform`` of the data config (what ONNX Runtime is fed) made 36 x 36 too. Images are now
    normalised, resized to 32 x 41 (the sides over crop_pct 0.875) by torchvision and centre-cropped to 28 x 36: the
    probabilities of the checkpoint's model on those."""
    import torchvision.transforms.functional as TF

    from vitrel.inference import eval_transform

    out = tmp_path / "export"
    assert export_main([str(trained), str(out), "--pt2", "--dynamic", "batch", "--img-size", "28", "36"]) == 0
    predictor = load_predictor(out / "model.pt2")
    assert predictor.data_config["input_size"] == [1, 28, 36] and predictor.data_config["resize"] == "tensor"
    root, arrays, _ = fmnist_test
    rows = predict_folder(predictor, root, topk=3, progress=False).rows
    assert eval_transform(predictor.data_config)(Image.open(root / "0000.png")).shape == (1, 28, 36)
    x = (torch.from_numpy(arrays[:, None]).float() / 255 - FMNIST_MEAN) / FMNIST_STD
    x = TF.center_crop(TF.resize(x, [32, 41], interpolation=TF.InterpolationMode.BICUBIC, antialias=True), [28, 36])
    with torch.no_grad():
        probs = vitrel.load_model(trained).eval()(x).softmax(-1)
    top_p, top_i = probs.topk(3, dim=-1)
    assert [int(r["index_0"]) for r in rows] == top_i[:, 0].tolist()
    got = torch.tensor([[float(r[f"prob_{k}"]) for k in range(3)] for r in rows])
    torch.testing.assert_close(got, top_p, rtol=0, atol=1e-5)


def test_a_checkpoint_from_before_resize_was_stored_is_resized_as_its_run_was(trained, fmnist_test, tmp_path):
    """Checkpoints written before 2026-12-03 store no ``resize``: a memory-loader run's (the default recipe's) images
    were resized by PIL in predict.py and its exports, not as its test resized them (13 of 500 top-1 classes
    differed). Its run record says how (``.hydra/config.yaml``'s data.loader; null: the data set's default): the
    same predictions as the checkpoint that stores it, from the file and from its export. A record of the workers
    loader, of a run from before the memory loader (no data.loader), or none (the file moved out of its run
    folder) leaves PIL's resize."""
    import shutil

    from vitrel.models.data_config import stored_data_config

    run = tmp_path / "old_run"
    shutil.copytree(trained.parent.parent / ".hydra", run / ".hydra")
    (run / "checkpoints").mkdir()
    old = run / "checkpoints" / "last.ckpt"
    ckpt = torch.load(trained, weights_only=True)
    del ckpt["hyper_parameters"]["data_config"]["resize"]  # (as written before 2026-12-03)
    torch.save(ckpt, old)
    root, _, _ = fmnist_test
    ref = predict_folder(load_predictor(trained), root, topk=1, progress=False).rows
    out = tmp_path / "export"
    assert export_main([str(old), str(out)]) == 0
    for src in (old, out):
        predictor = load_predictor(src)
        assert predictor.data_config["resize"] == "tensor"
        rows = predict_folder(predictor, root, topk=1, progress=False).rows
        assert [r["index"] for r in rows] == [r["index"] for r in ref]
        assert max(abs(a["prob"] - b["prob"]) for a, b in zip(rows, ref)) < 1e-6

    record = run / ".hydra" / "config.yaml"
    text = record.read_text()
    assert text.count("  loader: memory\n") == 1
    for loader, resize in [("loader: null", "tensor"), ("loader: workers", None), ("", None)]:
        record.write_text(text.replace("  loader: memory\n", f"  {loader}\n" if loader else ""))
        assert stored_data_config(old).get("resize") == resize, loader
    record.unlink()
    assert "resize" not in stored_data_config(old)


def test_timm_checkpoint_path_on_a_train_py_checkpoint_and_its_export(trained, tmp_path):
    """``timm.create_model(name, checkpoint_path=...)`` (timm's ``load_checkpoint``, strict) on a ``train.py``
    ``.ckpt`` (Lightning's ``model.*`` keys) and on an export's ``model.safetensors``: the model's weights when the
    model's arguments are given; without them, one error naming the routes that read the stored arguments."""
    import re

    import timm
    from timm.data import resolve_data_config

    from vitrel import CheckpointError

    ref = vitrel.load_model(trained).eval()
    name = ref.vitrel_cfg["architecture"]
    args = {k: v for k, v in ref.vitrel_cfg.items() if k != "architecture"}
    out = tmp_path / "export"
    assert export_main([str(trained), str(out)]) == 0
    x = torch.randn(2, 1, 32, 32)
    for weights in (trained, out / "model.safetensors"):
        m = timm.create_model(name, checkpoint_path=str(weights), **args).eval()
        with torch.no_grad():
            torch.testing.assert_close(m(x), ref(x), rtol=0, atol=0)
        with pytest.raises(CheckpointError) as err:  # the architecture's defaults: another model
            timm.create_model(name, checkpoint_path=str(weights))
        said = str(err.value)
        assert re.search(r"(?s)do not fit.*local-dir:.*pretrained_cfg_overlay=dict\(file=", said), said
    for m in (  # the routes that need nothing more: the weights and the training data's preprocessing
        timm.create_model(f"local-dir:{out}", pretrained=True),
        timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(out / "model.safetensors"))),
        timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(trained))),
    ):
        with torch.no_grad():
            torch.testing.assert_close(m.eval()(x), ref(x), rtol=0, atol=0)
        resolved = resolve_data_config(model=m)
        assert resolved["mean"] == pytest.approx((FMNIST_MEAN,)) and resolved["std"] == pytest.approx((FMNIST_STD,))
        assert tuple(resolved["input_size"]) == (1, 32, 32)


def test_a_backbone_from_a_train_py_checkpoint_with_its_data_config(trained):
    """``vitrel.load_model(ckpt, features_only=True)`` on what ``train.py`` wrote: the run's network's
    intermediates exactly, and timm's data config of the backbone is the training data's (Fashion-MNIST's grey mean
    and std at 32 px), as the whole model's is."""
    from timm.data import resolve_data_config

    ref = vitrel.load_model(trained).eval()
    backbone = vitrel.load_model(trained, features_only=True, out_indices=(-1,)).eval()
    x = torch.randn(2, 1, 32, 32)
    with torch.no_grad():
        (got,) = backbone(x)
        torch.testing.assert_close(
            got, ref.forward_intermediates(x, indices=1, intermediates_only=True)[0], rtol=0, atol=0
        )
    resolved = resolve_data_config(model=backbone)
    assert resolved == resolve_data_config(model=ref)
    assert resolved["mean"] == pytest.approx((FMNIST_MEAN,)) and tuple(resolved["input_size"]) == (1, 32, 32)
    assert (
        "num_classes" not in backbone.pretrained_cfg
        and backbone.pretrained_cfg["resize"] == ref.pretrained_cfg["resize"]
    )


# ---------------------------------------------------------------------------- a checkpoint of a NaFlex run
NAFLEX = ["experiment=fmnist_naflex", *(o for o in TRAIN if "limit_train" not in o), "trainer.limit_train_batches=2"]
NAFLEX_RUN = {"packing": "pack", "seq_len": 128, "max_tokens": 64, "eval_max_ratio": 1.0}


@pytest.fixture(scope="module")
def naflex_trained(tmp_path_factory) -> Path:
    """``last.ckpt`` of two steps of ``train.py experiment=fmnist_naflex`` (packed rows of 128 tokens, at most 64
    patches an image, native sizes at evaluation), in-process, with its run record as Hydra saves it (the composed
    config, unresolved, in ``.hydra/config.yaml``)."""
    from tests.train_helpers import compose
    from vitrel.train.run import train

    run = tmp_path_factory.mktemp("naflex")
    cfg = compose(run, NAFLEX)
    train(cfg)
    (run / ".hydra").mkdir()
    OmegaConf.save(cfg, run / ".hydra" / "config.yaml")
    return run / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module")
def odd_sizes(fmnist_test, tmp_path_factory) -> Path:
    """Twelve of the test images as PNG files of several sizes and aspect ratios (28 x 28, wide, tall, larger than
    the run's 64-patch budget)."""
    _, arrays, _ = fmnist_test
    root = tmp_path_factory.mktemp("odd_sizes")
    for i, a in enumerate(arrays[:12]):
        w, h = [(28, 28), (40, 20), (16, 36), (48, 48)][i % 4]
        Image.fromarray(a).resize((w, h), Image.BILINEAR).save(root / f"{i:02d}.png")
    return root


def _eval_way(ckpt: Path, files: list[Path], tmp_path: Path) -> torch.Tensor:
    """Probabilities of ``files`` (in order) from the model ``eval.py`` scores, on the NaFlex batch its data module
    makes with the settings eval.py takes from the run (``data=fashion_mnist_naflex``, vitrel.train.eval_data)."""
    from hydra.utils import instantiate
    from omegaconf import open_dict

    from tests.train_helpers import compose
    from vitrel.models.checkpoint import checkpoint_scores_ema, stored_data_config
    from vitrel.models.run_record import run_record
    from vitrel.train.eval_data import run_settings, stored_split

    cfg = compose(tmp_path / "eval", [f"ckpt_path={ckpt}", "data=fashion_mnist_naflex"], config_name="eval")
    held = stored_split(ckpt, cfg.data)  # (as evaluate reads the checkpoint and its run folder)
    taken, _, _ = run_settings(ckpt, run_record(ckpt), stored_data_config(ckpt) or {}, held, cfg.data)
    with open_dict(cfg):
        cfg.data.update(taken)
    dm = instantiate(cfg.data)
    model = vitrel.load_model(ckpt, use_ema=checkpoint_scores_ema(ckpt)).eval()
    tf = dm.naflex_transform(train=False)
    samples = []
    for i, f in enumerate(files):
        with Image.open(f) as img:
            samples.append((tf(img.convert("L")), i))
    x, order = dm.collate_fn(samples)
    with torch.no_grad():
        probs = model(x).softmax(-1)
    return probs[order.argsort()]


def _probs(rows: list[dict[str, str]]) -> tuple[list[int], torch.Tensor]:
    return [int(r["index_0"]) for r in rows], torch.tensor([[float(r[f"prob_{k}"]) for k in range(3)] for r in rows])


def test_predict_scores_a_naflex_run_as_eval_py_does(naflex_trained, odd_sizes, tmp_path, caplog):
    """``predict.py ckpt_path=<a NaFlex run's checkpoint>``: each image at its own size within the run's
    ``data.max_tokens``, in rows of its ``data.seq_len`` (taken from the run, said in one line): the probabilities of
    the model on the NaFlex batch eval.py's data module builds. Before, every image was resized and centre-cropped to
    28 x 28 (and with ``seq_len`` given, ``max_tokens`` was ``seq_len``, not the run's). ``seq_len=null``: fixed
    size."""
    from tests.train_helpers import compose

    files = sorted(odd_sizes.glob("*.png"))
    top_p, top_i = _eval_way(naflex_trained, files, tmp_path).topk(3, dim=-1)
    base = [f"ckpt_path={naflex_trained}", f"input={odd_sizes}", "topk=3", "progress_bar=false"]

    def predict(name: str, *over: str) -> tuple[dict, list[dict[str, str]]]:
        out = tmp_path / f"{name}.csv"
        summary = run_predict(compose(tmp_path / name, [*base, f"results_file={out}", *over], config_name="predict"))
        return summary, _rows(out)

    caplog.set_level("INFO", logger="vitrel.train.predict")
    for name, over, taken in [
        ("default", [], NAFLEX_RUN),
        ("seq_len", ["seq_len=128"], {k: v for k, v in NAFLEX_RUN.items() if k != "seq_len"}),
    ]:
        summary, rows = predict(name, *over)
        index, probs = _probs(rows)
        assert index == top_i[:, 0].tolist()
        torch.testing.assert_close(probs, top_p, rtol=0, atol=2e-6)  # (the CSV rounds to 6 decimals)
        assert summary["naflex_from_run"] == taken
    said = [r.getMessage() for r in caplog.records if "NaFlex evaluation of last.ckpt's run" in r.getMessage()]
    assert len(said) == 2 and said[0].startswith("packing=pack seq_len=128 max_tokens=64 eval_max_ratio=1.0: ")
    assert str(naflex_trained.parents[1] / ".hydra" / "config.yaml") in said[0]

    summary, rows = predict("fixed", "seq_len=null")  # the opt-out: resized and centre-cropped to 28 x 28
    fixed = predict_folder(load_predictor(naflex_trained), odd_sizes, topk=3, progress=False).rows
    assert summary["naflex_from_run"] == {} and _probs(rows)[0] == [r["index_0"] for r in fixed]
    assert (_probs(rows)[1] - top_p).abs().max() > 1e-4  # (what predict.py scored before)


def test_predict_takes_a_naflex_runs_eval_max_ratio(naflex_trained, odd_sizes, tmp_path):
    """A run that scored its images enlarged to fill the budget (``data.eval_max_ratio=null``): predict.py too."""
    import shutil

    from tests.train_helpers import compose

    run = tmp_path / "run"
    shutil.copytree(naflex_trained.parents[1], run)
    record = OmegaConf.load(run / ".hydra" / "config.yaml")
    record.data.eval_max_ratio = None
    OmegaConf.save(record, run / ".hydra" / "config.yaml")
    ckpt = run / "checkpoints" / "last.ckpt"
    files = sorted(odd_sizes.glob("*.png"))
    top_p, top_i = _eval_way(ckpt, files, tmp_path).topk(3, dim=-1)
    out = tmp_path / "p.csv"
    args = [f"ckpt_path={ckpt}", f"input={odd_sizes}", "topk=3", "progress_bar=false", f"results_file={out}"]
    summary = run_predict(compose(tmp_path / "predict", args, config_name="predict"))
    index, probs = _probs(_rows(out))
    assert index == top_i[:, 0].tolist()
    torch.testing.assert_close(probs, top_p, rtol=0, atol=2e-6)
    assert summary["naflex_from_run"] == {**NAFLEX_RUN, "eval_max_ratio": None}


def test_a_symlinked_class_folder_is_predicted_and_a_dead_link_counted(ckpt, tmp_path, caplog):
    """``data=imagenet`` reads a symlinked class folder as a class; ``predict.py`` on the same tree left its images out
    without a word (``Path.rglob`` does not enter links to folders: "predicted 7 of 7" of 11 images), and a link to
    nothing named ``*.jpg`` was neither skipped nor counted."""
    store, tree = tmp_path / "store", tmp_path / "tree"
    (store / "zebra").mkdir(parents=True)
    (tree / "apple" / "nested").mkdir(parents=True)
    for i in range(3):
        Image.new("RGB", (32, 32), (200, 10 * i, 10)).save(store / "zebra" / f"z{i}.png")
    Image.new("RGB", (32, 32), (10, 200, 10)).save(tree / "apple" / "A.JPG")
    Image.new("RGB", (40, 30), (10, 190, 10)).save(tree / "apple" / "nested" / "b.png")
    (tree / "zebra").symlink_to(store / "zebra", target_is_directory=True)
    (tree / "apple" / "loop").symlink_to(tree, target_is_directory=True)  # (a link back up: not followed)
    (tree / "apple" / "gone.jpg").symlink_to(tmp_path / "nowhere.jpg")
    with caplog.at_level(logging.WARNING):
        res = predict_folder(load_predictor(ckpt), tree, topk=1, progress=False)
    names = [r["filename"] for r in res.rows]
    assert names == ["apple/A.JPG", "apple/nested/b.png", "zebra/z0.png", "zebra/z1.png", "zebra/z2.png"]
    said = [r.getMessage() for r in caplog.records if "links back up" in r.getMessage()]
    assert said == [f"{tree / 'apple' / 'loop'} links back up to {tree}, a folder it is in: not followed"], said
    assert res.found == 6 and [s[0] for s in res.skipped] == ["apple/gone.jpg"]


def test_a_canvas_run_is_predicted_on_its_canvas_as_its_test_scored(tmp_path):
    """A run trained with ``data.canvas_size=40`` (28 x 28 garments pasted into a black 40 x 40 canvas) stored only
    ``input_size`` 40: ``predict.py`` stretched each 28 x 28 image to 40 x 40, which the model never saw (a tiny run:
    11 % where its test scored 34 %). The data config now keeps the canvas, and each image is pasted in its middle, as
    the data module's ``canvas_mode=center`` evaluation pastes it."""
    from vitrel.data import FashionMNISTDataModule
    from vitrel.models.data_config import data_config_of

    dm = FashionMNISTDataModule(canvas_size=40, canvas_mode="center", val_fraction=0.0)
    data = data_config_of(dm)
    assert data["canvas_size"] == 40 and data["canvas_image_size"] == 28 and data["input_size"] == [1, 40, 40]
    torch.manual_seed(0)
    m = vitrel.create_model("vitrel_vit_tiny_patch4_32", pos="rel2d_factored", embed_dim=32, depth=1, num_heads=2,
                            in_chans=1, img_size=40, num_classes=10)  # fmt: skip
    path = tmp_path / "last.ckpt"
    state = {f"model.{k}": v for k, v in m.state_dict().items()}
    hp = {"num_classes": 10, "data_config": data}
    torch.save({"vitrel_cfg": m.vitrel_cfg, "state_dict": state, "hyper_parameters": hp}, path)
    ds, folder = dm.make_dataset("test"), tmp_path / "images"
    folder.mkdir()
    for i in range(6):
        dm.raw_dataset("test")[i][0].save(folder / f"{i}.png")
    with torch.no_grad():
        want = m.eval()(torch.stack([ds[i][0] for i in range(6)])).softmax(-1)
    rows = predict_folder(load_predictor(path), folder, topk=10, progress=False).rows
    got = torch.tensor([[r[f"prob_{k}"] for k in range(10)] for r in rows])
    order = torch.tensor([[r[f"index_{k}"] for k in range(10)] for r in rows])
    torch.testing.assert_close(got, want.gather(1, order), atol=2e-6, rtol=0)


def _seen(model: torch.nn.Module, log: list) -> torch.nn.Module:
    """``model``, noting in ``log`` the autocast dtype each forward runs under (None: off)."""

    def hook(module, args):
        log.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)

    model.register_forward_pre_hook(hook)
    return model


def test_predict_py_precision_runs_the_forward_under_autocast(ckpt, images, tmp_path, monkeypatch):
    """``precision=bf16-mixed``: the forward under autocast; the default, 32-true, as before: float32, no autocast."""
    log = []
    monkeypatch.setattr(predict_module, "load_predictor", lambda *a, **k: _with_log(load_predictor(*a, **k), log))
    cfg = OmegaConf.create(dict(ckpt_path=str(ckpt), input=str(images), results_file=str(tmp_path / "p.csv")))
    cfg.progress_bar, cfg.device = False, "cpu"
    summary = predict_module.run_predict(cfg)
    assert summary["precision"] == "32-true" and log and set(log) == {None}
    by_hand = predict_folder(load_predictor(ckpt, "cpu"), images, progress=False).rows  # float32, no autocast
    assert _rows(tmp_path / "p.csv") == [{k: str(v) for k, v in r.items()} for r in by_hand]
    log.clear()
    predict_module.run_predict(OmegaConf.merge(cfg, dict(precision="bf16-mixed")))
    assert log and set(log) == {torch.bfloat16}
    with pytest.raises(PredictSettingsError, match=r"^precision=bf16 is not one predict.py runs: 32-true, bf16-mixed"):
        predict_module.run_predict(OmegaConf.merge(cfg, dict(precision="bf16")))


def _with_log(predictor, log):
    _seen(predictor.model, log)
    return predictor


def test_the_no_data_config_warning_names_the_caller_not_vitrel(tmp_path):
    """A checkpoint without a data config: its warning was attributed to ``vitrel/inference.py``
    (``data_config = data_config_for(p, model)``), a line of vitrel's; now to the line that called
    ``load_predictor`` (the first frame outside vitrel, torch and timm, as the table-resize warning)."""
    m = _model()
    path = tmp_path / "old.ckpt"
    torch.save({"vitrel_cfg": m.vitrel_cfg, "state_dict": {f"model.{k}": v for k, v in m.state_dict().items()}}, path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_predictor(path)
    said = [w for w in caught if "stores no data config" in str(w.message)]
    assert len(said) == 1 and said[0].filename == __file__, [(w.filename, w.lineno) for w in said]


def test_the_in_chans_warning_names_the_caller_not_vitrel(ckpt):
    """``model_overrides={"in_chans": 1}`` for a 3-channel model: the patch embedding's adaptation
    warning was attributed to ``vitrel/inference.py`` (``model = load_model(...)``); now to the caller's line."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_predictor(ckpt, model_overrides={"in_chans": 1})
    said = [w for w in caught if "input channels (timm's adapt_input_conv)" in str(w.message)]
    assert len(said) == 1 and said[0].filename == __file__, [(w.filename, w.lineno) for w in said]
