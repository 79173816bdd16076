"""Token pieces of a conversation, cut out of the model's own chat template.

Re-rendering a whole history through the chat template and re-tokenising it is how prefix
reuse breaks: the reply's text may not tokenise back to the ids the model generated, and
templates render history differently from a live turn. Instead, a conversation's ids are
grown by appending pieces, each rendered once:

- the **prefix**: the system turn (the template's default system turn when there is no
  instruction) — ``render([system])``;
- a **user turn**: the text the template adds for one more user message plus the generation
  prompt — ``render(probe + [user], add_generation_prompt=True)`` minus ``render(probe)``;
- a **turn of messages** (a stateless Responses turn: earlier replies, tool calls and their
  results, then a user message or a result): ``render(probe + messages,
  add_generation_prompt=True)`` minus ``render(probe)``;
- the **closing tail** of the previous reply: what the template writes after an assistant
  message's content (ChatML: ``<|im_end|>\\n``), less the end-of-turn token when the model
  already generated it.

Each piece is found by rendering probe conversations and cutting at known marker strings, so
any template that renders a conversation as a concatenation of its turns works; one that does
not is refused with ``InvalidParameterError``. Pieces are tokenised separately (no merge can
happen across a boundary) and without the tokenizer's automatic BOS.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvledger.errors import InvalidParameterError

_SYS, _USER, _REPLY = "\x00sys\x00", "\x00user\x00", "\x00reply\x00"
_PROBE = [{"role": "system", "content": _SYS}, {"role": "user", "content": _USER},
          {"role": "assistant", "content": _REPLY}]


@dataclass(frozen=True)
class _Template:
    user_before: str  # text of a user turn before its content
    user_after: str  # ... after it, generation prompt included
    tail: str  # what follows an assistant reply's content
    default_prefix: str  # what the template puts before the first user turn with no system turn
    probe_reply: str  # the probe conversation rendered up to its reply's closing tail


class TurnCodec:
    """Token ids of conversation pieces for one tokenizer (an HF tokenizer with a template).

    Args:
        tokenizer: provides ``apply_chat_template(messages, tokenize=False,
            add_generation_prompt=...)``, ``encode(text, add_special_tokens=False)`` and
            ``eos_token`` (may be None).
        eos_token_ids: ids that end a generated reply (the model's EOS set).

    Raises:
        InvalidParameterError: the chat template does not render turns by concatenation.
    """

    def __init__(self, tokenizer, eos_token_ids: set[int] | frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self._t = self._probe()
        pads = self.encode(" ")
        self.pad_id: int | None = pads[0] if len(pads) == 1 else None

    def _render(self, messages: list[dict], generation: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=generation)

    def _probe(self) -> _Template:
        base = [{"role": "system", "content": _SYS}, {"role": "user", "content": _USER}]
        r_base = self._render(base)
        r_gen = self._render(base, generation=True)
        r_user = self._render(base + [{"role": "assistant", "content": _REPLY},
                                      {"role": "user", "content": _USER}], generation=True)
        r_reply = self._render(base + [{"role": "assistant", "content": _REPLY}])
        r_alone = self._render([{"role": "user", "content": _USER}])
        if not (r_gen.startswith(r_base) and r_reply.startswith(r_base)
                and r_user.startswith(r_reply) and _REPLY in r_reply):
            raise InvalidParameterError(
                "this model's chat template does not render a conversation as a concatenation "
                "of its turns; server-side sessions cannot extend it token-exactly")
        user_turn = r_user[len(r_reply):]
        before, _, after = user_turn.partition(_USER)
        tail = r_reply[r_reply.index(_REPLY) + len(_REPLY):]
        if _USER not in user_turn or not r_alone.endswith(r_base[r_base.index(_USER):]):
            raise InvalidParameterError("this model's chat template renders user turns "
                                        "differently by position; cannot extend token-exactly")
        alone_user = r_alone.rindex(before + _USER)
        return _Template(before, after, tail, r_alone[:alone_user], r_reply)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with no BOS added (special-token strings become their ids)."""
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def prefix_ids(self, system: str | None) -> list[int]:
        """The system turn: ``system`` as the system message, or the template's default."""
        if system is None:
            return self.encode(self._t.default_prefix)
        return self.encode(self._render([{"role": "system", "content": system}]))

    def user_turn_ids(self, text: str) -> list[int]:
        """One user message and the generation prompt (the tokens the model answers)."""
        return self.encode(self._t.user_before + text + self._t.user_after)

    def messages_ids(self, messages: list[dict]) -> list[int]:
        """Chat messages (any roles, ``tool_calls``, ``tool``) and the generation prompt, as
        the template renders them after a reply.

        Raises:
            InvalidParameterError: the template renders the earlier turns differently when
                these follow them.
        """
        before = self._t.probe_reply
        rendered = self._render(_PROBE + messages, generation=True)
        if not rendered.startswith(before):
            raise InvalidParameterError(
                "this model's chat template renders a conversation differently when these "
                "messages follow it; server-side sessions cannot extend it token-exactly")
        return self.encode(rendered[len(before):])

    def tail_ids(self, reply_ids: list[int]) -> list[int]:
        """What closes a reply whose generated ids are ``reply_ids`` before the next turn."""
        tail = self._t.tail
        eos = self.tokenizer.eos_token
        if reply_ids and reply_ids[-1] in self.eos_token_ids and eos and tail.startswith(eos):
            tail = tail[len(eos):]
        return self.encode(tail)

    def pad_to_block(self, ids: list[int], block_size: int) -> list[int]:
        """``ids`` of a prefix padded with spaces before its end-of-turn token to whole blocks.

        Unchanged when the tokenizer has no one-token space or the prefix has no EOS token
        (the padding then goes at the end).
        """
        missing = -len(ids) % block_size
        if not missing or self.pad_id is None:
            return ids
        cut = max((i for i, t in enumerate(ids) if t in self.eos_token_ids), default=len(ids))
        return ids[:cut] + [self.pad_id] * missing + ids[cut:]
