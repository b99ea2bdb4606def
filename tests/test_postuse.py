"""Post-use & Pre-cut: the token cache against a plain reference, step-wise drafting and grafted verification
trees against brute-force forwards, Q-learning arithmetic and persistence, bounded memory, losslessness."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache, GenerationConfig

from hf_spec import SpeculativeDecoder
from hf_spec.core.compat import cache_kwargs
from hf_spec.core.drafter import SpecState
from hf_spec.core.specs import parse_method
from hf_spec.engine.target.forward import flat_tree_budget, time_verifications
from hf_spec.engine.target.profile import target_profile
from hf_spec.methods.draft_model.config import DraftModelConfig
from hf_spec.methods.draft_model.drafter import DraftModelDrafter
from hf_spec.methods.early_exit.config import EarlyExitConfig
from hf_spec.methods.early_exit.drafter import EarlyExitDrafter
from hf_spec.methods.postuse import PostUseConfig, PostUseDrafter, PreCutController, TokenCache
from hf_spec.methods.postuse.branches import agreeing_runs, windows
from hf_spec.methods.postuse.controller import CONTINUE, STOP
from hf_spec.tree.draft_tree import DraftTree
from hf_spec.tree.fusion import graft
from hf_spec.tree.masks import tree_attention_mask, tree_position_ids
from tests.conftest import CACHE, make_tiny_model, prompt_ids
from tests.stats import sampled_marginals_pvalues
from tests.test_sampling import V


# ---- token cache ---------------------------------------------------------------------------------------
class ReferenceCache:
    """The cache rules written as plainly as possible: one list of anchor records, full scans."""

    def __init__(self, max_anchors: int, max_phrases: int, beta: int) -> None:
        self.max_anchors, self.max_phrases, self.beta = max_anchors, max_phrases, beta
        self.records: list[dict] = []  # {"anchor", "uses", "last", "phrases": oldest first}
        self.clock = 0

    def _record(self, anchor):
        return next((r for r in self.records if r["anchor"] == anchor), None)

    def _use(self, rec) -> None:
        self.clock += 1
        rec["uses"] += 1
        rec["last"] = self.clock

    def admit(self, phrase) -> None:
        phrase = tuple(phrase[: self.beta])
        if len(phrase) < 2:
            return
        rec = self._record(phrase[0])
        if rec is None:
            if len(self.records) == self.max_anchors:
                least = sorted(self.records, key=lambda r: (r["uses"], r["last"]))[0]
                self.records.remove(least)
            rec = {"anchor": phrase[0], "uses": 0, "last": 0, "phrases": []}
            self.records.append(rec)
        self._use(rec)
        extensions = [p for p in rec["phrases"] if len(p) > len(phrase) and p[: len(phrase)] == phrase]
        if extensions:
            newest = extensions[-1]
            rec["phrases"].remove(newest)
            rec["phrases"].append(newest)
            return
        rec["phrases"] = [p for p in rec["phrases"] if not (len(p) <= len(phrase) and phrase[: len(p)] == p)]
        rec["phrases"].append(phrase)
        while len(rec["phrases"]) > self.max_phrases:
            rec["phrases"].pop(0)

    def lookup(self, anchor, k):
        rec = self._record(anchor)
        if rec is None or not rec["phrases"] or k <= 0:
            return []
        self._use(rec)
        return list(reversed(rec["phrases"]))[:k]


ops = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.lists(st.integers(0, 5), min_size=0, max_size=7)),
        st.tuples(st.just("lookup"), st.tuples(st.integers(0, 5), st.integers(0, 4))),
    ),
    max_size=80,
)


@given(ops, st.integers(1, 4), st.integers(1, 4), st.integers(2, 5))
@settings(max_examples=300, deadline=None)
def test_token_cache_matches_plain_reference(operations, max_anchors, max_phrases, beta):
    cache, ref = TokenCache(max_anchors, max_phrases, beta), ReferenceCache(max_anchors, max_phrases, beta)
    for op, arg in operations:
        if op == "admit":
            cache.admit(arg)
            ref.admit(arg)
        else:
            assert cache.lookup(*arg) == ref.lookup(*arg)
        assert sorted(cache._stacks) == sorted(r["anchor"] for r in ref.records)
        for r in ref.records:
            assert cache.phrases(r["anchor"]) == list(reversed(r["phrases"]))
        assert len(cache) <= max_anchors
        assert all(len(s) <= max_phrases for s in cache._stacks.values())


def test_token_cache_lifo_refresh_and_eviction():
    cache = TokenCache(max_anchors=2, max_phrases=2, phrase_length=3)
    cache.admit([5, 6, 7, 8])  # cut to beta = 3
    cache.admit([5, 9])
    assert cache.lookup(5, 5) == [(5, 9), (5, 6, 7)]  # newest first
    cache.admit([5, 6])  # a prefix of a stored phrase refreshes it
    assert cache.lookup(5, 5) == [(5, 6, 7), (5, 9)]
    cache.admit([5, 9, 1])  # replaces its prefix (5, 9)
    assert cache.phrases(5) == [(5, 9, 1), (5, 6, 7)]
    cache.admit([5, 4])  # third phrase: the oldest (5, 6, 7) goes
    assert cache.phrases(5) == [(5, 4), (5, 9, 1)]
    cache.admit([3, 1])
    cache.lookup(3, 1)
    cache.lookup(3, 1)  # anchor 3: 3 uses, anchor 5: 6 uses
    cache.admit([7, 7])  # pool full: the least-used anchor (3) is evicted
    assert 3 not in cache and 5 in cache and 7 in cache
    cache.admit([1])  # too short: ignored
    assert 1 not in cache


def test_phrase_helpers():
    assert agreeing_runs([0, 1, 2, 3, 4, 5], [True, False, True, True, False]) == [[0, 1], [2, 3, 4]]
    assert agreeing_runs([0, 1], [False]) == []
    assert windows([1, 2, 3, 4], 3) == [[1, 2, 3], [2, 3, 4], [3, 4]]


# ---- grafting cached phrases onto the verification tree ------------------------------------------------
def test_graft_shares_nodes_keeps_order_and_budget():
    probs = torch.softmax(torch.randn(2, 10), -1)
    tree = DraftTree.chain([3, 4], draft_probs=probs)
    out, added = graft(tree, [(0, [4, 5]), (-1, [6, 7]), (1, [8])], max_nodes=5)
    assert out.tokens.tolist() == [3, 4, 5, 6, 7]
    assert out.parents.tolist() == [-1, 0, 1, -1, 3]
    assert added == 3
    assert torch.equal(out.draft_probs[:2], probs) and not out.draft_probs[2:].any()
    same, added = graft(tree, [(0, [4])], max_nodes=10)
    assert same is tree and added == 0


def test_target_side_tree_logits_equal_per_path_forwards(tiny_model):
    """A verification tree with cached branches grafted behind the last draft tokens: every node's logits from
    the one masked forward equal a plain forward of the committed text + that node's path."""
    cfg = PostUseConfig(
        drafter="early-exit:2",
        precut=None,
        reuse_draft=None,
        draft_length=3,
        reuse_target={"max_tree_nodes": 30},
    )
    drafter = PostUseDrafter(cfg, tiny_model)
    ids = prompt_ids(12, seed=5)
    chain = [11, 12, 13]
    for phrase in ([13, 20, 21], [13, 22], [12, 30, 31, 32], [11, 12, 40]):
        drafter.cache.admit(phrase)
    drafter.cache.admit([int(ids[0, -1]), 50, 51])
    tree = drafter._graft_cached(
        DraftTree.chain(chain), [int(ids[0, -1])] + chain, [-1, 0, 1, 2], max_depth=8
    )
    assert len(tree) > len(chain)
    tokens = tree.tokens.tolist()
    # the grafts hang below the right anchors
    paths = {tuple(tokens[n] for n in tree.path_to(i)) for i in range(len(tree))}
    for expected in [(11, 12, 13, 20, 21), (11, 12, 13, 22), (11, 12, 30, 31, 32), (11, 12, 40)]:
        assert expected in paths
    cache = DynamicCache(config=tiny_model.config)
    past = ids.shape[1] - 1
    with torch.no_grad():
        tiny_model(input_ids=ids[:, :-1], **{CACHE: cache}, use_cache=True)
        verify = torch.cat([ids[:, -1:], tree.tokens.view(1, -1)], dim=1)
        logits = tiny_model(
            input_ids=verify,
            position_ids=tree_position_ids(tree, past),
            attention_mask=tree_attention_mask(tree, past),
            **{CACHE: cache},
            use_cache=True,
        ).logits[0]
        for node in range(len(tree)):
            path = [tokens[n] for n in tree.path_to(node)]
            full = torch.cat([ids[0], torch.tensor(path)])[None]
            ref = tiny_model(input_ids=full).logits[0, -1]
            torch.testing.assert_close(logits[node + 1], ref, atol=1e-4, rtol=1e-4)


