"""Config of `oracle`: a diagnostic drafter that replays the true greedy continuation."""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_spec.core.config import MethodConfig


@dataclass
class OracleConfig(MethodConfig):
    """Diagnostic, not a user method: proposes the true greedy continuation (computed beforehand), so every
    draft token is accepted under greedy decoding. It measures the ceiling of the speculative loop
    ([Leviathan et al. 2023](https://arxiv.org/abs/2211.17192)) and its own overhead.

    Args:
        num_draft_tokens: chain length per round.
    """

    method = "oracle"
    main_arg = "num_draft_tokens"

    num_draft_tokens: int = field(default=8, metadata={"help": "chain length"})

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_at_least(1, "num_draft_tokens")
