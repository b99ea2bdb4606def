"""`hf-spec eval-head`: a saved head's agreement on a store's fixed held-out set is the figure its training report
gives, for each head kind; other selections and bad input."""

from __future__ import annotations

import json

import pytest

from hf_spec.cli.main import main
from hf_spec.training.features import FeatureStore, capture_sequences
from hf_spec.training.head_eval import (
    head_agreement,
    head_method,
    held_out_from_training,
    load_for_evaluation,
)
from hf_spec.training.lazy_store import lazy_sequences
from hf_spec.training.store_data import HEAD_KEYS
from tests.conftest import STORIES, make_tiny_model, prompt_ids
from tests.eagle3_checkpoints import write_eagle3_checkpoint
from tests.fake_hub import cache_repo
from tests.test_published_heads import write_eagle_checkpoint

LAYERS = (1, 2, 3)


def answers_store(model, folder) -> FeatureStore:
    """The target's greedy answers to 8 prompts (source `answers`, so the store has a fixed held-out set) and 4
    texts of another source."""
    items = []
    for seed in range(12):
        ids = prompt_ids(10, seed=300 + seed)
        out = model.generate(ids, max_new_tokens=16, do_sample=False)[0].tolist()
        name = f"answers/a{seed}" if seed < 8 else f"text/t{seed}"
        items.append((name, out, [0] * 10 + [1] * (len(out) - 10)))
    return capture_sequences(model, items, folder, topk=8, aux_layers=LAYERS, progress=False)


@pytest.mark.parametrize(
    ("trainer", "method", "extra"),
    [
        ("eagle3", "eagle3", ["--save-dtype", "float32", "--align-steps", "2"]),
        ("eagle", "eagle", ["--align-steps", "2", "--topk", "4"]),
        ("lyanna", "lyanna", ["--chain-steps", "2"]),
    ],
)
def test_agreement_on_the_heldout_set_is_the_training_reports(
    stories, tmp_path, keep_threads, trainer, method, extra
):
    model, _ = stories
    store = answers_store(model, tmp_path / "features")
    head = tmp_path / "head"
    common = ["--target", str(STORIES), "--features", str(store.folder), "--threads", "1"]
    train = [
        "train",
        trainer,
        *common,
        "--out",
        str(head),
        "--draft-vocab",
        "64",
        "--epochs",
        "2",
        "--heldout",
        "2",
    ]
    assert main([*train, "--checkpoint-dir", str(tmp_path / "run"), "--lr", "3e-3", *extra]) == 0
    report = json.loads((head / "training_report.json").read_text())
    out = tmp_path / "agreement.json"
    args = [
        "eval-head",
        *common,
        "--head",
        str(head),
        "--heldout",
        "2",
        "--out",
        str(out),
    ]  # method: the head's
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["method"] == method and result["sequences"] == len(report["heldout_ids"]) == 2
    assert result["accuracy_by_depth"] == pytest.approx(report["heldout"]["accuracy_by_depth"], abs=2e-3)
    assert any(a > 0 for a in result["accuracy_by_depth"])
    assert result["held_out_from_training"] is True  # the report lists these ids as held out
    report_file = head / "training_report.json"
    saved = report_file.read_text()
    for start in ({"head": "elsewhere"}, {"head": "h", "training": report | {"heldout_ids": ["answers/a0"]}}):
        report_file.write_text(
            json.dumps(report | {"started_from": start})
        )  # a start head trained elsewhere or on them
        assert held_out_from_training(str(head), report["heldout_ids"]) is False
    report_file.write_text(
        saved
    )  # the folder's checksum list covers its report: loading it again needs it whole
    # another selection: every sequence of a source
    assert main([*args[:-2], "--sources", "text", "--depths", "5", "--out", str(out)]) == 0
    other = json.loads(out.read_text())
    assert other["sequences"] == 4 and len(other["accuracy_by_depth"]) == 5 and other["sources"] == "text"


