"""What the loggers write for a run that Lightning runs without loggers (``trainer.fast_dev_run``), and what the closing
line says of the W&B run: none when W&B is disabled, every offline part of a resumed run in the upload command."""

from __future__ import annotations

import time

import pytest

from tests.train_helpers import FAST, TINY_VIT, compose
from vitrel.train.loggers import offline_parts
from vitrel.train.run import train

SHORT = ["trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1"]
SHORT += ["trainer.limit_test_batches=1"]


def test_fast_dev_run_opens_no_logger_run(tmp_path, capsys, monkeypatch):
    """Lightning's ``fast_dev_run`` replaces the loggers with a dummy: no W&B run (offline files, or a run on the
    server online), no TensorBoard event file, no CSV ``hparams.yaml``; the closing lines name no W&B run."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    over = [*TINY_VIT, *FAST, "trainer.fast_dev_run=true", "logger=[wandb,csv,tensorboard]"]
    train(compose(tmp_path, over))
    out = capsys.readouterr().out
    assert "test accuracy" in out and (tmp_path / "metrics.json").exists()
    assert not list(tmp_path.glob("wandb/*run-*")), sorted(p.name for p in (tmp_path / "wandb").iterdir())
    assert not (tmp_path / "csv" / "hparams.yaml").exists() and not list(tmp_path.glob("tensorboard/events.*"))
    assert "W&B run" not in out


def test_disabled_wandb_names_no_run_folder(tmp_path, capsys, monkeypatch):
    """``WANDB_MODE=disabled``: W&B writes nothing, so the closing lines name no W&B run (not a folder that does not
    exist)."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    train(compose(tmp_path, [*TINY_VIT, *FAST, *SHORT, "logger=wandb"]))
    out = capsys.readouterr().out
    assert "test accuracy" in out and "W&B run" not in out, out[-600:]


def test_resumed_offline_run_uploads_every_part(tmp_path, capsys, monkeypatch):
    """An offline run resumed in its folder is one W&B run (one id) in two offline folders: the closing line's upload
    command names both, in the order they ran (``wandb sync`` syncs the parts of one run in that order)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    over = [*TINY_VIT, *FAST, *SHORT, "logger=wandb"]
    train(compose(tmp_path, over))
    capsys.readouterr()
    train(compose(tmp_path, [*over, "trainer.max_epochs=2"]))
    last = capsys.readouterr().out.strip().splitlines()[-1]
    parts = offline_parts(tmp_path / "wandb", (tmp_path / "wandb_run_id").read_text())
    assert len(parts) == 2 and sorted((tmp_path / "wandb").glob("offline-run-*")) == sorted(parts), parts
    assert last == f"W&B run     {parts[1]} (offline, 2 parts; upload with: wandb sync {parts[0]} {parts[1]})"


def test_run_started_over_in_its_folder_is_a_new_wandb_run(tmp_path, monkeypatch):
    """``resume=false`` in a folder with a checkpoint starts over, and so does a run whose folder has no checkpoint yet
    (an attempt that failed before its first): a new W&B run, not more history in the earlier run's (whose steps would
    show twice), as ``metrics.csv`` starts over. A resume keeps the folder's W&B run."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    over = [*TINY_VIT, *FAST, *SHORT, "logger=[wandb,csv]"]
    ids = []
    for extra in ([], ["resume=false"], ["trainer.max_epochs=2"]):
        train(compose(tmp_path, [*over, *extra]))
        ids.append((tmp_path / "wandb_run_id").read_text())
        assert (tmp_path / "wandb" / "latest-run").resolve() in offline_parts(tmp_path / "wandb", ids[-1])
    assert ids[0] != ids[1] and ids[2] == ids[1], ids  # started over: a new run; resumed: the same


