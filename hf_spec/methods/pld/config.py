"""Config of `pld`: prompt lookup decoding that merges several n-gram continuations into one token tree."""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_spec.core.config import MethodConfig


@dataclass
class PLDConfig(MethodConfig):
    """Prompt lookup decoding ([Saxena 2023](https://github.com/apoorvumang/prompt-lookup-decoding)) that proposes
    several continuations as one token tree.

    Args:
        num_draft_tokens: longest continuation drafted (tree depth).
        max_ngram / min_ngram: n-gram sizes matched against the context, longest first.
        max_candidates: continuations merged into the tree.
        max_nodes: verification budget (tree size) when the match is strong.
        strong_ngram: a match this long (or longer) earns the full budget.
        weak_nodes: budget when only shorter n-grams match: a short match is often wrong, and verifying a few
            tokens costs about as much as one plain decoding step while a large tree costs more.
    """

    method = "pld"
    main_arg = "num_draft_tokens"

    num_draft_tokens: int = field(default=10, metadata={"help": "tree depth: longest continuation drafted"})
    max_ngram: int = field(default=3, metadata={"help": "longest n-gram matched"})
    min_ngram: int = field(default=1, metadata={"help": "shortest n-gram matched"})
    max_candidates: int = field(default=4, metadata={"help": "continuations merged into the tree"})
    max_nodes: int = field(default=16, metadata={"help": "verification budget in tree nodes"})
    strong_ngram: int = field(default=3, metadata={"help": "n-gram length that earns the full budget"})
    weak_nodes: int = field(default=5, metadata={"help": "budget when only shorter n-grams match"})

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_at_least(
            1, "num_draft_tokens", "min_ngram", "max_candidates", "max_nodes", "strong_ngram"
        )
        self.require_at_least(0, "weak_nodes")
        if self.max_ngram < self.min_ngram:
            raise ValueError(f"pld: max_ngram must be >= min_ngram, got {self.max_ngram} < {self.min_ngram}")
