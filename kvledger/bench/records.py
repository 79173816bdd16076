"""What a workload asks for (Level, RequestSpec) and what a request measured (RequestRecord).

A *level* is one point of a curve: a set of requests sent with the same prompt length and
concurrency (a sweep point, a shared-prefix batch, one turn of the growing chats). Times in a
record are seconds; ``arrival_s`` and ``send_s`` are relative to the level's start, so
``slot_wait_s = send_s - arrival_s`` is the time spent waiting for the client's own
concurrency slot, excluded from TTFT and reported on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestSpec:
    """One request to send: a prompt (text, or chat messages) and its intended token count.

    ``estimated``: the count is an estimate (template tokens between chat messages), so a
    different count from the server is expected and not noted.
    """

    uid: str
    prompt: str | list[dict]
    prompt_tokens: int
    phase: str = ""
    session: int = 0
    estimated: bool = False


@dataclass
class Level:
    """Requests that form one measured point.

    Attributes:
        workload: ``sweep``, ``shared-prefix`` or ``chat-growth``.
        prompt_len: the level's nominal prompt length in tokens (sweep length, shared prefix
            length, or the intended context of this chat turn).
        concurrency: most requests in flight at once.
        specs: the requests, in arrival order.
        turn: chat turn number (chat-growth only, from 1).
        cold_first: send ``specs[0]`` alone before the others (shared-prefix: it fills the
            prefix cache that the rest should hit).
    """

    workload: str
    prompt_len: int
    concurrency: int
    specs: list[RequestSpec]
    turn: int | None = None
    cold_first: bool = False

    @property
    def label(self) -> str:
        """Short unique name, e.g. ``sweep L=4096 c=4`` or ``chat-growth turn=3 c=1``."""
        point = f"turn={self.turn}" if self.turn is not None else f"L={self.prompt_len}"
        return f"{self.workload} {point} c={self.concurrency}"


@dataclass
class RequestRecord:
    """One request's outcome. Failures have ``ok=False``, an ``error`` and no timings."""

    level: str
    workload: str
    index: int
    uid: str
    phase: str
    concurrency: int
    level_prompt_len: int
    target_prompt_tokens: int
    requested_output_tokens: int
    arrival_s: float
    send_s: float
    ok: bool
    error: str | None
    ttft_s: float | None
    e2e_s: float | None
    tpot_s: float | None
    output_tokens: int | None
    prompt_tokens: int | None
    content_events: int
    itl_s: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    turn: int | None = None
    answer: str = ""

    @property
    def slot_wait_s(self) -> float:
        """Arrival -> send: time waiting for the client's concurrency slot (not in TTFT)."""
        return self.send_s - self.arrival_s

    @property
    def actual_prompt_tokens(self) -> int:
        """Prompt tokens the server reported (usage), else the intended count."""
        return self.prompt_tokens if self.prompt_tokens is not None else self.target_prompt_tokens

    @property
    def context_tokens(self) -> float | None:
        """Mean context length during decode: prompt + half the output (x of TPOT curves)."""
        if self.output_tokens is None:
            return None
        return self.actual_prompt_tokens + self.output_tokens / 2


@dataclass
class BenchResult:
    """Everything one ``kvledger bench`` run produced (what results.json holds).

    ``overlay`` has the ledger comparison when ``--plan-model`` was given: ``rows`` (one per
    level and metric: measured, floor, ratio) and ``ttft_curve`` / ``tpot_curve`` as
    ``[(tokens, seconds)]`` for the plots.
    """

    meta: dict
    summaries: list[dict]
    records: list[RequestRecord]
    anomalies: list = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    overlay: dict | None = None
