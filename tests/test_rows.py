"""Batched prompts through `SpeculativeDecoder`: row by row, laid out as transformers' own batch."""

from __future__ import annotations

import pytest
import torch
from transformers import pipeline

from hf_spec import SpeculativeDecoder
from hf_spec.engine.outputs import combine_stats
from hf_spec.engine.rows import left_padding
from tests.conftest import OUTPUT_CACHE, assert_equal_up_to_ties, prompt_ids
from tests.test_generate import Collect

PAD = 0


def left_padded(*rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(1, n_i)` prompts -> left-padded `input_ids` and `attention_mask` `(batch, max n_i)`."""
    width = max(r.shape[1] for r in rows)
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - r.shape[1] :] = r[0]
        mask[i, width - r.shape[1] :] = 1
    return ids, mask


def batch_of_three() -> tuple[torch.Tensor, torch.Tensor]:
    return left_padded(prompt_ids(12, seed=1), prompt_ids(5, seed=2), prompt_ids(9, seed=3))


@pytest.mark.parametrize(
    ("spec", "batches"),
    [
        ("pld", "batched"),
        ("pld", "rows"),
        ("retrieval", "batched"),
        ("oracle:8", "auto"),
        ("early-exit:2", "auto"),
    ],
)
def test_padded_batch_equals_batched_generate(tiny_model, spec, batches):
    ids, mask = batch_of_three()
    free = tiny_model.generate(ids[1:2, 7:], max_new_tokens=30, do_sample=False)[0, 5:].tolist()
    eos = free[next(i for i in range(3, 30) if free[i] not in free[:i])]  # row 1 stops mid-way
    kwargs = dict(
        attention_mask=mask, max_new_tokens=30, do_sample=False, eos_token_id=eos, pad_token_id=PAD,
        min_new_tokens=2, repetition_penalty=1.3,
    )  # fmt: skip
    ref = tiny_model.generate(ids, **kwargs)
    dec = SpeculativeDecoder(spec, batches=batches)
    out = tiny_model.generate(ids, **kwargs, custom_generate=dec)
    assert torch.equal(out, ref)
    assert (out[1] == PAD).sum() > (ids[1] == PAD).sum()  # the row that stopped early is padded after its EOS
    new = [r[ids.shape[1] :].tolist() for r in out]
    assert dec.last_stats.new_tokens == sum(n.index(eos) + 1 if eos in n else len(n) for n in new)


def test_batched_verification_refuses_drafters_sharing_the_target(tiny_llama):
    ids, mask = batch_of_three()
    with pytest.raises(ValueError, match="early-exit cannot draft for a batch verified in one forward"):
        tiny_llama.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=4,
            custom_generate=SpeculativeDecoder("early-exit:2", batches="batched"),
        )


@pytest.mark.parametrize("batches", ["batched", "rows"])
def test_rows_see_their_own_length_based_processors(tiny_llama, batches):
    """min_new_tokens and max_length count the padded batch's positions, as in transformers."""
    ids, mask = batch_of_three()
    kwargs = dict(attention_mask=mask, max_new_tokens=9, min_new_tokens=9, do_sample=False, pad_token_id=PAD)
    ref = tiny_llama.generate(ids, eos_token_id=list(range(3, 60)), **kwargs)
    out = tiny_llama.generate(
        ids,
        eos_token_id=list(range(3, 60)),
        custom_generate=SpeculativeDecoder("pld", batches=batches),
        **kwargs,
    )
    assert torch.equal(out, ref) and out.shape[1] == ids.shape[1] + 9


def test_prefix_allowed_tokens_fn_gets_each_rows_batch_index(tiny_llama):
    ids, mask = batch_of_three()
    seen: set[int] = set()

    def allowed(batch_id: int, sent: torch.Tensor) -> list[int]:
        seen.add(batch_id)
        return list(range(10 + 20 * batch_id, 30 + 20 * batch_id))

    kwargs = dict(
        attention_mask=mask,
        max_new_tokens=8,
        do_sample=False,
        pad_token_id=PAD,
        prefix_allowed_tokens_fn=allowed,
    )
    ref = tiny_llama.generate(ids, **kwargs)
    seen.clear()
    out = tiny_llama.generate(ids, **kwargs, custom_generate=SpeculativeDecoder("pld"))
    assert torch.equal(out, ref) and seen == {0, 1, 2}


@pytest.mark.parametrize("spec", ["oracle:4", "pld"])  # row by row, verified together
def test_batch_dict_output_fills_finished_rows(tiny_llama, spec):
    ids, mask = batch_of_three()
    free = tiny_llama.generate(ids[1:2, 7:], max_new_tokens=12, do_sample=False)[0, 5:].tolist()
    eos = free[3] if free[3] not in free[:3] else free[0]
    kwargs = dict(
        attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=PAD,
        return_dict_in_generate=True, output_scores=True, output_logits=True,
    )  # fmt: skip
    ref = tiny_llama.generate(ids, **kwargs)
    out = tiny_llama.generate(ids, **kwargs, custom_generate=SpeculativeDecoder(spec))
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores) == len(out.logits) == out.sequences.shape[1] - ids.shape[1]
    for t, (got, want) in enumerate(zip(out.scores, ref.scores, strict=True)):
        live = [r for r in range(3) if t == 0 or out.sequences[r, ids.shape[1] + t - 1] != eos]
        live = [r for r in live if eos not in out.sequences[r, ids.shape[1] : ids.shape[1] + t].tolist()]
        torch.testing.assert_close(got[live], want[live], rtol=1e-4, atol=1e-4)
        for r in set(range(3)) - set(live):  # after its EOS a row holds padding with log-probability 0
            assert got[r, PAD] == 0 and torch.isinf(got[r]).sum() == got.shape[1] - 1
    assert getattr(out, OUTPUT_CACHE) is None and out.spec_stats["new_tokens"] > 0


def test_num_return_sequences_samples_each_copy(tiny_llama):
    ids = prompt_ids(8, seed=4)
    out = tiny_llama.generate(
        ids, max_new_tokens=10, do_sample=True, num_return_sequences=4, pad_token_id=PAD,
        custom_generate=SpeculativeDecoder("pld", seed=0),
    )  # fmt: skip
    assert out.shape == (4, 18) and torch.equal(out[:, :8], ids.expand(4, -1))
    assert len({tuple(r.tolist()) for r in out}) > 1  # independent samples, not one copied
    greedy = tiny_llama.generate(ids, max_new_tokens=10, do_sample=False)
    top1 = tiny_llama.generate(
        ids, max_new_tokens=10, do_sample=True, top_k=1, num_return_sequences=3, pad_token_id=PAD,
        custom_generate=SpeculativeDecoder("pld", seed=0),
    )  # fmt: skip
    assert torch.equal(top1, greedy.expand(3, -1))


def test_pipeline_batches(stories):
    model, tok = stories
    tok.pad_token = tok.pad_token or tok.unk_token or tok.eos_token
    tok.padding_side = "left"
    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    prompts = ["Once upon a time", "The cat sat on the mat and", "Lily"]
    ref = pipe(prompts, max_new_tokens=20, do_sample=False, batch_size=3)
    out = pipe(
        prompts, max_new_tokens=20, do_sample=False, batch_size=3, custom_generate=SpeculativeDecoder("pld")
    )
    assert out == ref


def test_bad_batches_raise(tiny_llama):
    ids, mask = batch_of_three()
    right = mask.flip(1)
    with pytest.raises(ValueError, match="row 1 of the batch is not left-padded"):
        tiny_llama.generate(
            ids, attention_mask=right, max_new_tokens=4, custom_generate=SpeculativeDecoder("pld")
        )
    empty = mask.clone()
    empty[1] = 0
    with pytest.raises(ValueError, match="row 1 of the batch is all padding"):
        left_padding(ids, empty)
    with pytest.raises(ValueError, match="a streamer takes one sequence"):
        tiny_llama.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=4,
            streamer=Collect(),
            custom_generate=SpeculativeDecoder("pld"),
        )
    with pytest.raises(ValueError, match="guidance_scale"):
        tiny_llama.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=4,
            guidance_scale=1.5,
            custom_generate=SpeculativeDecoder("pld"),
        )


def test_combined_stats_sum_the_rows(tiny_llama):
    ids, mask = batch_of_three()
    dec = SpeculativeDecoder("oracle:4")
    tiny_llama.generate(
        ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=PAD, custom_generate=dec
    )
    whole = dec.last_stats
    parts = []
    for r in range(3):
        row = ids[r : r + 1, int((mask[r] == 0).sum()) :]
        tiny_llama.generate(row, max_new_tokens=10, do_sample=False, pad_token_id=PAD, custom_generate=dec)
        parts.append(dec.last_stats)
    again = combine_stats(parts)
    assert (whole.new_tokens, whole.target_forwards, whole.depth_tries) == (
        again.new_tokens, again.target_forwards, again.depth_tries
    )  # fmt: skip


def test_plain_batches_hand_the_batch_to_transformers(tiny_llama):
    ids, mask = batch_of_three()
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=PAD)
    dec = SpeculativeDecoder("pld", batches="plain")
    assert torch.equal(
        tiny_llama.generate(ids, **kwargs, custom_generate=dec), tiny_llama.generate(ids, **kwargs)
    )
    assert dec.last_stats is None
    one = prompt_ids(8)  # a single unpadded prompt still speculates
    tiny_llama.generate(one, max_new_tokens=10, do_sample=False, custom_generate=dec)
    assert dec.last_stats.target_forwards > 0
    with pytest.raises(ValueError, match="batches must be 'auto', 'batched', 'rows' or 'plain'"):
        SpeculativeDecoder("pld", batches="loop")


def test_plain_bfloat16_batches_run_hf_specs_attention_and_match_generate(tiny_llama, attention_calls):
    """In bfloat16 plain batches go through hf-spec's attention: the short padded prefill takes the grouped product,
    whose padding queries see no key and must not turn NaN (as they did with -inf masks) and spread to the rows."""
    import copy

    target = copy.deepcopy(tiny_llama).to(torch.bfloat16)
    ids, mask = batch_of_three()
    kwargs = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=PAD)
    ref = target.generate(ids, **kwargs)
    out = target.generate(ids, **kwargs, custom_generate=SpeculativeDecoder("pld", batches="plain"))
    rows = [n for _, n in attention_calls]
    assert 1 in rows and ids.shape[1] in rows  # the steps and the padded prefill came here
    for r in range(ids.shape[0]):
        prompt = ids[r : r + 1, int((mask[r] == 0).sum()) :]
        start = ids.shape[1] - prompt.shape[1]
        assert_equal_up_to_ties(target, prompt, out[r : r + 1, start:], ref[r : r + 1, start:])


def test_block_mask_and_kept_slots_against_brute_force(tiny_llama):
    from transformers import DynamicCache

    from hf_spec.engine.batch import keep_slots
    from hf_spec.tree.draft_tree import DraftTree
    from hf_spec.tree.masks import block_mask

    valid = torch.tensor([[False, True, True], [True, True, True]])
    trees = [DraftTree.chain([5, 6]), DraftTree.empty()]
    allowed = block_mask(valid, trees, 3, torch.float32)[:, 0] == 0  # [rows, width, past + width]
    for r, tree in enumerate(trees):
        ancestors = torch.from_numpy(tree.ancestor_matrix())
        for q in range(3):
            want = [bool(valid[r, j]) and q <= len(tree) for j in range(3)]
            want += [bool(ancestors[q, k]) if max(q, k) <= len(tree) else q == k for k in range(3)]
            assert allowed[r, q].tolist() == want, (r, q)

    cache = DynamicCache(config=tiny_llama.config)
    keys = torch.arange(2 * 2 * 6, dtype=torch.float32).view(2, 2, 6, 1).expand(2, 2, 6, 4).contiguous()
    cache.update(keys, keys + 100, 0)
    assert keep_slots(cache, 3, [[0, 2], [0]]) == 2
    got = cache.layers[0].keys
    assert got.shape == (2, 2, 5, 4)
    assert torch.equal(got[:, :, :3], keys[:, :, :3])
    assert torch.equal(got[0, :, 3:], keys[0, :, [3, 5]]) and torch.equal(got[1, :, 3:], keys[1, :, [3, 3]])
    assert torch.equal(cache.layers[0].values, got + 100)


def test_an_error_mid_batch_leaves_everything_usable(tiny_llama):
    """A stopping criterion that raises mid-round: the error reaches the caller, the LM head and linears are
    restored, and the next batched call is exact again."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Boom(StoppingCriteria):
        calls = 0

        def __call__(self, input_ids, scores, **kwargs):
            Boom.calls += 1
            if Boom.calls == 7:
                raise KeyboardInterrupt
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    ids, mask = batch_of_three()
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=PAD)
    dec = SpeculativeDecoder("pld", batches="batched")
    with pytest.raises(KeyboardInterrupt):
        tiny_llama.generate(
            ids, **kwargs, stopping_criteria=StoppingCriteriaList([Boom()]), custom_generate=dec
        )
    assert all("forward" not in m.__dict__ for m in tiny_llama.modules())
    assert torch.equal(
        tiny_llama.generate(ids, **kwargs, custom_generate=dec), tiny_llama.generate(ids, **kwargs)
    )


def test_squeezed_cache_keeps_each_rows_slots_in_order():
    from transformers import DynamicCache, LlamaConfig

    from hf_spec.engine.batch import squeeze_holes

    valid = torch.tensor([[False, True, False, True, True], [True, False, False, False, True]])
    cache = DynamicCache(config=LlamaConfig(num_hidden_layers=1, num_attention_heads=1, hidden_size=4))
    keys = torch.arange(2 * 5, dtype=torch.float32).view(2, 1, 5, 1).expand(2, 1, 5, 3).contiguous()
    cache.update(keys, -keys, 0)
    squeezed = squeeze_holes(cache, valid)
    assert squeezed.tolist() == [[True, True, True], [False, True, True]]
    got = cache.layers[0].keys[:, 0, :, 0]
    assert got[0].tolist() == [1, 3, 4] and got[1, 1:].tolist() == [5, 9]
    assert torch.equal(cache.layers[0].values, -cache.layers[0].keys)


def test_batched_generation_with_the_cache_squeezed_every_round(tiny_llama, monkeypatch):
    import hf_spec.engine.batch as batched

    monkeypatch.setattr(batched, "MIN_HOLES", 0)
    monkeypatch.setattr(batched, "HOLE_SHARE", 0.0)
    calls = []
    squeeze = batched.squeeze_holes
    monkeypatch.setattr(batched, "squeeze_holes", lambda c, v: calls.append(v.shape) or squeeze(c, v))
    ids, mask = batch_of_three()
    kwargs = dict(attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=PAD)
    out = tiny_llama.generate(ids, **kwargs, custom_generate=SpeculativeDecoder("pld", batches="batched"))
    assert torch.equal(out, tiny_llama.generate(ids, **kwargs)) and calls
