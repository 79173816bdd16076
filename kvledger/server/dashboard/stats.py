"""The dashboard's data: one JSON snapshot of the KV pool, the requests and the latencies.

:func:`engine_snapshot` runs in the engine thread (through ``EngineLoop.call``), between two
steps, so the pool, the block tables and the queues it reads are consistent with each other.
:func:`latency_histograms` reads the server's Prometheus histograms (thread-safe) in the HTTP
thread. :func:`alerts` turns both into the page's warnings.

Block states in ``blocks`` (one int per block, the pool's block ids in order):
``FREE`` (-1) empty, ``CACHED`` (-2) free but still holding a prefix-cache hash,
``SHARED`` (-3) in use by several requests (a prefix-cache hit), ``OTHER`` (-4) in use by
another tenant's request, ``i >= 0`` in use by ``requests[i]`` alone. Requests are listed by
id, token counts and bytes only: the snapshot never carries prompt or output text. With API
keys a tenant sees only its own requests (:func:`visible_to`); an admin key sees all.
"""

from __future__ import annotations

from typing import Any

from kvledger.engine.sched.snapshot import BLOCK_CACHED, BLOCK_USED, RequestSnapshot

FREE, CACHED, SHARED, OTHER = -1, -2, -3, -4
POOL_FULL_WARNING = 0.9  # warn when this fraction of the blocks is in use
HISTOGRAMS = {  # dashboard name -> Prometheus histogram (without the kvledger: prefix)
    "ttft": "time_to_first_token_seconds",
    "tpot": "request_time_per_output_token_seconds",
    "itl": "inter_token_latency_seconds",
}


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


def _request_row(req: RequestSnapshot, block_size: int, bytes_per_block: int,
                 bytes_per_token: int) -> dict:
    """One request: token counts, KV held (allocated blocks and the ledger's figure), the most
    KV it may reach (prompt + max_tokens, in blocks), preemptions. No text."""
    return {
        "id": req.request_id,
        "state": req.state,
        "prompt_tokens": req.prompt_tokens,
        "output_tokens": req.output_tokens,
        "computed_tokens": req.computed_tokens,
        "cached_tokens": req.cached_tokens,
        "blocks": req.blocks_held,
        "kv_bytes": req.blocks_held * bytes_per_block,
        "kv_bytes_predicted": req.computed_tokens * bytes_per_token,
        "quota_bytes": cdiv(req.max_total_tokens, block_size) * bytes_per_block,
        "preemptions": req.preemptions,
    }


def engine_snapshot(engine: Any) -> dict:
    """Pool, block map, requests and counters of an ``LLMEngine`` (call in its thread).

    Returns a JSON-ready dict: ``stats`` (``engine.stats()``), ``pool`` (block counts, bytes per
    block, block size), ``blocks`` (state per block, see the module docstring), ``requests``
    (running first, then waiting, each as :func:`_request_row`) and ``quota_tokens`` (the
    per-request KV quota, None when unset), ``tiers`` (the KV tiers below the pool: name ->
    their counters, ``engine/kv/tiers/tier.py``'s TierStats). Everything but the stats comes
    from the engine's read model (``engine.snapshot()``, ``engine/sched/snapshot.py``); an
    engine without one (a test fake) gives its stats only.
    """
    stats = dict(engine.stats())
    if not hasattr(engine, "snapshot"):
        return {"stats": stats, "pool": None, "blocks": [], "requests": [], "quota_tokens": None}
    snap = engine.snapshot()
    pool, bpt = snap.pool, engine.bytes_per_token
    owner: dict[int, int] = {}
    for index, req in enumerate(snap.requests):
        for block_id in req.block_ids:
            owner[block_id] = SHARED if block_id in owner else index
    blocks = [owner.get(i, SHARED) if state == BLOCK_USED else CACHED if state == BLOCK_CACHED
              else FREE for i, state in enumerate(snap.block_states)]
    return {
        "stats": stats,
        "pool": {"blocks_total": pool.blocks_total, "blocks_free": pool.blocks_free,
                 "blocks_cached": pool.blocks_cached, "blocks_in_use": pool.blocks_in_use,
                 "bytes_per_block": pool.bytes_per_block, "bytes_per_token": bpt,
                 "block_size": pool.block_size},
        "blocks": blocks,
        "requests": [_request_row(r, pool.block_size, pool.bytes_per_block, bpt)
                     for r in snap.requests],
        "quota_tokens": snap.quota_tokens,
        "tiers": stats.get("kv_tiers", {}),
    }


