"""Helpers of the training tests: config composition, test-only callbacks, a W&B offline-file reader.

The callbacks are importable by ``python train.py`` subprocesses (tests/ on PYTHONPATH) and are
added from the command line as ``+callbacks.<name>={_target_: train_helpers.<Class>, ...}``.
"""

from __future__ import annotations

import os
import signal
import struct
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

# a small, fast model and data setting shared by the tests
TINY_VIT = ["model=vit_tiny_fmnist", "model.embed_dim=32", "model.depth=2", "model.num_heads=2"]
TINY_SWIN = [
    "model=vitrel_swin_tiny_patch2_window4_32",
    "+model.embed_dim=16",
    "+model.depths=[1,1]",
    "+model.num_heads=[2,2]",
]
FAST = [
    "data.num_workers=0",
    "data.batch_size=16",
    "trainer.accelerator=cpu",
    "progress_bar=none",
    "callbacks.pos_images=null",
    "callbacks.curves=null",  # (tests/train/test_curves.py draws them; 0.2-0.3 s a draw, each epoch)
    "callbacks.batch_preview=null",  # (tests/train/test_batch_preview.py draws it)
    "callbacks.attention_distance=null",  # (tests/train/test_attention_distance.py writes them)
    "callbacks.per_class.max_png_classes=0",  # (its CSVs only: tests/train/test_per_class.py draws confusion.png)
]
# eval.py's pictures off (as FAST's for train.py; eval.yaml's callbacks are top-level keys), for the tests of what
# it scores: tests/train/test_attention_distance.py and tests/train/test_per_class.py draw them
EVAL_PICTURES_OFF = ["attention_distance=null", "per_class.max_png_classes=0"]
# Moving Fashion-MNIST, small: 64 training and 32 test clips
TINY_CLIPS = ["data=moving_fmnist", "data.train_images=32", "data.test_images=16", "data.batch_size=8"]
# experiment=video with a one-block model
TINY_VIDEO = ["experiment=video", "model.embed_dim=16", "model.depth=1", "model.num_heads=2", *TINY_CLIPS[1:]]
TINY_VIDEO += ["data.val_fraction=0.0", *FAST[:1], *FAST[2:]]


