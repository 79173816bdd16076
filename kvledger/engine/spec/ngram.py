"""Prompt lookup (n-gram) proposals: the tokens that followed the latest earlier occurrence of
the sequence's last n tokens (Saxena 2023, vLLM's ``ngram`` method, llama.cpp's
``ngram-simple``).

The longest n in ``[n_min, n_max]`` with an earlier occurrence wins; among its occurrences
the latest one is taken (the most recent context is the likeliest to be copied again). The
search is one vectorised comparison per n over the request's prompt and output.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def lookup(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> tuple[list[int], int]:
    """(up to ``k`` proposed tokens, the length of the n-gram matched; 0 without a match).

    Args:
        tokens: the sequence so far (prompt + output), int64.
        k: most tokens proposed.
        n_min, n_max: shortest and longest n-gram matched against the sequence's end.
    """
    size = len(tokens)
    if k <= 0:
        return [], 0
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        windows = sliding_window_view(tokens[: size - 1], n)  # starts 0 .. size - 1 - n
        hits = np.flatnonzero((windows == tokens[size - n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start: start + k].tolist(), n
    return [], 0
