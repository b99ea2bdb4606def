"""Config of `postuse`: Post-use (a token cache of verified phrases reused at the drafter and at the target) and
Pre-cut (a Q-learning draft-length controller) around another drafter.

The settings come in parts, each checking its own rules: `cache` (the token cache), `reuse_draft` and
`reuse_target` (where cached phrases are reused; None: not there) and `precut` (the controller; None: a fixed
draft length).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from hf_spec.core.config import ConfigPart, MethodConfig, accepts_flat_keys


@dataclass
class TokenCacheSettings(ConfigPart):
    """Post-use's token cache (`token_cache.py`): the draft positions the target agrees with (also after the first
    mismatch) and the committed text, kept as short phrases by their first token (the anchor).

    Args:
        phrase_length: beta, longest cached phrase, anchor included [5].
        pool_size: kappa_pool, most anchors in the cache [1000].
        phrases_per_anchor: kappa_phase, most phrases per anchor [20].
        admit_prompt: also admit the prompt's phrases at the start of a generation.
    """

    method = "postuse.cache"

    phrase_length: int = field(default=5, metadata={"help": "beta: longest phrase, anchor included"})
    pool_size: int = field(default=1000, metadata={"help": "kappa_pool: most anchors"})
    phrases_per_anchor: int = field(default=20, metadata={"help": "kappa_phase: most phrases per anchor"})
    admit_prompt: bool = field(default=False, metadata={"help": "admit the prompt's phrases"})

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_at_least(1, "pool_size", "phrases_per_anchor")
        if self.phrase_length < 2:
            raise ValueError(
                f"postuse.cache: phrase_length (beta) must be >= 2: a phrase is an anchor plus tokens, got "
                f"{self.phrase_length}"
            )


@dataclass
class DraftReuse(ConfigPart):
    """Post-use at the drafter (Algorithm 2): cached phrases behind the last token are checked by the drafter in the
    same forward; an agreeing phrase yields several draft tokens from one forward. Needs a step-wise drafter.

    Args:
        phrases: W, cached phrases checked per draft forward.
    """

    method = "postuse.reuse_draft"

    phrases: int = field(default=4, metadata={"help": "W: phrases checked per draft forward"})

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_at_least(0, "phrases")


@dataclass
class TargetReuse(ConfigPart):
    """Post-use at the target (Algorithm 3): cached phrases behind the last draft tokens become extra branches of the
    verification tree.

    Args:
        anchors: m, last draft tokens that get cached phrases at verification [3].
        phrases: cached phrases per anchor at verification.
        max_tree_nodes: verification budget (draft + cached nodes); 0: measured at the first generation, the
            largest tree up to `auto_tree_max` nodes whose verification costs at most `auto_tree_tolerance` times
            a one-node one (`hf_spec.engine.target.forward.flat_tree_budget`; 5 where the loop verifies no tree of ours:
            batched rows, transformers' assisted loop). Where verifying more nodes costs nothing extra that is
            `auto_tree_max`; where each node adds to the verification, less.
        auto_tree_max: `max_tree_nodes: 0`: the largest tree measured.
        auto_tree_tolerance: `max_tree_nodes: 0`: the cost allowed over a one-node verification (>= 1).
    """

    method = "postuse.reuse_target"

    anchors: int = field(default=3, metadata={"help": "m: last draft tokens given cached branches"})
    phrases: int = field(default=2, metadata={"help": "cached phrases per anchor at verification"})
    max_tree_nodes: int = field(
        default=16, metadata={"help": "verification budget in tree nodes (0: measured)"}
    )
    auto_tree_max: int = field(default=13, metadata={"help": "max_tree_nodes 0: largest tree measured"})
    auto_tree_tolerance: float = field(
        default=1.15, metadata={"help": "max_tree_nodes 0: cost allowed over a one-node verification"}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_at_least(0, "anchors", "phrases", "max_tree_nodes")
        self.require_at_least(1, "auto_tree_max", "auto_tree_tolerance")


@dataclass
class PreCut(ConfigPart):
    """Pre-cut: a Q-learning controller (`controller.py`) that stops drafting when more draft calls are unlikely to
    pay. Needs a step-wise drafter.

    Args:
        max_draft_length: lambda_max, the longest draft [24].
        alpha: Q-learning rate [0.1].
        gamma: Q-learning discount [0.99].
        epsilon: exploration rate while learning.
        init_continue: initial Q(CONTINUE) (slightly above `init_stop`: an unexplored state keeps drafting).
        init_stop: initial Q(STOP).
        benefit_buckets: buckets of the expected benefit (product of draft confidences) in the state.
        target_cost: one target call in draft-call units for the reward; 0 = measured online (EMA of the
            wall time of draft calls and of verification rounds).
        reward: the tokens eta counts: `"useful"` (paper Eq. 7: draft tokens the target agrees with, also
            after the first mismatch), `"accepted"` (accepted draft tokens) or `"committed"` (accepted + the
            bonus token: tokens per unit cost, i.e. speed; the choice when a draft call costs about as much as
            a target call, where the flat paper reward cannot tell draft lengths apart).
        warmup_rounds: first rounds of a fresh table that draft to `max_draft_length` (every position a trial).
        q_table: JSON Q-table to start from (`hf-spec train postuse` writes one); None = initial values.
        freeze: no Q updates and no exploration (reproducible runs with a learned table).

    Exploration draws from a generator seeded with 0.
    """

    method = "postuse.precut"

    max_draft_length: int = field(default=24, metadata={"help": "lambda_max: longest draft"})
    alpha: float = field(default=0.1, metadata={"help": "Q-learning rate"})
    gamma: float = field(default=0.99, metadata={"help": "Q-learning discount"})
    epsilon: float = field(default=0.05, metadata={"help": "exploration rate while learning"})
    init_continue: float = field(default=0.01, metadata={"help": "initial Q(CONTINUE)"})
    init_stop: float = field(default=0.0, metadata={"help": "initial Q(STOP)"})
    benefit_buckets: int = field(default=10, metadata={"help": "expected-benefit buckets"})
    target_cost: float = field(default=0.0, metadata={"help": "target call in draft calls (0: measured)"})
    reward: Literal["useful", "accepted", "committed"] = field(
        default="useful", metadata={"help": "tokens the reward counts: useful (paper), accepted or committed"}
    )
    warmup_rounds: int = field(default=0, metadata={"help": "rounds drafting to max_draft_length"})
    q_table: str | None = field(default=None, metadata={"help": "JSON Q-table to start from"})
    freeze: bool = field(default=False, metadata={"help": "no Q updates, no exploration"})

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_at_least(1, "max_draft_length")


@accepts_flat_keys
@dataclass
class PostUseConfig(MethodConfig):
    """Post-use & Pre-cut (["Holistic Token Efficient Speculative Decoding"](https://openreview.net/forum?id=ELhSQC3BJE)):
    two training-free plug-ins around any hf-spec drafter.

    - Post-use: the draft positions the target agrees with (also after the first mismatch) and the committed
      text are kept as short phrases in a token cache (`token_cache.py`) and recycled: at the drafter
      (cached phrases behind the last token are checked by the drafter in the same forward; an agreeing
      phrase yields several draft tokens from one forward) and at the target (cached phrases behind the last
      draft tokens become extra branches of the verification tree).
    - Pre-cut: a Q-learning controller (`controller.py`) stops drafting when more draft calls are unlikely
      to pay.

    Both only change what is proposed; verification keeps the output exactly the target's.

    Args:
        drafter: the wrapped drafter: a method spec (`"early-exit:20"`) or a method config (object, or dict with its
            `method`: `{"method": "early-exit", "exit_layer": 20}`).
        draft_length: fixed draft length lambda (draft tokens per round) when `precut` is None.
        cache: the token cache (`TokenCacheSettings`: phrase length, pool size, ...), used when either reuse is on.
        reuse_draft: Post-use at the drafter (`DraftReuse`); None: off. Needs a step-wise drafter.
        reuse_target: Post-use at the target (`TargetReuse`: anchors, phrases, verification budget); None: off.
        precut: the Q-learning draft-length controller (`PreCut`); None: a fixed `draft_length`. Needs a step-wise
            drafter.

    The token cache lives as long as the drafter (the paper's pool, across `generate` calls). Configs saved before
    the parts existed (`reuse_draft: true`, `alpha`, `phrase_length`, ... at the top level) still load, with a
    `FutureWarning`; saving them writes the parts.
    """

    method = "postuse"
    main_arg = "drafter"
    # options of config_version 1 and the value that behaves as today's code
    removed_fields = {"keep_cache": True, "seed": 0}
    flat_keys = {
        "phrase_length": "cache.phrase_length",
        "pool_size": "cache.pool_size",
        "phrases_per_anchor": "cache.phrases_per_anchor",
        "admit_prompt": "cache.admit_prompt",
        "reuse_draft": "reuse_draft",
        "draft_phrases": "reuse_draft.phrases",
        "reuse_target": "reuse_target",
        "target_anchors": "reuse_target.anchors",
        "target_phrases": "reuse_target.phrases",
        "max_tree_nodes": "reuse_target.max_tree_nodes",
        "auto_tree_max": "reuse_target.auto_tree_max",
        "auto_tree_tolerance": "reuse_target.auto_tree_tolerance",
        "precut": "precut",
        "max_draft_length": "precut.max_draft_length",
        "alpha": "precut.alpha",
        "gamma": "precut.gamma",
        "epsilon": "precut.epsilon",
        "init_continue": "precut.init_continue",
        "init_stop": "precut.init_stop",
        "benefit_buckets": "precut.benefit_buckets",
        "target_cost": "precut.target_cost",
        "reward": "precut.reward",
        "warmup_rounds": "precut.warmup_rounds",
        "q_table": "precut.q_table",
        "freeze": "precut.freeze",
    }

    drafter: str | MethodConfig = field(
        default="early-exit", metadata={"help": "wrapped drafter: method spec or config"}
    )
    draft_length: int = field(default=3, metadata={"help": "fixed draft length without precut"})
    cache: TokenCacheSettings = field(
        default_factory=TokenCacheSettings, metadata={"help": "the token cache of verified phrases"}
    )
    reuse_draft: DraftReuse | None = field(
        default_factory=DraftReuse, metadata={"help": "Post-use at the drafter (Algorithm 2)"}
    )
    reuse_target: TargetReuse | None = field(
        default_factory=TargetReuse, metadata={"help": "Post-use at the target (Algorithm 3)"}
    )
    precut: PreCut | None = field(
        default_factory=PreCut, metadata={"help": "Q-learning draft-length controller (off: fixed length)"}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_at_least(1, "draft_length")
