"""Accepting a token tree against the target's distributions.

Terms (as in vLLM's rejection sampler):
- *accepted* tokens: draft nodes on the path the target agrees with, from the root downwards;
- *bonus* token: the one token the target itself emits after the last accepted node (a recovered
  token after a rejection, or a free extra token when a whole branch was accepted).
Each verification round therefore commits `len(accepted) + 1` tokens.

Device-to-host transfers are what stalls an accelerator, so each rule reads as little as it can:
- `accept_greedy_logits` (greedy, no logits processors): the argmax of every row in one op and one transfer,
  then the walk on Python ints;
- `accept_greedy` (greedy with processors): the target's scores for a row are produced lazily by
  `score_row(row, path)`, so that logits processors (repetition penalty, ...) see exactly the prefix plain
  `generate` would give them (`path`: the accepted node indices so far); one argmax read per visited row;
- `accept_sampling`: every uniform of the round drawn in one call and read once; at a node whose children are all
  deterministic, their target probabilities are read in one transfer and the rejection steps run on the host.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hf_spec.tree import DraftTree

# score_row(row, path) -> processed scores of shape (vocab_size,) for verification row `row`
ScoreFn = Callable[[int, list[int]], torch.Tensor]


@dataclass
class Acceptance:
    """Result of verifying one tree.

    Args:
        accepted: indices of accepted draft nodes, root's child first.
        bonus: the token the target emits after them.
        scores: processed target scores behind every committed token (`len(accepted) + 1` tensors of shape
            `(vocab_size,)`), in order; empty where the caller did not ask for them.
        predictions: with `accept_greedy_logits`, the argmax of every verification row (`num_nodes + 1` ints).
    """

    accepted: list[int]
    bonus: int
    scores: list[torch.Tensor]
    predictions: list[int] | None = None


def greedy_walk(
    children: list[list[int]], tokens: list[int], predictions: list[int]
) -> tuple[list[int], int]:
    """Follow `predictions` (the target's argmax of row 0 = the root and row `i + 1` = node `i`) down the tree
    while the predicted token is a child; return `(accepted nodes, bonus token)`.

    Example: tokens [a, b, c], parents [-1, 0, -1] (children [[0, 2], [1], [], []]), predictions
    [c, x, y, z] -> node 2 (token c) accepted, then row 3 predicts z, not a child of node 2: ([2], z).
    """
    path: list[int] = []
    node = -1
    while True:
        pred = predictions[node + 1]
        nxt = next((c for c in children[node + 1] if tokens[c] == pred), None)
        if nxt is None:
            return path, pred
        path.append(nxt)
        node = nxt


def accept_greedy_logits(tree: DraftTree, logits: torch.Tensor, want_scores: bool = False) -> Acceptance:
    """Greedy acceptance from raw verification logits `(num_nodes + 1, vocab_size)` (no logits processors)."""
    predictions = logits.argmax(-1).tolist()  # the round's one transfer
    path, bonus = greedy_walk(tree.children, tree.tokens.tolist(), predictions)
    scores = [logits[k] for k in [0, *(i + 1 for i in path)]] if want_scores else []
    return Acceptance(path, bonus, scores, predictions)


def accept_greedy(tree: DraftTree, score_row: ScoreFn) -> Acceptance:
    """Follow the target's argmax down the tree; the first argmax that is not a child is the bonus token."""
    children = tree.children
    tokens = tree.tokens.tolist()
    path: list[int] = []
    rows: list[torch.Tensor] = []
    node = -1
    while True:
        scores = score_row(node + 1, path)
        rows.append(scores)
        pred = int(scores.argmax())
        nxt = next((c for c in children[node + 1] if tokens[c] == pred), None)
        if nxt is None:
            return Acceptance(path, pred, rows)
        path.append(nxt)
        node = nxt


def accept_sampling(
    tree: DraftTree, score_row: ScoreFn, generator: torch.Generator | None = None
) -> Acceptance:
    """Recursive rejection sampling over a tree (SpecInfer's multi-draft rule, exact for every proposal kind).

    At a node, with p the target distribution and children c_1..c_m in proposal order, each drawn from
    q_i (its row of `draft_probs`, a point mass when deterministic):
        accept c_i with probability min(1, p(c_i) / q_i(c_i));
        on rejection p <- normalize(max(p - q_i, 0)) and try c_{i+1};
    if no child is accepted the bonus token is drawn from the final p. Each step is one single-draft
    speculative-sampling step against the current residual, so the committed token is distributed
    exactly as p whatever the q_i are, provided c_i really was drawn from q_i.

    Randomness: `u[i]`, one uniform per node drawn at once (`torch.rand(num_nodes)`), decides child `i`; the bonus
    is one `torch.multinomial` draw after them.
    """
    children = tree.children
    tokens = tree.tokens.tolist()
    probs_q = tree.draft_probs
    path: list[int] = []
    rows: list[torch.Tensor] = [score_row(0, path)]
    device = rows[0].device
    uniforms = torch.rand(len(tree), generator=generator, device=device).tolist() if len(tree) else []
    # deterministic[i]: node i is a point mass (no draft_probs, or an all-zero row)
    deterministic = [True] * len(tree) if probs_q is None else (~probs_q.any(dim=-1)).tolist()
    while True:
        p = torch.softmax(rows[-1].float(), dim=-1)  # target distribution at this node
        kids = children[(path[-1] if path else -1) + 1]
        if all(deterministic[c] for c in kids):
            nxt, p = _point_mass_children(p, kids, tokens, uniforms)
        else:
            nxt, p = _sampled_children(p, kids, tokens, probs_q, deterministic, uniforms)
        if nxt is None:
            bonus = int(torch.multinomial(p, 1, generator=generator))
            return Acceptance(path, bonus, rows)
        path.append(nxt)
        rows.append(score_row(nxt + 1, path))


def _point_mass_children(
    p: torch.Tensor, kids: list[int], tokens: list[int], uniforms: list[float]
) -> tuple[int | None, torch.Tensor]:
    """The rejection steps for deterministic children, on the host: rejecting token t leaves p with p(t) zeroed and
    renormalized, so child k is accepted with probability p(t_k) / (1 - mass of the tokens rejected before it).
    Returns `(accepted child or None, the residual p)`."""
    if not kids:
        return None, p
    mass = p[[tokens[c] for c in kids]].tolist()  # one transfer for all the node's children
    rejected: list[int] = []
    removed = 0.0
    for c, p_tok in zip(kids, mass, strict=True):
        tok = tokens[c]
        left = 1.0 - removed
        accept_prob = 0.0 if tok in rejected or left <= 0.0 else min(p_tok / left, 1.0)
        if uniforms[c] < accept_prob:
            return c, p
        if tok not in rejected:
            rejected.append(tok)
            removed += p_tok
    residual = p.clone()
    residual[rejected] = 0.0
    # the residual is empty only when the rejected tokens held all the mass, a rejection of probability 0
    return None, residual if removed < 1.0 else p


def _sampled_children(
    p: torch.Tensor,
    kids: list[int],
    tokens: list[int],
    probs_q: torch.Tensor,
    deterministic: list[bool],
    uniforms: list[float],
) -> tuple[int | None, torch.Tensor]:
    """The rejection steps at a node with children drawn from distributions (`draft_probs` rows)."""
    for c in kids:
        tok = tokens[c]
        if deterministic[c]:
            accept_prob = float(p[tok])
        else:
            q = probs_q[c].to(p)
            accept_prob = float(torch.clamp(p[tok] / q[tok], max=1.0))
        if uniforms[c] < accept_prob:
            return c, p
        p = _residual(p, tok if deterministic[c] else probs_q[c].to(p))
    return None, p


def _residual(p: torch.Tensor, q: torch.Tensor | int) -> torch.Tensor:
    """normalize(max(p - q, 0)); `q` an int is a point mass on that token."""
    if isinstance(q, int):
        r = p.clone()
        r[q] = 0.0
    else:
        r = torch.clamp(p - q, min=0.0)
    total = r.sum()
    # total == 0 only when p == q, in which case the rejection had probability 0; keep p
    return r / total if float(total) > 0 else p
