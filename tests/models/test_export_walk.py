"""The export path as a user walks it (docs/export.md): what the exported files compute, at which sizes, and what they
record. Small and quick; the scheme matrix is tests/models/test_export.py."""

from __future__ import annotations

import json
import re
import warnings

import numpy as np
import pytest
import torch

import vitrel
from vitrel.export import best_dynamic, check_exportable


def _vit(pos: dict, depth: int = 2) -> torch.nn.Module:
    """A two-block ViT of 28 px grey images (a 7 x 7 grid, as the default recipe's), average-pooled (so every
    patch's attention reaches the logits), its parameters moved off their initial values."""
    torch.manual_seed(0)
    m = vitrel.create_model(
        "vitrel_vit_tiny_patch4_32", img_size=28, in_chans=1, num_classes=10, embed_dim=32, depth=depth, num_heads=2,
        global_pool="avg", pos=pos,
    )  # fmt: skip
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return m.eval()


@pytest.mark.parametrize(
    "pos",
    [
        {"name": "rel2d_factored", "extend": "interpolate"},
        {"name": "rel2d_full", "extend": "interpolate"},
        {"name": "rope2d_axial", "scaling": {"rope_type": "yarn", "factor": "auto"}},
        {"name": "rope2d_mixed", "scaling": {"rope_type": "linear", "factor": "auto"}},
    ],
    ids=lambda p: f"{p['name']}-{p.get('extend') or p['scaling']['rope_type']}",
)
def test_a_vit_whose_scheme_compares_grids_gets_no_hw_program(pos):
    """``extend: interpolate`` resizes a bias table only when the call's grid outgrows it, RoPE's ``factor: auto`` is
    ``max(1, L' / L)``: both compare the grid with the built one, so a program traced at 28 px holds on one side of
    that comparison only. With ``dynamic="hw"`` the ``.pt2`` failed a guard at 56 px and the ONNX model (no guards)
    returned logits 3.3e-3 (rel2d_factored) and 8.3e-4 (rel2d_full) away from eager there. Now such a ViT gets
    ``"batch"`` and ``"hw"`` is refused with the reason."""
    m = _vit(pos, depth=1)
    assert best_dynamic(m) == "batch"
    with pytest.raises(ValueError, match=r"compares the image's grid with the built one .* dynamic='batch'"):
        check_exportable(m, "hw")


def test_a_swin_keeps_hw_with_an_interpolating_table():
    """A Swin calls its schemes on whole windows at every size in the symbolic program: no size comparison."""
    torch.manual_seed(0)
    m = vitrel.create_model(
        "vitrel_swin_tiny_patch2_window4_32", pos={"name": "rel2d_full", "extend": "interpolate"}, embed_dim=16,
        depths=(1, 1), num_heads=(2, 2),
    )  # fmt: skip
    assert best_dynamic(m) == "hw"


NAMES = [f"class_{i}" for i in range(10)]


@pytest.fixture(scope="module")
def ema_ckpt(tmp_path_factory):
    """A training checkpoint as ``train.py`` writes it with ``module/ema=default``: trained and EMA weights (apart),
    the module's ``ema_eval`` and the data config (grey 28 px, the run's statistics, class names)."""
    m, ema = _vit({"name": "rel2d_factored"}, depth=1), _vit({"name": "rel2d_factored"}, depth=1)
    with torch.no_grad():
        for p in ema.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    data = dict(input_size=[1, 28, 28], mean=[0.286], std=[0.353], interpolation="bilinear", crop_pct=1.0)
    state = {f"model.{k}": v for k, v in m.state_dict().items()}
    state |= {f"ema_model.module.{k}": v for k, v in ema.state_dict().items()}
    hp = {"num_classes": 10, "ema_eval": True, "data_config": {**data, "class_names": NAMES}}
    path = tmp_path_factory.mktemp("ckpt") / "last.ckpt"
    torch.save({"vitrel_cfg": m.vitrel_cfg, "state_dict": state, "hyper_parameters": hp}, path)
    return path


