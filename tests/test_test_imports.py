"""Test modules import their helpers by bare name (``from oracle_kit import ...``), never as
``tests.x``: the README's ``pytest`` (rootdir-less ``prepend`` import mode) puts each test's own
folder on ``sys.path``, not the repository root, so ``import tests.x`` works only under
``python -m pytest`` and fails collection in CI.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent


def _imports_of_tests_package(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        found += [f"{path.relative_to(TESTS_DIR)}:{node.lineno} imports {n}"
                  for n in names if n == "tests" or n.startswith("tests.")]
    return found


def test_no_test_module_imports_the_tests_package():
    offenders = [line for p in sorted(TESTS_DIR.rglob("*.py"))
                 for line in _imports_of_tests_package(p)]
    assert not offenders, "\n".join(offenders)
