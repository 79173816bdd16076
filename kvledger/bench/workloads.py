"""The three workloads, as generators of levels.

Each workload is a generator: it yields a :class:`Level`, receives the level's records with
``send()``, and yields the next one (the growing chat needs the previous answers). Levels whose
tokens would not fit the model's context are skipped with a note.

- **sweep** (seed §5.1): for every concurrency and prompt length, ``max(requests,
  concurrency)`` requests with distinct prompts of exactly that many tokens (template tokens
  of the chat endpoint and BOS included), fixed output length. Distinct prompts share no KV
  block beyond the chat template's fixed opening (its default system prompt), so a prefix
  cache cannot shorten their prefill by more than that.
- **shared-prefix** (seed §4.3): for every prefix length, requests that share a system prompt
  of that many tokens, each followed by its own question of ``turn_tokens`` tokens. The first
  request runs alone (``cold``: it prefills the prefix); the rest (``warm``) can reuse it.
- **chat-growth** (seed §2.3): ``concurrency`` sessions, ``turns`` turns each; every turn
  appends the previous answer and a new question of ``turn_tokens`` tokens, so context grows
  by about ``turn_tokens + output_len`` per turn. TPOT is reported per turn.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field

from kvledger.bench.prompts import TokenCounter, make_prompt
from kvledger.bench.records import Level, RequestRecord, RequestSpec

WORKLOADS = ("sweep", "shared-prefix", "chat-growth")
LevelGen = Generator[Level, list[RequestRecord], None]


@dataclass
class WorkloadConfig:
    """Knobs of a workload (token counts are tokens of the server's tokenizer).

    ``prompt_overhead`` is the number of tokens the server adds around a prompt (the chat
    template around one user message, or a BOS token); sweep prompts are shortened by it so
    the server prefills exactly the nominal length.
    """

    prompt_lens: list[int]
    output_len: int
    concurrency: list[int]
    requests: int
    turn_tokens: int = 512
    turns: int = 8
    max_model_len: int | None = None
    prompt_overhead: int = 0
    notes: list[str] = field(default_factory=list)

    def fits(self, prompt_tokens: int, what: str) -> bool:
        """Whether prompt + output fit the context; adds a skip note when they do not."""
        need = prompt_tokens + self.output_len
        if self.max_model_len is not None and need > self.max_model_len:
            self.notes.append(
                f"skipped {what}: {prompt_tokens} prompt + {self.output_len} output tokens "
                f"exceed the model's context of {self.max_model_len}"
            )
            return False
        return True


def sweep(cfg: WorkloadConfig, counter: TokenCounter) -> LevelGen:
    """Prompt-length sweep at each concurrency (seed §5.1)."""
    lens = [n for n in sorted(set(cfg.prompt_lens)) if cfg.fits(n, f"prompt length {n}")]
    for c in cfg.concurrency:
        for n in lens:
            specs = []
            for i in range(max(cfg.requests, c)):
                uid = f"sweep-{n}-{c}-{i}"
                text, count = make_prompt(counter, uid, max(1, n - cfg.prompt_overhead))
                specs.append(RequestSpec(uid, text, count + cfg.prompt_overhead))
            yield Level("sweep", n, c, specs)


def shared_prefix(cfg: WorkloadConfig, counter: TokenCounter, chat: bool) -> LevelGen:
    """Requests sharing a long system prompt, first one cold (seed §4.3)."""
    for n in sorted(set(cfg.prompt_lens)):
        total = n + cfg.turn_tokens + cfg.prompt_overhead
        if not cfg.fits(total, f"shared prefix {n} (+ {cfg.turn_tokens}-token question)"):
            continue
        for c in cfg.concurrency:
            prefix, prefix_count = make_prompt(counter, f"prefix-{n}-{c}", n)
            specs = []
            for i in range(max(cfg.requests, c + 1)):
                question, q_count = make_prompt(counter, f"question-{n}-{c}-{i}", cfg.turn_tokens)
                prompt: str | list[dict] = (
                    [{"role": "system", "content": prefix}, {"role": "user", "content": question}]
                    if chat else f"{prefix}\n\n{question}"
                )
                phase = "cold" if i == 0 else "warm"
                specs.append(RequestSpec(f"{phase}-{n}-{c}-{i}", prompt,
                                         prefix_count + q_count + cfg.prompt_overhead, phase,
                                         estimated=True))
            yield Level("shared-prefix", n, c, specs, cold_first=True)


def chat_growth(cfg: WorkloadConfig, counter: TokenCounter) -> LevelGen:
    """``concurrency`` chats growing turn by turn (seed §2.3)."""
    for c in cfg.concurrency:
        sessions: list[list[dict]] = [[] for _ in range(c)]
        context = 0
        for turn in range(1, cfg.turns + 1):
            context += cfg.turn_tokens + (cfg.prompt_overhead if turn == 1 else cfg.output_len)
            if not cfg.fits(context, f"chat turn {turn} at concurrency {c} and later turns"):
                break
            specs = []
            for s, messages in enumerate(sessions):
                question, _ = make_prompt(counter, f"chat-{c}-{s}-{turn}", cfg.turn_tokens)
                messages.append({"role": "user", "content": question})
                specs.append(RequestSpec(f"chat-{c}-{s}-{turn}", list(messages), context,
                                         f"turn {turn}", s, estimated=True))
            records = yield Level("chat-growth", context, c, specs, turn=turn)
            for record, messages in zip(sorted(records, key=lambda r: r.index), sessions):
                messages.append({"role": "assistant", "content": record.answer or ""})


def make_levels(name: str, cfg: WorkloadConfig, counter: TokenCounter, chat: bool) -> LevelGen:
    """The generator of workload ``name`` (one of :data:`WORKLOADS`)."""
    if name == "sweep":
        return sweep(cfg, counter)
    if name == "shared-prefix":
        return shared_prefix(cfg, counter, chat)
    if name == "chat-growth":
        return chat_growth(cfg, counter)
    raise ValueError(f"unknown workload {name!r}")