def compose(tmp_path: Path, overrides: list[str], config_name: str = "train", multirun: bool = False):
    """Compose ``conf/<config_name>.yaml`` as ``python train.py <overrides>`` would, outside Hydra's main.

    The job folder is ``tmp_path``; Hydra's runtime config is registered so ``${hydra:...}`` resolves
    (``multirun``: as a job of ``-m``).
    """
    from hydra import compose as hcompose
    from hydra import initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import open_dict

    from vitrel.config import register_configs

    register_configs()  # (the schemas the configs' defaults name; idempotent)
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = hcompose(config_name, overrides=[*overrides, f"paths.output_dir={tmp_path}"], return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.mode = RunMode.MULTIRUN if multirun else RunMode.RUN
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def script_env() -> dict[str, str]:
    """Environment of ``python train.py`` subprocesses: tests/ importable, same thread count, W&B offline."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), str(ROOT), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = str(torch.get_num_threads())
    env.setdefault("WANDB_MODE", "offline")
    return env


def run_script(script: str, args: list[str], cwd: Path, timeout: float = 300):
    """``python <script> <args>`` (see ``script_env``); returns the CompletedProcess."""
    import subprocess

    return subprocess.run(
        [sys.executable, str(ROOT / script), *args],
        cwd=cwd,
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _script_here(script: str, args: list[str], cwd: str, out: str, err: str) -> None:
    """``python <script> <args>`` in this process (one forked by :func:`run_script_forked`), ending as the interpreter
    ends: the script run as ``__main__`` with its ``sys.argv``, ``sys.path`` (its folder, then ``script_env``'s
    tests/) and ``script_env``'s environment (that of the processes it starts: Lightning's DDP ranks), stdout and
    stderr to the files ``out`` and ``err`` (one file if the same); an uncaught exception's traceback or a
    ``SystemExit`` message printed, then the ``atexit`` functions the script registered and logging's shutdown (a
    forked process ends without them), then the exit code. The server's own ``atexit`` functions are not run: what
    they clean up is the server's, shared by every process forked from it (wandb's media folder, which
    ``wandb.Image`` writes into: a later forked process found it gone)."""
    import atexit
    import logging
    import runpy
    import traceback

    atexit._clear()  # (those the server registered when it imported the modules)

    for fd, path in ((1, out), (2, err)):
        if fd == 2 and err == out:  # both to one file, in the order written
            os.dup2(1, 2)
            continue
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    os.chdir(cwd)
    os.environ.update(script_env())
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    sys.argv = [str(ROOT / script), *args]
    code = 0
    try:
        runpy.run_path(str(ROOT / script), run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    logging.shutdown()  # (registered at exit by the server's import of logging: the script's handlers flushed)
    sys.exit(code)


def run_script_forked(script: str, args: list[str], cwd: Path, timeout: float = 300):
    """``python <script> <args>`` as :func:`run_script` (its CompletedProcess: exit code, stdout, stderr), run in a
    process forked from tests/preloaded.py's server, which imported vitrel once, instead of a fresh interpreter (about
    8 s of CPU to import). The script's own code runs as under ``python``; what differs is that the imports happened
    before it: a test of what importing prints, or of how a script starts, uses :func:`run_script`."""
    import subprocess
    import tempfile

    from tests import preloaded

    with tempfile.TemporaryDirectory() as d:
        out, err = Path(d) / "stdout", Path(d) / "stderr"
        proc = preloaded.start(_script_here, script, list(args), str(cwd), str(out), str(err))
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired([script, *args], timeout)
        texts = [p.read_text() if p.exists() else "" for p in (out, err)]
    return subprocess.CompletedProcess([script, *args], proc.exitcode, stdout=texts[0], stderr=texts[1])


def straight_and_resumed(over: list[str], tmp_path: Path, at_step: int) -> tuple[dict, dict]:
    """``python train.py <over>`` (:func:`run_script_forked`) run straight in one folder, and in another with SIGTERM
    at the start of step ``at_step`` (:class:`SendSignal`: it saves after step ``at_step + 1`` and exits), then the
    same command again there (it resumes): the two runs' ``last.ckpt``, loaded."""
    import signal

    kill = [f"+callbacks.sig={{_target_: train_helpers.SendSignal, at_step: {at_step}}}"]
    runs = {}
    for name, extra in (("straight", []), ("killed", kill), ("killed", [])):
        runs[name] = tmp_path / name
        proc = run_script_forked("train.py", [*over, *extra, f"hydra.run.dir={runs[name]}"], tmp_path)
        assert proc.returncode == (128 + signal.SIGTERM if extra else 0), proc.stderr[-3000:]
        if extra:
            saved = torch.load(runs[name] / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
            assert saved == at_step + 1, saved
    a, b = (torch.load(runs[n] / "checkpoints" / "last.ckpt", weights_only=True) for n in runs)
    return a, b


class ForkedScript:
    """``python <script> <args>`` started as :func:`run_script_forked` runs it (its stdout and stderr together in the
    file ``out``), not waited for: the methods of ``subprocess.Popen`` the tests use (``pid``, ``poll``, ``wait``,
    ``communicate``, ``send_signal``, ``kill``, ``returncode``) on the ``multiprocessing.Process`` it runs in."""

    def __init__(self, script: str, args: list[str], cwd: Path, out: Path) -> None:
        from tests import preloaded

        self.args, self.out = [script, *args], out
        self.proc = preloaded.start(_script_here, script, list(args), str(cwd), str(out), str(out))
        self.pid = self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.exitcode

    def poll(self) -> int | None:
        return self.proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.proc.exitcode

    def output(self) -> str:
        """What the script wrote so far (stdout and stderr)."""
        return self.out.read_text() if self.out.exists() else ""

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        self.wait(timeout)
        return self.output(), None

    def send_signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def kill(self) -> None:
        self.proc.kill()


def train_video_sweep(sweep: Path) -> Path:
    """``python train.py -m experiment=video pos=none`` (a sweep, as a user runs it), tiny, one epoch, in ``sweep``:
    its first job's folder (the ``video_sweep`` fixture of tests/conftest.py)."""
    args = ["-m", *TINY_VIDEO, "pos=none", "trainer.max_epochs=1", f"hydra.sweep.dir={sweep}", "logger=none"]
    r = run_script_forked("train.py", args, cwd=sweep)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return sweep / "0"


def _train_with_hang(cfg, at_step: int, marker: str) -> None:
    from vitrel.train.run import train

    train(cfg, callbacks=[Hang(at_step, marker)])


def start_hanging_run(cfg, marker: Path, at_step: int, what: str = "the run"):
    """``train(cfg)`` in a process of its own (forked from tests/preloaded.py's server) with a :class:`Hang` callback
    at ``at_step``: returns the running process (a ``multiprocessing.Process``) once it hangs there (``marker``
    written). The caller kills it."""
    from tests import preloaded

    proc = preloaded.start(_train_with_hang, cfg, at_step, str(marker))
    t0 = time.time()
    while not marker.exists():
        if not proc.is_alive():
            raise AssertionError(f"{what} ended before step {at_step} (exit code {proc.exitcode}; its error is above)")
        if time.time() - t0 > 240:
            proc.kill()
            raise AssertionError(f"timed out waiting for {what} to reach step {at_step}")
        time.sleep(0.2)
    return proc


def model_state(module: L.LightningModule) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.model.state_dict().items()}