# ---- step-wise drafting: one masked forward == separate forwards per branch ---------------------------
def _exit_logits(model, seq: torch.Tensor, layer: int) -> torch.Tensor:
    with torch.no_grad():
        hs = model(input_ids=seq, output_hidden_states=True).hidden_states[layer]
        return model.lm_head(model.model.norm(hs))[0].float()


def _stepper(kind: str, model):
    if kind == "early-exit":
        return EarlyExitDrafter(EarlyExitConfig(exit_layer=2), model)
    draft = make_tiny_model("llama", seed=5, layers=2)
    return DraftModelDrafter(DraftModelConfig(num_draft_tokens=4), model, draft_model=draft)


def _reference_logits(kind: str, drafter, model, seq: torch.Tensor) -> torch.Tensor:
    if kind == "early-exit":
        return _exit_logits(model, seq, drafter.exit_layer)
    with torch.no_grad():
        return drafter.draft(input_ids=seq).logits[0].float()


@pytest.mark.parametrize("kind", ["early-exit", "draft-model"])
def test_draft_step_branches_equal_separate_forwards(tiny_model, kind):
    drafter = _stepper(kind, tiny_model)
    ids = prompt_ids(12, seed=6)
    cache = DynamicCache(config=tiny_model.config)
    with torch.no_grad():
        tiny_model(input_ids=ids[:, :-1], **{CACHE: cache}, use_cache=True)
    state = SpecState(tiny_model, cache, ids, GenerationConfig(), backend=target_profile(tiny_model).backend)
    drafter.begin(state)
    root = int(ids[0, -1])
    branches = [[7, 8, 9], [10], [7, 11]]
    assert drafter.draft_start(state)
    step = drafter.draft_step([root], branches)
    base = ids[0]
    torch.testing.assert_close(
        step.chain, _reference_logits(kind, drafter, tiny_model, base[None])[-1], atol=1e-4, rtol=1e-4
    )
    for b, branch in enumerate(branches):
        seq = torch.cat([base, torch.tensor(branch)])[None]
        ref = _reference_logits(kind, drafter, tiny_model, seq)[-len(branch) :]
        torch.testing.assert_close(step.branches[b], ref, atol=1e-4, rtol=1e-4)
    # keep 2 tokens of branch 2, then one more step: as if [root, 7, 11] had been fed as a chain
    drafter.draft_keep(2, 2, [7, 11])
    step = drafter.draft_step([4], [[5, 6]])
    seq = torch.cat([base, torch.tensor([7, 11, 4])])
    torch.testing.assert_close(
        step.chain, _reference_logits(kind, drafter, tiny_model, seq[None])[-1], atol=1e-4, rtol=1e-4
    )
    ref = _reference_logits(kind, drafter, tiny_model, torch.cat([seq, torch.tensor([5, 6])])[None])[-2:]
    torch.testing.assert_close(step.branches[0], ref, atol=1e-4, rtol=1e-4)
    drafter.draft_stop(state)
    if kind == "early-exit":  # the target's cache is back to the committed tokens
        assert all(layer.keys.shape[-2] == ids.shape[1] - 1 for layer in cache.layers)
    else:  # the draft cache holds the committed tokens + the chain fed after the root
        assert drafter.cached == ids.shape[1] and drafter.pending == [7, 11, 4]
        assert drafter.cache.get_seq_length() == ids.shape[1] + 3


