"""The docs stay readable and agree with the registries.

No prose paragraph in README.md or docs/*.md runs over 150 words (tables, code blocks and headings aside);
docs/gpu.md is a guide of at most 300 lines; its table of attention kernels names exactly the registered ones
(:func:`vitrel.kernels.list_kernels`) and no other place names one that is not; README's scheme table has a row for
every registered scheme (:func:`vitrel.list_pos`) and no other, docs/gpu.md's table of ``auto``'s rules is
:data:`vitrel.kernels.AUTO`, and no file refers to a result by a name it no longer has (bench/results/README.md keeps
the old names); docs/training.md's table of config groups names every file of each conf/ group and no other; a
signature the docs spell out in full is the code's; every relative Markdown link names a file and heading that exist.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

import vitrel
from vitrel.kernels import AUTO, list_kernels

ROOT = Path(__file__).resolve().parents[1]
MAX_WORDS = 150
MAX_GUIDE_LINES = 300
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def paragraphs(text: str) -> list[str]:
    """The prose paragraphs of a Markdown text: blocks of lines between blank lines, outside code fences, with table
    rows, headings and HTML comments left out; each list item is a paragraph of its own."""
    out: list[str] = []
    cur: list[str] = []
    fence = None

    def flush() -> None:
        if cur:
            out.append(" ".join(cur))
            cur.clear()

    for line in text.splitlines():
        s = line.strip()
        if fence is not None:
            if s.startswith(fence):
                fence = None
            continue
        m = re.match(r"(```+|~~~+)", s)
        if m:
            flush()
            fence = m.group(1)
            continue
        if not s or s.startswith(("|", "#", "<!--")):
            flush()
            continue
        if re.match(r"([-*+]|\d+[.)])\s", s):
            flush()
        cur.append(s)
    flush()
    return out


def words(paragraph: str) -> int:
    return len(paragraph.split())


def test_paragraphs_split_outside_code_and_tables():
    long = " ".join(["word"] * (MAX_WORDS + 1))
    text = f"# Title\n\nshort one\n\n```bash\n{long}\n```\n\n| a | {long} |\n|---|---|\n\n- item one\n- {long}\n"
    got = paragraphs(text)
    assert got == ["short one", "- item one", f"- {long}"]
    assert [words(p) for p in got] == [2, 3, MAX_WORDS + 2]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_prose_paragraph_over_150_words(path):
    long = [(words(p), p[:80]) for p in paragraphs(path.read_text()) if words(p) > MAX_WORDS]
    assert not long, f"{path.name}: paragraphs over {MAX_WORDS} words (split or tighten them): {long}"


def test_gpu_guide_is_short():
    n = len((ROOT / "docs" / "gpu.md").read_text().splitlines())
    assert n <= MAX_GUIDE_LINES, (
        f"docs/gpu.md has {n} lines (at most {MAX_GUIDE_LINES}: history goes to bench/journal/)"
    )


#: the first read of the training pages, and its limit in lines (the rest: data.md, checkpoints.md, sweeps.md)
MAX_FIRST_READ_LINES = 400


def test_training_guide_is_a_first_read():
    """docs/training.md stays a first read: topics past the first run get a page of their own, history the journal."""
    n = len((ROOT / "docs" / "training.md").read_text().splitlines())
    assert n <= MAX_FIRST_READ_LINES, f"docs/training.md has {n} lines (at most {MAX_FIRST_READ_LINES})"


# --- lists of kernels and schemes ------------------------------------------------------------------------------


def pipe_list(region: str) -> set[str]:
    """The names of a list written ``a`` | ``b`` (description) | ``c``: the last double-backticked name before the
    first ``|``, then the first one after each."""
    pieces = region.split("|")
    if len(pieces) < 2:
        return set()
    names = re.findall(r"``(\w+)``", pieces[0])[-1:]
    for piece in pieces[1:]:
        names += re.findall(r"``(\w+)``", piece)[:1]
    return set(names)


def arg_doc(path: Path, arg: str) -> str:
    """The text documenting ``arg`` in the docstring of ``path``'s first class that documents it: its line and the
    more indented lines after it."""
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith(f"{arg}:"))
    indent = len(lines[start]) - len(lines[start].lstrip())
    end = start + 1
    while end < len(lines) and len(lines[end]) - len(lines[end].lstrip()) > indent and lines[end].strip():
        end += 1
    return "\n".join(lines[start:end])


def table_rows(text: str, header: str) -> list[list[str]]:
    """The cells of the rows of the Markdown table whose header line starts with ``header``."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(header)), None)
    assert start is not None, f"no table whose header starts with {header!r}"
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def first_cell_names(rows: list[list[str]]) -> set[str]:
    return {name for row in rows for name in re.findall(r"`(\w+)`", row[0])}


