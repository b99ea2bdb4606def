"""Pure helpers: cutting verified phrases out of a round (grafting cached phrases onto the verification tree is
`hf_spec.tree.fusion.graft`)."""

from __future__ import annotations


def agreeing_runs(tokens: list[int], agree: list[bool]) -> list[list[int]]:
    """Phrases of useful tokens (paper Eq. 7) along a drafted chain: each maximal run of positions the target
    agrees with, behind its anchor (the token before the run; `tokens[0]` is the root, never judged).

    Example: tokens [r, a, b, c, d, e], agree [T, F, T, T, F] (for a..e) -> [[r, a], [b, c, d]].
    """
    runs: list[list[int]] = []
    i = 0
    while i < len(agree):
        if not agree[i]:
            i += 1
            continue
        j = i
        while j < len(agree) and agree[j]:
            j += 1
        runs.append(tokens[i : j + 1])  # anchor tokens[i] = the token before position i + 1
        i = j
    return runs


def windows(phrase: list[int], length: int) -> list[list[int]]:
    """Every phrase of up to `length` tokens starting inside `phrase` (at least 2 tokens each)."""
    return [phrase[s : s + length] for s in range(len(phrase) - 1)]