def test_step_tree_layout():
    tree = DraftTree.chain_with_branches([1, 2], [[3, 4], [5]])
    assert tree.tokens.tolist() == [2, 3, 4, 5] and tree.parents.tolist() == [-1, 0, 1, 0]


# ---- Pre-cut controller ----------------------------------------------------------------------------------
def test_q_update_arithmetic():
    ctrl = PreCutController(
        max_calls=4, benefit_buckets=2, alpha=0.5, gamma=0.9, epsilon=0.0, init_continue=0.01
    )
    s1, s2 = ctrl.state(1, 0.9), ctrl.state(2, 0.3)
    assert (s1, s2) == ((1, 1), (2, 0))
    assert ctrl.state(9, 1.0) == (4, 1)  # clipped
    ctrl.update([s1, s2], [-0.5, 0.2])
    # STOP: Q <- Q + a (r - Q)
    assert ctrl.table[s1][STOP] == pytest.approx(0.5 * -0.5)
    assert ctrl.table[s2][STOP] == pytest.approx(0.5 * 0.2)
    # CONTINUE at s1: Q <- Q + a (g * max Q(s2) - Q), with Q(s2) already updated
    assert ctrl.table[s1][CONTINUE] == pytest.approx(0.01 + 0.5 * (0.9 * 0.1 - 0.01))
    assert ctrl.table[s2][CONTINUE] == pytest.approx(0.01)  # last state: no CONTINUE trial
    assert ctrl.should_continue(s1) and not ctrl.should_continue(s2)
    assert ctrl.should_continue(ctrl.state(3, 0.5))  # unseen: CONTINUE starts above STOP
    # at max_calls only STOP is open: the state before it backs up Q(STOP), not the untouched Q(CONTINUE)
    s3, s4 = ctrl.state(3, 0.5), ctrl.state(4, 0.5)
    ctrl.update([s3, s4], [-0.4, -0.8])
    assert ctrl.table[s4][STOP] == pytest.approx(-0.4) and ctrl.table[s4][CONTINUE] == pytest.approx(0.01)
    assert ctrl.table[s3][CONTINUE] == pytest.approx(0.01 + 0.5 * (0.9 * -0.4 - 0.01))