def read(rel: str) -> str:
    return (ROOT / rel).read_text()


#: the place that lists every kernel: a new kernel is one file, one test and one row here
KERNEL_TABLE = "docs/gpu.md (table)"
#: every place that names kernels, and how to read the names it names; only KERNEL_TABLE must name them all
KERNEL_LISTS = {
    KERNEL_TABLE: lambda: first_cell_names(table_rows(read("docs/gpu.md"), "| `attn_impl` |")),
    "docs/gpu.md (sections)": lambda: set(re.findall(r"^### `(\w+)`$", read("docs/gpu.md"), flags=re.M)),
    "README.md": lambda: first_cell_names(table_rows(read("README.md"), "| `attn_impl` |")),
}


@pytest.mark.parametrize("place", list(KERNEL_LISTS))
def test_kernel_lists_name_the_registered_kernels(place):
    named = KERNEL_LISTS[place]() - {"auto"}
    registered = set(list_kernels())
    stale, missing = named - registered, registered - named if place == KERNEL_TABLE else set()
    assert not stale and not missing, (
        f"{place} lists the kernels {sorted(named)}; registered: {sorted(registered)} "
        f"(missing {sorted(missing)}, not registered {sorted(stale)})"
    )


def test_no_docstring_lists_the_kernels():
    """The code's docstrings point at :func:`vitrel.kernels.list_kernels` and docs/gpu.md instead of listing the
    kernels: a list there was one more file a new kernel had to edit (seven places in five files did)."""
    for path in ["vitrel/models/vit.py", "vitrel/models/swin.py", "vitrel/layers/attention.py"]:
        assert len(pipe_list(arg_doc(ROOT / path, "attn_impl"))) < 2, path
    assert len(pipe_list(read("vitrel/kernels/__init__.py").split('"""')[1])) < 2


def test_readme_scheme_table_has_a_row_per_registered_scheme():
    rows = table_rows((ROOT / "README.md").read_text(), "| `pos=` |")
    named = first_cell_names(rows)
    registered = set(vitrel.list_pos())
    assert named == registered, (
        f"README's scheme table: missing {sorted(registered - named)}, not registered {sorted(named - registered)}"
    )


def test_gpu_guide_auto_table_is_the_auto_rules():
    rows = table_rows((ROOT / "docs" / "gpu.md").read_text(), "| device | schemes | from N | kernel |")
    documented: dict[str, list] = {}
    for device, schemes, fewest, kernel in rows:
        documented.setdefault(device, []).append(
            (frozenset(re.findall(r"`(\w+)`", schemes)), int(fewest), kernel.strip("`"))
        )
    rules = {device: [(r.schemes, r.fewest, r.kernel) for r in rs] for device, rs in AUTO.items()}
    assert documented == rules, f"docs/gpu.md's auto table {documented} is not vitrel.kernels.AUTO {rules}"
    # the guide says every rule is for training only
    assert all(r.training for rs in AUTO.values() for r in rs), (
        "an AUTO rule applies in evaluation: say so in docs/gpu.md"
    )


# --- result files -----------------------------------------------------------------------------------------------


def renamed_results() -> dict[str, str]:
    """Old name -> new name, from bench/results/README.md's rows ``| `new` (was `old`) | ...``."""
    text = (ROOT / "bench" / "results" / "README.md").read_text()
    return {old: new for new, old in re.findall(r"^\| `([^`]+)` \(was `([^`]+)`\)", text, flags=re.M)}


def test_results_index_lists_every_result_file():
    text = (ROOT / "bench" / "results" / "README.md").read_text()
    indexed = set(re.findall(r"^\| `([^`]+)`", text, flags=re.M))
    files = {p.name for p in (ROOT / "bench" / "results").iterdir() if p.is_file() and p.name != "README.md"}
    assert indexed == files, f"not indexed: {sorted(files - indexed)}; indexed but absent: {sorted(indexed - files)}"


def tracked_text_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    skip = {".png", ".safetensors", ".ckpt", ".pt", ".pth", ".bin", ".whl"}
    return [ROOT / f for f in out.splitlines() if Path(f).suffix not in skip and (ROOT / f).is_file()]


