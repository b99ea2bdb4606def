"""EAGLE-3 heads in the published layouts (the EAGLE authors', SpecForge/SGLang, vLLM's speculators) on tiny random
Llama and Qwen2 targets: checkpoints written by `tests/eagle3_checkpoints.py` from the layouts' descriptions, drafts
checked against its independent forward; lossless greedy and sampling; the target states each layout names; clear
errors for wrong targets and damaged checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, GenerationConfig, LlamaConfig

from hf_spec import SpeculativeDecoder
from hf_spec.core.drafter import SpecState
from hf_spec.engine.target.profile import target_profile
from hf_spec.methods.eagle3 import Eagle3Config, Eagle3Drafter, load_eagle3_head
from tests.conftest import CACHE, make_tiny_model, prompt_ids, tiny_fields
from tests.eagle3_checkpoints import reference_logits, reference_states, target_ids, write_eagle3_checkpoint

LAYERS = 7  # the default target states 2, L//2, L-3 are distinct from 7 layers on
# layout -> (target architecture, the layout's own layer ids, the output_hidden_states indices they mean)
LAYOUTS = {
    "authors": ("llama", None, (2, 3, 4)),
    "sglang": ("qwen2", [0, 3, 5], (1, 4, 6)),  # ids of layers whose output is read: index id + 1
    "vllm": ("llama", [1, 4, 6], (1, 4, 6)),  # indices themselves
}


def _target(arch: str, **kw):
    return make_tiny_model(arch, layers=LAYERS, temperature=16.0, **kw)


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def published(request, tmp_path_factory):
    """`(layout, target, folder, tensors)`: a tiny target and an EAGLE-3 head for it in `layout`."""
    layout = request.param
    arch, ids, _ = LAYOUTS[layout]
    target = _target(arch)
    folder = tmp_path_factory.mktemp(f"eagle3-{layout}") / "head"
    tensors, _ = write_eagle3_checkpoint(folder, target, layout, ids, seed=3)
    return layout, target, folder, tensors


def _state(model, ids: torch.Tensor, layers) -> SpecState:
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(input_ids=ids[:, :-1], **{CACHE: cache}, use_cache=True, output_hidden_states=True)
    hidden = torch.cat([out.hidden_states[i] for i in layers], -1)
    return SpecState(
        model, cache, ids, GenerationConfig(), hidden_states=hidden, backend=target_profile(model).backend
    )


# ---- loading -------------------------------------------------------------------------------------------------
def test_each_layout_names_its_target_states(published):
    layout, target, folder, tensors = published
    head = load_eagle3_head(str(folder), target)
    assert head.config.hidden_state_indices == LAYOUTS[layout][2]
    assert head.config.norm_before_residual == (layout == "vllm")  # the speculators config sets it
    assert head.embed_tokens is None  # SpecForge's stored copy equals the target's: the target's is used
    assert torch.equal(head.draft_token_ids().cpu(), torch.tensor(target_ids(tensors, list(range(40)))))
    drafter = Eagle3Drafter(Eagle3Config(head=str(folder)), target)
    assert drafter.hidden_state_layers == LAYOUTS[layout][2] and drafter.requires_hidden_states


def test_drafts_match_an_independent_forward(published):
    """The EAGLE-2 tree's first two levels equal top-k of the reference head: fc over the joined target states at
    the committed positions, the head's own state fed back (no fc) below the root."""
    layout, target, folder, t = published
    indices = LAYOUTS[layout][2]
    ids = prompt_ids(10, seed=5)
    n, topk = ids.shape[1], 3
    drafter = Eagle3Drafter(Eagle3Config(head=str(folder), depth=2, topk=topk, total_tokens=64), target)
    drafter.begin(_state(target, ids, indices))
    tree = drafter.propose(_state(target, ids, indices), max_depth=2)
    with torch.no_grad():
        hs = target(input_ids=ids[:, :-1], output_hidden_states=True).hidden_states
    aux = torch.cat([hs[i][0] for i in indices], -1)  # [n - 1, 3H]: the states at positions 0..n-2
    embed = target.get_input_embeddings().weight.detach()
    nbr = layout == "vllm"
    g = aux @ t["fc.weight"].T  # committed pairs (a_i, x_{i+1}) at EAGLE positions i = 0..n-2
    states = reference_states(t, embed, g, ids[0, 1:], torch.arange(n - 1), nbr)
    first = target_ids(t, reference_logits(t, states[-1:])[0].topk(topk).indices.tolist())
    roots = [i for i, p in enumerate(tree.parents.tolist()) if p == -1]
    assert [int(tree.tokens[i]) for i in roots] == first
    for node in roots:  # level 2: the node's token with the head state that predicted it, at position n - 1
        tok = int(tree.tokens[node])
        s = reference_states(
            t,
            embed,
            torch.cat([g, states[-1:]]),
            torch.cat([ids[0, 1:], torch.tensor([tok])]),
            torch.arange(n),
            nbr,
        )
        want = target_ids(t, reference_logits(t, s[-1:])[0].topk(topk).indices.tolist())
        children = [int(tree.tokens[i]) for i, p in enumerate(tree.parents.tolist()) if p == node]
        assert children == want, (tok, children, want)