def test_q_table_save_load_and_freeze(tmp_path):
    ctrl = PreCutController(max_calls=6, benefit_buckets=3)
    ctrl.update([(1, 2), (2, 1), (3, 0)], [0.1, -0.2, -0.6])
    ctrl.target_cost = 1.3
    path = ctrl.save(tmp_path / "q.json")
    other = PreCutController(max_calls=6, benefit_buckets=3, frozen=True)
    other.load(path)
    assert other.table == ctrl.table and other.updates == 1 and other.target_cost == 1.3
    before = json.dumps(other.to_dict())
    other.update([(1, 2)], [5.0])  # frozen: no learning
    assert json.dumps(other.to_dict()) == before
    with pytest.raises(ValueError, match="max_calls/benefit_buckets"):
        PreCutController(max_calls=5, benefit_buckets=3).load(path)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not an hf-spec Pre-cut Q-table"):
        ctrl.load(tmp_path / "bad.json")
    with pytest.raises(FileNotFoundError):
        ctrl.load(tmp_path / "missing.json")
    saved = json.loads(path.read_text())
    for q, message in [
        ([], "'q' must map states"),
        ({"a,b": [0, 0]}, "bad entry 'a,b'"),
        ({"1,2,3": [0, 0]}, "bad entry '1,2,3'"),
        ({"1,2": 5}, "bad entry '1,2'"),
        ({"1,2": [0.0, float("nan")]}, "two finite values"),
        ({"99,0": [0.0, 0.0]}, "outside this controller's layout"),
    ]:
        (tmp_path / "bad.json").write_text(json.dumps({**saved, "q": q}))
        with pytest.raises(ValueError, match=message):
            ctrl.load(tmp_path / "bad.json")


