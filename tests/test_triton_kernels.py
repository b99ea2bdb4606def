"""Every Triton kernel against its torch twin, under Triton's interpreter on CPU tensors (no GPU needed): random
trees (hypothesis), float32 and bfloat16, the edge cases (a one-node tree, all rejected, all accepted, EOS inside
the tree, vocabularies that are no multiple of a block), and the sampling kernel's distribution (chi-square). A slow test compiles every
kernel for an H100 (sm_90) without a GPU, which catches what the interpreter lets pass (types of loop-carried
values, unsupported control flow)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":  # conftest.py sets it where torch sees no GPU
    pytest.skip(
        "the kernels run on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1)",
        allow_module_level=True,
    )

from hf_spec.kernels.triton.draft_topk import draft_topk, draft_topk_reference  # noqa: E402
from hf_spec.kernels.triton.greedy_accept import greedy_accept, greedy_accept_reference, unpack_greedy  # noqa: E402
from hf_spec.kernels.triton.kv_compact import kv_compact, kv_compact_reference  # noqa: E402
from hf_spec.kernels.triton.sampling_accept import (  # noqa: E402
    sampling_accept,
    sampling_accept_reference,
    unpack_sampling,
)
from hf_spec.kernels.triton.token_info_topk import token_info_topk, token_info_topk_reference  # noqa: E402
from hf_spec.kernels.triton.tree_mask import tree_inputs, tree_inputs_reference  # noqa: E402
from tests.stats import chi2_pvalue  # noqa: E402
from tests.test_acceptance import V as TABLE_VOCAB  # noqa: E402
from tests.test_acceptance import random_tree, target_logits  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
# vocabularies around the kernels' blocks (512, 1024) and chunks (2048): none a multiple of a block but 1
VOCABS = [1, 7, 97, 1000, 2049]
FAST = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def trees(draw, max_nodes: int = 12, vocab: int = 97) -> tuple[list[int], list[int]]:
    """`(parents, tokens)` of a random tree: parents before children, tokens repeating often."""
    n = draw(st.integers(0, max_nodes))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    tokens = [draw(st.integers(0, min(vocab, 6) - 1)) for _ in range(n)]
    return parents, tokens


def logits_for(
    parents: list[int], tokens: list[int], vocab: int, accept: float, seed: int, dtype
) -> torch.Tensor:
    """Random rows where each node's token is its parent row's argmax with probability `accept`."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(parents) + 1, vocab, generator=g)
    chosen = torch.rand(len(parents), generator=g) < accept
    for i, (p, t) in enumerate(zip(parents, tokens, strict=True)):
        if chosen[i]:
            logits[p + 1, t % vocab] = 50.0
    return logits.to(dtype)


def check_greedy(parents, tokens, logits) -> list[int]:
    p, t = torch.tensor(parents, dtype=torch.long), torch.tensor(tokens, dtype=torch.long)
    got = unpack_greedy(greedy_accept(logits, p, t).tolist(), len(parents))
    want = unpack_greedy(greedy_accept_reference(logits, p, t).tolist(), len(parents))
    assert got == want
    return got[0]


