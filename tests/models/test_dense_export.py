"""Dense backbones (timm's ``features_only`` wrappers around vitrel models) through ``vitrel.export`` and
``vitrel.load_model``: what a segmentation or detection user deploys (docs/dense.md)."""

from __future__ import annotations

import pytest
import timm
import torch

from vitrel.export import best_dynamic, export_program

VIT = dict(name="vitrel_vit_tiny_patch4_32", embed_dim=32, depth=3, num_heads=2, pos="rel2d_factored")
SWIN = dict(
    name="vitrel_swin_tiny_patch2_window4_32", embed_dim=16, depths=(2, 2), num_heads=(1, 2), pos="rel2d_factored"
)
#: the ONNX test's backbone: two stages (two maps) of one block each; the shifted blocks' windows and masks through
#: ONNX are tests/models/test_export.py's (every Swin case there has them), at every size here through torch.export
SWIN_ONNX = dict(SWIN, depths=(1, 1))


def features(spec: dict, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    spec = dict(spec)
    return timm.create_model(spec.pop("name"), features_only=True, **{**spec, **kw}).eval()


@pytest.mark.parametrize(
    "spec,kw",
    [(VIT, {}), (VIT, dict(feature_cls="hook")), (SWIN, dict(output_fmt="NCHW"))],
    ids=["vit", "vit-hook", "swin"],
)
def test_features_only_backbone_exports_at_every_size(spec, kw):
    """One ``dynamic="hw"`` program of a ``features_only`` backbone gives eager's maps (exactly, float32 on CPU) at
    the traced size and at other batches and sides."""
    f = features(spec, **kw)
    assert best_dynamic(f) == "hw"
    ep = export_program(f, example=torch.randn(2, 3, 32, 32), dynamic="hw")
    for shape in [(2, 3, 32, 32), (1, 3, 24, 40), (3, 3, 16, 8)]:
        x = torch.randn(*shape)
        with torch.no_grad():
            want, got = f(x), ep.module()(x)
        assert len(got) == len(want)
        for a, b in zip(want, got):
            assert a.shape == b.shape
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_features_only_swin_with_extent_scheme_gets_batch():
    """A wrapped Swin whose scheme depends on the window's extent is seen as the bare model is: ``best_dynamic``
    says ``"batch"`` and ``dynamic="hw"`` is refused before tracing, with the reason."""
    f = features(SWIN, pos="rope1d")
    assert best_dynamic(f) == best_dynamic(f.model) == "batch"
    with pytest.raises(ValueError, match="window's extent"):
        export_program(f, example=torch.randn(1, 3, 32, 32), dynamic="hw")


@pytest.mark.usefixtures("one_torchlib_registry")  # (tests/conftest.py)
@pytest.mark.parametrize(
    "kw", [dict(output_fmt="NCHW"), dict(feature_cls="fx", out_indices=(1,))], ids=["getter", "fx"]
)
def test_features_only_onnx_names_the_maps(tmp_path, kw):
    """The ONNX model of a backbone names its outputs ``features_<i>`` (not ``logits``) and equals eager in ONNX
    Runtime (max difference <= 1e-4) at the traced size and at another."""
    pytest.importorskip("onnxscript")
    ort = pytest.importorskip("onnxruntime")
    from vitrel.export import export_onnx

    f = features(SWIN_ONNX, **kw)
    path = export_onnx(f, tmp_path / "f.onnx", example=torch.randn(2, 3, 32, 32))
    sess = ort.InferenceSession(str(path))
    assert [o.name for o in sess.get_outputs()] == [f"features_{i}" for i in range(len(f.feature_info.out_indices))]
    for shape in [(2, 3, 32, 32), (1, 3, 24, 40)]:
        x = torch.randn(*shape)
        with torch.no_grad():
            want = f(x)
        for a, b in zip(want, sess.run(None, {"images": x.numpy()})):
            torch.testing.assert_close(torch.from_numpy(b), a, rtol=1e-4, atol=1e-4)


def test_load_model_features_only_gives_the_backbone_timm_builds_from_the_same_weights(tmp_path):
    """``vitrel.load_model(path, features_only=True, ...)`` and ``vitrel.create_model(name, checkpoint_path=path,
    features_only=True)`` (once refused, naming timm's route) give the backbone timm's route builds: the stored
    model's intermediates exactly, in training mode as timm's, at a resized ``img_size`` too; only timm's getter
    takes weights (``hook`` is refused naming it)."""
    import vitrel
    from vitrel.models import save_pretrained

    torch.manual_seed(0)
    spec = dict(VIT)
    model = vitrel.create_model(spec.pop("name"), **spec).eval()
    save_pretrained(model, tmp_path / "export")
    timm_route = timm.create_model(
        VIT["name"],
        pretrained=True,
        pretrained_cfg_overlay=dict(file=str(tmp_path / "export" / "model.safetensors")),
        features_only=True,
        out_indices=(0, 2),
    )
    ours = vitrel.load_model(tmp_path / "export", features_only=True, out_indices=(0, 2))
    also = vitrel.create_model(
        VIT["name"], checkpoint_path=str(tmp_path / "export"), features_only=True, out_indices=(0, 2)
    )
    assert type(ours) is type(timm_route) and ours.training and timm_route.training
    assert also.feature_info.out_indices == ours.feature_info.out_indices == timm_route.feature_info.out_indices
    assert ours.pretrained_cfg == {
        k: v for k, v in timm_route.pretrained_cfg.items() if k != "file"
    }  # (timm's: the file)
    x = torch.randn(2, 3, 24, 32)
    with torch.no_grad():
        want = model.forward_intermediates(x, indices=[0, 2], intermediates_only=True)
        for got in (timm_route.eval()(x), ours.eval()(x), also.eval()(x)):
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        bigger = vitrel.load_model(tmp_path / "export", img_size=64, features_only=True).eval()
        x = torch.randn(1, 3, 64, 64)
        want = vitrel.load_model(tmp_path / "export", img_size=64).eval()
        assert all(torch.equal(a, b) for a, b in zip(bigger(x), want.forward_intermediates(x, indices=3)[1]))
    with pytest.raises(ValueError, match="feature_cls='getter'"):
        vitrel.load_model(tmp_path / "export", features_only=True, feature_cls="hook")
