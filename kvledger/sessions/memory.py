"""Memory policies: what the prompt of the next turn holds, within a token budget.

Budget (tokens): ``limit - max_output_tokens``, where ``limit`` is the most tokens one request
may reach under the ledger's admission rule (:class:`kvledger.ledger.admission.RequestBudget`:
the model's context, the KV pool and the per-request KV quota, whichever is smallest).

Every policy appends a turn token-exactly while the conversation fits: the new prompt is the
previous conversation's ids (prompt + reply) plus the closing tail of the reply and the new
user turn (:mod:`.codec`). What happens when it no longer fits depends on ``truncation``:
``"disabled"`` (OpenAI's default) refuses the turn with the numbers (HTTP 400); ``"auto"``
applies the policy:

- ``full``: the oldest turns leave the prompt until the rest fits (a sliding window).
- ``summary``: the prompt is [system + summary][recent turns]. On overflow the oldest turns
  are condensed by the served model into a new summary, and enough of them that the rest
  takes at most :data:`LOW_WATER` of the budget; so the next rewrite comes only after the
  conversation has grown by about half the budget again (hysteresis), and in between every
  turn is a token-exact append whose prefix-cache hit covers the system + summary blocks.
  The system + summary prefix is padded with spaces to whole KV blocks.
- ``segment``: after ``segment_turns`` turns, ``segment_tokens`` tokens or an overflow, the
  model writes the segment's conclusions (a note, stored and retrievable); the new segment
  starts from [system + the last :data:`CARRY_NOTES` notes][the new turn].

With ``truncation="auto"`` and no policy able to make room (the new turn alone with the
smallest prefix does not fit) the turn is refused too.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from kvledger.sessions.codec import TurnCodec
from kvledger.sessions.errors import TurnTooLargeError

POLICIES = ("full", "summary", "segment")
LOW_WATER = 0.5  # fraction of the budget the recent turns may keep after a summary rewrite
CARRY_NOTES = 3
SUMMARY_MAX_TOKENS = 96
NOTE_MAX_TOKENS = 64
TRANSCRIPT_TURN_CHARS = 600  # each message is cut to this many characters for condensing
SUMMARY_HEADER = "Summary of the earlier conversation:"
NOTES_HEADER = "Notes from earlier parts of this conversation:"


@dataclass
class Turn:
    """One turn in the prompt window; ``start`` is its first token's offset in the ids."""

    start: int
    user: str
    reply: str = ""
    chunk_ids: list[int] = field(default_factory=list)


