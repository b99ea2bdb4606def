"""Config of `talon`: a retrieval tree and a model drafter's tree fused into one verification, optionally with the
model drafting the next block while the target verifies."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from hf_spec.core.config import MethodConfig
from hf_spec.methods.retrieval.config import RetrievalConfig


@dataclass
class TalonConfig(MethodConfig):
    """Talon ([Gao et al., AAAI 2026, "Breaking the Synchronization Barrier in Speculative Decoding with Hybrid
    Model-based and Retrieve-based Drafting"](https://underline.io/lecture/141730-talon-breaking-the-synchronization-barrier-in-speculative-decoding-with-hybrid-model-based-and-retrieve-based-drafting)):
    a retrieval tree and a model drafter's tree fused by longest-prefix matching into one token tree, verified in
    one target forward; optionally the model drafts the next block on another thread while the target verifies.

    Args:
        retrieval: the `retrieval` method's settings (a `RetrievalConfig` or its dict: datastore recipe or path,
            tree budget, ...); None turns the retrieval half off (model-only).
        drafter: the model drafter: a method spec (`early-exit[:LAYER]`, `eagle:<config.json>`, ...) or a method
            config (object or dict with its `method`). `early-exit` runs as an own-cache chain of the target's
            first layers + exit head and can draft asynchronously; any other method drafts synchronously. None
            turns the model half off (retrieval-only).
        mode: `sync` (draft, then verify) or `async` (the model drafts the next block while the target verifies,
            assuming its chain is accepted; the block is kept when the target agrees and dropped otherwise).
        adaptive: skip the model drafter in rounds where it does not pay, by the rule `switch` names.
        switch: `match`: skip it when retrieval found a strong match (`skip_match`); `cost`: skip it when the
            tokens it adds do not pay for its measured draft time, given what retrieval alone got accepted at this
            match length (`switch.py`); `best`: per round, the draft with the most expected tokens per second
            among retrieval alone, the model alone and both (`CostAwareSwitch.choose`; pays where verifying nodes
            is dear, e.g. float32 targets).
        skip_match: `match` switch: the match length from which retrieval drafts alone (0:
            `retrieval.strong_match`; e.g. `retrieval.long_match` leaves the model out only where the context is
            being copied).
        skip_lookup: `match` switch: also leave the model out while this generation's mean accepted length of
            prompt lookup's chain (`retrieval.prompt_lookup`) is at least this many tokens: the output copies the
            prompt, and retrieval's full tree drafts the copy (0: off).
        explore_every: `cost`/`best` switch: after this many rounds in a row without the model, it runs once.
        switch_cost: `cost` switch: the model's draft time over the rest of a round, fixed (> 0) instead of
            measured (0).
        verify_threads: async mode: torch threads of the verification while the drafting thread runs (0: all
            cores but the drafting thread's one).
        async_min_acceptance: async drafting-ahead only pays when the guess holds; below this running rate of
            fully accepted model chains a round does not draft ahead (the paper's Figure 1 switch).
        pre_verify: async mode, rounds that do not draft ahead: pre-retrieve & pre-verify: the target verifies
            the retrieval tree on the worker thread while the model drafter drafts; the round's verification
            forward then computes only the model's nodes the retrieval tree did not have (hf-spec's loop only;
            transformers' assisted loop falls back to sync rounds).
        extend_tokens: retrieval continues the model's draft: up to this many tokens found by a suffix match of the
            context followed by the model tree's first-child path are appended behind that path (0: off). The
            model starts a phrase the retrieval tree did not see coming; the datastore or the prompt may know how
            it goes on.
        extend_min_match: the extension's suffix match must be at least this long (it then spans drafted tokens).
        both_nodes: rounds that verify both halves: the retrieval tree is cut to this many nodes (its least
            frequent subtrees first; long matches keep theirs), so the fused tree stays small (0: off).
        both_lookup: with `both_nodes`, what happens to prompt lookup's chain (`retrieval.prompt_lookup`) in those
            rounds: `cut` with the rest; `whole`: kept whole, `both_nodes` other nodes beside it; `auto`: whole
            while the chain's mean accepted length over this generation's rounds is at least `auto_lookup` (the
            output copies the prompt: a summary, a RAG answer), else cut.
        auto_lookup: `both_lookup: auto`'s threshold (tokens).
    """

    method = "talon"
    main_arg = None
    # options of config_version 1 and the value that behaves as today's code: the drafting thread always has one
    # torch thread, and drafts one chain length ahead
    removed_fields = {"draft_ahead": 0, "draft_threads": 1}

    retrieval: RetrievalConfig | None = field(
        default_factory=RetrievalConfig, metadata={"help": "retrieval settings; None: no retrieval half"}
    )
    drafter: str | MethodConfig | None = field(
        default="early-exit", metadata={"help": "model drafter: method spec or config; None: no model half"}
    )
    mode: Literal["sync", "async"] = field(default="sync", metadata={"help": "sync or async drafting"})
    adaptive: bool = field(
        default=True, metadata={"help": "skip the model drafter in rounds where it does not pay"}
    )
    switch: Literal["match", "cost", "best"] = field(
        default="match", metadata={"help": "adaptive rule: match, cost or best"}
    )
    skip_match: int = field(default=0, metadata={"help": "match switch: match length that skips the model"})
    skip_lookup: float = field(default=0.0, metadata={"help": "match switch: lookup acceptance that skips"})
    explore_every: int = field(default=4, metadata={"help": "cost switch: run the model after N skips"})
    switch_cost: float = field(default=0.0, metadata={"help": "cost switch: fixed c/T (0: measured)"})
    verify_threads: int = field(
        default=0, metadata={"help": "async: torch threads while overlapped (0: rest)"}
    )
    async_min_acceptance: float = field(
        default=0.0, metadata={"help": "async: draft ahead only above this chain acceptance rate"}
    )
    pre_verify: bool = field(
        default=False, metadata={"help": "async: pre-verify the retrieval tree while the model drafts"}
    )
    extend_tokens: int = field(default=0, metadata={"help": "retrieval tokens behind the model's path"})
    extend_min_match: int = field(default=3, metadata={"help": "suffix match length the extension needs"})
    both_nodes: int = field(default=0, metadata={"help": "retrieval nodes in fused rounds (0: all)"})
    both_lookup: Literal["cut", "whole", "auto"] = field(
        default="cut", metadata={"help": "prompt lookup's chain in fused rounds: cut, whole or auto"}
    )
    auto_lookup: float = field(default=3.0, metadata={"help": "both_lookup auto: mean accepted chain length"})

    def __post_init__(self) -> None:
        super().__post_init__()
        has_model, has_retrieval = self.drafter is not None, self.retrieval is not None
        lookup = self.retrieval.prompt_lookup if has_retrieval else 0
        # the halves
        if not has_model and not has_retrieval:
            raise ValueError("talon: both halves are off (retrieval is null and drafter is empty)")
        if not has_model and (self.mode == "async" or self.extend_tokens):
            raise ValueError(
                "talon: mode 'async' and extend_tokens need the model drafter (drafter is empty)"
            )
        if self.extend_tokens and not has_retrieval:
            raise ValueError("talon: extend_tokens needs the retrieval half (retrieval is null)")
        if self.both_nodes and not (has_model and has_retrieval):
            raise ValueError("talon: both_nodes needs both halves (retrieval and a model drafter)")
        # async mode
        if self.mode == "sync" and (self.async_min_acceptance or self.verify_threads):
            raise ValueError("talon: async_min_acceptance and verify_threads apply to mode 'async' only")
        if not 0.0 <= self.async_min_acceptance <= 1.0:
            raise ValueError(
                f"talon: async_min_acceptance must be in [0, 1], got {self.async_min_acceptance}"
            )
        if self.pre_verify and (self.mode != "async" or not (has_model and has_retrieval)):
            raise ValueError("talon: pre_verify needs mode 'async' with both retrieval and a model drafter")
        # the adaptive switch
        if self.switch_cost and self.switch == "match":
            raise ValueError("talon: switch_cost applies to switch 'cost' or 'best', not 'match'")
        if (self.skip_match or self.skip_lookup) and (self.switch != "match" or not self.adaptive):
            raise ValueError("talon: skip_match and skip_lookup apply to adaptive switch 'match' only")
        if self.skip_lookup < 0 or (self.skip_lookup and not lookup):
            raise ValueError("talon: skip_lookup must be >= 0 and needs retrieval.prompt_lookup")
        # fused rounds
        if self.both_lookup != "cut" and not (self.both_nodes and lookup):
            raise ValueError("talon: both_lookup needs both_nodes and retrieval.prompt_lookup")
        if self.auto_lookup < 0:
            raise ValueError("talon: auto_lookup must be >= 0")
        # sizes
        if self.extend_tokens < 0 or self.extend_min_match < 1:
            raise ValueError("talon: extend_tokens must be >= 0 and extend_min_match >= 1")
        if self.both_nodes < 0 or self.skip_match < 0:
            raise ValueError("talon: both_nodes and skip_match must be >= 0")
        if self.explore_every < 0 or self.switch_cost < 0 or self.verify_threads < 0:
            raise ValueError("talon: explore_every, switch_cost and verify_threads must be >= 0")

    def drafter_config(self) -> MethodConfig | None:
        """The model drafter's config (a method spec parsed by the registry), or None without a model half."""
        if isinstance(self.drafter, str):
            from hf_spec.core.specs import parse_method

            return parse_method(self.drafter)
        return self.drafter
