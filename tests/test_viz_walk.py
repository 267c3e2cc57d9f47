"""A researcher's look at what a run learned: a checkpoint ``train.py`` wrote, loaded, its position scheme drawn, the
numbers behind the pictures checked against the scheme's equation in float64, and the wrong things handed to the
drawing functions refused in one line."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import vitrel  # noqa: E402
from tests.train_helpers import FAST, TINY_VIT, compose  # noqa: E402
from vitrel import viz  # noqa: E402

RUN = [*TINY_VIT, *(o for o in FAST if o != "callbacks.pos_images=null"), "callbacks.pos_images.every_n_epochs=1"]
RUN += ["trainer.max_steps=3", "trainer.limit_train_batches=3", "trainer.limit_val_batches=1", "logger=none"]
RUN += ["test=false", "module/ema=default", "pos=rel2d_full"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny rel2d_full ViT trained 3 steps with an EMA, and what its position-picture callback drew:
    ``(run folder, [(title, kernel of the scheme drawn)])``."""
    from vitrel.train.run import train

    drawn, plot = [], viz.plot_pos_scheme

    def record(scheme, grid=None, title=None, **kw):
        drawn.append((title, viz.position_kernel(scheme, grid)))
        return plot(scheme, grid, title, **kw)

    out = tmp_path_factory.mktemp("walk")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(viz, "plot_pos_scheme", record)
        train(compose(out, RUN))
    return out, drawn


def test_kernel_of_a_loaded_run_is_its_table_read_at_query_minus_key(run):
    s = vitrel.load_model(run[0]).blocks[0].attn.pos
    table, (h, w), (qi, qj) = s.table.detach().double(), s.grid, (1, 5)
    kernel = viz.position_kernel(s, query=(qi, qj)).double()
    for r in range(h):
        for c in range(w):  # Swin: B[row_i - row_j + H - 1, col_i - col_j + W - 1], i the query
            torch.testing.assert_close(kernel[:, r, c], table[qi - r + h - 1, qj - c + w - 1], rtol=0, atol=1e-7)
    fig = viz.plot_pos_scheme(s, query=(qi, qj))
    assert "query (1, 5)" in fig._suptitle.get_text()
    assert fig.axes[0].lines[0].get_xydata().tolist() == [[qj, qi]]  # the x at column 5, row 1


def test_callback_draws_the_weights_the_run_scores_and_says_so(run):
    folder, drawn = run
    title, kernel = [d for d in drawn if d[0].startswith("blocks.0.attn.pos:")][-1]  # at the end of training
    raw = vitrel.load_model(folder, use_ema=False).blocks[0].attn.pos
    loaded = vitrel.load_model(folder).blocks[0].attn.pos  # the EMA copy: what the run validated with
    assert not torch.allclose(viz.position_kernel(raw), viz.position_kernel(loaded))
    torch.testing.assert_close(kernel, viz.position_kernel(loaded))
    assert "EMA weights" in title, title


def _swin():
    return vitrel.create_model(
        "vitrel_swin_tiny_patch2_window4_32", embed_dim=16, depths=(1, 1), num_heads=(2, 2), num_classes=10
    )


DRAW = {
    "position_matrix": lambda m: viz.position_matrix(m),
    "position_kernel": lambda m: viz.position_kernel(m),
    "rope_similarity": lambda m: viz.rope_similarity(m),
    "rope_freqs": lambda m: viz.rope_freqs(m),
    "content_tables": lambda m: viz.content_tables(m),
    "plot_pos_scheme": lambda m: viz.plot_pos_scheme(m),
    "plot_schemes": lambda m: viz.plot_schemes({"m": m}),
    "plot_rope_similarity": lambda m: viz.plot_rope_similarity({"m": m}),
    "plot_content_tables": lambda m: viz.plot_content_tables(m),
}


@pytest.mark.parametrize("fn", list(DRAW))
def test_a_model_or_attention_layer_is_refused_in_one_line_naming_a_scheme(run, fn):
    vit = vitrel.load_model(run[0])
    swin = _swin()
    for obj, inner in [(vit, "blocks.0.attn.pos"), (vit.blocks[0].attn, "pos"), (swin, "layers.0.blocks.0.attn.pos")]:
        with pytest.raises(TypeError, match=f"^{fn} draws a position scheme") as e:
            DRAW[fn](obj)
        assert "\n" not in str(e.value) and f".get_submodule({inner!r})" in str(e.value)


