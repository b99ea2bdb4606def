"""Accepting a token tree against the target's distributions.

Terms (as in vLLM's rejection sampler):
- *accepted* tokens: draft nodes on the path the target agrees with, from the root downwards;
- *bonus* token: the one token the target itself emits after the last accepted node (a recovered
  token after a rejection, or a free extra token when a whole branch was accepted).
Each verification round therefore commits `len(accepted) + 1` tokens.

The target's scores for a row are produced lazily by `score_row(row, path)` so that logits
processors (repetition penalty, temperature, top-k/top-p, ...) see exactly the prefix that plain
`generate` would give them: `path` is the list of accepted node indices so far.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hf_spec.tree.buffers import DraftTree

# score_row(row, path) -> processed scores of shape (vocab_size,) for verification row `row`
ScoreFn = Callable[[int, list[int]], torch.Tensor]


@dataclass
class Acceptance:
    """Result of verifying one tree.

    Args:
        accepted: indices of accepted draft nodes, root's child first.
        bonus: the token the target emits after them.
        scores: processed target scores behind every committed token (`len(accepted) + 1` tensors of shape
            `(vocab_size,)`), in order.
    """

    accepted: list[int]
    bonus: int
    scores: list[torch.Tensor]


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
    """
    children = tree.children
    tokens = tree.tokens.tolist()
    probs_q = tree.draft_probs
    path: list[int] = []
    rows: list[torch.Tensor] = []
    node = -1
    while True:
        scores = score_row(node + 1, path)
        rows.append(scores)
        p = torch.softmax(scores.float(), dim=-1)  # target distribution at this node
        nxt = None
        for c in children[node + 1]:
            tok = tokens[c]
            q = probs_q[c].to(p) if probs_q is not None else None
            deterministic = q is None or not bool(q.any())
            accept_prob = p[tok] if deterministic else torch.clamp(p[tok] / q[tok], max=1.0)
            if float(torch.rand((), generator=generator, device=p.device)) < float(accept_prob):
                nxt = c
                break
            p = _residual(p, tok if deterministic else q)
        if nxt is None:
            bonus = int(torch.multinomial(p, 1, generator=generator))
            return Acceptance(path, bonus, rows)
        path.append(nxt)
        node = nxt


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
