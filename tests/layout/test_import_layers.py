"""The package's import layers: no cycle among module-level imports, and no layer importing one above it.

Layers, lowest first: ``vitrel.layout`` (grids, token layouts, windows) <- ``vitrel.pos`` (schemes) and
``vitrel.kernels`` <- ``vitrel.layers`` <- ``vitrel.models`` <- ``vitrel.train``. Read from the source with ``ast``
(nothing is imported): an import inside a function or under ``if TYPE_CHECKING:`` runs later or never, so it is no
edge of the runtime graph (cycles); one under ``if TYPE_CHECKING:`` is an edge of the layers' graph (a type named
is a dependency too). A package that imports its modules in a loop over ``pkgutil.iter_modules`` (``vitrel.pos``,
``vitrel.kernels``) has an edge to each of them (to the public ones where the loop skips names starting with
``_``). Importing ``a.b.c`` runs ``a/b/__init__.py`` first, so it is also an edge to each package above ``c``
(except ``vitrel`` itself, whose ``__init__`` is the public facade, and the importer's own packages)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "vitrel"

#: each layer and the layers it must not import
FORBIDDEN = {
    "vitrel.layout": ("vitrel.pos", "vitrel.kernels", "vitrel.layers", "vitrel.models", "vitrel.train"),
    "vitrel.pos": ("vitrel.kernels", "vitrel.layers", "vitrel.models", "vitrel.train"),
}


def module_names(root: Path = ROOT) -> dict[str, Path]:
    """``{dotted name: file}`` of every module of the package (a package by its ``__init__.py``)."""
    out = {}
    for f in root.rglob("*.py"):
        parts = f.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _top_level_imports(body: list[ast.stmt], type_checking: bool = False):
    """Import statements that run when the module is imported (module level, ``try`` / ``if`` bodies included),
    and with ``type_checking`` those under ``if TYPE_CHECKING:``."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If):
            if type_checking or not _is_type_checking(node.test):
                yield from _top_level_imports(node.body, type_checking)
            yield from _top_level_imports(node.orelse, type_checking)
        elif isinstance(node, ast.Try):
            for part in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _top_level_imports(part, type_checking)


def _imports_all_modules(body: list[ast.stmt]) -> str | None:
    """``"all"`` or ``"public"`` when the module imports its package's modules in a ``pkgutil.iter_modules`` loop."""
    for node in body:
        if isinstance(node, ast.For) and "iter_modules" in ast.unparse(node.iter):
            return "public" if "startswith('_')" in ast.unparse(node) else "all"
    return None


