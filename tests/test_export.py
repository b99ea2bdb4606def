"""`hf-spec export`: heads written in the layouts SGLang and vLLM load (the fields and names they read), and loaded
back through `eagle3:` / `eagle:` drafting the same trees as the original head; hf-spec's own EAGLE-3 head folder
format (`save_eagle3_head`) and what cannot be exported."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import DynamicCache, GenerationConfig

from hf_spec.cli.export import export_head
from hf_spec.cli.main import main
from hf_spec.core.drafter import SpecState
from hf_spec.engine.target.profile import target_profile
from hf_spec.io.integrity import CHECKSUM_FILE, IntegrityError
from hf_spec.methods.eagle import EagleConfig, EagleDrafter
from hf_spec.methods.eagle3 import (
    Eagle3Config,
    Eagle3Drafter,
    Eagle3Head,
    Eagle3HeadConfig,
    load_eagle3_head,
    save_eagle3_head,
)
from tests.conftest import CACHE, make_tiny_model, prompt_ids
from tests.eagle3_checkpoints import write_eagle3_checkpoint
from tests.test_reliability import as_saved_before_checksums

LAYERS = 7


@pytest.fixture(scope="module")
def target():
    return make_tiny_model("llama", layers=LAYERS, temperature=16.0)


def trees(drafter, target, layers, seeds=(1, 2, 3)) -> list[tuple[list[int], list[int]]]:
    """`(tokens, parents)` of the tree `drafter` proposes after each prompt's prefill."""
    out = []
    for seed in seeds:
        ids = prompt_ids(12, seed=seed)
        cache = DynamicCache(config=target.config)
        with torch.no_grad():
            o = target(input_ids=ids[:, :-1], **{CACHE: cache}, use_cache=True, output_hidden_states=True)
        hidden = torch.cat([o.hidden_states[i] for i in layers], -1)
        state = SpecState(
            target,
            cache,
            ids,
            GenerationConfig(),
            hidden_states=hidden,
            backend=target_profile(target).backend,
        )
        drafter.begin(state)
        tree = drafter.propose(state, max_depth=4)
        drafter.end(state)
        out.append((tree.tokens.tolist(), tree.parents.tolist()))
    return out


def eagle3_trees(folder_or_head, target):
    cfg = Eagle3Config(depth=4, topk=3, total_tokens=12)
    if isinstance(folder_or_head, Eagle3Head):
        drafter = Eagle3Drafter(cfg, target, head=folder_or_head)
    else:
        drafter = Eagle3Drafter(
            Eagle3Config(head=str(folder_or_head), depth=4, topk=3, total_tokens=12), target
        )
    return trees(drafter, target, drafter.hidden_state_layers)


def keys(folder) -> set[str]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return set(f.keys())


# ---- published EAGLE-3 heads ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "layout, ids, fmt",
    [
        ("authors", None, "eagle3-sglang"),
        ("sglang", [0, 3, 5], "eagle3-vllm"),
        ("vllm", [1, 4, 6], "eagle3-vllm"),
    ],
)
def test_eagle3_round_trip_drafts_the_same_trees(tmp_path, target, layout, ids, fmt):
    write_eagle3_checkpoint(tmp_path / "src", target, layout, ids, seed=5)
    extra = ["--target", str(tmp_path / "target")] if layout == "authors" else []
    if extra:
        target.save_pretrained(tmp_path / "target")
    assert (
        main(["export", str(tmp_path / "src"), "--format", fmt, "--out", str(tmp_path / "out"), *extra]) == 0
    )
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    indices = load_eagle3_head(str(tmp_path / "src"), target).config.hidden_state_indices
    if fmt == "eagle3-sglang":  # what SGLang's LlamaForCausalLMEagle3 reads
        assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 40
        assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in indices]
        assert any(k.startswith("midlayer.") for k in keys(tmp_path / "out"))
    else:  # what vLLM's speculators config reader and Eagle3LlamaForCausalLM read
        assert config["speculators_model_type"] == "eagle3" and config[
            "eagle_aux_hidden_state_layer_ids"
        ] == list(indices)
        assert config["transformer_layer_config"]["hidden_size"] == 32 and "norm_before_residual" in config
        assert "layers.0.hidden_norm.weight" in keys(tmp_path / "out")
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= keys(tmp_path / "out")
    assert eagle3_trees(tmp_path / "out", target) == eagle3_trees(tmp_path / "src", target)


def test_authors_heads_need_the_target_for_their_default_layers(tmp_path, target):
    write_eagle3_checkpoint(tmp_path / "src", target, "authors")
    with pytest.raises(ValueError, match="names no target layers.*--target"):
        export_head(str(tmp_path / "src"), "eagle3-vllm", tmp_path / "out")


def test_norm_before_residual_heads_have_no_sglang_layout(tmp_path, target):
    write_eagle3_checkpoint(tmp_path / "src", target, "vllm", [1, 4, 6])
    with pytest.raises(ValueError, match="norm_before_residual.*export it as eagle3-vllm"):
        export_head(str(tmp_path / "src"), "eagle3-sglang", tmp_path / "out")


