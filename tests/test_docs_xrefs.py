"""Every Sphinx-style cross-reference in vitrel's docstrings and the docs (``:func:`...```, ``:class:``, ``:meth:``,
``:mod:``, ``:data:``, ``:attr:``, ``:exc:``) names something that exists: a dotted path imports and resolves, a bare
or relative name resolves in its module (or its package), or, for a method or attribute named inside its class's
docstring, is defined in the same file. A function moved or renamed leaves no docstring pointing at its old place."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROLE = re.compile(r":(?:func|class|mod|data|meth|attr|exc):`~?([A-Za-z_][\w.]*)`")
SOURCES = sorted((ROOT / "vitrel").rglob("*.py")) + sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]


def _resolve(dotted: str) -> bool:
    """``dotted`` imports as a module followed by attributes (``vitrel.models.run_record.run_record``)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for name in parts[i:]:
                obj = getattr(obj, name)
        except AttributeError:
            return False
        return True
    return False


def _module_name(path: Path) -> str | None:
    if path.suffix != ".py":
        return None
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _defined_in(text: str, name: str) -> bool:
    """``name`` is a def, a class, or an attribute assigned or annotated in ``text`` (a method or attribute of the
    class whose docstring names it bare)."""
    n = re.escape(name)
    return re.search(rf"(def|class) {n}\b|^\s*{n}\s*[:=]|self\.{n}\s*[:=]", text, re.M) is not None


def unresolved(text: str, module: str | None) -> list[str]:
    """The references of ``text`` (the source of ``module``, or a page of the docs: None) that name nothing."""
    out = []
    for ref in sorted(set(ROLE.findall(text))):
        candidates = [ref]
        if module is not None:
            candidates += [f"{module}.{ref}", f"{module.rsplit('.', 1)[0]}.{ref}"]
        if any(_resolve(c) for c in candidates):
            continue
        if module is not None and _defined_in(text, ref.rsplit(".", 1)[-1]):
            continue
        out.append(ref)
    return out


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_cross_references_name_what_exists(path: Path):
    missing = unresolved(path.read_text(), _module_name(path))
    assert not missing, f"{path.relative_to(ROOT)} refers to what is not there: {missing}"


def test_the_check_sees_a_stale_reference():
    """References to a moved function and to a method no class of the file has fail; the live ones pass."""
    text = (
        ":data:`vitrel.train.predict.NAFLEX_RUN_KEYS` :meth:`attend` :data:`~vitrel.models.run_record.NAFLEX_RUN_KEYS` "
        ":func:`run_predict` :meth:`sizes`\n    def sizes(self): ..."
    )
    assert unresolved(text, "vitrel.train.predict") == ["attend", "vitrel.train.predict.NAFLEX_RUN_KEYS"]
