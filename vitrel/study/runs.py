"""One run of the study: its config (``conf/experiment/study_<budget>.yaml`` composed as ``python train.py``
does), its training (``vitrel.train.run.train``), its scores on ``study.evals``, its fine-tune at a larger size,
the throughput timing of the finished selection and the position tensors kept for the notebooks."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from pathlib import Path

import torch
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

import vitrel.config  # noqa: F401  (registers the config schemas conf/ names, before Hydra composes)
from vitrel.bench import StepTimer, alternate, train_step, train_step_bytes
from vitrel.pos import PositionScheme

ROOT = Path(__file__).resolve().parents[2]
#: the study's budgets: conf/experiment/study_<budget>.yaml (study_base*.yaml: the parts they share)
BUDGETS = sorted(p.stem.removeprefix("study_") for p in (ROOT / "conf" / "experiment").glob("study_*.yaml"))
BUDGETS = [b for b in BUDGETS if not b.startswith("base")]
# a run's config minus these keys is its recipe (where things go, the display, which scheme and seed; the scheme's
# settings are checked per run: vitrel.study.cli.scheme_settings)
NOT_RECIPE = ("paths", "seed", "pos", "progress_bar", "ckpt_path", "resume", "task_name", "study")


def compose(budget: str, overrides: list[str], output_dir: str | Path = "<run folder>") -> DictConfig:
    """``conf/train.yaml`` + ``experiment=study_<budget>`` + ``overrides``, as ``python train.py`` composes it."""
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = hydra_compose("train", [f"experiment=study_{budget}", *overrides])
    cfg.paths.output_dir = str(output_dir)  # instead of Hydra's job folder
    return cfg


def recipe(budget: str, extra: list[str] = ()) -> dict:
    """The ``study`` block and each architecture's resolved run config (less the per-run keys)."""
    study = OmegaConf.to_container(compose(budget, list(extra)).study, resolve=True)
    runs = {}
    for arch, arch_overrides in study["archs"].items():
        cfg = OmegaConf.to_container(compose(budget, [*extra, *arch_overrides]), resolve=True)
        cfg["data"].pop("root", None), cfg["model"].pop("pos", None)
        runs[arch] = {k: v for k, v in cfg.items() if k not in NOT_RECIPE}
    return dict(budget=budget, overrides=list(extra), study=study, runs=runs)


#: the ``test`` eval scored on the other evals' images (``ood_images``): a run records ``<TEST_ON_OOD>_acc``, what a
#: within-run difference against an out-of-distribution set (``study.derived``) takes for ``test``
TEST_ON_OOD = "test_on_ood_images"


def same_images(study: dict) -> bool:
    """Whether ``test`` scores the same images as the other evals (every test image for all: both counts null)."""
    return study.get("test_images") is None and study.get("ood_images") is None


def _subset(ds, n: int | None, seed: int):
    idx = torch.randperm(len(ds), generator=torch.Generator().manual_seed(seed))[:n]
    return ds if n is None or n >= len(ds) else torch.utils.data.Subset(ds, sorted(idx.tolist()))


def eval_sets(study: dict, dm, paired: bool = False) -> dict[str, torch.utils.data.Dataset]:
    """``study.evals`` of the data module's test split: the in-distribution set (``test``: ``test_images``,
    seeded subset 1) and the others (the same ``ood_images`` test images each, seeded subset 2), each image
    in a black canvas at a seeded offset of the eval's region (``mode``, ``grid_step``, ``off_step``) and/or
    resized. Clips (a video data module): the same videos rendered or read with ``num_frames`` frames (default
    the training clips') and/or at ``resize`` pixels a side (the data module's ``make_dataset``).

    ``paired``: also ``TEST_ON_OOD``, the ``test`` set made of the others' images (where they differ: not both
    ``test_images`` and ``ood_images`` null), the base of a within-run difference on the same images."""
    from vitrel.data import ResizedDataset, TranslatedDataset
    from vitrel.data.video import VideoDataModule

    def make(name: str, e: dict, ood: bool):
        if isinstance(dm, VideoDataModule):
            if "canvas" in e:
                raise ValueError(f"study.evals.{name}: canvas places images; clips take num_frames and resize")
            ds = dm.make_dataset("test", img_size=e.get("resize"), num_frames=e.get("num_frames"))
            return _subset(ds, study["ood_images" if ood else "test_images"], seed=2 if ood else 1)
        if "num_frames" in e:
            raise ValueError(f"study.evals.{name}: num_frames needs video data (data=moving_fmnist, video_folder)")
        ds = dm.make_dataset("test")
        if "canvas" in e:
            c, mode = e["canvas"], e.get("mode", "random")
            ds = TranslatedDataset(
                dm.raw_dataset("test"), c, 0, dm.eval_transform(c), mode, grid_step=e.get("grid_step", 1),
                off_step=e.get("off_step", 1),
            )  # fmt: skip
        ds = _subset(ds, study["ood_images" if ood else "test_images"], seed=2 if ood else 1)
        return ResizedDataset(ds, e["resize"]) if "resize" in e else ds

    out = {name: make(name, e, ood=name != "test") for name, e in study["evals"].items()}
    if paired and "test" in out and not same_images(study):
        out[TEST_ON_OOD] = make("test", study["evals"]["test"], ood=True)
    return out


