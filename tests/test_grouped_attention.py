"""Few-row grouped-query attention (`hf_spec.kernels.grouped_attention`) against transformers' `sdpa`."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_spec import SpeculativeDecoder
from hf_spec.kernels import grouped_attention as ga
from hf_spec.tree.draft_tree import DraftTree
from hf_spec.tree.masks import tree_attention_mask
from tests.conftest import prompt_ids


class _Module(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def _inputs(heads: int, kv_heads: int, rows: int, kv_len: int, seed: int = 0, batch: int = 1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, rows, 16, generator=g)
    k = torch.randn(batch, kv_heads, kv_len, 16, generator=g)
    v = torch.randn(batch, kv_heads, kv_len, 16, generator=g)
    return q, k, v


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (14, 2)])
@pytest.mark.parametrize("rows", [2, 5])
def test_equals_sdpa_with_causal_and_tree_masks(heads, kv_heads, rows):
    kv_len = 30
    q, k, v = _inputs(heads, kv_heads, rows, kv_len, seed=rows)
    module = _Module(heads // kv_heads)
    causal = torch.ones(rows, kv_len, dtype=torch.bool).tril(kv_len - rows)[None, None]  # bool: True attends
    tree = DraftTree(torch.arange(rows - 1), torch.tensor([-1, 0, 0, 2][: rows - 1]))
    additive = tree_attention_mask(tree, kv_len - rows, torch.float32)  # a tree under the root: -inf off-path
    assert additive.shape == (1, 1, rows, kv_len)
    for mask in (causal, additive):
        with torch.no_grad():
            ref, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
            out, _ = ga.grouped_attention_forward(module, q, k, v, mask, scaling=0.25)
        assert out.shape == ref.shape == (1, rows, heads, 16)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_batched_rows_with_masks_of_their_own_equal_sdpa():
    """A batch whose rows each have their own 4D mask (hf-spec's batched verification), and a shared one."""
    from hf_spec.tree.masks import block_mask

    q, k, v = _inputs(14, 2, 4, 20, seed=3, batch=3)
    valid = torch.rand(3, 16, generator=torch.Generator().manual_seed(1)) > 0.3
    trees = [
        DraftTree.chain([1, 2, 3]),
        DraftTree(torch.arange(2), torch.tensor([-1, -1])),
        DraftTree.empty(),
    ]
    module = _Module(7)
    for mask in (
        block_mask(valid, trees, 4, torch.float32),
        block_mask(valid[:1], trees[:1], 4, torch.float32),
    ):
        with torch.no_grad():
            ref, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
            out, _ = ga.grouped_attention_forward(module, q, k, v, mask, scaling=0.25)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_other_calls_go_to_sdpa(monkeypatch):
    """One row, no mask, grad, dropout and an extra bias all take transformers' own path."""
    calls = []
    monkeypatch.setattr(ga, "sdpa_attention_forward", lambda *a, **kw: calls.append(1) or (None, None))
    q, k, v = _inputs(4, 2, 3, 10)
    mask = torch.ones(1, 1, 3, 10, dtype=torch.bool)
    module = _Module(2)
    with torch.no_grad():
        ga.grouped_attention_forward(module, q[:, :, :1], k, v, mask[:, :, :1])
        ga.grouped_attention_forward(module, q, k, v, None)
        ga.grouped_attention_forward(module, q, k, v, mask, dropout=0.1)
        ga.grouped_attention_forward(module, q, k, v, mask, position_bias=torch.zeros(1, 4, 3, 10))
        ga.grouped_attention_forward(module, q, k, v, mask[..., :9])  # a mask that is not the cache's length
    with torch.enable_grad():
        ga.grouped_attention_forward(module, q, k, v, mask)
    assert len(calls) == 6
    with torch.no_grad():
        ga.grouped_attention_forward(module, q, k, v, mask)
    assert len(calls) == 6


def test_decoding_runs_it_and_restores_the_config(tiny_model, monkeypatch):
    """hf-spec's loop verifies through it (tiny GQA targets run sdpa), with output equal to `generate`'s; the
    config reads `sdpa` again afterwards, also after an error; `HF_SPEC_GROUPED_ATTENTION=0` turns it off."""
    rows = []
    real = ga.grouped_attention_forward

    def spy(module, query, *args, **kwargs):
        rows.append(query.shape[2])
        return real(module, query, *args, **kwargs)

    monkeypatch.setattr(ga, "grouped_attention_forward", spy)
    monkeypatch.setitem(ga.AttentionInterface._global_mapping, ga.NAME, spy)
    ids = prompt_ids(12, seed=3)
    ref = tiny_model.generate(ids, max_new_tokens=24, do_sample=False)
    assert not rows  # plain generate never sees it
    out = tiny_model.generate(
        ids, max_new_tokens=24, do_sample=False, custom_generate=SpeculativeDecoder("pld")
    )
    assert torch.equal(out, ref)
    assert max(rows) >= 2 and tiny_model.config._attn_implementation == "sdpa"

    with pytest.raises(RuntimeError, match="boom"), ga.grouped_attention(tiny_model):
        assert tiny_model.config._attn_implementation == ga.NAME
        raise RuntimeError("boom")
    assert tiny_model.config._attn_implementation == "sdpa"

    monkeypatch.setenv("HF_SPEC_GROUPED_ATTENTION", "0")
    rows.clear()
    out = tiny_model.generate(
        ids, max_new_tokens=24, do_sample=False, custom_generate=SpeculativeDecoder("pld")
    )
    assert torch.equal(out, ref) and not rows


def test_bfloat16_inputs_keep_fp32_scores():
    """bf16 query/key/value: scores and softmax in fp32, so the output is the fp32 result rounded once."""
    q, k, v = _inputs(6, 2, 4, 40, seed=7)
    mask = torch.ones(4, 40, dtype=torch.bool).tril(36)[None, None]
    module = _Module(3)
    with torch.no_grad():
        ref, _ = sdpa_attention_forward(module, q, k, v, mask)
        half = [t.bfloat16() for t in (q, k, v)]
        exact, _ = sdpa_attention_forward(module, *[t.float() for t in half], mask)
        out, _ = ga.grouped_attention_forward(module, *half, mask)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), exact, rtol=2**-7, atol=2**-8)  # one bf16 rounding
    assert float((out.float() - ref).abs().max()) < 0.05