def test_run_started_over_in_its_folder_hides_the_earlier_tensorboard_events(tmp_path):
    """``resume=false`` over a finished run: TensorBoard shows the new run's scalars only, each step once (the
    earlier run's event files stay in the folder, hidden by the new file's ``purge_step=0``), as ``metrics.csv``
    starts over."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    over = [*TINY_VIT, *FAST, *SHORT, "logger=[csv,tensorboard]", "trainer.log_every_n_steps=1"]
    train(compose(tmp_path, over))
    train(compose(tmp_path, [*over, "resume=false", "seed=1"]))
    ea = EventAccumulator(str(tmp_path / "tensorboard"))
    ea.Reload()
    csv_rows = (tmp_path / "csv" / "metrics.csv").read_text().splitlines()
    header = csv_rows[0].split(",")
    col, step = header.index("train/loss_step"), header.index("step")
    want = [(int(r.split(",")[step]), float(r.split(",")[col])) for r in csv_rows[1:] if r.split(",")[col]]
    got = [(e.step, e.value) for e in ea.Scalars("train/loss_step")]
    assert [s for s, _ in got] == [0, 1] and [s for s, _ in want] == [0, 1], (got, want)
    assert all(abs(g - w) < 1e-6 for (_, g), (_, w) in zip(got, want)), (got, want)  # the second run's, not the first's


def test_offline_parts_of_one_second_are_all_found_in_order(tmp_path):
    """W&B names a second offline folder of a run started within the same second ``offline-run-<time>-<id>-1``: a
    resume that fast (the CI machine) is still one run's parts, oldest first; another id is not."""
    names = ["20261201_112534-abc", "20261201_112534-abc-1", "20261201_112533-abc", "20261201_112534-abcd"]
    names += ["20261201_112534-abc-10", "20261201_112534-abc-2"]
    for n in names:
        (tmp_path / f"offline-run-{n}").mkdir()
    got = [p.name[len("offline-run-") :] for p in offline_parts(tmp_path, "abc")]
    assert got == ["20261201_112533-abc", "20261201_112534-abc", *(f"20261201_112534-abc-{k}" for k in (1, 2, 10))]


def test_a_finished_run_resumed_keeps_its_position_pictures_in_tensorboard(tmp_path):
    """A finished run run again in its folder (a requeued job, a sweep run again) trains nothing and tests again; its
    TensorBoard file purges from the last step, which hid the ``pos/*`` pictures logged there (the fit's end, which
    does not come again): none left. The pictures are logged again as the test starts, into the run's one event
    file."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    over = [*TINY_VIT, *SHORT, *(o for o in FAST if o != "callbacks.pos_images=null"), "logger=tensorboard"]
    train(compose(tmp_path, over))
    # TensorBoard reads event files in name order, ``<seconds>.<host>.<pid>.<writer count>``: the runs' files a
    # second apart, read in the runs' order (a second process of a real run has another pid and second)
    time.sleep(1.0)
    train(compose(tmp_path, over))  # resume=auto: resumed finished, tested again

    # one file per run: a second one (the test's, as Lightning's logger opened) of the same second, its writer count
    # past 9 (a full suite, a sweep's jobs in one process), sorted first and the run's purge hid its pictures
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2

    ea = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"images": 0})
    ea.Reload()
    tags = [t for t in ea.Tags()["images"] if t.startswith("pos/")]
    steps = {t: [e.step for e in ea.Images(t)] for t in tags}  # (in the message: a rare CI failure showed none)
    assert len(tags) == 2 and all(s == [2] for s in steps.values()), (
        steps,
        sorted(f.name for f in (tmp_path / "tensorboard").rglob("*")),
    )


def test_a_key_without_a_reachable_server_logs_offline_with_a_warning(monkeypatch):
    """A compute node with ``WANDB_API_KEY`` and no network: ``logger.wandb.mode=auto`` chose online, and W&B waited
    two minutes, then stopped the run with ``CommError``. Auto now asks the server first (a refused port here), and
    logs offline, saying so; an explicit ``online`` is kept."""
    import socket

    from vitrel.train.loggers import wandb_mode

    with socket.socket() as s:  # a port nobody listens on: refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    with pytest.warns(UserWarning, match="the server does not answer .*logging offline"):
        assert wandb_mode("auto") == "offline"
    assert wandb_mode("online") == "online"
    with socket.socket() as server:  # a server that answers: online
        server.bind(("127.0.0.1", 0))
        server.listen()
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
        assert wandb_mode("auto") == "online"