def visible_to(snapshot: dict, owners: dict[str, str], tenant: str | None) -> dict:
    """The snapshot as ``tenant`` may see it: its own requests, the others' blocks as
    ``OTHER``; ``tenant`` None (an admin, or a server without keys) sees everything.

    Args:
        owners: the tenant of every live request, by id (``EngineLoop.owners``).
    """
    if tenant is None:
        return snapshot
    rows = snapshot["requests"]
    kept = [i for i, row in enumerate(rows) if owners.get(row["id"]) == tenant]
    new_index = {old: new for new, old in enumerate(kept)}
    blocks = [new_index.get(b, OTHER) if b >= 0 else b for b in snapshot["blocks"]]
    return {**snapshot, "requests": [rows[i] for i in kept], "blocks": blocks}


def latency_histograms(registry: Any) -> dict:
    """TTFT / TPOT / ITL histograms from a Prometheus registry.

    Returns ``{name: {"le": [upper bounds, s], "counts": [per bucket, not cumulative],
    "count": n, "sum": seconds}}``; the last bucket (``+Inf``) is dropped from ``le`` and its
    count folded into the last finite one's overflow ``counts[-1]``.
    """
    wanted = {"kvledger:" + prom: name for name, prom in HISTOGRAMS.items()}
    out = {name: {"le": [], "counts": [], "count": 0, "sum": 0.0} for name in HISTOGRAMS}
    for family in registry.collect():
        name = wanted.get(family.name)
        if name is None:
            continue
        cumulative = []
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                cumulative.append((float(sample.labels["le"]), sample.value))
            elif sample.name.endswith("_count"):
                out[name]["count"] = int(sample.value)
            elif sample.name.endswith("_sum"):
                out[name]["sum"] = sample.value
        cumulative.sort()
        previous = 0.0
        for le, value in cumulative:
            if le == float("inf"):
                out[name]["counts"].append(int(value - previous))  # overflow bucket
                break
            out[name]["le"].append(le)
            out[name]["counts"].append(int(value - previous))
            previous = value
    return out


def counter_values(registry: Any) -> dict[str, float]:
    """Every counter of a Prometheus registry summed over its labels, by name without the
    ``kvledger:`` prefix (e.g. ``{"kv_alerts": 2.0, "request_success": 5.0}``)."""
    out: dict[str, float] = {}
    for family in registry.collect():
        if family.type != "counter":
            continue
        name = family.name.removeprefix("kvledger:")
        out[name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
    return out


def alerts(snapshot: dict, counters: dict[str, float], engine_alive: bool) -> list[dict]:
    """Warnings for the page: ``[{"level": "error"|"warning"|"info", "message": str}]``.

    - the engine thread stopped;
    - the pool is at least :data:`POOL_FULL_WARNING` in use;
    - the allocated KV exceeds the ledger's bytes for the tokens held by more than one block per
      running request (a partly filled last block is the only allowed difference);
    - requests preempted, refused for their KV quota, or past ``--kv-alert-bytes`` (counts).
    """
    out = []
    if not engine_alive:
        out.append({"level": "error", "message": "the engine thread has stopped"})
    stats, pool = snapshot["stats"], snapshot["pool"]
    usage = stats.get("kv_usage", 0.0)
    if usage >= POOL_FULL_WARNING:
        out.append({"level": "warning", "message": f"KV pool {usage:.0%} in use; "
                    f"{stats.get('num_waiting', 0)} requests waiting"})
    if pool is not None:
        running = sum(1 for r in snapshot["requests"] if r["state"] == "running")
        slack = running * pool["bytes_per_block"]
        allocated = stats.get("kv_bytes_allocated", 0)
        predicted = stats.get("kv_bytes_predicted", 0)
        if allocated > predicted + slack:
            out.append({"level": "error", "message": f"ledger mismatch: {allocated} bytes "
                        f"allocated for {predicted} predicted (+{slack} for partial blocks)"})
    for key, text in (("num_preemptions", "preemptions (recompute)"),
                      ("kv_quota_rejections", "requests refused for their KV quota"),
                      ("kv_alerts", "requests past --kv-alert-bytes")):
        n = int(counters.get(key, stats.get(key, 0)))
        if n:
            out.append({"level": "info", "message": f"{n} {text}"})
    return out
