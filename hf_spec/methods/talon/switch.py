"""Talon's cost-aware switch: run the model drafter only in rounds where its branches are expected to pay.

Per bucket of retrieval match length b, running means of
    R[b] = tokens the retrieval tree alone gets accepted,
    G[b] = extra tokens the model's branches add (measured in rounds that ran both).
Without the model a round commits R + 1 tokens in time T; with it R + G + 1 in T + c (c: the model's draft
time, T: the rest of the round, both measured). The model pays when (R + G + 1) / (T + c) > (R + 1) / T, i.e.

    G > (R + 1) * c / T.

A bucket the model has not tried yet runs it (optimistic start); a bucket that skips it retries every
`explore_every`-th round, so a stale estimate can recover.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class _RunningMean:
    value: float = 0.0
    count: int = 0

    def add(self, x: float, min_rate: float = 0.1) -> None:
        """Plain mean over the first samples, then an exponential average (rate `min_rate`)."""
        self.count += 1
        self.value += max(1.0 / self.count, min_rate) * (x - self.value)


class CostAwareSwitch:
    """Decides per round whether Talon's model drafter runs (`use_model`), learning from `record`.

    Args:
        max_bucket: match lengths at or above this share one bucket.
        explore_every: a bucket that skips the model still runs it every this many rounds.
        cost_ratio: c / T when > 0 (fixed, deterministic); 0 measures both with `time.perf_counter`.
    """

    def __init__(self, max_bucket: int = 8, explore_every: int = 8, cost_ratio: float = 0.0) -> None:
        self.max_bucket = max_bucket
        self.explore_every = explore_every
        self.cost_ratio = cost_ratio
        self.reset()

    def reset(self) -> None:
        self.retrieval_accepted = [_RunningMean() for _ in range(self.max_bucket + 1)]
        self.model_gain = [_RunningMean() for _ in range(self.max_bucket + 1)]
        self.skipped = [0] * (self.max_bucket + 1)  # rounds skipped in a row, per bucket
        self.model_seconds = _RunningMean()
        self.rest_seconds = _RunningMean()  # a round's time without the model's drafting
        self._round_start: float | None = None
        self._round_model_seconds = 0.0

    def bucket(self, match: int) -> int:
        return min(max(match, 0), self.max_bucket)

    def ratio(self) -> float:
        """c / T: the model's draft time over the rest of a round."""
        if self.cost_ratio > 0:
            return self.cost_ratio
        if not self.model_seconds.count or not self.rest_seconds.count or self.rest_seconds.value <= 0:
            return 0.0
        return self.model_seconds.value / self.rest_seconds.value

    def use_model(self, match: int) -> bool:
        b = self.bucket(match)
        gain = self.model_gain[b]
        if not gain.count or gain.value > (self.retrieval_accepted[b].value + 1.0) * self.ratio():
            self.skipped[b] = 0
            return True
        self.skipped[b] += 1
        if self.explore_every and self.skipped[b] >= self.explore_every:
            self.skipped[b] = 0
            return True
        return False

    # ---- measurements ------------------------------------------------------------------------------
    def start_round(self) -> None:
        """Call at the start of each round's drafting: closes the previous round's timing."""
        now = time.perf_counter()
        if self._round_start is not None:
            self.rest_seconds.add(now - self._round_start - self._round_model_seconds)
        self._round_start, self._round_model_seconds = now, 0.0

    def model_drafted(self, seconds: float) -> None:
        self._round_model_seconds = seconds
        self.model_seconds.add(seconds)

    def record(self, match: int, used_model: bool, retrieval_accepted: int, accepted: int) -> None:
        """After verification: tokens accepted in the retrieval tree alone and in the whole (fused) tree."""
        b = self.bucket(match)
        self.retrieval_accepted[b].add(retrieval_accepted)
        if used_model:
            self.model_gain[b].add(accepted - retrieval_accepted)


__all__ = ["CostAwareSwitch"]
