from __future__ import annotations

from dataclasses import dataclass, field

from hf_spec.config import MethodConfig
from hf_spec.kernels.weight_only import SCHEMES


@dataclass
class ExitHeadsOptions:
    """The exit-head fields shared by the early-exit drafters (`early-exit`, `hispec`)."""

    exit_heads: str = field(
        default="",
        metadata={
            "help": "exit-heads folder (`hf-spec train exits`); empty: the target's final norm + LM head"
        },
    )
    draft_vocab: bool = field(
        default=False, metadata={"help": "exits take their argmax over the heads' draft vocabulary only"}
    )


@dataclass
class EarlyExitConfig(MethodConfig, ExitHeadsOptions):
    """Self-speculation: the target's first `exit_layer` layers + its final norm and LM head draft a chain
    (LayerSkip, Elhoushi et al. 2024, without its training recipe). The draft writes into the target's own
    KV cache of those layers, which already holds the committed tokens, and is rolled back afterwards.

    Without trained exit heads an early layer can be a poor drafter: on Qwen2.5-Coder-0.5B the final norm + LM
    head applied after layer 8/12/16/20/23 of 24 agree with the next token 0/0/3/63/93% of the time.

    Args:
        exit_layer: number of target layers used for drafting; 0 = three quarters of the model's depth.
        num_draft_tokens: chain length.
        siblings: extra top-k alternatives per depth added as leaves.
        min_confidence: stop the chain when the drafted token's probability falls below this (0 = never).
        exit_heads: folder of trained exit heads for this target (`hf-spec train exits`, checked against the
            target's fingerprint); empty = the stock final norm + LM head read the exit layer.
        draft_vocab: exits compute only the LM-head rows of the heads' draft vocabulary (frequent training
            tokens), a fraction of the LM head's cost; tokens outside it are never drafted.
        quantize: draft through packed `int8` or `int4` copies of the drafting layers' linears and an int8 copy of
            the exit's LM-head rows (CPU; `""`: the target's own weights). Lossless: the draft's KV entries are
            rolled back and verification runs the target's own weights. On a CPU, where a draft step is reading
            its weights from memory, it makes drafting ~2.8x cheaper for a little agreement (Qwen2.5-0.5B, layer 22
            of 24: 46 -> 16.5 ms a step, tau 1.79 -> 1.75).
    """

    method = "early-exit"
    main_arg = "exit_layer"

    exit_layer: int = field(default=0, metadata={"help": "layers used for drafting (0: 3/4 of the depth)"})
    num_draft_tokens: int = field(default=3, metadata={"help": "chain length"})
    siblings: int = field(default=0, metadata={"help": "extra top-k leaves per depth"})
    min_confidence: float = field(default=0.0, metadata={"help": "stop drafting below this probability"})
    quantize: str = field(default="", metadata={"help": "draft weights: '', int8 or int4 (CPU)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_at_least(1, "num_draft_tokens")
        self.require_at_least(0, "exit_layer", "siblings")
        if not 0.0 <= self.min_confidence <= 1.0:
            raise ValueError(f"early-exit: min_confidence must be in [0, 1], got {self.min_confidence}")
        if self.quantize and self.quantize not in SCHEMES:
            raise ValueError(f"early-exit: quantize must be '', 'int8' or 'int4', got {self.quantize!r}")