@pytest.mark.usefixtures("one_torchlib_registry")  # (tests/conftest.py)
def test_onnx_file_alone_reproduces_predict(ema_ckpt, tmp_path, capsys):
    """``python -m vitrel.export CKPT OUT --pt2 --onnx`` then ONNX Runtime on image files, preprocessed from what the
    ONNX file records: predict.py's probabilities on the checkpoint. The ``.pt2`` carried the preprocessing, the ONNX
    file nothing (``metadata_props`` empty: mean / std / size / class names only in config.json beside it), nor which
    weights it holds. Now its metadata has the ``.pt2``'s data config and ``vitrel_weights`` (here ``ema``: the
    weights the run validated with, which the ``wrote`` line names)."""
    ort = pytest.importorskip("onnxruntime")
    from PIL import Image

    from vitrel.export import ONNX_DATA_CONFIG_KEY, ONNX_WEIGHTS_KEY, load_program, main
    from vitrel.inference import eval_transform, load_predictor, predict_folder

    out = tmp_path / "export"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main([str(ema_ckpt), str(out), "--pt2", "--onnx"]) == 0
    assert "(the EMA weights)" in capsys.readouterr().out
    sess = ort.InferenceSession(str(out / "model.onnx"))
    meta = sess.get_modelmeta().custom_metadata_map
    assert meta[ONNX_WEIGHTS_KEY] == "ema"
    cfg = json.loads(meta[ONNX_DATA_CONFIG_KEY])
    assert cfg == load_program(out / "model.pt2")[1] and cfg["class_names"] == NAMES
    rng = np.random.default_rng(0)
    images = tmp_path / "images"
    images.mkdir()
    for i, (h, w, mode) in enumerate([(28, 28, "L"), (56, 40, "RGB"), (33, 33, "RGB")]):
        a = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
        Image.fromarray(a).convert(mode).save(images / f"{i}.png")
    rows = predict_folder(load_predictor(ema_ckpt), images, topk=10, batch_size=4, progress=False).rows
    tf = eval_transform(cfg)
    for row in rows:
        x = tf(Image.open(images / row["filename"]))[None].numpy()
        logits = torch.from_numpy(sess.run(None, {"images": x})[0])
        probs = logits.softmax(-1)[0]
        assert cfg["class_names"][int(probs.argmax())] == row["label_0"]
        want = [row[f"prob_{i}"] for i in range(10)]
        assert max(abs(float(probs[row[f"index_{i}"]]) - want[i]) for i in range(10)) < 1e-5
    # other sizes (dynamic=hw): eager's logits at whole patches; sides that are not whole patches, which eager and the
    # .pt2 refuse, were taken (30 x 28 px: the logits of the top-left 28 x 28 px, max difference 0, the strided
    # convolution dropping the rest); the exported patch embedding now splits the image into whole patches, a reshape
    # that ONNX Runtime refuses for other sides
    model = vitrel.load_model(ema_ckpt, use_ema=True).eval()
    x = torch.randn(3, 1, 56, 40)
    with torch.no_grad():
        assert np.abs(sess.run(None, {"images": x.numpy()})[0] - model(x).numpy()).max() < 1e-5
    for h, w in ((30, 28), (28, 29)):
        with pytest.raises(Exception, match="(?i)reshape"):
            sess.run(None, {"images": np.zeros((1, 1, h, w), np.float32)})


def test_an_export_into_an_earlier_exports_folder_leaves_only_its_own_files(ema_ckpt, tmp_path, capsys):
    """``python -m vitrel.export CKPT OUT --pt2`` (the EMA weights), then ``... OUT --ema false`` into the same folder:
    the first export's ``model.pt2`` stayed beside the trained weights, and ``predict.py ckpt_path=OUT/model.pt2``
    scored the EMA copy. The second export now removes the programs it does not write, and says so."""
    from vitrel.export import main

    out = tmp_path / "export"
    assert main([str(ema_ckpt), str(out), "--pt2"]) == 0
    assert sorted(f.name for f in out.iterdir()) == ["config.json", "model.pt2", "model.safetensors"]
    capsys.readouterr()
    assert main([str(ema_ckpt), str(out), "--ema", "false"]) == 0
    assert sorted(f.name for f in out.iterdir()) == ["config.json", "model.safetensors"]
    assert f"removed model.pt2 of an earlier export to {out}" in capsys.readouterr().out
    assert main([str(ema_ckpt), str(out), "--ema", "false", "--pt2"]) == 0  # (a program written again: kept)
    assert sorted(f.name for f in out.iterdir()) == ["config.json", "model.pt2", "model.safetensors"]
    assert "removed" not in capsys.readouterr().out


