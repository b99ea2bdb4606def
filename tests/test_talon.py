"""`retrieval` and `talon`: lossless greedy and sampling, async == sync, no leaked thread on errors."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from hf_spec import SpeculativeDecoder
from hf_spec.datastore import DatastoreRecipe, TokenIndex
from hf_spec.datastore.store import save_datastore
from hf_spec.engine.target.forward import flat_tree_budget
from hf_spec.methods.pld.ngram_matcher import first_continuation
from hf_spec.methods.retrieval.config import RetrievalConfig
from hf_spec.methods.retrieval.retriever import Retriever
from hf_spec.methods.talon.config import TalonConfig
from hf_spec.methods.talon.drafter import TalonDrafter
from hf_spec.methods.talon.overlap import THREAD_PREFIX
from hf_spec.methods.talon.preverify import finish_verification, pre_verify
from hf_spec.tree.draft_tree import DraftTree
from hf_spec.tree.fusion import fuse_trees
from hf_spec.tree.masks import tree_attention_mask, tree_position_ids
from tests.conftest import CACHE, make_tiny_model, prompt_ids
from tests.stats import sampled_marginals_pvalues
from tests.test_sampling import SampledTreeDrafter, V


def tiny_datastore(model, folder, seeds=(11, 12, 13, 14), length=60) -> str:
    """The model's own greedy continuations of other prompts (a target-response source)."""
    docs = [
        model.generate(prompt_ids(8, seed=s), max_new_tokens=length, do_sample=False)[0].tolist()
        for s in seeds
    ]
    save_datastore(
        folder, TokenIndex.from_documents(docs), DatastoreRecipe(), {"format": 1, "tokenizer": None}
    )
    return str(folder)


def talon(path: str, lookup: int = 0, **kw) -> TalonConfig:
    """A Talon config on the datastore at `path`; `lookup`: the retrieval half's `prompt_lookup`."""
    retrieval = {"datastore_path": path, "num_draft_tokens": 6, "max_nodes": 8, "weak_nodes": 4}
    retrieval.update({"prompt_lookup": lookup} if lookup else {})
    return TalonConfig(retrieval=retrieval, **{"drafter": "early-exit:3", **kw})


def leaked() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("talon")


def test_greedy_equals_generate(tiny_model, store_dir, seed=1):
    path = tiny_datastore(tiny_model, store_dir / f"{tiny_model.config.model_type}")
    ids = prompt_ids(14, seed=seed)
    ref = tiny_model.generate(ids, max_new_tokens=40, do_sample=False)
    configs = [
        RetrievalConfig(datastore_path=path),
        RetrievalConfig(datastore_path=path, search_context=False, max_nodes=24, strong_match=1),
        RetrievalConfig(datastore_path=path, long_match=4, long_draft_tokens=16, long_nodes=20),
        RetrievalConfig(datastore_path=path, prompt_lookup=2, weak_nodes=2, max_nodes=10),
        talon(path),
        talon(path, switch=None),
        talon(path, schedule={"mode": "async"}, switch=None),
        talon(path, drafter="pld"),
        talon(path, switch={"rule": "cost"}),
        talon(path, switch={"rule": "cost", "cost": 0.5, "explore_every": 2}),
        talon(path, switch={"rule": "best", "explore_every": 2}),
        talon(path, switch={"rule": "best"}, drafter="pld"),
        talon(path, switch={"rule": "best"}, fusion={"extend_tokens": 3, "extend_min_match": 2}),
        talon(path, drafter="pld", fusion={"extend_tokens": 4, "extend_min_match": 1}),
        talon(path, switch={"rule": "best", "explore_every": 1}, fusion={"both_nodes": 2}),
        talon(path, switch={"skip_match": 4}),
        talon(path, switch=None, fusion={"both_nodes": 3}),
        *[
            talon(path, lookup=2, switch=None, fusion={"both_nodes": 2, "both_lookup": m})
            for m in ("whole", "auto")
        ],
        TalonConfig(retrieval=None, drafter="early-exit:2"),
    ]
    for config in configs:
        dec = SpeculativeDecoder(config)
        out = tiny_model.generate(ids, max_new_tokens=40, do_sample=False, custom_generate=dec)
        assert torch.equal(out, ref), config
        assert dec.last_stats.new_tokens == ref.shape[1] - ids.shape[1]
        switch = getattr(dec.drafter_for(tiny_model), "switch", None)
        if switch is not None:  # the cost switch saw every round and ran the model in some
            seen = sum(b.count for b in switch.retrieval_accepted)
            rounds = dec.last_stats.target_forwards - 1  # observe() skips the last round
            # `best` does not count a dropped retrieval tree that matched every committed token
            assert seen == rounds if config.switch.rule == "cost" else 0 < seen <= rounds
            assert 0 < switch.model_gain.count <= rounds
    assert not leaked()


