"""Retrieve-then-stitch: documents cut into chunks, ranked by BM25 against each question.

A long document pasted whole into every turn costs its KV on every turn; instead it is cut into
chunks of about :data:`CHUNK_WORDS` words (paragraphs kept whole when they fit), indexed with
``bm25s`` (Okapi BM25, English stopwords), and each turn stitches only the ``k`` best chunks
for the user's text into its message. Segment notes are indexed the same way.

The query is the user's text less the terms the prompt already holds (its system turn, summary,
notes and kept turns): a passage is stitched only when it matches something the prompt lacks.
Without that rule the words every turn repeats ("Turn", "passage", "sentence" of a templated
message) matched some old note on every turn, and each stitched note pushed a ``segment``
conversation past its segment budget (see BENCHMARKS.md, sessions).
"""

from __future__ import annotations

import base64
import binascii
import re
from collections import OrderedDict
from collections.abc import Iterable

import bm25s

from kvledger.errors import InvalidParameterError
from kvledger.sessions.errors import DocumentTooLargeError
from kvledger.sessions.store import Chunk

CHUNK_WORDS = 120
MAX_DOCUMENT_BYTES = 1 << 20
INDEX_CACHE_SIZE = 32  # conversations whose index is kept between turns


def decode_document(file_data: str, filename: str, max_bytes: int = MAX_DOCUMENT_BYTES) -> str:
    """The text of an ``input_file`` part: base64 or a ``data:...;base64,`` URL of UTF-8 text.

    Raises:
        DocumentTooLargeError: more than ``max_bytes`` bytes once decoded (HTTP 413).
        InvalidParameterError: not base64, not UTF-8, or binary (a NUL byte) (HTTP 400).
    """
    payload = file_data.partition(",")[2] if file_data.startswith("data:") else file_data
    if len(payload) * 3 // 4 > max_bytes + 3:
        raise DocumentTooLargeError(
            f"document {filename!r} is larger than {max_bytes} bytes; attach a smaller text")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidParameterError(f"document {filename!r}: file_data is not base64") from None
    if len(raw) > max_bytes:
        raise DocumentTooLargeError(f"document {filename!r} has {len(raw)} bytes; the most "
                                    f"accepted is {max_bytes}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is None or "\x00" in text:
        raise InvalidParameterError(f"document {filename!r} is not UTF-8 text; only plain-text "
                                    "documents can be attached")
    if not text.strip():
        raise InvalidParameterError(f"document {filename!r} is empty")
    return text


def chunk_text(text: str, words_per_chunk: int = CHUNK_WORDS) -> list[str]:
    """Cut ``text`` into chunks of at most ``words_per_chunk`` words at paragraph boundaries
    (a longer paragraph is cut between words)."""
    chunks: list[str] = []
    current: list[str] = []
    for paragraph in re.split(r"\n\s*\n", text):
        words = paragraph.split()
        while len(words) > words_per_chunk:
            if current:
                chunks.append(" ".join(current))
                current = []
            chunks.append(" ".join(words[:words_per_chunk]))
            words = words[words_per_chunk:]
        if current and len(current) + len(words) > words_per_chunk:
            chunks.append(" ".join(current))
            current = []
        current.extend(words)
    if current:
        chunks.append(" ".join(current))
    return chunks


def _tokens(texts: list[str]) -> list[list[str]]:
    return bm25s.tokenize(texts, stopwords="en", return_ids=False, show_progress=False)


class Retriever:
    """Ranks a conversation's chunks by BM25; keeps recent indexes (keyed by chunk ids)."""

    def __init__(self) -> None:
        self._cache: OrderedDict[tuple[int, ...], bm25s.BM25] = OrderedDict()

    def _index(self, chunks: list[Chunk]) -> bm25s.BM25:
        key = tuple(c.id for c in chunks)
        index = self._cache.get(key)
        if index is None:
            index = bm25s.BM25()
            index.index(_tokens([c.text for c in chunks]), show_progress=False)
            self._cache[key] = index
            if len(self._cache) > INDEX_CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return index

    def top_k(self, chunks: list[Chunk], query: str, k: int, exclude: set[int] = frozenset(),
              known: Iterable[str] = ()) -> list[tuple[Chunk, float]]:
        """The best ``k`` chunks for ``query`` with a positive BM25 score, best first.

        Chunks whose id is in ``exclude`` (already in the prompt) are skipped, and the terms
        of the ``known`` texts (what the prompt already says) are dropped from the query, so
        a chunk that matches only those terms scores 0 and is not returned.
        """
        candidates = [c for c in chunks if c.id not in exclude]
        # a chunk of stopwords only (e.g. an empty note) has no terms; bm25s cannot index it
        candidates = [c for c, terms in zip(candidates, _tokens([c.text for c in candidates]),
                                            strict=True) if terms]
        known_texts = [text for text in known if text]
        known_terms = ({term for terms in _tokens(known_texts) for term in terms}
                       if known_texts else set())
        query_tokens = [term for term in _tokens([query])[0] if term not in known_terms]
        if not candidates or not query_tokens or k < 1:
            return []
        index = self._index(candidates)
        docs, scores = index.retrieve([query_tokens], k=min(k, len(candidates)),
                                      show_progress=False)
        return [(candidates[int(i)], float(s)) for i, s in zip(docs[0], scores[0]) if s > 0]
