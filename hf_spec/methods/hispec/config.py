"""Config of `hispec`: early-exit drafting with an intermediate early-exit verifier before the full model."""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_spec.core.config import MethodConfig
from hf_spec.methods.early_exit.config import ExitHeadsOptions


@dataclass
class HiSpecConfig(MethodConfig, ExitHeadsOptions):
    """HiSpec: hierarchical early-exit speculation with intermediate verification ([Kumar et al. 2025, "HiSpec:
    Hierarchical Speculative Decoding for LLMs"](https://arxiv.org/abs/2510.01336), Algorithm 2). One target, three
    models: its first `draft_layer` layers draft, its first `verify_layer` layers verify early, the full model
    verifies for good. Every layer range continues from the hidden states and KV cache of the range below it:
    nothing is recomputed, and rejected tokens are pruned from each range's cache.

    Args:
        draft_layer: L_d, layers that draft (0: depth / 8).
        verify_layer: L_i, layers that verify early, L_d < L_i < depth (0: depth / 4).
        num_draft_tokens: N_d, tokens drafted per intermediate verification.
        num_buffer_tokens: N_i, tentatively accepted tokens buffered before the full model verifies them.
        exit_heads: folder of exit heads for this target (`hf-spec train exits`) with heads for L_d and L_i;
            None: the target's own final norm + LM head read layers L_d and L_i (LayerSkip-style models).
        draft_vocab: exits compute only the LM-head rows of the heads' draft vocabulary (frequent training
            tokens), a fraction of the LM head's cost; tokens outside it are never drafted.
    """

    method = "hispec"

    draft_layer: int = field(default=0, metadata={"help": "L_d: layers that draft (0: depth / 8)"})
    verify_layer: int = field(default=0, metadata={"help": "L_i: layers that verify early (0: depth / 4)"})
    num_draft_tokens: int = field(default=2, metadata={"help": "N_d: drafted tokens per intermediate check"})
    num_buffer_tokens: int = field(default=4, metadata={"help": "N_i: buffered tokens per full verification"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_draft_tokens < 1 or self.num_buffer_tokens < 1:
            raise ValueError(
                f"hispec: num_draft_tokens and num_buffer_tokens must be >= 1, got {self.num_draft_tokens}, "
                f"{self.num_buffer_tokens}"
            )