def test_retrieval_finds_the_datastore(tiny_llama, store_dir):
    """A prompt that is a prefix of a datastore document: retrieval drafts its continuation (tau >> 1)."""
    path = tiny_datastore(tiny_llama, store_dir / "prefix", seeds=(21,), length=60)
    ids = prompt_ids(8, seed=21)
    dec = SpeculativeDecoder(RetrievalConfig(datastore_path=path, search_context=False))
    tiny_llama.generate(ids, max_new_tokens=40, do_sample=False, custom_generate=dec)
    assert dec.last_stats.tau > 4


def test_long_matches_draft_deeper(tiny_llama, store_dir):
    """A context suffix matched for `long_match` tokens or more earns `long_draft_tokens` levels and
    `long_nodes` nodes; shorter matches keep `num_draft_tokens`, and the loop's depth limit still holds."""
    path = tiny_datastore(tiny_llama, store_dir / "long", seeds=(31,), length=60)
    doc = tiny_llama.generate(prompt_ids(8, seed=31), max_new_tokens=60, do_sample=False)[0].numpy()
    plain = Retriever(
        RetrievalConfig(datastore_path=path, search_context=False, num_draft_tokens=6), tiny_llama
    )
    deep = Retriever(
        RetrievalConfig(
            datastore_path=path,
            search_context=False,
            num_draft_tokens=6,
            long_match=10,
            long_draft_tokens=16,
            long_nodes=20,
        ),
        tiny_llama,
    )
    context = doc[:30]  # a 30-token suffix of the document matches: a long match
    tree, match = deep.propose(context, max_depth=100)
    assert match >= 10 and int(tree.depth.max()) == 16 and len(tree) <= 20
    node, path = int(tree.depth.argmax()), []
    while node >= 0:
        path.append(int(tree.tokens[node]))
        node = int(tree.parents[node])
    assert path[::-1] == doc[30:46].tolist()  # the document's own continuation
    assert int(plain.propose(context, max_depth=100)[0].depth.max()) == 6
    assert len(deep.propose(context, max_depth=100, max_nodes=3)[0]) == len(
        tree
    )  # a long match keeps its budget
    small, _ = plain.propose(doc[20:28], max_depth=100, max_nodes=3)  # an 8-token match: capped at 3 nodes
    assert 0 < len(small) <= 3 and small.tokens[0] == doc[28]
    assert int(deep.propose(context, max_depth=4)[0].depth.max()) == 4
    short, match = deep.propose(doc[20:25], max_depth=100)  # a 5-token context: at most a 5-token match
    assert match < 10 and int(short.depth.max()) <= 6


def test_prompt_lookup_candidate_is_kept_whole(tiny_llama, store_dir):
    """`prompt_lookup`: prompt lookup's candidate is one root path of every tree, whatever the datastore says; the
    budget grows to its length + `prompt_lookup_extra`, never past `max_nodes`."""
    path = tiny_datastore(tiny_llama, store_dir / "lookup", seeds=(51,), length=60)
    settings = dict(datastore_path=path, num_draft_tokens=6, weak_nodes=2, max_nodes=9, strong_match=50)
    plain = Retriever(RetrievalConfig(**settings), tiny_llama)
    lookup = Retriever(RetrievalConfig(**settings, prompt_lookup=2, prompt_lookup_extra=2), tiny_llama)
    rng = np.random.default_rng(0)
    kept = 0
    for _ in range(40):
        context = rng.integers(0, 6, size=int(rng.integers(2, 30)))
        chain = first_continuation(context, 2, 6)
        tree, _ = lookup.propose(context, max_depth=100)
        paths = {tuple(p) for p in tree_paths(tree)}
        assert not chain or tuple(chain) in paths
        assert len(tree) <= max(2, min(len(chain) + 2, 9))
        assert len(plain.propose(context, max_depth=100)[0]) <= 2  # weak matches only: 2 nodes
        kept += len(chain) > 0
    assert kept > 20
    capped, _ = lookup.propose(np.array([1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]), max_depth=100, max_nodes=4)
    assert max(tree_paths(capped), key=len) == [3, 4, 5, 1] and len(capped) == 4  # Talon's cap holds