@dataclass
class ConversationState:
    """What a stored response keeps besides the ids, to plan the turn after it."""

    system: str | None
    policy: str
    prefix_len: int
    turns: list[Turn] = field(default_factory=list)
    tools: str | None = None  # the tool declarations that follow the instructions
    summary: str = ""
    notes: list[str] = field(default_factory=list)
    total_turns: int = 0
    rewrites: int = 0
    segment: int = 0

    def to_json(self) -> dict:
        """A JSON-able dict (the ``state`` column)."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> ConversationState:
        """Inverse of :meth:`to_json`."""
        turns = [Turn(**t) for t in data.get("turns", [])]
        return cls(**{**data, "turns": turns})


@dataclass(frozen=True)
class MemoryOptions:
    """Policy knobs (tokens unless said otherwise)."""

    policy: str = "summary"
    block_size: int = 16
    segment_turns: int = 8
    segment_tokens: int | None = None  # None = half the budget


@dataclass
class TurnPlan:
    """The prompt of the next turn and the state it leaves (its reply is filled in later).

    ``event`` is None (plain append), ``"window"``, ``"summary"`` or ``"segment"``;
    ``note`` is the conclusions written when a segment closed.
    """

    prompt_ids: list[int]
    state: ConversationState
    event: str | None = None
    note: str | None = None


# condense(kind, messages, max_tokens) -> text written by the served model
Condense = Callable[[str, list[dict], int], Awaitable[str]]
# run(fn, *args) -> fn(*args), where tokenizing may block (the server's tokenizer thread)
Run = Callable[..., Awaitable[Any]]


async def _inline(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def _transcript(turns: list[Turn]) -> str:
    lines = []
    for t in turns:
        lines.append(f"User: {t.user[:TRANSCRIPT_TURN_CHARS]}")
        lines.append(f"Assistant: {t.reply[:TRANSCRIPT_TURN_CHARS]}")
    return "\n".join(lines)


def summary_messages(old_summary: str, turns: list[Turn]) -> list[dict]:
    """Chat messages asking the model to fold ``turns`` into ``old_summary``."""
    earlier = f"Summary so far: {old_summary}\n\n" if old_summary else ""
    return [{"role": "system", "content": "You write short summaries of conversations. Keep "
             "names, numbers and facts the user stated."},
            {"role": "user", "content": f"{earlier}Conversation:\n{_transcript(turns)}\n\n"
             "Write the updated summary in a few sentences."}]


def note_messages(turns: list[Turn]) -> list[dict]:
    """Chat messages asking the model for the conclusions of a finished segment."""
    return [{"role": "system", "content": "You write the conclusions of a conversation as a "
             "short note. Keep names, numbers and decisions."},
            {"role": "user", "content": f"Conversation:\n{_transcript(turns)}\n\n"
             "Write the note in two or three sentences."}]


def system_content(state: ConversationState) -> str | None:
    """The system message of a state: instructions, tool declarations, then the summary or the
    carried notes."""
    parts = [p for p in (state.system, state.tools) if p]
    if state.summary:
        parts.append(f"{SUMMARY_HEADER} {state.summary}")
    if state.notes:
        parts.append(NOTES_HEADER + "".join(f"\n- {n}" for n in state.notes))
    return "\n\n".join(parts) if parts else None


def _prefix(codec: TurnCodec, state: ConversationState, block_size: int) -> list[int]:
    ids = codec.prefix_ids(system_content(state))
    return codec.pad_to_block(ids, block_size) if (state.summary or state.notes) else ids


def _too_large(need: int, budget: int, what: str) -> TurnTooLargeError:
    return TurnTooLargeError(f"{what} needs {need} prompt tokens but the budget is {budget} "
                             "tokens (context or per-request KV quota minus max_output_tokens)")


class MemoryPlanner:
    """Plans each turn's prompt under one tokenizer and options."""

    def __init__(self, codec: TurnCodec, options: MemoryOptions, run: Run | None = None) -> None:
        self.codec = codec
        self.options = options
        self._run = run or _inline

    def _encode_turn(self, ids: list[int], state: ConversationState, user_text: str,
                     messages: list[dict] | None) -> tuple[list[int], list[int]]:
        """(closing tail of the previous reply, the new turn's ids: one user text, or
        ``messages``)."""
        turn = (self.codec.messages_ids(messages) if messages is not None else
                self.codec.user_turn_ids(user_text))
        return self.codec.tail_ids(ids) if state.turns else [], turn

    async def _prefix(self, state: ConversationState) -> list[int]:
        return await self._run(_prefix, self.codec, state, self.options.block_size)

    def first_state(self, system: str | None, policy: str, tools: str | None = None
                    ) -> tuple[list[int], ConversationState]:
        """The ids and state of a conversation before its first turn (``tools``: the tool
        declarations of the system message)."""
        state = ConversationState(system=system, policy=policy, prefix_len=0, tools=tools)
        ids = _prefix(self.codec, state, self.options.block_size)
        state.prefix_len = len(ids)
        return ids, state

    def with_system(self, ids: list[int], state: ConversationState, system: str | None,
                    tools: str | None = None) -> tuple[list[int], ConversationState]:
        """The conversation under new instructions or tool declarations: a new prefix, the kept
        turns' exact ids after it (the prefix cache then hits only up to the change). ``None``
        keeps the old."""
        system = state.system if system is None else system
        tools = state.tools if tools is None else tools
        if system == state.system and tools == state.tools:
            return ids, state
        state = ConversationState.from_json(state.to_json())
        state.system, state.tools = system, tools
        return self._rebase(ids, state, 0, _prefix(self.codec, state, self.options.block_size)), \
            state

    async def plan(self, ids: list[int], state: ConversationState, user_text: str,
                   budget: int, truncation: str, condense: Condense,
                   messages: list[dict] | None = None) -> TurnPlan:
        """The next prompt for ``user_text`` after a conversation with ``ids`` and ``state``
        (``messages``: the turn's chat messages, when it is more than one user text, which
        then stands for them in the memory's transcripts).

        Raises:
            TurnTooLargeError: it does not fit ``budget`` and ``truncation`` is
                ``"disabled"``, or the turn alone cannot fit (HTTP 400, with the numbers).
        """
        state = ConversationState.from_json(state.to_json())  # never mutate the stored one
        tail, user_ids = await self._run(self._encode_turn, ids, state, user_text, messages)
        if state.prefix_len + len(user_ids) > budget:
            raise _too_large(state.prefix_len + len(user_ids), budget, "the new turn alone")
        need = len(ids) + len(tail) + len(user_ids)
        segment_full = state.policy == "segment" and truncation == "auto" and state.turns and (
            len(state.turns) >= self.options.segment_turns
            or need - state.prefix_len > (self.options.segment_tokens or budget // 2))
        if need <= budget and not segment_full:
            return self._append(ids + tail, state, user_text, user_ids)
        if truncation != "auto":
            raise _too_large(need, budget, "the conversation with the new turn")
        if state.policy == "segment":
            return await self._new_segment(state, user_text, user_ids, budget, condense)
        if state.policy == "summary":
            return await self._summarize(ids + tail, state, user_text, user_ids, budget,
                                         condense)
        return self._window(ids + tail, state, user_text, user_ids, budget, "window",
                            await self._prefix(state))

    def _append(self, ids: list[int], state: ConversationState, user_text: str,
                user_ids: list[int], event: str | None = None) -> TurnPlan:
        state.turns.append(Turn(start=len(ids), user=user_text))
        state.total_turns += 1
        return TurnPlan(ids + user_ids, state, event)

    def _rebase(self, ids: list[int], state: ConversationState, keep_from: int,
                prefix: list[int]) -> list[int]:
        """``prefix`` + the turns from index ``keep_from`` on (their exact ids), offsets moved."""
        kept = state.turns[keep_from:]
        start = kept[0].start if kept else len(ids)
        for t in kept:
            t.start = t.start - start + len(prefix)
        state.turns = kept
        state.prefix_len = len(prefix)
        return prefix + ids[start:]

    def _window(self, ids: list[int], state: ConversationState, user_text: str,
                user_ids: list[int], budget: int, event: str, prefix: list[int]) -> TurnPlan:
        keep_from = 0
        while keep_from < len(state.turns):
            start = state.turns[keep_from].start
            if len(prefix) + len(ids) - start + len(user_ids) <= budget:
                break
            keep_from += 1
        new_ids = self._rebase(ids, state, keep_from, prefix)
        if len(new_ids) + len(user_ids) > budget:
            raise _too_large(len(new_ids) + len(user_ids), budget, "the new turn with its memory")
        return self._append(new_ids, state, user_text, user_ids, event)

    async def _summarize(self, ids: list[int], state: ConversationState, user_text: str,
                         user_ids: list[int], budget: int, condense: Condense) -> TurnPlan:
        target = LOW_WATER * budget
        room = state.prefix_len + SUMMARY_MAX_TOKENS + self.options.block_size
        cut = 0
        while cut < len(state.turns) and (
                room + len(ids) - state.turns[cut].start + len(user_ids) > target):
            cut += 1
        cut = max(cut, 1)
        condensed = state.turns[:cut]
        state.summary = (await condense("summary", summary_messages(state.summary, condensed),
                                        SUMMARY_MAX_TOKENS)).strip()
        state.rewrites += 1
        state.turns = state.turns[cut:]
        return self._window(ids, state, user_text, user_ids, budget, "summary",
                            await self._prefix(state))

    async def _new_segment(self, state: ConversationState, user_text: str, user_ids: list[int],
                           budget: int, condense: Condense) -> TurnPlan:
        note = (await condense("note", note_messages(state.turns), NOTE_MAX_TOKENS)).strip()
        state.notes = (state.notes + [note])[-CARRY_NOTES:]
        state.segment += 1
        state.turns = []
        prefix = await self._prefix(state)
        state.prefix_len = len(prefix)
        if len(prefix) + len(user_ids) > budget:
            raise _too_large(len(prefix) + len(user_ids), budget, "the new turn with its notes")
        plan = self._append(prefix, state, user_text, user_ids, "segment")
        plan.note = note
        return plan
