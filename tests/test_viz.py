"""vitrel.viz: the numbers behind the pictures against naive float64 references, and the figures' layout."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

import vitrel
from vitrel import viz
from vitrel.pos import Grid, list_pos
from vitrel.pos.base import FAMILIES


def build(name: str, grid=(4, 5), heads: int = 3, head_dim: int = 8, **kw):
    torch.manual_seed(0)
    return vitrel.build_pos(name, num_heads=heads, head_dim=head_dim, grid=grid, **kw)


def panels(fig) -> list:
    """The figure's axes without the colour bars."""
    return [a for a in fig.axes if a.get_label() != "<colorbar>"]


# ------------------------------------------------------------------------------------------ numbers
@pytest.mark.parametrize("name", ["rel2d_full", "rel2d_factored", "rel2d_cpb", "rel2d_bucket", "alibi2d", "alibi1d"])
@pytest.mark.parametrize("query", [None, (0, 0), (3, 1), 7])
def test_heat_map_of_a_bias_is_the_bias_row(name, query):
    s = build(name)
    g = Grid(4, 5)
    if name == "rel2d_full":  # make the table clearly non-trivial
        with torch.no_grad():
            s.table.normal_()
    bias = s.bias(g, 0).detach()
    k = viz.position_kernel(s, g, query)
    i = 2 * 5 + 2 if query is None else (query if isinstance(query, int) else query[0] * 5 + query[1])
    assert k.shape == (3, 4, 5)
    torch.testing.assert_close(k, bias[:, i].reshape(3, 4, 5).float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(viz.position_matrix(s, g), bias.float(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["rel3d_full", "rel3d_factored", "alibi3d"])
@pytest.mark.parametrize("query", [None, (0, 0, 0), (3, 2, 1), 37])
def test_video_heat_map_of_a_bias_is_the_bias_row(name, query):
    """On a video grid ``(T, H, W)`` (t-major tokens) the kernel is ``[heads, T, H, W]``; the query ``(frame, row,
    col)`` or a raster index (default: the centre, ``(T//2, H//2, W//2)``)."""
    s = build(name, grid=(4, 3, 5))
    with torch.no_grad():
        for p in s.parameters():
            p.normal_()
    g = vitrel.layout.geometry.Grid3(4, 3, 5)
    bias = s.bias(g, 0).detach()
    t, r, c = (2, 1, 2) if query is None else (37 // 15, 37 % 15 // 5, 37 % 5) if query == 37 else query
    k = viz.position_kernel(s, g, query)
    assert k.shape == (3, 4, 3, 5)
    for h in range(3):
        for tj in range(4):
            for rj in range(3):
                for cj in range(5):
                    want = float(bias[h, (t * 3 + r) * 5 + c, (tj * 3 + rj) * 5 + cj])
                    assert float(k[h, tj, rj, cj]) == pytest.approx(want, abs=1e-5)


def test_plot_pos_scheme_of_a_video_grid_shows_every_frame_per_head():
    """One strip per head: the ``T`` frames' ``H x W`` maps side by side, a blank column between frames."""
    s = build("rel3d_factored", grid=(4, 3, 5))
    with torch.no_grad():
        s.table_t.normal_()
    fig = viz.plot_pos_scheme(s, query=(1, 0, 4))
    axes = panels(fig)
    assert len(axes) == 3
    kernel = viz.position_kernel(s, query=(1, 0, 4))
    for h, ax in enumerate(axes):
        strip = torch.as_tensor(ax.images[0].get_array().filled(float("nan")))
        assert strip.shape == (3, 4 * 6 - 1)
        for t in range(4):
            torch.testing.assert_close(strip[:, 6 * t : 6 * t + 5].float(), kernel[h, t])
        assert strip[:, 5::6].isnan().all()
    assert viz.figure_to_array(fig).std() > 0


def test_position_kernel_rejects_a_query_outside_the_grid():
    s = build("rel2d_full")
    with pytest.raises(ValueError, match="outside"):
        viz.position_kernel(s, (4, 5), (4, 0))
    with pytest.raises(ValueError, match="outside"):
        viz.position_kernel(s, (4, 5), 20)
    with pytest.raises(ValueError, match=r"query \(1, 1, 1\) is outside the 4x5 grid"):
        viz.position_kernel(s, (4, 5), (1, 1, 1))
    v = build("rel3d_factored", grid=(2, 3, 4))
    with pytest.raises(ValueError, match=r"query \(2, 0, 0\) is outside the 2x3x4 grid"):
        viz.position_kernel(v, query=(2, 0, 0))


def test_position_kernel_rel2d_full_reads_the_table_around_the_centre():
    s = vitrel.build_pos("rel2d_full", num_heads=2, head_dim=8, grid=(5, 7))
    k = viz.position_kernel(s, (5, 7))
    cy, cx = 2, 3
    for h in range(2):
        for r in range(5):
            for c in range(7):
                assert k[h, r, c] == pytest.approx(float(s.table.detach()[cy - r + 4, cx - c + 6, h]), abs=1e-6)


def test_position_kernel_rope1d_is_the_sum_of_cosines():
    d, base = 8, 100.0
    s = vitrel.build_pos("rope1d", num_heads=1, head_dim=d, grid=(3, 4), base=base)
    k = viz.position_kernel(s, (3, 4))
    c = 1 * 4 + 2
    for p in range(12):
        want = sum(math.cos((p - c) * base ** (-2 * t / d)) - 1 for t in range(d // 2)) / math.sqrt(d)
        assert k[0, p // 4, p % 4] == pytest.approx(want, abs=1e-5)


def test_position_matrix_rope2d_axial_is_the_sum_of_cosines():
    d, base, g = 8, 100.0, Grid(3, 4)
    s = build("rope2d_axial", grid=g, heads=2, head_dim=d, base=base)
    m = viz.position_matrix(s, g)
    omega = [base ** (-4 * t / d) for t in range(d // 4)]

    def angles(r, c):  # pairs t < d/4: row, pairs d/4 + t: column
        return [r * w for w in omega] + [c * w for w in omega]

    for i in range(g.n):
        for j in range(g.n):
            ai, aj = angles(i // 4, i % 4), angles(j // 4, j % 4)
            want = sum(math.cos(x - y) - 1 for x, y in zip(ai, aj)) / math.sqrt(d)
            assert m[0, i, j] == pytest.approx(want, abs=1e-5)
            assert m[1, i, j] == pytest.approx(want, abs=1e-5)


def test_position_matrix_shaw2d_full_is_the_key_term():
    g = Grid(3, 3)
    s = build("shaw2d_full", grid=g, heads=2, head_dim=4, clip_distance=1)
    with torch.no_grad():
        s.rel_k.normal_()
    m = viz.position_matrix(s, g)
    table = s.rel_k.detach().double()
    u = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    for i in range(g.n):
        for j in range(g.n):
            dh = max(-1, min(1, i // 3 - j // 3))
            dw = max(-1, min(1, i % 3 - j % 3))
            want = float(u @ table[dh + 1, dw + 1]) / 2.0  # / sqrt(d)
            assert m[0, i, j] == pytest.approx(want, abs=1e-5)


def test_position_matrix_sincos2d_is_the_cosine_similarity_of_the_embeddings():
    g = Grid(3, 4)
    s = build("sincos2d", grid=g, heads=2, head_dim=8)
    m = viz.position_matrix(s, g)
    assert m.shape == (1, 12, 12)
    q, temp = 4, 10000.0
    omega = [temp ** (-t / q) for t in range(q)]

    def e(r, c):
        return torch.tensor(
            [math.sin(r * w) for w in omega]
            + [math.cos(r * w) for w in omega]
            + [math.sin(c * w) for w in omega]
            + [math.cos(c * w) for w in omega],
            dtype=torch.float64,
        )

    for i in range(12):
        for j in range(12):
            a, b = e(i // 4, i % 4), e(j // 4, j % 4)
            assert m[0, i, j] == pytest.approx(float(a @ b / (a.norm() * b.norm())), abs=1e-5)


@pytest.mark.parametrize("name", ["pape", "pape_ri"])
def test_position_matrix_of_pape_is_its_term_for_a_zero_input_token(name):
    # PaPE's term comes from augment(x, q, k), which position_matrix did not call: every picture of it was blank
    h, w, heads, d = 3, 4, 2, 8
    s = build(name, grid=(h, w), heads=heads, head_dim=d).double()
    with torch.no_grad():
        for p in s.parameters():
            p.normal_(0.0, 0.5)
    want = torch.zeros(heads, h * w, h * w, dtype=torch.float64)
    curv = math.log(2.0)  # softplus(A 0)
    for i in range(h * w):
        for j in range(h * w):
            dp = torch.tensor([i % w - j % w, i // w - j // w], dtype=torch.float64)  # (x, y) = (col, row) offsets
            if name == "pape":  # sum_p -a (u_ip - u_jp)^2 + b (u_ip - u_jp), b = B 0 = 0
                du = s.position.weight.view(heads, s.parabolas, 2) @ dp
                want[:, i, j] = -curv * (du**2).sum(-1)
            else:  # -a s_h^2 |p_i - p_j|^2
                want[:, i, j] = -curv * s.position_scales.view(heads) ** 2 * (dp**2).sum()
    torch.testing.assert_close(viz.position_matrix(s).double(), want / math.sqrt(d), rtol=1e-5, atol=1e-5)


def test_none_has_no_position_term():
    s = build("none")
    assert viz.position_matrix(s, (4, 5)).abs().max() == 0


def test_offset_profile_folds_pairs_by_offset():
    g = Grid(3, 4)
    s = build("rel2d_full", grid=g)
    with torch.no_grad():
        s.table.normal_()
    torch.testing.assert_close(viz.offset_profile(viz.position_matrix(s, g), g), s.table.detach().permute(2, 0, 1))
    # any matrix: the mean over the pairs of each offset
    x = torch.randn(2, 12, 12, dtype=torch.float64)
    p = viz.offset_profile(x, g)
    for dh in range(-2, 3):
        for dw in range(-3, 4):
            vals = [x[:, i, j] for i in range(12) for j in range(12) if (i // 4 - j // 4, i % 4 - j % 4) == (dh, dw)]
            torch.testing.assert_close(p[:, dh + 2, dw + 3], torch.stack(vals).mean(0))
    with pytest.raises(ValueError):
        viz.offset_profile(x, Grid(2, 2))


def test_rope_similarity_of_rope2d_mixed_uses_its_learned_frequencies():
    d, g = 8, Grid(3, 3)
    s = build("rope2d_mixed", grid=g, heads=2, head_dim=d)
    sim = viz.rope_similarity(s, (4, 5))
    assert sim.shape == (2, 7, 9)
    f = s.freqs.detach().double()
    for h in range(2):
        for dh in range(-3, 4):
            for dw in range(-4, 5):
                want = sum(math.cos(float(f[0, h, t]) * dw + float(f[1, h, t]) * dh) for t in range(d // 2)) / (d / 2)
                assert sim[h, dh + 3, dw + 4] == pytest.approx(want, abs=1e-5)
    assert torch.allclose(sim[:, 3, 4], torch.ones(2))
    with pytest.raises(ValueError, match="rotary"):
        viz.rope_similarity(build("rel2d_full"))


def test_rope_similarity_under_yarn_at_a_larger_grid_is_still_a_cosine():
    """YaRN's attention factor ``m`` scales cos and sin at a grid larger than the built one: the similarity came out
    ``m^2`` times the cosine (1.49 at offset 0, half the picture clipped at 1; an audit's). It is the cosine of the
    rotations' angles, from the equation: ``(2/d) sum_t cos(omega'_t dh)`` on the rows' pairs and the columns' (the
    YaRN-scaled frequencies); and the frequency row of a learned scheme shows the frequencies in effect there."""
    d, built, big = 16, Grid(4, 4), Grid(12, 12)
    s = build("rope2d_axial", grid=built, heads=1, head_dim=d, scaling={"rope_type": "yarn", "factor": "auto"})
    sim = viz.rope_similarity(s, big)
    assert float(sim.abs().max()) <= 1 + 1e-6 and float(sim[0, 11, 11]) == pytest.approx(1.0, abs=1e-6)
    w_r = s.axis_omega(0, d // 2, big, torch.float64)
    w_c = s.axis_omega(1, d // 2, big, torch.float64)
    for dh, dw in ((0, 3), (5, -2), (-7, 11)):
        want = (torch.cos(w_r * dh).sum() + torch.cos(w_c * dw).sum()) / (d / 2)
        assert float(sim[0, dh + 11, dw + 11]) == pytest.approx(float(want), abs=1e-5)
    mixed = build("rope2d_mixed", grid=built, heads=2, head_dim=d, scaling={"rope_type": "linear", "factor": "auto"})
    fig = viz.plot_pos_scheme(mixed, big)
    dots = panels(fig)[2].collections[0].get_offsets()  # (row 2, head 0: (f_x, f_y) per pair)
    want = mixed.scaled_freqs(mixed.freqs, big).detach()[:, 0].T.numpy()
    np.testing.assert_allclose(np.asarray(dots), want, rtol=1e-6)


@pytest.mark.parametrize("block_size", [2, 4, "head"])
def test_rope_similarity_of_liere_is_the_trace_of_its_rotations(block_size):
    # tr(R_i^T R_j) / d from the generators in float64 (dense d x d matrix exponentials), folded by offset with
    # loops; a single probe (every pair (1, 0), as before) was off by up to 0.54 with 4 x 4 blocks
    d, g = 8, Grid(3, 4)
    s = build("liere", grid=g, heads=2, head_dim=d, block_size=block_size, coords="index")
    a = s.generators().detach().double()  # [heads, axes, d/b, b, b]
    dense = torch.zeros(2, 2, d, d, dtype=torch.float64)
    for m in range(a.shape[2]):
        b = a.shape[-1]
        dense[:, :, m * b : (m + 1) * b, m * b : (m + 1) * b] = a[:, :, m]
    pos = [(r, c) for r in range(g.h) for c in range(g.w)]
    rot = [torch.linalg.matrix_exp(r * dense[:, 0] + c * dense[:, 1]) for r, c in pos]  # [heads, d, d] per patch
    sim = viz.rope_similarity(s)
    for h in range(2):
        for dh in range(-g.h + 1, g.h):
            for dw in range(-g.w + 1, g.w):
                vals = [
                    float(torch.trace(rot[i][h].T @ rot[j][h])) / d
                    for i in range(g.n)
                    for j in range(g.n)
                    if (pos[i][0] - pos[j][0], pos[i][1] - pos[j][1]) == (dh, dw)
                ]
                assert sim[h, dh + g.h - 1, dw + g.w - 1] == pytest.approx(sum(vals) / len(vals), abs=1e-5)


@pytest.mark.parametrize("name", ["rope2d_axial", "rope2d_mixed", "spiral_rope"])
def test_pictures_of_a_scheme_in_training_mode_show_its_evaluation_positions(name):
    # build_pos and load_model return schemes in training mode, where DINOv3's coordinate augmentation moves the
    # patches at random: the pictures must show the positions the model is evaluated at, draw no random numbers
    # (the training callback draws them mid-run) and leave the mode as it was
    s = build(name, heads=2, head_dim=16, coords="normalized", shift=0.5, jitter=2.0, rescale=2.0)
    s.eval()
    want_m, want_s = viz.position_matrix(s), viz.rope_similarity(s)
    s.train()
    rng = torch.get_rng_state()
    torch.testing.assert_close(viz.position_matrix(s), want_m, rtol=0, atol=0)
    torch.testing.assert_close(viz.rope_similarity(s), want_s, rtol=0, atol=0)
    assert torch.equal(torch.get_rng_state(), rng)
    assert s.training


def test_group_by_declared_family():
    want = {
        "none": "none",
        "ape": "absolute",
        "sincos2d": "absolute",
        "rel2d_full": "learned bias",
        "rel2d_cpb": "learned bias",
        "alibi2d": "fixed bias",
        "rope1d": "rotary",
        "rope2d_mixed": "rotary",
        "shaw1d": "content",
        "shaw2d_factored": "content",
    }
    for name, fam in want.items():
        assert build(name, head_dim=8).family == fam, name
    groups = viz.group_by_family({n: build(n, head_dim=8) for n in list_pos()})
    assert list(groups) == [f for f in FAMILIES if f in groups]
    assert sorted(n for g in groups.values() for n in g) == list_pos()


def test_content_tables():
    assert set(viz.content_tables(build("shaw2d_factored"))) == {"rel_kh", "rel_kw", "rel_vh", "rel_vw"}
    with pytest.raises(ValueError, match="content"):
        viz.content_tables(build("rel2d_full"))


def _tiny_vit(pos="rel2d_full", **kw):
    torch.manual_seed(0)
    return vitrel.create_model(
        "vitrel_vit_tiny_patch4_32",
        pos=pos,
        img_size=16,
        in_chans=1,
        num_classes=3,
        embed_dim=16,
        depth=2,
        num_heads=2,
        **kw,
    )


def test_attention_maps_vit_is_the_class_token_row_of_the_block():
    model = _tiny_vit()
    x = torch.randn(3, 1, 16, 16)
    seen = {}

    def grab(module, args):
        seen["x"] = args[0]

    h = model.blocks[1].attn.register_forward_pre_hook(grab)
    model.eval()
    with torch.no_grad():
        model(x)
    h.remove()
    maps = viz.attention_maps(model, x, block=1)
    assert maps.shape == (3, 2, 4, 4)
    with torch.no_grad():
        want = model.blocks[1].attn.attention_map(seen["x"], (4, 4))[:, :, 0, 1:].reshape(3, 2, 4, 4)
    torch.testing.assert_close(maps, want)
    # without a class token: the attention each patch receives, averaged over the queries
    maps = viz.attention_maps(_tiny_vit(class_token=False, global_pool="avg"), x, block=0)
    torch.testing.assert_close(maps.sum((-2, -1)), torch.ones(3, 2))
    with pytest.raises(ValueError, match="block"):
        viz.attention_maps(model, x, block=5)
    with pytest.raises(TypeError):
        viz.attention_maps(torch.nn.Linear(2, 2), x)


def test_attention_maps_swin_mean_attention_received():
    torch.manual_seed(0)
    model = vitrel.create_model(
        "vitrel_swin_tiny_patch2_window4_32",
        pos="rel2d_full",
        img_size=16,
        in_chans=1,
        num_classes=3,
        embed_dim=8,
        depths=[2, 1],
        num_heads=[2, 2],
        window_size=4,
    )
    x = torch.randn(2, 1, 16, 16)
    maps = viz.attention_maps(model, x, stage=0, block=1)  # the shifted block of stage 0, 8x8 grid
    assert maps.shape == (2, 2, 8, 8)
    torch.testing.assert_close(maps.sum((-2, -1)), torch.ones(2, 2))
    assert viz.attention_maps(model, x, stage=1, block=0).shape == (2, 2, 4, 4)


# ------------------------------------------------------------------------------------------ figures
def test_plot_schemes_axes_and_heat_maps_are_the_bias_rows():
    g = Grid(4, 5)
    schemes = {"rel2d_full": build("rel2d_full"), "alibi2d": build("alibi2d"), "ape": build("ape", head_dim=8)}
    fig = viz.plot_schemes(schemes, grid=g, query=(1, 3), max_heads=3)
    axes = panels(fig)
    assert len(axes) == 3 * 4
    bias = schemes["rel2d_full"].bias(g, 0).detach()
    torch.testing.assert_close(torch.as_tensor(axes[0].images[0].get_array()), bias[0].float())
    for h in range(3):
        img = torch.as_tensor(axes[1 + h].images[0].get_array())
        torch.testing.assert_close(img, bias[h, 1 * 5 + 3].reshape(4, 5).float())
    assert len(axes[4 + 3].images) == 1  # alibi head 2
    assert len(axes[8 + 2].images) == 0  # ape has one panel: the others are off
    assert viz.figure_to_array(fig).std() > 0


def test_plot_pos_scheme_query():
    s = build("rel2d_factored")
    fig = viz.plot_pos_scheme(s, query=(0, 4))
    axes = panels(fig)
    assert len(axes) == 3
    img = torch.as_tensor(axes[2].images[0].get_array())
    torch.testing.assert_close(img, s.bias(Grid(4, 5), 0).detach()[2, 4].reshape(4, 5).float())


@pytest.mark.parametrize("plot", ["plot_pos_scheme", "plot_schemes"])
def test_keys_a_head_cannot_see_are_drawn_apart_from_the_finite_scale(plot):
    # LookHere's -inf (outside a head's view) made the colour scale infinite: every key in view drew at the bottom of
    # the scale and the keys out of view drew blank, the colour of a zero term
    import matplotlib.colors

    s = build("lookhere", grid=(7, 7), heads=4, head_dim=8)
    m = viz.position_matrix(s)
    finite = m[torch.isfinite(m)]
    assert (m == float("-inf")).any() and finite.min() < finite.max()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "invalid value encountered" on an infinite scale
        fig = getattr(viz, plot)({"lookhere": s}) if plot == "plot_schemes" else viz.plot_pos_scheme(s)
        viz.figure_to_array(fig)
    images = [im for ax in panels(fig) for im in ax.images]
    shown = np.concatenate([np.ma.getdata(im.get_array()).ravel() for im in images])
    for im in images:  # one scale for the figure: the largest finite term drawn
        assert math.isfinite(im.norm.vmin) and math.isfinite(im.norm.vmax)
        assert im.norm.vmax == pytest.approx(float(np.abs(shown[np.isfinite(shown)]).max()))
        bad = matplotlib.colors.to_rgba(im.cmap.get_bad())
        assert bad[3] == 1.0 and bad[:3] != (1.0, 1.0, 1.0)  # opaque, not white (a zero on RdBu)


@pytest.mark.parametrize("pos", ["rel2d_factored", "rope2d_mixed", "sincos2d", "shaw2d_factored", "alibi2d"])
def test_plot_pos_scheme_returns_a_figure(pos):
    from matplotlib.figure import Figure

    s = vitrel.build_pos(pos, num_heads=2, head_dim=8, grid=(4, 6))
    fig = viz.plot_pos_scheme(s)
    assert isinstance(fig, Figure)
    img = viz.figure_to_array(fig)
    assert img.ndim == 3 and img.shape[2] == 3 and img.std() > 0
    rows = 2 if pos == "rope2d_mixed" else 1
    assert len(fig.axes) >= rows * (1 if s.kind == "absolute" else 2)


def test_plot_rope_similarity_and_content_tables():
    fig = viz.plot_rope_similarity({"a": build("rope2d_axial", head_dim=8), "m": build("rope2d_mixed", head_dim=8)})
    assert len(panels(fig)) == 2 * 4  # 3 heads drawn, the 4th panel of each row switched off
    assert len(panels(viz.plot_content_tables(build("shaw2d_factored")))) == 4
    assert len(panels(viz.plot_content_tables(build("shaw2d_full")))) == 2
    assert len(panels(viz.plot_content_tables(build("shaw1d")))) == 2


def test_plot_attention_maps_axes():
    x = torch.randn(3, 1, 16, 16)
    maps = torch.rand(3, 5, 4, 4)
    assert len(panels(viz.plot_attention_maps(x, maps, labels=["a", "b", "c"], max_heads=2))) == 3 * 4
    with pytest.raises(ValueError):
        viz.plot_attention_maps(x, maps[:2])
    # a 30 px image in patches of 4 (dynamic_img_pad): an 8 x 8 grid covering 32 px, each cell 4 px wide, not the
    # 3.75 px of the grid stretched over the image (an audit's: the last cells 1.75 px off)
    fig = viz.plot_attention_maps(torch.randn(1, 1, 30, 30), torch.rand(1, 2, 8, 8))
    overlay = panels(fig)[1].get_images()[1]
    assert overlay.get_extent() == [-0.5, 31.5, 31.5, -0.5] and panels(fig)[1].get_xlim() == (-0.5, 29.5)


def test_plot_packed_batch_draws_rows_images_and_the_block_diagonal_mask():
    from tests.layout.test_tokens import images, packed
    from vitrel.pos.registry import build_pos
    from vitrel.viz import plot_packed_batch

    d = packed(images(torch.float32))
    fig = plot_packed_batch(d, patch_size=4)
    assert len(fig.axes) == 3
    mask = fig.axes[2].images[0].get_array()
    assert mask.shape == (35, 35) and mask[0, 0] == 1 and mask[0, 13] == 0  # image 0 does not see image 1
    scheme = build_pos("rel2d_full", num_heads=2, head_dim=8, grid=(4, 4), num_prefix_tokens=1)
    assert len(plot_packed_batch(d, scheme).axes) == 2


def test_position_kernel_of_gpsa_is_the_weights_it_mixes_in():
    """GPSA adds no logit term; its picture is the attention it gives the query by position, ``sigmoid(g_h) P_h``,
    ``P_h`` the softmax over the keys of ``w_h . (dc, dr, dr^2 + dc^2)`` (key minus query), from the equation."""
    s = build("gpsa", heads=4).double()
    with torch.no_grad():
        s.pos_proj.normal_()
        s.gating.normal_()
    for query in [None, (0, 4)]:
        k = viz.position_kernel(s, Grid(4, 5), query)
        qr, qc = (2, 2) if query is None else query
        w = s.pos_proj.detach()
        for h in range(4):
            logits = torch.zeros(4, 5, dtype=torch.float64)
            for r in range(4):
                for c in range(5):
                    logits[r, c] = w[h, 0] * (c - qc) + w[h, 1] * (r - qr) + w[h, 2] * ((r - qr) ** 2 + (c - qc) ** 2)
            p = logits.flatten().softmax(0).reshape(4, 5) * torch.sigmoid(s.gating[h].detach())
            torch.testing.assert_close(k[h], p.float(), rtol=1e-5, atol=1e-7)
    fig = viz.plot_pos_scheme(s)
    assert [a.get_title() for a in panels(fig)] == [f"head {h}: {k[h].sum():.2f}" for h in range(4)]
    with pytest.raises(ValueError, match="position_kernel"):
        viz.position_matrix(s)


def test_the_training_pictures_draw_every_scheme_they_take():
    """``train.py``'s position pictures (``PosImageLogger``) ended a run with ``pos=gpsa`` or ``cpe`` at training's end
    (their schemes refused the picture): every registered scheme it takes now draws, and ``cpe`` is not taken."""
    from vitrel.pos.registry import get_pos_class
    from vitrel.train.callbacks import position_schemes

    schemes = torch.nn.ModuleDict()
    for name in list_pos():
        grid = (3, 4) if get_pos_class(name).grid_dims != 3 else (2, 3, 4)
        schemes[name] = vitrel.build_pos(name, num_heads=2, head_dim=8, grid=grid, embed_dim=16)
    taken = dict(position_schemes(schemes))
    assert set(taken) == set(list_pos()) - {"none", "cpe"}
    for name, s in taken.items():
        assert viz.figure_to_array(viz.plot_pos_scheme(s, title=name)).std() > 0, name
