"""Write what ``kvledger bench`` sent as a trace (``kvledger bench --trace FILE``).

The bench sends text, so its trace has lengths, not token ids: ``prompt_tokens`` (the server's
count when it reported one) and ``output_tokens`` (what it returned; the requested length for a
failed request). The prefix sharing it built into the workload is kept as block hashes over
blocks of :data:`HASH_BLOCK_SIZE` tokens: the requests of a ``shared-prefix`` level share the
prefix's blocks (the level's prefix length), and the turns of one ``chat-growth`` conversation
share their leading blocks (each turn's prompt extends the previous one). The hashes name those
shared blocks; they are not hashes of real token ids. Arrival times: levels run one after the
other, so a level starts where the previous one's wall time ended.
"""

from __future__ import annotations

import hashlib

from kvledger.bench.records import BenchResult, RequestRecord
from kvledger.replay.trace import TraceWriter

HASH_BLOCK_SIZE = 16


def _hashes(key: str, tokens: int) -> list[str]:
    return [hashlib.sha256(f"{key}:{j}".encode()).hexdigest()[:32]
            for j in range(tokens // HASH_BLOCK_SIZE)]


def _shared(r: RequestRecord, prompt: int) -> tuple[str | None, list[str]]:
    """(session, block hashes) of a bench request."""
    if r.workload == "shared-prefix":
        return None, _hashes(f"prefix:{r.level}", min(r.level_prompt_len, prompt - 1))
    if r.workload == "chat-growth":
        session = r.uid.rsplit("-", 1)[0]  # chat-{c}-{s}-{turn} -> chat-{c}-{s}
        return session, _hashes(f"session:{session}", prompt - 1)
    return None, []


def write_bench_trace(result: BenchResult, path: str) -> None:
    """Write ``result``'s requests as a trace file at ``path``."""
    writer = TraceWriter(path, "bench", result.meta.get("model"), private=True,
                         hash_block_size=HASH_BLOCK_SIZE)
    offsets, t = {}, 0.0
    for s in result.summaries:
        offsets[s["level"]] = t
        t += s["wall_s"]
    for r in sorted(result.records, key=lambda r: offsets[r.level] + r.send_s):
        prompt = r.actual_prompt_tokens
        session, hashes = _shared(r, prompt)
        writer.write({"type": "request", "id": r.uid, "arrival_s": offsets[r.level] + r.send_s,
                      "prompt_tokens": prompt, "block_hashes": hashes,
                      "max_tokens": r.requested_output_tokens,
                      "sampling": {"ignore_eos": True}, "session": session,
                      "output_tokens": r.output_tokens if r.ok else r.requested_output_tokens})
    writer.close()
