"""A contributor's path through docs/schemes.md's "Adding a position scheme": a toy bias scheme and a toy rotary scheme,
written as the section says, reach the registry, the study's selection, the kernels (run or refused by name) and a
training step; the section's import line works inside the package too."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.train_helpers import ROOT, script_env


def test_the_docs_import_line_works_in_a_module_of_the_schemes_package():
    # a new vitrel/pos/schemes/<name>.py with the how-to's `from vitrel.pos import PositionScheme, register_pos` failed:
    # "cannot import name 'PositionScheme' from partially initialized module 'vitrel.pos'" (the package imports its
    # schemes first); the finder below runs that line where the first scheme module is imported
    code = textwrap.dedent(
        """
        import importlib.abc, sys

        class DocsImportLine(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.startswith("vitrel.pos.schemes."):
                    sys.meta_path.remove(self)
                    from vitrel.pos import PositionScheme, register_pos  # noqa: F401
                return None

        sys.meta_path.insert(0, DocsImportLine())
        import vitrel
        print(len(vitrel.list_pos()))
        """
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=script_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