# ---- hf-spec's own EAGLE-3 head folder ---------------------------------------------------------------------------
def test_own_head_format_saves_loads_and_exports(tmp_path, target):
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3HeadConfig.for_target(target, 50)).eval()  # 7 layers: states 2, 3, 4
    head.lm_head.weight.data.mul_(8.0)
    head.set_vocab_mapping(torch.randperm(96)[:50].sort().values)
    save_eagle3_head(tmp_path / "own", head, target=target, metadata={"training": {"steps": 0}})
    config = json.loads((tmp_path / "own" / "config.json").read_text())
    sidecar = json.loads((tmp_path / "own" / "hf_spec.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 50
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert sidecar["format"] == "hf_spec_eagle3" and sidecar["format_version"] == 1
    assert sidecar["hidden_state_indices"] == [2, 3, 4] and sidecar["target"]["num_hidden_layers"] == LAYERS
    assert sidecar["training"] == {"steps": 0}
    loaded = load_eagle3_head(str(tmp_path / "own"), target)
    for (name, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    want = eagle3_trees(head, target)
    assert eagle3_trees(tmp_path / "own", target) == want
    for fmt in ("eagle3-sglang", "eagle3-vllm"):
        export_head(str(tmp_path / "own"), fmt, tmp_path / fmt)
        assert json.loads((tmp_path / fmt / "hf_spec.json").read_text())["target"] == sidecar["target"]
        assert eagle3_trees(tmp_path / fmt, target) == want, fmt
    other = make_tiny_model("llama", seed=9, layers=LAYERS)  # same shapes, other weights
    with pytest.raises(ValueError, match="trained for a different llama model"):
        load_eagle3_head(str(tmp_path / "own"), other)


def flip_a_weight_byte(file) -> None:
    """Damage a safetensors file where it still parses: one byte of its last tensor's data."""
    data = bytearray(file.read_bytes())
    data[-3] ^= 0x40
    file.write_bytes(bytes(data))


def test_own_head_folders_carry_checksums_and_refuse_damaged_weights(tmp_path, target, caplog):
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3HeadConfig.for_target(target, 50)).eval()
    save_eagle3_head(tmp_path / "own", head, target=target)
    export_head(str(tmp_path / "own"), "eagle3-vllm", tmp_path / "vllm")
    for folder in (tmp_path / "own", tmp_path / "vllm"):
        listing = json.loads((folder / CHECKSUM_FILE).read_text())
        assert list(listing["files"]) == ["config.json", "hf_spec.json", "model.safetensors"]  # every file
        load_eagle3_head(str(folder), target)  # intact: loads
    flip_a_weight_byte(tmp_path / "own" / "model.safetensors")
    damaged = r"model\.safetensors does not match its checksum"
    with pytest.raises(IntegrityError, match=damaged):
        load_eagle3_head(str(tmp_path / "own"), target)
    with pytest.raises(IntegrityError, match=damaged):
        export_head(str(tmp_path / "own"), "eagle3-sglang", tmp_path / "again")
    # saving again over the damaged folder writes a new list
    save_eagle3_head(tmp_path / "own", head, target=target)
    load_eagle3_head(str(tmp_path / "own"), target)
    # hf-spec's folders from before checksums load with a warning; third-party folders have none and load quietly
    as_saved_before_checksums(tmp_path / "vllm")
    with caplog.at_level("WARNING", logger="hf_spec.io.integrity"):
        load_eagle3_head(str(tmp_path / "vllm"), target)
        assert "carries no checksum" in caplog.text
        caplog.clear()
        write_eagle3_checkpoint(tmp_path / "published", target, "sglang", [0, 3, 5])
        load_eagle3_head(str(tmp_path / "published"), target)
        assert "carries no checksum" not in caplog.text


def test_save_checks_a_state_dict_against_its_config(tmp_path, target):
    config = Eagle3HeadConfig.for_target(target, 50)
    state = Eagle3Head(config).state_dict()
    with pytest.raises(ValueError, match="pass the head's Eagle3HeadConfig"):
        save_eagle3_head(tmp_path / "x", state)
    with pytest.raises(ValueError, match=r"missing \['norm.weight'\]"):
        save_eagle3_head(tmp_path / "x", {k: v for k, v in state.items() if k != "norm.weight"}, config)


# ---- EAGLE-1/2 ----------------------------------------------------------------------------------------------------
def test_eagle_round_trip_drafts_the_same_trees(tmp_path, target):
    from tests.test_published_heads import write_eagle_checkpoint

    write_eagle_checkpoint(tmp_path / "src", target, "bin", seed=2, with_embed=True)
    export_head(str(tmp_path / "src"), "eagle", tmp_path / "out")
    assert keys(tmp_path / "out") == {
        k for k in torch.load(tmp_path / "src" / "pytorch_model.bin") if k != "embed_tokens.weight"
    }
    assert json.loads((tmp_path / "out" / "config.json").read_text())["bias"] is True
    assert (tmp_path / "out" / CHECKSUM_FILE).is_file()  # checked when hf-spec reads the export

    def eagle_trees(folder):
        drafter = EagleDrafter(EagleConfig(head=str(folder), depth=4, topk=3, total_tokens=12), target)
        return trees(drafter, target, (-1,))

    assert eagle_trees(tmp_path / "out") == eagle_trees(tmp_path / "src")
    with pytest.raises(ValueError, match="is an EAGLE-1/2 head: export it as eagle"):
        export_head(str(tmp_path / "src"), "eagle3-vllm", tmp_path / "bad")


def test_hf_spec_eagle_heads_are_refused_with_the_reason(tmp_path, target):
    from hf_spec.methods.eagle.modeling import EagleHeadConfig, EagleHeadModel

    EagleHeadModel(EagleHeadConfig.for_target(target, 64)).save_pretrained(tmp_path / "h")
    with pytest.raises(ValueError, match="hf_spec_eagle head.*input_layernorm.*final norm"):
        export_head(str(tmp_path / "h"), "eagle", tmp_path / "out")
