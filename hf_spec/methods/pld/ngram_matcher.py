"""Pure n-gram matcher behind prompt-lookup drafting."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def find_continuations(
    tokens: np.ndarray, max_ngram: int, min_ngram: int, length: int, max_candidates: int
) -> tuple[list[list[int]], int]:
    """Continuations that followed earlier occurrences of the context's last n-gram.

    Longer n-grams are tried first; within one n, the most recent occurrence comes first. Continuations are
    cut to `length` tokens; at most `max_candidates` distinct ones are returned.

    Example: tokens = [5 6 7 5 6 8 5 6], max_ngram=2, min_ngram=2, length=3 ->
        the suffix (5, 6) occurred at positions 3 and 0 -> ([[8, 5, 6], [7, 5, 6]], 2)

    Returns the continuations and the longest n-gram that matched (0 if none).
    """
    n_tokens = len(tokens)
    found: list[list[int]] = []
    best = 0
    seen: set[tuple[int, ...]] = set()
    for n in range(min(max_ngram, n_tokens - 1), min_ngram - 1, -1):
        # windows that end before the last token, so each has at least one continuation token
        windows = sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        for start in hits[::-1]:
            cont = tokens[start + n : start + n + length]
            key = tuple(cont.tolist())
            if key in seen:
                continue
            seen.add(key)
            found.append(list(key))
            best = max(best, n)
            if len(found) >= max_candidates:
                return found, best
    return found, best


def first_continuation(tokens: np.ndarray, max_ngram: int, length: int) -> list[int]:
    """Prompt lookup's candidate by transformers' rule (`PromptLookupCandidateGenerator`): the continuation of the
    leftmost earlier occurrence of the context's last n-gram, n from `max_ngram` down to 1, cut to `length`
    tokens and at the context's end; `[]` when nothing matches.

    Example: tokens = [5 6 7 5 6 8 5 6], max_ngram=2, length=3 -> (5, 6) first occurs at 0 -> [7, 5, 6]
    """
    n_tokens = len(tokens)
    for n in range(min(max_ngram, n_tokens - 1), 0, -1):
        windows = sliding_window_view(tokens[:-1], n)  # windows ending before the last token
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if len(hits):
            start = int(hits[0]) + n
            return tokens[start : start + length].tolist()
    return []
