"""Pure suffix-array kernels over flat token arrays (no state, no I/O).

A corpus is one flat `int32` array of token ids with `SEP = -1` between documents and at the end. To find the
longest *suffix* of a context that occurs in the corpus we index the corpus reversed: a context suffix read
backwards is a *prefix* of a reversed-corpus suffix, so extending the match by one token narrows the current
suffix-array range (ranges of longer matches nest inside shorter ones) and one pass finds every match length.

Example: forward corpus `[5 6 7 SEP 5 6 8 SEP]`, context `[... 5 6]`:
    reversed corpus `R = [SEP 8 6 5 SEP 7 6 5]`, query = context reversed = `[6, 5, ...]`
    the range of suffixes of R starting `6` holds positions 2 and 6; starting `6 5` still both -> length 2,
    2 occurrences; they end (forward) at positions 1 and 5, continued by `[7]` and `[8]`.
"""

from __future__ import annotations

import numpy as np

SEP = -1  # document separator; sorts before every token id

# below this range size the next column is gathered and searched in one vectorised call
_GATHER = 2048
_PAST_END = -(2**62)  # a suffix that has ended sorts before every token and SEP


def build_suffix_array(tokens: np.ndarray) -> np.ndarray:
    """Suffix array of an integer array (suffix start positions in lexicographic order).

    Uses libdivsufsort through `pydivsufsort` when installed, else a numpy prefix-doubling sort
    (O(n log^2 n), fine up to a few million tokens).

    Args:
        tokens: `np.ndarray` of integers, shape `(n,)`.

    Returns:
        `np.ndarray` of `int32` (`int64` above 2^31 positions), shape `(n,)`.
    """
    tokens = np.ascontiguousarray(tokens)
    if len(tokens) == 0:
        return np.zeros(0, dtype=np.int32)
    try:
        from pydivsufsort import divsufsort
    except ImportError:
        return _prefix_doubling(tokens)
    sa = divsufsort(tokens.astype(np.int32, copy=False))
    return sa.astype(np.int32 if len(tokens) < 2**31 else np.int64, copy=False)


def _prefix_doubling(tokens: np.ndarray) -> np.ndarray:
    """Manber-Myers prefix doubling with numpy sorts: ranks of 2^k-token prefixes until all are distinct."""
    n = len(tokens)
    _, rank = np.unique(tokens, return_inverse=True)
    rank = rank.astype(np.int64) + 1  # 0 is "past the end": shorter suffixes sort first
    k = 1
    while True:
        second = np.zeros(n, dtype=np.int64)
        second[: n - k] = rank[k:] if k < n else 0
        order = np.lexsort((second, rank))
        key_r, key_s = rank[order], second[order]
        new_group = np.ones(n, dtype=np.int64)
        new_group[1:] = (key_r[1:] != key_r[:-1]) | (key_s[1:] != key_s[:-1])
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.cumsum(new_group)
        if rank.max() == n or k >= n:
            return order.astype(np.int32 if n < 2**31 else np.int64)
        k *= 2


def _narrow(text: np.ndarray, sa: np.ndarray, lo: int, hi: int, offset: int, token: int) -> tuple[int, int]:
    """Sub-range of `sa[lo:hi]` whose suffixes hold `token` at `offset` (they all share the first `offset`
    tokens, so that column is sorted inside the range)."""
    n = len(text)
    if hi - lo <= _GATHER:
        pos = sa[lo:hi].astype(np.int64) + offset
        col = text[np.minimum(pos, n - 1)].astype(np.int64)
        col[pos >= n] = _PAST_END
        return lo + int(np.searchsorted(col, token, "left")), lo + int(np.searchsorted(col, token, "right"))

    def column(i: int) -> int:
        p = int(sa[i]) + offset
        return int(text[p]) if p < n else _PAST_END

    a, b = lo, hi  # first index with column >= token
    while a < b:
        mid = (a + b) // 2
        if column(mid) < token:
            a = mid + 1
        else:
            b = mid
    start, b = a, hi  # first index with column > token
    while a < b:
        mid = (a + b) // 2
        if column(mid) <= token:
            a = mid + 1
        else:
            b = mid
    return start, a


def longest_suffix_match(
    reversed_text: np.ndarray, sa: np.ndarray, context: np.ndarray, max_len: int, min_len: int = 1
) -> tuple[int, int, int]:
    """Paper Algorithm 1 on a reversed-corpus suffix array: the longest `l` in `[min_len, max_len]` such that the
    context's last `l` tokens occur in the corpus.

    Args:
        reversed_text: the corpus reversed (`SEP`-separated), shape `(n,)`.
        sa: its suffix array, shape `(n,)`.
        context: `np.ndarray` of token ids, shape `(m,)`.

    Returns:
        `(l, lo, hi)`: match length (0 when even `min_len` tokens do not occur) and the suffix-array range
        `sa[lo:hi]` of the occurrences (each position is where the reversed match starts).
    """
    lo, hi = 0, len(sa)
    best = (0, 0, 0)
    for k in range(min(max_len, len(context))):
        token = int(context[-1 - k])
        if token < 0:
            break
        lo, hi = _narrow(reversed_text, sa, lo, hi, k, token)
        if lo >= hi:
            break
        if k + 1 >= min_len:
            best = (k + 1, lo, hi)
    return best


def continuations(text: np.ndarray, ends: np.ndarray, depth: int) -> np.ndarray:
    """The `depth` tokens after each forward position in `ends`, cut at the first `SEP` (padded with `SEP`).

    Args:
        text: forward corpus, shape `(n,)`, ending with `SEP`.
        ends: positions of the last matched token, shape `(k,)`.

    Returns:
        `np.ndarray` of shape `(k, depth)`.
    """
    n = len(text)
    idx = ends.astype(np.int64)[:, None] + 1 + np.arange(depth)[None, :]
    rows = text[np.minimum(idx, n - 1)].astype(np.int64)
    rows[idx >= n] = SEP
    dead = np.cumsum(rows == SEP, axis=1) > 0
    rows[dead] = SEP
    return rows


def scan_match_lengths(text: np.ndarray, context: np.ndarray, max_len: int) -> np.ndarray:
    """For every position `e` of a (small) `text`, how many of the context's last tokens end at `e`
    (capped at `max_len`): a vectorised scan used for the online part (prompt + generated text).

    Returns:
        `np.ndarray` of shape `(len(text),)`.
    """
    n = len(text)
    lengths = np.zeros(n, dtype=np.int64)
    alive = np.ones(n, dtype=bool)
    for k in range(min(max_len, len(context))):
        shifted = np.full(n, SEP, dtype=np.int64)
        shifted[k:] = text[: n - k] if k else text
        alive &= shifted == int(context[-1 - k])
        if not alive.any():
            break
        lengths += alive
    return lengths
