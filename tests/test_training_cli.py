"""`hf-spec data` / `hf-spec train` end to end on the real 260K-parameter stories model: answers generated and
cached, features captured, a head trained, saved as a Hub-style folder, resumed, and used by generate."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_spec.cli.main import main
from hf_spec.methods.eagle.modeling import EagleHeadModel
from hf_spec.methods.head_drafter import load_draft_head
from hf_spec.methods.lyanna.modeling import LyannaHeadModel
from hf_spec.training.prompts import load_train_prompts
from hf_spec.training.responses import ResponseCache
from tests.conftest import STORIES


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "tasks.jsonl"
    rows = [
        {"id": f"t{i}", "instruction": f"Once upon a time there was a {w}"}
        for i, w in enumerate(["cat", "dog", "girl", "boy", "tree", "ball", "bird", "car"])
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _without(args: list[str], flag: str) -> list[str]:
    """`args` without `flag` and its value."""
    i = args.index(flag)
    return args[:i] + args[i + 2 :]


def _set(args: list[str], flag: str, value: str) -> list[str]:
    """`args` with `flag`'s value replaced."""
    i = args.index(flag)
    return [*args[: i + 1], value, *args[i + 2 :]]


def data_args(data, prompts_file) -> list[str]:
    return ["--target", str(STORIES), "--prompts", str(prompts_file), "--data-dir", str(data)]


def test_eval_sets_are_refused(tmp_path):
    bad = tmp_path / "eval" / "spec_bench_dev.jsonl"
    bad.parent.mkdir()
    bad.write_text("{}\n")
    with pytest.raises(ValueError, match="evaluation prompt set"):
        load_train_prompts(bad)


