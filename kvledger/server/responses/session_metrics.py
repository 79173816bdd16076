"""Prometheus counters of server-side conversations, next to the server's own metrics.

Names (prefix ``kvledger:``, label ``model_name``): ``session_turns``,
``session_prompt_tokens``, ``session_cached_tokens`` (prefix-cache hits of session turns),
``session_output_tokens``, ``session_summary_rewrites``, ``session_segments`` and
``session_retrievals`` (passages stitched into prompts), and
``session_conversations_removed`` (label ``reason``: ``age`` or ``size``, sessions/expiry.py).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from kvledger.engine.output.request_output import RequestOutput
from kvledger.server.metrics.server_metrics import PREFIX

EVENT_COUNTERS = {"summary": "session_summary_rewrites", "note": "session_segments",
                  "retrieval": "session_retrievals"}


class SessionMetrics:
    """The counters above, registered in the server's registry."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        docs = {
            "session_turns": "Turns of server-side conversations (Responses API).",
            "session_prompt_tokens": "Prompt tokens of session turns.",
            "session_cached_tokens": "Prompt tokens of session turns found in the prefix cache.",
            "session_output_tokens": "Generated tokens of session turns.",
            "session_summary_rewrites": "Summary rewrites by the summary memory policy.",
            "session_segments": "Segments closed (a note written) by the segment policy.",
            "session_retrievals": "Passages retrieved and stitched into session prompts.",
        }
        self.counters = {name: Counter(PREFIX + name, doc, ["model_name"], registry=registry)
                         .labels(model_name=model_name) for name, doc in docs.items()}
        removed = Counter(PREFIX + "session_conversations_removed",
                          "Conversations deleted by --state-max-age (age) or --state-max-gib "
                          "(size).", ["model_name", "reason"], registry=registry)
        self.removed = {reason: removed.labels(model_name=model_name, reason=reason)
                        for reason in ("age", "size")}

    def count_turn(self, out: RequestOutput) -> None:
        """One finished turn and its token counts."""
        self.counters["session_turns"].inc()
        self.counters["session_prompt_tokens"].inc(len(out.prompt_token_ids))
        self.counters["session_cached_tokens"].inc(out.metrics.num_cached_tokens)
        self.counters["session_output_tokens"].inc(len(out.token_ids))

    def count_removed(self, removed: dict[str, int]) -> None:
        """Conversations deleted by expiry, per reason."""
        for reason, n in removed.items():
            self.removed[reason].inc(n)

    def count_event(self, kind: str, n: int = 1) -> None:
        """A memory event: ``summary``, ``note`` (a segment closed) or ``retrieval``."""
        self.counters[EVENT_COUNTERS[kind]].inc(n)