# ---- lossless ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [1, 2])
def test_greedy_equals_generate(published, seed):
    _, target, folder, _ = published
    dec = SpeculativeDecoder(f"eagle3:{folder}")
    ids = prompt_ids(12, seed=seed)
    ref = target.generate(ids, max_new_tokens=40, do_sample=False)
    out = target.generate(ids, max_new_tokens=40, do_sample=False, custom_generate=dec)
    assert torch.equal(out, ref)
    assert dec.last_stats.draft_tokens > 0


def test_a_batch_and_postuse_stay_lossless(tmp_path):
    """A batch verified in one forward, and Post-use driving the head step by step, get the joined states too."""
    target = _target("llama")
    write_eagle3_checkpoint(tmp_path / "h", target, "sglang", [0, 3, 5], seed=2)
    ids = torch.cat([prompt_ids(12, seed=1), prompt_ids(12, seed=2)])
    ref = target.generate(ids, max_new_tokens=20, do_sample=False)
    dec = SpeculativeDecoder(f"eagle3:{tmp_path / 'h'}")
    dec.batches = "batched"
    assert torch.equal(target.generate(ids, max_new_tokens=20, do_sample=False, custom_generate=dec), ref)
    one = prompt_ids(12, seed=3)
    ref = target.generate(one, max_new_tokens=30, do_sample=False)
    post = SpeculativeDecoder(f"postuse:eagle3:{tmp_path / 'h'}")
    assert torch.equal(target.generate(one, max_new_tokens=30, do_sample=False, custom_generate=post), ref)


@pytest.mark.parametrize("loop", ["batched", pytest.param("hf-spec", marks=pytest.mark.slow)])
def test_sampling_keeps_target_distribution(tmp_path, loop):
    from tests.stats import sampled_marginals_pvalues
    from tests.test_sampling import V

    target = make_tiny_model("llama", seed=11, vocab_size=V, layers=4, temperature=2.0)
    tensors, _ = write_eagle3_checkpoint(tmp_path / "head", target, "vllm", [1, 2, 3], seed=1)
    cfg = Eagle3Config(head=str(tmp_path / "head"), depth=3, topk=2, total_tokens=5)
    pvalues, accepted = sampled_marginals_pvalues(target, lambda: SpeculativeDecoder(cfg), loop)
    assert accepted > 0
    assert min(pvalues) > 1e-3, pvalues


