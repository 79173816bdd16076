"""Prompts of exact token counts, cut from real text.

The text is Python's own documentation (``pydoc_data.topics``, ~465 K characters, shipped with
every CPython), so prompts are real English prose and code, not repeated filler that a tokenizer
compresses oddly. Each prompt starts with a unique header (``Document <uid>.``) and starts at a
different offset in the text, so two prompts never share a KV block and a server's prefix cache
cannot make a sweep look faster than it is.

Token counts come from, in order of preference:

1. the server's ``POST /tokenize`` (vLLM's shape ``{"model", "prompt"} -> {"count" | "tokens"}``,
   llama.cpp's ``{"content"} -> {"tokens"}``), once a known text got a plausible count
   (:meth:`ServerTokenizer.probe`): exact for that server;
2. a local transformers tokenizer (``--tokenizer``: a folder, or a ``.gguf`` file);
3. otherwise an estimate of 4 characters per token, flagged as approximate.

:func:`cut_to_tokens` finds the character cut whose prefix has exactly ``n`` tokens by
interpolation search; token counts of prefixes grow (almost) monotonically with their length.
"""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

import httpx

from kvledger.bench.target import Target
from kvledger.errors import KVLedgerError

CHARS_PER_TOKEN_GUESS = 4.0
PROBE_TEXT = "The quick brown fox jumps over the lazy dog, then naps under an old oak tree."
# A count for PROBE_TEXT (77 characters, 16 words) is plausible when it lies between one token
# per 12 characters and one per character plus a few special tokens; llama.cpp's answer to the
# key it does not know (``{"tokens": []}``) is not.
PROBE_MIN_TOKENS, PROBE_MAX_TOKENS = len(PROBE_TEXT) // 12, len(PROBE_TEXT) + 4
_STRIDE = 7919  # characters between the start offsets of consecutive prompts (a prime)


class TokenCounter:
    """Counts tokens of a text. ``exact`` says whether counts are the server's own."""

    exact = False
    source = "estimate (4 characters per token)"
    max_model_len: int | None = None

    def count(self, text: str) -> int:
        """Number of tokens the server would prefill for ``text`` as a completions prompt."""
        return max(1, math.ceil(len(text) / CHARS_PER_TOKEN_GUESS))


class ServerTokenizer(TokenCounter):
    """Counts with the server's ``POST /tokenize`` (vLLM or llama.cpp shape)."""

    exact = True

    def __init__(self, client: httpx.Client, target: Target, body_key: str) -> None:
        self.client, self.target, self.body_key = client, target, body_key
        self.source = f"server POST /tokenize ({'vLLM' if body_key == 'prompt' else 'llama.cpp'})"

    def _post(self, text: str) -> dict:
        body = {"model": self.target.model, self.body_key: text}
        response = self.client.post(
            f"{self.target.base_url}/tokenize", json=body, headers=self.target.headers
        )
        response.raise_for_status()
        return response.json()

    def count(self, text: str) -> int:
        return self._count_of(self._post(text))

    @classmethod
    def probe(cls, client: httpx.Client, target: Target) -> ServerTokenizer | None:
        """A ServerTokenizer if the server tokenizes in either shape, else None.

        A shape is taken only if it counts :data:`PROBE_TEXT` plausibly (between
        :data:`PROBE_MIN_TOKENS` and :data:`PROBE_MAX_TOKENS`): llama.cpp's server ignores
        the vLLM key ``prompt`` and answers ``{"tokens": []}``, which would make every prompt
        count 0 tokens and the cut search grow a prompt without end.
        """
        for key in ("prompt", "content"):
            tokenizer = cls(client, target, key)
            try:
                body = tokenizer._post(PROBE_TEXT)
                count = tokenizer._count_of(body)
            except (httpx.HTTPError, ValueError, TypeError, KeyError):
                continue
            if PROBE_MIN_TOKENS <= count <= PROBE_MAX_TOKENS:
                if isinstance(body.get("max_model_len"), int):
                    tokenizer.max_model_len = body["max_model_len"]
                return tokenizer
        return None

    @staticmethod
    def _count_of(body: dict) -> int:
        """Token count of a /tokenize answer: vLLM's ``count``, else ``len(tokens)``."""
        return int(body["count"]) if "count" in body else len(body["tokens"])


class LocalTokenizer(TokenCounter):
    """Counts with a transformers tokenizer from a local folder or GGUF file."""

    exact = True

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        p = Path(path).expanduser()
        if not p.exists():
            raise KVLedgerError(f"--tokenizer path not found: {p}")
        if p.is_file() and p.suffix == ".gguf":
            self.tokenizer = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
        else:
            self.tokenizer = AutoTokenizer.from_pretrained(str(p))
        self.source = f"local tokenizer {p}"

    def count(self, text: str) -> int:
        return len(self.tokenizer(text)["input_ids"])


def make_counter(client: httpx.Client, target: Target, tokenizer: str | None) -> TokenCounter:
    """The best available counter: server /tokenize, else ``tokenizer`` path, else estimate."""
    server = ServerTokenizer.probe(client, target)
    if server is not None:
        return server
    if tokenizer:
        return LocalTokenizer(tokenizer)
    return TokenCounter()


@lru_cache(maxsize=1)
def corpus() -> str:
    """Python's documentation topics joined into one text (deterministic order)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key].strip() for key in sorted(topics))


def source_text(uid: str, chars: int) -> str:
    """``chars`` characters of real text: a unique header, then the corpus from an offset."""
    text = corpus()
    start = (sum(map(ord, uid)) * _STRIDE + len(uid)) % len(text)
    body = (text[start:] + "\n\n" + text) * (1 + chars // len(text))
    return f"Document {uid}.\n" + body[:chars]


def cut_to_tokens(counter: TokenCounter, text: str, n: int) -> tuple[str, int]:
    """A prefix of ``text`` with ``n`` tokens, and its token count.

    The count equals ``n`` unless no character cut lands exactly on ``n`` (then the closest
    count below ``n``) or ``text`` itself has at most ``n`` tokens (then all of it).
    """
    total = counter.count(text)
    if total <= n:
        return text, total
    lo, lo_count, hi, hi_count = 0, 0, len(text), total
    k = min(len(text) - 1, max(1, round(n * CHARS_PER_TOKEN_GUESS)))
    for _ in range(64):
        count = counter.count(text[:k])
        if count == n:
            return text[:k], n
        if count < n:
            lo, lo_count = k, count
        else:
            hi, hi_count = k, count
        if hi - lo <= 1:
            break
        guess = lo + round((n - lo_count) * (hi - lo) / max(1, hi_count - lo_count))
        k = min(hi - 1, max(lo + 1, guess))
    return text[:lo], lo_count


def make_prompt(counter: TokenCounter, uid: str, n: int) -> tuple[str, int]:
    """A prompt of ``n`` tokens (as counted by ``counter``) and its count; unique per ``uid``."""
    chars = int(n * CHARS_PER_TOKEN_GUESS * 2) + 256
    while True:
        text = source_text(uid, chars)
        prompt, count = cut_to_tokens(counter, text, n)
        if prompt != text or chars > 64 * len(corpus()):
            return prompt, count
        chars *= 2
