"""Every command the docs give a user composes: ``python train.py | eval.py | predict.py <overrides>``.

The commands are read from every place a user reads one (:data:`SOURCES`): code blocks and inline code of the
guides, ``conf/`` comments, the scripts' and the package's docstrings. Each distinct command is one case (its id:
where it first appears). Its placeholders (``<run>``, ``<budget>`` ...) are filled from :data:`PLACEHOLDERS`; a
command that is no command (a synopsis, a sentence about one) is in :data:`SKIP`, one written to show an error in
:data:`EXPECTED_ERRORS` with the error it must give. Each command is composed as its script composes it (Hydra's
compose API on ``conf/<script>.yaml``; under ``-m`` every job of the sweep), then the script's checks that run before
any work do (moved keys, a ``pos=`` with ``model=from_checkpoint``, ``trainer=ddp`` under ``-m``, the settings of
``predict.py``) and the config is resolved, as the script resolves it: no data, model or checkpoint is read.
"""

from __future__ import annotations

import itertools
import re
import shlex
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import OmegaConf, open_dict

from vitrel.config import check_moved_keys, register_configs
from vitrel.inference import check_predict_args
from vitrel.train.run import check_from_checkpoint, check_launch
from vitrel.train.utils import run_dir_of

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

# Where users read commands: the guides (prose and code blocks), the measured figures' commands (bench/results),
# conf/ comments, the entry scripts' and the package's docstrings and messages, the benchmarks' usage lines.
# Not read: bench/journal/ (dated notes, kept as written), CHANGELOG.md (history), tests/ (they run their commands).
SOURCES = [
    "README.md",
    "docs/*.md",
    "notebooks/README.md",
    "bench/results/*.md",
    "conf/**/*.yaml",
    "train.py",
    "eval.py",
    "predict.py",
    "vitrel/**/*.py",
    "bench/*.py",
]
SCRIPTS = {"train.py": "train", "eval.py": "eval", "predict.py": "predict"}  # script -> its conf/<name>.yaml

RUN = "outputs/train/runs/2026-01-01_12-00-00"
# the study's budgets: conf/experiment/study_<budget>.yaml (study_base*.yaml are the parts they share)
BUDGETS = sorted(p.stem.removeprefix("study_") for p in (CONF / "experiment").glob("study_*.yaml"))
BUDGETS = [b for b in BUDGETS if not b.startswith("base")]

# placeholder as the docs write it -> its value, or values (the command is composed with each); replaced in this
# order. Paths need not exist: nothing is read.
PLACEHOLDERS: dict[str, str | list[str]] = {
    # the study's runs (vitrel/study/__init__.py writes the budget B): every budget; the architectures' overrides
    # (study.archs) are composed for every budget by tests/study/ (vitrel.study.recipe)
    "<study.archs.<arch>>": "",
    "experiment=study_<budget>": [f"experiment=study_{b}" for b in BUDGETS],
    "experiment=study_B": [f"experiment=study_{b}" for b in BUDGETS],
    "<scheme>": "rel2d_factored",
    "seed=<k>": "seed=1",
    "seed=<s>": "seed=1",
    # checkpoints, export folders, model files, run folders
    "<.ckpt | export folder | model.pt2>": "export_dir",
    "<.ckpt | export folder | .pt2>": "export_dir",
    "<.ckpt | .safetensors | export folder>": "export_dir",
    "<export dir or model.safetensors>": "export_dir/model.safetensors",
    "<export dir or .safetensors>": "export_dir/model.safetensors",
    "<export folder | model.pt2>": "export_dir/model.pt2",
    "<...>.ckpt": f"{RUN}/checkpoints/last.ckpt",
    "ckpt_path=...": f"ckpt_path={RUN}/checkpoints/last.ckpt",
    "<video run>": RUN,
    "outputs/train/runs/<run>": RUN,
    "outputs/train/runs/<folder>": RUN,
    "<run>": RUN,
    # predict.py's input and data roots
    "<folder, ImageFolder tree or one file>": "path/to/images",
    "<ImageFolder tree>": "path/to/images",
    "<folder of videos>": "path/to/videos",
    "<folder>": "path/to/images",
    "<videos>": "/data/videos",
    # a SLURM partition; a data group ([data=...] in conf/eval.yaml)
    "<p>": "gpu",
    "data=...": "data=cifar10",
    # docs/data.md's config folder of one's own data module (my_conf/data/mine.yaml): tests/fixtures' copy
    "file://my_conf": f"file://{ROOT}/tests/fixtures/my_conf",
    # a trailing `...`: "and any other overrides"
    " ...": "",
}

