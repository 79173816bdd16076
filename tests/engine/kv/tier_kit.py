"""What the KV-tier tests share: one request run to its end on an engine."""

from __future__ import annotations


def finish(params, engine, prompt, request_id="r"):
    """Add ``prompt`` as ``request_id`` with ``params`` and step ``engine`` until nothing is
    left; the request's final output."""
    engine.add_request(request_id, prompt, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    return final
