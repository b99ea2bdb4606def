"""Acceptance rules: greedy against a brute-force walk; sampling is distribution-preserving (chi-square)."""

from __future__ import annotations

import hashlib
from collections import Counter

import pytest
import torch

from hf_spec.engine.acceptance import accept_greedy, accept_sampling
from hf_spec.tree.draft_tree import DraftTree
from tests.stats import chi2_pvalue

V = 6


def target_logits(path: tuple[int, ...]) -> torch.Tensor:
    """A fixed random 'target': logits depend only on the token path."""
    seed = int(hashlib.sha256(repr(path).encode()).hexdigest()[:8], 16)
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 1.5


def scorer(tree: DraftTree):
    tokens = tree.tokens.tolist()
    return lambda row, path: target_logits(tuple(tokens[i] for i in path))


def test_greedy_follows_argmax_brute_force():
    for seed in range(50):
        g = torch.Generator().manual_seed(seed)
        n = 8
        parents = [int(torch.randint(-1, i, (1,), generator=g)) if i else -1 for i in range(n)]
        tree = DraftTree(torch.randint(0, V, (n,), generator=g), torch.tensor(parents))
        acc = accept_greedy(tree, scorer(tree))
        # brute force: walk by argmax over the token path
        path: tuple[int, ...] = ()
        node = -1
        while True:
            pred = int(target_logits(path).argmax())
            kids = [c for c in tree.children[node + 1] if int(tree.tokens[c]) == pred]
            if not kids:
                break
            node = kids[0]
            path += (pred,)
        assert [int(tree.tokens[i]) for i in acc.accepted] == list(path)
        assert acc.bonus == int(target_logits(path).argmax())


def draft_q(path: tuple[int, ...]) -> torch.Tensor:
    """The drafter's (imperfect) distribution: a different fixed random table."""
    seed = int(hashlib.sha256(("q", path).__repr__().encode()).hexdigest()[:8], 16)
    return torch.softmax(torch.randn(V, generator=torch.Generator().manual_seed(seed)), dim=-1)


def sample_children(path, kind: str, k: int, g: torch.Generator) -> tuple[list[int], list[torch.Tensor]]:
    """k siblings and the exact distribution each was drawn from (zeros = deterministic)."""
    q = draft_q(path)
    if kind == "deterministic":
        toks = torch.topk(q, k).indices.tolist()
        return toks, [torch.zeros(V)] * k
    if kind == "iid":
        toks = torch.multinomial(q, k, replacement=True, generator=g).tolist()
        return toks, [q] * k
    toks, rows, rest = [], [], q.clone()
    for _ in range(k):  # without replacement: each draw from the renormalised remainder
        cond = rest / rest.sum()
        tok = int(torch.multinomial(cond, 1, generator=g))
        toks.append(tok)
        rows.append(cond)
        rest[tok] = 0
    return toks, rows


def random_tree(kind: str, g: torch.Generator) -> DraftTree:
    """Depth-2 tree: k1 children of the root, each with k2 children."""
    tokens, parents, rows = [], [], []
    kids, qs = sample_children((), kind, 3, g)
    for tok, q in zip(kids, qs, strict=True):
        tokens.append(tok), parents.append(-1), rows.append(q)
    for parent in range(len(kids)):
        sub, subq = sample_children((tokens[parent],), kind, 2, g)
        for tok, q in zip(sub, subq, strict=True):
            tokens.append(tok), parents.append(parent), rows.append(q)
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.stack(rows))


@pytest.mark.parametrize("kind", ["deterministic", "iid", "without_replacement", "mixed"])
def test_sampling_preserves_target_distribution(kind):
    g = torch.Generator().manual_seed(1234)
    n = 12000
    counts: Counter = Counter()
    for i in range(n):
        k = kind if kind != "mixed" else ("deterministic", "iid", "without_replacement")[i % 3]
        tree = random_tree(k, g)
        acc = accept_sampling(tree, scorer(tree), generator=g)
        committed = [int(tree.tokens[j]) for j in acc.accepted] + [acc.bonus]
        counts[tuple(committed[:2])] += 1 if len(committed) >= 2 else 0
        counts[(committed[0],)] += 1 if len(committed) == 1 else 0
    # which first tokens can continue inside the tree depends on the draws, so compare the marginal of the
    # first token, and the pair distribution given that a second token was committed
    first = Counter()
    for key, c in counts.items():
        first[key[0]] += c
    p1 = torch.softmax(target_logits(()), -1)
    assert chi2_pvalue(first, {t: float(p1[t]) for t in range(V)}, n) > 1e-4
    for t in range(V):
        pairs = Counter({key[1]: c for key, c in counts.items() if len(key) == 2 and key[0] == t})
        m = sum(pairs.values())
        if m < 200:
            continue
        p2 = torch.softmax(target_logits((t,)), -1)
        assert chi2_pvalue(pairs, {u: float(p2[u]) for u in range(V)}, m) > 1e-4, (t, pairs)


def test_wrong_q_is_detected():
    """Sanity check of the test itself: reporting a q that was not sampled from breaks the distribution."""
    g = torch.Generator().manual_seed(7)
    n = 12000
    first = Counter()
    for _ in range(n):
        tree = random_tree("iid", g)
        tree.draft_probs = torch.full_like(tree.draft_probs, 1.0 / V)  # lie: claim uniform proposals
        acc = accept_sampling(tree, scorer(tree), generator=g)
        first[int(tree.tokens[acc.accepted[0]]) if acc.accepted else acc.bonus] += 1
    p1 = torch.softmax(target_logits(()), -1)
    assert chi2_pvalue(first, {t: float(p1[t]) for t in range(V)}, n) < 1e-4