def recorded_output(before: str) -> bool:
    """Whether a name follows ``--out`` or a directory other than bench/results/: a recorded command's output
    path on the machine that ran it (``--out /root/out/gpu_h100.md``), which keeps the name it had."""
    return before.endswith(("--out ", "--figure ")) or (before.endswith("/") and not before.endswith("bench/results/"))


def test_no_reference_to_a_renamed_result():
    old = renamed_results()
    assert old, "bench/results/README.md lists no renamed file"
    pattern = re.compile(r"(?<![\w.-])(" + "|".join(re.escape(name) for name in old) + r")")
    index = ROOT / "bench" / "results" / "README.md"
    stale = []
    for path in tracked_text_files():
        if path == index:
            continue
        text = path.read_text(errors="ignore")
        for m in pattern.finditer(text):
            if not recorded_output(text[: m.start()]):
                stale.append(f"{path.relative_to(ROOT)}: {m.group(1)} (now {old[m.group(1)]})")
    assert not stale, "references to results by their old names: " + "; ".join(stale[:20])


def test_referenced_results_exist():
    missing = []
    for path in tracked_text_files():
        text = path.read_text(errors="ignore")
        for m in re.finditer(r"bench/results/([\w.-]+\.(?:md|csv|json|png|safetensors))\b", text):
            if not recorded_output(text[: m.start()]) and not (ROOT / "bench" / "results" / m.group(1)).exists():
                missing.append(f"{path.relative_to(ROOT)}: {m.group(1)}")
    assert not missing, "references to result files that do not exist: " + "; ".join(missing[:20])


def brace_names(cell: str) -> set[str]:
    """The names a table cell lists in backticks, with shell-style braces expanded (`rel2d_{full,factored}`)."""
    out: set[str] = set()
    for token in re.findall(r"`([\w{},]+)`", cell):
        names = [""]
        for lit, alts in re.findall(r"([^{]*)(?:\{([^}]*)\})?", token):
            names = [n + lit + a for n in names for a in (alts.split(",") if alts else [""])]
        out.update(names)
    return out


def test_training_guide_config_groups_table_lists_every_option():
    """docs/training.md's table of config groups names exactly the files of each group in conf/ (an option it names
    that does not exist fails when composed; one it leaves out is never found)."""
    rows = table_rows(read("docs/training.md"), "| group | options | what |")
    listed = {row[0].strip("`"): brace_names(row[1]) for row in rows}
    groups = {p.parent.relative_to(ROOT / "conf").as_posix() for p in (ROOT / "conf").glob("*/**/*.yaml")}
    # Hydra's own settings, the folders, the data x scheme and experiment x data specialisations
    groups -= {"hydra", "paths", "data_pos", "experiment_data"}
    assert groups <= set(listed), f"groups missing from the table: {sorted(groups - set(listed))}"
    for group in sorted(groups - {"pos"}):  # (pos: the README's table, one file per scheme; test_pos_configs_...)
        files = {p.stem for p in (ROOT / "conf" / group).glob("*.yaml")}
        extra = listed[group] - files - {"basic"}  # (hydra/launcher: Hydra's own launcher)
        assert files <= listed[group] and not extra, (
            f"docs/training.md lists for {group}: missing {sorted(files - listed[group])}, not in conf/{group}/: "
            f"{sorted(extra)}"
        )


def test_pos_configs_are_the_package_schemes():
    """conf/pos/ holds one file per scheme vitrel/pos/schemes/ registers (the training tests train each file's
    scheme; a scheme without one is not found by ``train.py pos=<name>``), and docs/training.md points to them."""
    from vitrel.pos.registry import get_pos_class, list_pos

    files = {p.stem for p in (ROOT / "conf" / "pos").glob("*.yaml")}
    package = {n for n in list_pos() if get_pos_class(n).__module__.startswith("vitrel.pos.schemes.")}
    assert files == package, f"conf/pos/ lacks {sorted(package - files)}, has no scheme for {sorted(files - package)}"
    rows = table_rows(read("docs/training.md"), "| group | options | what |")
    assert any(row[0] == "`pos`" and "vitrel.list_pos()" in row[1] for row in rows)


