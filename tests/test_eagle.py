"""EAGLE/HASS heads on tiny random targets: shapes, losses and masks against plain references, training,
save/load (incl. trust_remote_code and custom_generate), mismatch errors, lossless decoding."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModel, DynamicCache, GenerationConfig

from hf_spec import SpeculativeDecoder
from hf_spec.core.drafter import SpecState
from hf_spec.core.specs import HEAD_IN_THIS_FOLDER
from hf_spec.engine.target.profile import target_profile
from hf_spec.heads.hub import save_head_folder
from hf_spec.io.integrity import MARK
from hf_spec.methods.eagle import EagleConfig, EagleDrafter
from hf_spec.methods.eagle.drafter import load_head
from hf_spec.methods.eagle.modeling import EagleHeadConfig, EagleHeadModel
from hf_spec.methods.postuse import PostUseConfig, PostUseDrafter
from hf_spec.training.eagle import EagleTrainConfig, train_eagle
from hf_spec.training.features import FeatureStore, capture_features
from hf_spec.training.losses import alignment_mask, topk_loss
from hf_spec.training.responses import Conversation
from hf_spec.tree.masks import causal_mask
from tests.conftest import (
    CACHE,
    OUTPUT_CACHE,
    assert_equal_up_to_ties,
    make_tiny_model,
    prompt_ids,
    run_in_bfloat16,
)


def random_head(model, vocab: int = 64) -> EagleHeadModel:
    torch.manual_seed(0)
    head = EagleHeadModel(EagleHeadConfig.for_target(model, vocab))
    head.d2t.copy_(torch.arange(vocab) + (model.config.vocab_size - vocab))
    return head.attach_target(model).eval()


def tiny_conversations(model, count: int = 24, new: int = 40) -> list[Conversation]:
    convs = []
    for seed in range(count):
        ids = prompt_ids(10, seed=100 + seed)
        out = model.generate(ids, max_new_tokens=new, do_sample=False)
        convs.append(Conversation(f"c{seed}", ids[0].tolist(), out[0, ids.shape[1] :].tolist()))
    return convs


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def trained(request, tmp_path_factory):
    """A head trained briefly on the tiny target's own greedy outputs: `(model, head, report, folder)`."""
    model = make_tiny_model(request.param, temperature=16.0)  # peaked: a head can learn it
    folder = tmp_path_factory.mktemp(f"eagle-{request.param}")
    store = capture_features(model, tiny_conversations(model), folder / "data", topk=8, progress=False)
    cfg = EagleTrainConfig(
        align_steps=2, topk=4, draft_vocab=80, epochs=12, lr=2e-3, batch_tokens=512, heldout=2
    )
    head, report = train_eagle(model, store.load_sequences(), folder / "run", cfg, progress=False)
    save_head_folder(head, folder / "head", EagleConfig(head=HEAD_IN_THIS_FOLDER, depth=4, topk=3), "card")
    return model, head, report, folder


def test_features_reproduce_target_logits(tmp_path):
    model = make_tiny_model("llama")
    store = capture_features(model, tiny_conversations(model, count=2), tmp_path, topk=5, progress=False)
    seq = FeatureStore.open(tmp_path / "features").load_sequences()[0]
    assert store.num_tokens == len(seq["input_ids"]) + len(
        FeatureStore.open(tmp_path / "features").load_sequences()[1]["input_ids"]
    )
    logits = model.lm_head(model.model.norm(seq["features"].float()))
    ref = model(input_ids=seq["input_ids"][None].long()).logits[0]
    assert torch.allclose(logits, ref, atol=0.05)  # features are stored in bf16
    assert torch.equal(seq["topk_ids"][:, 0].long(), ref.argmax(-1))


