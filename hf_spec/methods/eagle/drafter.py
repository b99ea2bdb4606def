"""EAGLE-2 dynamic draft trees from an EAGLE/HASS feature head.

Per round: the head catches up on the committed positions it has not seen (their target features are known
now), then grows the tree level by level: the `topk` best nodes of the last level (by cumulative log-probability)
are fed to the head together, in one forward with a tree mask, and each gets its `topk` best children. After
`depth` levels all nodes are reranked and the best `total_tokens` are verified. The head's KV cache keeps the
committed positions only; draft positions are cropped after each round.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from hf_spec.heads.eagle.modeling import EagleHeadModel
from hf_spec.kernels.skinny_linear import fast_linears, skinny_linear
from hf_spec.methods.base import Drafter, RoundResult, SpecState
from hf_spec.methods.eagle.config import EagleConfig
from hf_spec.training.features import unit_features
from hf_spec.tree.buffers import DraftTree
from hf_spec.verify.cache import cache_length, crop_cache


def load_head(path: str, target) -> EagleHeadModel:
    if not path:
        raise ValueError("eagle needs a head folder: eagle:<folder> (train one with `hf-spec train eagle`)")
    try:
        head = EagleHeadModel.from_pretrained(path, dtype=torch.float32)
    except OSError as err:
        raise ValueError(f"cannot load an EAGLE head from {path!r}: {err}") from None
    return head.eval().attach_target(target)


class EagleDrafter(Drafter):
    requires_hidden_states = True
    config: EagleConfig

    def __init__(
        self, config: EagleConfig, model, tokenizer=None, head: EagleHeadModel | None = None
    ) -> None:
        super().__init__(config, model, tokenizer)
        self.head = head.attach_target(model) if head is not None else load_head(config.head, model)
        self.cache = DynamicCache()
        self.pending_features: list[
            torch.Tensor
        ] = []  # [n, H] chunks: f_{p-1} of positions not in the cache yet
        self.norm = model.model.norm

    # ---- bookkeeping of committed positions --------------------------------------------------------------------
    def begin(self, state: SpecState) -> None:
        self.cache = DynamicCache()
        if state.hidden_states is None or state.hidden_states.shape[1] != state.seq_len - 1:
            raise ValueError("eagle needs the target's hidden states of the prompt (requires_hidden_states)")
        self.pending_features = [self._unit(state.hidden_states[0])]

    def observe(self, state: SpecState, result: RoundResult) -> None:
        self.pending_features.append(self._unit(result.hidden_states[0]))

    def end(self, state: SpecState) -> None:
        self.cache = DynamicCache()
        self.pending_features = []

    def _unit(self, hidden: torch.Tensor) -> torch.Tensor:
        return unit_features(hidden, self.norm)

    # ---- drafting ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def propose(self, state: SpecState, max_depth: int) -> DraftTree:
        cfg = self.config
        with fast_linears(self.head):
            h_root = self._catch_up(state)
            depth = min(cfg.depth, max_depth)
            if depth <= 0:
                return DraftTree.empty()
            tree = self._grow(h_root, state.seq_len - 1, depth)
        return tree

    def _catch_up(self, state: SpecState) -> torch.Tensor:
        """Feed the committed positions the head has not seen; return the head state at the root `(H,)`."""
        features = torch.cat(self.pending_features)  # [P, H]: f_{p-1} for the pending positions p
        self.pending_features = []
        past = cache_length(self.cache)
        first = state.seq_len - features.shape[0]  # positions first .. seq_len-1 (the root)
        if first != past + 1:
            raise RuntimeError(f"eagle head cache out of step: holds {past} positions, next is {first}")
        ids = state.input_ids[:, first:]
        positions = torch.arange(first, state.seq_len).view(1, -1)
        mask = causal_mask(features.shape[0], past)
        h = self.head(features[None], ids, positions, mask, self.cache)
        return h[0, -1]

    def _logp(self, h: torch.Tensor) -> torch.Tensor:
        """Head states `(n, H)` -> log-probabilities over the draft vocabulary `(n, V_draft)`."""
        parts = self.head.parts
        return torch.log_softmax(skinny_linear(parts.norm(h), parts.lm_weight).float(), dim=-1)

    def _grow(self, h_root: torch.Tensor, root_pos: int, depth: int) -> DraftTree:
        cfg, d2t = self.config, self.head.d2t
        committed = cache_length(self.cache)
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        depths: list[int] = []
        slot_of: dict[int, int] = {}  # node -> head-cache slot (fed nodes only)
        source_h: list[torch.Tensor] = []  # the head state each node was predicted from

        def add_children(parent: int, h: torch.Tensor, logp: torch.Tensor, base: float, level: int) -> None:
            top = torch.topk(logp, cfg.topk)
            for lp, idx in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                tokens.append(int(d2t[idx]))
                parents.append(parent)
                scores.append(base + lp)
                depths.append(level)
                source_h.append(h)

        add_children(-1, h_root, self._logp(h_root[None])[0], 0.0, 1)
        level_nodes = list(range(len(tokens)))
        try:
            for level in range(2, depth + 1):
                beam = sorted(level_nodes, key=lambda i: -scores[i])[: cfg.topk]
                h = self._feed(beam, tokens, parents, source_h, slot_of, committed, root_pos + level - 1)
                logp = self._logp(h)
                level_nodes = []
                for row, node in enumerate(beam):
                    start = len(tokens)
                    add_children(node, h[row], logp[row], scores[node], level)
                    level_nodes.extend(range(start, len(tokens)))
        finally:
            crop_cache(self.cache, committed)
        return rerank(tokens, parents, scores, depths, cfg.total_tokens)

    def _feed(self, beam, tokens, parents, source_h, slot_of, committed: int, position: int) -> torch.Tensor:
        """One head forward of the `beam` nodes (same depth) with a tree mask; returns their head states."""
        past = cache_length(self.cache)
        n = len(beam)
        allowed = torch.zeros(n, past + n, dtype=torch.bool)
        allowed[:, :committed] = True
        for row, node in enumerate(beam):
            allowed[row, past + row] = True
            anc = parents[node]
            while anc >= 0:
                allowed[row, slot_of[anc]] = True
                anc = parents[anc]
            slot_of[node] = past + row
        mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
        features = torch.stack([source_h[i] for i in beam])[None]
        ids = torch.tensor([[tokens[i] for i in beam]])
        positions = torch.full((1, n), position)
        return self.head(features, ids, positions, mask, self.cache)[0]


def rerank(
    tokens: list[int], parents: list[int], scores: list[float], depths: list[int], budget: int
) -> DraftTree:
    """Keep the `budget` nodes of highest cumulative log-probability (ancestors first on ties, and always kept),
    ordered by depth then score so parents precede children and siblings come best first."""
    order = sorted(range(len(tokens)), key=lambda i: (-scores[i], depths[i]))
    keep: set[int] = set()
    for i in order:
        if len(keep) >= budget:
            break
        node = i
        while node >= 0 and node not in keep:
            keep.add(node)
            node = parents[node]
    kept = sorted(keep, key=lambda i: (depths[i], -scores[i]))
    index = {old: new for new, old in enumerate(kept)}
    return DraftTree(
        torch.tensor([tokens[i] for i in kept], dtype=torch.long),
        torch.tensor([index[parents[i]] if parents[i] >= 0 else -1 for i in kept], dtype=torch.long),
    )


def causal_mask(q_len: int, past: int) -> torch.Tensor:
    """Additive `(1, 1, q_len, past + q_len)`: every query sees the cache and the queries up to itself."""
    allowed = torch.ones(q_len, past + q_len, dtype=torch.bool).tril(diagonal=past)
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
