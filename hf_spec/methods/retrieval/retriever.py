"""The stateful retrieval wrapper: datastore + context search -> a pruned, frequency-ordered token tree."""

from __future__ import annotations

import os

import numpy as np

from hf_spec.datastore import Datastore, DatastoreRecipe, Matches, get_datastore, scan_search
from hf_spec.datastore.index import SEP
from hf_spec.datastore.store import tokenizer_id
from hf_spec.engine.target.forward import measured_tree_budget
from hf_spec.methods.pld.ngram_matcher import first_continuation
from hf_spec.methods.retrieval.config import RetrievalConfig
from hf_spec.tree.draft_tree import DraftTree
from hf_spec.tree.retrieval import retrieval_tree

_LOADED: dict[tuple, Datastore] = {}  # one loaded datastore per (recipe key or path), shared by drafters


class Retriever:
    """Proposes retrieval trees for a context (used by the `retrieval` and `talon` drafters)."""

    def __init__(self, config: RetrievalConfig, model, tokenizer=None) -> None:
        self.config = config
        recipe = DatastoreRecipe.from_dict(config.datastore) if config.datastore else None
        building = not config.datastore_path and recipe is not None and not recipe.empty
        if building and tokenizer is None:
            tokenizer = _tokenizer_of(model)
        key = (
            _folder_key(config.datastore_path)
            if config.datastore_path
            else (recipe.key(tokenizer),)
            if building
            else None
        )
        if key is not None and key in _LOADED and not config.grow_online:
            self.datastore = _LOADED[key]
            if tokenizer is not None and self.datastore.meta.get("tokenizer") != tokenizer_id(tokenizer):
                raise ValueError(f"{key[0]} was built with another tokenizer; rebuild it")
        else:
            self.datastore = get_datastore(recipe, model, tokenizer, config.datastore_path)
            if key is not None and not config.grow_online:
                _LOADED[key] = self.datastore
        _check_vocabulary(self.datastore, model)
        self.last_match = 0  # longest match length of the latest search
        self.last_lookup: list[int] = []  # prompt lookup's chain of the latest search
        self._searched: tuple[tuple, list] | None = None  # (context, depth) and matches of the last search
        self.max_nodes = config.max_nodes  # strong matches' budget: the config's, or measured (`auto_nodes`)
        self.verification_costs: dict[int, float] = {}  # {tree nodes: seconds} behind that measurement

    def fit_budget(self, drafter, state) -> None:
        """`auto_nodes`: at the first generation that allows it, measure `max_nodes` on `state`'s cache through
        `drafter`'s verification forward (only in hf-spec's loop, for one sequence: a batch row or transformers'
        assisted loop keeps the config's)."""
        cfg = self.config
        if not cfg.auto_nodes or self.verification_costs or not state.uses_verify_forward:
            return
        if state.cache is None or state.input_ids.shape[0] != 1:
            return
        self.max_nodes, self.verification_costs = measured_tree_budget(
            drafter, state, cfg.max_nodes, cfg.auto_nodes_tolerance, "retrieval max_nodes"
        )

    def matches(
        self, context: np.ndarray, depth: int, text: np.ndarray | None = None
    ) -> list[tuple[Matches, float]]:
        """Matches of `context`'s suffix in the datastore and (`search_context`) in `text` (default: `context`
        itself), each with its source weight."""
        cfg = self.config
        found = []
        if self.datastore.num_tokens:
            found.append(
                (
                    self.datastore.search(context, cfg.max_match, depth, cfg.min_match, cfg.max_occurrences),
                    1.0,
                )
            )
        if cfg.search_context:
            own = context if text is None else text
            found.append((scan_search(own, context, cfg.max_match, depth, cfg.min_match), cfg.context_weight))
        return [(m, w) for m, w in found if m.length > 0 and len(m.counts)]

    def continuation(self, context: np.ndarray, draft: list[int], depth: int, min_match: int) -> list[int]:
        """The most likely `depth`-token continuation of `context` `(seq_len,)` followed by the drafted tokens
        `draft`, from suffix matches of at least `min_match` tokens (the committed `context` is the searched text,
        never the drafted tokens); `[]` when nothing matches that long."""
        if depth <= 0:
            return []
        query = np.concatenate([context, np.asarray(draft, dtype=context.dtype)])
        best, best_weight = [], 0.0
        for m, w in self.matches(query, depth, text=context):
            if m.length < min_match:
                continue
            share = _shares(m, w)
            i = int(share.argmax())
            if share[i] > best_weight:
                row = m.sequences[i]
                best, best_weight = [int(t) for t in row[row != SEP]], float(share[i])
        return best

    def propose(
        self, context: np.ndarray, max_depth: int, max_nodes: int = 0, lookup_whole: bool = False
    ) -> tuple[DraftTree, int]:
        """A retrieval tree of at most `max_depth` levels for `context` `(seq_len,)` and the longest match length.

        The tree is `num_draft_tokens` deep with `max_nodes` (strong match) or `weak_nodes`; a match of
        `long_match` tokens or more earns `long_draft_tokens` and `long_nodes`. A `max_nodes` argument > 0 caps
        the nodes of a tree that is not a long match's (the least frequent subtrees go first). With
        `prompt_lookup`, prompt lookup's candidate is kept whole and the budget grows to its length +
        `prompt_lookup_extra` (at most `max_nodes`); with `lookup_whole` a `max_nodes` argument caps only the
        nodes beside that chain (the config's `max_nodes` caps all). The chain is kept in `last_lookup`.
        """
        cfg = self.config
        self.last_lookup = []
        depth = min(cfg.num_draft_tokens, max_depth)
        long_depth = min(cfg.long_draft_tokens, max_depth) if cfg.long_match else depth
        if long_depth <= 0:
            return DraftTree.empty(), 0
        key = (context.tobytes(), long_depth)  # Talon asks again with a node cap: search once
        if self._searched is None or self._searched[0] != key:
            self._searched = (key, self.matches(context, long_depth))
        found = self._searched[1]
        longest = max((m.length for m, _ in found), default=0)
        if cfg.long_match and longest >= cfg.long_match:
            budget, keep = cfg.long_nodes, long_depth
        else:
            budget, keep = (self.max_nodes if longest >= cfg.strong_match else cfg.weak_nodes), depth
            budget = min(budget, max_nodes) if max_nodes > 0 else budget
        sequences, weights = [], []
        for m, w in found:
            share = _shares(m, w)
            sequences.extend(m.sequences[:, :keep].tolist())
            weights.extend(share.tolist())
        lookup = first_continuation(context, cfg.prompt_lookup, keep) if cfg.prompt_lookup else []
        if lookup:  # outweighs all the rest, so pruning keeps its whole chain first
            sequences.append(lookup)
            weights.append(sum(weights) + 1.0)
            if max_nodes > 0 and lookup_whole:
                budget = min(len(lookup) + max_nodes, self.max_nodes)
            else:
                cap = min(self.max_nodes, max_nodes) if max_nodes > 0 else self.max_nodes
                budget = max(budget, min(len(lookup) + cfg.prompt_lookup_extra, cap))
        self.last_match, self.last_lookup = longest, lookup
        if not sequences:
            return DraftTree.empty(), 0
        tree, _ = retrieval_tree(sequences, weights, budget)
        return tree, longest

    def finish(self, tokens: np.ndarray) -> None:
        if self.config.grow_online:
            self.datastore.add(tokens)
            self._searched = None  # the datastore changed