def tree_paths(tree: DraftTree) -> list[list[int]]:
    """Every root-to-node token path of `tree`, in node order."""
    paths: list[list[int]] = []
    for i, p in enumerate(tree.parents.tolist()):
        paths.append((paths[p] if p >= 0 else []) + [int(tree.tokens[i])])
    return paths


def test_skip_match_leaves_the_model_out_of_long_matches_only(tiny_llama, store_dir):
    """`switch: match`: the model drafts in exactly the rounds whose retrieval match is shorter than `skip_match`."""
    path = tiny_datastore(tiny_llama, store_dir / "skip", seeds=(61,), length=60)
    ids = prompt_ids(10, seed=61)
    for skip in (1, 3, 100):
        dec = SpeculativeDecoder(talon(path, switch={"skip_match": skip}))
        drafter = dec.drafter_for(tiny_llama)
        matches: list[int] = []
        propose = drafter.retriever.propose

        def spy(*args, _propose=propose, matches=matches, **kw):
            tree, match = _propose(*args, **kw)
            matches.append(match)
            return tree, match

        drafter.retriever.propose = spy
        tiny_llama.generate(ids, max_new_tokens=30, do_sample=False, custom_generate=dec)
        assert drafter.rounds["model"] == sum(m < skip for m in matches)
        if skip == 100:
            assert drafter.rounds["model"] == len(matches) > 0


def test_both_nodes_cuts_the_retrieval_tree_of_fused_rounds(tiny_llama, store_dir):
    """`both_nodes`: a round that fuses both halves keeps at most that many retrieval nodes beside the model's."""
    path = tiny_datastore(tiny_llama, store_dir / "both", seeds=(71,), length=60)
    ids = prompt_ids(10, seed=71)
    extra = {}
    for both in (0, 2):
        dec = SpeculativeDecoder(talon(path, switch=None, fusion={"both_nodes": both}))
        drafter = dec.drafter_for(tiny_llama)
        propose, added = drafter.propose, []

        def spy(*args, _propose=propose, _drafter=drafter, added=added, **kw):
            fused = _propose(*args, **kw)
            added.append(len(fused) - len(_drafter._round.model_tree))
            return fused

        drafter.propose = spy
        searches = []
        matches = drafter.retriever.matches
        drafter.retriever.matches = lambda *a, _m=matches, _s=searches, **kw: _s.append(1) or _m(*a, **kw)
        tiny_llama.generate(ids, max_new_tokens=30, do_sample=False, custom_generate=dec)
        extra[both] = added
        assert len(searches) <= len(added)  # the capped tree reuses its round's search
    assert max(extra[2]) <= 2 < max(extra[0])


def test_lookup_whole_keeps_prompt_lookups_chain_beside_a_node_cap(tiny_llama):
    """`lookup_whole`: a `max_nodes` argument caps the nodes beside prompt lookup's chain, not the chain; without it
    the chain is cut with the rest."""
    retriever = Retriever(RetrievalConfig(prompt_lookup=2, num_draft_tokens=8, max_nodes=16), tiny_llama)
    context = np.array([5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 20, 5, 6])
    chain = first_continuation(context, 2, 8)
    assert chain == [7, 8, 9, 10, 11, 12, 13, 14]
    whole, _ = retriever.propose(context, 8, max_nodes=2, lookup_whole=True)
    assert chain in tree_paths(whole) and len(whole) <= len(chain) + 2
    cut, _ = retriever.propose(context, 8, max_nodes=2)
    assert len(cut) == 2 and cut.tokens.tolist() == chain[:2]


def test_auto_lookup_keeps_the_chain_whole_once_it_is_being_accepted(tiny_llama, store_dir):
    """`both_lookup: auto`: fused rounds keep prompt lookup's chain whole only once this generation's mean accepted
    chain length reaches `auto_lookup` (a repetitive prompt: the tiny model's output loops); each generation starts
    over."""
    path = tiny_datastore(tiny_llama, store_dir / "auto", seeds=(91,), length=40)
    ids = prompt_ids(12, seed=91)
    for threshold, expect_whole in ((0.0, True), (1000.0, False)):
        fusion = {"both_nodes": 2, "both_lookup": "auto", "auto_lookup": threshold}
        config = talon(path, lookup=2, switch=None, fusion=fusion)
        dec = SpeculativeDecoder(config)
        drafter = dec.drafter_for(tiny_llama)
        calls: list[tuple[bool, int]] = []
        propose = drafter.retriever.propose

        def spy(*args, _propose=propose, calls=calls, _drafter=drafter, **kw):
            if "lookup_whole" in kw:
                calls.append((kw["lookup_whole"], _drafter.lookup_accepted.count))
            return _propose(*args, **kw)

        drafter.retriever.propose = spy
        for _ in range(2):
            tiny_llama.generate(ids, max_new_tokens=30, do_sample=False, custom_generate=dec)
            assert 0 < drafter.lookup_accepted.count < 30
        assert calls and all(whole == (expect_whole and seen > 0) for whole, seen in calls)
        assert any(seen == 0 for _, seen in calls[1:])  # the second generation started over


