"""Incremental detokenization with stop strings, for streaming.

Decoding the whole output at every step costs O(n) per token; instead we decode a short window
of recent tokens and emit only the text that became stable (a token that ends in the middle of a
multi-byte character decodes to U+FFFD until the next token completes it). Text that could still
be the beginning of a stop string is held back until it is known not to be one; the stop string
itself is never part of the output (OpenAI semantics).
"""

from __future__ import annotations


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Args:
        tokenizer: a transformers tokenizer, or None (then text stays empty).
        stop: stop strings; generation ends at the first occurrence.
    """

    def __init__(self, tokenizer, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""  # all stable text decoded so far
        self.emitted = 0  # characters of self.text already returned

    def update(self, token_ids: list[int]) -> tuple[str, bool]:
        """Add the latest tokens (``token_ids`` is the whole output so far).

        Returns the newly emitted text and whether a stop string was found (the text is then
        cut just before it).
        """
        if self.tokenizer is None:
            return "", False
        self.text += self._decode_new(token_ids)
        stopped = self._cut_at_stop()
        end = len(self.text) if stopped else max(self.emitted, len(self.text) - self._hold)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta, stopped

    def flush(self) -> str:
        """Text still held back (call once when the request finishes for another reason)."""
        delta = self.text[self.emitted:]
        self.emitted = len(self.text)
        return delta

    def _decode_new(self, ids: list[int]) -> str:
        decode = self.tokenizer.decode
        before = decode(ids[self._prefix_offset:self._read_offset], skip_special_tokens=True)
        after = decode(ids[self._prefix_offset:], skip_special_tokens=True)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        return after[len(before):]

    def _cut_at_stop(self) -> bool:
        start = max(0, self.emitted - self._hold)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        return True