def test_rewards_useful_and_accepted(tiny_llama):
    from hf_spec.methods.postuse.drafter import PostUseRound

    for reward, expected in [("useful", [1, 3]), ("accepted", [1, 1]), ("committed", [2, 2])]:
        drafter = PostUseDrafter(
            PostUseConfig(drafter="early-exit:2", precut={"reward": reward, "target_cost": 2.0}), tiny_llama
        )
        rnd = PostUseRound(
            [0, 1, 2, 3, 4], [0, 1, 2, 3], call_ends=[2, 4], states=[(1, 0), (2, 0)], grafted_from=4
        )
        got = drafter._rewards(rnd, [True, False, True, True])
        assert got == pytest.approx([expected[0] / 3 - 1, expected[1] / 4 - 1])


# ---- configuration ---------------------------------------------------------------------------------------
def test_config_specs_and_errors(tiny_llama, tmp_path):
    cfg = parse_method("postuse:early-exit:3")
    assert cfg.drafter == "early-exit:3"
    nested = PostUseConfig(drafter={"method": "early-exit", "exit_layer": 1, "num_draft_tokens": 2})
    path = nested.save_pretrained(tmp_path / "cfg")
    loaded = parse_method(str(path))
    assert loaded == nested
    assert PostUseDrafter(loaded, tiny_llama).inner.exit_layer == 1
    with pytest.raises(ValueError, match="does not support that"):
        PostUseDrafter(PostUseConfig(drafter="pld"), tiny_llama)
    with pytest.raises(
        ValueError, match="postuse.precut: reward must be 'useful', 'accepted' or 'committed'"
    ):
        PostUseConfig(precut={"reward": "speed"})
    with pytest.raises(ValueError, match="postuse.reuse_target: max_tree_nodes must be >= 0, got -1"):
        PostUseConfig(reuse_target={"max_tree_nodes": -1})
    with pytest.raises(ValueError, match="postuse.reuse_target: auto_tree_tolerance must be >= 1"):
        PostUseConfig(reuse_target={"max_tree_nodes": 0, "auto_tree_tolerance": 0.9})
    for bad, message in [
        ({"draft_length": 0}, "postuse: draft_length must be >= 1, got 0"),
        ({"cache": {"phrase_length": 1}}, r"postuse.cache: phrase_length \(beta\) must be >= 2"),
        ({"cache": {"pool_size": 0}}, "postuse.cache: pool_size must be >= 1, got 0"),
        ({"reuse_draft": {"phrases": -1}}, "postuse.reuse_draft: phrases must be >= 0"),
        ({"reuse_target": {"anchors": -2}}, "postuse.reuse_target: anchors must be >= 0"),
        ({"precut": {"max_draft_length": 0}}, "postuse.precut: max_draft_length must be >= 1"),
        ({"precut": {"alpha": "fast"}}, "postuse.precut: alpha must be float, got 'fast'"),
        ({"precut": {"alpha": 0.1, "lr": 3}}, r"unknown postuse.precut config keys \['lr'\]"),
        ({"precut": 5}, "postuse: precut must be a dict of its settings or null"),
    ]:
        with pytest.raises((ValueError, TypeError), match=message):
            PostUseConfig(**bad)
    with pytest.raises(ValueError, match="not itself"):
        PostUseDrafter(PostUseConfig(drafter={"method": "postuse"}), tiny_llama)
    with pytest.raises(ValueError, match="cannot wrap hispec: it runs its own verification forward"):
        PostUseDrafter(
            PostUseConfig(drafter="hispec", reuse_draft=None, precut=None),
            make_tiny_model("llama", layers=6),
        )
    with pytest.raises(FileNotFoundError, match="Q-table"):
        config = PostUseConfig(drafter="early-exit:1", precut={"q_table": str(tmp_path / "none.json")})
        PostUseDrafter(config, tiny_llama)


