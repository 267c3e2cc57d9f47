"""``predict.py``'s body (:func:`run_predict`): its settings checked, the model loaded, a folder scored
(:mod:`vitrel.inference`), the CSV written and a summary printed. A ``.ckpt`` whose ``train.py`` run trained with NaFlex
batches (``data.packing``) scores its images as the run's test and ``eval.py`` did, with the run's ``seq_len``,
``max_tokens``, ``eval_max_ratio`` and packing (:func:`naflex_of_run`) unless given. The rows are written as CSV, or
as JSON for a ``results_file`` ending in ``.json``, a batch at a time as they are predicted (:class:`ResultsWriter`)."""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import os
import textwrap
from pathlib import Path
from typing import Any

import torch
from timm.layers import to_2tuple

from vitrel.config import PredictConfig, check_top_keys
from vitrel.data.input_files import IMG_EXTENSIONS, check_input
from vitrel.inference import PredictSettingsError, check_predict_args, load_predictor, predict_folder
from vitrel.models.ckpt_files import run_checkpoint
from vitrel.models.run_record import naflex_of_run, nominal_size_warning
from vitrel.train.launch_paths import PREDICT_PATHS, launch_paths
from vitrel.train.progress import progress_bar_kind

__all__ = [
    "run_predict",
    "check_results_file",
    "write_results",
    "ResultsWriter",
]

log = logging.getLogger(__name__)