def test_an_example_size_of_no_whole_patches_under_dynamic_hw_names_the_nearest_sizes(ema_ckpt, tmp_path, capsys):
    """``python -m vitrel.export CKPT OUT --pt2 --img-size 30`` (patches of 4 px, ``dynamic=hw``) failed in torch.export
    ("Expected shape[2] = 30 ... of the form 4*grid_h") and advised ``--dynamic static``, which the model refuses at 30
    px too. It now says the size must be whole patches and names the nearest, before anything is written; the advice
    runs."""
    from vitrel.export import main

    out = tmp_path / "export"
    for size, said in (
        (["30"], "28x28 (--img-size 28) or 32x32 (--img-size 32)"),
        (["30", "36"], "28x36 (--img-size 28 36) or 32x36"),
    ):
        assert main([str(ema_ckpt), str(out), "--pt2", "--img-size", *size]) == 2
        err = capsys.readouterr().err
        assert "is not a multiple of the patch size 4" in err and f"the nearest, {said}" in err, err
        assert "static" not in err and not out.exists()
    assert main([str(ema_ckpt), str(out), "--pt2", "--img-size", "32"]) == 0


def test_load_model_on_an_export_folders_program_or_config_says_what_loads_them(ema_ckpt, tmp_path):
    """``vitrel.load_model("<export>/model.pt2")`` and ``load_model("<export>/config.json")`` said "truncated or not a
    torch checkpoint" (torch.load read them). Each now says what the file is and what loads it; that advice runs."""
    from vitrel.export import load_program, main
    from vitrel.models.checkpoint import CheckpointError

    out = tmp_path / "export"
    assert main([str(ema_ckpt), str(out), "--pt2"]) == 0
    for name, said in (
        ("model.pt2", "is a torch.export program (python -m vitrel.export ... --pt2), not weights"),
        ("config.json", "is an export folder's configuration, not its weights: load the folder, vitrel.load_model("),
    ):
        with pytest.raises(CheckpointError, match=re.escape(f"{out / name} {said}")) as err:
            vitrel.load_model(out / name)
        assert "truncated" not in str(err.value) and f"vitrel.load_model('{out}')" in str(err.value)
    ep, data_config = load_program(out / "model.pt2")
    x = torch.randn(2, 1, 28, 28)
    torch.testing.assert_close(ep.module()(x), vitrel.load_model(out).eval()(x), rtol=0, atol=1e-5)


@pytest.mark.usefixtures("one_torchlib_registry")
@pytest.mark.parametrize("opset", [17, 18])
def test_the_wrote_line_names_the_opset_the_onnx_file_has(ema_ckpt, tmp_path, capsys, opset):
    """``--opset 17``: torch's exporter writes opset 18 and converts it down where it can; for this model the
    conversion failed (no adapter for Pad), the file kept 18, and the command said ``(ONNX opset 17, ...)``. Now the
    wrote line names the file's opset, and where it is not the one asked for a warning names both."""
    onnx = pytest.importorskip("onnx")
    from vitrel.export import main

    out = tmp_path / "out"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main([str(ema_ckpt), str(out), "--onnx", "--opset", str(opset)]) == 0
    said = capsys.readouterr()
    written = next(o.version for o in onnx.load(str(out / "model.onnx")).opset_import if o.domain in ("", "ai.onnx"))
    assert f"wrote {out / 'model.onnx'} (ONNX opset {written}, dynamic=hw)" in said.out, said.out
    warned = f"warning: --opset {opset} asked; torch's exporter could not convert to it: the file has opset {written}"
    assert (warned in said.err) == (written != opset), said.err