def test_alignment_mask_matches_decoding_simulation():
    """Step j of the masked parallel forward equals drafting j steps after position i - j, one at a time."""
    model = make_tiny_model("llama")
    head = random_head(model)
    n, steps = 9, 3
    torch.manual_seed(3)
    f_in = torch.randn(1, n, model.config.hidden_size)
    ids = torch.randint(3, 96, (1, n))
    pos = torch.arange(1, n + 1)[None]
    cache, f, outs = DynamicCache(), f_in, []
    with torch.no_grad():
        for j in range(1, steps + 1):
            h = head(f, ids, pos, alignment_mask(n, j)[None, None], cache)
            outs.append(h)
            f = torch.cat([f_in[:, :1], h[:, :-1]], dim=1)
        for j in range(1, steps + 1):
            for i in range(j - 1, n):
                sim = DynamicCache()
                last = i - j + 1  # the first drafted index; 0..last-1 are committed
                if last > 0:
                    causal = torch.zeros(last, last).masked_fill(
                        ~torch.ones(last, last, dtype=torch.bool).tril(), -1e30
                    )
                    head(f_in[:, :last], ids[:, :last], pos[:, :last], causal[None, None], sim)
                feat = f_in[:, last : last + 1]
                for k in range(last, i + 1):
                    feat = head(feat, ids[:, k : k + 1], pos[:, k : k + 1], None, sim)
                assert torch.allclose(feat[0, 0], outs[j - 1][0, i], atol=1e-4), (i, j)


def test_topk_loss_matches_loop():
    torch.manual_seed(0)
    logp = torch.log_softmax(torch.randn(2, 3, 7), -1)
    ids = torch.randint(-1, 7, (2, 3, 4))
    logq = torch.log_softmax(torch.randn(2, 3, 10), -1)[..., :4]
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    total = 0.0
    for b in range(2):
        for t in range(3):
            if mask[b, t]:
                total += -sum(
                    float(logq[b, t, k].exp() * logp[b, t, ids[b, t, k]])
                    for k in range(3)
                    if ids[b, t, k] >= 0
                )
    assert float(topk_loss(logp, ids, logq, mask, k=3)) == pytest.approx(total / float(mask.sum()), rel=1e-5)


def test_training_lowers_loss_and_learns(trained):
    _, _, report, _ = trained
    assert report["final_loss"] < 0.75 * report["first_loss"]
    assert report["heldout"]["accuracy_by_depth"][0] > 0.1  # chance: 1/80


def test_saved_folder_round_trip(trained):
    model, head, _, folder = trained
    path = folder / "head"
    config = json.loads((path / "config.json").read_text())
    assert config["auto_map"]["AutoModel"] == "modeling_hf_spec.EagleHeadModel"
    assert config["target"]["vocab_size"] == model.config.vocab_size
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
        assert not any("embed" in k or "lm_head" in k for k in f.keys())  # the target's parts are not stored
    loaded = load_head(str(path), model)
    assert torch.equal(loaded.d2t, head.d2t)
    for _ in range(3):  # non-persistent rotary buffers are recomputed on every load, never left as raw memory
        again = load_head(str(path), model)
        assert torch.equal(again.rotary_emb.inv_freq, head.rotary_emb.inv_freq)
        assert torch.equal(again.rotary_emb.original_inv_freq, head.rotary_emb.original_inv_freq)
    x = torch.randn(1, 5, model.config.hidden_size)
    ids, pos = torch.randint(3, 96, (1, 5)), torch.arange(1, 6)[None]
    mask = alignment_mask(5, 1)[None, None]
    with torch.no_grad():
        assert torch.allclose(loaded(x, ids, pos, mask), head(x, ids, pos, mask), atol=0.05)
    remote = AutoModel.from_pretrained(path, trust_remote_code=True)
    assert type(remote).__name__ == "EagleHeadModel"


def test_head_refuses_another_target(trained):
    model, _, _, folder = trained
    other = make_tiny_model(model.config.model_type, seed=9, temperature=16.0)
    with pytest.raises(ValueError, match="trained for"):
        load_head(str(folder / "head"), other)