@pytest.mark.parametrize("kind", ["eagle", "lyanna"])
def test_train_cli_end_to_end_and_resume(tmp_path, prompts_file, kind):
    data, out = tmp_path / "data", tmp_path / "head"
    args = [
        "train",
        kind,
        *data_args(data, prompts_file),
        "--max-new-tokens",
        "24",
        "--batch-size",
        "4",
        "--draft-vocab",
        "256",
        "--epochs",
        "2",
        "--lr",
        "1e-3",
        "--batch-tokens",
        "256",
        "--heldout",
        "2",
        "--save-every",
        "2",
        "--out",
        str(out),
        "--checkpoint-dir",
        str(tmp_path / "run"),
        "--threads",
        "1",
    ]
    assert main(args) == 0
    assert len(ResponseCache(data).load()) == 8  # answers cached: a second run generates nothing
    report = json.loads((out / "training_report.json").read_text())
    assert report["steps"] > 0 and report["final_loss"] < report["first_loss"]
    assert (out / "custom_generate" / "generate.py").exists() and (out / "README.md").read_text().startswith(
        "---"
    )
    # resume: the finished checkpoint is picked up, no step is redone
    assert main(args) == 0
    again = json.loads((out / "training_report.json").read_text())
    assert again["steps"] == report["steps"] and again["final_loss"] == report["final_loss"]
    with pytest.raises(ValueError, match="holds a run on other data"):  # resuming on other data is refused
        main([*args, "--limit", "6"])
    with pytest.raises(ValueError, match=r"other settings \(draft_vocab 256 -> 128"):  # nor other settings
        main([*args, "--draft-vocab", "128"])
    # one --seed, one head: a fresh run elsewhere gives the same weights (the head's init was unseeded)
    twin = tmp_path / "twin"
    assert main([*args, "--out", str(twin), "--checkpoint-dir", str(tmp_path / "run2")]) == 0
    assert (twin / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    # training on from the saved head keeps its draft vocabulary and starts from its weights
    on = tmp_path / "on"
    tuned_args = _set(_without(args, "--draft-vocab"), "--lr", "1e-12")
    tuned_args = _set(_set(tuned_args, "--out", str(on)), "--checkpoint-dir", str(tmp_path / "run3"))
    assert main([*tuned_args, "--init-from", str(out)]) == 0
    head_cls = {"eagle": EagleHeadModel, "lyanna": LyannaHeadModel}[kind]
    target = AutoModelForCausalLM.from_pretrained(STORIES).eval()
    first, tuned = (load_draft_head(head_cls, str(f), target, kind) for f in (out, on))
    assert torch.equal(first.d2t, tuned.d2t)
    assert all(
        torch.allclose(a.float(), b.float(), atol=1e-5)
        for a, b in zip(first.state_dict().values(), tuned.state_dict().values(), strict=True)
    )
    on_report = json.loads((on / "training_report.json").read_text())
    assert on_report["config"]["extra"] == {"init_from": str(out)}
    assert on_report["started_from"]["training"]["final_loss"] == report["final_loss"]
    # the card names the start head by its folder's name (the training machine's paths are written portably)
    assert f"- Started from the head `{out.name}`, itself trained on " in (on / "README.md").read_text()
    elsewhere = [*_set(tuned_args, "--out", str(tmp_path / "x")), "--init-from", str(out)]
    with pytest.raises(ValueError, match="256-token draft vocabulary, the training config asks for 128"):
        main([*elsewhere, "--draft-vocab", "128"])
    with pytest.raises(ValueError, match="give one"):
        main([*elsewhere, "--init-from-last-layer"])
    shape = ["--architecture", "eagle1"] if kind == "eagle" else ["--token-info-rank", "8"]
    with pytest.raises(ValueError, match="the head to start from has .*, this run asks for"):
        main([*elsewhere, *shape])
    foreign = tmp_path / "a-model"  # a folder holding something else is refused before any work
    foreign.mkdir()
    (foreign / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match=r"already holds other files \(config.json\)"):
        main([*args, "--out", str(foreign)])

    tok = AutoTokenizer.from_pretrained(STORIES)
    model = AutoModelForCausalLM.from_pretrained(STORIES).eval()
    ids = tok("Once upon a time there was a frog", return_tensors="pt").input_ids
    ref = model.generate(ids, max_new_tokens=32, do_sample=False)
    out_ids = model.generate(
        ids, max_new_tokens=32, do_sample=False, custom_generate=str(out), trust_remote_code=True
    )
    assert torch.equal(out_ids, ref)


def test_eagle3_trains_on_the_answers_to_prompts(tmp_path, prompts_file, keep_threads):
    """`train eagle3 --prompts`: answers, features with the head's layers (kept apart from the other heads' store)
    and training in one command; `data features --prompts --aux-layers` captures the same store beforehand."""
    from hf_spec.methods.eagle3.drafter import load_eagle3_head
    from hf_spec.training.features import FeatureStore

    data, out = tmp_path / "data", tmp_path / "head"
    common = [*data_args(data, prompts_file), "--max-new-tokens", "16", "--threads", "1"]
    assert main(["data", "features", *common, "--aux-layers", "1,2,3"]) == 0
    store = FeatureStore.open(data / "features-aux-1-2-3")
    assert store.aux_layers == [1, 2, 3] and store.shards and not (data / "features").exists()
    captured = list(store.shards)
    train = [
        "train",
        "eagle3",
        *common,
        "--aux-layers",
        "1,2,3",
        "--draft-vocab",
        "64",
        "--batch-tokens",
        "64",
    ]
    train += [
        "--heldout",
        "2",
        "--out",
        str(out),
        "--checkpoint-dir",
        str(tmp_path / "run"),
        "--eval-every",
        "1",
    ]
    assert main(train) == 0
    assert FeatureStore.open(store.folder).shards == captured  # the answers' features were not captured again
    report = json.loads((out / "training_report.json").read_text())
    assert report["prompt_files"] == [str(prompts_file)] and len(report["heldout"]["accuracy_by_depth"]) == 4
    # --eval-every 1: the held-out set after every step but the last (which "heldout" is)
    assert report["steps"] > 2
    assert [e["step"] for e in report["heldout_by_step"]] == list(range(1, report["steps"]))
    assert all(len(e["accuracy_by_depth"]) == 4 for e in report["heldout_by_step"])
    assert "(prompts: `tasks.jsonl`;" in (out / "README.md").read_text()
    model = AutoModelForCausalLM.from_pretrained(STORIES).eval()
    assert load_eagle3_head(str(out), model).config.hidden_state_indices == (1, 2, 3)
    # training on from it, on the same prompts: the answers' features are read at the head's own layers (this
    # 5-layer target has no three distinct default EAGLE-3 layers), from the same store
    on = _set(
        _set(_without(train, "--aux-layers"), "--out", str(tmp_path / "on")),
        "--checkpoint-dir",
        str(tmp_path / "r2"),
    )
    assert main([*on, "--init-from", str(out), "--lr", "1e-12"]) == 0
    assert FeatureStore.open(store.folder).shards == captured
    # eval-head on the answers to the same prompts: read from the same store, at the head's layers
    result = tmp_path / "agreement.json"
    assert main(["eval-head", *common, "--head", str(out), "--out", str(result)]) == 0
    agreement = json.loads(result.read_text())
    assert (
        agreement["method"] == "eagle3"
        and agreement["sequences"] == 8
        and len(agreement["accuracy_by_depth"]) == 4
    )
    assert agreement["sources"] == f"answers to {prompts_file}" and "held_out_from_training" not in agreement
    assert FeatureStore.open(store.folder).shards == captured
    with pytest.raises(ValueError, match="one of them"):
        main([*train, "--features", str(store.folder)])
    no_prompts = [a for a in train if a not in ("--prompts", str(prompts_file))]
    with pytest.raises(ValueError, match="--aux-layers goes with --prompts"):
        main([*no_prompts, "--features", str(store.folder)])


def test_head_card_lists_measured_rows_with_their_config():
    from hf_spec.heads.card import head_card

    row = {"method": "eagle:c.json", "prompts": 13, "tau": 1.5, "speedup": 1.1, "machine": "cpu", "date": "d"}
    rows = [row | {"command": "hf-spec bench A"}, row | {"tau": 1.2, "command": "hf-spec bench A"}]
    card = head_card("HASS", "eagle", "t", {"config": {}}, "cmd", rows)
    assert "| `eagle:c.json` | 13 | 1.50 | 1.10x | cpu | d |" in card and "| 1.20 |" in card
    assert card.count("- `hf-spec bench A`") == 1  # one line per distinct command


def test_head_card_names_the_training_prompt_files():
    from hf_spec.heads.card import head_card

    recorded = head_card("HASS", "eagle", "t", {"prompt_files": ["a/x.json"]}, "cmd")
    from_command = head_card("HASS", "eagle", "t", {"command": "hf-spec train eagle --prompts d/s.json"}, "c")
    default = head_card("HASS", "eagle", "t", {"command": "hf-spec train eagle"}, "c")
    assert "(prompts: `x.json`;" in recorded and "(prompts: `s.json`;" in from_command
    assert "(prompts: `sharegpt_1000.json`, `alpaca_seed_tasks.jsonl`;" in default


def test_head_card_of_a_head_trained_on_from_others_shows_each_start_head():
    from hf_spec.heads.card import head_card

    base = {
        "features": "s/store",
        "train_tokens": 9,
        "steps": 3,
        "epochs": 1.0,
        "wall_seconds": 7200,
        "config": {"lr": 0.1, "batch_tokens": 8},
        "heldout": {"accuracy_by_depth": [0.5]},
        "command": "first",
    }
    middle = {"features": "s/store", "steps": 2, "started_from": {"head": "base-head", "training": base}}
    top = {
        "wall_seconds": 1800,
        "started_from": {"head": "mid-head", "training": middle | {"wall_seconds": 3600}},
    }
    card = head_card("EAGLE-3", "eagle3", "t", top, "c")
    assert "- Training time: 0.50 h (3.50 h with the start head's own training)." in card
    assert "- Started from the head `mid-head`, itself trained on " in card
    assert "- Started from the head `base-head`, itself trained on " in card
    assert (
        "`store` (sources: all; never evaluation prompts), 9 tokens" in card
        and "; 2.00 h. Its command: `first`" in card
    )
    elsewhere = head_card("EAGLE-3", "eagle3", "t", {"started_from": {"head": "org/published"}}, "c")
    assert (
        "- Started from the head `org/published` (trained elsewhere: no hf-spec training report)."
        in elsewhere
    )


def test_data_responses_in_bfloat16_are_tagged_and_feed_float32_features(
    tmp_path, prompts_file, capsys, keep_threads
):
    """Answers generated by the bfloat16 target carry their dtype; features are still captured in float32 (the
    target fingerprint of the cache) from those answers."""
    data = tmp_path / "data"
    common = [*data_args(data, prompts_file), "--limit", "3"]
    answers = [
        "data",
        "responses",
        *common,
        "--max-new-tokens",
        "16",
        "--dtype",
        "bfloat16",
        "--threads",
        "1",
    ]
    assert main(answers) == 0
    cached = ResponseCache(data).load()
    assert len(cached) == 3 and {c.source for c in cached.values()} == {"generated-bfloat16"}
    assert main(["data", "features", *common, "--cached-only", "--threads", "1"]) == 0
    assert "features: " in capsys.readouterr().out
    manifest = json.loads((data / "features" / "manifest.json").read_text())
    assert len(manifest["done"]) == 3 and manifest["num_tokens"] > 0


def test_training_schedule_covers_every_epoch_whatever_its_batch_count():
    """Reshuffled epochs pack into different numbers of batches; the schedule must follow each epoch's own count
    (a fixed steps-per-epoch from epoch 0 ran past the end of a shorter epoch)."""
    from hf_spec.training.batches import epoch_batches, training_schedule

    rng = random.Random(1)  # more than one 256-sequence sorting window, so packing depends on the shuffle
    lengths = [rng.randint(3, 1000) for _ in range(700)]
    counts = [len(epoch_batches(lengths, 1024, 0, e)) for e in range(4)]
    assert len(set(counts)) > 1  # the case that broke a run
    schedule = training_schedule(lengths, 1024, 0, 4)
    assert len(schedule) == sum(counts)
    start = 0
    for count in counts:  # each whole epoch sees every sequence once
        assert sorted(i for batch in schedule[start : start + count] for i in batch) == list(
            range(len(lengths))
        )
        start += count
    assert len(training_schedule(lengths, 1024, 0, 1.5)) == counts[0] + math.ceil(counts[1] / 2)


def test_continue_cut_answers_equal_longer_generation_and_are_recaptured(
    tmp_path, prompts_file, keep_threads
):
    """Answers cut by an 8-token budget, continued to 16 with `--continue-cut`, are what a 16-token run writes;
    their features are captured again and the newer copy replaces the old one in place."""
    from hf_spec.training.features import FeatureStore

    def answers(data, *extra):
        args = ["data", "responses", *data_args(data, prompts_file), "--limit", "4", "--threads", "1"]
        assert main([*args, *extra]) == 0
        return ResponseCache(data).load()

    def features(data):
        assert (
            main(["data", "features", *data_args(data, prompts_file), "--limit", "4", "--cached-only"]) == 0
        )
        return FeatureStore.open(data / "features")

    grown, direct = tmp_path / "grown", tmp_path / "direct"
    short = answers(grown, "--max-new-tokens", "8")
    first = features(grown).load_sequences()
    assert answers(grown, "--max-new-tokens", "16") == short  # without the flag, cut answers stay as they are
    longer = answers(grown, "--max-new-tokens", "16", "--continue-cut")
    reference = answers(direct, "--max-new-tokens", "16")
    assert {k: c.response_ids for k, c in longer.items()} == {k: c.response_ids for k, c in reference.items()}
    cut = [k for k, c in short.items() if len(c.response_ids) == 8 and c.response_ids[-1] != 2]
    assert cut and all(longer[k].source == "generated+generated" for k in cut)
    store = features(grown)
    assert len(store.done) == 4 + len(cut)  # the cut ones captured again
    again = store.load_sequences()
    assert [len(s["input_ids"]) for s in again] == [
        len(longer[k].input_ids) for k in dict.fromkeys(store.done)
    ]
    assert len(again) == len(first) and torch.equal(again[0]["input_ids"][:5], first[0]["input_ids"][:5])


def test_seed_answers_as_long_as_the_seeds_budget_are_not_marked_finished(tmp_path):
    from hf_spec.training.responses import chat_prompt_text, import_seed

    tok = AutoTokenizer.from_pretrained(STORIES)
    prompts = load_train_prompts(story_prompts_file(tmp_path))
    rows = [
        {"id": p.id, "prompt": chat_prompt_text(tok, p), "response": "a cat sat", "response_tokens": n}
        for p, n in zip(prompts, [3, 6, 6], strict=True)
    ]
    seed = tmp_path / "seed.jsonl"
    seed.write_text("".join(json.dumps(r) + "\n" for r in rows))
    convs = import_seed(seed, tok, prompts, eos_token_id=2, max_new_tokens=64)
    assert [c.response_ids[-1] == 2 for c in convs] == [
        True,
        False,
        False,
    ]  # 6 = the seed's budget: cut there


def story_prompts_file(folder):
    path = folder / "prompts.jsonl"
    path.write_text(
        "".join(json.dumps({"id": f"s{i}", "instruction": f"Tell a story {i}"}) + "\n" for i in range(3))
    )
    return path


def test_sampled_answers_are_extra_conversations_seeded_and_held_out_with_their_prompt(
    tmp_path, prompts_file, keep_threads
):
    """`--samples 2`: two sampled answers per prompt beside the unchanged greedy one, reproducible, cached (a second
    run adds nothing), and a held-out prompt takes its sampled answers with it."""
    from hf_spec.training.responses import SAMPLE_MARK, prompt_id_of
    from hf_spec.training.trainer import split_heldout

    def answers(data, *extra):
        args = ["data", "responses", *data_args(data, prompts_file), "--limit", "3", "--threads", "1"]
        assert main([*args, "--max-new-tokens", "12", *extra]) == 0
        return ResponseCache(data).load()

    greedy = answers(tmp_path / "greedy")
    both = answers(tmp_path / "sampled", "--samples", "2", "--temperature", "1.0")
    again = answers(tmp_path / "again", "--samples", "2", "--temperature", "1.0")
    sampled = {k: c for k, c in both.items() if SAMPLE_MARK in k}
    assert len(sampled) == 6 and {prompt_id_of(k) for k in sampled} == set(greedy)
    assert {k: c.response_ids for k, c in both.items() if k in greedy} == {
        k: c.response_ids for k, c in greedy.items()
    }
    assert all(
        c.source == "generated-t1" and c.prompt_ids == both[prompt_id_of(k)].prompt_ids
        for k, c in sampled.items()
    )
    assert any(c.response_ids != greedy[prompt_id_of(k)].response_ids for k, c in sampled.items())
    assert {k: c.response_ids for k, c in again.items()} == {k: c.response_ids for k, c in both.items()}
    lines = (tmp_path / "sampled" / "responses.jsonl").read_text().count("\n")
    answers(tmp_path / "sampled", "--samples", "2", "--temperature", "1.0")
    assert (tmp_path / "sampled" / "responses.jsonl").read_text().count("\n") == lines

    ids = [f"p{i}" for i in range(8)] + [f"p{i}{SAMPLE_MARK}1" for i in range(8)]
    sequences = [{"id": i} for i in ids]
    train, held = split_heldout(sequences, 2, [prompt_id_of(i) for i in ids])
    assert sorted(s["id"] for s in held) == ["p0", f"p0{SAMPLE_MARK}1", "p4", f"p4{SAMPLE_MARK}1"]
    assert len(train) == 12
    # without groups (or with only greedy answers) the split is the one of earlier runs: every k-th sequence
    assert split_heldout(sequences[:8], 2) == split_heldout(sequences[:8], 2, ids[:8])
    with pytest.raises(
        SystemExit
    ):  # refused by the command line (`--temperature: must be a finite number...`)
        answers(tmp_path / "bad", "--samples", "1", "--temperature", "0")


def test_exit_training_needs_rows_on_both_sides_of_the_split(tmp_path):
    data = tmp_path / "responses.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Q{i}", "response": "A story."}) + "\n" for i in range(3)))
    args = ["train", "exits", "--target", str(STORIES), "--layers", "2", "--responses", str(data)]
    with pytest.raises(ValueError, match=r"holds 3 rows: --heldout 24 must leave rows on both sides"):
        main([*args, "--out", str(tmp_path / "exits")])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["train", "eagle", "--draft-vocab", "0"],
            "argument --draft-vocab: must be an integer >= 1, got '0'",
        ),
        (["train", "eagle", "--epochs", "nan"], "argument --epochs: must be a finite number in (0, inf)"),
        (["train", "lyanna", "--chain-steps", "-2"], "argument --chain-steps: must be an integer >= 1"),
        (
            ["train", "exits", "--layers", "2", "--max-len", "1"],
            "argument --max-len: must be an integer >= 2",
        ),
        (["data", "responses", "--batch-size", "0"], "argument --batch-size: must be an integer >= 1"),
        (["datastore", "build", "--threads", "-1"], "argument --threads: must be an integer >= 1"),
    ],
)
def test_nonsense_sizes_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--target", "x", "--out", "y"])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_answer_cache_belongs_to_the_target_that_wrote_it(tmp_path):
    """Answers are the target's own: a cache written by one target is refused for another (was: reused silently,
    e.g. two model folders of the same name sharing `$HF_SPEC_CACHE/data/<name>`)."""
    from tests.conftest import make_tiny_model

    cache = ResponseCache(tmp_path / "data")
    llama = make_tiny_model("llama")
    cache.bind_target(llama)
    cache.bind_target(llama)  # the same target again: fine
    with pytest.raises(ValueError, match="holds another target's answers"):
        cache.bind_target(make_tiny_model("qwen2"))