# commands that are no command, with why they are not composed
SKIP = {
    # the synopsis of every command
    "python train.py [group=option ...] [key=value ...]": "the syntax of a command, not one",
    "python train.py [group=option ...] [key=value ...] (see docs/training.md)": "the same (conf/train.yaml)",
    # the scripts named in prose: eval.py and predict.py need ckpt_path (and input)
    "python eval.py": "names the script (ckpt_path is required)",
    "python predict.py": "names the script (ckpt_path and input are required)",
    # what Lightning re-runs for plain DDP (docs/sweeps.md, conf/trainer/ddp.yaml, the error of check_launch)
    "python train.py <same arguments>": "describes Lightning's re-launch of a command",
}

# commands written to show an error -> text the error must contain
EXPECTED_ERRORS = {
    "python train.py module.optimizer.lr=abc": "Value 'abc' of type 'str' could not be converted to Float",
}

CMD = re.compile(r"python (train|eval|predict)\.py\b")
SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)  # inline code: `...`, ``...`` (may span lines)
FENCE = re.compile(r"\s*(```+|~~~+)")
COMMENT = re.compile(r"\s+#.*$")  # a trailing `# comment`


# ------------------------------------------------------------------------------------------- extraction
def doc_lines(path: Path) -> list[tuple[str, bool]]:
    """``(text, in_code_block)`` per line of ``path`` as a user reads it: a Markdown file's lines (fence lines empty),
    a YAML file's comments (other lines empty), a Python file's lines."""
    lines = path.read_text().splitlines()
    if path.suffix == ".yaml":
        return [((m.group(2) if (m := re.search(r"(^|\s)#(.*)", s)) else ""), False) for s in lines]
    if path.suffix != ".md":
        return [(s, False) for s in lines]
    out, fence = [], None
    for s in lines:
        m = FENCE.match(s)
        if m and (fence is None or m.group(1).startswith(fence)):
            fence = m.group(1) if fence is None else None
            out.append(("", False))
        else:
            out.append((s, fence is not None))
    return out


def extract(path: Path) -> list[tuple[int, str]]:
    """``(line number, command)`` of every command in ``path``: in inline code, to the span's end (across lines);
    elsewhere, to the end of the line (joined over trailing ``\\``), less a trailing ``# comment``."""
    lines = doc_lines(path)
    found: list[tuple[int, str]] = []
    i = 0
    while i < len(lines):
        text, code = lines[i]
        if code:  # a code block's line, with its continuation lines
            start = i
            while text.endswith("\\") and i + 1 < len(lines) and lines[i + 1][1]:
                i += 1
                text = text[:-1] + " " + lines[i][0]
            found += [(start + 1, COMMENT.sub("", text[m.start() :])) for m in CMD.finditer(text)]
            i += 1
            continue
        if not text.strip():
            i += 1
            continue
        start = i  # a paragraph of prose: its inline code may span lines
        while i < len(lines) and lines[i][0].strip() and not lines[i][1]:
            i += 1
        para = "\n".join(t for t, _ in lines[start:i])
        spans = [(m.start(2), m.end(2)) for m in SPAN.finditer(para)]
        for m in CMD.finditer(para):
            end = next((e for s, e in spans if s <= m.start() < e), None)
            cmd = para[m.start() : end] if end is not None else COMMENT.sub("", para[m.start() :].split("\n")[0])
            found.append((start + 1 + para.count("\n", 0, m.start()), cmd))
    return [(n, " ".join(c.split())) for n, c in found]


def source_files() -> list[Path]:
    return sorted({p for pattern in SOURCES for p in ROOT.glob(pattern) if p.is_file()})


def doc_commands() -> dict[str, list[str]]:
    """Every distinct command -> where it appears (``file:line``), in the order of :func:`source_files`."""
    out: dict[str, list[str]] = {}
    for path in source_files():
        for line, cmd in extract(path):
            out.setdefault(cmd, []).append(f"{path.relative_to(ROOT)}:{line}")
    return out


COMMANDS = doc_commands()


