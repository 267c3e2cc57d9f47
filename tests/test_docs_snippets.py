"""Every Python example the docs give runs as written: the ```python blocks of README.md and docs/*.md.

One case per file (its id: the file): its blocks run in order in one namespace, as a reader
runs them in one session (docs/video.md's later blocks use the first one's imports; docs/models.md's last one uses
``vitrel`` imported above). Each runs in a fresh working directory holding the files a user would have there
(:func:`user_files`: a ``train.py``-style checkpoint, its export, timm weights); a path the docs write as a
placeholder is replaced by :data:`PLACEHOLDERS`, a download by its offline form. A block that cannot run here is
in :data:`SKIP` and only compiled. Where a comment states a result (``# [2, 10]``), :data:`CLAIMS` checks it.
Statements run one at a time, compiled with the doc's file name and line numbers, so a failure points at the line.
SKIP and CLAIMS name a block or statement by the text the docs write (not its line, which prose above it moves): a key
that names no block or statement of its file, or more than one, is an error that names it.
"""

from __future__ import annotations

import ast
import re
import traceback
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

import vitrel
from vitrel.models.checkpoint import save_pretrained
from vitrel.train.module import ClassifierModule

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["README.md", "docs/*.md", "notebooks/README.md"]
RUN = "outputs/train/runs/2026-01-01_12-00-00"  # a run folder of train.py, as the fixture writes it
VIDEO_RUN = "outputs/train/runs/2026-01-01_13-00-00"  # an image run whose scheme has a 3-D counterpart
FMNIST_RUN = "outputs/train/runs/2026-01-01_14-00-00"  # model=vitrel_vit_tiny_patch4_32 on Fashion-MNIST (1 x 28 x 28)

# (file, text as the docs write it) -> what runs here. Paths the docs write literally (`export_dir`, `last.ckpt`,
# `export/model.safetensors`, `weights.safetensors`) are made by user_files() in the working directory instead.
PLACEHOLDERS: dict[tuple[str, str], str] = {
    # a run of train.py: vitrel_vit_tiny_patch4_32 with rel2d_factored (docs/models.md's checkpoint_path= line names it)
    ("README.md", "outputs/train/runs/<run>"): RUN,
    ("docs/dense.md", "outputs/train/runs/<run>"): RUN,  # its trained weights as a features_only backbone
    ("docs/checkpoints.md", "outputs/train/runs/<run>"): FMNIST_RUN,  # Lightning's load_from_checkpoint of a run
    # video.md inflates its image run (train.py's default ViT, rope2d_mixed) into a rope3d_mixed video ViT
    ("docs/video.md", "outputs/train/runs/<run>"): VIDEO_RUN,
    # the last.ckpt of a model=vitrel_vit_tiny_patch4_32 run on the default data, as that line says
    ("docs/models.md", 'checkpoint_path="last.ckpt", pos="rel2d_factored"'): (
        f'checkpoint_path="{FMNIST_RUN}/checkpoints/last.ckpt", pos="rel2d_factored"'
    ),
    # downloads from the Hugging Face hub (no network here): the same architectures, timm's random weights
    ("docs/models.md", 'from_timm("swin_tiny_patch4_window7_224.ms_in1k")'): (
        'from_timm("swin_tiny_patch4_window7_224.ms_in1k", pretrained=False)'
    ),
    ("docs/models.md", '"vit_small_patch16_224.augreg_in21k_ft_in1k", pos='): (
        '"vit_small_patch16_224.augreg_in21k_ft_in1k", pretrained=False, pos='
    ),
    ("docs/video.md", 'create_model("vit_small_patch16_224", pretrained=True)'): (
        'create_model("vit_small_patch16_224", pretrained=False)'
    ),
}

# (file, text only one of its blocks contains) -> why that block is only compiled
SKIP: dict[tuple[str, str], str] = {
    ("docs/schemes.md", '@register_pos("gauss2d")'): (
        "registers a scheme in the global registry: tests/pos/test_register.py runs it, then restores it"
    ),
    ("docs/schemes.md", '@register_pos("rope_random")'): (
        "registers a scheme in the global registry: tests/pos/test_add_scheme.py runs it, then restores it"
    ),
    ("docs/gpu.md", '@register_kernel("chunked")'): (
        "registers a kernel in the global registry: tests/kernels/test_add_kernel.py runs it, then restores it"
    ),
}