def materialise(ds, batch: int = 1000) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*((x, torch.as_tensor(y)) for x, y in torch.utils.data.DataLoader(ds, batch_size=batch)))
    return torch.cat(xs), torch.cat(ys).long()


@torch.inference_mode()
def accuracy(model, x, y, device, batch: int, bf16: bool) -> float:
    """Top-1 accuracy of ``model`` on images or clips ``x``; videos of ``K`` clips (``x [B, K, C, T, H, W]``) are
    scored by the mean of their clips' softmax, as ``eval.py`` scores them."""
    from vitrel.inference import mean_softmax_log

    hits, model = 0, model.eval()
    with torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
        for i in range(0, len(x), batch):
            xb = x[i : i + batch].to(device)
            logits = mean_softmax_log(model(xb.flatten(0, 1)), xb.shape[1]) if xb.dim() == 6 else model(xb)
            hits += int((logits.argmax(-1).cpu() == y[i : i + batch]).sum())
    return hits / len(x)


class Probe(StepTimer):
    """Times the training steps; keeps the network the run scores (its EMA copy under ``module.ema_eval``, as
    ``train.py``'s test, ``eval.py`` and the fine-tune's ``load_model`` take) and the step count."""

    def on_fit_end(self, trainer, pl_module) -> None:
        self.model, self.steps, self.epochs = pl_module.scored_network, trainer.global_step, trainer.current_epoch


