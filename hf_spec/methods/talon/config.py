"""Config of `talon`: a retrieval tree and a model drafter's tree fused into one verification, optionally with the
model drafting the next block while the target verifies.

The settings come in parts, each checking its own rules: `schedule` (when the model drafts: sync or async),
`switch` (in which rounds it drafts at all) and `fusion` (how the two trees are joined), beside the `retrieval`
half's own config and the model `drafter`. Rules that join parts (a setting that needs both halves) are checked by
`TalonConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from hf_spec.core.config import ConfigPart, MethodConfig, accepts_flat_keys
from hf_spec.methods.retrieval.config import RetrievalConfig


@dataclass
class TalonSchedule(ConfigPart):
    """When Talon's model drafter drafts, relative to the target's verification.

    Args:
        mode: `sync` (draft, then verify) or `async` (the model drafts the next block while the target verifies,
            assuming its chain is accepted; the block is kept when the target agrees and dropped otherwise).
        verify_threads: async mode: torch threads of the verification while the drafting thread runs (0: all
            cores but the drafting thread's one).
        min_acceptance: async drafting-ahead only pays when the guess holds; below this running rate of fully
            accepted model chains a round does not draft ahead (the paper's Figure 1 switch).
        pre_verify: async mode, rounds that do not draft ahead: pre-retrieve & pre-verify: the target verifies the
            retrieval tree on the worker thread while the model drafter drafts; the round's verification forward
            then computes only the model's nodes the retrieval tree did not have (hf-spec's loop only;
            transformers' assisted loop falls back to sync rounds). Needs both halves.
    """

    method = "talon.schedule"

    mode: Literal["sync", "async"] = field(default="sync", metadata={"help": "sync or async drafting"})
    verify_threads: int = field(
        default=0, metadata={"help": "async: torch threads while overlapped (0: rest)"}
    )
    min_acceptance: float = field(
        default=0.0, metadata={"help": "async: draft ahead only above this chain acceptance rate"}
    )
    pre_verify: bool = field(
        default=False, metadata={"help": "async: pre-verify the retrieval tree while the model drafts"}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mode == "sync" and (self.min_acceptance or self.verify_threads or self.pre_verify):
            raise ValueError(
                "talon.schedule: min_acceptance, verify_threads and pre_verify apply to mode 'async' only"
            )
        if not 0.0 <= self.min_acceptance <= 1.0:
            raise ValueError(f"talon.schedule: min_acceptance must be in [0, 1], got {self.min_acceptance}")
        self.require_at_least(0, "verify_threads")


@dataclass
class TalonSwitch(ConfigPart):
    """In which rounds Talon's model drafter runs (`switch: null`: in every round).

    Args:
        rule: `match`: skip the model when retrieval found a strong match (`skip_match`); `cost`: skip it when the
            tokens it adds do not pay for its measured draft time, given what retrieval alone got accepted at this
            match length (`switch.py`); `best`: per round, the draft with the most expected tokens per second
            among retrieval alone, the model alone and both (`CostAwareSwitch.choose`; pays where verifying nodes
            is dear, e.g. float32 targets).
        skip_match: `match` rule: the match length from which retrieval drafts alone (0:
            `retrieval.strong_match`; e.g. `retrieval.long_match` leaves the model out only where the context is
            being copied).
        skip_lookup: `match` rule: also leave the model out while this generation's mean accepted length of prompt
            lookup's chain (`retrieval.prompt_lookup`) is at least this many tokens: the output copies the prompt,
            and retrieval's full tree drafts the copy (0: off).
        explore_every: `cost`/`best` rule: after this many rounds in a row without the model, it runs once.
        cost: `cost`/`best` rule: the model's draft time over the rest of a round, fixed (> 0) instead of measured
            (0).
    """

    method = "talon.switch"

    rule: Literal["match", "cost", "best"] = field(default="match", metadata={"help": "match, cost or best"})
    skip_match: int = field(default=0, metadata={"help": "match rule: match length that skips the model"})
    skip_lookup: float = field(default=0.0, metadata={"help": "match rule: lookup acceptance that skips"})
    explore_every: int = field(default=4, metadata={"help": "cost/best rule: run the model after N skips"})
    cost: float = field(default=0.0, metadata={"help": "cost/best rule: fixed c/T (0: measured)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_at_least(0, "skip_match", "skip_lookup", "explore_every", "cost")
        if (self.skip_match or self.skip_lookup) and self.rule != "match":
            raise ValueError(
                f"talon.switch: skip_match and skip_lookup apply to rule 'match', not {self.rule!r}"
            )
        if self.cost and self.rule == "match":
            raise ValueError("talon.switch: cost applies to rule 'cost' or 'best', not 'match'")


@dataclass
class TalonFusion(ConfigPart):
    """How Talon joins the retrieval tree and the model's tree in rounds that draft with both.

    Args:
        both_nodes: rounds that verify both halves: the retrieval tree is cut to this many nodes (its least frequent
            subtrees first; long matches keep theirs), so the fused tree stays small (0: off).
        both_lookup: with `both_nodes`, what happens to prompt lookup's chain (`retrieval.prompt_lookup`) in those
            rounds: `cut` with the rest; `whole`: kept whole, `both_nodes` other nodes beside it; `auto`: whole
            while the chain's mean accepted length over this generation's rounds is at least `auto_lookup` (the
            output copies the prompt: a summary, a RAG answer), else cut.
        auto_lookup: `both_lookup: auto`'s threshold (tokens).
        extend_tokens: retrieval continues the model's draft: up to this many tokens found by a suffix match of the
            context followed by the model tree's first-child path are appended behind that path (0: off). The
            model starts a phrase the retrieval tree did not see coming; the datastore or the prompt may know how
            it goes on.
        extend_min_match: the extension's suffix match must be at least this long (it then spans drafted tokens).
    """

    method = "talon.fusion"

    both_nodes: int = field(default=0, metadata={"help": "retrieval nodes in fused rounds (0: all)"})
    both_lookup: Literal["cut", "whole", "auto"] = field(
        default="cut", metadata={"help": "prompt lookup's chain in fused rounds: cut, whole or auto"}
    )
    auto_lookup: float = field(default=3.0, metadata={"help": "both_lookup auto: mean accepted chain length"})
    extend_tokens: int = field(default=0, metadata={"help": "retrieval tokens behind the model's path"})
    extend_min_match: int = field(default=3, metadata={"help": "suffix match length the extension needs"})

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_at_least(0, "both_nodes", "auto_lookup", "extend_tokens")
        self.require_at_least(1, "extend_min_match")
        if self.both_lookup != "cut" and not self.both_nodes:
            raise ValueError(f"talon.fusion: both_lookup {self.both_lookup!r} needs both_nodes")


@accepts_flat_keys
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
        schedule: when the model drafts: sync or async, and the async mode's settings (`TalonSchedule`).
        switch: in which rounds the model drafts (`TalonSwitch`: by match length, by measured cost, or the best of
            retrieval, model and both); None: in every round.
        fusion: how the two trees are joined in rounds that draft with both (`TalonFusion`: a smaller retrieval
            tree, retrieval continuing the model's draft).

    Configs saved before the parts existed (`mode`, `adaptive`, `switch: "cost"`, `both_nodes`, ... at the top
    level) still load, with a `FutureWarning`; saving them writes the parts.
    """

    method = "talon"
    main_arg = None
    # options of config_version 1 and the value that behaves as today's code: the drafting thread always has one
    # torch thread, and drafts one chain length ahead
    removed_fields = {"draft_ahead": 0, "draft_threads": 1}
    flat_keys = {
        "mode": "schedule.mode",
        "verify_threads": "schedule.verify_threads",
        "async_min_acceptance": "schedule.min_acceptance",
        "pre_verify": "schedule.pre_verify",
        "adaptive": "switch",
        "switch": "switch.rule",
        "skip_match": "switch.skip_match",
        "skip_lookup": "switch.skip_lookup",
        "explore_every": "switch.explore_every",
        "switch_cost": "switch.cost",
        "both_nodes": "fusion.both_nodes",
        "both_lookup": "fusion.both_lookup",
        "auto_lookup": "fusion.auto_lookup",
        "extend_tokens": "fusion.extend_tokens",
        "extend_min_match": "fusion.extend_min_match",
    }

    retrieval: RetrievalConfig | None = field(
        default_factory=RetrievalConfig, metadata={"help": "retrieval settings; None: no retrieval half"}
    )
    drafter: str | MethodConfig | None = field(
        default="early-exit", metadata={"help": "model drafter: method spec or config; None: no model half"}
    )
    schedule: TalonSchedule = field(
        default_factory=TalonSchedule, metadata={"help": "when the model drafts: sync or async"}
    )
    switch: TalonSwitch | None = field(
        default_factory=TalonSwitch,
        metadata={
            "help": "skip the model drafter in rounds where it does not pay (off: it runs every round)"
        },
    )
    fusion: TalonFusion = field(
        default_factory=TalonFusion, metadata={"help": "how the two trees are joined in rounds with both"}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        has_model, has_retrieval = self.drafter is not None, self.retrieval is not None
        lookup = self.retrieval.prompt_lookup if has_retrieval else 0
        schedule, switch, fusion = self.schedule, self.switch, self.fusion
        if not has_model and not has_retrieval:
            raise ValueError("talon: both halves are off (retrieval is null and drafter is empty)")
        if not has_model and (schedule.mode == "async" or fusion.extend_tokens):
            raise ValueError(
                "talon: schedule.mode 'async' and fusion.extend_tokens need the model drafter (drafter is empty)"
            )
        if fusion.extend_tokens and not has_retrieval:
            raise ValueError("talon: fusion.extend_tokens needs the retrieval half (retrieval is null)")
        if fusion.both_nodes and not (has_model and has_retrieval):
            raise ValueError("talon: fusion.both_nodes needs both halves (retrieval and a model drafter)")
        if fusion.both_lookup != "cut" and not lookup:
            raise ValueError("talon: fusion.both_lookup needs retrieval.prompt_lookup")
        if schedule.pre_verify and not (has_model and has_retrieval):
            raise ValueError("talon: schedule.pre_verify needs both retrieval and a model drafter")
        if switch is not None and switch.skip_lookup and not lookup:
            raise ValueError("talon: switch.skip_lookup needs retrieval.prompt_lookup")

    def drafter_config(self) -> MethodConfig | None:
        """The model drafter's config (a method spec parsed by the registry), or None without a model half."""
        if isinstance(self.drafter, str):
            from hf_spec.core.specs import parse_method

            return parse_method(self.drafter)
        return self.drafter
