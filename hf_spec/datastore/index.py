"""`TokenIndex`: a flat token array + reversed suffix array, searchable for the longest context suffix."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hf_spec.datastore.suffix_array import (
    SEP,
    build_suffix_array,
    continuations,
    longest_suffix_match,
    scan_match_lengths,
)


@dataclass
class Matches:
    """Continuations found for a context.

    Args:
        length: tokens of the context's suffix that matched (0: nothing matched).
        occurrences: how often that suffix occurs (all of them, not only the sampled ones).
        sequences: `np.ndarray` of shape `(k, depth)`, distinct continuations padded with `SEP` (-1).
        counts: `np.ndarray` of shape `(k,)`, how many sampled occurrences each continuation has.
    """

    length: int
    occurrences: int
    sequences: np.ndarray  # [k, depth]
    counts: np.ndarray  # [k]

    @classmethod
    def none(cls, depth: int) -> Matches:
        return cls(0, 0, np.zeros((0, depth), dtype=np.int64), np.zeros(0, dtype=np.int64))


def group_continuations(rows: np.ndarray, length: int, occurrences: int) -> Matches:
    """Distinct non-empty continuation rows with their counts, most frequent first (ties: smaller row)."""
    depth = rows.shape[1]
    rows = rows[rows[:, 0] != SEP] if len(rows) else rows
    if not len(rows):
        return Matches(
            length if occurrences else 0, occurrences, np.zeros((0, depth), np.int64), np.zeros(0, np.int64)
        )
    uniq, counts = np.unique(rows, axis=0, return_counts=True)
    order = np.argsort(-counts, kind="stable")
    return Matches(length, occurrences, uniq[order], counts[order])


class TokenIndex:
    """Documents of token ids in one flat array, indexed for longest-suffix search.

    Example:
        >>> index = TokenIndex.from_documents([[5, 6, 7], [5, 6, 8]])
        >>> m = index.search(np.array([1, 5, 6]), max_len=4, depth=2)
        >>> m.length, m.sequences.tolist(), m.counts.tolist()
        (2, [[7, -1], [8, -1]], [1, 1])
    """

    def __init__(self, text: np.ndarray, sa: np.ndarray | None = None) -> None:
        text = np.asarray(text)
        if len(text) and text[-1] != SEP:
            raise ValueError("a TokenIndex text must end with the separator -1")
        self.text = text  # [n] forward, SEP-separated
        self.reversed = np.ascontiguousarray(text[::-1])
        self.sa = build_suffix_array(self.reversed) if sa is None else sa  # [n]

    @classmethod
    def from_documents(cls, documents: Iterable[Iterable[int]]) -> TokenIndex:
        return cls(flatten_documents(documents))

    @property
    def num_tokens(self) -> int:
        return int(len(self.text))

    @property
    def nbytes(self) -> int:
        return int(self.text.nbytes + self.reversed.nbytes + self.sa.nbytes)

    def search(
        self, context: np.ndarray, max_len: int, depth: int, min_len: int = 1, max_occurrences: int = 256
    ) -> Matches:
        """Longest suffix of `context` (at most `max_len`, at least `min_len` tokens) found in the index, and the
        `depth`-token continuations of up to `max_occurrences` of its occurrences (evenly spaced in suffix
        order when there are more)."""
        if not len(self.sa):
            return Matches.none(depth)
        length, lo, hi = longest_suffix_match(self.reversed, self.sa, context, max_len, min_len)
        if length == 0:
            return Matches.none(depth)
        count = hi - lo
        picks = (
            np.arange(lo, hi)
            if count <= max_occurrences
            else np.linspace(lo, hi - 1, max_occurrences).astype(np.int64)
        )
        ends = (
            len(self.text) - 1 - self.sa[picks].astype(np.int64)
        )  # forward position of the matched last token
        return group_continuations(continuations(self.text, ends, depth), length, count)

    # ---- persistence ----------------------------------------------------------------------------
    def save(self, folder: str | Path) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        np.save(folder / "tokens.npy", self.text)
        np.save(folder / "suffix_array.npy", self.sa)

    @classmethod
    def load(cls, folder: str | Path, mmap: bool = True) -> TokenIndex:
        folder = Path(folder)
        mode = "r" if mmap else None
        text = np.load(folder / "tokens.npy", mmap_mode=mode)
        sa = np.load(folder / "suffix_array.npy", mmap_mode=mode)
        if len(sa) != len(text):
            raise ValueError(f"{folder}: suffix array and token array lengths differ; rebuild the datastore")
        if not (np.issubdtype(text.dtype, np.integer) and np.issubdtype(sa.dtype, np.integer)):
            raise ValueError(
                f"{folder}: token / suffix arrays of dtype {text.dtype} / {sa.dtype}, not integers"
            )
        if len(sa) and (int(sa.min()) < 0 or int(sa.max()) >= len(text)):
            raise ValueError(f"{folder}: suffix array points outside the token array; rebuild the datastore")
        return cls(text, sa)


def flatten_documents(documents: Iterable[Iterable[int]]) -> np.ndarray:
    """`[[5, 6], [7]]` -> `[5, 6, -1, 7, -1]` as `int32`."""
    parts: list[np.ndarray] = []
    for doc in documents:
        arr = np.asarray(list(doc) if not isinstance(doc, np.ndarray) else doc, dtype=np.int32)
        if len(arr):
            if (arr < 0).any():
                raise ValueError("token ids must be non-negative")
            parts.append(arr)
            parts.append(np.array([SEP], dtype=np.int32))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


def scan_search(text: np.ndarray, context: np.ndarray, max_len: int, depth: int, min_len: int = 1) -> Matches:
    """The same answer as `TokenIndex.search` (without sampling) by a vectorised scan of a small forward `text`
    (`SEP`-separated); used for the growing prompt + generated text. Positions whose continuation would be
    empty (the text's end) do not count."""
    if len(text) < 2:
        return Matches.none(depth)
    lengths = scan_match_lengths(text[:-1], context, max_len)  # the last position has no continuation
    best = int(lengths.max()) if len(lengths) else 0
    if best < min_len:
        return Matches.none(depth)
    ends = np.flatnonzero(lengths == best)
    return group_continuations(continuations(text, ends, depth), best, len(ends))