# ------------------------------------------------------------------------------------------ callbacks
class SaveWeights(Callback):
    """Every rank saves its network's state dict at the start and at the end of training, to
    ``<dir>/start_rank<r>.pt`` and ``<dir>/rank<r>.pt``."""

    def __init__(self, dir: str) -> None:
        self.dir = dir

    def _save(self, trainer, pl_module, name: str) -> None:
        Path(self.dir).mkdir(parents=True, exist_ok=True)
        torch.save(model_state(pl_module), Path(self.dir) / f"{name}{trainer.global_rank}.pt")

    def on_train_start(self, trainer, pl_module) -> None:
        self._save(trainer, pl_module, "start_rank")

    def on_train_end(self, trainer, pl_module) -> None:
        self._save(trainer, pl_module, "rank")


class Hang(Callback):
    """Before training step ``at_step`` (global step), write ``marker`` and sleep (to be SIGKILLed)."""

    def __init__(self, at_step: int, marker: str) -> None:
        self.at_step = at_step
        self.marker = marker

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step >= self.at_step:
            Path(self.marker).write_text(str(trainer.global_step))
            time.sleep(600)


class SendSignal(Callback):
    """Send ``signum`` to this process at the start of training step ``at_step`` (to this thread, so that it is
    taken at once, whatever other threads the process runs)."""

    def __init__(self, at_step: int, signum: int = signal.SIGTERM) -> None:
        self.at_step = at_step
        self.signum = signum

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.at_step:
            signal.raise_signal(self.signum)


class PoisonWeights(Callback):
    """Fill one weight with NaN at the start of training step ``at_step``."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.at_step:
            with torch.no_grad():
                next(pl_module.model.parameters()).fill_(float("nan"))


class RaiseOnFetch(Callback):
    """After training step ``at_step``, the memory loader's data set raises on the next batch it makes (as a corrupt
    image would, while the loader fetches the batch of step ``at_step + 1``)."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.at_step:
            dataset = trainer.train_dataloader.dataset

            def corrupt(*args, **kwargs):
                raise OSError(f"image file is truncated (test: fetching the batch after step {self.at_step})")

            dataset.batch = corrupt


class RaiseInForward(Callback):
    """In the forward of the batch of step ``at_step + 1``: the network's last block raises (as an out-of-memory
    would), after the blocks before it ran (and drew their dropout)."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.at_step:

            def oom(module, args):
                raise torch.OutOfMemoryError(f"CUDA out of memory (test: forward after step {self.at_step})")

            pl_module.model.blocks[-1].register_forward_pre_hook(oom)


# ------------------------------------------------------------------------------------------ W&B files
def wandb_records(path: Path) -> list:
    """Records of a W&B offline run file (``run-<id>.wandb``: LevelDB-log framing of protobuf records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file")
    out, pos, block, buf = [], 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            break
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            payload = chunk
        elif kind == 2:
            buf = chunk
            continue
        elif kind == 3:
            buf += chunk
            continue
        else:
            payload = buf + chunk
        rec = pb.Record()
        rec.ParseFromString(payload)
        out.append(rec)
    return out


def wandb_contents(path: Path) -> tuple[dict, dict, Any]:
    """``(config, last value of each history key, run record)`` of a W&B offline run file."""
    import json

    config, history, run = {}, {}, None
    for rec in wandb_records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "config":
            for u in rec.config.update:
                config[u.key or "/".join(u.nested_key)] = json.loads(u.value_json)
        elif kind == "history":
            for item in rec.history.item:
                history[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        elif kind == "run":
            run = rec.run
    return config, history, run
