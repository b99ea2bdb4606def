"""Config of `postuse`: Post-use (a token cache of verified phrases reused at the drafter and at the target) and
Pre-cut (a Q-learning draft-length controller) around another drafter."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from hf_spec.core.config import MethodConfig


@dataclass
class PostUseConfig(MethodConfig):
    """Post-use & Pre-cut (["Holistic Token Efficient Speculative Decoding"](https://openreview.net/forum?id=ELhSQC3BJE)):
    two training-free plug-ins around any hf-spec drafter.

    - Post-use: the draft positions the target agrees with (also after the first mismatch) and the committed
      text are kept as short phrases in a token cache (`token_cache.py`) and recycled: at the drafter
      (cached phrases behind the last token are checked by the drafter in the same forward; an agreeing
      phrase yields several draft tokens from one forward) and at the target (cached phrases behind the last
      `target_anchors` draft tokens become extra branches of the verification tree).
    - Pre-cut: a Q-learning controller (`controller.py`) stops drafting when more draft calls are unlikely
      to pay.

    Both only change what is proposed; verification keeps the output exactly the target's.

    Args:
        drafter: the wrapped drafter: a method spec (`"early-exit:20"`) or a method config (object, or dict with its
            `method`: `{"method": "early-exit", "exit_layer": 20}`).
        draft_length: fixed draft length lambda (draft tokens per round) when `precut` is off.
        max_draft_length: lambda_max, the longest draft with `precut` [24].
        reuse_draft: Post-use at the drafter (Algorithm 2); needs a step-wise drafter.
        reuse_target: Post-use at the target (Algorithm 3).
        precut: Q-learning draft-length controller; needs a step-wise drafter.
        phrase_length: beta, longest cached phrase, anchor included [5].
        pool_size: kappa_pool, most anchors in the cache [1000].
        phrases_per_anchor: kappa_phase, most phrases per anchor [20].
        draft_phrases: W, cached phrases checked per draft forward.
        target_anchors: m, last draft tokens that get cached phrases at verification [3].
        target_phrases: cached phrases per anchor at verification.
        max_tree_nodes: verification budget (draft + cached nodes); 0: measured at the first generation, the
            largest tree up to `auto_tree_max` nodes whose verification costs at most `auto_tree_tolerance` times
            a one-node one (`hf_spec.engine.target.forward.flat_tree_budget`; 5 where the loop verifies no tree of ours:
            batched rows, transformers' assisted loop). Where verifying more nodes costs nothing extra that is
            `auto_tree_max`; where each node adds to the verification, less.
        auto_tree_max / auto_tree_tolerance: the largest tree measured, and the cost allowed over one node.
        admit_prompt: also admit the prompt's phrases at the start of a generation.
        alpha / gamma / epsilon: Q-learning rate, discount and exploration [0.1, 0.99].
        init_continue / init_stop: initial Q values (CONTINUE slightly above STOP).
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

    The token cache lives as long as the drafter (the paper's pool, across `generate` calls); exploration draws
    from a generator seeded with 0.
    """

    method = "postuse"
    main_arg = "drafter"
    # options of config_version 1 and the value that behaves as today's code
    removed_fields = {"keep_cache": True, "seed": 0}

    drafter: str | MethodConfig = field(
        default="early-exit", metadata={"help": "wrapped drafter: method spec or config"}
    )
    draft_length: int = field(default=3, metadata={"help": "fixed draft length without precut"})
    max_draft_length: int = field(default=24, metadata={"help": "lambda_max with precut"})
    reuse_draft: bool = field(default=True, metadata={"help": "Post-use at the drafter (Algorithm 2)"})
    reuse_target: bool = field(default=True, metadata={"help": "Post-use at the target (Algorithm 3)"})
    precut: bool = field(default=True, metadata={"help": "Q-learning draft-length controller"})
    phrase_length: int = field(default=5, metadata={"help": "beta: longest phrase, anchor included"})
    pool_size: int = field(default=1000, metadata={"help": "kappa_pool: most anchors"})
    phrases_per_anchor: int = field(default=20, metadata={"help": "kappa_phase: most phrases per anchor"})
    draft_phrases: int = field(default=4, metadata={"help": "W: phrases checked per draft forward"})
    target_anchors: int = field(default=3, metadata={"help": "m: last draft tokens given cached branches"})
    target_phrases: int = field(default=2, metadata={"help": "cached phrases per anchor at verification"})
    max_tree_nodes: int = field(
        default=16, metadata={"help": "verification budget in tree nodes (0: measured)"}
    )
    auto_tree_max: int = field(default=13, metadata={"help": "max_tree_nodes 0: largest tree measured"})
    auto_tree_tolerance: float = field(
        default=1.15, metadata={"help": "max_tree_nodes 0: cost allowed over a one-node verification"}
    )
    admit_prompt: bool = field(default=False, metadata={"help": "admit the prompt's phrases"})
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
        for name in ("draft_length", "max_draft_length", "phrase_length", "pool_size", "phrases_per_anchor"):
            if getattr(self, name) < 1:
                raise ValueError(f"postuse {name} must be >= 1, got {getattr(self, name)}")
        if self.max_tree_nodes < 0 or self.auto_tree_max < 1 or self.auto_tree_tolerance < 1.0:
            raise ValueError(
                "postuse: max_tree_nodes must be >= 0 (0: measured), auto_tree_max >= 1 and auto_tree_tolerance "
                f">= 1.0; got {self.max_tree_nodes}, {self.auto_tree_max}, {self.auto_tree_tolerance}"
            )
        if self.phrase_length < 2:
            raise ValueError("postuse phrase_length (beta) must be >= 2: a phrase is an anchor plus tokens")