# ---- the whole loop -------------------------------------------------------------------------------------
CONFIGS = {  # max_draft_length is kept small: the default table continues (CONTINUE starts above STOP)
    "all": dict(precut={"max_draft_length": 6}),
    "fixed": dict(reuse_draft=None, reuse_target=None, precut=None, draft_length=4),
    "draft-reuse": dict(reuse_target=None, precut=None, draft_length=6),
    "target-reuse": dict(reuse_draft=None, precut=None, draft_length=2),
    "precut-only": dict(
        reuse_draft=None, reuse_target=None, precut={"warmup_rounds": 2, "max_draft_length": 6}
    ),
    "measured-tree": dict(
        precut={"max_draft_length": 6}, reuse_target={"max_tree_nodes": 0, "auto_tree_max": 9}
    ),
}


def _postuse(kind: str, model, **kw) -> PostUseDrafter:
    if kind == "early-exit":
        return PostUseDrafter(PostUseConfig(drafter="early-exit:2", **kw), model)
    draft = make_tiny_model("llama", seed=5, layers=1)
    inner = DraftModelDrafter(DraftModelConfig(), model, draft_model=draft)
    return PostUseDrafter(PostUseConfig(drafter="draft-model", **kw), model, inner=inner)


def _check_greedy(model, drafter: PostUseDrafter) -> None:
    decoder = SpeculativeDecoder(drafter)
    for seed in (1, 2):  # the cache carries over from the first prompt to the second
        ids = prompt_ids(14, seed=seed)
        ref = model.generate(ids, max_new_tokens=30, do_sample=False)
        out = model.generate(ids, max_new_tokens=30, do_sample=False, custom_generate=decoder)
        assert torch.equal(out, ref), (drafter.config, seed)
    assert drafter.stats.rounds > 0 and drafter.stats.chain_accepted <= drafter.stats.chain_tokens


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_equals_generate_early_exit(tiny_model, name):
    _check_greedy(tiny_model, _postuse("early-exit", tiny_model, **CONFIGS[name]))


@pytest.mark.parametrize("name", ["all", "fixed"])
def test_greedy_equals_generate_draft_model(tiny_llama, name):
    _check_greedy(tiny_llama, _postuse("draft-model", tiny_llama, **CONFIGS[name]))


def test_measured_tree_budget(tiny_llama):
    """`max_tree_nodes: 0`: the first generation times verifications on its own cache (left as it was) and keeps a
    budget in [1, auto_tree_max]; later generations reuse it; grafted trees stay within it."""
    drafter = _postuse(
        "early-exit",
        tiny_llama,
        reuse_target={"max_tree_nodes": 0, "auto_tree_max": 9},
        draft_length=2,
        precut=None,
    )
    ids = prompt_ids(12, seed=4)
    cache = DynamicCache(config=tiny_llama.config)
    tiny_llama(ids[:, :-1], **cache_kwargs(tiny_llama, cache), use_cache=True)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    state = SpecState(
        tiny_llama, cache, ids, GenerationConfig(max_new_tokens=4), backend=target_profile(tiny_llama).backend
    )
    costs = time_verifications(drafter, state, [1, 5, 9], repeats=1)
    assert sorted(costs) == [1, 5, 9] and all(t > 0 for t in costs.values())
    for (k, v), layer in zip(before, cache.layers, strict=True):
        assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
    decoder = SpeculativeDecoder(drafter)
    ref = tiny_llama.generate(ids, max_new_tokens=30, do_sample=False)
    assert torch.equal(
        tiny_llama.generate(ids, max_new_tokens=30, do_sample=False, custom_generate=decoder), ref
    )
    budget, costs = drafter.tree_budget, drafter.verification_costs
    assert 1 <= budget <= 9 and sorted(costs) == [1, 3, 5, 7, 9]
    assert budget == flat_tree_budget(costs, drafter.config.reuse_target.auto_tree_tolerance)
    grafted = drafter._graft_cached(DraftTree.chain([1, 2]), [0, 1, 2], [-1, 0, 1], max_depth=10)
    assert len(grafted) <= max(budget, 2)
    tiny_llama.generate(ids, max_new_tokens=10, do_sample=False, custom_generate=decoder)
    assert drafter.verification_costs is costs  # measured once