def test_skip_lookup_leaves_the_model_out_while_the_output_copies(tiny_llama, store_dir):
    """`skip_lookup`: the model drafts exactly in the rounds before which this generation's mean accepted length of
    prompt lookup's chain is below the threshold (the tiny model's looping output makes it long)."""
    path = tiny_datastore(tiny_llama, store_dir / "skip_lookup", seeds=(92,), length=40)
    ids = prompt_ids(12, seed=92)
    ref = tiny_llama.generate(ids, max_new_tokens=40, do_sample=False)
    for threshold in (0.5, 1000.0):
        dec = SpeculativeDecoder(talon(path, lookup=2, switch={"skip_match": 100, "skip_lookup": threshold}))
        drafter = dec.drafter_for(tiny_llama)
        seen: list[tuple[bool, bool]] = []  # (copying before the round, the model ran)
        propose = drafter.propose

        def spy(*args, _propose=propose, _drafter=drafter, seen=seen, _at=threshold, **kw):
            mean = _drafter.lookup_accepted
            copying = mean.count > 0 and mean.value >= _at
            fused = _propose(*args, **kw)
            seen.append((copying, _drafter._round.used_model))
            return fused

        drafter.propose = spy
        out = tiny_llama.generate(ids, max_new_tokens=40, do_sample=False, custom_generate=dec)
        assert torch.equal(out, ref)
        assert all(ran != copying for copying, ran in seen)
        assert any(copying for copying, _ in seen) == (threshold < 1000)


def test_continuation_follows_the_context_and_the_draft(tiny_llama, store_dir):
    """`Retriever.continuation`: the datastore's continuation of (context + drafted tokens), matched over at least
    `min_match` tokens; the drafted tokens are searched for, never searched in."""
    path = tiny_datastore(tiny_llama, store_dir / "continue", seeds=(41,), length=60)
    doc = tiny_llama.generate(prompt_ids(8, seed=41), max_new_tokens=60, do_sample=False)[0].numpy()
    retriever = Retriever(RetrievalConfig(datastore_path=path, search_context=False), tiny_llama)
    context, draft = doc[:30], doc[30:32].tolist()
    assert retriever.continuation(context, draft, 5, min_match=4) == doc[32:37].tolist()
    assert retriever.continuation(context, draft, 0, min_match=1) == []
    assert retriever.continuation(context[-2:], draft, 5, min_match=10) == []  # a 4-token query: too short
    own = Retriever(RetrievalConfig(search_context=True), tiny_llama)  # no datastore: the prompt lookup only
    text = np.array([4, 5, 6, 7, 8, 9, 1, 2, 3, 5, 6])
    assert own.continuation(text, [7], 3, min_match=3) == [8, 9, 1]  # "5 6 7" occurs in the text, then 8 9 1
    assert own.continuation(text, [9], 3, min_match=2) == []  # "6 9" does not


def test_extension_goes_behind_the_model_path_and_stays_out_of_the_drafter(tiny_llama, store_dir):
    """The extension hangs under the model tree's first-child path; the model drafter observes its own nodes."""
    path = tiny_datastore(tiny_llama, store_dir / "extend", seeds=(51,), length=60)
    doc = tiny_llama.generate(prompt_ids(8, seed=51), max_new_tokens=60, do_sample=False)[0]
    config = talon(path, drafter="pld", fusion={"extend_tokens": 3, "extend_min_match": 3})
    drafter = TalonDrafter(config, tiny_llama)
    state = type("S", (), {"input_ids": doc[None, :30]})()
    model_tree = DraftTree(doc[30:33].clone(), torch.tensor([-1, 0, -1]))  # path 30, 31; a sibling root child
    model_tree.tokens[2] = int(doc[30]) + 1
    extended = drafter._extended(state, model_tree, max_depth=10)
    assert extended.tokens[:3].tolist() == model_tree.tokens.tolist()
    assert extended.tokens[3:].tolist() == doc[32:35].tolist() and extended.parents[3:].tolist() == [1, 3, 4]
    assert drafter.rounds["extended"] == 1
    assert drafter._extended(state, model_tree, max_depth=2) is model_tree  # no depth left behind the path


