"""Config of `eagle`: EAGLE-2 dynamic draft trees from an EAGLE or HASS feature-level draft head."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from hf_spec.core.config import MethodConfig, QuantizeScheme


@dataclass
class EagleConfig(MethodConfig):
    """EAGLE-2 decoding with an EAGLE or HASS draft head ([EAGLE-2](https://arxiv.org/abs/2406.16858),
    [HASS](https://arxiv.org/abs/2408.15766)).

    Args:
        head: folder of a head saved by `hf-spec train eagle` (Hub-style: config.json + model.safetensors).
        depth: draft tree depth (head forwards per round).
        topk: children kept per expanded node, and nodes expanded per level.
        total_tokens: verification budget: nodes kept after the global rerank by cumulative log-probability.
        vocab_limit: draft from the first N rows of the head's draft vocabulary only (the N most frequent
            tokens; 0 = all): a smaller LM-head read per level, fewer tokens draftable.
        quantize: draft with packed `int8` or `int4` copies of the head's weights (CPU; None: as loaded): the
            head's cost here is reading its weights, and verification keeps the output exact either way.
        max_catch_up: when more committed positions wait for the head than this (a long prompt, or rounds a
            hybrid drafted without it), it feeds only the latest this many; the older ones never enter its
            cache (their absolute positions stay as they were). 0: all. Bounds the head's catch-up cost.
    """

    method: ClassVar[str] = "eagle"
    main_arg: ClassVar[str] = "head"

    head: str | None = field(default=None, metadata={"help": "draft head folder"})
    depth: int = field(default=5, metadata={"help": "draft tree depth"})
    topk: int = field(default=4, metadata={"help": "children per expanded node / nodes expanded per level"})
    total_tokens: int = field(default=16, metadata={"help": "nodes verified per round (after the rerank)"})
    vocab_limit: int = field(
        default=0, metadata={"help": "draft from the N most frequent draft tokens (0: all)"}
    )
    quantize: QuantizeScheme | None = field(
        default=None, metadata={"help": "packed draft weights: int8, int4 or None (as loaded)"}
    )
    max_catch_up: int = field(
        default=0, metadata={"help": "positions the head feeds at most when it catches up (0: all)"}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.depth < 1 or self.topk < 1 or self.total_tokens < 1:
            raise ValueError(f"{self.method}: depth, topk and total_tokens must be >= 1")
        if self.vocab_limit < 0 or self.max_catch_up < 0:
            raise ValueError(f"{self.method}: vocab_limit and max_catch_up must be >= 0")

    @classmethod
    def from_cli_arg(cls, arg: str | None) -> EagleConfig:
        """`eagle:<head folder>` or `eagle:<config.json>`."""
        from hf_spec.methods.head_drafter import head_config_from_cli_arg

        return head_config_from_cli_arg(cls, arg)