def test_measured_budget_falls_back_in_transformers_loop(tiny_llama):
    """transformers' assisted loop verifies chains itself: nothing is measured, the output is still the target's."""
    from hf_spec.integrations import enable_assistant

    ids = prompt_ids(12, seed=9)
    ref = tiny_llama.generate(ids, max_new_tokens=20, do_sample=False)
    config = PostUseConfig(drafter="early-exit:2", reuse_target={"max_tree_nodes": 0}, precut=None)
    decoder = SpeculativeDecoder(config)
    with enable_assistant(tiny_llama, loop="transformers"):
        out = tiny_llama.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=decoder)
    assert torch.equal(out, ref)
    drafter = decoder.drafter_for(tiny_llama)
    assert drafter.tree_budget is None and not drafter.verification_costs


def test_flat_tree_budget_arithmetic():
    assert flat_tree_budget({1: 34.0, 5: 38.0, 9: 42.0, 13: 46.0}, 1.15) == 6  # 1 ms a node on 33 ms
    assert flat_tree_budget({1: 80.0, 4: 80.5, 7: 79.0, 10: 81.0, 13: 80.0}, 1.15) == 13  # flat
    assert flat_tree_budget({1: 80.0, 7: 79.0, 13: 78.0}, 1.0) == 13  # falling: the largest
    assert flat_tree_budget({1: 10.0, 13: 100.0}, 1.1) == 1  # steep: one node
    assert flat_tree_budget({4: 1.0}, 1.1) == 4


def test_reuse_pays_on_repetitive_text(tiny_llama):
    """Generating the same prompt again: the cached phrases are accepted at both sides."""
    decoder = SpeculativeDecoder(_postuse("early-exit", tiny_llama, precut=None, draft_length=3))
    ids = prompt_ids(10, seed=3)
    per_call = []
    for _ in range(2):
        tiny_llama.generate(ids, max_new_tokens=40, do_sample=False, custom_generate=decoder)
        per_call.append(decoder.drafter_for(tiny_llama).counts)
    stats = decoder.drafter_for(tiny_llama).stats
    assert stats.reused_at_draft > 0 and stats.cache_accepted > 0
    # `counts` (what the bench records per prompt) are this generation's share of the running totals
    for key in ("rounds", "chain_tokens", "cache_accepted", "reused_at_draft"):
        assert per_call[0][key] + per_call[1][key] == getattr(stats, key), key
    assert per_call[1]["cache_accepted"] > 0 and per_call[0]["rounds"] > 0


