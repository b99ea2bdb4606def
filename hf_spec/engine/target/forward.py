"""The verification forward and its inputs, and what a verification costs by tree size on this machine.

How much each extra tree node costs depends on the hardware (flat where the matmuls are bandwidth-bound or run on
tiles, rising where they are compute-bound), so tree budgets can be measured rather than fixed:
`flat_tree_budget` turns measured costs into the largest tree that verifies at about the price of one node;
`measured_tree_budget` does both on a live generation.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from hf_spec.engine.target.cache import crop_cache
from hf_spec.engine.target.windows import sequence_mask
from hf_spec.tree.draft_tree import DraftTree
from hf_spec.tree.masks import tree_attention_mask, tree_position_ids

logger = logging.getLogger(__name__)


def verification_inputs(
    model, root: torch.Tensor, tree: DraftTree, past: int, backend=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | dict | None]:
    """`(input_ids, position_ids, attention_mask)` of the verification forward of `[root] + tree` after `past`
    cached tokens: `(1, num_nodes + 1)` ids and positions; `None` mask for a chain (plain causal attention),
    else the 4D tree mask (windowed for sliding-window models), built by `backend.tree_inputs` where given.

    Args:
        root: `torch.LongTensor` of shape `(1, 1)`, the last committed token.
    """
    device = root.device
    input_ids = torch.cat([root, tree.tokens.view(1, -1).to(device)], dim=1)
    if tree.is_chain:  # an empty tree is a chain
        return input_ids, torch.arange(past, past + input_ids.shape[1], device=device).unsqueeze(0), None
    if backend is not None:
        position_ids, mask = backend.tree_inputs(tree, past, model.dtype, device)
    else:
        position_ids = tree_position_ids(tree, past, device)
        mask = tree_attention_mask(tree, past, model.dtype, device)
    return input_ids, position_ids, sequence_mask(model, mask, position_ids)


@torch.no_grad()
def time_verifications(drafter, state, sizes: list[int], repeats: int = 3) -> dict[int, float]:
    """Seconds of one greedy verification forward of an `n`-node tree for each `n` in `sizes` (the minimum of
    `repeats` after one warm-up call), through `drafter.verify_forward` on the live cache behind the current
    root; every block is cropped away again, so the state is left as it was. The trees repeat the root token and
    branch (a 4D tree mask, as the loop verifies Post-use's grafted trees), inside the target's kernel backend as
    in the loop.

    Returns:
        `{n: seconds}`.
    """
    from hf_spec.engine.target.profile import target_profile

    model, past = state.model, state.seq_len - 1
    root = state.input_ids[:, -1:]
    profile = target_profile(model)
    screen = profile.screens(do_sample=False, has_processors=False, returns_scores=False)
    costs: dict[int, float] = {}
    for n in sizes:
        # a chain with its last node moved one level up: a branching tree (one node is a chain, as in the loop)
        parents = list(range(-1, n - 2)) + [n - 3] if n > 1 else [-1]
        tree = DraftTree(torch.full((n,), int(root[0, 0])), torch.tensor(parents))
        ids, positions, mask = verification_inputs(model, root, tree, past, profile.backend)
        seconds = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            with profile.backend.verification(model, screen=screen):
                drafter.verify_forward(state, tree, ids, positions, mask, False)
            seconds.append(time.perf_counter() - t0)
            crop_cache(state.cache, past)
        costs[n] = min(seconds[1:])
    return costs


def flat_tree_budget(costs: dict[int, float], tolerance: float) -> int:
    """The largest tree size, up to the largest measured one, whose cost on a least-squares line through
    `costs` (`{nodes: seconds}`) is at most `tolerance` times that line's cost of one node; at least 1.

    Example: costs {1: 34, 5: 38, 9: 42, 13: 46} ms (1 ms a node on 33 ms), tolerance 1.15: one node 34 ms,
    limit 39.1 ms -> 6 nodes. Flat costs -> 13.
    """
    sizes = sorted(costs)
    if len(sizes) < 2:
        return max(sizes[0], 1) if sizes else 1
    slope, intercept = np.polyfit(np.array(sizes, dtype=np.float64), [costs[n] for n in sizes], 1)
    if slope <= 0:
        return sizes[-1]
    one = intercept + slope
    return int(min(max((tolerance * one - intercept) / slope, 1), sizes[-1]))


def measured_tree_budget(
    drafter, state, largest: int, tolerance: float, setting: str
) -> tuple[int, dict[int, float]]:
    """Time verifications of five tree sizes from 1 to `largest` nodes on `state`'s cache (left as it was; see
    `time_verifications`), log them as what decides `setting`, and return `(flat_tree_budget(costs, tolerance),
    costs)`."""
    sizes = sorted({round(1 + i * (largest - 1) / 4) for i in range(5)})
    costs = time_verifications(drafter, state, sizes)
    budget = flat_tree_budget(costs, tolerance)
    logger.info(
        "verification seconds by tree size %s -> %s %d",
        {n: round(t, 4) for n, t in costs.items()},
        setting,
        budget,
    )
    return budget, costs