# ---- errors --------------------------------------------------------------------------------------------------
def test_wrong_target_is_refused_naming_the_mismatch(tmp_path):
    target = _target("llama")
    write_eagle3_checkpoint(tmp_path / "h", target, "sglang", [0, 3, 5])
    wide = AutoModelForCausalLM.from_config(LlamaConfig(**(tiny_fields(layers=LAYERS) | {"hidden_size": 48})))
    with pytest.raises(ValueError, match=r"hidden states of size 32, but the target's hidden size is 48"):
        load_eagle3_head(str(tmp_path / "h"), wide)
    with pytest.raises(ValueError, match=r"vocabulary of 96 tokens, but the target's vocab size is 128"):
        load_eagle3_head(str(tmp_path / "h"), make_tiny_model("llama", vocab_size=128, layers=LAYERS))
    with pytest.raises(ValueError, match=r"entering layers \[4, 6\], but the target has 4 layers"):
        load_eagle3_head(str(tmp_path / "h"), make_tiny_model("llama"))
    write_eagle3_checkpoint(tmp_path / "two", target, "sglang", [0, 3])  # fc reads 2 states...
    config = json.loads((tmp_path / "two" / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 3, 5]  # ...the config names 3
    (tmp_path / "two" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"fc.weight reads 64 features, but 3 target layers \[1, 4, 6\]"):
        load_eagle3_head(str(tmp_path / "two"), target)


def test_damaged_checkpoints_are_clear_errors(tmp_path):
    from safetensors.torch import save_file

    target = _target("llama")
    good, _ = write_eagle3_checkpoint(tmp_path / "h", target, "sglang", [0, 3, 5])
    file = tmp_path / "h" / "model.safetensors"
    file.write_bytes(b"truncated")
    with pytest.raises(ValueError, match="model.safetensors is not a readable safetensors file"):
        load_eagle3_head(str(tmp_path / "h"), target)
    save_file({k: v for k, v in good.items() if k != "midlayer.mlp.up_proj.weight"}, str(file))
    with pytest.raises(ValueError, match=r"lacks weights \['midlayer.mlp.up_proj.weight'\]"):
        load_eagle3_head(str(tmp_path / "h"), target)
    save_file(good | {"midlayer.self_attn.q_proj.weight": torch.zeros(32, 32)}, str(file))
    with pytest.raises(
        ValueError, match=r"q_proj.weight has shape \(32, 32\), its config implies \(32, 64\)"
    ):
        load_eagle3_head(str(tmp_path / "h"), target)
    save_file(good | {"t2d": torch.ones(96, dtype=torch.bool)}, str(file))
    with pytest.raises(ValueError, match="t2d does not mark the target ids d2t maps to"):
        load_eagle3_head(str(tmp_path / "h"), target)
    save_file(good | {"d2t": good["d2t"] + 90}, str(file))
    with pytest.raises(ValueError, match="d2t maps draft ids outside the target's 96 tokens"):
        load_eagle3_head(str(tmp_path / "h"), target)
    save_file({k: v for k, v in good.items() if k != "d2t"}, str(file))
    with pytest.raises(ValueError, match="reduced draft vocabulary but no d2t mapping"):
        load_eagle3_head(str(tmp_path / "h"), target)


def test_a_bin_with_code_in_it_is_refused(tmp_path):
    from tests.test_published_heads import _Touch

    target = _target("llama")
    tensors, _ = write_eagle3_checkpoint(tmp_path / "h", target, "authors")
    marker = tmp_path / "code-ran"
    torch.save({**tensors, "fc.weight": _Touch(marker)}, tmp_path / "h" / "pytorch_model.bin")
    with pytest.raises(
        ValueError, match="refused .*pytorch_model.bin holds pickled objects other than tensors"
    ):
        load_eagle3_head(str(tmp_path / "h"), target)
    assert not marker.exists()


def test_heads_of_the_other_method_name_it(tmp_path):
    from hf_spec.methods.eagle import EagleConfig, EagleDrafter
    from tests.test_published_heads import write_eagle_checkpoint

    target = _target("llama")
    write_eagle_checkpoint(tmp_path / "e1", target)
    with pytest.raises(ValueError, match=r"is a published EAGLE-1/2 head: use eagle:"):
        load_eagle3_head(str(tmp_path / "e1"), target)
    write_eagle3_checkpoint(tmp_path / "e3", target, "vllm", [1, 4, 6])
    with pytest.raises(ValueError, match=r"is a published EAGLE-3 head: use eagle3:"):
        EagleDrafter(EagleConfig(head=str(tmp_path / "e3")), target)
    with pytest.raises(ValueError, match="eagle3 needs a head"):
        Eagle3Drafter(Eagle3Config(), target)


def test_hub_ids_resolve_through_the_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from hf_spec.core.hub_ids import HubIdError
    from tests.fake_hub import cache_repo

    cache = tmp_path / "hf_home" / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    target = _target("llama")
    write_eagle3_checkpoint(tmp_path / "src", target, "authors", seed=4)
    cache_repo(cache, "yuhuili/EAGLE3-tiny", tmp_path / "src")
    dec = SpeculativeDecoder("eagle3:yuhuili/EAGLE3-tiny")
    ids = prompt_ids(12, seed=1)
    ref = target.generate(ids, max_new_tokens=24, do_sample=False)
    assert torch.equal(target.generate(ids, max_new_tokens=24, do_sample=False, custom_generate=dec), ref)
    with pytest.raises(HubIdError, match=r"'org/missing'.*not in the local Hugging Face cache"):
        SpeculativeDecoder("eagle3:org/missing")


def test_transformers_assisted_loop_gets_the_joined_states(tmp_path):
    from hf_spec.integrations import enable_assistant

    target = _target("llama")
    write_eagle3_checkpoint(tmp_path / "h", target, "sglang", [0, 3, 5], seed=2)
    ids = prompt_ids(12, seed=5)
    ref = target.generate(ids, max_new_tokens=24, do_sample=False)
    dec = SpeculativeDecoder(f"eagle3:{tmp_path / 'h'}")
    with enable_assistant(target, loop="transformers"):
        out = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=dec)
    assert torch.equal(out, ref)