def test_async_output_equals_sync_output(tiny_llama, store_dir):
    path = tiny_datastore(tiny_llama, store_dir / "async")
    outs = {}
    for mode in ("sync", "async"):
        dec = SpeculativeDecoder(talon(path, schedule={"mode": mode}, switch=None, drafter="early-exit:3"))
        drafter = dec.drafter_for(tiny_llama)
        outs[mode] = [
            tiny_llama.generate(
                prompt_ids(12, seed=s), max_new_tokens=48, do_sample=False, custom_generate=dec
            )
            for s in (3, 4, 5)
        ]
        if mode == "async":  # the worker really drafted ahead, and some of those blocks were used
            assert drafter.rounds["ahead_kept"] + drafter.rounds["ahead_dropped"] > 0
    for a, b in zip(outs["sync"], outs["async"], strict=True):
        assert torch.equal(a, b)
    assert not leaked()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_finish_verification_equals_the_stock_forward(tiny_model, seed):
    """Pre-verifying the retrieval tree, then the fused tree's other nodes: the stock forward of the fused
    tree (logits, last hidden states, and the cache block in fused order)."""
    gen = torch.Generator().manual_seed(seed)
    ids = prompt_ids(10, seed=seed)

    def random_tree(n: int) -> DraftTree:
        parents = [-1] + [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(1, n)]
        return DraftTree(torch.randint(3, 12, (n,), generator=gen), torch.tensor(parents))

    ret_tree, model_tree = random_tree(6), random_tree(4)
    fused, _, ret_map = fuse_trees(model_tree, ret_tree)
    root, past = int(ids[0, -1]), ids.shape[1] - 1

    def prefilled():
        cache = DynamicCache(config=tiny_model.config)
        with torch.no_grad():
            tiny_model(input_ids=ids[:, :-1], **{CACHE: cache}, use_cache=True)
        return cache

    ref_cache, cache = prefilled(), prefilled()
    with torch.no_grad():
        ref = tiny_model(
            input_ids=torch.cat([ids[0, -1:], fused.tokens])[None],
            position_ids=tree_position_ids(fused, past),
            attention_mask=tree_attention_mask(fused, past),
            **{CACHE: ref_cache},
            use_cache=True,
            output_hidden_states=True,
        )
    pre = pre_verify(tiny_model, cache, root, ret_tree, output_hidden_states=True)
    out = finish_verification(tiny_model, cache, pre, fused, ret_map, output_hidden_states=True)
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.hidden_states[-1], ref.hidden_states[-1], atol=1e-4, rtol=1e-4)
    for layer, ref_layer in zip(cache.layers, ref_cache.layers, strict=True):
        torch.testing.assert_close(layer.keys, ref_layer.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(layer.values, ref_layer.values, atol=1e-5, rtol=1e-5)


def test_pre_verify_output_equals_generate(tiny_llama, store_dir):
    """Async rounds that do not draft ahead pre-verify the retrieval tree beside the model drafting."""
    path = tiny_datastore(tiny_llama, store_dir / "pre")
    dec = SpeculativeDecoder(
        talon(path, schedule={"mode": "async", "pre_verify": True, "min_acceptance": 0.5}, switch=None)
    )
    drafter = dec.drafter_for(tiny_llama)
    for s in (3, 4):
        ids = prompt_ids(12, seed=s)
        ref = tiny_llama.generate(ids, max_new_tokens=40, do_sample=False)
        assert torch.equal(
            tiny_llama.generate(ids, max_new_tokens=40, do_sample=False, custom_generate=dec), ref
        )
    assert drafter.rounds["pre_verified"] > 0
    assert not leaked()


class Boom(Exception):
    pass


class RaisingStreamer:
    def __init__(self, after: int, exc: type[BaseException]) -> None:
        self.calls, self.after, self.exc = 0, after, exc

    def put(self, value) -> None:
        self.calls += 1
        if self.calls > self.after:
            raise self.exc("stop")

    def end(self) -> None:
        pass


@pytest.mark.parametrize("exc", [Boom, KeyboardInterrupt])
def test_no_leaked_thread_on_error_or_interrupt(tiny_llama, exc):
    threads = torch.get_num_threads()
    config = TalonConfig(retrieval={}, drafter="early-exit:3", schedule={"mode": "async"}, switch=None)
    dec = SpeculativeDecoder(config)
    with pytest.raises(exc):
        tiny_llama.generate(
            prompt_ids(12),
            max_new_tokens=40,
            do_sample=False,
            custom_generate=dec,
            streamer=RaisingStreamer(3, exc),
        )
    assert not leaked() and torch.get_num_threads() == threads
    # the decoder still works afterwards
    ref = tiny_llama.generate(prompt_ids(12), max_new_tokens=20, do_sample=False)
    assert torch.equal(
        tiny_llama.generate(prompt_ids(12), max_new_tokens=20, do_sample=False, custom_generate=dec), ref
    )


def test_worker_error_is_raised_not_hung(tiny_llama, monkeypatch):
    dec = SpeculativeDecoder(TalonConfig(retrieval=None, drafter="early-exit:3", schedule={"mode": "async"}))
    drafter = dec.drafter_for(tiny_llama)
    calls = {"n": 0}
    step = drafter.chain._step

    def flaky():
        calls["n"] += 1
        if calls["n"] > 4 and threading.current_thread().name.startswith(THREAD_PREFIX):
            raise Boom("draft failed")
        step()

    monkeypatch.setattr(drafter.chain, "_step", flaky)
    with pytest.raises(Boom):
        tiny_llama.generate(prompt_ids(12), max_new_tokens=40, do_sample=False, custom_generate=dec)
    assert not leaked()


def test_thread_counts_are_restored(tiny_llama):
    before = torch.get_num_threads()
    dec = SpeculativeDecoder(
        TalonConfig(retrieval=None, drafter="early-exit:3", schedule={"mode": "async", "verify_threads": 1})
    )
    tiny_llama.generate(prompt_ids(12), max_new_tokens=30, do_sample=False, custom_generate=dec)
    assert torch.get_num_threads() == before


def test_bad_configs_are_clear_errors(tiny_llama):
    with pytest.raises(ValueError, match="both halves are off"):
        TalonConfig(retrieval=None, drafter="")
    with pytest.raises(ValueError, match="talon.schedule: mode must be 'sync' or 'async', got 'parallel'"):
        TalonConfig(schedule={"mode": "parallel"})
    with pytest.raises(ValueError, match="talon.schedule: .*pre_verify apply to mode 'async' only"):
        TalonConfig(schedule={"pre_verify": True})
    with pytest.raises(
        ValueError, match="talon: schedule.pre_verify needs both retrieval and a model drafter"
    ):
        TalonConfig(retrieval=None, schedule={"mode": "async", "pre_verify": True})
    with pytest.raises(ValueError, match="own state"):
        TalonDrafter(TalonConfig(drafter="pld", schedule={"mode": "async"}), tiny_llama)
    with pytest.raises(ValueError, match="unknown retrieval config keys"):
        TalonDrafter(TalonConfig(retrieval={"nodes": 3}), tiny_llama)
    with pytest.raises(FileNotFoundError, match="no datastore"):
        SpeculativeDecoder(RetrievalConfig(datastore_path="/nonexistent/ds")).drafter_for(tiny_llama)
    with pytest.raises(ValueError, match="min_match"):
        RetrievalConfig(min_match=5, max_match=2)
    with pytest.raises(ValueError, match="prompt_lookup and prompt_lookup_extra must be >= 0"):
        RetrievalConfig(prompt_lookup=-1)
    with pytest.raises(ValueError, match="long_draft_tokens must be >= num_draft_tokens"):
        RetrievalConfig(long_match=8, long_draft_tokens=4)
    with pytest.raises(ValueError, match="auto_nodes needs max_nodes >= 1"):
        RetrievalConfig(auto_nodes=True, max_nodes=0)
    with pytest.raises(ValueError, match="auto_nodes_tolerance >= 1.0"):
        RetrievalConfig(auto_nodes=True, auto_nodes_tolerance=0.9)
    with pytest.raises(ValueError, match="talon.switch: rule must be 'match', 'cost' or 'best'"):
        TalonConfig(switch={"rule": "learned"})
    with pytest.raises(ValueError, match="talon: fusion.extend_tokens needs the retrieval half"):
        TalonConfig(retrieval=None, drafter="early-exit:2", fusion={"extend_tokens": 2})
    with pytest.raises(
        ValueError, match="talon.switch: skip_match and skip_lookup apply to rule 'match', not 'cost'"
    ):
        TalonConfig(switch={"skip_match": 8, "rule": "cost"})
    with pytest.raises(ValueError, match="talon: switch.skip_lookup needs retrieval.prompt_lookup"):
        TalonConfig(switch={"skip_lookup": 3.0})
    with pytest.raises(ValueError, match="talon.switch: skip_lookup must be >= 0"):
        TalonConfig(switch={"skip_lookup": -1.0})
    with pytest.raises(ValueError, match="talon.fusion: both_lookup must be 'cut', 'whole' or 'auto'"):
        TalonConfig(fusion={"both_nodes": 3, "both_lookup": "all"})
    with pytest.raises(ValueError, match="talon: fusion.both_lookup needs retrieval.prompt_lookup"):
        TalonConfig(fusion={"both_nodes": 3, "both_lookup": "whole"})
    with pytest.raises(ValueError, match="talon.fusion: both_nodes must be >= 0"):
        TalonConfig(fusion={"both_nodes": -1}, switch={"rule": "best"})
    with pytest.raises(ValueError, match="talon.switch: skip_match must be >= 0"):
        TalonConfig(switch={"skip_match": -1})
    for bad, message in [
        (dict(schedule={"verify_threads": 2}), "apply to mode 'async' only"),
        (dict(schedule={"mode": "async", "min_acceptance": 2.0}), r"min_acceptance must be in \[0, 1\]"),
        (
            dict(schedule={"mode": "async", "verify_threads": -1}),
            "talon.schedule: verify_threads must be >= 0",
        ),
        (dict(drafter="", schedule={"mode": "async"}), "need the model drafter"),
        (dict(drafter="", fusion={"extend_tokens": 3}), "need the model drafter"),
        (dict(fusion={"both_nodes": 3}, drafter=""), "both_nodes needs both halves"),
        (dict(fusion={"auto_lookup": -1.0}), "talon.fusion: auto_lookup must be >= 0"),
        (dict(fusion={"extend_min_match": 0}), "talon.fusion: extend_min_match must be >= 1"),
        (
            dict(retrieval=None, drafter="early-exit:2", fusion={"both_lookup": "whole"}),
            "both_lookup 'whole' needs both_nodes",
        ),
        (dict(switch={"cost": 0.5}), "talon.switch: cost applies to rule 'cost' or 'best', not 'match'"),
        (dict(switch={"explore_every": -1, "rule": "cost"}), "talon.switch: explore_every must be >= 0"),
        (dict(switch={"rule": "cost", "speed": 1}), r"unknown talon.switch config keys \['speed'\]"),
        (dict(retrieval="foo"), "retrieval must be a settings object or null"),
    ]:
        with pytest.raises(ValueError, match=message):
            TalonConfig(**bad)
    with pytest.raises(ValueError, match="talon wraps a model drafter, not itself"):
        TalonDrafter(TalonConfig(drafter="talon"), tiny_llama)
    with pytest.raises(ValueError, match="cannot wrap hispec: it runs its own verification forward"):
        TalonDrafter(TalonConfig(retrieval=None, drafter="hispec"), make_tiny_model("llama", layers=6))


class ShallowSampledDrafter(SampledTreeDrafter):
    """One level of sampled root children (3 new tokens leave no depth behind a 2-level tree to extend)."""

    def propose(self, state, max_depth: int) -> DraftTree:
        return super().propose(state, min(max_depth, 1))


@pytest.mark.parametrize("async_mode", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_fused_tree_sampling_matches_plain_sampling(tmp_path, async_mode):
    """A sampled model tree (reporting q) fused with a deterministic retrieval tree that often proposes the same
    tokens: per-position distributions must equal plain sampling's (chi-square)."""
    target = make_tiny_model("llama", seed=11, vocab_size=V, layers=2, temperature=2.0)
    draft = make_tiny_model("llama", seed=12, vocab_size=V, layers=1, temperature=2.0)
    prompt = torch.tensor([[1, 5, 7, 3, 9]])
    docs = [target.generate(prompt, max_new_tokens=6, do_sample=True, top_k=0)[0].tolist() for _ in range(30)]
    save_datastore(
        tmp_path / "ds", TokenIndex.from_documents(docs), DatastoreRecipe(), {"format": 1, "tokenizer": None}
    )
    retrieval = {
        "datastore_path": str(tmp_path / "ds"),
        "num_draft_tokens": 3,
        "max_nodes": 4,
        "weak_nodes": 4,
    }
    if (
        async_mode
    ):  # the early-exit chain drafts ahead on the worker; retrieval fused with it (all deterministic)
        drafter = TalonDrafter(
            TalonConfig(retrieval=retrieval, drafter="early-exit:1", schedule={"mode": "async"}, switch=None),
            target,
        )
    else:
        # retrieval also continues the model's first path (`extend_tokens`): deterministic nodes behind sampled ones
        fusion = {"extend_tokens": 2, "extend_min_match": 2}
        config = TalonConfig(retrieval=retrieval, drafter="pld", switch=None, fusion=fusion)
        drafter = TalonDrafter(config, target)
        drafter.sub = ShallowSampledDrafter(target, draft, width=2)  # any drafter that reports its q
    pvalues, accepted = sampled_marginals_pvalues(
        target, lambda: SpeculativeDecoder(drafter), n=800, seed=2025
    )
    assert accepted > 800 * 0.3
    assert min(pvalues) > 1e-3, pvalues
    assert async_mode or drafter.rounds["extended"] > 0
    assert not leaked()


@pytest.mark.parametrize("method", ["retrieval", "talon"])
def test_auto_nodes_measures_the_strong_budget_once(tiny_llama, store_dir, method):
    """`auto_nodes`: the first generation times verifications of 1..max_nodes nodes and keeps the flat budget as
    strong matches' `max_nodes` (never more than configured); later generations reuse it; output unchanged."""
    path = tiny_datastore(tiny_llama, store_dir / "auto")
    settings = dict(datastore_path=path, num_draft_tokens=6, max_nodes=9, weak_nodes=2, auto_nodes=True)
    config = (
        RetrievalConfig(**settings)
        if method == "retrieval"
        else TalonConfig(retrieval=settings, drafter="early-exit:3", switch=None)
    )
    decoder = SpeculativeDecoder(config)
    ids = prompt_ids(14, seed=6)
    ref = tiny_llama.generate(ids, max_new_tokens=30, do_sample=False)
    out = tiny_llama.generate(ids, max_new_tokens=30, do_sample=False, custom_generate=decoder)
    assert torch.equal(out, ref)
    retriever = decoder.drafter_for(tiny_llama).retriever
    costs = retriever.verification_costs
    assert sorted(costs) == [1, 3, 5, 7, 9] and all(t > 0 for t in costs.values())
    assert retriever.max_nodes == flat_tree_budget(costs, 1.3) and 1 <= retriever.max_nodes <= 9
    stored = tiny_llama.generate(prompt_ids(8, seed=11), max_new_tokens=60, do_sample=False)[0, :12]
    retriever.max_nodes = 3  # a strong match's tree stays within the measured budget
    tree, longest = retriever.propose(stored.numpy(), 6)
    assert longest >= 3 and 0 < len(tree) <= 3
    tiny_llama.generate(ids, max_new_tokens=10, do_sample=False, custom_generate=decoder)
    assert retriever.verification_costs is costs and retriever.max_nodes == 3  # measured once


def test_auto_nodes_keeps_the_config_where_it_cannot_measure(tiny_llama, store_dir):
    """transformers' assisted loop and batch rows verify without hf-spec's verification forward or on several
    sequences: nothing is measured, `max_nodes` stays the config's, the output is the target's."""
    from hf_spec.integrations import enable_assistant

    path = tiny_datastore(tiny_llama, store_dir / "auto-fallback")
    config = RetrievalConfig(datastore_path=path, max_nodes=7, auto_nodes=True)
    ids = prompt_ids(12, seed=9)
    ref = tiny_llama.generate(ids, max_new_tokens=20, do_sample=False)
    decoder = SpeculativeDecoder(config)
    with enable_assistant(tiny_llama, loop="transformers"):
        out = tiny_llama.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=decoder)
    assert torch.equal(out, ref)
    retriever = decoder.drafter_for(tiny_llama).retriever
    assert retriever.max_nodes == 7 and not retriever.verification_costs
    batch = torch.cat([prompt_ids(12, seed=9), prompt_ids(12, seed=10)])
    refs = tiny_llama.generate(batch, max_new_tokens=12, do_sample=False)
    decoder = SpeculativeDecoder(config)
    out = tiny_llama.generate(batch, max_new_tokens=12, do_sample=False, custom_generate=decoder)
    assert torch.equal(out, refs)
    assert not decoder.drafter_for(tiny_llama).retriever.verification_costs