#: ``precision=``: Lightning's ``trainer.precision`` names (``eval.py``'s), and the dtype each runs the forward under
#: ``torch.autocast`` in (none: float32)
AUTOCAST = {"32-true": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def _precision(precision: str) -> torch.dtype | None:
    if precision not in AUTOCAST:
        raise PredictSettingsError(
            f"precision={precision} is not one predict.py runs: 32-true, bf16-mixed or 16-mixed (torch.autocast), "
            "as Lightning's trainer.precision names them"
        )
    return AUTOCAST[precision]


def _naflex_settings(cfg: Any, ckpt: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(predict_folder's NaFlex arguments, those taken from the run of the checkpoint ckpt)``: the run's
    (:func:`naflex_of_run`) but for the keys given, a value or on Hydra's command line (outside Hydra: any key ``cfg``
    holds); logged in one line. ``seq_len=null`` given: fixed-size images, nothing taken."""
    from vitrel.train.utils import hydra_config, override_key

    hc, args = hydra_config(), {"seq_len": cfg.get("seq_len"), "max_tokens": cfg.get("max_tokens")}
    on_line = {override_key(o) for o in hc.overrides.task} if hc is not None else set(cfg)
    given = {k for k, v in args.items() if v is not None or k in on_line}
    if "seq_len" in given and args["seq_len"] is None:
        return args, {}
    run, record = naflex_of_run(ckpt)
    taken = {k: v for k, v in run.items() if k not in given}
    args |= taken
    if "max_tokens" in taken and "seq_len" in given and taken["max_tokens"] > args["seq_len"]:
        raise PredictSettingsError(
            f"seq_len={args['seq_len']} is shorter than the run's max_tokens={taken['max_tokens']} ({record}): give "
            f"max_tokens=<at most {args['seq_len']}> or seq_len=<at least {taken['max_tokens']}>"
        )
    if taken:
        log.info(
            " ".join(f"{k}={'null' if v is None else v}" for k, v in taken.items())
            + f": the NaFlex evaluation of {ckpt.name}'s run (its data.* in {record}; "
            "seq_len=<n> / max_tokens=<n> for others, seq_len=null for fixed-size images)"
        )
    return args, taken


def _device(device: str) -> str:
    """``device=`` as torch names it (``auto``: cuda when there is one); a malformed name, or a GPU this machine does
    not have, an error naming what to give (torch's own comes as a traceback once the checkpoint is read)."""
    from vitrel.train.utils import AcceleratorUnavailableError

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise PredictSettingsError(f"device={device} is not a device: auto, cpu, cuda, cuda:<n>, mps ...") from None
    missing = {
        "cuda": ("a CUDA GPU", torch.cuda.is_available),
        "mps": ("an Apple GPU (MPS)", torch.backends.mps.is_available),
    }
    if kind in missing and not missing[kind][1]():
        raise AcceleratorUnavailableError(
            f"device={device} asks for {missing[kind][0]}, and PyTorch sees none on this machine: predict on the CPU "
            "with device=cpu (or device=auto: a GPU where there is one)"
        )
    return device


#: the formats of ``results_file``, by its suffix
RESULTS_FORMATS = {".csv": "CSV", ".json": "JSON (a list of rows)"}


def check_results_file(path: str | Path) -> Path:
    """``results_file`` checked before anything is loaded: a file ending in ``.csv`` or ``.json``, not a folder."""
    p = Path(path)
    if p.is_dir():
        raise PredictSettingsError(
            f"results_file={p} is a folder: give a file in it, e.g. results_file={p / 'predictions.csv'}"
        )
    if p.suffix.lower() not in RESULTS_FORMATS:
        kinds = ", ".join(f"{k} ({v})" for k, v in RESULTS_FORMATS.items())
        raise PredictSettingsError(f"results_file={p}: predict.py writes {kinds}; give a file name ending in one")
    return p


class ResultsWriter:
    """The rows of ``results_file`` written as they are predicted (:meth:`write`, a batch at a time, flushed) to
    ``<name>.partial<suffix>`` beside it, renamed onto it when the run ends: a run stopped part way (Ctrl-C, an error,
    a kill) leaves the rows predicted so far in the partial file, and a previous ``results_file`` whole. CSV as timm's
    separate columns, or for ``.json`` a JSON list of the same rows (numbers as numbers; closed, valid, unless
    killed)."""

    def __init__(self, path: str | Path) -> None:
        self.path = check_results_file(path)
        self.partial = self.path.with_name(f"{self.path.stem}.partial{self.path.suffix}")
        self.json, self.count, self._csv = self.path.suffix.lower() == ".json", 0, None

    def __enter__(self) -> ResultsWriter:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.partial, "w", newline="", encoding="utf-8")  # noqa: SIM115 - closed by __exit__
        return self

    def write(self, rows: list[dict[str, Any]]) -> None:
        if self.json:
            for row in rows:
                self._f.write(("[\n" if self.count == 0 else ",\n") + textwrap.indent(json.dumps(row, indent=1), " "))
                self.count += 1
        elif rows:
            if self._csv is None:
                self._csv = csv.DictWriter(self._f, fieldnames=list(rows[0]))
                self._csv.writeheader()
            self._csv.writerows(rows)
            self.count += len(rows)
        self._f.flush()

    def __exit__(self, kind: Any, *_: Any) -> None:
        with self._f:
            if self.json:
                self._f.write("\n]\n" if self.count else "[]\n")  # (json.dump's indent=1 layout)
            elif self._csv is None:
                csv.DictWriter(self._f, fieldnames=["filename"]).writeheader()
        if kind is None:
            os.replace(self.partial, self.path)
        elif self.count == 0:  # (stopped before a row: nothing to keep)
            self.partial.unlink(missing_ok=True)


def write_results(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """The rows written to ``path`` as CSV, or for a ``.json`` path as a JSON list (:class:`ResultsWriter`)."""
    with ResultsWriter(path) as out:
        out.write(rows)
    return out.path


class NothingReadError(RuntimeError):
    """``predict.py`` found image (or video) files under its input and could read none of them: the run fails (a
    script must not take a results file of its header only for a success)."""


def given_class_names(value: Any) -> list[str] | None:
    """``class_names``: a list, or a text file of one name a line (timm's class map: line ``i`` names class ``i``)."""
    if value is None:
        return None
    if isinstance(value, str):
        path = Path(value)
        if not path.is_file():
            raise FileNotFoundError(f"class_names={value}: no such file (give a list [a,b,...] or a file of names)")
        return [line.strip() for line in path.read_text().splitlines() if line.strip()]
    return [str(v) for v in value]


def run_predict(cfg: Any) -> dict[str, Any]:
    """``predict.py``'s body: check the settings, load, predict, write the CSV, print a summary; returns the summary."""
    check_top_keys(cfg, PredictConfig, "predict.py")  # +top_k=3: composed and ignored
    launch_paths(cfg, PREDICT_PATHS)  # input=images: the launch folder's, also under hydra.job.chdir=true
    check_predict_args(**{k: cfg.get(k, d) for k, d in (("topk", 5), ("batch_size", 64), ("num_workers", 0))})
    check_predict_args(seq_len=cfg.get("seq_len"), max_tokens=cfg.get("max_tokens"))
    check_results_file(str(cfg.results_file))
    device = _device(str(cfg.get("device", "auto")))
    autocast = _precision(str(cfg.get("precision", "32-true")))
    from vitrel.train.utils import plain  # (predict.py's configuration is Hydra's)

    overrides = dict(plain(cfg.get("model_overrides")) or {})
    from vitrel.data.video.folder import VIDEO_EXTENSIONS

    names = given_class_names(cfg.get("class_names"))
    # a mistyped input, an empty folder, one of other files: refused before the model loads
    check_input(Path(str(cfg.input)), "images or videos", extensions=IMG_EXTENSIONS + VIDEO_EXTENSIONS)
    ckpt = run_checkpoint(str(cfg.ckpt_path))  # a train.py run folder: the checkpoint its test scored (logged)
    naflex, taken = _naflex_settings(cfg, ckpt)  # (a NaFlex run's checkpoint: its images scored as its test did)
    predictor = load_predictor(ckpt, device, cfg.get("ema", "auto"), overrides)
    classes = getattr(predictor.model, "num_classes", None)  # (timm's models and a .pt2's: before any image is read)
    if names is not None and isinstance(classes, int) and len(names) != classes:
        raise PredictSettingsError(f"class_names has {len(names)} names; the model has {classes} classes")
    patch = (getattr(predictor.model, "vitrel_cfg", None) or {}).get("patch_size")
    h, w = predictor.data_config["input_size"][-2:]
    if naflex.get("seq_len") is None and patch is not None and h == w and "num_frames" not in predictor.data_config:
        fix = "leave seq_len unset to score its images as the run did"
        warning = nominal_size_warning(ckpt, int(h), int(to_2tuple(patch)[0]), fix, "+model_overrides.img_size")
        if warning:
            log.warning(warning)
    mixed = torch.autocast(predictor.device.type, dtype=autocast) if autocast else contextlib.nullcontext()
    writer = ResultsWriter(str(cfg.results_file))
    try:
        with writer, mixed:  # (the forward's ops: the images are read and normalised in float32, in workers or not)
            res = predict_folder(
                predictor,
                str(cfg.input),
                topk=int(cfg.get("topk", 5)),
                batch_size=int(cfg.get("batch_size", 64)),
                num_workers=int(cfg.get("num_workers", 0)),
                progress={"lines": "lines", "none": False}.get(
                    progress_bar_kind(cfg.get("progress_bar", "auto")), True
                ),
                apply_exif_orientation=bool(cfg.get("apply_exif_orientation", False)),
                class_names=names,
                on_rows=writer.write,
                **naflex,
            )
    except BaseException:
        if writer.count:
            log.warning(f"stopped after {writer.count} prediction(s): they are in {writer.partial}")
        raise
    out = writer.path
    kind = "videos" if "num_frames" in predictor.data_config else "images"
    summary = {
        kind: len(res.rows),
        "skipped": len(res.skipped),
        "found": res.found,
        "passed_over": res.passed_over,  # the other files under input (not images / videos)
        "exif_turned": len(res.turned),  # photos stored turned (EXIF orientation 2-8)
        "seconds": round(res.seconds, 3),
        f"{kind}_per_s": round(len(res.rows) / res.seconds, 2) if res.seconds > 0 else None,
        "results_file": str(out),
        "model": predictor.source,
        "device": str(predictor.device),
        "precision": str(cfg.get("precision", "32-true")),
        "naflex_from_run": taken,  # the NaFlex settings taken from the checkpoint's run (not given)
    }
    skipped = f", skipped {len(res.skipped)} unreadable file(s)" if res.skipped else ""
    if res.passed_over:
        skipped += f", passed over {res.passed_over} other file(s) (not {kind})"
    print(
        f"predicted {len(res.rows)} of {res.found} {kind[:-1]}(s){skipped} in {res.seconds:.1f} s on "
        f"{predictor.device}; "
        f"wrote {out}"
    )
    if res.found and not res.rows:
        first, why = res.skipped[0]
        raise NothingReadError(
            f"none of the {res.found} {kind} under {cfg.input} could be read ({first}: {why}); {out} holds the "
            "header only"
        )
    return summary
