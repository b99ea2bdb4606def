"""The Talon drafter: a retrieval tree and a model drafter's tree fused into one token tree per round, the model
optionally drafting ahead on a worker thread (async mode) or the target pre-verifying the retrieval tree there."""

from __future__ import annotations

import copy
import functools
import time
from typing import NamedTuple

import torch

from hf_spec.core.drafter import Drafter, RoundResult, SpecState, check_wrappable
from hf_spec.core.registry import get_method
from hf_spec.engine.target.cache import cache_length, crop_cache
from hf_spec.kernels.screened_head import max_screened_rows
from hf_spec.methods.early_exit.config import EarlyExitConfig
from hf_spec.methods.early_exit.drafter import exit_draft_parts
from hf_spec.methods.early_exit.exit_heads import ExitLM
from hf_spec.methods.retrieval.retriever import Retriever
from hf_spec.methods.talon.chain import ExitChain
from hf_spec.methods.talon.config import TalonConfig
from hf_spec.methods.talon.overlap import DraftWorker
from hf_spec.methods.talon.preverify import PreVerified, finish_verification, pre_verify
from hf_spec.methods.talon.switch import CostAwareSwitch, RunningMean
from hf_spec.tree.draft_tree import DraftTree
from hf_spec.tree.fusion import fuse_trees, fused_path, graft, matched_depth


def _step_nodes(model) -> int:
    """Verified nodes (the root aside) up to which a greedy verification reads this model's screened LM head."""
    head = model.get_output_embeddings()
    weights = head.weight.numel() if head is not None and hasattr(head, "weight") else None
    return max_screened_rows(weights) - 1


class TalonRound(NamedTuple):
    """What a round drafted, for `observe`: the model tree and both trees' node indices in the fused tree (none
    for a dropped retrieval tree), the retrieval match length, whether the model ran, the retrieval tree."""

    model_tree: DraftTree
    model_map: list[int]
    ret_map: list[int]
    match: int
    used_model: bool
    retrieved: DraftTree