@FAST
@given(trees(), st.sampled_from(VOCABS[2:]), st.floats(0, 1), st.integers(0, 99), st.sampled_from(DTYPES))
def test_greedy_accept_matches_twin(tree, vocab, accept, seed, dtype):
    parents, tokens = tree
    check_greedy(parents, tokens, logits_for(parents, tokens, vocab, accept, seed, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_accept_edge_cases(dtype):
    chain = list(range(-1, 5))  # parents of a 6-node chain
    assert check_greedy([-1], [3], logits_for([-1], [3], 97, 1.0, 0, dtype)) == [0]  # a one-node tree
    assert check_greedy(chain, [5] * 6, logits_for(chain, [5] * 6, 2049, 1.0, 1, dtype)) == list(range(6))
    assert check_greedy(chain, [5] * 6, logits_for(chain, [5] * 6, 1000, 0.0, 2, dtype)) == []  # all rejected
    assert check_greedy([], [], logits_for([], [], 7, 0.0, 3, dtype)) == []  # an empty tree: the bonus alone
    ties = torch.zeros(3, 1000, dtype=dtype)  # equal maxima: the lowest index, as torch.argmax
    ties[:, 500:] = 1.0
    assert check_greedy([-1, 0], [500, 500], ties) == [0, 1]


@FAST
@given(
    trees(max_nodes=8, vocab=7),
    st.integers(0, 999),
    st.booleans(),
    st.sampled_from(DTYPES),
    st.sampled_from([7, 7, 1000, 2049]),
)
def test_sampling_accept_matches_twin_with_the_same_generator(tree, seed, sampled, dtype, vocab):
    """Same accepted path and bonus as `accept_sampling` from the same generator state, for point-mass and
    sampled children (`draft_probs`: a mix of rows and all-zero rows), scores read in their own dtype, over
    vocabularies of one block and of several (the residual and the bonus draw past the first block)."""
    parents, tokens = tree
    g = torch.Generator().manual_seed(seed)
    scores = (torch.randn(len(parents) + 1, vocab, generator=g) * 2).to(dtype)
    q = None
    if sampled and parents:
        q = torch.softmax(torch.randn(len(parents), vocab, generator=g), -1)
        q[torch.rand(len(parents), generator=g) < 0.4] = 0.0  # deterministic nodes among sampled ones
        tokens = [
            int(torch.multinomial(q[i], 1, generator=g)) if q[i].any() else t for i, t in enumerate(tokens)
        ]
    p, t = torch.tensor(parents, dtype=torch.long), torch.tensor(tokens, dtype=torch.long)
    got = sampling_accept(scores, p, t, q, torch.Generator().manual_seed(seed + 1))
    want = sampling_accept_reference(scores, p, t, q, torch.Generator().manual_seed(seed + 1))
    assert unpack_sampling(got.tolist()) == unpack_sampling(want.tolist())


def test_sampling_accept_edge_cases():
    g = torch.Generator().manual_seed(0)
    chain = torch.arange(-1, 3)
    sure = torch.full((5, 97), -30.0)
    sure[torch.arange(4), torch.tensor([4, 5, 6, 7])] = 30.0  # the chain is certain: all accepted
    assert unpack_sampling(sampling_accept(sure, chain, torch.tensor([4, 5, 6, 7]), None, g).tolist())[0] == [
        0,
        1,
        2,
        3,
    ]
    never = torch.zeros(5, 97)
    never[:, 9] = -float("inf")  # token 9 impossible everywhere: all rejected, never drawn as the bonus
    path, bonus = unpack_sampling(sampling_accept(never, chain, torch.full((4,), 9), None, g).tolist())
    assert path == [] and bonus != 9
    path, bonus = unpack_sampling(sampling_accept(never[:1], chain[:0], chain[:0], None, g).tolist())
    assert path == [] and 0 <= bonus < 97 and bonus != 9  # an empty tree: a plain draw
    one = torch.tensor([-1])
    path, bonus = unpack_sampling(sampling_accept(sure[:2], one, torch.tensor([4]), None, g).tolist())
    assert path == [0] and bonus == 5  # a one-node tree, accepted: the bonus from its row
    path, bonus = unpack_sampling(sampling_accept(never[:2], one, torch.tensor([9]), None, g).tolist())
    assert path == [] and bonus != 9  # a one-node tree, rejected


EOS = 2  # a token the random trees draw often (tokens 0..5)


def commit_round(
    parents, tokens, logits, do_sample: bool, seed: int, backend
) -> tuple[list[int], list[int], bool]:
    """`(committed tokens, accepted nodes, finished)` of one round accepted by `backend` (None: the loop's host
    rules) and committed with EOS as a stopping criterion, as the loop commits it."""
    from transformers import LogitsProcessorList, StoppingCriteriaList
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

    from hf_spec.engine.commit import SequenceOutputs, StopCheck, TokenBuffer, accept, commit_tokens
    from hf_spec.engine.outputs import SpecStats
    from hf_spec.tree import DraftTree

    tree = DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))
    prefix = torch.tensor([[1, 4]])
    generator = torch.Generator().manual_seed(seed)
    acc = accept(tree, logits, prefix, LogitsProcessorList(), do_sample, generator, False, backend)
    stop = StopCheck(StoppingCriteriaList([EosTokenCriteria(EOS), MaxLengthCriteria(64)]))
    buffer = TokenBuffer(prefix, prefix.shape[1] + len(tree) + 1)
    done = commit_tokens(tree, acc, logits, buffer, stop, SequenceOutputs(), SpecStats())
    return done.new_tokens, done.accepted, done.finished