def case_ids() -> list[str]:
    """Each command's id: where it first appears (``file:line``; ``#2`` for a second command first seen on a line)."""
    ids: list[str] = []
    for where in COMMANDS.values():
        n = sum(i.split("#")[0] == where[0] for i in ids)
        ids.append(where[0] if n == 0 else f"{where[0]}#{n + 1}")
    return ids


# ------------------------------------------------------------------------------------------- composition
def fill(command: str) -> list[str]:
    """The command with its placeholders filled: one command per combination of the values of :data:`PLACEHOLDERS`."""
    out = [command]
    for key, value in PLACEHOLDERS.items():
        if any(key in c for c in out):
            values = [value] if isinstance(value, str) else value
            out = [c.replace(key, v) for c in out for v in values]
    return out


def parse(command: str) -> tuple[str, list[str], bool, bool]:
    """``(config name, overrides, -m, runs the task)`` of a filled command; ``--cfg`` / ``--help`` only compose (Hydra
    prints and stops). A whole-token ``[key=value]`` is an optional override, given."""
    tokens = shlex.split(command)
    assert tokens[0] == "python" and tokens[1] in SCRIPTS, command
    overrides, multirun, runs, args = [], False, True, iter(tokens[2:])
    for t in args:
        if t in ("-m", "--multirun"):
            multirun = True
        elif t in ("--cfg", "-c"):
            runs = False
            next(args)  # the part: job | hydra | all
        elif t in ("--help", "-h", "--hydra-help"):
            runs = False
        elif t.startswith("-"):
            raise AssertionError(f"{t}: a flag this test does not know (add it to parse())")
        else:
            overrides.append(t[1:-1] if t.startswith("[") and t.endswith("]") and "=" in t else t)
    return SCRIPTS[tokens[1]], overrides, multirun, runs


def jobs(overrides: list[str], multirun: bool) -> list[list[str]]:
    """The overrides of each job: the one run, or every job of the ``-m`` sweep as Hydra's basic sweeper splits it
    (comma lists, ``glob()``, ``range()``: the product of every override's values, as its ``split_arguments``)."""
    if not multirun:
        return [overrides]
    parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
    per_key = []
    for o in parser.parse_overrides(overrides):
        key = o.get_key_element()
        values = o.sweep_string_iterator() if o.is_sweep_override() else [o.get_value_element_as_str()]
        per_key.append([f"{key}={v}" for v in values])
    return [list(job) for job in itertools.product(*per_key)]


def compose_job(config_name: str, overrides: list[str], multirun: bool, num: int, runs: bool):
    """The job's config as Hydra hands it to the script: composed, its Hydra runtime config set (the job's folder is
    ``hydra.run.dir``, or ``hydra.sweep.dir/subdir`` of job ``num``), the ``hydra`` node removed. A sweep that runs
    resolves ``hydra.launcher`` and ``hydra.sweeper`` first, as Hydra does to build them (``hydra/launcher=slurm``
    takes its task counts from ``trainer.devices``)."""
    cfg = compose(config_name, overrides=overrides, return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.mode = RunMode.MULTIRUN if multirun else RunMode.RUN
        cfg.hydra.job.num = num
        where = f"{cfg.hydra.sweep.dir}/{cfg.hydra.sweep.subdir}" if multirun else cfg.hydra.run.dir
        cfg.hydra.runtime.output_dir = where
    if multirun and runs:
        OmegaConf.to_container(cfg.hydra.launcher, resolve=True, throw_on_missing=True)
        OmegaConf.to_container(cfg.hydra.sweeper, resolve=True, throw_on_missing=True)
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def preflight(config_name: str, cfg) -> None:
    """The checks each script makes before any work (train(), evaluate(), run_predict()), and the config resolved."""
    if config_name == "train":
        check_moved_keys(cfg)
        run_dir_of(cfg)
        check_launch(cfg.trainer)
        check_from_checkpoint(cfg)
    elif config_name == "eval":
        check_moved_keys(cfg)
        assert cfg.split in ("test", "val"), f"split must be test or val, got {cfg.split!r}"  # as evaluate()
    else:
        check_predict_args(topk=cfg.topk, batch_size=cfg.batch_size, num_workers=cfg.num_workers)
        check_predict_args(seq_len=cfg.seq_len, max_tokens=cfg.max_tokens)
    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)


