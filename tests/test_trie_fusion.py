"""Retrieval tries (cumulative frequencies, pruning) and tree fusion by longest-prefix matching."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_spec.tree.draft_tree import DraftTree
from hf_spec.tree.fusion import fuse_trees, fused_path, matched_depth
from hf_spec.tree.retrieval import prune_by_frequency, retrieval_tree, weighted_trie


def paths(tree: DraftTree) -> list[tuple[int, ...]]:
    """Root-to-node token paths, one per node."""
    toks = tree.tokens.tolist()
    return [tuple(toks[i] for i in tree.path_to(n)) for n in range(len(tree))]


def reference_prune(parents: list[int], freq: list[float], max_nodes: int) -> set[int]:
    """The paper's rule literally: remove the lowest-frequency leaf until at most max_nodes remain (ties: the
    deepest, then the latest inserted)."""
    alive = set(range(len(parents)))
    depth = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    while len(alive) > max_nodes:
        leaves = [i for i in alive if not any(parents[j] == i for j in alive)]
        victim = min(leaves, key=lambda i: (freq[i], -depth[i], -i))
        alive.remove(victim)
    return alive


seqs_strategy = st.lists(
    st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=5), st.integers(1, 5)), min_size=0, max_size=8
)


@given(seqs_strategy, st.integers(0, 12))
@settings(max_examples=300, deadline=None)
def test_prune_equals_lowest_leaf_removal(weighted, max_nodes):
    tokens, parents, freq = weighted_trie([s for s, _ in weighted], [w for _, w in weighted])
    for i, p in enumerate(parents):  # cumulative: a parent's frequency covers its children's
        assert p < 0 or freq[p] >= freq[i]
    keep = prune_by_frequency(parents, freq, max_nodes)
    assert set(keep.nonzero()[0].tolist()) == reference_prune(parents, freq, max_nodes)


@given(seqs_strategy, st.integers(1, 12))
@settings(max_examples=200, deadline=None)
def test_retrieval_tree_is_a_valid_pruned_trie(weighted, max_nodes):
    tree, freq = retrieval_tree([s for s, _ in weighted], [w for _, w in weighted], max_nodes)
    assert len(tree) <= max_nodes
    all_paths = {tuple(s[: k + 1]) for s, _ in weighted for k in range(len(s))}
    got = paths(tree)
    assert len(set(got)) == len(got) and set(got) <= all_paths
    for kids in tree.children:  # siblings in decreasing frequency
        assert [freq[k] for k in kids] == sorted((freq[k] for k in kids), reverse=True)


def test_trie_example_from_docstring():
    tree, freq = retrieval_tree([[1, 2, 3]] * 3 + [[1, 4], [5]], [1] * 5, 3)
    assert paths(tree) == [(1,), (1, 2), (1, 2, 3)] and freq == [4.0, 3.0, 3.0]


def tree_strategy(max_nodes: int = 8):
    @st.composite
    def build(draw):
        n = draw(st.integers(0, max_nodes))
        parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
        tokens = [draw(st.integers(0, 3)) for _ in range(n)]
        return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))

    return build()


def reference_merge(a: DraftTree, b: DraftTree) -> list[tuple[int, ...]]:
    """Union of root-to-node paths, in first-seen order."""
    out: list[tuple[int, ...]] = []
    for p in paths(a) + paths(b):
        if p not in out:
            out.append(p)
    return out


@given(tree_strategy(), tree_strategy())
@settings(max_examples=300, deadline=None)
def test_fusion_equals_reference_merge(a, b):
    fused, map_a, map_b = fuse_trees(a, b)
    assert sorted(paths(fused)) == sorted(reference_merge(a, b))
    assert len(fused) == len(reference_merge(a, b))  # shared prefixes appear once
    for tree, mapping in ((a, map_a), (b, map_b)):
        fp = paths(fused)
        for i, p in enumerate(paths(tree)):
            assert fp[mapping[i]] == p
    for kids in fused.children:  # no duplicate sibling tokens
        toks = [int(fused.tokens[k]) for k in kids]
        assert len(toks) == len(set(toks))


def test_fused_probs_are_conditional_on_earlier_siblings():
    v = 5
    q = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0])
    model = DraftTree(
        torch.tensor([3, 2]), torch.tensor([-1, 0]), torch.stack([q, q])
    )  # sampled chain 3 -> 2
    retrieval = DraftTree(torch.tensor([1, 3, 4]), torch.tensor([-1, -1, 1]))  # deterministic
    fused, map_r, map_m = fuse_trees(retrieval, model)
    # root children: 1 (det), 3 (det, merged with the model's sampled 3): the merged node stays a point mass
    assert fused.tokens.tolist() == [1, 3, 4, 2]
    assert map_m == [1, 3]
    probs = fused.draft_probs
    assert not probs[0].any() and not probs[1].any() and not probs[2].any()
    # the model's 2 sits after the retrieval child 4 of node 3: its q excludes token 4 (already zero) only
    assert torch.allclose(probs[3], q / q.sum())
    # sampled first, deterministic second: the sampled row is untouched, the later one renormalised
    fused, _, _ = fuse_trees(model, DraftTree(torch.tensor([0]), torch.tensor([-1])))
    assert torch.allclose(fused.draft_probs[0], q) and not fused.draft_probs[2].any()
    sampled_after = DraftTree(torch.tensor([1]), torch.tensor([-1]), q[None])
    fused, _, _ = fuse_trees(DraftTree(torch.tensor([3]), torch.tensor([-1])), sampled_after)
    expect = q.clone()
    expect[3] = 0
    assert torch.allclose(fused.draft_probs[1], expect / expect.sum())
    assert fused.draft_probs.shape == (2, v)


def test_fused_path_maps_back_to_a_source_tree():
    a = DraftTree.chain([1, 2, 3])
    b = DraftTree(torch.tensor([1, 5]), torch.tensor([-1, 0]))
    fused, map_a, map_b = fuse_trees(a, b)
    assert fused_path(map_a, [0, 1]) == [0, 1]
    assert fused_path(map_b, [0, 3]) == [0, 1]  # b's 5 is fused node 3
    assert fused_path(map_a, [0, 3]) == [0]


def test_zero_probability_sampled_token_is_an_error():
    bad = DraftTree(torch.tensor([1]), torch.tensor([-1]), torch.tensor([[0.0, 0.0, 1.0]]))
    with pytest.raises(ValueError, match="zero probability"):
        fuse_trees(DraftTree(torch.tensor([2]), torch.tensor([-1])), bad)


def test_matched_depth_is_what_greedy_verification_accepts():
    #    5 -> 6 -> 7
    #      -> 8
    #    9
    tree = DraftTree(torch.tensor([5, 9, 6, 8, 7]), torch.tensor([-1, -1, 0, 0, 2]))
    assert matched_depth(tree, [5, 6, 7, 1]) == 3
    assert matched_depth(tree, [5, 8, 7]) == 2
    assert matched_depth(tree, [9]) == 1
    assert matched_depth(tree, [6, 7]) == 0  # paths start at the root
    assert matched_depth(DraftTree.empty(), [5]) == 0
