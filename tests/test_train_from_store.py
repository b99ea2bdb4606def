"""Head trainers fed from a feature store (`--features`, `training/store_data.py`) on the real stories260K model: a
selection of sources and tokens, read lazily; one fixed held-out set that no selection trains on, the same for
every trainer; clear refusals; and `lab/scaling_curve.py`, killed and re-run."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from hf_spec.cli.main import main
from hf_spec.training.features import FeatureStore, capture_sequences
from hf_spec.training.store_data import select, split_store
from tests.conftest import STORIES, make_tiny_model, prompt_ids

REPO = Path(__file__).resolve().parents[1]
LAYERS = (1, 2, 3)  # aux layers: the store serves EAGLE-3 too


def items(model) -> list[tuple[str, list[int], list[int]]]:
    """12 target answers, then 8 documentation pieces and 4 package pieces (a corpus captures answers first)."""
    out = []
    for i in range(12):
        ids = prompt_ids(8, vocab_size=512, seed=300 + i)
        answer = model.generate(ids, max_new_tokens=24, do_sample=False)[0].tolist()
        out.append((f"answers/a{i}", answer, [0] * 8 + [1] * (len(answer) - 8)))
    for i in range(12):
        ids = prompt_ids(30 + i, vocab_size=512, seed=400 + i)[0].tolist()
        source = "python-docs" if i < 8 else "pypi-docs-click"
        out.append((f"{source}/d{i}", ids, [0] + [1] * (len(ids) - 1)))
    return out


@pytest.fixture(scope="module")
def store(stories, tmp_path_factory) -> FeatureStore:
    model, _ = stories
    folder = tmp_path_factory.mktemp("store") / "features"
    # small shards: a selection spans several of them
    return capture_sequences(
        model, items(model), folder, topk=8, aux_layers=LAYERS, shard_tokens=200, progress=False
    )


def train_args(kind: str, store: FeatureStore, tmp: Path, *extra: str) -> list[str]:
    args = ["train", kind, "--target", str(STORIES), "--features", str(store.folder), "--heldout", "2"]
    args += ["--draft-vocab", "64", "--epochs", "1", "--batch-tokens", "256", "--threads", "1"]
    return [*args, "--out", str(tmp / "head"), "--checkpoint-dir", str(tmp / "run"), *extra]


@pytest.mark.parametrize("kind", ["eagle", "lyanna", "eagle3"])
def test_trainers_learn_from_a_store_selection_read_lazily(kind, store, tmp_path, keep_threads, monkeypatch):
    def whole_store(*args, **kwargs):
        raise AssertionError("the store was read whole")

    monkeypatch.setattr(FeatureStore, "load_sequences", whole_store)
    assert (
        main(train_args(kind, store, tmp_path, "--sources", "python-docs,pypi-*", "--limit-tokens", "150"))
        == 0
    )
    report = json.loads((tmp_path / "head" / "training_report.json").read_text())
    lengths = store.captured()
    chosen = select(store, "python-docs,pypi-*", 150)
    assert chosen == [
        "python-docs/d0",
        "python-docs/d1",
        "python-docs/d2",
        "python-docs/d3",
        "python-docs/d4",
    ]
    assert report["train_conversations"] == len(chosen)
    assert report["selected_tokens"] == sum(lengths[c] for c in chosen) >= 150
    # the fixed held-out set: two of the target's answers, the same whatever the selection
    assert report["heldout_sources"] == "answers" and report["heldout_conversations"] == 2
    assert report["heldout_ids"] == split_store(store, "ALL", None, "auto", 2).heldout
    assert len(report["heldout"]["accuracy_by_depth"]) == 4
    assert report["tokens_seen"] == report["train_tokens"] and report["tokens_per_second"] > 0
    assert report["wall_seconds"] >= 0 and report["features_dtype"] == "float32"


def test_heldout_set_is_fixed_and_never_trained_on(store):
    splits = [
        split_store(store, sources, limit, "auto", 3)
        for sources, limit in [("ALL", None), ("answers", None), ("answers", 60), ("python-docs,pypi-*", 100)]
    ]
    held = splits[0].heldout
    assert len(held) == 3 and all(h.startswith("answers/") for h in held)
    for split in splits:
        assert split.heldout == held and not set(split.train) & set(held)
    assert len(splits[1].train) == 9  # all answers but the held-out ones
    assert splits[2].train == splits[1].train[: len(splits[2].train)]  # a prefix of the same order
    assert all(c.startswith("answers/") for c in splits[1].train)
    # another source, or none: the trainer holds out from its own selection as it does without a store
    docs = split_store(store, "ALL", None, "python-docs", 2)
    assert len(docs.heldout) == 2 and all(h.startswith("python-docs/") for h in docs.heldout)
    assert split_store(store, "ALL", None, "none", 2).heldout == []
    assert split_store(store, "ALL", None, "auto", 0).heldout == []


def test_store_training_refusals(store, stories, tmp_path):
    def fails(message: str, *argv: str) -> None:
        with pytest.raises(ValueError, match=message):
            main(list(argv))

    base = train_args("eagle", store, tmp_path)
    fails(
        r"no sequences of sources 'sphinx' .*\(it holds: answers, python-docs", *base, "--sources", "sphinx"
    )
    fails("holds only 12 prompts of --heldout-sources 'answers'", *base, "--heldout", "13")
    fails(
        "outside the held-out set",
        *base,
        "--sources",
        "answers",
        "--heldout-sources",
        "answers",
        "--heldout",
        "12",
    )
    fails("give --prompts .* or --features", *base, "--prompts", str(tmp_path / "p.jsonl"))
    no_store = [a for a in base if a not in ("--features", str(store.folder))]
    fails("give --prompts", *no_store)
    fails("select from a store: give --features", *no_store, "--prompts", "p.jsonl", "--sources", "answers")
    fails("--topk 9 exceeds the 8 target probabilities", *base, "--topk", "9")
    # features of another target
    other = make_tiny_model("llama")
    foreign = capture_sequences(
        other, [("answers/x", [1, 5, 6, 7], [0, 1, 1, 1])], tmp_path / "foreign", progress=False
    )
    fails(
        "holds features of another target",
        *[str(foreign.folder) if a == str(store.folder) else a for a in base],
    )
    # a store without the tensors a trainer reads
    stripped = tmp_path / "stripped"
    stripped.mkdir()
    (stripped / "manifest.json").write_text((store.folder / "manifest.json").read_text())
    for shard in store.shards:
        tensors = load_file(store.folder / shard)
        save_file({k: v for k, v in tensors.items() if k != "topk_logp"}, stripped / shard)
    fails(
        r"has no \['topk_logp'\], which EAGLE training needs",
        *[str(stripped) if a == str(store.folder) else a for a in base],
    )


def scaling_module():
    spec = importlib.util.spec_from_file_location("scaling_curve", REPO / "lab" / "scaling_curve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_scaling_arms_are_parsed_and_sized_against_the_store(store, tmp_path):
    sc = scaling_module()
    assert sc.parse_arm("fixed:python-docs,pypi-*:120k") == {
        "name": "fixed",
        "sources": "python-docs,pypi-*",
        "tokens": 120_000,
    }
    assert sc.parse_arm("all:ALL:ALL")["tokens"] is None and sc.parse_tokens("0.4M") == 400_000
    for bad in ("a:b", "a b:answers:1", "a:answers:0", "a:answers:lots"):
        with pytest.raises(Exception, match="--arm|tokens must be"):
            sc.parse_arm(bad)
    argv = [
        "--target",
        str(STORIES),
        "--features",
        str(store.folder),
        "--out",
        str(tmp_path),
        "--heldout",
        "2",
    ]
    with pytest.raises(SystemExit, match="asks for 10,000,000 tokens of answers"):
        sc.plan_arms(sc.parse_args([*argv, "--arm", "big:answers:10M"]))
    (arm,) = sc.plan_arms(sc.parse_args([*argv, "--arm", "big:answers:10M", "--allow-short"]))
    available = split_store(store, "answers", None, "auto", 2).available_tokens
    assert arm["short"] and arm["limit"] == available and arm["requested"] == 10_000_000


def test_scaling_curve_killed_and_rerun_skips_finished_arms(store, tmp_path):
    out = tmp_path / "curve"
    cmd = [sys.executable, str(REPO / "lab" / "scaling_curve.py"), "--target", str(STORIES)]
    cmd += ["--features", str(store.folder), "--out", str(out), "--method", "eagle", "--heldout", "2"]
    cmd += ["--arm", "answers:answers:ALL", "--arm", "fixed:python-docs,pypi-*:200", "--threads", "1"]
    cmd += ["--", "--draft-vocab", "64", "--batch-tokens", "256", "--save-every", "1"]
    env = os.environ | {"HF_HUB_OFFLINE": "1"}
    first = out / "arms" / "answers" / "head" / "training_report.json"
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.time() + 600
    while not first.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)  # killed while the second arm trains (or just after it)
    proc.wait()
    assert first.exists(), proc.stdout.read()
    stamp = first.stat().st_mtime_ns
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "arm answers: skipped (finished earlier)" in done.stdout
    assert first.stat().st_mtime_ns == stamp
    results = json.loads((out / "results.json").read_text())
    rows = {r["arm"]: r for r in results["arms"]}
    assert rows["fixed"]["status"] in ("done", "skipped") and results["same_heldout_set"]
    assert rows["answers"]["trained_tokens"] > 0 and len(rows["fixed"]["heldout_accuracy_by_depth"]) == 4
    assert (
        rows["fixed"]["limit_tokens"] == 200
        and rows["answers"]["limit_tokens"] == rows["answers"]["trained_tokens"]
    )
    table = (out / "results.md").read_text()
    assert "| answers | `answers` |" in table and "| fixed | `python-docs,pypi-*` |" in table
    assert "commit" in table and "Machine:" in table
