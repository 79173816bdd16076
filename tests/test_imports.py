"""The import graph of ``kvledger``: no cycle, the spec package's readers stay private, the
layers point one way (the ledger never reaches torch, the engine, model and device never reach
the server or the CLI), and the module paths that issue 32 moved are gone, with no shim.

Every ``import`` statement of every module counts, also those inside functions (a lazy import
hides a cycle at start-up but not in the design). ``from a import b`` is an edge to ``a.b`` when
that is a module, else to ``a``.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

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


def _external(path: Path) -> set[str]:
    """Top-level names of the packages outside kvledger that the file at ``path`` imports."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name.partition(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.partition(".")[0])
    return out - {"kvledger"}


def _reached(graph: dict[str, set[str]], roots: set[str]) -> set[str]:
    """``roots`` and every module they import, directly or not."""
    seen, todo = set(roots), list(roots)
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def _under(names, *packages: str) -> set[str]:
    return {n for n in names for p in packages if n == p or n.startswith(p + ".")}


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


def test_the_reach_follows_imports_through_modules():
    assert _reached({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a"}}, {"a"}) == {"a", "b", "c"}


def test_the_ledger_reaches_no_torch():
    """The cost model is pure integers: no ledger module, nor any kvledger module it imports,
    imports torch (``kvledger plan`` runs without it)."""
    graph, modules = _graph(), _modules()
    reached = _reached(graph, _under(graph, "kvledger.ledger"))
    assert not {name for name in reached if "torch" in _external(modules[name])}


def test_the_engine_model_and_device_never_reach_the_server_or_the_cli():
    graph = _graph()
    reached = _reached(graph, _under(graph, "kvledger.engine", "kvledger.model", "kvledger.device"))
    assert not _under(reached, "kvledger.server", "kvledger.commands", "kvledger.cli")


MOVED = ("kvledger.engine.model", "kvledger.engine.linear", "kvledger.engine.q4",
         "kvledger.engine.rope", "kvledger.engine.loader", "kvledger.engine.gguf_weights",
         "kvledger.engine.kernels", "kvledger.engine.probe_timing", "kvledger.engine.fused",
         "kvledger.engine.w8a8", "kvledger.engine.omp", "kvledger.engine.attention.native",
         "kvledger.engine.kv.native_encode", "kvledger.ledger.probe")
"""Module paths before issue 32 (now in kvledger.model and kvledger.device)."""


@pytest.mark.parametrize("name", MOVED)
def test_a_moved_module_path_is_gone_with_no_shim(name):
    parent, _, leaf = name.rpartition(".")
    assert importlib.util.find_spec(name) is None
    assert not hasattr(importlib.import_module(parent), leaf)


def test_every_cpp_source_is_in_the_cpu_device():
    """The C++ sources and headers live in ``kvledger/device/cpu/csrc/`` only."""
    sources = {p for ext in ("*.cpp", "*.h", "*.c", "*.hpp", "*.cc") for p in PACKAGE_DIR.rglob(ext)}
    assert sources and {p.parent for p in sources} == {PACKAGE_DIR / "device" / "cpu" / "csrc"}


# ---------------------------------------------------------------- retention behind one interface
# (issue 32 item 3) The engine core asks each request's retention object; it never imports a
# policy or a retention state, and never branches on which policy a request has.

RETENTION_INTERFACE = "kvledger.engine.retention.interface"
POLICY_ATTRIBUTES = {"policy", "evicts"}  # spec.policy names the policy; spec.evicts = "not full"


def _core_modules() -> dict[str, Path]:
    """The scheduler, the KV manager, the runner and the attention package's modules."""
    return {name: path for name, path in _modules().items()
            if name in ("kvledger.engine.sched.scheduler", "kvledger.engine.kv.manager",
                        "kvledger.engine.runner")
            or name == "kvledger.engine.attention" or name.startswith("kvledger.engine.attention.")}


def _import_targets(tree: ast.AST, name: str) -> set[str]:
    """Every dotted name an import statement of module ``name`` (parsed: ``tree``) reaches,
    module and module.name, relative ones resolved."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            parts = name.split(".")
            anchor = parts[: len(parts) - node.level] if node.level else []
            base = ".".join(anchor + ([node.module] if node.module else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def _retention_names() -> set[str]:
    """Classes and functions the retention package defines besides its interface: its
    policies, states, factory and observer."""
    names: set[str] = set()
    for name, path in _modules().items():
        if name.startswith("kvledger.engine.retention.") and name != RETENTION_INTERFACE:
            tree = ast.parse(path.read_text())
            names.update(n.name for n in tree.body
                         if isinstance(n, ast.ClassDef | ast.FunctionDef))
    return names


def _policy_branches(source: str, name: str, forbidden: set[str]) -> list[str]:
    """Where ``source`` (module ``name``) branches on a retention policy: an import of a
    retention module other than the interface, a name of ``forbidden`` (a policy or state
    class: isinstance, construction), a policy's name as a string, ``.policy`` / ``.evicts``,
    or ``x.retention`` used as a value (``is None``, truth, isinstance) instead of asked."""
    from kvledger.ledger.retention import POLICIES

    tree = ast.parse(source)
    found = [f"imports {t}" for t in sorted(_import_targets(tree, name))
             if "retention" in t.split(".") and not t.startswith(RETENTION_INTERFACE)]
    asked = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in forbidden:
            found.append(f"line {node.lineno}: names {node.id}")
        elif isinstance(node, ast.alias) and node.name.split(".")[-1] in forbidden:
            found.append(f"imports {node.name}")
        elif isinstance(node, ast.Constant) and node.value in POLICIES:
            found.append(f"line {node.lineno}: the policy name {node.value!r}")
        elif isinstance(node, ast.Attribute) and node.attr in POLICY_ATTRIBUTES | forbidden:
            found.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Attribute) and node.attr == "retention" \
                and id(node) not in asked:
            found.append(f"line {node.lineno}: .retention used as a value")
    return found


def test_the_policy_branch_finder_finds_branches():
    """Negative controls: each way of branching on the policy is reported."""
    forbidden = _retention_names()
    assert {"WindowPolicy", "RetainedKV", "FullRetention", "retention_for"} <= forbidden
    branches = {
        "if req.retention is None:\n    pass": ".retention used as a value",
        "x = 1 if req.retention else 2": ".retention used as a value",
        "ok = isinstance(req.retention.policy, int)": ".policy",
        "ok = isinstance(state, WindowPolicy)": "names WindowPolicy",
        "cap = 64 if req.retention.spec.evicts else 0": ".evicts",
        "ok = spec.policy == 'h2o'": "the policy name 'h2o'",
        "from kvledger.engine.retention.state import RetainedKV": "imports",
        "from kvledger.ledger.retention import EVICTION_CHUNK": "imports",
        "from ..retention import state": "imports kvledger.engine.retention",
    }
    for source, what in branches.items():
        found = _policy_branches(source, "kvledger.engine.kv.manager", forbidden)
        assert any(what in f for f in found), (source, found)
    asked = "n = req.retention.kv_slots(req.num_computed_tokens)\n" \
            "from kvledger.engine.retention.interface import HeldContext"
    assert _policy_branches(asked, "kvledger.engine.runner", forbidden) == []


def test_the_engine_core_asks_retention_through_its_interface_only():
    """The scheduler, KV manager, runner and attention import retention only through
    ``engine/retention/interface.py`` and never branch on the policy."""
    core = _core_modules()
    assert {"kvledger.engine.sched.scheduler", "kvledger.engine.kv.manager",
            "kvledger.engine.runner", "kvledger.engine.attention.metadata"} <= set(core)
    forbidden = _retention_names()
    offenders = {name: found for name, path in core.items()
                 if (found := _policy_branches(path.read_text(), name, forbidden))}
    assert offenders == {}
