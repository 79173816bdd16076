"""Who proposes a sequence's next tokens: the method of the ``speculative_config``.

``ngram`` looks the sequence's end up in its own prompt and output (:mod:`.ngram`); ``suffix``
also in the outputs of recent requests (:mod:`.suffix`); ``auto`` is ``suffix``. The proposer
keeps no per-request state: the suffix index holds finished requests' tokens only, added by
:meth:`Proposer.finished`.
"""

from __future__ import annotations

import numpy as np

from kvledger.engine.spec.config import SpeculativeConfig
from kvledger.engine.spec.ngram import lookup
from kvledger.engine.spec.suffix import SuffixIndex


class Proposer:
    """Proposals of the configured method (``config.method`` other than ``off``)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.suffix = (SuffixIndex(config.prompt_lookup_min, config.prompt_lookup_max,
                                   config.suffix_decoding_max_cached_requests)
                       if config.method in ("suffix", "auto") else None)

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], str]:
        """(up to ``k`` tokens to follow ``tokens``, the method that found them: ``ngram`` or
        ``suffix``; ``[]`` when none matched)."""
        c = self.config
        local, n = lookup(np.asarray(tokens, dtype=np.int64), k, c.prompt_lookup_min,
                          c.prompt_lookup_max)
        if self.suffix is None or len(local) == k:
            return local, "ngram"
        shared, m = self.suffix.propose(tokens, k)
        if m > n or (m == n and len(shared) > len(local)):
            return shared, "suffix"
        return local, "ngram"

    def finished(self, prompt: list[int], output: list[int]) -> None:
        """A request finished: its output enters the suffix index (``suffix`` / ``auto``)."""
        if self.suffix is not None and output:
            self.suffix.add(prompt, output)
