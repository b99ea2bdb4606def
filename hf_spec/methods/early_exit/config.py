"""Config of `early-exit`: the target's own first layers draft (self-speculation); `ExitHeadsOptions` holds the
exit-head fields it shares with `hispec`."""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_spec.core.config import MethodConfig, QuantizeScheme


@dataclass
class ExitHeadsOptions:
    """The exit-head fields shared by the early-exit drafters (`early-exit`, `hispec`).

    Args:
        exit_heads: folder of trained exit heads for this target (`hf-spec train exits`, checked against the
            target's fingerprint); None: the target's own final norm + LM head read the exit layer.
        draft_vocab: exits compute only the LM-head rows of the heads' draft vocabulary (frequent training
            tokens), a fraction of the LM head's cost; tokens outside it are never drafted.
    """

    exit_heads: str | None = field(
        default=None,
        metadata={
            "help": "exit-heads folder (`hf-spec train exits`); None: the target's final norm + LM head"
        },
    )
    draft_vocab: bool = field(
        default=False, metadata={"help": "exits take their argmax over the heads' draft vocabulary only"}
    )


@dataclass
class EarlyExitConfig(MethodConfig, ExitHeadsOptions):
    """Self-speculation: the target's first `exit_layer` layers + its final norm and LM head draft a chain
    ([LayerSkip](https://arxiv.org/abs/2404.16710), Elhoushi et al. 2024, without its training recipe). The draft
    writes into the target's own KV cache of those layers, which already holds the committed tokens, and is rolled
    back afterwards. Without trained exit heads (`exit_heads`) an early layer of a model not trained for early exit
    is usually a poor drafter.

    Args:
        exit_layer: number of target layers used for drafting; 0 = three quarters of the model's depth.
        num_draft_tokens: chain length.
        siblings: extra top-k alternatives per depth added as leaves.
        min_confidence: stop the chain when the drafted token's probability falls below this (0 = never).
        exit_heads: folder of trained exit heads for this target (`hf-spec train exits`, checked against the
            target's fingerprint); None = the stock final norm + LM head read the exit layer.
        draft_vocab: exits compute only the LM-head rows of the heads' draft vocabulary (frequent training
            tokens), a fraction of the LM head's cost; tokens outside it are never drafted.
        quantize: draft through packed `int8` or `int4` copies of the drafting layers' linears and an int8 copy of
            the exit's LM-head rows (CPU; None: the target's own weights). Lossless: the draft's KV entries are
            rolled back and verification runs the target's own weights. On a CPU, where a draft step mostly reads
            weights from memory, it makes drafting several times cheaper for slightly lower agreement.
    """

    method = "early-exit"
    main_arg = "exit_layer"

    exit_layer: int = field(default=0, metadata={"help": "layers used for drafting (0: 3/4 of the depth)"})
    num_draft_tokens: int = field(default=3, metadata={"help": "chain length"})
    siblings: int = field(default=0, metadata={"help": "extra top-k leaves per depth"})
    min_confidence: float = field(default=0.0, metadata={"help": "stop drafting below this probability"})
    quantize: QuantizeScheme | None = field(
        default=None, metadata={"help": "packed draft weights: int8, int4 or None (the target's own; CPU)"}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_at_least(1, "num_draft_tokens")
        self.require_at_least(0, "exit_layer", "siblings")
        if not 0.0 <= self.min_confidence <= 1.0:
            raise ValueError(f"early-exit: min_confidence must be in [0, 1], got {self.min_confidence}")