@FAST
@given(trees(max_nodes=10, vocab=7), st.integers(0, 99), st.booleans(), st.sampled_from(DTYPES))
@example((list(range(-1, 5)), [4, 2, 5, 1, 3, 0]), 0, False, torch.float32)  # EOS second on an accepted chain
@example(([-1, -1, 0, 1, 3], [5, 2, 0, 3, 2]), 1, True, torch.bfloat16)  # EOS on a branch and a leaf
def test_eos_inside_the_tree_commits_what_the_host_rules_commit(tree, seed, do_sample, dtype):
    """The kernels know no EOS: a path through the EOS token is accepted as the twin accepts it, and the round
    commits up to the EOS and no further, exactly as with the loop's host rules (greedy and sampling, the same
    random numbers)."""
    from hf_spec.engine.backend import TritonBackend

    parents, tokens = tree
    logits = logits_for(parents, tokens, 7, 0.9, seed, dtype)  # mostly accepted: paths run through EOS often
    got = commit_round(parents, tokens, logits, do_sample, seed, TritonBackend())
    want = commit_round(parents, tokens, logits, do_sample, seed, None)
    assert got == want
    committed, _, finished = got
    assert finished == (EOS in committed) and EOS not in committed[:-1]


@pytest.mark.parametrize("do_sample", [False, True])
def test_eos_second_on_an_accepted_chain_ends_the_round(do_sample):
    from hf_spec.engine.backend import TritonBackend

    chain, tokens = list(range(-1, 5)), [4, EOS, 5, 1, 3, 0]
    logits = logits_for(chain, tokens, 7, 1.0, 0, torch.float32)  # every node accepted
    committed, accepted, finished = commit_round(chain, tokens, logits, do_sample, 0, TritonBackend())
    assert committed == [4, EOS] and accepted == list(range(6)) and finished


@pytest.mark.parametrize("n", [500, pytest.param(4000, marks=pytest.mark.slow)])
def test_sampling_kernel_keeps_the_target_distribution(n):
    """Chi-square: the first committed token follows the target's row-0 distribution over random depth-2 trees
    of every proposal kind (deterministic, i.i.d. and without-replacement siblings), as `accept_sampling` does in
    `tests/test_acceptance.py` (the interpreter's speed limits CI to 500 draws; the slow run takes 4,000)."""
    g = torch.Generator().manual_seed(4321)
    first: Counter = Counter()
    kinds = ("deterministic", "iid", "without_replacement")
    for i in range(n):
        tree = random_tree(kinds[i % 3], g)
        tokens = tree.tokens.tolist()
        rows = [target_logits(())] + [
            target_logits(tuple(tokens[j] for j in tree.path_to(k))) for k in range(len(tree))
        ]
        probs = tree.draft_probs if bool(tree.draft_probs.any()) else None
        packed = sampling_accept(torch.stack(rows), tree.parents, tree.tokens, probs, g).tolist()
        path, bonus = unpack_sampling(packed)
        first[tokens[path[0]] if path else bonus] += 1
    p1 = torch.softmax(target_logits(()), -1)
    assert chi2_pvalue(first, {t: float(p1[t]) for t in range(TABLE_VOCAB)}, n) > 1e-3


