"""The export path as a user walks it (docs/export.md): what the exported files compute, at which sizes, and what they
record. Small and quick; the scheme matrix is tests/models/test_export.py."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import vitrel
from vitrel.export import best_dynamic, check_exportable, example_input, onnx_program


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


def test_onnx_of_an_interpolating_table_is_right_or_refuses_at_another_size(tmp_path):
    """The program ``python -m vitrel.export`` would write (``best_dynamic``) for ``rel2d_factored`` with ``extend:
    interpolate``, in ONNX Runtime: equal to eager at the traced size; at 56 px (a grid larger than the table's)
    either equal to eager or refused, never other numbers."""
    ort = pytest.importorskip("onnxruntime")
    m = _vit({"name": "rel2d_factored", "extend": "interpolate"})
    x0 = example_input(m)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        onnx_program(m, x0, best_dynamic(m)).save(str(tmp_path / "m.onnx"))
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"))
    for x in (x0, torch.randn(1, 1, 56, 56)):
        with torch.no_grad():
            ref = m(x).numpy()
        try:
            got = sess.run(None, {"images": x.numpy()})[0]
        except Exception as e:  # onnxruntime's own error types: a refusal of the input's shape
            assert x.shape[-1] != 28 and "dimension" in str(e).lower(), e
            continue
        assert np.abs(got - ref).max() < 1e-5, (tuple(x.shape), np.abs(got - ref).max())


def test_a_swin_keeps_hw_with_an_interpolating_table():
    """A Swin calls its schemes on whole windows at every size in the symbolic program: no size comparison."""
    torch.manual_seed(0)
    m = vitrel.create_model(
        "vitrel_swin_tiny_patch2_window4_32", pos={"name": "rel2d_full", "extend": "interpolate"}, embed_dim=16,
        depths=(1, 1), num_heads=(2, 2),
    )  # fmt: skip
    assert best_dynamic(m) == "hw"
