"""hf-spec EAGLE heads of the `eagle1` architecture (`hf-spec train eagle --architecture eagle1`): the published
EAGLE-1 layer (checked against `reference_states`, an independent plain-torch forward), trained on the target's
post-norm states, decoded losslessly through `eagle:`, exported with `hf-spec export --format eagle` and read back
drafting the same trees, on tiny Llama and Qwen2 targets."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from hf_spec import SpeculativeDecoder
from hf_spec.cli.export import export_head
from hf_spec.cli.main import build_parser, main
from hf_spec.core.specs import HEAD_IN_THIS_FOLDER
from hf_spec.heads.hub import save_head_folder
from hf_spec.methods.eagle import EagleConfig, EagleDrafter
from hf_spec.methods.eagle.drafter import load_head
from hf_spec.methods.eagle.eagle1 import config_of_layer, layer_config, published_config
from hf_spec.methods.eagle.modeling import EagleHeadConfig, EagleHeadModel
from hf_spec.methods.eagle.published import PublishedEagleHead
from hf_spec.methods.eagle3.export import eagle1_checkpoint
from hf_spec.training.batches import collate
from hf_spec.training.eagle import EagleTrainConfig, train_eagle
from hf_spec.training.features import capture_features
from hf_spec.training.trainer import Unroll
from tests.conftest import make_tiny_model, prompt_ids
from tests.test_eagle import tiny_conversations
from tests.test_export import trees
from tests.test_published_heads import reference_states


def tiny_target(arch: str):
    target = make_tiny_model(arch, temperature=16.0)
    with torch.no_grad():  # a final norm that is not all ones: unit features and post-norm states then differ
        target.model.norm.weight.copy_(1 + 0.5 * torch.randn(32, generator=torch.Generator().manual_seed(7)))
    return target


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def trained(request, tmp_path_factory):
    """`(target, head, report, folder, store)`: an eagle1 head trained briefly on the target's greedy answers and
    saved as `hf-spec train eagle` saves it."""
    target = tiny_target(request.param)
    folder = tmp_path_factory.mktemp(f"eagle1-{request.param}")
    store = capture_features(
        target, tiny_conversations(target, count=16), folder / "data", topk=8, progress=False
    )
    cfg = EagleTrainConfig(
        align_steps=2, topk=4, epochs=16, lr=5e-3, batch_tokens=512, heldout=2, architecture="eagle1"
    )
    head, report = train_eagle(target, store.load_sequences(), folder / "run", cfg, progress=False)
    save_head_folder(head, folder / "head", EagleConfig(head=HEAD_IN_THIS_FOLDER, depth=4, topk=3), "card")
    return target, head, report, folder, store


def eagle_trees(folder, target):
    drafter = EagleDrafter(EagleConfig(head=str(folder), depth=4, topk=3, total_tokens=12), target)
    return trees(drafter, target, (-1,))


# ---- the architecture --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_eagle1_head_is_the_published_layer(arch):
    target = tiny_target(arch)
    torch.manual_seed(0)
    head = (
        EagleHeadModel(EagleHeadConfig.for_target(target, 50, layout="eagle1")).attach_target(target).eval()
    )
    with torch.no_grad():  # weights that are not their initial ones (norm weight 1, biases 0)
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    assert head.config.draft_vocab_size == 96 and torch.equal(
        head.d2t, torch.arange(96)
    )  # no draft vocabulary
    assert "layer.input_layernorm.weight" not in head.state_dict() and head.reads_post_norm_states
    fields = head.config.layer_config
    assert fields == layer_config(published_config(target.config, 96))
    assert layer_config(config_of_layer(fields, 96)) == fields
    assert fields["model_type"] == ("qwen2" if arch == "qwen2" else "llama")
    config, tensors = eagle1_checkpoint(head.config.to_dict(), head.state_dict(), "the head")
    assert config["qkv_bias"] is (arch == "qwen2") and config["bias"] is True
    y = torch.randn(6, 32)  # post-norm states
    ids, pos = prompt_ids(6, seed=3)[0], torch.arange(1, 7)
    embed = target.get_input_embeddings().weight.detach()
    want = reference_states(tensors, config, embed, y, ids, pos - 1)
    mask = torch.full((6, 6), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        got = head(y[None], ids[None], pos[None], mask)[0]
        assert torch.allclose(got, want, atol=1e-5)
        # drafts read the target's LM head directly: no norm in between, the whole vocabulary in token order
        lm = target.get_output_embeddings().weight
        assert torch.allclose(head.draft_logits(got), got @ lm.T, atol=1e-6)


def test_published_config_keeps_the_targets_rotary_embedding():
    from transformers import LlamaConfig

    from hf_spec.heads.family import build_layer_config
    from tests.conftest import tiny_fields

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    scaling["original_max_position_embeddings"] = 256
    target = LlamaConfig(**tiny_fields(), rope_theta=500000.0, rope_scaling=dict(scaling))  # a copy: edited
    config = published_config(target, 96)
    assert config["rope_theta"] == 500000.0 and config["rope_scaling"] == scaling
    assert build_layer_config(layer_config(config)).rope_parameters == target.rope_parameters


def test_unknown_layout_is_refused():
    with pytest.raises(ValueError, match="unknown EAGLE head layout 'eagle2'"):
        EagleHeadConfig(layout="eagle2")


def test_cli_takes_the_architecture():
    args = build_parser().parse_args(
        ["train", "eagle", "--target", "t", "--prompts", "p", "--out", "o", "--architecture", "eagle1"]
    )
    assert args.architecture == "eagle1"


def test_init_from_last_layer_copies_all_but_the_input_norm():
    target = tiny_target("llama")
    head = EagleHeadModel(EagleHeadConfig.for_target(target, layout="eagle1"))
    head.init_layer_from(target, -1)
    source = target.model.layers[-1].state_dict()
    for key, value in head.layer.state_dict().items():
        assert torch.equal(value, source[key]), key


# ---- training, decoding, export -----------------------------------------------------------------------------------
def test_training_regresses_the_post_norm_states(trained):
    target, head, report, _, store = trained
    assert report["final_loss"] < 0.9 * report["first_loss"]
    assert report["heldout"]["accuracy_by_depth"][0] > 0.1  # chance: 1/96
    batch = collate(store.load_sequences()[:2], 64)
    d = Unroll.of(head, head.training_batch(batch), torch.arange(96))
    with torch.no_grad():
        out = target(input_ids=batch["input_ids"][:1].long(), output_hidden_states=True)
    n = int(batch["valid"][0].sum())
    y = out.hidden_states[-1][0, : n - 1]  # the target's last hidden state after its final norm
    # the head's inputs / regression targets are the post-norm states; its target logits the target's own
    assert torch.allclose(d.f_in[0, : n - 1], y, atol=0.05, rtol=0.02)
    assert torch.allclose(d.u_tgt[0, : n - 2], y[1:], atol=0.05, rtol=0.02)
    assert torch.allclose(d.target_logits[0, : n - 2], out.logits[0, 1 : n - 1], atol=0.3, rtol=0.02)


def test_saved_head_decodes_losslessly(trained):
    target, _, _, folder, _ = trained
    config = json.loads((folder / "head" / "config.json").read_text())
    assert config["layout"] == "eagle1" and config["draft_vocab_size"] == 96
    head = load_head(str(folder / "head"), target)
    assert head.reads_post_norm_states and not isinstance(head, PublishedEagleHead)
    dec = SpeculativeDecoder(EagleDrafter(EagleConfig(depth=4, topk=3, total_tokens=10), target, head=head))
    for seed in (1, 2):
        ids = prompt_ids(12, seed=seed)
        ref = target.generate(ids, max_new_tokens=40, do_sample=False)
        assert torch.equal(target.generate(ids, max_new_tokens=40, do_sample=False, custom_generate=dec), ref)
    assert dec.last_stats.accepted_tokens > 0


def test_export_writes_the_published_layout_drafting_the_same_trees(trained, tmp_path):
    target, _, _, folder, _ = trained
    out = tmp_path / "published"
    assert main(["export", str(folder / "head"), "--format", "eagle", "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 1
    assert config["qkv_bias"] is (target.config.model_type == "qwen2") and config["vocab_size"] == 96
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "fc.weight" in names and "layers.0.post_attention_layernorm.weight" in names
    assert not any(k.startswith("layer.") or "input_layernorm" in k or k == "d2t" for k in names)
    assert isinstance(load_head(str(out), target), PublishedEagleHead)  # read as a published head
    assert eagle_trees(out, target) == eagle_trees(folder / "head", target)
    with pytest.raises(ValueError, match=r"EAGLE-1 head \(architecture eagle1\): export it as eagle"):
        export_head(str(folder / "head"), "eagle3-vllm", tmp_path / "bad")


def test_default_heads_are_refused_pointing_to_the_option(tmp_path):
    target = tiny_target("llama")
    EagleHeadModel(EagleHeadConfig.for_target(target, 64)).save_pretrained(tmp_path / "h")
    with pytest.raises(ValueError, match="input_layernorm.*--architecture eagle1"):
        export_head(str(tmp_path / "h"), "eagle", tmp_path / "out")