@FAST
@given(trees(max_nodes=16), st.sampled_from([0, 5, 1100]), st.sampled_from(DTYPES))
@example(([-1], [0]), 0, torch.float32)  # a one-node tree
@example((list(range(-1, 15)), [0] * 16), 1100, torch.bfloat16)  # a chain
@example(([-1] * 16, [0] * 16), 5, torch.float32)  # all children of the root
def test_tree_inputs_match_the_host_masks(tree, past, dtype):
    parents = torch.tensor(tree[0], dtype=torch.long)
    got = tree_inputs(parents, past, dtype)
    want = tree_inputs_reference(parents, past, dtype)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def check_kv_compact(num_nodes: int, past: int, accepted: list[int], dtype) -> None:
    """Every layer of a group in one launch; a cropped view (other strides) in a group of its own."""
    keep = [0, *accepted]
    length = past + num_nodes + 1
    tensors = [torch.randn(2, 3, length + 2, 8).to(dtype) for _ in range(4)]
    tensors.append(torch.randn(1, 2, length + 5, 12).to(dtype)[..., :length, :])
    mine, theirs = [t.clone() for t in tensors], [t.clone() for t in tensors]
    kv_compact(mine, past, keep)
    kv_compact_reference(theirs, past, keep)
    for a, b in zip(mine, theirs, strict=True):
        assert torch.equal(a[..., : past + len(keep), :], b[..., : past + len(keep), :])


@FAST
@given(st.integers(1, 9), st.integers(0, 6), st.data(), st.sampled_from(DTYPES))
def test_kv_compact_matches_index_select(num_nodes, past, data, dtype):
    check_kv_compact(num_nodes, past, sorted(data.draw(st.sets(st.integers(1, num_nodes)))), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_nodes, past, accepted",
    [(1, 0, []), (1, 3, [1]), (9, 5, list(range(1, 10))), (9, 0, []), (9, 2, [2, 5, 9])],
    ids=["one-node-rejected", "one-node-accepted", "all-accepted", "all-rejected", "branch-path"],
)
def test_kv_compact_edge_cases(num_nodes, past, accepted, dtype):
    check_kv_compact(num_nodes, past, accepted, dtype)


@FAST
@given(st.sampled_from(VOCABS), st.integers(1, 4), st.integers(0, 99), st.sampled_from(DTYPES), st.booleans())
def test_draft_topk_matches_twin(vocab, rows, seed, dtype, ties):
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)).to(dtype)
    if ties:  # repeated values: the lower index first
        logits[:, 1::2] = logits[:, :1]
    k = min(vocab, 1 + seed % 5)
    values, indices = draft_topk(logits, k)
    want_values, want_indices = draft_topk_reference(logits, k)
    assert torch.equal(indices, want_indices)
    torch.testing.assert_close(values, want_values, rtol=0, atol=1e-5)


@FAST
@given(
    st.sampled_from([7, 300, 1001]),
    st.integers(1, 4),
    st.sampled_from([1, 8, 24]),
    st.sampled_from(["none", "dense", "low_rank"]),
    st.integers(0, 99),
    st.sampled_from(DTYPES),
)
def test_token_info_topk_matches_twin(vocab, frontier, rank, kind, seed, dtype):
    """Lyanna's step: raw level logits over the first `cols` entries plus a dense or low-rank token-info bias
    (its norm over the whole draft vocabulary), rows without token info left raw."""
    g = torch.Generator().manual_seed(seed)
    cols = vocab - seed % 3
    raw = (torch.randn(cols, generator=g) * 3).to(dtype)
    valid = torch.rand(frontier, generator=g) < 0.7
    kw = {}
    if kind == "dense":
        kw["bias"] = torch.randn(frontier, vocab, generator=g).to(dtype)
    elif kind == "low_rank":
        low = torch.randn(frontier, rank, generator=g)
        w2 = torch.randn(vocab, rank, generator=g) / 4
        kw["factors"] = (low.to(dtype), w2.to(dtype), (0.1 + torch.rand(vocab, generator=g)).to(dtype))
    k = min(cols, 1 + seed % 4)
    values, indices = token_info_topk(raw, k, frontier, valid, **kw)
    want_values, want_indices = token_info_topk_reference(raw, k, frontier, valid, **kw)
    assert torch.equal(indices, want_indices)
    torch.testing.assert_close(values, want_values, rtol=0, atol=1e-4)


# ---- compiled for an H100 without a GPU ------------------------------------------------------------------------
@pytest.mark.slow
def test_every_kernel_compiles_for_an_h100():
    """Ahead-of-time compilation to sm_90 machine code (`tests/triton_signatures.py`), in a process without the
    interpreter: no GPU needed."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.triton_signatures"], cwd=root, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("compiled") == 12, done.stdout  # every kernel, token info in 3 modes
