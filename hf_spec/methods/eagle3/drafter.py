"""EAGLE-2 dynamic trees from an EAGLE-3 head: the `eagle` drafter's tree growth and head cache, fed the target's
low/mid/high hidden states instead of its last one.

The engine hands the drafter the states of `hidden_state_layers` (the head's `hidden_state_indices`) joined, after
the prefill and after every verification. Catching up on committed positions feeds them through the head's `fc`;
growing the tree feeds the head's own state (before its final norm) back, with no `fc`, as EAGLE-3 drafts.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from hf_spec.core.hub_ids import resolve_head_folder
from hf_spec.heads.published import load_published_head
from hf_spec.methods.eagle.drafter import EagleDrafter
from hf_spec.methods.eagle3.config import Eagle3Config
from hf_spec.methods.eagle3.decoding_head import Eagle3DecodingHead
from hf_spec.methods.eagle3.modeling import Eagle3Head


def load_eagle3_head(path: str | None, target: PreTrainedModel) -> Eagle3Head:
    """The EAGLE-3 head a folder or Hub id names, checked against and placed on `target`."""
    if not path:
        raise ValueError("eagle3 needs a head: eagle3:<folder or Hub id of an EAGLE-3 head>")
    folder = resolve_head_folder(path, "eagle3 head")
    head = load_published_head(folder, target, "eagle3", path)
    if head is None:
        raise ValueError(
            f"{path!r} is not an EAGLE-3 head (no LlamaForCausalLMEagle3 / speculators eagle3 checkpoint with "
            "midlayer.* or layers.0.hidden_norm weights); hf-spec's own EAGLE heads load with eagle:"
        )
    return head


class Eagle3Drafter(EagleDrafter):
    """EAGLE-2 dynamic trees (`propose`) and the step-wise top-1 chain (Post-use) from an EAGLE-3 head.

    Args:
        head: a ready `Eagle3Head` (default: loaded from `config.head`).
    """

    config: Eagle3Config
    batchable = True

    def __init__(
        self, config: Eagle3Config, model: PreTrainedModel, tokenizer=None, head: Eagle3Head | None = None
    ) -> None:
        head = head if head is not None else load_eagle3_head(config.head, model)
        ids = head.draft_token_ids()
        if config.vocab_limit and len(ids) > 1 and bool((ids[1:] > ids[:-1]).all()):
            raise ValueError(
                f"eagle3: vocab_limit {config.vocab_limit} drafts from the first rows of the head's draft "
                "vocabulary, but this head keeps it in token-id order (not most-frequent first): set vocab_limit 0"
            )
        super().__init__(config, model, tokenizer, head=Eagle3DecodingHead(head))
        # the target states the engine hands over: the head's low/mid/high layers, joined
        self.hidden_state_layers = tuple(head.config.hidden_state_indices)

    def target_features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The joined target states `(n, fused_width)` are the head's input as they are (its `fc` fuses them)."""
        return hidden.to(self.dtype)


__all__ = ["Eagle3Drafter", "load_eagle3_head"]