def test_memory_stays_bounded_over_a_long_generation(tiny_llama):
    drafter = _postuse(
        "early-exit",
        tiny_llama,
        cache={"pool_size": 6, "phrases_per_anchor": 3},
        precut={"max_draft_length": 5, "benefit_buckets": 4},
    )  # 3 x 200 tokens
    decoder = SpeculativeDecoder(drafter)
    ids = prompt_ids(10, seed=7)
    sizes = []
    for seed in range(3):
        ids = prompt_ids(10, seed=7 + seed)
        tiny_llama.generate(ids, max_new_tokens=200, do_sample=False, custom_generate=decoder)
        sizes.append((len(drafter.cache), drafter.cache.num_phrases, len(drafter.controller.table)))
    for anchors, phrases, states in sizes:
        assert anchors <= 6 and phrases <= 6 * 3 and states <= (5 + 1) * 4
    assert sizes[-1][0] == 6  # the pool did fill up and evict
    assert drafter.stats.rounds_log is None  # no per-round log unless asked for


@pytest.mark.parametrize("kind", ["early-exit", pytest.param("draft-model", marks=pytest.mark.slow)])
def test_sampling_matches_plain_sampling(kind):
    target = make_tiny_model("llama", seed=11, vocab_size=V, layers=3, temperature=2.0)
    if kind == "early-exit":
        drafter = PostUseDrafter(
            PostUseConfig(drafter="early-exit:2", precut={"max_draft_length": 3}), target
        )
    else:
        draft = make_tiny_model("llama", seed=12, vocab_size=V, layers=1, temperature=2.0)
        inner = DraftModelDrafter(DraftModelConfig(), target, draft_model=draft)
        drafter = PostUseDrafter(
            PostUseConfig(drafter="draft-model", precut={"max_draft_length": 3}), target, inner=inner
        )
    n = 600
    pvalues, _ = sampled_marginals_pvalues(target, lambda: SpeculativeDecoder(drafter), n=n, seed=2025)
    stats = drafter.stats
    # drafts and cached branches both land (the tiny drafters agree rarely)
    assert stats.chain_accepted > 0 and stats.cache_accepted > 0
    assert stats.chain_accepted + stats.cache_accepted > 0.1 * n
    assert min(pvalues) > 1e-3, pvalues


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_train_postuse_cli_writes_a_table(tmp_path, capsys, dtype, keep_threads):
    """`hf-spec train postuse` on the real stories260K: learning on, in the dtype asked for, a loadable table."""
    from hf_spec.cli.main import main
    from tests.conftest import STORIES

    config = PostUseConfig(drafter="early-exit:3", precut={"max_draft_length": 4, "warmup_rounds": 2})
    config.save_pretrained(tmp_path / "cfg")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "\n".join(json.dumps({"turns": [t]}) for t in ["Once upon a time", "Lily and Tom went"])
    )
    out = tmp_path / "q.json"
    argv = [
        "train",
        "postuse",
        "--target",
        str(STORIES),
        "--config",
        str(tmp_path / "cfg"),
        "--prompts",
        str(prompts),
    ]
    assert main([*argv, "--max-new-tokens", "24", "--threads", "1", "--dtype", dtype, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"wrote {out}" in text and json.loads(text[: text.index("wrote")])["rounds"] > 0
    learned = PreCutController(max_calls=4, benefit_buckets=config.precut.benefit_buckets)
    learned.load(out)
    assert learned.updates > 0 and learned.table and learned.target_cost > 0


def test_discount_biases_towards_continuing_with_negative_rewards():
    """Stopping after 1, 2 or 3 calls earns the same r = -0.9: gamma < 1 still makes CONTINUE look better (the
    over-drafting bias documented in controller.py); gamma = 1 leaves the choice a tie."""
    states, rewards = [(1, 0), (2, 0), (3, 0)], [-0.9, -0.9, -0.9]
    for gamma, biased in ((0.99, True), (1.0, False)):
        ctrl = PreCutController(
            max_calls=3, benefit_buckets=1, gamma=gamma, init_continue=-0.9, init_stop=-0.9
        )
        for _ in range(200):
            ctrl.update(states, rewards)
        q_cont, q_stop = ctrl.value((1, 0))
        assert (q_cont - q_stop > 1e-3) is biased
        assert q_cont == pytest.approx(-0.9 * gamma**2, abs=1e-6) and q_stop == pytest.approx(-0.9, abs=1e-6)
