"""The Post-use & Pre-cut wrapper: any drafter + a recycling token cache + a Q-learning draft-length cut."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from hf_spec.core.config import MethodConfig
from hf_spec.core.drafter import Drafter, RoundResult, SpecState, check_wrappable
from hf_spec.engine.target.forward import measured_tree_budget
from hf_spec.methods.postuse.branches import agreeing_runs, windows
from hf_spec.methods.postuse.config import PostUseConfig
from hf_spec.methods.postuse.controller import PreCutController
from hf_spec.methods.postuse.token_cache import TokenCache
from hf_spec.methods.stepwise import DraftStep, StepwiseDrafter
from hf_spec.tree.draft_tree import DraftTree
from hf_spec.tree.fusion import graft

EMA = 0.05  # smoothing of the measured draft-call and verification times
# `max_tree_nodes: 0` where the loop verifies no tree of ours (batched rows, transformers' assisted loop)
UNMEASURED_TREE_NODES = 5


@dataclass
class PostUseStats:
    """Counters since the drafter was built (all generations). `chain_*`: tokens the wrapped drafter drafted;
    `cache_*`: nodes grafted from the cache at verification."""

    rounds: int = 0
    draft_calls: int = 0
    chain_tokens: int = 0
    chain_accepted: int = 0
    chain_useful: int = 0  # paper Eq. 7: chain tokens the target agrees with, also after the first mismatch
    reused_at_draft: int = 0  # chain tokens taken from cached phrases at the drafter
    cache_nodes: int = 0
    cache_accepted: int = 0
    cache_seconds: float = 0.0  # lookups, grafting and admissions
    controller_seconds: float = 0.0
    rounds_log: list[dict] | None = field(default=None, repr=False)  # per-round records when a list

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "rounds_log"}


@dataclass
class PostUseRound:
    """What a round drafted, for `observe`: the chain, where its tokens sit in the tree, the draft calls and the
    controller's states."""

    chain: list[int]  # [root] + drafted chain tokens
    chain_nodes: list[int]  # tree node of each drafted chain token
    call_ends: list[int]  # chain length after each draft call
    states: list[tuple[int, int]]  # controller state after each draft call
    grafted_from: int  # nodes >= this index came from the cache


def build_drafter(spec: str | MethodConfig, model, tokenizer=None) -> Drafter:
    """The wrapped drafter from a method spec (`"early-exit:20"`) or a method config."""
    from hf_spec.core.registry import get_method
    from hf_spec.core.specs import parse_method

    config = parse_method(spec)
    if config.method == "postuse":
        raise ValueError("postuse wraps another drafter, not itself")
    return get_method(config.method).drafter_cls(config, model, tokenizer)


