"""Whether drafting pays for a batch, decided from rounds timed as they run.

At batch size B one verification forward takes B * (1 + nodes) query rows. On a GPU a few extra rows per sequence
cost next to nothing; on a CPU they cost compute, and with several rows a plain batched step can commit more tokens
per second than drafted rounds. A round with no tree is exactly such a plain step (one row per sequence), so the
batched loop can do either in any round, with the same output. `DraftSwitch` keeps the committed tokens per second
of both kinds of round and drafts while drafted rounds are faster, trying the other kind again now and then (the
cache grows, rows leave the batch, acceptance changes with the text).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DraftSwitch:
    """Per-batch choice between drafted rounds and plain steps.

    Each kind's rate is its committed tokens over its seconds since the batch began (a round's tokens vary too much
    to judge from a few), so the choice settles; the losing kind is tried again after `probe_every` rounds,
    scaled by how far it is behind (a kind 3x slower is tried a third as often).

    Args:
        warmup: drafted rounds measured first (the first one, which also feeds the prompt to draft heads, is not
            counted); then one plain step.
        probe_every: rounds between tries of the losing kind when the two are close.
    """

    warmup: int = 4
    probe_every: int = 16
    totals: dict[bool, list[float]] = field(default_factory=dict)  # kind -> [tokens, seconds]
    seen: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    since_probe: int = 0

    def draft_now(self) -> bool:
        if self.seen[True] <= self.warmup:
            return True
        if not self.seen[False]:
            return False
        drafted, plain = self.rate(True), self.rate(False)
        best = drafted >= plain
        self.since_probe += 1
        if self.since_probe > self.probe_every * max(drafted, plain) / max(min(drafted, plain), 1e-9):
            self.since_probe = 0
            return not best
        return best

    def record(self, drafted: bool, tokens: int, seconds: float) -> None:
        """A round of the given kind committed `tokens` (all rows) in `seconds` (drafting included)."""
        self.seen[drafted] += 1
        if drafted and self.seen[True] == 1:
            return  # the first drafted round also feeds the prompt to draft heads
        total = self.totals.setdefault(drafted, [0.0, 0.0])
        total[0] += tokens
        total[1] += seconds

    def rate(self, drafted: bool) -> float:
        """Committed tokens per second of the given kind of round so far (0 before any)."""
        tokens, seconds = self.totals.get(drafted, (0.0, 0.0))
        return tokens / seconds if seconds > 0 else 0.0

    @property
    def drafting_pays(self) -> bool | None:
        """Whether drafted rounds are faster so far (`None` before both kinds were measured)."""
        if len(self.totals) < 2:
            return None
        return self.rate(True) >= self.rate(False)
