"""The import graph of ``kvledger``: no cycle, the spec package's readers stay private, the
folders point one way (:data:`ORDER`, bottom to top: no import runs upward; the ledger never
reaches torch; only the device folder imports a device's own folder such as
``kvledger.device.cpu``), and the module paths that issue 32 moved are gone, with no shim.

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


ORDER = (
    ("kvledger", "kvledger.errors", "kvledger.ranges", "kvledger.paths", "kvledger.data",
     "kvledger.spec"),
    ("kvledger.ledger",),
    ("kvledger.device",),
    ("kvledger.model",),
    ("kvledger.engine",),
    ("kvledger.bench", "kvledger.eval", "kvledger.sessions"),
    ("kvledger.replay", "kvledger.server"),
    ("kvledger.commands", "kvledger.cli", "kvledger.__main__"),
)
"""The folders (and top-level modules) of kvledger, bottom to top: a module imports its own
level or below, never above (``kvledger`` alone is the package's ``__init__``: its version and
its lazily loaded names, which it imports by string)."""


def _level(name: str) -> int | None:
    """The :data:`ORDER` level of module ``name`` (the longest entry it is, or is inside)."""
    best, level = "", None
    for i, entries in enumerate(ORDER):
        for entry in entries:
            if (name == entry or name.startswith(entry + ".")) and len(entry) > len(best):
                best, level = entry, i
    return level


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """Every import of ``graph`` that runs upward in :data:`ORDER`, as ``module -> import``."""
    return sorted(f"{name} -> {dep}" for name, deps in graph.items() for dep in deps
                  if _level(dep) > _level(name))


def test_every_module_has_a_place_in_the_order():
    assert not [name for name in _graph() if _level(name) is None]


def test_the_order_finder_finds_an_upward_import_also_a_lazy_one(tmp_path):
    """Negative control: a device module importing the engine inside a function is reported;
    the engine importing the device is not."""
    source = tmp_path / "fake.py"
    source.write_text("def f():\n    from kvledger.engine.attention import make_backend\n")
    known = set(_modules())
    lazy = _imports(source, "kvledger.device.cpu.fake", known)
    assert lazy == {"kvledger.engine.attention"}
    graph = {"kvledger.device.cpu.fake": lazy, "kvledger.engine.attention": {"kvledger.device"}}
    assert _upward(graph) == ["kvledger.device.cpu.fake -> kvledger.engine.attention"]


def test_no_import_runs_upward():
    """Lazy imports included (:func:`_imports` walks function bodies)."""
    assert _upward(_graph()) == []


def _device_folder_imports(source: str, name: str) -> list[str]:
    """The imports of a device's own folder (``kvledger.device.cpu`` or below) in ``source``
    (module ``name``)."""
    from kvledger.device import DEVICES

    folders = {f"kvledger.device.{device}" for device in DEVICES}
    return sorted(t for t in _import_targets(ast.parse(source), name)
                  for folder in folders if t == folder or t.startswith(folder + "."))


def test_the_device_folder_finder_finds_a_direct_import():
    """Negative controls: every spelling of a direct import of the CPU's folder is reported;
    the device seam (``kvledger.device``) is not."""
    for source in ("from kvledger.device.cpu.kernels import KERNELS",
                   "import kvledger.device.cpu.native",
                   "from kvledger.device import cpu",
                   "def f():\n    from ..device.cpu import native\n"):
        assert _device_folder_imports(source, "kvledger.engine.engine"), source
    assert _device_folder_imports("from kvledger.device import resolve\n",
                                  "kvledger.engine.engine") == []


def test_only_the_device_folder_imports_a_device():
    """Outside ``kvledger/device/`` code reaches a device through ``kvledger.device.resolve``
    and the objects it returns, never a device's module."""
    offenders = {name: found for name, path in _modules().items()
                 if _level(name) != _level("kvledger.device")
                 and (found := _device_folder_imports(path.read_text(), name))}
    assert offenders == {}


MOVED = ("kvledger.engine.model", "kvledger.engine.linear", "kvledger.engine.q4",
         "kvledger.engine.rope", "kvledger.engine.loader", "kvledger.engine.gguf_weights",
         "kvledger.engine.kernels", "kvledger.engine.probe_timing", "kvledger.engine.fused",
         "kvledger.engine.w8a8", "kvledger.engine.omp", "kvledger.engine.attention.native",
         "kvledger.engine.kv.native_encode", "kvledger.ledger.probe",
         "kvledger.device.cpu.kernel_probe", "kvledger.device.cpu.probe_timing",
         "kvledger.model.ops")
"""Module paths before issue 32 (now in kvledger.model and kvledger.device) and issue 53 (the
kernel probe now in kvledger.engine.tuning, the PyTorch ops in kvledger.device.ops)."""


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