# (file, a statement of its blocks as written, less its comment) -> (the result its comment states, as written; that
# result here). The statement's value (an expression's, or the name it assigns) is compared: a tensor by its shape,
# `...` in a list skips elements. The statement must be a top-level one of exactly one block of the file.
CLAIMS: dict[tuple[str, str], tuple[str, object]] = {
    ("docs/schemes.md", "logits = attn.logits(x, grid=(14, 14))"): ("[B, heads, N, N]", [2, 6, 197, 197]),
    ("docs/schemes.md", "bias = attn.bias((14, 14))"): ("[heads, N, N]", [6, 197, 197]),
    ("docs/schemes.md", "y = blk(torch.randn(1, packed.num_tokens, 192), grid=packed)"): (
        "[1, 134, 192]",
        [1, 134, 192],
    ),
    ("docs/packing.md", "logits = model(batch)"): ("[2, 10]", [2, 10]),
    ("docs/checkpoints.md", "logits = torch.cat(trainer.predict(module, loader))"): ("[8, 10]", [8, 10]),
    ("docs/swin.md", "logits = m(images)"): ("[3, 10]", [3, 10]),
    ("docs/video.md", "m(torch.randn(2, 1, 8, 32, 32)).shape"): ("[2, 2]", [2, 2]),
    ("docs/video.md", "m.forward_intermediates(torch.randn(2, 1, 16, 32, 32), indices=1)[1][0].shape"): (
        "[2, 192, 16, 8, 8]",
        [2, 192, 16, 8, 8],
    ),
    ("docs/video.md", "s.forward_features(torch.randn(2, 1, 8, 32, 32)).shape"): (
        "[2, 8, 2, 2, 768]",
        [2, 8, 2, 2, 768],
    ),
    ("docs/video.md", "[o.shape for o in f(torch.randn(1, 3, 8, 128, 128))]"): (
        "[1, 96, 4, 32, 32], ..., [1, 768, 4, 4, 4]",
        [[1, 96, 4, 32, 32], ..., [1, 768, 4, 4, 4]],
    ),
    ("docs/video.md", "f.feature_info.channels(), f.feature_info.reduction()"): (
        "[96, 192, 384, 768], [4, 8, 16, 32]",
        [[96, 192, 384, 768], [4, 8, 16, 32]],
    ),
    ("docs/video.md", 'f.feature_info.get("time_reduction")'): ("[2, 2, 2, 2]", [2, 2, 2, 2]),
    ("docs/data.md", "sizes = (dm.num_classes, dm.in_chans, dm.img_size)"): ("[4, 1, 32]", [4, 1, 32]),
    ("docs/training.md", "ema.module.eval()(x).shape"): ("[8, 10]", [8, 10]),
    ("docs/data.md", "batch = next(iter(MyDataModule().train_dataloader()))"): (
        "images [64, 1, 16, 24], targets [64]",
        [[64, 1, 16, 24], [64]],
    ),
}

# a package the dev extras install (pyproject.toml) that a file's examples import
OPTIONAL = {"docs/dense.md": "segmentation_models_pytorch"}


# ------------------------------------------------------------------------------------------- extraction
def blocks(path: Path) -> list[tuple[int, str]]:
    """``(line of the first code line, code)`` of every ```python block of ``path``."""
    lines = path.read_text().splitlines()
    out, start = [], None
    for i, s in enumerate(lines):
        if start is None and s.strip() == "```python":
            start = i + 1
        elif start is not None and s.strip().startswith("```"):
            out.append((start + 1, "\n".join(lines[start:i]) + "\n"))
            start = None
    return out


def doc_files() -> dict[str, list[tuple[int, str]]]:
    files = sorted({p for pattern in SOURCES for p in ROOT.glob(pattern) if p.is_file()})
    return {str(p.relative_to(ROOT)): b for p in files if (b := blocks(p))}


FILES = doc_files()


def skipped_block(file: str, text: str) -> int:
    """The first code line of the one block of ``file`` that contains ``text`` (a :data:`SKIP` key); an error
    naming the key where no block or several do."""
    found = [line for line, code in FILES.get(file, []) if text in code]
    if len(found) != 1:
        raise LookupError(f"SKIP key ({file!r}, {text!r}) is in {len(found)} blocks of {file} (lines {found}), not 1")
    return found[0]


