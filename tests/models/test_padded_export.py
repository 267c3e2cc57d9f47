"""A ViT built with timm's ``dynamic_img_pad=True`` (docs/dense.md: images of any size zero-padded on the right and
bottom to whole patches) through ``vitrel.export``: its ``"hw"`` program, ``.pt2`` and ONNX model take every side the
eager model takes (docs/export.md). The scheme matrix at whole patches is tests/models/test_export.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import vitrel
from tests.weights import lively
from vitrel.export import export_program, program_input_sizes

#: the traced size, sides that are not whole patches of 4 px (30 x 30 pads to 32 x 32; 33 x 45 to 36 x 48, a grid
#: larger than the built 8 x 8; 5 x 3 to 8 x 4), and whole patches of another size
SIZES = [(2, 3, 32, 32), (1, 3, 30, 30), (3, 3, 33, 45), (1, 3, 5, 3), (2, 3, 24, 36)]
SCHEMES = ["rel2d_full", "rope2d_axial"]  # a relative bias and a rotary scheme
ANY_SIDE = range(1, 4097)  # (vitrel.export.MAX_SIDE, in steps of 1 px)


def padding_vit(pos: str, global_pool: str = "avg") -> torch.nn.Module:
    """A one-block ViT of 4 px patches built with ``dynamic_img_pad=True``, average-pooled (every patch reaches the
    logits), with :func:`tests.weights.lively` weights (under timm's init a scheme barely moves the logits)."""
    torch.manual_seed(0)
    m = vitrel.create_model(
        "vitrel_vit_tiny_patch4_32", pos=pos, embed_dim=32, depth=1, num_heads=2, global_pool=global_pool,
        dynamic_img_pad=True,
    )  # fmt: skip
    return lively(m).eval()


@pytest.mark.parametrize("pos", SCHEMES)
def test_a_padding_vit_has_one_hw_program_for_every_side(pos):
    """``export_program(m, dynamic="hw")`` of a ``dynamic_img_pad`` ViT refused a 30 px example ("not a multiple of
    the patch size"), and its program, traced at 32 px, failed a guard at 30 x 30 px where eager pads to 32 x 32. The
    program is now traced in pixels and pads inside: traced at 30 px, it equals eager at every size of SIZES, and
    eager there is the model on the image zero-padded by hand (timm's ``dynamic_img_pad``)."""
    m = padding_vit(pos)
    ep = export_program(m, torch.randn(2, 3, 30, 30), dynamic="hw")
    assert program_input_sizes(ep) == (range(1, 65537), 3, ANY_SIDE, ANY_SIDE)
    program = ep.module()
    with torch.no_grad():
        for shape in SIZES:
            x = torch.randn(*shape)
            want = m(x)
            torch.testing.assert_close(program(x), want, rtol=1e-5, atol=1e-5)
            h, w = shape[-2:]
            padded = F.pad(x, (0, -w % 4, 0, -h % 4))  # (the right and bottom, to whole patches)
            torch.testing.assert_close(m(padded), want, rtol=0, atol=0)


def test_a_padding_vit_with_timms_map_pool_keeps_a_program_of_whole_patches():
    """Through timm's ``AttentionPoolLatent`` (``global_pool="map"``) a program traced in pixels is refused by torch
    (a guard on the padded grid it cannot prove): such a ViT's ``"hw"`` program stays one of whole patches (of 2 or
    more), equal to eager there, and a 30 px example is refused naming the pool."""
    m = padding_vit("rel2d_full", global_pool="map")
    with pytest.raises(ValueError, match=r"not a multiple of the patch size 4: .*not into global_pool='map'"):
        export_program(m, torch.randn(2, 3, 30, 30), dynamic="hw")
    ep = export_program(m, torch.randn(2, 3, 32, 32), dynamic="hw")
    assert [r.step for r in program_input_sizes(ep)[2:]] == [4, 4]  # (whole patches)
    x = torch.randn(1, 3, 24, 36)
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(x), m(x), rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("one_torchlib_registry")  # (tests/conftest.py)
@pytest.mark.parametrize("pos", SCHEMES)
def test_the_export_command_writes_programs_of_every_side_for_a_padding_vit(tmp_path, pos):
    """``python -m vitrel.export WEIGHTS OUT --pt2 --onnx --img-size 30`` of a ``dynamic_img_pad`` ViT refused the 30
    px example. With sides in pixels, the ONNX model cropped a 30 px side to 28 px in ONNX Runtime (the grid's
    ceiling ``-(-30 // 4)`` became ONNX's truncating ``Div``: 7 patches, not 8), 0.03 away from eager, until the grid
    was written ``(30 + 3) // 4``. Now the ``.pt2`` (through ``load_predictor``, whose size check says the program
    takes any side) and the ONNX model equal eager at every size of SIZES."""
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from vitrel.export import main
    from vitrel.inference import load_predictor
    from vitrel.models.checkpoint import save_pretrained

    m = padding_vit(pos)
    src, out = save_pretrained(m, tmp_path / "weights"), tmp_path / "out"
    assert main([str(src), str(out), "--pt2", "--onnx", "--img-size", "30"]) == 0
    model = load_predictor(out / "model.pt2").model
    assert model.shape == (range(1, 65537), 3, ANY_SIDE, ANY_SIDE)
    sess = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    with torch.no_grad():
        for shape in SIZES:
            x = torch.randn(*shape)
            want = m(x)
            torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)
            (got,) = sess.run(None, {"images": x.numpy()})
            np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-4)
    said = r"model\.pt2 takes images of any side from 1 to 4096 px \(padded to whole patches in the program\)"
    with pytest.raises(ValueError, match=rf"{said}, got 4100x8: resize them to at most 4096 px a side"):
        model(torch.randn(1, 3, 4100, 8))