@pytest.mark.usefixtures("one_torchlib_registry")
def test_a_program_of_one_size_records_that_size(ema_ckpt, tmp_path):
    """``--dynamic batch --img-size 48``: a program of 48 px images only, whose ONNX metadata and ``.pt2`` data config
    said the checkpoint's ``input_size`` [1, 28, 28]; images preprocessed by it (docs/export.md) were refused by ONNX
    Runtime ("Got: 28 Expected: 48"). Now both record [1, 48, 48], and ONNX Runtime scores images preprocessed by it
    as the ``.pt2`` does. A program of every size (``--dynamic hw``, traced at 48) keeps the trained 28 as the
    default; a ``.pt2`` written before (its data config the trained size) is read at its program's size."""
    ort = pytest.importorskip("onnxruntime")
    from PIL import Image

    from vitrel.export import DATA_CONFIG_NAME, ONNX_DATA_CONFIG_KEY, load_program, main
    from vitrel.inference import eval_transform, load_predictor

    out, hw = tmp_path / "b48", tmp_path / "hw48"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main([str(ema_ckpt), str(out), "--pt2", "--onnx", "--dynamic", "batch", "--img-size", "48"]) == 0
        assert main([str(ema_ckpt), str(hw), "--pt2", "--onnx", "--dynamic", "hw", "--img-size", "48"]) == 0
    sess = ort.InferenceSession(str(out / "model.onnx"))
    cfg = json.loads(sess.get_modelmeta().custom_metadata_map[ONNX_DATA_CONFIG_KEY])
    ep, stored = load_program(out / "model.pt2")
    assert cfg["input_size"] == [1, 48, 48] and cfg == stored and cfg["class_names"] == NAMES
    predictor = load_predictor(out / "model.pt2")
    assert predictor.data_config == cfg
    img = Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 56), dtype=np.uint8))
    x = eval_transform(cfg)(img)[None]
    assert x.shape == (1, 1, 48, 48)
    with torch.no_grad():
        np.testing.assert_allclose(sess.run(None, {"images": x.numpy()})[0], predictor.model(x).numpy(), atol=1e-5)
    every = ort.InferenceSession(str(hw / "model.onnx")).get_modelmeta().custom_metadata_map[ONNX_DATA_CONFIG_KEY]
    assert json.loads(every)["input_size"] == load_program(hw / "model.pt2")[1]["input_size"] == [1, 28, 28]
    old = tmp_path / "old.pt2"
    torch.export.save(ep, str(old), extra_files={DATA_CONFIG_NAME: json.dumps({**cfg, "input_size": [1, 28, 28]})})
    assert load_predictor(old).data_config["input_size"] == [1, 48, 48]


def test_a_one_size_pt2_run_by_vitrel_names_both_sizes(tmp_path):
    """A ``.pt2`` of one image size (``dynamic="batch"``, traced at 28 px) called at 32 px through
    ``vitrel.inference.load_predictor`` raised torch's bare ``Guard failed: x.size()[2] == 28``; it now names both
    sizes and the fix. torch's own ``torch.export.load(...).module()`` is left as it is."""
    from vitrel.export import export_program, save_program
    from vitrel.inference import load_predictor

    m = _vit({"name": "rel2d_full"}, depth=1)
    config = {"input_size": [1, 28, 28], "mean": [0.5], "std": [0.5], "crop_pct": 1.0, "interpolation": "bilinear"}
    path = save_program(export_program(m, torch.randn(2, 1, 28, 28), dynamic="batch"), tmp_path / "m.pt2", config)
    model = load_predictor(path).model
    x = torch.randn(3, 1, 28, 28)
    torch.testing.assert_close(model(x), m(x), rtol=1e-5, atol=1e-5)  # the program's own size runs as before
    fix = r"m\.pt2 takes 28x28 images \(a program of one image size\), got 32x32: resize them to 28x28 .*--dynamic hw"
    with pytest.raises(ValueError, match=fix):
        model(torch.randn(3, 1, 32, 32))
    with pytest.raises(ValueError, match=r"takes input of shape \[1\.\.65536, 1, 28, 28\], got \[3, 3, 28, 28\]"):
        model(torch.randn(3, 3, 28, 28))
    with pytest.raises(AssertionError, match="Guard failed"):  # torch's module, called directly: unchanged
        torch.export.load(str(path)).module()(torch.randn(3, 1, 32, 32))