def test_a_checkpoint_from_before_a_setting_existed_resumes_with_its_default(tmp_path):
    """A run recorded before `architecture` existed was an hf-spec-layout run: it resumes as one, not another."""
    from hf_spec.training.trainer import check_resumable

    saved = {"training": {"lr": 1e-3}, "head": {"hidden_size": 8}}
    check_resumable(
        saved, {"training": {"lr": 1e-3, "architecture": "hf-spec"}, "head": {"hidden_size": 8}}, tmp_path
    )
    with pytest.raises(ValueError, match="architecture 'hf-spec' -> 'eagle1'"):
        check_resumable(
            saved, {"training": {"lr": 1e-3, "architecture": "eagle1"}, "head": {"hidden_size": 8}}, tmp_path
        )


def test_init_from_last_layer_reaches_the_training_config():
    """`--init-from-last-layer` (named in the errors a quantized target gives) is a flag of the head trainers."""
    from hf_spec.cli.main import build_parser
    from hf_spec.cli.training_args import common_train_config

    for kind in ("eagle", "lyanna"):
        args = build_parser().parse_args(
            ["train", kind, "--target", "t", "--prompts", "p.json", "--out", "o", "--init-from-last-layer"]
        )
        assert common_train_config(args)["init_from_last_layer"] is True


