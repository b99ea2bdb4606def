"""Config of `draft-model`: a small causal LM of the target's tokenizer drafts a chain."""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_spec.core.config import MethodConfig


@dataclass
class DraftModelConfig(MethodConfig):
    """Classic two-model speculative decoding ([Leviathan et al. 2023](https://arxiv.org/abs/2211.17192),
    [Chen et al. 2023](https://arxiv.org/abs/2302.01318)) with any small causal LM sharing the target's tokenizer.

    Args:
        model: a known model name (see `hf-spec fetch`), a local folder or a Hub id; required unless the drafter
            is given a loaded model.
        num_draft_tokens: chain length.
        siblings: extra top-k alternatives per depth added as leaves (a cheap tree).
    """

    method = "draft-model"
    main_arg = "model"

    model: str | None = field(default=None, metadata={"help": "draft model: known name, folder or Hub id"})
    num_draft_tokens: int = field(default=5, metadata={"help": "chain length"})
    siblings: int = field(default=0, metadata={"help": "extra top-k leaves per depth"})

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_at_least(1, "num_draft_tokens")
        self.require_at_least(0, "siblings")