def test_select_hidden_states_joins_layers_in_order():
    from hf_spec.engine.target.hidden import select_hidden_states

    hs = tuple(torch.full((1, 2, 3), float(i)) for i in range(5))
    assert select_hidden_states(hs, (-1,)) is hs[-1]
    assert select_hidden_states(hs, (1, 3))[0, 0].tolist() == [1.0] * 3 + [3.0] * 3
    with pytest.raises(
        ValueError, match=r"reads the target's hidden states \[2, 16\], but this forward returned 5"
    ):
        select_hidden_states(hs, (2, 16))


@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
def test_eagle_drafting_fields_stay_lossless(tmp_path, quantize):
    """`vocab_limit`, `quantize` and `max_catch_up` are `eagle`'s fields: a head whose draft vocabulary is
    most-frequent first (as `hf-spec train eagle3` saves it) drafts from its first rows, packed, exactly."""
    target = _target("qwen2")
    write_eagle3_checkpoint(tmp_path / "h", target, "sglang", [0, 3, 5], seed=4)
    head = load_eagle3_head(str(tmp_path / "h"), target)
    head.set_vocab_mapping(head.draft_token_ids().flip(0))  # not in token-id order
    config = Eagle3Config(depth=3, topk=2, total_tokens=6, vocab_limit=16, quantize=quantize, max_catch_up=8)
    drafter = Eagle3Drafter(config, target, head=head)
    assert drafter.lm_weight.shape[0] == 16 and head.lm_head not in drafter.quantized
    assert bool(drafter.quantized) == (quantize is not None)
    dec = SpeculativeDecoder(drafter)
    ids = prompt_ids(12, seed=7)
    ref = target.generate(ids, max_new_tokens=30, do_sample=False)
    assert torch.equal(target.generate(ids, max_new_tokens=30, do_sample=False, custom_generate=dec), ref)
    assert dec.last_stats.draft_tokens > 0


def test_vocab_limit_on_a_vocabulary_in_token_id_order_is_refused(tmp_path):
    target = _target("llama")
    write_eagle3_checkpoint(tmp_path / "h", target, "vllm", [1, 4, 6], seed=2)  # published: by token id
    with pytest.raises(ValueError, match="token-id order"):
        Eagle3Drafter(Eagle3Config(head=str(tmp_path / "h"), vocab_limit=8), target)
    with pytest.raises(ValueError, match="eagle3: vocab_limit and max_catch_up must be >= 0"):
        Eagle3Config(head=str(tmp_path / "h"), vocab_limit=-1)
