"""`hf-spec train eagle3` on several processes (`hf_spec.training.distributed`), as `train eagle` runs there.

Fast tests run N "processes" as threads joined by an in-memory all-reduce (`tests/test_distributed_training.py`'s
`thread_processes`): the loss after N steps equals one process's with the same global batch, a run stopped and
resumed with the same or another process count ends with the uninterrupted run's weights, and the command writes
the head folder from the main process only. The slow tests launch real processes (`accelerate launch --multi_gpu
--num_processes 2`, gloo on this CPU) on stories260K's features.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import threading
from pathlib import Path

import pytest
import torch

from hf_spec.cli.main import main
from hf_spec.training import distributed
from hf_spec.training import eagle3 as eagle3_train
from hf_spec.training.eagle3 import Eagle3TrainConfig, train_eagle3
from tests.conftest import STORIES, make_tiny_model
from tests.test_distributed_training import (  # noqa: F401 - thread_processes is a fixture
    KILLER,
    LOSS_RTOL,
    WEIGHT_ATOL,
    Killed,
    _launch,
    _local,
    thread_processes,
    trainer_history,
)
from tests.test_train_eagle3 import KEYS, LAYERS, captured

CFG = Eagle3TrainConfig(
    align_steps=2, topk=4, draft_vocab=80, epochs=2, lr=2e-3, batch_tokens=128, heldout=0, save_every=2
)


@pytest.fixture
def eagle3_threads(thread_processes, monkeypatch):  # noqa: F811 - the imported fixture
    """`thread_processes` for EAGLE-3: every run (one process or several) starts from the same initial head, built
    once under a lock (threads share torch's global generator, which `train_eagle3` seeds), as processes seeded
    alike would build it; the CLI's `current_processes` sees the thread's place too."""
    real_head, built, lock = eagle3_train.Eagle3Head, {}, threading.Lock()

    def same_head(config):
        with lock:
            key = repr(config)  # a dataclass
            if key not in built:
                torch.manual_seed(0)
                built[key] = real_head(config)
            return copy.deepcopy(built[key])

    monkeypatch.setattr(eagle3_train, "Eagle3Head", same_head)
    monkeypatch.setattr(
        distributed, "current_processes", lambda: getattr(_local, "processes", distributed.Processes.single())
    )
    return lambda world, fn: thread_processes(world, fn, staggered=False)


@pytest.fixture(scope="module")
def tiny_eagle3_data(tmp_path_factory):
    model = make_tiny_model("qwen2", temperature=16.0)
    store = captured(model, tmp_path_factory.mktemp("eagle3-distributed") / "features", count=12, new=24)
    return model, store.load_sequences(keys=KEYS)


def test_eagle3_loss_matches_one_process_with_the_same_global_batch(
    tiny_eagle3_data, eagle3_threads, tmp_path
):
    model, sequences = tiny_eagle3_data

    def train(run):
        return lambda: train_eagle3(model, sequences, run, CFG, LAYERS, progress=False)

    (one, one_report), *_ = eagle3_threads(1, train(tmp_path / "one"))
    results = eagle3_threads(2, train(tmp_path / "two"))
    two, report = results[0]
    assert one_report["steps"] == report["steps"] > 4
    losses = [h["loss"] for h in trainer_history(tmp_path / "one")]
    assert [h["loss"] for h in trainer_history(tmp_path / "two")] == pytest.approx(
        losses, rel=LOSS_RTOL, abs=1e-4
    )
    for a, b in zip(one.state_dict().values(), two.state_dict().values(), strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=WEIGHT_ATOL)
    assert torch.equal(results[1][0].fc.weight, two.fc.weight)  # both processes end with the same head
    assert report["num_processes"] == 2 and one_report["num_processes"] == 1
    assert report["global_batch_tokens"] == CFG.batch_tokens


@pytest.mark.parametrize("resume_world", [2, 1])
def test_eagle3_killed_and_resumed_run_ends_with_the_uninterrupted_weights(
    tiny_eagle3_data, eagle3_threads, tmp_path, monkeypatch, resume_world
):
    """A 2-process run killed after its 4th step resumes from its checkpoint, with the same or another process
    count (the checkpoint holds the global state; the report names both counts)."""
    model, sequences = tiny_eagle3_data
    train = lambda run: lambda: train_eagle3(model, sequences, run, CFG, LAYERS, progress=False)  # noqa: E731
    whole, _ = eagle3_threads(2, train(tmp_path / "whole"))[0]
    real_train_head, calls = eagle3_train.train_head, {"n": 0}

    def stopping(*args, **kwargs):
        step_fn = args[5]

        def step(*a, **k):
            calls["n"] += 1
            if calls["n"] > 4 * 2:  # four steps on each of the two processes
                raise Killed
            return step_fn(*a, **k)

        return real_train_head(*args[:5], step, *args[6:], **kwargs)

    with monkeypatch.context() as m:
        m.setattr(eagle3_train, "train_head", stopping)
        with pytest.raises(Killed):
            eagle3_threads(2, train(tmp_path / "cut"))
    step = torch.load(tmp_path / "cut" / "checkpoint" / "checkpoint.pt", weights_only=False)["step"]
    assert 0 < step < len(trainer_history(tmp_path / "whole"))
    resumed, report = eagle3_threads(resume_world, train(tmp_path / "cut"))[0]
    for a, b in zip(whole.state_dict().values(), resumed.state_dict().values(), strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=10 * CFG.lr)
    assert [r["processes"] for r in report["num_processes_by_step"]] == [2, resume_world][: 3 - resume_world]
    losses = [h["loss"] for h in trainer_history(tmp_path / "whole")]
    assert [h["loss"] for h in trainer_history(tmp_path / "cut")] == pytest.approx(losses, rel=1e-2)


def _cli_args(features: Path, out: Path, run: Path, *extra: str) -> list[str]:
    return [
        "train", "eagle3", "--target", str(STORIES), "--features", str(features), "--out", str(out),
        "--checkpoint-dir", str(run), "--draft-vocab", "64", "--epochs", "1", "--heldout", "2",
        "--batch-tokens", "128", "--save-every", "1", "--dtype", "float32", "--threads", "1", *extra,
    ]  # fmt: skip


def test_eagle3_command_on_two_processes_writes_the_head_from_the_main_one(
    stories, eagle3_threads, tmp_path, keep_threads, monkeypatch
):
    model, _ = stories
    store = captured(model, tmp_path / "features", count=8, new=16)
    writes = []
    from hf_spec.methods.eagle3 import export as write

    real_save = write.save_eagle3_head
    monkeypatch.setattr(write, "save_eagle3_head", lambda *a, **k: writes.append(1) or real_save(*a, **k))
    args = _cli_args(store.folder, tmp_path / "head", tmp_path / "run")
    assert eagle3_threads(2, lambda: main(args)) == [0, 0]
    assert len(writes) == 1  # the main process alone
    report = json.loads((tmp_path / "head" / "training_report.json").read_text())
    assert report["num_processes"] == 2 and report["heldout"]["accuracy_by_depth"]


def test_eagle3_command_loads_the_target_in_8bit(stories, tmp_path, keep_threads, monkeypatch):
    """`--load-in-8bit` reaches the target's loading (bitsandbytes LLM.int8): the head trains on its
    unquantized embedding and LM head, which the fingerprint reads."""
    pytest.importorskip("bitsandbytes")
    from hf_spec.models import fetch

    model, _ = stories
    store = captured(model, tmp_path / "features", count=6, new=12)
    seen, real_load = [], fetch.load_model
    monkeypatch.setattr(fetch, "load_model", lambda *a, **k: seen.append(k) or real_load(*a, **k))
    assert main(_cli_args(store.folder, tmp_path / "head", tmp_path / "run", "--load-in-8bit")) == 0
    assert seen and seen[0].get("load_in_8bit") is True
    assert (tmp_path / "head" / "training_report.json").exists()


# ---- real processes: accelerate launch --multi_gpu --num_processes 2 (gloo on this CPU) ----------------------


def _run(argv: list[str], processes: int) -> None:
    proc = _launch(argv, processes, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, output[-3000:]


@pytest.fixture(scope="module")
def stories_features(stories, tmp_path_factory) -> Path:
    return captured(stories[0], tmp_path_factory.mktemp("stories") / "features", count=10, new=24).folder


@pytest.mark.slow
def test_eagle3_two_processes_match_one_on_stories(stories_features, tmp_path):
    _run(_cli_args(stories_features, tmp_path / "one", tmp_path / "run-one"), 1)
    _run(_cli_args(stories_features, tmp_path / "two", tmp_path / "run-two"), 2)
    one = json.loads((tmp_path / "one" / "training_report.json").read_text())
    two = json.loads((tmp_path / "two" / "training_report.json").read_text())
    assert two["num_processes"] == 2 and one["num_processes"] == 1
    assert two["global_batch_tokens"] == one["global_batch_tokens"] == 128
    assert two["steps"] == one["steps"]
    assert two["final_loss"] == pytest.approx(one["final_loss"], rel=1e-3)


@pytest.mark.slow
def test_eagle3_killed_and_resumed_two_processes_end_with_the_uninterrupted_weights(
    stories_features, tmp_path, monkeypatch
):
    _run(_cli_args(stories_features, tmp_path / "whole", tmp_path / "run-whole"), 2)
    total = json.loads((tmp_path / "whole" / "training_report.json").read_text())["steps"]
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(KILLER)
    path = os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])
    cut = _cli_args(stories_features, tmp_path / "cut", tmp_path / "run-cut")
    with monkeypatch.context() as env:
        env.setenv("PYTHONPATH", path)
        env.setenv("KILL_AFTER_STEP", str(total // 2))
        proc = _launch(cut, 2, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert proc.wait(timeout=900) != 0  # killed
    checkpoint = tmp_path / "run-cut" / "checkpoint" / "checkpoint.pt"
    assert torch.load(checkpoint, weights_only=False)["step"] == total // 2 > 0
    _run(cut, 2)
    whole = json.loads((tmp_path / "whole" / "training_report.json").read_text())
    resumed = json.loads((tmp_path / "cut" / "training_report.json").read_text())
    assert resumed["final_loss"] == whole["final_loss"]
    assert (tmp_path / "cut" / "model.safetensors").read_bytes() == (
        tmp_path / "whole" / "model.safetensors"
    ).read_bytes()