def test_corrupt_or_missing_head_is_a_clear_error(tmp_path, trained):
    model, _, _, folder = trained
    with pytest.raises(ValueError, match="cannot load the eagle head"):
        load_head(str(tmp_path / "nothing"), model)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((folder / "head" / "config.json").read_text())
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    # the copied config.json says hf-spec wrote the folder with a checksum list: the incomplete copy is refused by name
    with pytest.raises(ValueError, match="the eagle head at .*bad.*hf_spec_checksums.json is missing"):
        load_head(str(bad), model)
    # a folder without hf-spec's mark (as saved before checksum lists) is read; a damaged one is refused by name
    config = json.loads((folder / "head" / "config.json").read_text())
    config.pop(MARK, None)
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="cannot load the eagle head at .*bad"):
        load_head(str(bad), model)
    # a checkpoint lacking a tensor would load with random weights: refused
    from safetensors.torch import load_file, save_file

    weights = load_file(str(folder / "head" / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if k != "fc.weight"}, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks weights \['fc.weight'\]"):
        load_head(str(bad), model)
    (bad / "config.json").write_text(json.dumps({"model_type": "hf_spec_lyanna"}))
    with pytest.raises(ValueError, match="holds a 'hf_spec_lyanna' model, not a eagle head"):
        load_head(str(bad), model)
    (bad / "config.json").write_text("{oops")
    with pytest.raises(ValueError, match="bad config.json"):
        load_head(str(bad), model)
    # the head folder's own recipe ("head": ".") names that folder wherever the command runs
    recipe = folder / "head" / "hf_spec_config.json"
    assert EagleConfig.from_cli_arg(str(recipe)).head == os.path.abspath(folder / "head")


@pytest.mark.parametrize("seed,quantize", [(1, ""), (2, ""), (1, "int8"), (2, "int4")])
def test_greedy_equals_generate_and_accepts(trained, seed, quantize):
    model, head, _, _ = trained
    config = EagleConfig(depth=4, topk=3, total_tokens=10, quantize=quantize)
    drafter = EagleDrafter(config, model, head=head)
    dec = SpeculativeDecoder(drafter)
    ids = prompt_ids(12, seed=seed)
    ref = model.generate(ids, max_new_tokens=48, do_sample=False)
    out = model.generate(ids, max_new_tokens=48, do_sample=False, custom_generate=dec)
    assert torch.equal(out, ref)
    assert dec.last_stats.accepted_tokens > 0  # the trained head's drafts are really accepted
    assert bool(drafter.quantized) == bool(quantize) and (drafter.lm_quantized is None) == (not quantize)
    assert all("forward" not in m.__dict__ for m in head.modules())  # the shared head is left as it was


def test_head_layer_runs_hf_specs_attention(trained, attention_calls):
    """The head's decoder layer attends through hf-spec's attention while drafting (its tree levels are few rows
    against every cached position), its config reads `sdpa` again afterwards, and the output is `generate`'s."""
    model, head, _, _ = trained
    dec = SpeculativeDecoder(EagleDrafter(EagleConfig(depth=4, topk=3, total_tokens=10), model, head=head))
    ids = prompt_ids(12, seed=3)
    ref = model.generate(ids, max_new_tokens=32, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=32, do_sample=False, custom_generate=dec), ref)
    head_rows = [rows for module, rows in attention_calls if module is head.layer.self_attn]
    assert head_rows and max(head_rows) >= 2 and head.layer.self_attn.config._attn_implementation == "sdpa"


def test_one_token_prompt_drafts_from_the_second_round(trained):
    """Nothing is prefilled before a one-token prompt: the head sits out the first round (plain and wrapped)."""
    model, head, _, _ = trained
    ids = prompt_ids(1, seed=3)
    ref = model.generate(ids, max_new_tokens=20, do_sample=False)
    for drafter in (
        EagleDrafter(EagleConfig(depth=3, topk=2), model, head=head),
        PostUseDrafter(
            PostUseConfig(drafter="eagle"), model, inner=EagleDrafter(EagleConfig(), model, head=head)
        ),
    ):
        dec = SpeculativeDecoder(drafter)
        assert torch.equal(model.generate(ids, max_new_tokens=20, do_sample=False, custom_generate=dec), ref)
        assert dec.last_stats.draft_tokens > 0  # it drafted after the first round


def test_vocab_limit_drafts_frequent_rows_only(trained):
    model, head, _, _ = trained
    drafter = EagleDrafter(EagleConfig(depth=3, topk=2, total_tokens=6, vocab_limit=20), model, head=head)
    drafted: list[int] = []
    propose = drafter.propose

    def recording_propose(state, max_depth):
        tree = propose(state, max_depth)
        drafted.extend(tree.tokens.tolist())
        return tree

    drafter.propose = recording_propose
    dec = SpeculativeDecoder(drafter)
    ids = prompt_ids(12, seed=3)
    ref = model.generate(ids, max_new_tokens=32, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=32, do_sample=False, custom_generate=dec), ref)
    assert drafted and set(drafted) <= set(head.d2t[:20].tolist())
    assert head.parts.lm_weight.shape[0] == head.config.draft_vocab_size  # the shared head is untouched
    with pytest.raises(ValueError, match="vocab_limit 10000 exceeds"):
        EagleDrafter(EagleConfig(vocab_limit=10_000), model, head=head)


