"""Tree buffers against brute force, and one tree forward against feeding each branch on its own."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from hf_spec.tree.draft_tree import DraftTree
from hf_spec.tree.masks import tree_attention_mask, tree_position_ids
from tests.conftest import CACHE


@st.composite
def trees(draw, max_nodes: int = 12):
    n = draw(st.integers(0, max_nodes))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    tokens = draw(st.lists(st.integers(3, 95), min_size=n, max_size=n))
    return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))


def brute_path(parents: list[int], i: int) -> list[int]:
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path


@given(trees(), st.integers(0, 5))
@settings(max_examples=200, deadline=None)
def test_mask_and_positions_match_brute_force(tree, past):
    parents = tree.parents.tolist()
    mask = tree_attention_mask(tree, past)[0, 0]
    pos = tree_position_ids(tree, past)[0]
    n = len(tree)
    assert mask.shape == (n + 1, past + n + 1)
    assert pos[0] == past
    for q in range(n + 1):
        visible = {0} | ({j + 1 for j in brute_path(parents, q - 1)} if q else set())
        for k in range(n + 1):
            assert (mask[q, past + k] == 0) == (k in visible)
        assert bool((mask[q, :past] == 0).all())
        if q:
            assert pos[q] == past + len(brute_path(parents, q - 1))


@given(st.lists(st.lists(st.integers(3, 9), min_size=1, max_size=5), min_size=1, max_size=6))
@settings(max_examples=200, deadline=None)
def test_from_sequences_is_a_trie_of_the_sequences(seqs):
    tree = DraftTree.from_sequences(seqs)
    toks, parents = tree.tokens.tolist(), tree.parents.tolist()
    paths = {tuple(toks[j] for j in brute_path(parents, i)[::-1]) for i in range(len(tree))}
    prefixes = {tuple(s[:k]) for s in seqs for k in range(1, len(s) + 1)}
    assert paths == prefixes  # every prefix once, nothing else
    assert len(tree) == len(prefixes)


def test_from_sequences_budget_keeps_parents():
    tree = DraftTree.from_sequences([[1, 2, 3], [1, 4, 5], [6]], max_nodes=4)
    assert tree.tokens.tolist() == [1, 2, 3, 4]
    assert tree.parents.tolist() == [-1, 0, 1, 0]


@given(trees(), st.integers(0, 4))
@settings(max_examples=100, deadline=None)
def test_truncate_depth_and_select_keep_a_valid_tree(tree, max_depth):
    cut = tree.truncate_depth(max_depth)
    assert all(d <= max_depth for d in cut.depth.tolist())
    kept_paths = {tuple(cut.tokens[cut.path_to(i)].tolist()) for i in range(len(cut))}
    all_paths = {
        tuple(tree.tokens[tree.path_to(i)].tolist()) for i in range(len(tree)) if tree.depth[i] <= max_depth
    }
    assert kept_paths == all_paths


def test_parents_must_precede_children():
    with pytest.raises(ValueError, match="parent must come before"):
        DraftTree(torch.tensor([5, 6]), torch.tensor([1, -1]))


def test_tree_forward_equals_feeding_each_branch(tiny_model):
    """One forward of [root] + tree with the 4D mask gives, at every node, the logits of its own path."""
    torch.manual_seed(0)
    prompt = torch.randint(3, 96, (1, 9))
    tree = DraftTree(torch.tensor([10, 11, 12, 13, 14, 15]), torch.tensor([-1, 0, 0, -1, 3, 1]))
    cache = DynamicCache(config=tiny_model.config)
    with torch.no_grad():
        tiny_model(input_ids=prompt[:, :-1], **{CACHE: cache}, use_cache=True)
        past = prompt.shape[1] - 1
        ids = torch.cat([prompt[:, -1:], tree.tokens[None]], dim=1)
        out = tiny_model(
            input_ids=ids,
            position_ids=tree_position_ids(tree, past),
            attention_mask=tree_attention_mask(tree, past),
            **{CACHE: cache},
            use_cache=True,
        )
        for i in range(-1, len(tree)):
            path = tree.tokens[tree.path_to(i)] if i >= 0 else torch.empty(0, dtype=torch.long)
            seq = torch.cat([prompt[0], path])[None]
            ref = tiny_model(input_ids=seq).logits[0, -1]
            torch.testing.assert_close(out.logits[0, i + 1], ref, atol=1e-4, rtol=1e-4)