class TalonDrafter(Drafter):
    """Hybrid drafting: model tree (first) fused with the retrieval tree; see `TalonConfig`.

    Per round (sync):   retrieval tree | model chain -> fuse -> verify
    Per round (async, pre-retrieve & post-verify): retrieval tree | model chain (already drafted ahead when the
                        guess held) -> fuse -> start drafting the next block on the worker -> the loop verifies
                        meanwhile
    Per round (async, pre-retrieve & pre-verify, `pre_verify`; rounds that do not draft ahead): retrieval tree ->
                        the worker runs the target on it | the model drafts its chain -> fuse -> the loop's
                        verification computes only the model's new nodes (`verify_forward`)
    """

    config: TalonConfig

    def __init__(self, config: TalonConfig, model, tokenizer=None) -> None:
        super().__init__(config, model, tokenizer)
        self.retriever = (
            Retriever(config.retrieval, model, tokenizer) if config.retrieval is not None else None
        )
        self.chain: ExitChain | None = None
        self.exits: ExitLM | None = None  # the chain's exit LM, when it drafts from an early exit
        self.sub: Drafter | None = None
        self.chain_len = 0
        sub_config = config.drafter_config()
        if sub_config is not None:
            if isinstance(sub_config, EarlyExitConfig):
                layer, exits, quantized = exit_draft_parts(sub_config, model)
                self.exits = exits
                self.chain = ExitChain(
                    model,
                    layer,
                    head=functools.partial(exits.logits, layer),
                    min_confidence=sub_config.min_confidence,
                    quantized=quantized,
                )
                self.chain_len = sub_config.num_draft_tokens
            else:
                if config.schedule.mode == "async":
                    raise ValueError(
                        f"talon async mode needs a drafter with its own state (early-exit), not {config.drafter!r}"
                    )
                if sub_config.method == "talon":
                    raise ValueError("talon wraps a model drafter, not itself")
                self.sub = get_method(sub_config.method).drafter_cls(sub_config, model, tokenizer)
                check_wrappable(self.sub, "talon")
                self.requires_hidden_states = self.sub.requires_hidden_states
                self.hidden_state_layers = self.sub.hidden_state_layers
        self._fresh_round_state()

    def _fresh_round_state(self) -> None:
        """The state one generation builds up: worker, switch, counters, the round in flight."""
        config = self.config
        self.worker: DraftWorker | None = None
        self._round: TalonRound | None = None
        rule = config.switch.rule if config.switch is not None else None
        self.switch = (
            CostAwareSwitch(
                explore_every=config.switch.explore_every,
                cost_ratio=config.switch.cost,
                step_nodes=_step_nodes(self.model),
            )
            if rule in ("cost", "best")
            else None
        )
        self.lookup_accepted = RunningMean()  # prompt lookup's chain: tokens accepted, this generation
        self.rounds = {
            "model": 0,
            "model_only": 0,
            "ahead_kept": 0,
            "ahead_dropped": 0,
            "chain_full": 0,
            "pre_verified": 0,
            "extended": 0,
        }
        self._pre: tuple[PreVerified, DraftTree, list[int]] | None = None  # (pre-verified, fused tree, map)
        self._chain_rate = 1.0  # running rate of fully accepted model chains (async switch)
        self._last_chain: list[int] = []
        # nodes of the latest model tree that the model drafted (the rest: retrieval's extension)
        self._own_nodes = 0

    def for_another_row(self) -> TalonDrafter:
        """A drafter sharing this one's loaded parts (datastore, exit LM and packed weights, a sub-drafter's head),
        with a retriever, chain, worker and round state of its own."""
        twin = copy.copy(self)
        if self.retriever is not None:  # the datastore is loaded once per path (`Retriever` caches it)
            twin.retriever = Retriever(self.config.retrieval, self.model, self.tokenizer)
        if self.chain is not None:
            chain = self.chain
            twin.chain = ExitChain(
                self.model,
                chain.exit_layer,
                head=chain.head,
                min_confidence=chain.min_confidence,
                quantized=chain.quantized,
            )
        if self.sub is not None:
            twin.sub = self.sub.for_another_row()
        twin._fresh_round_state()
        return twin

    # ---- lifecycle ---------------------------------------------------------------------------------
    def begin(self, state: SpecState) -> None:
        if self.retriever is not None:  # before the drafters' own state, on the prompt's cache
            self.retriever.fit_budget(self, state)
        if self.chain is not None:
            self.chain.parts.check_window(state.generation_config.max_length, "talon's exit-layer drafter")
            if self.exits is not None:
                self.exits.use_backend(state.backend)
            self.chain.begin(state.cache, state.input_ids[0].tolist(), state.backend)
        if self.sub is not None:
            self.sub.begin(state)
        if self.config.schedule.mode == "async" and self.chain is not None:
            self.worker = DraftWorker(verify_threads=self.config.schedule.verify_threads)
        self._chain_rate = 1.0
        self._pre = None
        if self.switch is not None:
            self.switch.new_generation()
        self.lookup_accepted = RunningMean()

    def end(self, state: SpecState) -> None:
        try:
            if self.worker is not None:
                self.worker.close()
        finally:
            self.worker, self._pre = None, None
            if self.chain is not None:
                self.chain.end()
            if self.sub is not None:
                self.sub.end(state)
            if self.retriever is not None:
                self.retriever.finish(state.input_ids[0].cpu().numpy())

    # ---- drafting ----------------------------------------------------------------------------------
    def propose(self, state: SpecState, max_depth: int) -> DraftTree:
        if self.worker is not None and self.worker.busy:
            self.worker.result()  # the block drafted while the target verified (re-raises its error)
        if self.switch is not None:
            self.switch.start_round()
        ret_tree, match = DraftTree.empty(), 0
        ids = state.input_ids[0].cpu().numpy()
        if self.retriever is not None:
            ret_tree, match = self.retriever.propose(ids, max_depth)
        use_model = self.chain is not None or self.sub is not None
        retrieved = ret_tree  # kept for the switch, also when this round drops it
        switch, fusion = self.config.switch, self.config.fusion
        if use_model and switch is not None and self.retriever is not None:
            if switch.rule == "best":
                pick = self.switch.choose(match, len(ret_tree))
                use_model = pick != "retrieval"
                ret_tree = DraftTree.empty() if pick == "model" else ret_tree
            elif self.switch is not None:
                use_model = self.switch.use_model(match)
            else:
                use_model = match < (switch.skip_match or self.retriever.config.strong_match)
                use_model = use_model and not (switch.skip_lookup and self._copying(switch.skip_lookup))
        both = fusion.both_nodes
        if use_model and 0 < both < len(ret_tree):  # fused: a smaller retrieval tree
            mode = fusion.both_lookup
            whole = mode == "whole" or (mode == "auto" and self._copying(fusion.auto_lookup))
            ret_tree, _ = self.retriever.propose(ids, max_depth, max_nodes=both, lookup_whole=whole)
        ahead = self.worker is not None and self._chain_rate >= self.config.schedule.min_acceptance
        pre = None
        if use_model and not ahead and self._can_pre_verify(state, ret_tree):
            root = int(state.input_ids[0, -1])
            want_hidden = self.requires_hidden_states
            self.worker.submit(lambda stop: pre_verify(state.model, state.cache, root, ret_tree, want_hidden))
            try:
                model_tree = self._model_tree(state, max_depth)
            finally:
                pre = self.worker.result()  # re-raises the worker's error
        else:
            model_tree = self._model_tree(state, max_depth) if use_model else DraftTree.empty()
        fused, model_map, ret_map = fuse_trees(model_tree, ret_tree)
        self._round = TalonRound(model_tree, model_map, ret_map, match, use_model, retrieved)
        self._pre = (pre, fused, ret_map) if pre is not None else None
        self.rounds["pre_verified"] += pre is not None
        if use_model:
            self.rounds["model"] += 1
            self.rounds["model_only"] += not len(ret_tree) and len(retrieved) > 0
            if ahead and len(model_tree):
                n = self._own_nodes + 1 + self.chain_len  # the chain, the guessed bonus, then the next block
                self.worker.submit(lambda stop: self.chain.draft(n, stop))
        return fused

    def _copying(self, tokens: float) -> bool:
        """Whether prompt lookup's chain has had at least `tokens` accepted on average in this generation."""
        return self.lookup_accepted.count > 0 and self.lookup_accepted.value >= tokens

    def _can_pre_verify(self, state: SpecState, ret_tree: DraftTree) -> bool:
        return (
            self.config.schedule.pre_verify
            and self.worker is not None
            and len(ret_tree) > 0
            and state.uses_verify_forward
            and cache_length(state.cache) == state.seq_len - 1
        )

    @property
    def continues_verification(self) -> bool:
        return self.config.schedule.pre_verify

    def verify_forward(self, state, tree, input_ids, position_ids, attention_mask, output_hidden_states):
        """With a pre-verified retrieval tree: only the fused tree's other nodes run now (see `preverify.py`)."""
        pending, self._pre = self._pre, None
        if pending is None:
            return super().verify_forward(
                state, tree, input_ids, position_ids, attention_mask, output_hidden_states
            )
        pre, fused, ret_map = pending
        if tree is not fused and not (
            torch.equal(tree.tokens, fused.tokens) and torch.equal(tree.parents, fused.parents)
        ):  # the loop changed the tree: forget the pre-verified block
            crop_cache(state.cache, pre.past)
            return super().verify_forward(
                state, tree, input_ids, position_ids, attention_mask, output_hidden_states
            )
        return finish_verification(state.model, state.cache, pre, fused, ret_map, output_hidden_states)

    def _model_tree(self, state: SpecState, max_depth: int) -> DraftTree:
        start = time.perf_counter()
        tree = self._draft_model_tree(state, max_depth)
        self._own_nodes = len(tree)
        if self.config.fusion.extend_tokens and len(tree):
            tree = self._extended(state, tree, max_depth)
        if self.switch is not None:
            self.switch.model_drafted(time.perf_counter() - start)
        return tree

    def _extended(self, state: SpecState, tree: DraftTree, max_depth: int) -> DraftTree:
        """`tree` with a retrieval continuation behind its first-child path (the model's most likely draft); the
        continuation's nodes come after all of `tree`'s."""
        children, node, path = tree.children, -1, []
        while children[node + 1]:
            node = children[node + 1][0]
            path.append(node)
        more = self.retriever.continuation(
            state.input_ids[0].cpu().numpy(),
            tree.tokens[path].tolist(),
            min(self.config.fusion.extend_tokens, max_depth - len(path)),
            self.config.fusion.extend_min_match,
        )
        if not more:
            return tree
        self.rounds["extended"] += 1
        # below a leaf every token is a new node; retrieved tokens are deterministic proposals (zero rows)
        extended, _ = graft(tree, [(node, more)], len(tree) + len(more))
        return extended

    def _draft_model_tree(self, state: SpecState, max_depth: int) -> DraftTree:
        if self.sub is not None:
            return self.sub.propose(state, max_depth)
        committed = state.input_ids[0].tolist()
        had = len(self.chain.seq) - len(committed)  # tokens drafted ahead beyond the old commit
        self.chain.sync(committed)
        kept = len(self.chain.seq) - len(committed)
        if had > 0 and self.worker is not None:
            self.rounds["ahead_kept" if kept > 0 else "ahead_dropped"] += 1
        self._last_chain = self.chain.draft(min(self.chain_len, max_depth))
        return DraftTree.chain(self._last_chain)

    def observe(self, state: SpecState, result: RoundResult) -> None:
        no_round = TalonRound(DraftTree.empty(), [], [], 0, False, DraftTree.empty())
        model_tree, model_map, ret_map, match, used_model, retrieved = self._round or no_round
        used_retrieval = len(ret_map) > 0
        accepted = fused_path(model_map, result.accepted)
        lookup = self.retriever.last_lookup if self.retriever is not None else []
        if lookup:  # how far the chain went, whether or not this round verified it whole
            self.lookup_accepted.add(matched_depth(DraftTree.chain(lookup), result.new_tokens), min_rate=0.25)
        if self.switch is not None and self.retriever is not None:
            censored = False
            if used_retrieval or not len(retrieved):
                retrieval_accepted = len(fused_path(ret_map, result.accepted))
            else:  # dropped this round: what it would have had accepted by the committed tokens
                retrieval_accepted = matched_depth(retrieved, result.new_tokens)
                censored = retrieval_accepted >= len(result.new_tokens)
            nodes = len(result.tree)
            self.switch.record(
                match,
                used_model,
                retrieval_accepted,
                len(result.accepted),
                nodes,
                nodes - len(ret_map),
                model_accepted=len(accepted),
                model_size=len(model_tree),
                used_retrieval=used_retrieval,
                retrieval_censored=censored,
            )
        own = min(self._own_nodes, len(model_tree))
        if own < len(model_tree):  # the model drafter sees its own nodes only, not the retrieval extension
            kept = model_tree.draft_probs[:own] if model_tree.draft_probs is not None else None
            model_tree = DraftTree(model_tree.tokens[:own], model_tree.parents[:own], kept)
            accepted = accepted[: next((k for k, i in enumerate(accepted) if i >= own), len(accepted))]
        if self._last_chain and self.chain is not None and len(model_tree):
            full = len(accepted) == len(model_tree)
            self.rounds["chain_full"] += int(full)
            self._chain_rate = 0.8 * self._chain_rate + 0.2 * float(full)
        if self.sub is not None:
            self.sub.observe(
                state, RoundResult(model_tree, accepted, result.new_tokens, result.hidden_states)
            )
        self._last_chain = []


__all__ = ["TalonDrafter"]