def run_command(command: str) -> int:
    """Compose every job of every filled form of ``command`` and run its pre-flight; the number of jobs."""
    register_configs()
    left = sorted(set(re.findall(r"<[^<>]*>", " ".join(fill(command)))))
    assert not left, f"placeholders {left} are not in PLACEHOLDERS: add them there, or the command to SKIP"
    n = 0
    try:
        with initialize_config_dir(str(CONF), version_base="1.3"):
            for filled in fill(command):
                config_name, overrides, multirun, runs = parse(filled)
                for num, job in enumerate(jobs(overrides, multirun)):
                    cfg = compose_job(config_name, job, multirun, num, runs)
                    if runs:
                        preflight(config_name, cfg)
                    n += 1
    finally:
        HydraConfig.instance().cfg = None  # (no Hydra runtime config left for the next test)
    return n


def messages(e: BaseException) -> str:
    """The error and its causes, as Hydra prints them."""
    out = []
    while e is not None:
        out.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    return "\n".join(out)


# ------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("command", list(COMMANDS), ids=case_ids())
def test_doc_command_composes(command):
    where = ", ".join(COMMANDS[command])
    if command in SKIP:
        pytest.skip(SKIP[command])
    if command in EXPECTED_ERRORS:
        with pytest.raises(Exception) as err:
            run_command(command)
        assert EXPECTED_ERRORS[command] in messages(err.value), f"{where}: {command}\n{messages(err.value)}"
        return
    try:
        assert run_command(command) >= 1
    except Exception as e:
        pytest.fail(f"the command at {where} fails:\n  {command}\n{messages(e)}", pytrace=False)


def test_commands_found():
    """The extraction finds the commands of each kind of source (a broken pattern would find none and pass)."""
    where = [w.split(":")[0] for ws in COMMANDS.values() for w in ws]
    docs = ("README.md", "docs/training.md", "docs/data.md", "docs/checkpoints.md", "docs/sweeps.md", "docs/video.md")
    for source in (*docs, "conf/experiment/video.yaml", "train.py"):
        assert source in where, f"no command found in {source}"
    assert len(COMMANDS) >= 50, len(COMMANDS)
    assert any(" -m " in c for c in COMMANDS) and any("--cfg job" in c for c in COMMANDS)


def test_tables_name_doc_commands():
    """Every entry of SKIP, EXPECTED_ERRORS and PLACEHOLDERS is still used: a table does not outlive its command."""
    assert not set(SKIP) - set(COMMANDS), set(SKIP) - set(COMMANDS)
    assert not set(EXPECTED_ERRORS) - set(COMMANDS), set(EXPECTED_ERRORS) - set(COMMANDS)
    text = "\n".join(COMMANDS)
    assert not [k for k in PLACEHOLDERS if k not in text], [k for k in PLACEHOLDERS if k not in text]


def test_extract(tmp_path):
    """Code blocks (continuation lines, trailing comments), inline code across lines, YAML comments, docstrings."""
    md = tmp_path / "a.md"
    md.write_text(
        "Run `python train.py\npos=rope2d_mixed` or `python eval.py ckpt_path=x` (see below).\n\n"
        "```bash\npython train.py -m \\\n  pos=none,ape   # two runs\n```\n\n| a | `python predict.py input=x` |\n"
    )
    assert extract(md) == [
        (1, "python train.py pos=rope2d_mixed"),
        (2, "python eval.py ckpt_path=x"),
        (5, "python train.py -m pos=none,ape"),
        (9, "python predict.py input=x"),
    ]
    yaml = tmp_path / "a.yaml"
    yaml.write_text("# text.   python train.py a=1   # note\nkey: 1   # `python eval.py b=2`, so\n")
    assert extract(yaml) == [(1, "python train.py a=1"), (2, "python eval.py b=2")]
    py = tmp_path / "a.py"
    py.write_text('"""Train: ``python train.py [group=option ...]``.\n\n    python train.py x=1    # one\n"""\n')
    assert extract(py) == [(1, "python train.py [group=option ...]"), (3, "python train.py x=1")]


def test_fill_and_parse():
    assert fill("python train.py experiment=study_<budget> pos=<scheme>") == [
        f"python train.py experiment=study_{b} pos=rel2d_factored" for b in BUDGETS
    ]
    assert parse("python train.py -m 'pos=glob(*)' [data.img_size=48] --cfg job") == (
        "train",
        ["pos=glob(*)", "data.img_size=48"],
        True,
        False,
    )
