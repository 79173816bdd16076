"""The import graph of ``kvledger``: no cycle, and the spec package's readers stay private.

Every ``import`` statement of every module counts, also those inside functions (a lazy import
hides a cycle at start-up but not in the design). ``from a import b`` is an edge to ``a.b`` when
that is a module, else to ``a``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvledger

PACKAGE_DIR = Path(kvledger.__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE_DIR.rglob("*.py")}


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """kvledger modules that module ``name`` (file ``path``) imports."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in known and t != name)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(path, name, known) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_walk_sees_the_package():
    graph = _graph()
    assert "kvledger.spec.hf_config" in graph["kvledger.spec.load"]
    assert "kvledger.ledger.kv" in graph["kvledger.ledger.planner"]


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_kvledger_has_no_import_cycle():
    assert _cycle(_graph()) is None


def test_only_the_spec_package_imports_its_readers():
    """Outside ``kvledger.spec`` code uses the package's public names, never a reader module."""
    offenders = {
        (name, dep)
        for name, deps in _graph().items()
        if name != "kvledger.spec" and not name.startswith("kvledger.spec.")
        for dep in deps
        if dep.startswith("kvledger.spec.")
    }
    assert not offenders