def claimed_statement(file: str, text: str, said: str) -> int:
    """The line of the one top-level statement of ``file``'s blocks written as ``text`` (a :data:`CLAIMS` key), whose
    comment still says ``said``; an error naming the key where no statement or several match, or it says otherwise."""
    found = []
    for line, code in FILES.get(file, []):
        for stmt in ast.parse(code).body:
            if ast.get_source_segment(code, stmt) == text:
                found.append((line + stmt.lineno - 1, line + stmt.end_lineno - 1))
    if len(found) != 1:
        raise LookupError(f"CLAIMS key ({file!r}, {text!r}) is {len(found)} statements of {file}, not 1: {found}")
    start, end = found[0]
    written = (ROOT / file).read_text().splitlines()[start - 1 : end]
    if not any(re.search(r"#.*" + re.escape(said), s) for s in written):
        raise LookupError(f"{file}:{start} ({text}) no longer says {said}: {' '.join(s.strip() for s in written)}")
    return start


def filled(file: str, code: str) -> str:
    for (where, text), value in PLACEHOLDERS.items():
        if where == file:
            code = code.replace(text, value)
    return code


def shape_of(value):
    """A result as the docs write it: a tensor's or size's shape as a list, tuples and lists as lists."""
    if isinstance(value, torch.Tensor):
        return list(value.shape)
    if isinstance(value, (torch.Size, tuple, list)):
        return [shape_of(v) for v in value]
    return value


def matches(value, expected) -> bool:
    """``value`` is ``expected``; ``...`` in an expected list stands for any elements (at least zero)."""
    if isinstance(expected, list) and ... in expected:
        i = expected.index(...)
        head, tail = expected[:i], expected[i + 1 :]
        return (
            isinstance(value, list)
            and len(value) >= len(head) + len(tail)
            and matches(value[: len(head)], head)
            and matches(value[len(value) - len(tail) :], tail)
        )
    return value == expected


def run_block(file: str, line: int, code: str, namespace: dict) -> dict[int, object]:
    """Run ``code`` (from ``file`` at ``line``) statement by statement in ``namespace``; the value of each expression
    statement and single-name assignment by its line in the file."""
    tree = ast.parse(code, filename=file)
    ast.increment_lineno(tree, line - 1)
    values: dict[int, object] = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Expr):
            values[stmt.lineno] = eval(compile(ast.Expression(stmt.value), file, "eval"), namespace)
            continue
        exec(compile(ast.Module([stmt], type_ignores=[]), file, "exec"), namespace)
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            values[stmt.lineno] = namespace[stmt.targets[0].id]
    return values


# ------------------------------------------------------------------------------------------- the user's files
def train_run(run: Path, pos: str, in_chans: int = 3, img_size: int = 32, **kw) -> Path:
    """``run/checkpoints/last.ckpt`` in the format ``train.py`` writes (Lightning's checkpoint of a
    :class:`ClassifierModule`: weights, ``vitrel_cfg``, the data config), of vitrel_vit_tiny_patch4_32 at 3 x 32 x 32
    (``in_chans`` x ``img_size``: 1 x 28 as a ``train.py`` run on its default data, Fashion-MNIST) after one step of
    a plain ``Trainer.fit``."""
    torch.manual_seed(0)
    model = vitrel.create_model(
        "vitrel_vit_tiny_patch4_32", pos=pos, num_classes=10, in_chans=in_chans, img_size=img_size, **kw
    )
    data_config = dict(input_size=[in_chans, img_size, img_size], mean=[0.5] * in_chans, std=[0.25] * in_chans)
    module = ClassifierModule(model, data_config={**data_config, "crop_pct": 1.0, "crop_mode": "center"})
    data = DataLoader(TensorDataset(torch.randn(4, in_chans, img_size, img_size), torch.arange(4)), batch_size=4)
    trainer = L.Trainer(
        max_steps=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=run,
    )
    with warnings.catch_warnings():  # Lightning's notices on a run without validation data
        warnings.simplefilter("ignore")
        trainer.fit(module, data)
    ckpt = run / "checkpoints" / "last.ckpt"
    trainer.save_checkpoint(ckpt)
    return ckpt