def _shares(m: Matches, weight: float) -> np.ndarray:
    """Each continuation's weight `(k,)`: a source's occurrences share one unit of `weight`, scaled by its match
    length."""
    return weight * m.length * m.counts / m.counts.sum()


def _folder_key(path: str) -> tuple:
    """A prebuilt datastore's cache key: its folder and when its metadata was written (a rebuilt or deleted
    folder is loaded again)."""
    try:
        written = os.stat(os.path.join(path, "meta.json")).st_mtime_ns
    except OSError:
        written = None
    return (os.path.abspath(path), written)


def _check_vocabulary(datastore: Datastore, model) -> None:
    """Every stored token id must be one of the target's (a datastore built for another model fails here)."""
    if datastore.index is None or not datastore.index.num_tokens:
        return
    head = model.get_output_embeddings()
    vocab = head.weight.shape[0] if head is not None else model.config.vocab_size
    largest = int(np.asarray(datastore.index.text).max())
    if largest >= vocab:
        raise ValueError(
            f"the datastore holds token id {largest}, outside the target's vocabulary ({vocab}): "
            "it was built for another model; rebuild it with this target's tokenizer"
        )


def _tokenizer_of(model):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model.name_or_path)
    except Exception as err:  # noqa: BLE001 - any failure means: ask the caller for the tokenizer
        raise ValueError(
            "the retrieval datastore needs the target's tokenizer: pass it "
            f"(SpeculativeDecoder(..., tokenizer=tok)); loading one from {model.name_or_path!r} failed: {err}"
        ) from None
