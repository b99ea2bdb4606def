"""The loop behind generate: stopping, streaming, outputs, every entry point and bad inputs."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList, pipeline
from transformers.generation.streamers import BaseStreamer

from hf_spec import SpeculativeDecoder
from hf_spec.core.config import MethodConfig
from hf_spec.core.registry import register_method
from hf_spec.core.specs import parse_method
from hf_spec.integrations import enable_assistant, save_custom_generate
from hf_spec.methods.draft_model.config import DraftModelConfig
from hf_spec.methods.draft_model.drafter import DraftModelDrafter
from hf_spec.methods.early_exit.config import EarlyExitConfig
from hf_spec.methods.pld.config import PLDConfig
from tests.conftest import make_tiny_model, prompt_ids


class Collect(BaseStreamer):
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.calls = 0
        self.ended = 0

    def put(self, value) -> None:
        self.calls += 1
        self.tokens.extend(value.reshape(-1).tolist())

    def end(self) -> None:
        self.ended += 1


def test_max_new_tokens_is_exact(tiny_llama):
    ids = prompt_ids(10, seed=2)
    for n in (1, 2, 7, 33):
        out = tiny_llama.generate(
            ids, max_new_tokens=n, do_sample=False, custom_generate=SpeculativeDecoder("oracle:8")
        )
        assert out.shape[1] == ids.shape[1] + n


def test_eos_inside_an_accepted_block_stops_there(tiny_llama):
    ids = prompt_ids(10, seed=2)
    free = tiny_llama.generate(ids, max_new_tokens=30, do_sample=False)[0, ids.shape[1] :].tolist()
    at = next(i for i in range(5, 30) if free[i] not in free[:i])  # first emitted mid-way: make it the EOS
    eos = free[at]
    ref = tiny_llama.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=eos, pad_token_id=0)
    dec = SpeculativeDecoder("oracle:8")  # whole blocks are accepted, so EOS lands inside one
    out = tiny_llama.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=eos, custom_generate=dec)
    assert torch.equal(out, ref)
    assert out[0, -1] == eos and out.shape[1] == ids.shape[1] + at + 1


def test_custom_stopping_criteria_and_stop_strings(stories):
    model, tok = stories
    ids = tok("Once upon a time", return_tensors="pt").input_ids

    class StopAfter(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= ids.shape[1] + 9, dtype=torch.bool)

    crit = StoppingCriteriaList([StopAfter()])
    ref = model.generate(ids, max_new_tokens=50, do_sample=False, stopping_criteria=crit)
    out = model.generate(
        ids,
        max_new_tokens=50,
        do_sample=False,
        stopping_criteria=crit,
        custom_generate=SpeculativeDecoder("oracle:8"),
    )
    assert torch.equal(out, ref) and out.shape[1] == ids.shape[1] + 9
    kw = dict(max_new_tokens=60, do_sample=False, stop_strings=["park"])
    ref = model.generate(ids, tokenizer=tok, **kw)
    out = model.generate(ids, custom_generate=SpeculativeDecoder("oracle:8", tokenizer=tok), **kw)
    assert torch.equal(out, ref)
    assert tok.decode(out[0]).endswith("park")
    with pytest.raises(ValueError, match="stop_strings needs a tokenizer"):
        model.generate(ids, custom_generate=SpeculativeDecoder("oracle:8"), **kw)


def test_stopping_criteria_see_the_scores_plain_decoding_shows_them(tiny_llama):
    """Plain decoding hands criteria `None`, or every score so far when `output_scores` is on."""
    ids = prompt_ids(10, seed=4)

    class Record(StoppingCriteria):
        def __init__(self) -> None:
            self.seen: list = []

        def __call__(self, input_ids, scores, **kwargs):
            self.seen.append(None if scores is None else len(scores))
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    for output_scores in (False, True):
        kw = dict(
            max_new_tokens=9, do_sample=False, return_dict_in_generate=True, output_scores=output_scores
        )
        ref_crit, crit = Record(), Record()
        ref = tiny_llama.generate(ids, stopping_criteria=StoppingCriteriaList([ref_crit]), **kw)
        out = tiny_llama.generate(
            ids,
            stopping_criteria=StoppingCriteriaList([crit]),
            custom_generate=SpeculativeDecoder("oracle:4"),
            **kw,
        )
        assert torch.equal(out.sequences, ref.sequences)
        assert crit.seen == ref_crit.seen == ([1, 2, 3, 4, 5, 6, 7, 8, 9] if output_scores else [None] * 9)


def test_streamer_gets_every_token_once_in_order(tiny_llama):
    ids = prompt_ids(10, seed=5)
    st = Collect()
    out = tiny_llama.generate(
        ids, max_new_tokens=25, do_sample=False, streamer=st, custom_generate=SpeculativeDecoder("oracle:6")
    )
    assert st.tokens == out[0].tolist()  # the prompt (put by generate) then each new token once
    assert st.ended == 1
    assert st.calls < 25  # blocks, not one call per token


def test_return_dict_has_sequences_scores_and_stats(tiny_llama):
    ids = prompt_ids(10, seed=6)
    kw = dict(
        max_new_tokens=12,
        do_sample=False,
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
    )
    ref = tiny_llama.generate(ids, **kw)
    out = tiny_llama.generate(ids, custom_generate=SpeculativeDecoder("oracle:5"), **kw)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores) == 12
    for a, b in zip(out.scores, ref.scores, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    for a, b in zip(out.logits, ref.logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    stats = out.spec_stats
    assert stats["new_tokens"] == 12 and stats["target_forwards"] < 12
    assert stats["tau"] == pytest.approx(12 / stats["target_forwards"])
    assert {"draft_tokens", "accepted_tokens", "time_draft", "time_verify", "time_other"} <= set(stats)


def test_assistant_model_entry_point_both_loops(tiny_llama):
    ids = prompt_ids(12, seed=7)
    ref = tiny_llama.generate(ids, max_new_tokens=30, do_sample=False)
    for loop in ("hf-spec", "transformers"):
        with enable_assistant(tiny_llama, loop=loop):
            for spec in ("pld", "early-exit:2"):
                out = tiny_llama.generate(
                    ids, max_new_tokens=30, do_sample=False, assistant_model=SpeculativeDecoder(spec)
                )
                assert torch.equal(out, ref), (loop, spec)
            out = tiny_llama.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=PLDConfig())
            assert torch.equal(out, ref)
        assert "generate" not in tiny_llama.__dict__  # restored
    with pytest.raises(ValueError, match="loop must be"):
        enable_assistant(tiny_llama, loop="beam")


def test_custom_generate_folder_with_trust_remote_code(tiny_llama, tmp_path):
    folder = save_custom_generate(tmp_path / "recipe", "pld:5")
    assert (folder / "custom_generate" / "generate.py").exists()
    assert json.loads((folder / "hf_spec_config.json").read_text())["num_draft_tokens"] == 5
    ids = prompt_ids(12, seed=8)
    ref = tiny_llama.generate(ids, max_new_tokens=20, do_sample=False)
    st = Collect()
    out = tiny_llama.generate(
        ids,
        max_new_tokens=20,
        do_sample=False,
        custom_generate=str(folder),
        trust_remote_code=True,
        streamer=st,
    )
    assert torch.equal(out, ref)
    assert st.tokens == out[0].tolist()


def test_pipeline_passes_custom_generate_through(stories):
    model, tok = stories
    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    ref = pipe("Once upon a time", max_new_tokens=30, do_sample=False)
    out = pipe(
        "Once upon a time", max_new_tokens=30, do_sample=False, custom_generate=SpeculativeDecoder("oracle:6")
    )
    assert out == ref


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(num_beams=2), "beam search"),
        (dict(use_cache=False), "use_cache"),
        (dict(prompt_lookup_num_tokens=3), "drop `prompt_lookup_num_tokens`"),
        (dict(return_dict_in_generate=True, output_attentions=True), "drop `output_attentions`"),
        (dict(return_dict_in_generate=True, output_hidden_states=True), "drop `output_hidden_states`"),
    ],
)
def test_unsupported_settings_raise(tiny_llama, kwargs, message):
    with pytest.raises(ValueError, match=message):
        tiny_llama.generate(
            prompt_ids(8), max_new_tokens=5, custom_generate=SpeculativeDecoder("pld"), **kwargs
        )


def test_assistant_model_and_inputs_embeds_with_custom_generate_raise(tiny_llama):
    ids = prompt_ids(8)
    with pytest.raises(ValueError, match="already speculates: drop assistant_model"):
        tiny_llama.generate(
            ids, max_new_tokens=5, assistant_model=tiny_llama, custom_generate=SpeculativeDecoder("pld")
        )
    embeds = tiny_llama.get_input_embeddings()(ids)
    with pytest.raises(ValueError, match="needs the prompt as input_ids"):
        tiny_llama.generate(inputs_embeds=embeds, max_new_tokens=5, custom_generate=SpeculativeDecoder("pld"))


def test_padding_is_stripped_or_refused(tiny_llama):
    mask = torch.ones(1, 8, dtype=torch.long)
    mask[0, 0] = 0  # one left-padding position: decoded without it, laid out with it
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    ref = tiny_llama.generate(prompt_ids(8), **kwargs)
    assert torch.equal(
        tiny_llama.generate(prompt_ids(8), **kwargs, custom_generate=SpeculativeDecoder("pld")), ref
    )
    mask[0, 0], mask[0, 4] = 1, 0
    with pytest.raises(ValueError, match="not left-padded"):
        tiny_llama.generate(
            prompt_ids(8), attention_mask=mask, max_new_tokens=5, custom_generate=SpeculativeDecoder("pld")
        )


def test_draft_model_with_another_vocabulary_raises(tiny_llama):
    other = make_tiny_model("llama", vocab_size=80, layers=1)
    with pytest.raises(ValueError, match=r"vocabulary \(80\) differs from the target's \(96\)"):
        DraftModelDrafter(DraftModelConfig(), tiny_llama, draft_model=other)
    with pytest.raises(ValueError, match="needs a draft model"):
        DraftModelDrafter(DraftModelConfig(), tiny_llama)


def test_early_exit_layer_out_of_range(tiny_llama):
    with pytest.raises(ValueError, match="exit_layer must be in"):
        tiny_llama.generate(
            prompt_ids(8), max_new_tokens=3, custom_generate=SpeculativeDecoder("early-exit:4")
        )


def test_registry_and_config_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown hf-spec method 'nope'"):
        parse_method("nope")
    with pytest.raises(ValueError, match="expected int"):
        parse_method("pld:many")
    with pytest.raises(ValueError, match="already registered"):
        register_method("pld", PLDConfig, object)
    with pytest.raises(ValueError, match="lowercase"):
        register_method("Bad_Name", PLDConfig, object)
    cfg = PLDConfig(num_draft_tokens=7, max_candidates=2)
    cfg.save_pretrained(tmp_path / "cfg")
    assert parse_method(str(tmp_path / "cfg")) == cfg
    assert MethodConfig.from_pretrained  # base class API
    (tmp_path / "bad.json").write_text('{"method": "pld", "depth": 3}')
    with pytest.raises(ValueError, match=r"unknown pld config keys \['depth'\]"):
        parse_method(str(tmp_path / "bad.json"))
    (tmp_path / "corrupt.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read an hf-spec config"):
        parse_method(str(tmp_path / "corrupt.json"))
    with pytest.raises(ValueError, match="not valid JSON"):
        PLDConfig.from_pretrained(tmp_path / "corrupt.json")
    for bad, message in [
        (dict(min_ngram=0), "pld: min_ngram must be >= 1, got 0"),
        (dict(max_ngram=1, min_ngram=2), "max_ngram must be >= min_ngram"),
        (dict(num_draft_tokens=-1), "pld: num_draft_tokens must be >= 1"),
    ]:
        with pytest.raises(ValueError, match=message):
            PLDConfig(**bad)
    with pytest.raises(ValueError, match="oracle: num_draft_tokens must be >= 1"):
        parse_method("oracle:0")
    with pytest.raises(ValueError, match="early-exit: siblings must be >= 0"):
        EarlyExitConfig(siblings=-1)
    with pytest.raises(ValueError, match=r"min_confidence must be in \[0, 1\]"):
        EarlyExitConfig(min_confidence=2.0)
    with pytest.raises(ValueError, match="draft-model: num_draft_tokens must be >= 1"):
        DraftModelConfig(num_draft_tokens=0)
    (tmp_path / "typed.json").write_text('{"method": "pld", "num_draft_tokens": "4"}')
    with pytest.raises(TypeError, match=r"pld: num_draft_tokens must be int, got '4'"):
        parse_method(str(tmp_path / "typed.json"))
    with pytest.raises(TypeError, match="must be bool"):
        EarlyExitConfig.from_dict({"method": "early-exit", "draft_vocab": 1})
    assert EarlyExitConfig.from_dict({"min_confidence": 0}).min_confidence == 0  # an int for a float field
    # a folder without an hf-spec config is the method's main argument (a model, a datastore), not a config
    model_dir = tmp_path / "draft"
    model_dir.mkdir()
    assert parse_method(f"draft-model:{model_dir}") == DraftModelConfig(model=str(model_dir))
    with pytest.raises(FileNotFoundError, match="no hf-spec config"):
        parse_method(f"talon:{model_dir}")  # talon takes only configs
    (tmp_path / "other.json").write_text('{"method": "oracle"}')
    with pytest.raises(ValueError, match="is for method 'oracle', not 'pld'"):
        PLDConfig.from_pretrained(tmp_path / "other.json")


def test_a_cache_under_an_unknown_name_is_named_in_the_error(tiny_llama):
    """Should a transformers release rename the cache again (5.24 renamed `past_key_values` to `cache`), the loop
    says what it was given instead of asking for `use_cache=True`."""
    from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

    from hf_spec.engine.sequence import speculative_generate

    drafter = SpeculativeDecoder("pld").drafter_for(tiny_llama)
    with pytest.raises(ValueError, match=r"no KV cache among the model_kwargs .*\['kv_state', 'use_cache'\]"):
        speculative_generate(
            tiny_llama, prompt_ids(8), LogitsProcessorList(), StoppingCriteriaList(), GenerationConfig(),
            drafter, use_cache=True, kv_state=object(),
        )  # fmt: skip
