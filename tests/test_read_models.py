"""Callers above the engine read it through its read models, and hooks are constructor arguments
(issue 53 item 5).

- The server, the CLI's commands, the sessions, the replay, the evals and the bench never reach
  through the engine into its scheduler's KV manager, pool or queues (``scheduler.kv``,
  ``kv.pool``, ``scheduler.requests`` / ``running`` / ``waiting``): they ask
  ``LLMEngine.snapshot()`` / ``Scheduler.pool_stats()`` (``engine/sched/snapshot.py``) or
  ``stats()``. Two modules drive the engine's internals rather than read them, and are named
  in :data:`DRIVERS` with why.
- No module assigns a hook (an ``on_*`` attribute) to another object after building it: the
  pool's ``on_release``, the prefix cache's ``on_cached`` and the KV tiers' link are
  constructor arguments.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvledger

PACKAGE_DIR = Path(kvledger.__file__).resolve().parent
CALLERS = ("server", "commands", "sessions", "replay", "eval", "bench")
REACH = {("kv", "pool")} | {(owner, attr) for owner in ("scheduler", "sched")
                           for attr in ("kv", "requests", "running", "waiting")}
DRIVERS = {
    # scores a text by allocating its slots and running the runner itself (perplexity, KL)
    "eval/scoring.py": {("scheduler", "kv")},
    # wraps a live request's retention policy to record what it evicts (serve --trace)
    "replay/recorder.py": {("scheduler", "requests")},
}


def _reaches(source: str) -> set[tuple[str, str]]:
    """The (owner, attribute) pairs of ``REACH`` that ``source`` reads, as ``x.owner.attr`` or
    ``owner.attr``."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            owner = node.value.attr if isinstance(node.value, ast.Attribute) else \
                node.value.id if isinstance(node.value, ast.Name) else None
            if (owner, node.attr) in REACH:
                found.add((owner, node.attr))
    return found


def _hooks_assigned(source: str) -> list[str]:
    """``x.on_* = ...`` assignments whose ``x`` is not ``self``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and t.attr.startswith("on_") and not (
                    isinstance(t.value, ast.Name) and t.value.id == "self"):
                out.append(f"line {node.lineno}: .{t.attr}")
    return out


def test_the_finders_find_what_they_look_for():
    assert _reaches("n = engine.scheduler.kv.pool.num_blocks") == {("scheduler", "kv"),
                                                                   ("kv", "pool")}
    assert _reaches("q = len(self.engine.scheduler.waiting)") == {("scheduler", "waiting")}
    assert _reaches("rows = [r for r in scheduler.running]") == {("scheduler", "running")}
    assert _reaches("n = engine.snapshot().pool.blocks_total") == set()
    assert _hooks_assigned("pool.on_release = store.release") == ["line 1: .on_release"]
    assert _hooks_assigned("self.on_release = on_release") == []


def test_callers_read_the_engine_through_its_read_models():
    offenders = {}
    for package in CALLERS:
        for path in (PACKAGE_DIR / package).rglob("*.py"):
            rel = path.relative_to(PACKAGE_DIR).as_posix()
            extra = _reaches(path.read_text()) - DRIVERS.get(rel, set())
            if extra:
                offenders[rel] = sorted(extra)
    assert offenders == {}


def test_every_driver_still_drives():
    """A driver that no longer reaches through leaves :data:`DRIVERS`."""
    for rel, pairs in DRIVERS.items():
        assert _reaches((PACKAGE_DIR / rel).read_text()) >= pairs, rel


def test_no_hook_is_assigned_after_construction():
    offenders = {path.relative_to(PACKAGE_DIR).as_posix(): found
                 for path in PACKAGE_DIR.rglob("*.py")
                 if (found := _hooks_assigned(path.read_text()))}
    assert offenders == {}