class PostUseDrafter(Drafter):
    """Wraps a drafter: Post-use token cache (reuse at the drafter and at the target) and Pre-cut controller.

    Args:
        config: `PostUseConfig`.
        model: the target.
        inner: a ready drafter to wrap (default: built from `config.drafter`).
    """

    config: PostUseConfig
    requires_target_predictions = True

    def __init__(self, config: PostUseConfig, model, tokenizer=None, inner: Drafter | None = None) -> None:
        super().__init__(config, model, tokenizer)
        self.inner = inner if inner is not None else build_drafter(config.drafter, model, tokenizer)
        check_wrappable(self.inner, "postuse")
        self.requires_hidden_states = self.inner.requires_hidden_states
        self.hidden_state_layers = self.inner.hidden_state_layers
        self.stepwise = isinstance(self.inner, StepwiseDrafter)
        if (config.reuse_draft is not None or config.precut is not None) and not self.stepwise:
            raise ValueError(
                f"postuse reuse_draft/precut drive the drafter one forward at a time; "
                f"{type(self.inner).__name__} does not support that (StepwiseDrafter). Use reuse_target only "
                "(reuse_draft and precut null)."
            )
        self.cache: TokenCache | None = None
        if config.reuse_draft is not None or config.reuse_target is not None:
            cache = config.cache
            self.cache = TokenCache(cache.pool_size, cache.phrases_per_anchor, cache.phrase_length)
        self.controller: PreCutController | None = None
        if config.precut is not None:
            precut = config.precut
            self.controller = PreCutController(
                precut.max_draft_length,
                precut.benefit_buckets,
                precut.alpha,
                precut.gamma,
                precut.epsilon,
                precut.init_continue,
                precut.init_stop,
                frozen=precut.freeze,
            )
            if precut.q_table:
                self.controller.load(precut.q_table)
        self.stats = PostUseStats()
        self.draft_seconds: float | None = None  # EMA of one draft call
        self.verify_seconds: float | None = None  # EMA of one verification round (propose end -> observe)
        self._round: PostUseRound | None = None
        self._proposed_at = 0.0
        self._next_window = 0  # first committed position whose window is not final in the cache
        self._stats_at_begin: dict = {}
        # verification budget of Post-use at the target: measured at the first `begin` when 0
        self.tree_budget = (
            (config.reuse_target.max_tree_nodes or None) if config.reuse_target is not None else 0
        )
        self.verification_costs: dict[int, float] = {}  # {tree nodes: seconds} behind that measurement

    # ---- lifecycle ----------------------------------------------------------------------------------
    def for_another_row(self) -> PostUseDrafter:
        """A wrapper around a copy of the inner drafter (sharing its loaded parts), with a token cache, controller
        and counters of its own; the measured tree budget is kept."""
        twin = type(self)(self.config, self.model, self.tokenizer, inner=self.inner.for_another_row())
        twin.tree_budget, twin.verification_costs = self.tree_budget, dict(self.verification_costs)
        return twin

    def begin(self, state: SpecState) -> None:
        if self.tree_budget is None and state.uses_verify_forward and state.cache is not None:
            self._measure_tree_budget(state)
        self.inner.begin(state)
        self._stats_at_begin = self.stats.to_dict()
        self._round = None
        self._next_window = 0 if self.config.cache.admit_prompt else state.seq_len - 1
        if self.cache is not None:
            t0 = time.perf_counter()
            self._admit_committed(state.input_ids[0].tolist())
            self.stats.cache_seconds += time.perf_counter() - t0

    def end(self, state: SpecState) -> None:
        self.inner.end(state)

    def _measure_tree_budget(self, state: SpecState) -> None:
        """`max_tree_nodes: 0`: time verifications of 1 to `auto_tree_max` nodes on this prompt's cache and keep
        the largest tree that costs about as much as one node (once per drafter)."""
        cfg = self.config.reuse_target
        self.tree_budget, self.verification_costs = measured_tree_budget(
            self, state, cfg.auto_tree_max, cfg.auto_tree_tolerance, "postuse reuse_target.max_tree_nodes"
        )

    @property
    def counts(self) -> dict[str, float]:
        """This generation's `PostUseStats` counters (the bench reports them per prompt)."""
        now = self.stats.to_dict()
        return {k: v - self._stats_at_begin.get(k, 0) for k, v in now.items()}

    @property
    def target_cost(self) -> float:
        """One target call in draft-call units (configured, or the measured ratio; 1 before any measurement)."""
        precut = self.config.precut
        if precut is not None and precut.target_cost > 0:
            return precut.target_cost
        if self.draft_seconds and self.verify_seconds:
            return self.verify_seconds / self.draft_seconds
        return 1.0

    # ---- drafting ------------------------------------------------------------------------------------
    @torch.no_grad()
    def propose(self, state: SpecState, max_depth: int) -> DraftTree:
        cfg = self.config
        root = int(state.input_ids[0, -1])
        if self.stepwise:
            limit = cfg.precut.max_draft_length if self.controller is not None else cfg.draft_length
            chain, call_ends, states = self._draft_chain(state, min(limit, max_depth))
            tree, chain_nodes = DraftTree.chain(chain), list(range(len(chain)))
        else:
            tree = self.inner.propose(state, max_depth)
            chain_nodes = _deepest_path(tree)
            chain, call_ends, states = tree.tokens[chain_nodes].tolist(), [], []
        grafted_from = len(tree)
        if cfg.reuse_target is not None and self.cache is not None and max_depth > 0:
            t0 = time.perf_counter()
            tree = self._graft_cached(tree, [root] + chain, [-1] + chain_nodes, max_depth)
            self.stats.cache_seconds += time.perf_counter() - t0
        self._round = PostUseRound([root] + chain, chain_nodes, call_ends, states, grafted_from)
        self._proposed_at = time.perf_counter()
        return tree

    def _draft_chain(
        self, state: SpecState, budget: int
    ) -> tuple[list[int], list[int], list[tuple[int, int]]]:
        """Algorithm 2 with the Pre-cut decision after every draft call. Returns the chain, the chain length
        after each call and the controller state after each call."""
        cfg, inner, ctrl = self.config, self.inner, self.controller
        if budget <= 0 or not inner.draft_start(state):
            return [], [], []
        chain: list[int] = []
        call_ends: list[int] = []
        states: list[tuple[int, int]] = []
        feed = [int(state.input_ids[0, -1])]
        benefit = 1.0
        warming = ctrl is not None and not ctrl.frozen and ctrl.updates < cfg.precut.warmup_rounds
        try:
            while len(chain) < budget:
                room = budget - len(chain)
                branches: list[list[int]] = []
                if cfg.reuse_draft is not None and room > 1:
                    t0 = time.perf_counter()
                    branches = [list(p[1:room]) for p in self.cache.lookup(feed[-1], cfg.reuse_draft.phrases)]
                    self.stats.cache_seconds += time.perf_counter() - t0
                t0 = time.perf_counter()
                step = inner.draft_step(feed, branches)
                new, rows, kept = self._take(step, branches)
                self._draft_time(time.perf_counter() - t0)
                self.stats.reused_at_draft += kept
                new = new[:room]
                chain += new
                call_ends.append(len(chain))
                feed = [new[-1]]
                if ctrl is not None:
                    t0 = time.perf_counter()
                    for row, tok in zip(rows, new, strict=False):
                        benefit *= float(torch.softmax(row, dim=-1)[tok])
                    s = ctrl.state(len(call_ends), benefit)
                    states.append(s)
                    go_on = warming or ctrl.should_continue(s)
                    self.stats.controller_seconds += time.perf_counter() - t0
                    if not go_on:
                        break
        finally:
            inner.draft_stop(state)
        return chain, call_ends, states

    def _take(self, step: DraftStep, branches: list[list[int]]) -> tuple[list[int], list[torch.Tensor], int]:
        """The drafter's own next token, or, when a cached phrase agrees with the drafter for `l >= 1` tokens
        (each one its argmax), those `l` tokens plus the drafter's token after them, all from this one
        forward. Returns the tokens, the logit rows they are the argmax of, and how many came from the cache.

        (The paper appends a phrase when it is "longer than 1"; one agreeing token already saves a draft call,
        so any agreement is taken.)"""
        token = int(step.chain.argmax())
        best, best_len, best_preds = -1, 0, []
        for b, (branch, logits) in enumerate(zip(branches, step.branches, strict=True)):
            if branch[0] != token:
                continue
            preds = logits.argmax(-1).tolist()  # the drafter's token after each branch token
            n = 1
            while n < len(branch) and branch[n] == preds[n - 1]:
                n += 1
            if n > best_len:
                best, best_len, best_preds = b, n, preds
        if not best_len:
            return [token], [step.chain], 0
        phrase = branches[best][:best_len]
        self.inner.draft_keep(best, best_len, phrase)
        rows = [step.chain] + [step.branches[best][j] for j in range(best_len)]
        return phrase + [best_preds[best_len - 1]], rows, best_len

    def _graft_cached(self, tree: DraftTree, path: list[int], nodes: list[int], max_depth: int) -> DraftTree:
        """Algorithm 3: cached phrases behind the last `reuse_target.anchors` tokens of the chain (the root counts
        when the chain is shorter), deepest anchor first, within `reuse_target.max_tree_nodes` and `max_depth`."""
        cfg = self.config.reuse_target
        grafts = []
        for depth in range(len(path) - 1, max(len(path) - 1 - cfg.anchors, -1), -1):
            room = max_depth - depth
            if room <= 0:
                continue
            for phrase in self.cache.lookup(path[depth], cfg.phrases):
                grafts.append((nodes[depth], list(phrase[1 : 1 + room])))
        tree, added = graft(tree, grafts, max(self.tree_budget or UNMEASURED_TREE_NODES, len(tree)))
        self.stats.cache_nodes += added
        return tree

    def _draft_time(self, seconds: float) -> None:
        self.draft_seconds = (
            seconds if self.draft_seconds is None else (1 - EMA) * self.draft_seconds + EMA * seconds
        )

    # ---- learning from the verification --------------------------------------------------------------
    def observe(self, state: SpecState, result: RoundResult) -> None:
        self.inner.observe(state, result)
        rnd, self._round = self._round, None
        if rnd is None:
            return
        verify = time.perf_counter() - self._proposed_at
        self.verify_seconds = (
            verify if self.verify_seconds is None else (1 - EMA) * self.verify_seconds + EMA * verify
        )
        agree = self._agreement(rnd, result)
        accepted = set(result.accepted)
        n_accepted = 0
        while n_accepted < len(rnd.chain_nodes) and rnd.chain_nodes[n_accepted] in accepted:
            n_accepted += 1
        st = self.stats
        st.rounds += 1
        st.chain_tokens += len(rnd.chain_nodes)
        st.draft_calls += len(rnd.call_ends)
        st.chain_accepted += n_accepted
        st.chain_useful += sum(agree)
        st.cache_accepted += sum(1 for i in result.accepted if i >= rnd.grafted_from)
        if st.rounds_log is not None:
            st.rounds_log.append(
                {
                    "drafted": len(rnd.chain_nodes),
                    "accepted": n_accepted,
                    "useful": sum(agree),
                    "calls": len(rnd.call_ends),
                    "nodes": len(result.tree),
                    "accepted_nodes": len(result.accepted),
                }
            )
        if self.cache is not None:
            t0 = time.perf_counter()
            self._admit_committed(state.input_ids[0].tolist())
            for run in agreeing_runs(rnd.chain, agree):
                for phrase in windows(run, self.config.cache.phrase_length):
                    self.cache.admit(phrase)
            st.cache_seconds += time.perf_counter() - t0
        if self.controller is not None and rnd.states:
            t0 = time.perf_counter()
            self.controller.target_cost = self.target_cost
            self.controller.update(rnd.states, self._rewards(rnd, agree))
            st.controller_seconds += time.perf_counter() - t0

    def _agreement(self, rnd: PostUseRound, result: RoundResult) -> list[bool]:
        """Per chain token: does the target's argmax after its parent equal it (paper Eq. 7)? Without the
        target's predictions (transformers' assisted loop), the accepted prefix."""
        preds = result.target_predictions
        if preds is None:
            accepted = set(result.accepted)
            out, ok = [], True
            for node in rnd.chain_nodes:
                ok = ok and node in accepted
                out.append(ok)
            return out
        preds = preds.tolist()
        tokens, parents = result.tree.tokens.tolist(), result.tree.parents.tolist()
        return [tokens[n] == preds[parents[n] + 1] for n in rnd.chain_nodes]

    def _rewards(self, rnd: PostUseRound, agree: list[bool]) -> list[float]:
        """r_t = eta_t - 1 for stopping after call t: useful (or accepted, or committed) tokens of the first t
        calls over their cost, t draft calls + one target call."""
        cost_target = self.target_cost
        rewards = []
        for t, end in enumerate(rnd.call_ends, start=1):
            if self.config.precut.reward == "useful":
                gained = sum(agree[:end])
            else:  # the accepted prefix (+ the bonus token for "committed")
                gained = next((i for i, ok in enumerate(agree[:end]) if not ok), end)
                gained += self.config.precut.reward == "committed"
            rewards.append(gained / (t + cost_target) - 1.0)
        return rewards

    def _admit_committed(self, seq: list[int]) -> None:
        """Windows of the committed text: every position from `_next_window` on anchors its next
        `phrase_length - 1` tokens; a window cut by the end is admitted now and replaced when it grows."""
        beta = self.config.cache.phrase_length
        for s in range(self._next_window, len(seq) - 1):
            self.cache.admit(seq[s : s + beta])
            if s + beta <= len(seq):
                self._next_window = s + 1

    # ---- persistence of the controller ----------------------------------------------------------------
    def save_q_table(self, path) -> None:
        if self.controller is None:
            raise ValueError("this postuse drafter has no Pre-cut controller (precut is null)")
        self.controller.target_cost = self.target_cost
        self.controller.save(path)


def _deepest_path(tree: DraftTree) -> list[int]:
    """Nodes from the root's child to the first deepest node."""
    if len(tree) == 0:
        return []
    return tree.path_to(int(torch.argmax(tree.depth)))