def test_plot_swin_windows_refuses_a_model_in_one_line():
    with pytest.raises(TypeError, match="^plot_swin_windows takes a map size") as e:
        viz.plot_swin_windows(_swin())
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("grid,window", [((4, 8, 8), (2, 4, 4)), ((4, 8, 8), 4), ((8, 8), (2, 4, 4))])
def test_plot_swin_windows_refuses_a_video_swins_map_in_one_line(grid, window):
    """A Video Swin's map ``(T, H, W)`` and window ``(Wt, Wh, Ww)`` drew a 2-D picture titled ``Swin windows 2x4 on a
    8x8 map``: the time window taken as the height. Refused, naming one frame's call that draws its spatial windows."""
    with pytest.raises(ValueError, match=r"^plot_swin_windows draws an image map \(H, W\) and window \(Wh, Ww\)") as e:
        viz.plot_swin_windows(grid, window)
    assert "\n" not in str(e.value) and "plot_swin_windows((8, 8), (4, 4))" in str(e.value)


@pytest.mark.parametrize("fn", ["plot_schemes", "rope_similarity", "offset_profile"])
def test_image_only_pictures_refuse_a_video_grid_in_one_line(fn):
    s = vitrel.build_pos("rope3d_axial", num_heads=2, head_dim=12, grid=(2, 3, 4))
    call = {
        "plot_schemes": lambda: viz.plot_schemes({"v": s}),
        "rope_similarity": lambda: viz.rope_similarity(s),
        "offset_profile": lambda: viz.offset_profile(viz.position_matrix(s), s.grid),
    }[fn]
    with pytest.raises(ValueError, match=f"^{fn} takes an image grid .* not the video grid 2x3x4"):
        call()


def test_offset_profile_axes_are_query_minus_key():
    """A key one row below and two columns right of its query is at ``(dh, dw) = (-1, -2)`` (module docstring)."""
    n = 12  # a 3x4 grid
    m = torch.zeros(1, n, n, dtype=torch.float64)
    for i in range(n):
        r, c = divmod(i, 4)
        if r + 1 < 3 and c + 2 < 4:
            m[0, i, (r + 1) * 4 + c + 2] = 1.0
    prof = viz.offset_profile(m, (3, 4))[0].numpy()
    assert np.argwhere(prof > 0).tolist() == [[-1 + 2, -2 + 3]]


def test_offset_axes_of_the_table_pictures_say_query_minus_key():
    """Shaw's key term at query (1, 3) peaks on the key one row below and two columns left, offset (dh, dw) =
    (-1, 2): the table picture puts the peak at y = -1, x = 2 and its axes say the offset is query minus key."""
    s = vitrel.build_pos("shaw2d_full", num_heads=1, head_dim=4, grid=(4, 5))
    with torch.no_grad():
        s.rel_k.zero_()
        s.rel_k[-1 + 3, 2 + 4] = 1.0  # [dh + Kh, dw + Kw]
    kernel = viz.position_kernel(s, query=(1, 3))[0]
    assert np.argwhere(kernel.numpy() > 0).tolist() == [[2, 1]]
    ax = viz.plot_content_tables(s).axes[0]
    img = ax.images[0]
    row, col = np.unravel_index(np.argmax(img.get_array()), img.get_array().shape)
    left, _, _, top = img.get_extent()
    assert (top + 0.5 + row, left + 0.5 + col) == (-1, 2)
    assert (ax.get_ylabel(), ax.get_xlabel()) == ("dh = row_q - row_k", "dw = col_q - col_k")
    rope = vitrel.build_pos("rope2d_axial", num_heads=1, head_dim=8, grid=(3, 3))
    ax = viz.plot_rope_similarity({"r": rope}, max_heads=1).axes[0]
    assert (ax.get_ylabel(), ax.get_xlabel()) == ("dh = row_q - row_k", "dw = col_q - col_k")


@pytest.mark.parametrize("fn", ["plot_schemes", "plot_rope_similarity"])
def test_one_scheme_where_a_mapping_is_taken_is_one_line(fn):
    """``plot_rope_similarity(scheme)`` (a 3-D RoPE's own scheme, say) raised ``AttributeError: 'Rope3dAxial' object has
    no attribute 'values'``; now one line that names the mapping to pass."""
    scheme = vitrel.create_model("vitrel_vit_video_tiny_patch4_32", pos="rope3d_axial").blocks[0].attn.pos
    said = rf"^{fn} takes a mapping {{name: scheme}}, got Rope3dAxial: {fn}\({{'rope3d_axial': scheme}}\)"
    with pytest.raises(TypeError, match=said) as e:
        getattr(viz, fn)(scheme)
    assert "\n" not in str(e.value)
