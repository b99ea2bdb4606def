"""Config of `lyanna`: a hidden-state chain head drafts token-info trees and re-samples rejected branches."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from hf_spec.core.config import MethodConfig, QuantizeScheme


@dataclass
class LyannaConfig(MethodConfig):
    """Lyanna decoding ([Chen et al. 2026, "Make Every Draft Count: Hidden State based Speculative
    Decoding"](https://arxiv.org/abs/2602.21224)).

    Args:
        head: folder of a head saved by `hf-spec train lyanna`.
        depth: chain length k (head layer steps per round; logits for all k in one LM-head call).
        topk: children per kept node and nodes kept per level (Algorithm 1).
        budget: verification budget B (nodes of the fresh tree).
        resample: after a rejection, re-sample a subtree rooted at the bonus token from the same chain's
            remaining logits (Algorithm 2): "off"; "separate" (verified alone next round, no fresh draft);
            "fused" (merged into the next round's fresh tree: verification fusion).
        resample_min_steps: r: re-sample only if more than r chain steps remain.
        resample_budget: nodes of the re-sampled subtree kept for fusion.
        token_info: "lowrank" (E_t W_1 W_2 per node), "table" (collapsed rows of the hot tokens), "off".
        hot_tokens: source tokens that get token info (the most frequent; 0 = the whole draft vocabulary).
        vocab_limit: draft from the first N rows of the head's draft vocabulary only (the N most frequent
            tokens; 0 = all): a smaller LM-head read and token-info rows, fewer tokens draftable.
        quantize: draft with packed `int8` or `int4` copies of the head's weights (CPU; None: as loaded): the
            head's cost here is reading its weights, and verification keeps the output exact either way.
    """

    method: ClassVar[str] = "lyanna"
    main_arg: ClassVar[str] = "head"

    head: str | None = field(default=None, metadata={"help": "Lyanna head folder"})
    depth: int = field(default=6, metadata={"help": "chain length k"})
    topk: int = field(default=4, metadata={"help": "children per node / nodes kept per level"})
    budget: int = field(default=16, metadata={"help": "verification budget B of the fresh tree"})
    resample: Literal["off", "separate", "fused"] = field(
        default="fused", metadata={"help": "re-sampling after a rejection: off, separate or fused"}
    )
    resample_min_steps: int = field(default=1, metadata={"help": "r: re-sample if more than r steps remain"})
    resample_budget: int = field(default=6, metadata={"help": "nodes of the re-sampled subtree"})
    token_info: Literal["lowrank", "table", "off"] = field(
        default="lowrank", metadata={"help": "token information per node: lowrank, table or off"}
    )
    hot_tokens: int = field(
        default=0, metadata={"help": "tokens with token info (0: whole draft vocabulary)"}
    )
    vocab_limit: int = field(
        default=0, metadata={"help": "draft from the N most frequent draft tokens (0: all)"}
    )
    quantize: QuantizeScheme | None = field(
        default=None, metadata={"help": "packed draft weights: int8, int4 or None (as loaded)"}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.vocab_limit < 0:
            raise ValueError("lyanna: vocab_limit must be >= 0")
        if min(self.depth, self.topk, self.budget) < 1:
            raise ValueError("lyanna: depth, topk and budget must be >= 1")

    @classmethod
    def from_cli_arg(cls, arg: str | None) -> LyannaConfig:
        """`lyanna:<head folder>` or `lyanna:<config.json>`."""
        from hf_spec.methods.head_drafter import head_config_from_cli_arg

        return head_config_from_cli_arg(cls, arg)
