"""``attention_distance.csv`` / ``.png`` of a train.py run (:class:`vitrel.train.attention_distance.AttentionDistance`)
and of a sweep (the summary's picture): the numbers of ``vitrel.viz.attention_distance`` on the weights the test
scored and the test's first images (a ViT, a Swin, a video ViT)."""

from types import SimpleNamespace

import hydra
import pytest
import torch

import vitrel
from tests.train_helpers import FAST, TINY_SWIN, TINY_VIDEO, TINY_VIT, compose
from vitrel.train.attention_distance import CSV, PNG, read_distances, sweep_distances, write_distances
from vitrel.viz import attention_distance

DRAWN = [o for o in FAST if not o.startswith("callbacks.attention_distance")]
SHORT = ["trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "logger=none"]


def _first_test_inputs(cfg, n, model):
    """The first ``n`` test images (or clips) of the run's data, across batches (NaFlex dicts: their images)."""
    dm = hydra.utils.instantiate(cfg.data)
    dm.setup("test")
    batches, have = iter(dm.test_dataloader()), []
    while len(have) < n:
        x = next(batches)[0]
        have.extend(model.read_input(x).batch.images(4) if isinstance(x, dict) else x)
    return torch.stack(have[:n])


@pytest.mark.parametrize(
    ("over", "images"),
    [
        ([*TINY_VIT, "trainer.limit_test_batches=2"], 20),  # two test batches of 16: the first 20 images
        ([*TINY_SWIN, "trainer.limit_test_batches=1"], 4),  # two stages of one block (2 heads each): across stages
        ([*TINY_VIT, "data=fashion_mnist_naflex", "data.batch_size=8", "trainer.limit_test_batches=2"], 10),
        ([*TINY_VIT, "module/ema=default", "trainer.limit_test_batches=1"], 4),  # the EMA copy (it was left out)
    ],
    ids=["vit", "swin", "naflex", "ema"],
)
def test_a_run_writes_the_distances_of_the_weights_it_tested_on_the_first_test_images(tmp_path, over, images):
    from vitrel.train.run import train

    cfg = compose(tmp_path, [*over, *DRAWN, *SHORT, f"callbacks.attention_distance.images={images}"])
    train(cfg)
    got = read_distances(tmp_path / CSV)
    assert got.shape == (2, 2) and (tmp_path / PNG).stat().st_size > 0
    model = vitrel.load_model(tmp_path / "checkpoints" / "last.ckpt")
    want = attention_distance(model, _first_test_inputs(cfg, images, model))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_a_video_run_writes_pixels_and_frames(tmp_path, caplog):
    """A video run's ``attention_distance.csv``: pixels and frames; its per-class report's line counts videos (it
    said images)."""
    from vitrel.train.run import train

    keep = [o for o in TINY_VIDEO if not o.startswith("callbacks.attention_distance")]
    over = [*keep, "pos=none", *SHORT, "trainer.limit_test_batches=1", "callbacks.attention_distance.images=4"]
    cfg = compose(tmp_path, over)
    with caplog.at_level("INFO", logger="vitrel.train.per_class"):
        train(cfg)
    assert "per_class.csv (8 videos)" in caplog.text
    assert (tmp_path / PNG).stat().st_size > 0
    px, frames = read_distances(tmp_path / CSV), read_distances(tmp_path / CSV, "distance_frames")
    model = vitrel.load_model(tmp_path / "checkpoints" / "last.ckpt")
    want = attention_distance(model, _first_test_inputs(cfg, 4, model), frames=True)
    torch.testing.assert_close((px, frames), want, rtol=1e-6, atol=1e-6)
    assert (frames > 0).all()  # (8 frames, a tubelet each)


def test_naflex_images_with_dropped_patches_are_left_out_in_one_line(caplog):
    from tests.test_viz_distance import _packed
    from vitrel.train.attention_distance import AttentionDistance

    caplog.set_level("INFO", logger="vitrel.train.attention_distance")
    batch = _packed([torch.randn(3, 8, 8)], [[0]])
    batch["patch_valid"][0, 3:] = False  # 3 of its 4 patches
    model = SimpleNamespace(scored_network=vitrel.create_model("vitrel_vit_tiny_patch4_32", depth=1))
    cb, trainer = AttentionDistance("unused"), SimpleNamespace(global_rank=0)
    cb.on_test_start(trainer, model)
    cb.on_test_batch_end(trainer, model, None, (batch, torch.zeros(1)), 0)
    cb.on_test_end(trainer, model)
    assert "attention distance: left out (image 0 of the NaFlex batch has 3 of the 4 patches" in caplog.text


def test_several_clips_per_video_count_each_clip(tmp_path):
    """``data.clips_per_video=K`` tests batches ``[B, K, C, T, H, W]``: each of the K clips is a clip."""
    from vitrel.train.attention_distance import AttentionDistance

    torch.manual_seed(0)
    net = vitrel.create_model("vitrel_vit_video_tiny_patch4_32", depth=1, img_size=16, num_frames=4, in_chans=1)
    model, trainer = SimpleNamespace(scored_network=net), SimpleNamespace(global_rank=0)
    clips = torch.randn(2, 3, 1, 4, 16, 16)
    cb = AttentionDistance(tmp_path, images=5)
    cb.on_test_start(trainer, model)
    cb.on_test_batch_end(trainer, model, None, (clips, torch.zeros(2)), 0)
    cb.on_test_end(trainer, model)
    want = attention_distance(net, clips.flatten(0, 1)[:5], frames=True)
    torch.testing.assert_close((read_distances(tmp_path / CSV), read_distances(tmp_path / CSV, "distance_frames")),
                               want, rtol=1e-6, atol=1e-6)  # fmt: skip


def test_the_csv_of_a_swin_keeps_only_its_heads(tmp_path):
    """NaN (a block's missing heads) gets no row, and reads back as NaN; plot and sweep take the NaN-padded tensor."""
    from vitrel.viz import plot_attention_distance

    d = torch.tensor([[1.0, float("nan")], [2.0, 3.0]], dtype=torch.float64)
    write_distances(tmp_path / CSV, d, frames=d / 2)
    assert (tmp_path / CSV).read_text().splitlines() == [
        "block,head,distance_px,distance_frames", "0,0,1.0,0.5", "1,0,2.0,1.0", "1,1,3.0,1.5",
    ]  # fmt: skip
    torch.testing.assert_close(read_distances(tmp_path / CSV), d, equal_nan=True)
    torch.testing.assert_close(read_distances(tmp_path / CSV, "distance_frames"), d / 2, equal_nan=True)
    ax = plot_attention_distance({"a": d, "b": d + 1}).axes[0]
    assert sum(len(c.get_offsets()) for c in ax.collections) == 8  # (the two NaN not drawn: masked)


def test_csv_round_trip_and_the_sweep_groups_seeds_by_setting(tmp_path):
    from tests.train.test_sweep_summary import _job
    from vitrel.train.hydra_callbacks import SweepSummary
    from vitrel.train.sweep_table import distance_groups, summary_rows

    d = torch.rand(3, 2, dtype=torch.float64) * 10
    for job, (over, dist) in enumerate([("pos=none seed=0", d), ("pos=none seed=1", d + 1), ("pos=ape seed=0", d[:2])]):
        _job(tmp_path, job, over.split(), {"test/acc1": 0.5})
        write_distances(tmp_path / str(job) / CSV, dist)
    _job(tmp_path, 3, ["pos=rope", "seed=0"])  # failed: no metrics.json (its CSV, if any, not drawn)
    write_distances(tmp_path / "3" / CSV, d)
    torch.testing.assert_close(read_distances(tmp_path / "0" / CSV), d, rtol=0, atol=0)
    rows, means, *_ = summary_rows(tmp_path, SweepSummary().metrics)
    runs = sweep_distances(tmp_path, distance_groups(rows, means))
    assert list(runs) == ["pos=none", "pos=ape"]
    torch.testing.assert_close(runs["pos=none"], torch.cat([d, d + 1], dim=1))
    assert runs["pos=ape"].equal(d[:2])  # (a shallower model: plot_attention_distance draws its blocks)


def test_the_sweep_summary_draws_the_jobs_distances_and_removes_a_stale_picture(tmp_path):
    from tests.train.test_sweep_summary import _job, _summarize

    sweep = tmp_path / "sweep"
    for job, pos in enumerate(("none", "alibi2d")):
        _job(sweep, job, [f"pos={pos}", "seed=0"], {"test/acc1": 0.5})
        write_distances(sweep / str(job) / CSV, torch.rand(2, 2))
    _summarize(sweep)
    assert (sweep / PNG).stat().st_size > 0
    for job in range(2):
        (sweep / str(job) / CSV).unlink()
    _summarize(sweep)
    assert not (sweep / PNG).exists(), "no earlier picture left to be taken for this sweep's"


def test_a_bf16_true_run_with_ema_writes_its_distances_and_its_summary(tmp_path):
    """Under ``trainer.precision=bf16-true`` the kept test images are bf16, the scored EMA copy float32: the run
    raised a dtype error after its test, with no ``metrics.json``. The images are cast to the scored weights'."""
    from vitrel.train.run import train

    over = [*TINY_VIT, "module/ema=default", "trainer.precision=bf16-true", "trainer.limit_test_batches=1"]
    train(compose(tmp_path, [*over, *DRAWN, *SHORT, "callbacks.attention_distance.images=4"]))
    assert read_distances(tmp_path / CSV).isfinite().all() and (tmp_path / "metrics.json").is_file()
