"""Quantized targets as users load them: bitsandbytes LLM.int8 (row-local verification, the prompt's outlier
columns for the first root, the tree check's row probe, batches refused), bitsandbytes NF4, optimum-quanto and
torchao weight-only int8 where they install. Greedy output must equal the quantized model's own `generate`."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from hf_spec import SpeculativeDecoder
from hf_spec.engine import sequence
from hf_spec.engine.target import check as compat
from hf_spec.engine.target import int8_rows
from hf_spec.engine.target.placement import target_placement
from hf_spec.engine.target.profile import target_profile
from hf_spec.models.fingerprint import check_fingerprint, target_fingerprint
from tests.conftest import STORIES
from tests.test_methods import METHOD_SPECS, decoder_for

bnb = pytest.importorskip("bitsandbytes")
from transformers import BitsAndBytesConfig  # noqa: E402

logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # "inputs will be cast to float16" on every forward

ISSUE_PROMPT = torch.tensor([[1, 400, 30, 70, 400, 30, 70, 22, 400, 30]])


def load_int8(**kwargs):
    config = BitsAndBytesConfig(load_in_8bit=True)
    return AutoModelForCausalLM.from_pretrained(STORIES, quantization_config=config, **kwargs).eval()


@pytest.fixture(scope="module")
def int8_stories():
    return load_int8()


def assert_greedy_equal(model, spec: str, ids: torch.Tensor, new: int = 40) -> None:
    ref = model.generate(ids, max_new_tokens=new, do_sample=False)
    out = model.generate(ids, max_new_tokens=new, do_sample=False, custom_generate=decoder_for(spec, model))
    assert out[0].tolist() == ref[0].tolist(), spec


@pytest.mark.parametrize("spec", ["pld", "oracle:4"])
def test_int8_target_decodes_as_its_own_generate(int8_stories, spec):
    """The issue's case: without row-local verification `pld` departed at position 28, `oracle:4` at 33."""
    profile = target_profile(int8_stories)
    assert profile.int8_rows and profile.placement.quantization == "bitsandbytes 8-bit"
    assert_greedy_equal(int8_stories, spec, ISSUE_PROMPT)


def test_row_local_forward_computes_each_row_as_bitsandbytes_computes_it_alone(int8_stories):
    layer = int8_rows.outlier_layers(int8_stories)[0]
    x = torch.randn(5, layer.in_features, generator=torch.Generator().manual_seed(0)) * 2
    x[2, 3] = 40.0  # an outlier in one row: bitsandbytes takes its column in float for all five rows
    with torch.no_grad():
        alone = torch.cat([layer(x[r : r + 1]) for r in range(5)])
        shared = layer(x)
        with int8_rows.row_local_int8(int8_stories):
            local = layer(x)
            one_row = torch.cat([layer(x[r : r + 1]) for r in range(5)])
    assert torch.equal(one_row, alone)  # one row: bitsandbytes' own operations
    torch.testing.assert_close(
        local, alone, rtol=1e-5, atol=1e-5
    )  # several: the float correction's sums only
    assert float((shared - alone).abs().max()) > 1e-3  # what the patch is for
    assert "forward" not in layer.__dict__  # unpatched after the block


def test_first_root_takes_the_prompts_outlier_columns(int8_stories, monkeypatch):
    """Every step's logits equal `generate`'s to float rounding; recomputing the prompt's last token with only its
    own outlier columns (not the prompt's, as `generate`'s prefill does) departs by up to ~0.3 on these prompts."""
    kw = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True)
    g = torch.Generator().manual_seed(0)
    bos = torch.ones(1, 1, dtype=torch.long)
    prompts = [torch.cat([bos, torch.randint(3, 512, (1, 12), generator=g)], 1) for _ in range(6)][3:]

    def gap(ids) -> float:
        ref = int8_stories.generate(ids, **kw)
        out = int8_stories.generate(ids, custom_generate=SpeculativeDecoder("pld"), **kw)
        return max(float((a - b).abs().max()) for a, b in zip(ref.logits, out.logits, strict=True))

    assert max(gap(ids) for ids in prompts) < 1e-4
    real = int8_rows.prompt_forward
    monkeypatch.setattr(
        sequence, "prompt_forward", lambda model, n, record=True: real(model, n, record=False)
    )
    assert max(gap(ids) for ids in prompts) > 1e-2


def test_tree_check_catches_int8_layers_that_share_outlier_columns(monkeypatch):
    model = load_int8()
    compat.check_tree_verification(model)  # row-local inside the verification context: passes
    monkeypatch.setattr(
        "hf_spec.engine.target.placement.row_local_int8", lambda module: contextlib.nullcontext()
    )
    model.__dict__.pop("_hf_spec_tree_check", None)
    with pytest.raises(ValueError, match=r"Linear8bitLt layers compute a row differently beside other rows"):
        compat.check_tree_verification(model)