@pytest.fixture(scope="module")
def user_files(tmp_path_factory) -> Path:
    """A folder with what a user has where the docs run: two train.py runs, ``last.ckpt`` and ``export_dir`` (its
    ``python -m vitrel.export``), ``export/`` (save_pretrained of a video ViT), timm weights ``weights.safetensors``."""
    import shutil

    import timm

    from vitrel.export import main as export_main

    root = tmp_path_factory.mktemp("user")
    ckpt = train_run(root / RUN, "rel2d_factored")
    # built as conf/model/vit_tiny_fmnist.yaml (train.py's default model), not at the registered name's sizes
    train_run(root / VIDEO_RUN, "rope2d_mixed", embed_dim=64, depth=4, num_heads=4, mlp_ratio=2.0, global_pool="avg")
    shutil.copy(ckpt, root / "last.ckpt")
    # a model=vitrel_vit_tiny_patch4_32 run on train.py's default data (docs/models.md's checkpoint_path= line)
    train_run(root / FMNIST_RUN, "rel2d_factored", in_chans=1, img_size=28)
    assert export_main([str(ckpt), str(root / "export_dir")]) == 0
    save_pretrained(vitrel.create_model("vitrel_vit_video_tiny_patch4_32"), root / "export")
    timm_model = timm.create_model("vit_small_patch16_rope_mixed_224")  # a file from the hub, offline
    save_file(timm_model.state_dict(), root / "weights.safetensors")
    return root


@pytest.fixture
def workdir(user_files, tmp_path, monkeypatch) -> Path:
    """A fresh working directory with the user's files (linked), no network, CPU only."""
    for p in user_files.iterdir():
        (tmp_path / p.name).symlink_to(p)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    return tmp_path


# ------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("file", list(FILES))
def test_doc_snippets_run(file, workdir):
    if file in OPTIONAL:
        pytest.importorskip(OPTIONAL[file])
    skip = {skipped_block(f, text) for f, text in SKIP if f == file}
    claims = {
        claimed_statement(f, text, said): (said, expected)
        for (f, text), (said, expected) in CLAIMS.items()
        if f == file
    }
    namespace: dict = {"__name__": "__docs__"}
    values: dict[int, object] = {}
    for line, code in FILES[file]:
        code = filled(file, code)
        if line in skip:
            compile(code, file, "exec")
            continue
        try:
            values.update(run_block(file, line, code, namespace))
        except Exception as e:
            at = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == file]
            pytest.fail(f"the example at {file}:{at[-1] if at else line} fails: {type(e).__name__}: {e}", pytrace=False)
    for n, (said, expected) in claims.items():
        assert n in values, f"{file}:{n}: the claimed statement did not run (a skipped block?)"
        got = shape_of(values[n])
        assert matches(got, expected), f"{file}:{n}: the docs say {said}, it gives {got}"


def test_snippets_found():
    """The extraction finds the blocks (a broken pattern would find none and pass)."""
    assert sum(len(b) for b in FILES.values()) >= 15
    for f in ("README.md", "docs/video.md", "docs/packing.md", "docs/training.md", "docs/data.md"):
        assert f in FILES, f


def test_tables_name_doc_snippets():
    """Every entry of PLACEHOLDERS, SKIP, CLAIMS and OPTIONAL is still used: a table does not outlive its snippet.
    A SKIP or CLAIMS key names exactly one block or statement, and a claim's comment still says what it states."""
    assert not set(OPTIONAL) - set(FILES), set(OPTIONAL) - set(FILES)
    for file, text in PLACEHOLDERS:
        assert any(text in code for _, code in FILES.get(file, [])), (file, text)
    errors = []
    for file, text in SKIP:
        try:
            skipped_block(file, text)
        except LookupError as e:
            errors.append(str(e))
    for (file, text), (said, _) in CLAIMS.items():
        try:
            claimed_statement(file, text, said)
        except LookupError as e:
            errors.append(str(e))
    assert not errors, "\n".join(errors)


def test_table_keys_are_exact(monkeypatch):
    """A key that names no block or statement, or several, is an error naming it; so is a changed comment."""
    monkeypatch.setitem(FILES, "x.md", [(3, "a = 1  # [1]\nb = 2\n"), (9, "a = 1  # [2]\nc = 3\n")])
    assert skipped_block("x.md", "c = 3") == 9
    for text in ("a = 1", "d = 4"):
        with pytest.raises(LookupError, match=re.escape(repr(text))):
            skipped_block("x.md", text)
        with pytest.raises(LookupError, match=re.escape(repr(text))):
            claimed_statement("x.md", text, "[1]")
    with pytest.raises(LookupError, match="no longer says"):
        claimed_statement("docs/video.md", 'f.feature_info.get("time_reduction")', "[2, 3]")


def test_matches():
    assert matches([[1, 2], [3], [4, 5]], [[1, 2], ..., [4, 5]])
    assert matches([[1, 2], [4, 5]], [[1, 2], ..., [4, 5]])
    assert not matches([[1, 2], [3]], [[1, 2], ..., [4, 5]])
    assert not matches([2, 10], [2, 11])
    assert shape_of((torch.zeros(2, 3), torch.Size([4]))) == [[2, 3], [4]]
