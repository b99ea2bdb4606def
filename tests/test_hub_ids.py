"""Hub ids `org/name[@revision]` for heads, exit heads, configs and custom_generate folders, resolved offline from a
fake Hub cache laid out as the Hub client stores downloaded repos (`tests/fake_hub.py`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from hf_spec import SpeculativeDecoder
from hf_spec.core.hub_ids import HubIdError, parse_hub_id, resolve_folder, resolve_head_folder
from hf_spec.core.specs import HEAD_IN_THIS_FOLDER, parse_method
from hf_spec.heads.hub import save_head_folder
from hf_spec.methods.eagle import EagleConfig
from hf_spec.methods.eagle.modeling import EagleHeadConfig, EagleHeadModel
from hf_spec.methods.early_exit import EarlyExitConfig
from hf_spec.methods.early_exit.exit_heads import ExitHeads, load_exit_lm
from hf_spec.methods.pld.config import PLDConfig
from tests.conftest import make_tiny_model, prompt_ids
from tests.fake_hub import cache_repo
from tests.test_published_heads import write_eagle_checkpoint


def assert_lossless(target, spec, seeds=(1,), new: int = 24) -> SpeculativeDecoder:
    dec = SpeculativeDecoder(spec)
    for seed in seeds:
        ids = prompt_ids(12, seed=seed)
        ref = target.generate(ids, max_new_tokens=new, do_sample=False)
        assert torch.equal(
            target.generate(ids, max_new_tokens=new, do_sample=False, custom_generate=dec), ref
        )
    return dec


def test_parse_hub_id(tmp_path, monkeypatch):
    assert parse_hub_id("yuhuili/EAGLE-LLaMA3-Instruct-8B") == ("yuhuili/EAGLE-LLaMA3-Instruct-8B", None)
    assert parse_hub_id("org/name@v1.2") == ("org/name", "v1.2")
    assert parse_hub_id("org/name@refs/pr/3") == ("org/name", "refs/pr/3")
    for not_an_id in (
        "name",
        "a/b/c",
        "./org/name",
        "/abs/path",
        "org/na..me",
        "org/--x",
        "org/cfg.json",
        "",
    ):
        assert parse_hub_id(not_an_id) is None, not_an_id
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert parse_hub_id("org/name") is None  # an existing local folder always wins
    assert resolve_folder("org/name", "x") == "org/name"


def test_published_head_by_hub_id_and_revision(hub_cache, tmp_path):
    target = make_tiny_model("llama", temperature=16.0)
    write_eagle_checkpoint(tmp_path / "src", target, "bin", seed=2)
    snapshot = cache_repo(hub_cache, "yuhuili/EAGLE-tiny", tmp_path / "src", refs=("main", "v1"))
    assert resolve_head_folder("yuhuili/EAGLE-tiny", "eagle head") == str(snapshot)
    for spec in ("yuhuili/EAGLE-tiny", "yuhuili/EAGLE-tiny@v1", f"yuhuili/EAGLE-tiny@{snapshot.name}"):
        dec = assert_lossless(target, f"eagle:{spec}")
        assert dec.config.head == spec  # the config keeps the Hub id, not the cache path
        assert dec.last_stats.draft_tokens > 0


def test_not_cached_offline_is_a_clear_error(hub_cache, tmp_path):
    target = make_tiny_model("llama")
    with pytest.raises(
        HubIdError, match=r"'org/missing' is not in the local Hugging Face cache .*HF_HUB_OFFLINE"
    ):
        SpeculativeDecoder("eagle:org/missing").drafter_for(target)
    write_eagle_checkpoint(tmp_path / "src", target)
    cache_repo(hub_cache, "org/head", tmp_path / "src")
    with pytest.raises(
        HubIdError, match=r"'org/head' at revision 'v9' is not in the local Hugging Face cache"
    ):
        resolve_head_folder("org/head@v9", "eagle head")
    with pytest.raises(HubIdError, match=r"exit heads 'org/exits'.*not in the local"):
        load_exit_lm(target, "org/exits")


def test_hf_home_is_respected_in_a_fresh_process(tmp_path):
    """With HF_HOME and HF_HUB_OFFLINE=1 set before the Hub client is imported, as a user sets them."""
    home = tmp_path / "home"
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text("{}")
    (tmp_path / "src" / "model.safetensors").write_bytes(b"weights")
    snapshot = cache_repo(home / "hub", "org/head", tmp_path / "src")
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")}
    env |= {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    code = "from hf_spec.core.hub_ids import resolve_head_folder as r; print(r('org/head', 'head')); r('org/gone', 'head')"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == str(snapshot)
    assert "head 'org/gone'" in done.stderr and "HF_HUB_OFFLINE is set" in done.stderr


@pytest.fixture
def hf_spec_head_repo(hub_cache, tmp_path):
    """`(target, repo id)`: an hf-spec EAGLE head folder with its own recipe (`"head": "."`) in the Hub cache."""
    target = make_tiny_model("qwen2", temperature=16.0)
    torch.manual_seed(0)
    head = EagleHeadModel(EagleHeadConfig.for_target(target, 64)).attach_target(target)
    head.init_layer_from(target)
    save_head_folder(head, tmp_path / "head", EagleConfig(head=HEAD_IN_THIS_FOLDER, depth=3, topk=2), "card")
    cache_repo(hub_cache, "org/hf-spec-head", tmp_path / "head")
    return target, "org/hf-spec-head"


def test_hf_spec_head_and_its_recipe_by_hub_id(hf_spec_head_repo):
    target, repo = hf_spec_head_repo
    for spec in (f"eagle:{repo}", repo):  # the head, or the folder's recipe naming the head "."
        config = parse_method(spec)
        assert (config.head, config.depth, config.topk) == (repo, 3, 2)
        assert_lossless(target, spec)


def test_custom_generate_folder_by_hub_id(hf_spec_head_repo):
    """`generate(custom_generate=<Hub id>)`: transformers fetches the folder's generate.py from the cache; its
    recipe names the head "." and hf-spec resolves that to the same repo."""
    target, repo = hf_spec_head_repo
    ids = prompt_ids(12, seed=3)
    ref = target.generate(ids, max_new_tokens=20, do_sample=False)
    out = target.generate(
        ids, max_new_tokens=20, do_sample=False, custom_generate=repo, trust_remote_code=True
    )
    assert torch.equal(out, ref)


def test_config_by_hub_id(hub_cache, tmp_path):
    PLDConfig(num_draft_tokens=6, max_ngram=2).save_pretrained(tmp_path / "recipe")
    cache_repo(hub_cache, "org/pld-recipe", tmp_path / "recipe")
    for spec in ("org/pld-recipe", "pld:org/pld-recipe"):
        assert parse_method(spec) == PLDConfig(num_draft_tokens=6, max_ngram=2)
    with pytest.raises(ValueError, match="config is for method 'pld', not 'early-exit'"):
        parse_method("early-exit:org/pld-recipe")
    assert parse_method("pld:5") == PLDConfig(num_draft_tokens=5)  # a plain value is never a Hub id


def test_exit_heads_by_hub_id(hub_cache, tmp_path):
    target = make_tiny_model("llama", layers=4)
    heads = ExitHeads.for_target(target, [1, 2], rank=4)
    heads.save_pretrained(tmp_path / "exits")
    cache_repo(hub_cache, "org/exits", tmp_path / "exits")
    loaded = load_exit_lm(target, "org/exits").heads
    for (name, a), (_, b) in zip(heads.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.allclose(a.float(), b.float(), atol=1e-2), name
    assert_lossless(target, EarlyExitConfig(exit_layer=2, exit_heads="org/exits"))
