"""Config of `retrieval`: REST-style drafting from a token datastore and the context, as one token tree."""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_spec.core.config import MethodConfig


@dataclass
class RetrievalConfig(MethodConfig):
    """Retrieval drafting ([REST](https://arxiv.org/abs/2311.08252), He et al. 2024; Talon's retrieval half): the
    longest suffix of the context found in a token datastore and in the prompt + generated text (paper Algorithm
    1), its continuations merged into a trie with cumulative frequencies and pruned to a node budget.

    Args:
        datastore: a datastore recipe (see `hf_spec.datastore.DatastoreRecipe`: `corpus`, `responses`,
            `early_exit_prompts`, ...): built on first use and cached under `$HF_SPEC_CACHE/datastores/`.
        datastore_path: a datastore folder from `hf-spec datastore build` (overrides `datastore`); None: none.
        num_draft_tokens: tree depth (continuation length).
        max_match / min_match: context suffix lengths tried, longest first.
        max_occurrences: occurrences sampled for the continuations of a frequent suffix.
        max_nodes: tree budget when the match is strong (m in the paper).
        strong_match: a match this long earns `max_nodes`; shorter ones get `weak_nodes`.
        weak_nodes: tree budget for short matches: their continuations are often wrong, so a small tree that
            costs about one plain decoding step to verify.
        long_match: a match this long (0: off) drafts `long_draft_tokens` deep with `long_nodes` nodes: a long
            suffix match is text being copied (a summary quoting its source, code being edited), whose
            continuation tends to hold for more than `num_draft_tokens`.
        long_draft_tokens / long_nodes: depth and tree budget for long matches.
        search_context: also search the current prompt + generated text.
        context_weight: weight of context matches against datastore matches in the trie frequencies.
        grow_online: add every finished prompt + answer to the datastore (kept in memory, across `generate`
            calls); off by default so benchmark prompts never leak into later drafts.
        prompt_lookup: n > 0 puts prompt lookup's candidate (transformers' rule: what followed the leftmost
            earlier occurrence of the context's last n-gram, n from `prompt_lookup` down to 1) into every tree
            whole, so retrieval drafts at least what `prompt_lookup_num_tokens` would; 0: off.
        prompt_lookup_extra: nodes kept for the other candidates beside that chain (the budget grows to the
            chain's length + this, at most `max_nodes`).
        auto_nodes: fit `max_nodes` to this machine: the first generation (batch size 1, hf-spec's loop) times
            verifications of 1..`max_nodes` nodes on its own cache and keeps the largest tree that costs at most
            `auto_nodes_tolerance` x one node's verification (`hf_spec.engine.target.forward.flat_tree_budget`); later
            generations reuse it. `long_nodes` stays as set (copied text pays for deep trees). Where verifying
            more nodes costs nothing extra that is `max_nodes`; where each node adds to the verification, less.
        auto_nodes_tolerance: cost allowed over one node's verification (>= 1).
    """

    method = "retrieval"
    main_arg = "datastore_path"

    datastore: dict = field(default_factory=dict, metadata={"help": "datastore recipe (built on first use)"})
    datastore_path: str | None = field(default=None, metadata={"help": "prebuilt datastore folder"})
    num_draft_tokens: int = field(default=10, metadata={"help": "tree depth"})
    max_match: int = field(default=16, metadata={"help": "longest context suffix matched"})
    min_match: int = field(default=1, metadata={"help": "shortest context suffix matched"})
    max_occurrences: int = field(default=256, metadata={"help": "occurrences sampled per match"})
    max_nodes: int = field(default=16, metadata={"help": "tree budget for strong matches"})
    strong_match: int = field(default=3, metadata={"help": "match length that earns max_nodes"})
    weak_nodes: int = field(default=5, metadata={"help": "tree budget for short matches"})
    long_match: int = field(
        default=0, metadata={"help": "match length that earns long_draft_tokens (0: off)"}
    )
    long_draft_tokens: int = field(default=20, metadata={"help": "tree depth for long matches"})
    long_nodes: int = field(default=24, metadata={"help": "tree budget for long matches"})
    search_context: bool = field(default=True, metadata={"help": "search the prompt + generated text too"})
    context_weight: float = field(default=2.0, metadata={"help": "weight of context matches"})
    grow_online: bool = field(default=False, metadata={"help": "add finished generations to the datastore"})
    prompt_lookup: int = field(
        default=0, metadata={"help": "always draft prompt lookup's n-gram candidate (0: off)"}
    )
    prompt_lookup_extra: int = field(default=6, metadata={"help": "nodes for other candidates beside it"})
    auto_nodes: bool = field(default=False, metadata={"help": "measure max_nodes at the first generation"})
    auto_nodes_tolerance: float = field(
        default=1.3, metadata={"help": "auto_nodes: cost allowed over a one-node verification"}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if min(self.num_draft_tokens, self.max_nodes, self.weak_nodes, self.long_match) < 0:
            raise ValueError("retrieval: num_draft_tokens, max_nodes, weak_nodes and long_match must be >= 0")
        if self.auto_nodes and (self.max_nodes < 1 or self.auto_nodes_tolerance < 1.0):
            raise ValueError(
                "retrieval: auto_nodes needs max_nodes >= 1 (the largest tree measured) and auto_nodes_tolerance "
                f">= 1.0; got {self.max_nodes}, {self.auto_nodes_tolerance}"
            )
        if min(self.prompt_lookup, self.prompt_lookup_extra) < 0:
            raise ValueError("retrieval: prompt_lookup and prompt_lookup_extra must be >= 0")
        if self.long_match and (self.long_draft_tokens < self.num_draft_tokens or self.long_nodes < 1):
            raise ValueError(
                "retrieval: long_draft_tokens must be >= num_draft_tokens and long_nodes >= 1 "
                f"(got {self.long_draft_tokens}, {self.long_nodes})"
            )
        if not 1 <= self.min_match <= self.max_match:
            raise ValueError(
                f"retrieval: need 1 <= min_match <= max_match, got {self.min_match}, {self.max_match}"
            )