def test_int8_batches_are_refused_unless_plain(int8_stories):
    ids = torch.cat([ISSUE_PROMPT, ISSUE_PROMPT.flip(1)])
    with pytest.raises(
        ValueError, match="LLM.int8 layers pick outlier columns over all rows.*batches='plain'"
    ):
        int8_stories.generate(
            ids, max_new_tokens=8, do_sample=False, custom_generate=SpeculativeDecoder("pld")
        )
    ref = int8_stories.generate(ids, max_new_tokens=8, do_sample=False)
    out = int8_stories.generate(
        ids, max_new_tokens=8, do_sample=False, custom_generate=SpeculativeDecoder("pld", batches="plain")
    )
    assert torch.equal(out, ref)


def test_head_for_the_unquantized_target_is_accepted(int8_stories):
    """bitsandbytes leaves the embedding and the LM head unquantized, and the fingerprint reads only those: a head
    trained on the float target loads on its int8 twin (and drafts from the int8 target's hidden states)."""
    plain = AutoModelForCausalLM.from_pretrained(STORIES)
    check_fingerprint(target_fingerprint(plain), int8_stories, "a head trained on the float target")


def test_warm_start_from_a_quantized_layer_is_refused(int8_stories):
    from hf_spec.methods.eagle.modeling import EagleHeadConfig, EagleHeadModel

    head = EagleHeadModel(EagleHeadConfig.for_target(int8_stories, 64))
    with pytest.raises(ValueError, match=r"init_from_last_layer .* bitsandbytes 8-bit: train without it"):
        head.init_layer_from(int8_stories)


@pytest.mark.slow
@pytest.mark.parametrize("spec", [s for s in METHOD_SPECS if s not in ("draft-model", "eagle")])
def test_every_method_on_an_int8_target(int8_stories, spec):
    assert_greedy_equal(int8_stories, spec, ISSUE_PROMPT)


@pytest.mark.slow
@pytest.mark.parametrize(
    "spec", [pytest.param("early-exit:2", marks=pytest.mark.ci_slow), "hispec", "eagle3"]
)
def test_layer_wise_and_head_methods_on_an_int8_target(int8_stories, spec):
    """Layer-wise methods run the int8 layers (row-local where their forwards feed the verification)."""
    assert_greedy_equal(int8_stories, spec, ISSUE_PROMPT, new=24)


def tiny_nf4_model(tmp_path):
    """A tiny random Llama whose linear widths are multiples of 32 (bitsandbytes' CPU NF4 packing needs them;
    stories260K's 172-wide MLP fails there), saved and loaded in NF4."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaked: greedy paths repeat, so drafts get accepted
    model.save_pretrained(tmp_path / "tiny")
    nf4 = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )
    return AutoModelForCausalLM.from_pretrained(tmp_path / "tiny", quantization_config=nf4).eval()


@pytest.mark.parametrize("spec", ["pld", "early-exit:2"])
def test_nf4_target(tmp_path, spec):
    model = tiny_nf4_model(tmp_path)
    assert target_placement(model).quantization == "bitsandbytes 4-bit nf4"
    assert not target_profile(model).int8_rows  # NF4 dequantizes weights: rows are independent
    ids = torch.tensor([[1, 5, 9, 14, 5, 9, 14, 30, 5, 9]])
    assert_greedy_equal(model, spec, ids, new=24)


def test_quanto_int8_weights():
    pytest.importorskip("optimum.quanto")
    from transformers import QuantoConfig

    model = AutoModelForCausalLM.from_pretrained(
        STORIES, quantization_config=QuantoConfig(weights="int8")
    ).eval()
    assert target_placement(model).quantization == "quanto"
    for spec in ("pld", "oracle:4"):
        assert_greedy_equal(model, spec, ISSUE_PROMPT)


def test_torchao_int8_weight_only():
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    config = TorchAoConfig(Int8WeightOnlyConfig())
    model = AutoModelForCausalLM.from_pretrained(STORIES, quantization_config=config).eval()
    placement = target_placement(model)
    assert placement.quantization == "torchao" and not placement.plain_linears
    assert target_profile(model).backend.name == "torch"  # hf-spec's CPU kernels cannot read its weights
    for spec in ("pld", "oracle:4", "early-exit:2"):
        assert_greedy_equal(model, spec, ISSUE_PROMPT)


def test_cli_decodes_an_int8_target(capsys):
    """`hf-spec generate --load-in-8bit` (bfloat16 activations where the CPU has them: `--dtype auto`)."""
    from hf_spec.cli.main import main

    argv = ["generate", "--target", str(STORIES), "--method", "pld", "--prompt", "Once upon a time"]
    argv += ["--dtype", "auto"]
    assert main([*argv, "--max-new-tokens", "16", "--threads", "1", "--load-in-8bit"]) == 0
    assert "identical to plain greedy generate: yes" in capsys.readouterr().out


@pytest.mark.parametrize(
    "options, message",
    [
        (["--load-in-8bit", "--load-in-4bit"], "not allowed with argument"),
        (["--device-map", "everywhere"], "--device-map takes auto, balanced"),
        (["--device-map", "auto", "--max-memory", "[1]"], "expected a JSON object"),
    ],
)
def test_loading_options_are_checked_by_name(options, message, capsys):
    from hf_spec.cli.main import main

    with pytest.raises(SystemExit):
        main(
            [
                "bench",
                "--target",
                str(STORIES),
                "--methods",
                "ar",
                "--prompts",
                "p.jsonl",
                "--out",
                "x",
                *options,
            ]
        )
    assert message in capsys.readouterr().err
