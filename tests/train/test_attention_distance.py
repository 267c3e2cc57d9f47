"""``attention_distance.csv`` / ``.png`` of a train.py run (:class:`vitrel.train.attention_distance.AttentionDistance`)
and of a sweep (the summary's picture): the numbers of ``vitrel.viz.attention_distance`` on the weights the test
scored and the test's first images."""

import hydra
import torch

import vitrel
from tests.train_helpers import FAST, TINY_SWIN, TINY_VIT, compose
from vitrel.train.attention_distance import CSV, PNG, read_distances, sweep_distances, write_distances
from vitrel.viz import attention_distance

DRAWN = [o for o in FAST if not o.startswith("callbacks.attention_distance")]
SHORT = ["trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "logger=none"]


def test_a_run_writes_the_distances_of_the_weights_it_tested_on_the_first_test_images(tmp_path):
    from vitrel.train.run import train

    over = [*TINY_VIT, *DRAWN, *SHORT, "trainer.limit_test_batches=2", "callbacks.attention_distance.images=20"]
    cfg = compose(tmp_path, over)
    train(cfg)
    got = read_distances(tmp_path / CSV)
    assert got.shape == (2, 2) and (tmp_path / PNG).stat().st_size > 0
    dm = hydra.utils.instantiate(cfg.data)
    dm.setup("test")
    batches = iter(dm.test_dataloader())
    images = torch.cat([next(batches)[0], next(batches)[0]])[:20]  # two batches of 16: the first 20 images
    model = vitrel.load_model(tmp_path / "checkpoints" / "last.ckpt")
    torch.testing.assert_close(got, attention_distance(model, images), rtol=1e-6, atol=1e-6)


def test_a_swin_run_leaves_it_out_in_one_line(tmp_path, caplog):
    from vitrel.train.run import train

    caplog.set_level("INFO", logger="vitrel.train.attention_distance")
    train(compose(tmp_path, [*TINY_SWIN, *DRAWN, *SHORT, "trainer.limit_test_batches=1"]))
    assert not (tmp_path / CSV).exists()
    assert "attention distance: left out (SwinTransformer is not a global ViT" in caplog.text


def test_csv_round_trip_and_the_sweep_groups_seeds_by_setting(tmp_path):
    from tests.train.test_sweep_summary import _job
    from vitrel.train.hydra_callbacks import SweepSummary, distance_groups, summary_rows

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
