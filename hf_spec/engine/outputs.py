"""What a generation reports: its counters (`SpecStats`) and `generate`'s output type with them."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from transformers.generation.utils import GenerateDecoderOnlyOutput


@dataclass
class SpecStats:
    """Counters of one generation. `tau` = committed tokens per target forward (plain decoding = 1.0)."""

    new_tokens: int = 0
    target_forwards: int = 0
    draft_tokens: int = 0  # proposed nodes, summed over rounds
    accepted_tokens: int = 0  # accepted draft nodes
    plain_rounds: int = 0  # batch rounds that took a plain step: drafting did not pay (`DraftSwitch`)
    compiled_rounds: int = 0  # rounds verified by the compiled forward (`hf_spec.engine.target.compiled`)
    # host seconds by phase of a round; on an asynchronous device nothing waits for the device between phases, so
    # a verification's device time lands where its result is first read (the commit: `time_other`)
    time_draft: float = 0.0
    time_verify: float = 0.0
    time_other: float = 0.0
    time_prefill: float = 0.0
    # [d-1]: rounds whose draft reached depth d with the first d-1 accepted / of those, rounds accepting depth d
    depth_tries: list[int] = field(default_factory=list)
    depth_hits: list[int] = field(default_factory=list)

    def record_round(self, draft_depth: int, accepted: int) -> None:
        """Count a round for the conditional acceptance rate by draft depth (HASS Fig. 5, Lyanna Table 1)."""
        grow = draft_depth - len(self.depth_tries)
        if grow > 0:
            self.depth_tries.extend([0] * grow)
            self.depth_hits.extend([0] * grow)
        for d in range(min(accepted + 1, draft_depth)):
            self.depth_tries[d] += 1
            self.depth_hits[d] += int(accepted > d)

    @property
    def tau(self) -> float:
        return self.new_tokens / max(self.target_forwards, 1)

    @property
    def draft_utilization(self) -> float:
        return self.accepted_tokens / max(self.draft_tokens, 1)

    def to_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards,
            "tau": self.tau,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "draft_utilization": self.draft_utilization,
            "plain_rounds": self.plain_rounds,
            "compiled_rounds": self.compiled_rounds,
            "time_prefill": self.time_prefill,
            "time_draft": self.time_draft,
            "time_verify": self.time_verify,
            "time_other": self.time_other,
            "depth_tries": list(self.depth_tries),
            "depth_hits": list(self.depth_hits),
        }


@dataclass
class SpecDecodeOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus `spec_stats` (see `SpecStats.to_dict`)."""

    spec_stats: dict | None = None


def sum_counts(lists) -> list[int]:
    """Element-wise sum of count lists of different lengths."""
    total: list[int] = []
    for counts in lists:
        total.extend([0] * (len(counts) - len(total)))
        for d, c in enumerate(counts):
            total[d] += c
    return total


def combine_stats(parts: list[SpecStats]) -> SpecStats:
    """One `SpecStats` summing the rows' counters (tau is then committed tokens per forward over the batch)."""
    total = SpecStats()
    for f in fields(SpecStats):
        values = [getattr(s, f.name) for s in parts]
        setattr(
            total, f.name, sum_counts(values) if isinstance(getattr(total, f.name), list) else sum(values)
        )
    return total