def run_one(
    cfg: DictConfig, study: dict, data: dict, device: torch.device, ft_cfg: DictConfig | None = None
) -> tuple[dict, torch.nn.Module]:
    """Train ``cfg``, score the model on every evaluation set; with ``ft_cfg``, fine-tune it at the larger
    size (``ft_cfg.model`` loads the trained weights) and score that on ``study.finetune.eval``."""
    from vitrel.train.run import train

    probe = Probe(study["timing_skip_steps"], device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    metrics = train(cfg, callbacks=[probe])
    fit_s, model = time.perf_counter() - t0, probe.model.to(device)
    x, y = (t[: int(cfg.data.batch_size)] for t in data["test"])
    x = x[:, 0] if x.dim() == 6 else x  # (videos of several clips: a training step takes one clip each)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else train_step_bytes(model, x, y)
    bf16 = str(cfg.trainer.precision).startswith("bf16")
    accs, eval_s = score(model, study, data, device, bf16)
    loss = metrics.get("train/loss_epoch")
    record = dict(params=sum(p.numel() for p in model.parameters()), **accs, train_img_s=probe.img_s)  # None: no step
    record.update(peak_mem_mb=peak / 2**20, fit_s=fit_s, eval_s=eval_s, steps=probe.steps, epochs=probe.epochs)
    record.update(final_train_loss=None if loss is None else float(loss), device=device.type)
    if ft_cfg is not None:
        ft_probe, t2 = Probe(study["timing_skip_steps"], device), time.perf_counter()
        train(ft_cfg, callbacks=[ft_probe])
        ev = study["finetune"]["eval"]
        record[f"ft_{ev}_acc"] = accuracy(ft_probe.model.to(device), *data[ev], device, study["eval_batch_size"], bf16)
        record.update(ft_fit_s=time.perf_counter() - t2, ft_steps=ft_probe.steps)
    return {**record, "finished": time.strftime("%Y-%m-%d %H:%M:%S")}, model


def score(model: torch.nn.Module, study: dict, data: dict, device, bf16: bool) -> tuple[dict, float]:
    """``{<eval>_acc: accuracy}`` on every evaluation set, and the seconds it took."""
    t1 = time.perf_counter()
    accs = {f"{k}_acc": accuracy(model, *v, device, study["eval_batch_size"], bf16) for k, v in data.items()}
    return accs, time.perf_counter() - t1


def rebuilt(cfg: DictConfig, trained: torch.nn.Module, device) -> torch.nn.Module:
    """``cfg``'s model (a scored variant: the trained entry's options plus ``score_with``) holding ``trained``'s
    weights; refuses a variant whose parameters differ (``load_state_dict`` strict: its options must act at call
    time only)."""
    from vitrel.train.build import build_model

    model = build_model(cfg.model, instantiate(cfg.data))
    try:
        model.load_state_dict(trained.state_dict())
    except RuntimeError as e:
        raise ValueError(
            f"a scored study variant (pos {OmegaConf.to_container(cfg.pos)}) must have the trained entry's parameters; "
            f"its options change them: {str(e).splitlines()[0]}"
        ) from None
    return model.to(device)


def finetune_cfg(cfg: DictConfig, study: dict, overrides: list[str], budget: str) -> DictConfig | None:
    """The fine-tune run of ``cfg``'s run: the same overrides plus ``study.finetune``'s, the input at
    ``finetune.img_size``, and ``model=from_checkpoint`` (``conf/model/from_checkpoint.yaml``:
    ``vitrel.load_model`` of the run's last checkpoint, learned tables and absolute embeddings resized to
    the new grid; the architecture's overrides restate the stored arguments)."""
    ft = study.get("finetune")
    if not ft:
        return None
    run_dir = Path(cfg.paths.output_dir)
    last = str(run_dir / "checkpoints" / "last.ckpt").replace("'", "\\'")  # a quoted Hydra value
    load = ["model=from_checkpoint", f"model.path='{last}'", f"model.architecture={cfg.model.name}"]
    over = [*overrides, *ft["overrides"], f"data.img_size={ft['img_size']}", *load]
    return compose(budget, over, run_dir.with_name(run_dir.name + "_ft"))


def measure_cost(cfgs: dict[str, DictConfig], device, rounds: int, steps: int) -> dict[str, dict]:
    """Training images/s of every ``"arch/scheme"`` config (seed-0 initialisation, the recipe's batch of random
    images): ``steps`` training steps per model and round, the models taking turns; the median of the rounds."""
    from vitrel.train.build import build_model

    fns, bs = {}, 0
    for key, cfg in cfgs.items():
        dm, bs, g = instantiate(cfg.data), int(cfg.data.batch_size), torch.Generator().manual_seed(0)
        torch.manual_seed(0)
        model = build_model(cfg.model, dm).to(device).train()
        x = torch.randn(bs, *dm.input_size, generator=g).to(device)
        y = torch.randint(0, dm.num_classes, (bs,), generator=g).to(device)
        bf16 = str(cfg.trainer.precision).startswith("bf16")
        fns[key] = train_step(model, torch.optim.AdamW(model.parameters()), x, y, bf16)
    on_round = lambda r: print(f"cost: round {r + 1}/{rounds} timed")  # noqa: E731
    times = alternate(fns, rounds, warmup=2, repeat=steps, device=device, on_round=on_round)
    return {k: dict(img_s=bs / statistics.median(v), rounds=[bs / t for t in v]) for k, v in times.items()}


def save_pos(path: Path, key: str, model: torch.nn.Module) -> None:
    """Add the state of a model's position schemes under ``<key>/`` to a safetensors file (with its vitrel_cfg)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from vitrel.models.ckpt_files import follow_umask

    tensors, meta = {}, {}
    if path.exists():
        with safe_open(str(path), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys() if not k.startswith(f"{key}/")}
            meta = dict(f.metadata() or {})
    for name, m in model.named_modules():
        for k, v in m.state_dict().items() if isinstance(m, PositionScheme) else ():
            tensors[f"{key}/{name}.{k}"] = v.detach().float().cpu().contiguous()
    meta[key] = json.dumps(model.vitrel_cfg)
    save_file(tensors, str(path.with_name(f".{path.name}.tmp")), metadata=meta)
    follow_umask(path.with_name(f".{path.name}.tmp"))  # (safetensors writes 0600)
    os.replace(path.with_name(f".{path.name}.tmp"), path)