def _head_state(model, ids: torch.Tensor) -> SpecState:
    """The loop's state after the prefill of `ids[:, :-1]` (target cache + last-layer hidden states)."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(input_ids=ids[:, :-1], **{CACHE: cache}, use_cache=True, output_hidden_states=True)
    return SpecState(
        model,
        cache,
        ids,
        GenerationConfig(),
        hidden_states=out.hidden_states[-1],
        backend=target_profile(model).backend,
    )


def test_draft_step_branches_equal_chain_steps(trained):
    """Step-wise drafting (Post-use): a branch fed level by level behind the chain gives the logits of feeding
    its tokens one call at a time as the chain; the first chain row is `propose`'s first level."""
    model, head, _, _ = trained
    ids = prompt_ids(12, seed=6)
    root, branches = int(ids[0, -1]), [[7, 8, 9], [10], [7, 11]]

    def stepper() -> tuple[EagleDrafter, SpecState]:
        drafter = EagleDrafter(EagleConfig(), model, head=head)
        state = _head_state(model, ids)
        drafter.begin(state)
        assert drafter.draft_start(state)
        return drafter, state

    drafter, state = stepper()
    step = drafter.draft_step([root], branches)
    first = torch.log_softmax(step.chain, -1)[head.d2t]
    with torch.no_grad():
        ref_drafter, ref_state = EagleDrafter(EagleConfig(), model, head=head), _head_state(model, ids)
        ref_drafter.begin(ref_state)
        h_root = ref_drafter.catch_up(ref_state, head)
        torch.testing.assert_close(first, ref_drafter._logp(h_root[None])[0], atol=1e-4, rtol=1e-4)
    assert torch.isinf(step.chain[~torch.isin(torch.arange(step.chain.shape[0]), head.d2t)]).all()
    for b, branch in enumerate(branches):
        ref, ref_state = stepper()
        rows = [ref.draft_step([root] if j == 0 else [branch[j - 1]]).chain for j in range(len(branch) + 1)]
        torch.testing.assert_close(step.branches[b], torch.stack(rows[1:]), atol=1e-4, rtol=1e-4)
        ref.draft_stop(ref_state)
    # keep 2 tokens of branch 2, then one more step: as if [7, 11] had been fed as chain tokens
    drafter.draft_keep(2, 2, [7, 11])
    step = drafter.draft_step([4], [[5, 6]])
    ref, ref_state = stepper()
    rows = [ref.draft_step([t]).chain for t in (root, 7, 11, 4, 5, 6)]
    torch.testing.assert_close(step.chain, rows[3], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(step.branches[0], torch.stack(rows[4:]), atol=1e-4, rtol=1e-4)
    committed = ids.shape[1] - 1  # head positions 1..root
    drafter.draft_stop(state)
    assert drafter.cache.get_seq_length() == committed


def test_head_drafts_after_a_cached_prefix_and_across_turns(trained):
    """With `past_key_values` the head has no features of the cached positions: it starts after them, still
    drafting what gets accepted, and a second turn continues the first turn's returned cache."""
    model, head, _, _ = trained
    ids = prompt_ids(16, seed=1)
    ref = model.generate(ids, max_new_tokens=40, do_sample=False)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :8], **{CACHE: cache})
    dec = SpeculativeDecoder(EagleDrafter(EagleConfig(depth=4, topk=3, total_tokens=10), model, head=head))
    first = model.generate(
        ids, **{CACHE: cache}, max_new_tokens=40, do_sample=False, custom_generate=dec,
        return_dict_in_generate=True,
    )  # fmt: skip
    assert torch.equal(first.sequences, ref)
    assert dec.last_stats.accepted_tokens > 0
    turn2 = torch.cat([first.sequences, prompt_ids(6, seed=9)], dim=1)
    out = model.generate(
        turn2,
        **{CACHE: getattr(first, OUTPUT_CACHE)},
        max_new_tokens=30,
        do_sample=False,
        custom_generate=dec,
    )
    assert torch.equal(out, model.generate(turn2, max_new_tokens=30, do_sample=False))
    assert dec.last_stats.accepted_tokens > 0


