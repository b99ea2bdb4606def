"""Config of `eagle3`: EAGLE-2 dynamic draft trees from an EAGLE-3 draft head."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from hf_spec.config import MethodConfig


@dataclass
class Eagle3Config(MethodConfig):
    """EAGLE-2 decoding with an EAGLE-3 draft head ([EAGLE-3](https://arxiv.org/abs/2503.01840), trees of
    [EAGLE-2](https://arxiv.org/abs/2406.16858)).

    The head reads three of the target's inner hidden states (low, mid, high) fused by its `fc` at the first draft
    step, and its own state at the later ones.

    Args:
        head: folder or Hub id of an EAGLE-3 head: the EAGLE authors' or SpecForge/SGLang layout (`midlayer.*`
            keys), vLLM's speculators layout (`layers.0.*`), or hf-spec's own (the SGLang layout plus
            `hf_spec.json`).
        depth: draft tree depth (head forwards per round).
        topk: children kept per expanded node, and nodes expanded per level.
        total_tokens: verification budget: nodes kept after the global rerank by cumulative log-probability.
    """

    method: ClassVar[str] = "eagle3"
    main_arg: ClassVar[str] = "head"

    head: str | None = field(default=None, metadata={"help": "EAGLE-3 head folder or Hub id"})
    depth: int = field(default=5, metadata={"help": "draft tree depth"})
    topk: int = field(default=4, metadata={"help": "children per expanded node / nodes expanded per level"})
    total_tokens: int = field(default=16, metadata={"help": "nodes verified per round (after the rerank)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.depth < 1 or self.topk < 1 or self.total_tokens < 1:
            raise ValueError("eagle3: depth, topk and total_tokens must be >= 1")

    @classmethod
    def from_cli_arg(cls, arg: str | None) -> Eagle3Config:
        """`eagle3:<head folder>`, `eagle3:<Hub id>` or `eagle3:<config.json>`."""
        from hf_spec.methods.head_drafter import head_config_from_cli_arg

        return head_config_from_cli_arg(cls, arg)
