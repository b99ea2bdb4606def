"""Post-use token cache (Holistic Token Efficient Speculative Decoding, Sec. "Post-use"): verified short
phrases, indexed by their first (anchor) token, recycled as draft tokens.

Rules (paper values in brackets):
- a phrase is a tuple of 2..beta tokens [5]; `phrase[0]` is its anchor, `phrase[1:]` what it proposes;
- each anchor holds a LIFO stack of phrases, newest on top; at most `max_phrases` [kappa_phase = 20] per
  anchor, the oldest is evicted;
- at most `max_anchors` [kappa_pool = 1000] anchors; admitting a new anchor into a full pool evicts the
  least-used anchor (fewest uses, then least recently used); a use is an admission or a lookup that hits;
- admitting a phrase refreshes it: an identical phrase, or one that is a prefix of the new phrase, is removed
  and the new one pushed on top; a new phrase that is a prefix of a stored one moves that one to the top.

Example (beta = 3)::

    cache.admit([5, 6, 7]); cache.admit([5, 8]); cache.lookup(5, 2) -> [(5, 8), (5, 6, 7)]
    cache.admit([5, 6]) -> (5, 6, 7) moves to the top: lookup(5, 2) -> [(5, 6, 7), (5, 8)]
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


class TokenCache:
    """Bounded anchor -> LIFO phrase stacks. Pure Python; every operation touches one stack; the least-used
    anchor comes from a heap of `(uses, last use, anchor)` with stale entries skipped (O(log pool))."""

    def __init__(self, max_anchors: int = 1000, max_phrases: int = 20, phrase_length: int = 5) -> None:
        if max_anchors < 1 or max_phrases < 1 or phrase_length < 2:
            raise ValueError("TokenCache needs max_anchors >= 1, max_phrases >= 1 and phrase_length >= 2")
        self.max_anchors = max_anchors
        self.max_phrases = max_phrases
        self.phrase_length = phrase_length
        self._stacks: dict[int, list[tuple[int, ...]]] = {}  # anchor -> phrases, newest LAST
        self._uses: dict[int, int] = {}
        self._last_use: dict[int, int] = {}
        self._clock = 0
        self._heap: list[tuple[int, int, int]] = []  # (uses, last use, anchor); stale when they changed

    # ---- queries ----------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Number of anchors."""
        return len(self._stacks)

    @property
    def num_phrases(self) -> int:
        return sum(len(s) for s in self._stacks.values())

    def __contains__(self, anchor: int) -> bool:
        return anchor in self._stacks

    def phrases(self, anchor: int) -> list[tuple[int, ...]]:
        """All phrases of `anchor`, newest first (no use is counted)."""
        return self._stacks.get(anchor, [])[::-1]

    def lookup(self, anchor: int, k: int) -> list[tuple[int, ...]]:
        """Up to `k` phrases starting with `anchor`, newest first; a hit counts as a use of the anchor."""
        stack = self._stacks.get(anchor)
        if not stack or k <= 0:
            return []
        self._touch(anchor)
        return stack[: -k - 1 : -1]

    # ---- updates ----------------------------------------------------------------------------------
    def admit(self, phrase: Sequence[int]) -> None:
        """Push a verified phrase (cut to `phrase_length`); phrases shorter than 2 tokens are ignored."""
        phrase = tuple(int(t) for t in phrase[: self.phrase_length])
        if len(phrase) < 2:
            return
        anchor = phrase[0]
        stack = self._stacks.get(anchor)
        if stack is None:
            if len(self._stacks) >= self.max_anchors:
                self._evict_anchor()
            stack = self._stacks[anchor] = []
            self._uses[anchor] = 0
        self._touch(anchor)
        longer = next((p for p in reversed(stack) if p[: len(phrase)] == phrase and p != phrase), None)
        if longer is not None:  # already known with more context: refresh that one
            stack.remove(longer)
            stack.append(longer)
            return
        stack[:] = [p for p in stack if phrase[: len(p)] != p]  # drop copies and prefixes of the new phrase
        stack.append(phrase)
        if len(stack) > self.max_phrases:
            del stack[0]  # the oldest

    def clear(self) -> None:
        self._stacks.clear()
        self._uses.clear()
        self._last_use.clear()
        self._heap.clear()

    def _touch(self, anchor: int) -> None:
        self._clock += 1
        self._uses[anchor] += 1
        self._last_use[anchor] = self._clock
        heapq.heappush(self._heap, (self._uses[anchor], self._clock, anchor))
        if len(self._heap) > 4 * self.max_anchors + 64:  # drop stale entries now and then
            self._heap = [(self._uses[a], self._last_use[a], a) for a in self._stacks]
            heapq.heapify(self._heap)

    def _evict_anchor(self) -> None:
        """Remove the anchor with the fewest uses, the least recently used among those."""
        while True:
            uses, last, anchor = heapq.heappop(self._heap)
            if self._last_use.get(anchor) == last:  # a live entry (every touch has its own clock value)
                break
        del self._stacks[anchor], self._uses[anchor], self._last_use[anchor]