def test_published_heads_are_evaluated_on_the_layers_they_read(tmp_path):
    target = make_tiny_model("llama", seed=5)
    store = answers_store(target, tmp_path / "features")
    sequences = list(lazy_sequences(store, set(store.ordered_ids()), (*HEAD_KEYS, "aux_features")))
    write_eagle_checkpoint(tmp_path / "eagle1", target)
    write_eagle3_checkpoint(tmp_path / "eagle3", target, "sglang", layer_ids=[0, 1, 2])  # states 1, 2, 3
    assert head_method(str(tmp_path / "eagle3")) == "eagle3" and head_method(str(tmp_path / "eagle1")) is None
    for method, name in (("eagle", "eagle1"), ("eagle3", "eagle3")):
        head = load_for_evaluation(method, str(tmp_path / name), target)
        result = head_agreement(method, head, target, sequences, store_layers=store.aux_layers)
        assert result["sequences"] == 12 and len(result["accuracy_by_depth"]) == 4
        assert all(0 <= a <= 1 for a in result["accuracy_by_depth"])
    # a published head says nothing of what it was trained on
    assert held_out_from_training(str(tmp_path / "eagle3"), store.ordered_ids()[:2]) is False
    with pytest.raises(
        ValueError, match=r"reads target layers \[1, 2, 3\], the features hold layers \[0, 1, 2\]"
    ):
        head_agreement("eagle3", head, target, sequences, store_layers=(0, 1, 2))  # a store of other layers


def test_a_head_by_hub_id_is_the_same_head(hub_cache, tmp_path):
    target = make_tiny_model("llama", seed=5)
    store = answers_store(target, tmp_path / "features")
    sequences = list(lazy_sequences(store, set(store.ordered_ids()), (*HEAD_KEYS, "aux_features")))
    write_eagle3_checkpoint(tmp_path / "eagle3", target, "sglang", layer_ids=[0, 1, 2], seed=4)
    cache_repo(hub_cache, "org/eagle3-head", tmp_path / "eagle3")
    results = [
        head_agreement(
            "eagle3", load_for_evaluation("eagle3", name, target), target, sequences, store_layers=(1, 2, 3)
        )
        for name in ("org/eagle3-head", str(tmp_path / "eagle3"))
    ]
    assert results[0] == results[1]
    assert held_out_from_training("org/eagle3-head", store.ordered_ids()[:2]) is False


def test_bad_input_is_refused_by_name(stories, tmp_path, keep_threads):
    model, _ = stories
    items = [(f"text/t{i}", prompt_ids(12, seed=i)[0].tolist(), [0] * 6 + [1] * 6) for i in range(4)]
    store = capture_sequences(model, items, tmp_path / "plain", topk=8, progress=False)  # no EAGLE-3 layers
    common = ["eval-head", "--target", str(STORIES), "--features", str(store.folder), "--head", str(tmp_path)]
    with pytest.raises(ValueError, match="does not say how it drafts"):
        main(common)
    with pytest.raises(ValueError, match="has no held-out set"):
        main([*common, "--method", "eagle"])
    with pytest.raises(ValueError, match="capture with --aux-layers eagle3"):
        main([*common, "--method", "eagle3", "--sources", "text"])
    with pytest.raises(ValueError, match="--limit-tokens selects from --sources"):
        main([*common, "--method", "eagle", "--limit-tokens", "5"])
    with pytest.raises(ValueError, match="no sequences of sources 'nothing'"):
        main([*common, "--method", "eagle", "--sources", "nothing"])
    with pytest.raises(SystemExit):
        main([*common, "--method", "eagle", "--depths", "2"])
    (tmp_path / "taken.json").write_text("not a result")
    with pytest.raises(ValueError, match="taken.json"):
        main([*common, "--method", "eagle", "--sources", "text", "--out", str(tmp_path / "taken.json")])