def test_max_catch_up_feeds_the_latest_positions_only(trained):
    """`max_catch_up`: of a long prompt the head feeds only the latest positions; its drafts still get accepted
    and the output is `generate`'s."""
    model, head, _, _ = trained
    ids = prompt_ids(20, seed=2)
    ref = model.generate(ids, max_new_tokens=40, do_sample=False)
    drafter = EagleDrafter(EagleConfig(depth=4, topk=3, total_tokens=10, max_catch_up=4), model, head=head)
    fed: list[int] = []
    catch_up_rows = drafter.catch_up_rows

    def spy(state):
        rows = catch_up_rows(state)
        fed.append(rows[0].shape[1])
        return rows

    drafter.catch_up_rows = spy
    dec = SpeculativeDecoder(drafter)
    assert torch.equal(model.generate(ids, max_new_tokens=40, do_sample=False, custom_generate=dec), ref)
    assert fed[0] == 4 and max(fed) <= 4 and dec.last_stats.accepted_tokens > 0
    with pytest.raises(ValueError, match="max_catch_up must be >= 0"):
        EagleConfig(max_catch_up=-1)


def test_draft_steps_keep_absolute_positions_after_a_capped_catch_up(trained):
    """Step-wise drafting after a catch-up that left positions out (`max_catch_up`, or a cached prefix) feeds its
    tokens at their absolute positions: the chain row equals the head run by hand at the next position."""
    model, head, _, _ = trained
    ids = prompt_ids(16, seed=4)
    drafter, state = EagleDrafter(EagleConfig(max_catch_up=5), model, head=head), _head_state(model, ids)
    drafter.begin(state)
    assert drafter.draft_start(state) and drafter.skipped == ids.shape[1] - 1 - 5
    step = drafter.draft_step([int(ids[0, -1]), 7])
    ref, ref_state = EagleDrafter(EagleConfig(max_catch_up=5), model, head=head), _head_state(model, ids)
    ref.begin(ref_state)
    with torch.no_grad():
        h_root = ref.catch_up(ref_state, head)
        position = torch.tensor([[ids.shape[1]]])  # the root sits at ids.shape[1] - 1
        h = head(h_root.view(1, 1, -1), torch.tensor([[7]]), position, causal_mask(1, 5), ref.cache)[0, -1]
        torch.testing.assert_close(step.chain, ref._full_logits(h[None])[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["all", "precut-only"])
def test_postuse_around_a_head_equals_generate(trained, name):
    """Post-use & Pre-cut wrap an EAGLE head step-wise (drafter-side reuse, Pre-cut) and at the target."""
    model, head, _, _ = trained
    kw = {
        "all": dict(precut={"max_draft_length": 6, "warmup_rounds": 2}),
        "precut-only": dict(reuse_draft=None, reuse_target=None, precut={"warmup_rounds": 2}),
    }[name]
    inner = EagleDrafter(EagleConfig(), model, head=head)
    drafter = PostUseDrafter(PostUseConfig(drafter="eagle", **kw), model, inner=inner)
    dec = SpeculativeDecoder(drafter)
    for seed in (1, 2):
        ids = prompt_ids(12, seed=seed)
        ref = model.generate(ids, max_new_tokens=40, do_sample=False)
        assert torch.equal(model.generate(ids, max_new_tokens=40, do_sample=False, custom_generate=dec), ref)
    assert drafter.stats.chain_accepted > 0 and drafter.stats.draft_calls > 0


def test_custom_generate_folder(trained):
    model, _, _, folder = trained
    ids = prompt_ids(12, seed=4)
    ref = model.generate(ids, max_new_tokens=24, do_sample=False)
    out = model.generate(
        ids, max_new_tokens=24, do_sample=False, custom_generate=str(folder / "head"), trust_remote_code=True
    )
    assert torch.equal(out, ref)
    assert EagleConfig.from_cli_arg(str(folder / "head")).head == str(folder / "head")


@pytest.mark.parametrize("do_sample", [False, True])
def test_transformers_assisted_loop_with_hidden_states(trained, do_sample):
    """The head drafts chains inside transformers' own assisted loop, fed through requires_model_outputs."""
    from hf_spec.integrations import enable_assistant

    model, head, _, _ = trained
    ids = prompt_ids(12, seed=5)
    dec = SpeculativeDecoder(EagleDrafter(EagleConfig(depth=4, topk=3, total_tokens=10), model, head=head))
    kw = dict(max_new_tokens=30, do_sample=do_sample, top_k=0)
    torch.manual_seed(0)
    ref = model.generate(ids, **kw)
    with enable_assistant(model, loop="transformers"):
        torch.manual_seed(0)
        out = model.generate(ids, assistant_model=dec, **kw)
    if do_sample:  # a sampled run may stop at another EOS; the distribution is tested by chi-square below
        assert ids.shape[1] < out.shape[1] <= ref.shape[1] + 30 and torch.equal(out[:, : ids.shape[1]], ids)
    else:
        assert torch.equal(out, ref)


@pytest.mark.parametrize("loop", ["hf-spec", "batched", "transformers"])
def test_sampling_keeps_target_distribution(loop):
    """Chi-square of per-position token counts vs the target's exact marginals (tiny vocabulary), both loops."""
    from tests.stats import sampled_marginals_pvalues
    from tests.test_sampling import V

    target = make_tiny_model("llama", seed=11, vocab_size=V, layers=2, temperature=2.0)
    torch.manual_seed(0)
    head = EagleHeadModel(EagleHeadConfig.for_target(target, V)).attach_target(target).eval()
    head.init_layer_from(target)
    cfg = EagleConfig(depth=3, topk=2, total_tokens=5)
    pvalues, accepted = sampled_marginals_pvalues(
        target, lambda: SpeculativeDecoder(EagleDrafter(cfg, target, head=head)), loop
    )
    assert loop == "transformers" or accepted > 200
    assert min(pvalues) > 1e-3, pvalues


def test_head_runs_in_a_bfloat16_target(trained):
    """A bfloat16 target loads its head in bfloat16 (features, masks and head agree on the dtype); greedy output
    equals the bfloat16 target's own `generate` up to bfloat16 ties (forwards of other shapes round otherwise)."""
    model, _, _, folder = trained
    target, dec = run_in_bfloat16(model, f"eagle:{folder / 'head'}")
    assert next(dec.drafter_for(target).head.parameters()).dtype == torch.bfloat16
    assert dec.last_stats.accepted_tokens > 0


def test_padded_batch_verified_together_equals_generate(trained):
    """Three left-padded rows, one head copy each, every round's trees verified in one forward."""
    from tests.test_rows import PAD, batch_of_three

    model, head, _, _ = trained
    ids, mask = batch_of_three()
    kwargs = dict(attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=PAD)
    dec = SpeculativeDecoder(EagleDrafter(EagleConfig(depth=4, topk=3, total_tokens=10), model, head=head))
    assert torch.equal(model.generate(ids, **kwargs, custom_generate=dec), model.generate(ids, **kwargs))
    assert dec.last_stats.accepted_tokens > 0 and dec.batches == "auto"


def test_batch_with_a_one_token_row(trained):
    """A one-token row has nothing prefilled: its head copy sits out the first round while the others draft."""
    from tests.test_rows import PAD, left_padded

    model, head, _, _ = trained
    ids, mask = left_padded(prompt_ids(1, seed=3), prompt_ids(9, seed=4))
    kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=PAD)
    dec = SpeculativeDecoder(EagleDrafter(EagleConfig(depth=3, topk=2), model, head=head), batches="batched")
    assert torch.equal(model.generate(ids, **kwargs, custom_generate=dec), model.generate(ids, **kwargs))
    assert dec.last_stats.draft_tokens > 0


def test_a_float32_head_drafts_in_a_bfloat16_targets_precision():
    """A head passed in as a module is cast to the target's dtype, as a head loaded from a folder is (on a GPU,
    a float32 head's logits against the target's bfloat16 LM head would fail in the matmul)."""
    target = make_tiny_model("llama").to(torch.bfloat16)
    head = random_head(make_tiny_model("llama"))
    drafter = EagleDrafter(EagleConfig(depth=3, topk=2, total_tokens=6), target, head=head)
    assert drafter.dtype is torch.bfloat16 and next(drafter.head.parameters()).dtype is torch.bfloat16
    ids = prompt_ids(12, seed=4)
    ref = target.generate(ids, max_new_tokens=20, do_sample=False)
    out = target.generate(
        ids, max_new_tokens=20, do_sample=False, custom_generate=SpeculativeDecoder(drafter)
    )
    assert_equal_up_to_ties(
        target, ids, out, ref
    )  # bfloat16: a tree forward rounds as a one-token one may not
