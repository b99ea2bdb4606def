"""Targets dispatched by accelerate (`device_map`, CPU and disk offload, `max_memory`, meta-initialised loading):
trees verify through accelerate's hooks, hf-spec's CPU kernels stay off, greedy output equals `generate`."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hf_spec.engine.target.placement import target_placement
from hf_spec.engine.target.profile import target_profile
from tests.conftest import STORIES
from tests.test_methods import decoder_for

PROMPT = torch.tensor([[1, 400, 30, 70, 400, 30, 70, 22, 400, 30]])
# stories260K's five layers on the CPU, on disk (accelerate loads each for its forward) and offloaded to CPU memory
MIXED_MAP = {
    "model.embed_tokens": "cpu",
    "model.rotary_emb": "cpu",
    "model.layers.0": "cpu",
    "model.layers.1": "disk",
    "model.layers.2": "cpu",
    "model.layers.3": "disk",
    "model.layers.4": "disk",
    "model.norm": "cpu",
    "lm_head": "cpu",
}


@pytest.fixture(scope="module")
def offloaded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("offload")
    return AutoModelForCausalLM.from_pretrained(STORIES, device_map=MIXED_MAP, offload_folder=folder).eval()


def assert_greedy_equal(model, spec: str, new: int = 30) -> None:
    ref = model.generate(PROMPT, max_new_tokens=new, do_sample=False)
    out = model.generate(
        PROMPT, max_new_tokens=new, do_sample=False, custom_generate=decoder_for(spec, model)
    )
    assert out[0].tolist() == ref[0].tolist(), spec


def test_offloaded_target_runs_stock_torch(offloaded):
    placement = target_placement(offloaded)
    assert placement.offloaded and placement.devices == ("cpu",) and not placement.cpu_kernels_apply
    profile = target_profile(offloaded)
    assert profile.backend.name == "torch" and not profile.can_screen  # the CPU kernels read resident weights
    assert profile.device == torch.device("cpu")


@pytest.mark.parametrize("spec", ["pld", "early-exit:2"])
def test_offloaded_target_decodes_as_its_own_generate(offloaded, spec):
    assert_greedy_equal(offloaded, spec)


@pytest.mark.slow
@pytest.mark.parametrize(
    "spec", ["oracle:4", "hispec", "lyanna", "retrieval", "talon", "postuse:early-exit:2"]
)
def test_every_method_on_an_offloaded_target(offloaded, spec):
    assert_greedy_equal(offloaded, spec)


def test_forcing_the_cpu_kernels_on_an_offloaded_target_is_refused(offloaded, monkeypatch):
    monkeypatch.setenv("HF_SPEC_BACKEND", "cpu")
    with pytest.raises(
        ValueError, match=r"HF_SPEC_BACKEND=cpu: hf-spec's CPU kernels cannot run this target"
    ):
        target_profile(offloaded)


@pytest.fixture(scope="module")
def all_on_disk(tmp_path_factory):
    """`device_map="auto"` within a `max_memory` too small for any layer: everything on disk, embedding and LM head
    too."""
    folder = tmp_path_factory.mktemp("disk")
    return AutoModelForCausalLM.from_pretrained(
        STORIES, device_map="auto", max_memory={"cpu": "200KB"}, offload_folder=folder
    ).eval()


@pytest.mark.parametrize("spec", ["pld", pytest.param("hispec", marks=pytest.mark.slow)])
def test_max_memory_offloads_everything_and_still_decodes(all_on_disk, spec):
    assert set(all_on_disk.hf_device_map.values()) == {"disk"}
    assert_greedy_equal(all_on_disk, spec, new=20)


def test_head_methods_name_an_offloaded_lm_head(all_on_disk):
    """EAGLE-style heads read the target's embedding and LM head weights themselves: offloaded, they are
    refused by name (the map should keep those two on a device)."""
    with pytest.raises(
        ValueError, match=r"fingerprint reads its (embedding|LM head), whose weight is offloaded"
    ):
        assert_greedy_equal(all_on_disk, "lyanna", new=4)


def test_meta_initialised_model_dispatched_by_accelerate(tmp_path):
    """Big-model inference as accelerate documents it: an empty (meta) model, then the checkpoint loaded and
    dispatched with layers offloaded to disk."""
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch

    config = AutoConfig.from_pretrained(STORIES)
    with init_empty_weights():
        empty = AutoModelForCausalLM.from_config(config)
    empty.tie_weights()  # the checkpoint holds the embedding only: the LM head shares it
    model = load_checkpoint_and_dispatch(
        empty, str(STORIES), device_map=MIXED_MAP, offload_folder=str(tmp_path), no_split_module_classes=[]
    ).eval()
    model.generation_config = AutoModelForCausalLM.from_pretrained(STORIES).generation_config
    assert target_placement(model).offloaded
    assert_greedy_equal(model, "pld")


def test_cli_loads_a_mapped_target(tmp_path, capsys):
    from hf_spec.cli.main import main

    map_arg = '{"model.embed_tokens": "cpu", "model.layers": "disk", "model.norm": "cpu", "lm_head": "cpu"}'
    argv = ["generate", "--target", str(STORIES), "--method", "pld", "--prompt", "Once upon a time"]
    argv += ["--dtype", "auto"]
    assert (
        main([*argv, "--max-new-tokens", "12", "--device-map", map_arg, "--offload-folder", str(tmp_path)])
        == 0
    )
    assert "identical to plain greedy generate: yes" in capsys.readouterr().out
    with pytest.raises(ValueError, match="give --device or --device-map, not both"):
        main([*argv, "--device", "cpu", "--device-map", "auto"])