def test_a_fully_masked_row_stays_finite_and_the_others_equal_sdpa():
    """A padding query of a padded prefill sees no key (transformers' boolean mask): its output must be finite, or
    the next layer's keys at that slot would carry NaN into every row (masked scores + NaN = NaN)."""
    q, k, v = _inputs(6, 2, 4, 4, seed=3)
    mask = torch.ones(4, 4, dtype=torch.bool).tril()[None, None].clone()
    mask[..., 0, :] = False
    module = _Module(3)
    with torch.no_grad():
        ref, _ = sdpa_attention_forward(module, q, k, v, mask)
        out, _ = ga.grouped_attention_forward(module, q, k, v, mask)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:, 1:], ref[:, 1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("masked", [False, True])
def test_one_row_takes_sdpas_masked_path(dtype, masked, monkeypatch):
    """One query row (torch's unmasked kernel is slow for it, 5-10x in bfloat16) goes to `sdpa` with a mask: its
    own 4D mask (a sliding window) or an all-zero bias; the result is the fp32 one up to one rounding."""
    q, k, v = _inputs(14, 2, 1, 50, seed=11, batch=2)
    mask = torch.ones(1, 1, 1, 50, dtype=torch.bool)
    mask[..., :20] = False
    module = _Module(7)
    half = [t.to(dtype) for t in (q, k, v)]
    masks = []

    def spy(module, query, key, value, attention_mask, **kwargs):
        masks.append(attention_mask)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setattr(ga, "sdpa_attention_forward", spy)
    with torch.no_grad():
        exact, _ = sdpa_attention_forward(module, *[t.float() for t in half], mask if masked else None)
        out, _ = ga.grouped_attention_forward(module, *half, mask if masked else None)
    assert out.dtype == dtype and out.shape == (2, 1, 14, 16)
    assert len(masks) == 1 and (masks[0] is mask if masked else not masks[0].any())  # given, or all-zero bias
    tolerance = 1e-5 if dtype is torch.float32 else 2**-7
    torch.testing.assert_close(out.float(), exact, rtol=tolerance, atol=tolerance / 2)


def test_bfloat16_decoding_runs_one_row_steps_here(monkeypatch):
    """In a bfloat16 target's decoding the one-row calls (rounds without a draft) come here too."""
    from tests.conftest import make_tiny_model, run_in_bfloat16

    rows = []
    real = ga.grouped_attention_forward

    def spy(module, query, *args, **kwargs):
        rows.append(query.shape[2])
        return real(module, query, *args, **kwargs)

    monkeypatch.setitem(ga.AttentionInterface._global_mapping, ga.NAME, spy)
    run_in_bfloat16(make_tiny_model("qwen2"), "pld")
    assert 1 in rows and max(rows) >= 2


def test_a_separate_draft_model_drafts_through_it(tiny_model, attention_calls):
    """A separate draft model's steps (one row each, and its prompt) go through hf-spec's attention too; the output
    is still `generate`'s."""
    from hf_spec.methods.draft_model.config import DraftModelConfig
    from hf_spec.methods.draft_model.drafter import DraftModelDrafter
    from tests.conftest import make_tiny_model

    draft = make_tiny_model("llama", seed=5, layers=2)
    dec = SpeculativeDecoder(
        DraftModelDrafter(DraftModelConfig(num_draft_tokens=4), tiny_model, draft_model=draft)
    )
    ids = prompt_ids(12, seed=4)
    ref = tiny_model.generate(ids, max_new_tokens=20, do_sample=False)
    assert torch.equal(tiny_model.generate(ids, max_new_tokens=20, do_sample=False, custom_generate=dec), ref)
    drafted = [rows for module, rows in attention_calls if any(module is m for m in draft.modules())]
    assert 1 in drafted and draft.config._attn_implementation == "sdpa"
