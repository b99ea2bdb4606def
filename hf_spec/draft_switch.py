"""Whether drafting pays for a batch, decided from rounds timed as they run.

At batch size B one verification forward takes B * (1 + nodes) query rows. On a GPU a few extra rows per sequence
cost next to nothing; on a CPU they cost compute: measured on a 2-core AMD EPYC (float32, Qwen2.5-Coder-0.5B, batch
5, 96 new tokens), HASS chain-of-2 rounds ran at 1.93x stock batched `generate`, its 12-node trees at 0.59x, and
plain batched decoding on hf-spec's kernels at 2.27x. A round with no tree is exactly such a plain step (one row
per sequence), so the batched loop can do either in any round, with the same output. `DraftSwitch` keeps the
committed tokens per second of both kinds of round and drafts while drafted rounds are faster, trying the other
kind again every `probe_every` rounds (the cache grows, rows leave the batch, acceptance changes with the text).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DraftSwitch:
    """Per-batch choice between drafted rounds and plain steps.

    Args:
        warmup: drafted rounds measured first (the first one, which also feeds the prompt to draft heads, is not
            counted).
        probe_every: rounds between tries of the kind currently losing.
        smoothing: weight of the newest round in each kind's running rate.
    """

    warmup: int = 3
    probe_every: int = 16
    smoothing: float = 0.3
    rate: dict[bool, float] = field(
        default_factory=dict
    )  # tokens/s of drafted (True) and plain (False) rounds
    seen: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    since_probe: int = 0

    def draft_now(self) -> bool:
        if self.seen[True] <= self.warmup:
            return True
        if not self.seen[False]:
            return False
        best = self.rate[True] >= self.rate[False]
        self.since_probe += 1
        if self.since_probe > self.probe_every:
            self.since_probe = 0
            return not best
        return best

    def record(self, drafted: bool, tokens: int, seconds: float) -> None:
        """A round of the given kind committed `tokens` (all rows) in `seconds` (drafting included)."""
        self.seen[drafted] += 1
        if drafted and self.seen[True] == 1:
            return  # the first drafted round also feeds the prompt to draft heads
        now = tokens / max(seconds, 1e-9)
        old = self.rate.get(drafted)
        self.rate[drafted] = now if old is None else (1 - self.smoothing) * old + self.smoothing * now

    @property
    def drafting_pays(self) -> bool | None:
        """Whether drafted rounds are currently faster (`None` before both kinds were measured)."""
        if True not in self.rate or False not in self.rate:
            return None
        return self.rate[True] >= self.rate[False]