@pytest.mark.parametrize("arch", ["vit", "swin"])
def test_a_dynamic_pt2_run_by_vitrel_names_the_patch_and_the_sizes_it_takes(tmp_path, arch):
    """A ``.pt2`` of dynamic height and width (``dynamic="hw"``) called through ``vitrel.inference.load_predictor`` at a
    side that is not whole patches raised torch's bare ``Guard failed: x.size()[2] % 4 == 0``; it now names the size,
    the patch and the sizes the program takes (export's ``patch * Dim``: 4 px for the ViT, 2 px for the Swin, up to
    MAX_SIDE = 4096 px)."""
    from vitrel.export import export_program, program_input_sizes, save_program
    from vitrel.inference import load_predictor

    if arch == "vit":
        m, patch = _vit({"name": "rope2d_axial"}, depth=1), 4
    else:
        m = vitrel.create_model(
            "vitrel_swin_tiny_patch2_window4_32", img_size=28, in_chans=1, num_classes=10, embed_dim=16, depths=[1, 1],
            num_heads=[2, 2],
        ).eval()  # fmt: skip
        patch = 2
    config = {"input_size": [1, 28, 28], "mean": [0.5], "std": [0.5], "crop_pct": 1.0, "interpolation": "bilinear"}
    ep = export_program(m, torch.randn(2, 1, 28, 28), dynamic="hw")
    sides = range(patch, 4097, patch)
    assert program_input_sizes(ep) == (range(1, 65537), 1, sides, sides)
    model = load_predictor(save_program(ep, tmp_path / "m.pt2", config)).model
    x = torch.randn(3, 1, 8 * patch, 12 * patch)
    torch.testing.assert_close(model(x), m(x), rtol=1e-5, atol=1e-5)  # whole patches of another size run as before
    fix = (
        rf"m\.pt2 takes images whose sides are whole patches of {patch} px \({patch}\.\.4096 in steps of {patch} px "
        rf"high, {patch}\.\.4096 in steps of {patch} px wide\), got 29x{8 * patch}: resize or crop them to whole "
        rf"patches, e.g. {29 // patch * patch}x{8 * patch} "
    )
    with pytest.raises(ValueError, match=fix):
        model(torch.randn(1, 1, 29, 8 * patch))
    big = 4096 + 2 * patch  # (whole patches, beyond the program's largest side: before, told to make whole patches)
    beyond = rf"m\.pt2 takes images of whole {patch} px patches from {patch} to 4096 px high and {patch} to 4096 px "
    beyond += "wide, "
    with pytest.raises(ValueError, match=beyond + rf"got {big}x{8 * patch}: resize them into that range, e.g. 4096x"):
        model(torch.zeros(1, 1, big, 8 * patch))
    with pytest.raises(ValueError, match=r"takes input of shape \[1\.\.65536, 1, .*\], got \[1, 3, 28, 28\]"):
        model(torch.randn(1, 3, 28, 28))
    with pytest.raises(AssertionError, match="Guard failed"):  # torch's module, called directly: unchanged
        ep.module()(torch.randn(1, 1, 29, 8 * patch))


@pytest.mark.parametrize("img_size, warned", [(64, True), (28, False)])
def test_export_of_a_naflex_run_says_its_fixed_size_was_never_trained(tmp_path, capsys, img_size, warned):
    """A run trained and tested on NaFlex batches (``data.packing``, at most ``data.max_tokens`` = 64 patches an image):
    its export records the model's built size as the fixed input, 64 px = 256 patches here (``data=imagenet``'s 224 =
    3136 in a real run), which training never fed it. predict.py on the export folder then scored every image there,
    in silence (tiny run: top-1 probability 2e-3 off predict.py on the .ckpt, which scores as the run did). Now the
    command warns, naming the run's budget and the two ways that score images as the run did; a size within the
    budget (28 px: 49 patches, Fashion-MNIST's) says nothing."""
    from vitrel.export import main

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / ".hydra").mkdir()
    (run / ".hydra" / "config.yaml").write_text("data:\n  packing: pack\n  seq_len: 64\n  max_tokens: 64\n")
    m = vitrel.create_model("vitrel_vit_tiny_patch4_32", img_size=img_size, embed_dim=16, depth=1, num_heads=2)
    state = {f"model.{k}": v for k, v in m.state_dict().items()}
    torch.save({"vitrel_cfg": m.vitrel_cfg, "state_dict": state, "hyper_parameters": {"num_classes": 1000}},
               run / "checkpoints" / "last.ckpt")  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (no data config stored: the architecture's statistics, warned)
        assert main([str(run / "checkpoints" / "last.ckpt"), str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    if warned:
        assert "warning: last.ckpt's run trained and tested on NaFlex batches" in err, err
        assert "at most 64 patches" in err and "fixed 64x64 images (256 patches of 4 px)" in err, err
        assert "predict.py on the .ckpt" in err and "dynamic=hw program" in err, err
    else:
        assert "NaFlex" not in err, err