def import_graph(root: Path = ROOT, type_checking: bool = False) -> dict[str, set[str]]:
    """``{module: the vitrel modules its import runs}`` (see the module docstring); with ``type_checking`` also those
    it imports under ``if TYPE_CHECKING:``."""
    mods = module_names(root)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        package = name if is_pkg else name.rpartition(".")[0]
        targets: set[str] = set()
        tree = ast.parse(path.read_text(), str(path))
        loop = _imports_all_modules(tree.body) if is_pkg else None
        if loop is not None:
            children = [m for m in mods if m.rpartition(".")[0] == name]
            targets |= {m for m in children if loop == "all" or not m.rpartition(".")[2].startswith("_")}
        for node in _top_level_imports(tree.body, type_checking):
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: from the importer's package
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                found = [base] + [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
            for t in found:
                parts = t.split(".")
                for i in range(2, len(parts) + 1):  # the module and the packages it runs on the way
                    t_i = ".".join(parts[:i])
                    own = name == t_i or name.startswith(t_i + ".")
                    if t_i in mods and not (own and t_i != t):
                        targets.add(t_i)
        targets.discard(name)
        graph[name] = targets
    return graph


def write_package(root: Path, files: dict[str, str]) -> None:
    """A toy package under ``root``: ``{relative path: source}``."""
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(u: str) -> list[str] | None:
        state[u] = 1
        stack.append(u)
        for v in sorted(graph.get(u, ())):
            if state.get(v) == 1:
                return stack[stack.index(v) :] + [v]
            if v not in state and (c := visit(v)) is not None:
                return c
        stack.pop()
        state[u] = 2
        return None

    for u in sorted(graph):
        if u not in state and (c := visit(u)) is not None:
            return c
    return None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``"a -> b"`` for every import of a layer above the importer's (:data:`FORBIDDEN`)."""
    bad = []
    for name, targets in sorted(graph.items()):
        for layer, above in FORBIDDEN.items():
            if name == layer or name.startswith(layer + "."):
                bad += [f"{name} -> {t}" for t in sorted(targets) for a in above if t == a or t.startswith(a + ".")]
    return bad


def test_graph_sees_the_modules():
    graph = import_graph()
    assert "vitrel.layout.tokens" in graph and "vitrel.layers.attention" in graph
    assert "vitrel.layout.tokens" in graph["vitrel.layers.attention"]
    assert "vitrel.layout" in graph["vitrel.pos.base"]  # the package runs before its module


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_layout_and_pos_import_no_upper_layer():
    """Not at runtime, nor for types alone (``if TYPE_CHECKING:``)."""
    assert upward_imports(import_graph(type_checking=True)) == []


def test_upward_import_for_types_alone_is_found(tmp_path):
    """A toy package whose low layer imports an upper one only under ``if TYPE_CHECKING:``: no runtime edge, but a
    layering one."""
    files = {
        "vitrel/__init__.py": "",
        "vitrel/pos/__init__.py": "",
        "vitrel/kernels/__init__.py": "",
        "vitrel/pos/base.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from vitrel.kernels import k\n",
        "vitrel/kernels/k.py": "import vitrel.pos.base\n",
    }  # fmt: skip
    write_package(tmp_path, files)
    assert upward_imports(import_graph(tmp_path / "vitrel")) == []
    assert find_cycle(import_graph(tmp_path / "vitrel")) is None
    found = upward_imports(import_graph(tmp_path / "vitrel", type_checking=True))
    assert found == ["vitrel.pos.base -> vitrel.kernels", "vitrel.pos.base -> vitrel.kernels.k"]


@pytest.mark.parametrize(
    "files, expect",
    [
        ({"a/__init__.py": "", "a/x.py": "from a.y import f\n", "a/y.py": "import a.x\n"}, "cycle"),
        ({"a/__init__.py": "", "a/x.py": "from a import y\n", "a/y.py": "def f():\n    import a.x\n"}, None),
        (
            {
                "a/__init__.py": "import a.y\n",
                "a/y.py": "",
                "a/x.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a.y\n",
            },
            None,
        ),  # fmt: skip
        # a package importing its modules in a loop
        (
            {
                "a/__init__.py": "",
                "a/x.py": "import a.p\n",
                "a/p/__init__.py": "import pkgutil, importlib\n"
                "for m in pkgutil.iter_modules(__path__):\n    importlib.import_module(m.name)\n",
                "a/p/m.py": "import a.x\n",
            },
            "cycle",
        ),  # fmt: skip
        # importing a.p.m runs a/p/__init__.py, which imports the importer back
        ({"a/__init__.py": "", "a/x.py": "import a.p.m\n", "a/p/__init__.py": "import a.x\n", "a/p/m.py": ""}, "cycle"),
    ],
)
def test_finds_cycles_on_a_toy_package(tmp_path, files, expect):
    write_package(tmp_path, files)
    cycle = find_cycle(import_graph(tmp_path / "a"))
    assert (cycle is not None) == (expect == "cycle"), cycle


def test_moved_modules_keep_their_old_paths():
    """The paths that moved (CHANGELOG.md) still import, as the very module at the new path (the fused kernels' old
    modules: their names), in a fresh interpreter."""
    import subprocess
    import sys

    schemes = sorted(p.stem for p in (ROOT / "pos" / "schemes").glob("*.py") if p.stem != "__init__")
    assert {"rope", "shaw", "fire", "lookhere", "none"} <= set(schemes)
    pairs = [("vitrel.pos.geometry", "vitrel.layout.geometry"), ("vitrel.pos.tokens", "vitrel.layout.tokens")]
    pairs += [(f"vitrel.pos.{s}", f"vitrel.pos.schemes.{s}") for s in schemes]
    code = "import importlib, sys\n" + "".join(
        f"assert importlib.import_module({old!r}) is importlib.import_module({new!r}), {old!r}\n" for old, new in pairs
    )
    code += "from vitrel.pos.tokens import TokenLayout, gather_pairs\nfrom vitrel.pos.rope import Rope2dMixed\n"
    # the fused kernels' modules, now the package vitrel.kernels.triton: their names re-exported
    code += (
        "import vitrel.kernels.triton as new\nfrom vitrel.kernels import triton_bias, triton_rope, triton_atomic\n"
        "assert set(triton_bias.__all__) == set(new.__all__)\n"
        "assert all(getattr(triton_bias, n) is getattr(new, n) for n in new.__all__)\n"
        "assert triton_rope.rope_rotate is new.rope.rope_rotate\n"
        "assert triton_atomic.TritonAtomicKernel is new.attend.TritonAtomicKernel\n"
        "assert triton_atomic.TritonAtomicKernel is vitrel.kernels.get_kernel('triton_atomic')\n"
    )
    first = f"import {pairs[0][0]}\n"  # an old path imported first, before anything else of vitrel
    subprocess.run([sys.executable, "-c", first + code], check=True, cwd=ROOT.parent)


#: the training stack: ``import vitrel`` (models, layers, schemes, kernels) must not run it
TRAINING_STACK = ("lightning", "torchmetrics", "hydra", "omegaconf", "wandb")


def training_stack_imports(root: Path = ROOT, start: str = "vitrel") -> list[str]:
    """``"module -> package"`` for every module-level import of :data:`TRAINING_STACK` by a module that importing
    ``start`` runs (its runtime import graph)."""
    graph, mods = import_graph(root), module_names(root)
    seen, todo = set(), [start]
    while todo:
        u = todo.pop()
        if u not in seen:
            seen.add(u)
            todo += graph.get(u, ())
    bad = []
    for name in sorted(seen):
        for node in _top_level_imports(ast.parse(mods[name].read_text()).body):
            found = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if not getattr(node, "level", 0):  # (a relative import stays in the package)
                bad += [f"{name} -> {t}" for t in found if t.split(".")[0] in TRAINING_STACK]
    return bad


def test_import_vitrel_leaves_the_training_stack_out():
    """A model user (``vitrel.create_model``, ``timm.create_model("vitrel_...")``, an export) does not pay for
    Lightning's, Hydra's or W&B's import (Lightning's alone ~2.8 s): only ``vitrel.train`` / ``vitrel.data`` and
    functions run them."""
    assert training_stack_imports() == []


def test_training_stack_import_is_found(tmp_path):
    files = {
        "vitrel/__init__.py": "from vitrel.models import m\n",
        "vitrel/models/__init__.py": "",
        "vitrel/models/m.py": "from vitrel.data.p import f\ndef g():\n    import hydra\n",
        "vitrel/data/__init__.py": "import lightning.pytorch as L\n",
        "vitrel/data/p.py": "",
    }  # fmt: skip
    write_package(tmp_path, files)
    assert training_stack_imports(tmp_path / "vitrel") == ["vitrel.data -> lightning.pytorch"]