def test_exit_heads_record_the_command_and_time_as_given(tmp_path, keep_threads):
    """The exit heads' config carries the command line as it was typed, every flag included, and the card the same
    with the training machine's paths written portably; the card also gives the training time."""
    from hf_spec.heads.card import portable_paths

    data = tmp_path / "responses.jsonl"
    story = "Once upon a time there was a little girl named Lily. She liked to play outside."
    data.write_text(
        "".join(json.dumps({"prompt": f"Tell story {i}.", "response": story}) + "\n" for i in range(6))
    )
    out = tmp_path / "exits"
    argv = ["train", "exits", "--target", str(STORIES), "--layers", "2", "--responses", str(data), "--out", str(out),
            "--heldout", "2", "--steps", "2", "--batch-size", "8", "--negatives", "4", "--draft-vocab", "64",
            "--threads", "1"]  # fmt: skip
    assert main(argv) == 0
    command = "hf-spec " + " ".join(argv)
    assert json.loads((out / "config.json").read_text())["training"]["command"] == command
    card = (out / "README.md").read_text()
    assert portable_paths(command) in card and str(tmp_path) not in card
    # the fit's wall time and throughput: 2 steps of 8 positions
    (line,) = [x for x in card.splitlines() if x.startswith("- Training time: ")]
    assert " fitting with 1 thread on " in line and line.endswith(" trained positions/s.")
