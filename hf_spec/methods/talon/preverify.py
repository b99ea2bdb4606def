"""Talon's pre-retrieve & pre-verify: the target verifies the retrieval tree while the model drafter drafts, and
the round's verification forward then computes only the fused tree's nodes the retrieval tree did not have.

    pre = pre_verify(model, cache, root, ret_tree)            # worker thread, beside the model drafting
    out = finish_verification(model, cache, pre, fused, ret_map, ...)   # the loop's verification forward

Each node's logits depend only on its own path, so computing the fused tree in two forwards (the retrieval nodes
first, the rest attending to their slots) gives the stock forward's logits; the cache block is then put back in
the fused tree's order, as the loop expects.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from hf_spec.core.compat import cache_kwargs
from hf_spec.engine.target.cache import cache_length, compact_cache
from hf_spec.engine.target.profile import target_profile
from hf_spec.engine.target.windows import sequence_mask, windowed_mask
from hf_spec.tree.draft_tree import DraftTree
from hf_spec.tree.masks import additive_mask, tree_attention_mask, tree_position_ids


@dataclass
class PreVerified:
    """The target's forward of `[root] + tree`, written into the cache at `[past, past + len(tree) + 1)`."""

    tree: DraftTree
    past: int
    logits: torch.Tensor  # [len(tree) + 1, vocab_size]
    hidden: torch.Tensor | None  # [len(tree) + 1, hidden_size], last layer


@torch.no_grad()
def pre_verify(model, cache, root: int, tree: DraftTree, output_hidden_states: bool = False) -> PreVerified:
    """Run the target on `[root] + tree` (the retrieval tree) after the committed cache."""
    past = cache_length(cache)
    device = next(model.parameters()).device
    ids = torch.cat([torch.tensor([root]), tree.tokens]).view(1, -1).to(device)
    positions = tree_position_ids(tree, past, device)
    out = model(
        input_ids=ids,
        position_ids=positions,
        attention_mask=sequence_mask(model, tree_attention_mask(tree, past, model.dtype, device), positions),
        **cache_kwargs(model, cache),
        use_cache=True,
        output_hidden_states=output_hidden_states,
    )
    hidden = out.hidden_states[-1][0] if output_hidden_states else None
    return PreVerified(tree, past, out.logits[0], hidden)


@torch.no_grad()
def finish_verification(
    model, cache, pre: PreVerified, fused: DraftTree, pre_map: list[int], output_hidden_states: bool = False
) -> CausalLMOutputWithPast:
    """Complete the verification of `[root] + fused`, where `pre_map[i]` is pre-verified node `i`'s index in
    `fused`: one forward of the other nodes (attending to the pre-verified slots of their ancestors), then the
    cache block reordered to `[root] + fused`. Returns what the stock forward of `[root] + fused` returns
    (`.logits` `(1, len(fused) + 1, vocab_size)`, `.hidden_states[-1]` when asked)."""
    if output_hidden_states and pre.hidden is None:
        raise ValueError("hidden states were asked for but the pre-verification did not keep them")
    past, m = pre.past, len(pre.tree)
    slot = [0] * (len(fused) + 1)  # block slot (relative to past) of each [root] + fused node
    for i, f in enumerate(pre_map):
        slot[f + 1] = i + 1
    pre_verified = set(pre_map)
    new = [f for f in range(len(fused)) if f not in pre_verified]
    for j, f in enumerate(new):
        slot[f + 1] = m + 1 + j
    logits = pre.logits.new_empty((len(fused) + 1, pre.logits.shape[-1]))
    hidden = pre.hidden.new_empty((len(fused) + 1, pre.hidden.shape[-1])) if output_hidden_states else None
    old = [0] + [f + 1 for f in pre_map]
    logits[old] = pre.logits
    if hidden is not None:
        hidden[old] = pre.hidden
    if new:
        device = pre.logits.device
        rows = [f + 1 for f in new]
        visible = torch.from_numpy(fused.ancestor_matrix())[rows]  # [len(new), len(fused) + 1]
        allowed = torch.zeros(len(new), past + m + 1 + len(new), dtype=torch.bool)
        allowed[:, :past] = True
        cols = torch.tensor(slot) + past
        allowed[:, cols] = visible
        depth = fused.depth[torch.tensor(new)]
        positions = (depth + past).view(1, -1)
        key_positions = torch.arange(past + m + 1 + len(new))  # block slots: [root] + fused nodes, by slot
        key_positions[cols] = torch.cat([torch.zeros(1, dtype=torch.long), fused.depth]) + past
        mask = windowed_mask(
            model, additive_mask(allowed, model.dtype).to(device), positions, key_positions[None]
        )
        with target_profile(model).backend.drafting(model, linears=True):
            out = model(
                input_ids=fused.tokens[torch.tensor(new)].view(1, -1).to(device),
                position_ids=positions.to(device),
                attention_mask=mask,
                **cache_kwargs(model, cache),
                use_cache=True,
                output_hidden_states=output_hidden_states,
            )
        logits[rows] = out.logits[0]
        if hidden is not None:
            hidden[rows] = out.hidden_states[-1][0]
    compact_cache(cache, past, slot)  # block -> [root] + fused order
    return CausalLMOutputWithPast(
        logits=logits[None], hidden_states=(hidden[None],) if hidden is not None else None
    )