def test_pos_configs_name_the_file_of_their_scheme():
    """Each conf/pos file's heading comment names the module that registers its scheme (``none.yaml`` said
    ``vitrel/pos/base.py``, ``spiral_rope.yaml`` ``rope.py``; two named none)."""
    from vitrel.pos.registry import get_pos_class

    wrong = {}
    for path in sorted((ROOT / "conf" / "pos").glob("*.yaml")):
        lines = path.read_text(encoding="utf-8").splitlines()
        heading = " ".join(line for line in lines[: next(i for i, x in enumerate(lines) if not x.startswith("#"))])
        named = re.findall(r"vitrel/[\w/]+\.py", heading)
        module = get_pos_class(path.stem).__module__.replace(".", "/") + ".py"
        registers = f'register_pos("{path.stem}")' in (ROOT / module).read_text(encoding="utf-8")
        if named != [module] or not registers:
            wrong[path.name] = (named, module)
    assert not wrong, f"the heading names another file than the scheme's (named, registered in): {wrong}"


def plain_signature(obj) -> str:
    """``obj``'s signature as the docs write it: no annotations, ``self`` left out, strings in double quotes."""
    import inspect

    params = [p.replace(annotation=inspect.Parameter.empty) for p in inspect.signature(obj).parameters.values()]
    params = [p for p in params if p.name != "self"]
    text = str(inspect.Signature(params))
    return re.sub(r"'([^']*)'", r'"\1"', text)


def documented_signatures() -> list[tuple[str, str, object]]:
    from vitrel.models.swin import SwinTransformer
    from vitrel.train.module import ClassifierModule

    # (doc, the name the doc writes before the signature, the code it documents)
    return [
        ("docs/training.md", "vitrel.train.module.ClassifierModule", ClassifierModule),
        ("docs/export.md", "forward_intermediates", SwinTransformer.forward_intermediates),
        ("docs/export.md", "prune_intermediate_layers", SwinTransformer.prune_intermediate_layers),
    ]


@pytest.mark.parametrize("doc,name,obj", documented_signatures(), ids=lambda v: v if isinstance(v, str) else "")
def test_documented_signatures_match_the_code(doc, name, obj):
    """A signature the docs spell out in full (in inline code: ``name(arg, arg=default, ...)``) is the code's."""
    text = " ".join(read(doc).split())
    m = re.search(r"`" + re.escape(name) + r"(\([^`]*\))`", text)
    assert m, f"{doc}: no `{name}(...)` signature"
    assert m.group(1) == plain_signature(obj), f"{doc}: {name}{m.group(1)} is not the code's {plain_signature(obj)}"


#: (guide, experiment, the guide's words for its training samples and batches an epoch)
RECIPE_COUNTS = [
    ("docs/video.md", "video", "{n:,} clips, {b} batches of 64 an epoch"),
    ("docs/data.md", "fmnist_naflex", "4 epochs of {b} steps ({n:,} training images"),
]


@pytest.mark.parametrize("doc,experiment,words", RECIPE_COUNTS, ids=[e for _, e, _ in RECIPE_COUNTS])
def test_guides_state_the_recipes_training_samples(doc, experiment, words):
    """The counts of a recipe's training samples and batches a guide states are the recipe's (its ``val_fraction``
    holds out part of the training set: the run trains on fewer)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.utils import instantiate

    import vitrel.config  # noqa: F401  (the schemas conf/ names)

    GlobalHydra.instance().clear()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[f"experiment={experiment}"])
    GlobalHydra.instance().clear()
    dm = instantiate(cfg.data)
    dm.setup("fit")
    n, b = len(dm.raw_dataset("train")), len(dm.train_dataloader())
    text = " ".join(read(doc).split())
    assert words.format(n=n, b=b) in text, (n, b)


LINKED_DOCS = [*DOCS, ROOT / "notebooks" / "README.md", ROOT / "bench" / "results" / "README.md"]


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors of a Markdown text's headings (outside code fences): lower case, punctuation but ``-`` and
    ``_`` dropped, spaces as ``-``."""
    out, fence = set(), False
    for line in text.splitlines():
        if re.match(r"\s*(```|~~~)", line):
            fence = not fence
        elif not fence and line.startswith("#"):
            out.add(re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-"))
    return out


@pytest.mark.parametrize("path", LINKED_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_markdown_links_name_files_and_anchors_that_exist(path):
    """Every relative link ``[...](file#anchor)`` of the guides names a file that exists and, in a Markdown file, a
    heading it has."""
    bad = []
    for link in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if re.match(r"[a-z]+:", link):
            continue
        file, _, anchor = link.partition("#")
        target = (path.parent / file) if file else path
        if not target.exists():
            bad.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in heading_anchors(target.read_text()):
            bad.append(f"{link}: no such heading")
    assert not bad, f"{path.relative_to(ROOT)}: {bad}"
