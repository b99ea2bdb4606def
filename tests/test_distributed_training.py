"""Head training on several processes (`hf_spec.training.distributed`).

Fast tests run N "processes" as threads of this process, joined by an in-memory all-reduce that stands in for
accelerate's (`ThreadGroup`): the loss after N steps equals one process's with the same global batch, and a run
stopped and resumed with another process count ends with the same weights. The slow tests launch real processes
with `accelerate launch --multi_gpu --num_processes 2` (gloo on this CPU) on stories260K.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from hf_spec.training import eagle as eagle_train
from hf_spec.training import exits as exits_train
from hf_spec.training import trainer
from hf_spec.training.distributed import Processes
from hf_spec.training.eagle import EagleTrainConfig, train_eagle
from hf_spec.training.features import capture_features
from tests.conftest import STORIES, make_tiny_model
from tests.test_eagle import tiny_conversations

# a global batch split over processes gives one process's loss up to float summation order; after a few steps
# the losses agree to 1e-3 and the weights to a few learning rates (Adam's step is about lr whatever the gradient's
# size, so summation noise in a near-zero gradient can flip a step's sign)
LOSS_RTOL = 1e-3
WEIGHT_ATOL = 3 * 2e-3


class ThreadGroup:
    """An all-reduce among `world` threads: each thread's `Accelerator` stand-in is `group.member(rank)`."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=120)
        self.slots: list[torch.Tensor | None] = [None] * world

    def member(self, rank: int):
        group = self

        class Member:
            process_index, num_processes, device = rank, group.world, torch.device("cpu")

            def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
                assert reduction == "sum"
                group.slots[rank] = tensor.clone()
                group.barrier.wait()
                total = sum(group.slots[1:], group.slots[0].clone())  # in rank order, as a ring would
                group.barrier.wait()
                return total

            def wait_for_everyone(self) -> None:
                group.barrier.wait()

            @contextlib.contextmanager
            def main_process_first(self):
                if rank:
                    group.barrier.wait()
                yield
                if not rank:
                    group.barrier.wait()

        return Member()


_local = threading.local()


@pytest.fixture
def thread_processes(monkeypatch):
    """`run(world, fn)`: `fn()` on `world` threads, each seeing itself as one of `world` processes; returns the
    results by rank (one process: `fn()` in this thread)."""
    for module in (trainer, exits_train):
        monkeypatch.setattr(
            module, "current_processes", lambda: getattr(_local, "processes", Processes.single())
        )
    # threads share torch's global generator, which `train_eagle` and `train_head` seed: the first thread builds
    # the initial head from the seed while the others wait, and every later build (of the same config) gets a copy
    # of it, as separate processes seeded alike would build it
    turn, real_head, built = threading.Condition(), eagle_train.EagleHeadModel, {}

    def head_then_next(config):
        key = config.to_json_string()
        if key not in built:
            built[key] = real_head(config)
        head = copy.deepcopy(built[key])
        started = getattr(_local, "turn", None)  # None: one process, in the test's own thread
        if started is not None:
            with turn:
                started[0] += 1
                turn.notify_all()
        return head

    monkeypatch.setattr(eagle_train, "EagleHeadModel", head_then_next)

    def run(world: int, fn, staggered: bool = True):
        """`staggered`: each thread starts once the one before has built its EAGLE head."""
        if world == 1:
            return [fn()]
        group, results, errors, started = ThreadGroup(world), [None] * world, [], [0 if staggered else world]

        def worker(rank: int) -> None:
            _local.processes, _local.turn = Processes(rank, world, group.member(rank)), started
            torch.set_num_threads(1)
            try:
                with turn:
                    turn.wait_for(lambda: started[0] >= rank or errors)
                results[rank] = fn()
            except BaseException as err:  # noqa: BLE001 - reported in the main thread
                errors.append(err)
                group.barrier.abort()
                with turn:
                    turn.notify_all()

        threads = [threading.Thread(target=worker, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results

    return run


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    model = make_tiny_model("llama", temperature=16.0)
    folder = tmp_path_factory.mktemp("distributed")
    store = capture_features(
        model, tiny_conversations(model, count=12), folder / "data", topk=8, progress=False
    )
    return model, store.load_sequences(), folder


CFG = EagleTrainConfig(draft_vocab=80, epochs=3, lr=2e-3, batch_tokens=384, heldout=0, save_every=2)


def test_accelerate_cpu_launch_that_started_one_process_is_refused(monkeypatch):
    """`accelerate launch --cpu --num_processes 2` without MPI runs ONE process (with a rendezvous address for
    two): training alone would silently do what one process does, so it is refused with the launch that works."""
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match=r"started ONE process.*torchrun --nproc_per_node N"):
        Processes.start()


def test_shard_deals_every_item_once_and_keeps_empty_processes_in_step():
    assert [Processes(r, 3).shard([5, 6, 7, 8]) for r in range(3)] == [
        ([5, 8], True),
        ([6], True),
        ([7], True),
    ]
    assert Processes(1, 2).shard([9]) == ([9], False)  # computed with weight 0, to join the gradient sum


@pytest.mark.parametrize("world", [2, 3])
def test_loss_matches_one_process_with_the_same_global_batch(tiny_data, thread_processes, tmp_path, world):
    model, sequences, _ = tiny_data

    def train(out):
        return lambda: train_eagle(model, sequences, out, CFG, progress=False)

    (one, one_report), *_ = thread_processes(1, train(tmp_path / "one"))
    results = thread_processes(world, train(tmp_path / "many"))
    many, report = results[0]
    losses = [h["loss"] for h in trainer_history(tmp_path / "one")]
    assert [h["loss"] for h in trainer_history(tmp_path / "many")] == pytest.approx(
        losses, rel=LOSS_RTOL, abs=1e-4
    )
    for a, b in zip(one.state_dict().values(), many.state_dict().values(), strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=WEIGHT_ATOL)
    for other, _ in results[1:]:  # every process ends with the same head
        assert torch.equal(other.fc.weight, many.fc.weight)
    assert report["num_processes"] == world and report["global_batch_tokens"] == CFG.batch_tokens
    assert one_report["num_processes"] == 1


def trainer_history(run: Path) -> list[dict]:
    return torch.load(run / "checkpoint" / "checkpoint.pt", weights_only=False)["extra"]["history"]


class Killed(Exception):
    pass


def train_until_killed(thread_processes, world: int, run, monkeypatch, model, sequences) -> int:
    """Train on `world` threads until the 5th step raises (a killed run); returns the checkpointed step."""
    real_step, calls = trainer.train_head, {"n": 0}

    def stopping(*args, **kwargs):
        step_fn = args[5]

        def step(*a, **k):
            calls["n"] += 1
            if calls["n"] > 4 * world:  # four steps on each process
                raise Killed
            return step_fn(*a, **k)

        return real_step(*args[:5], step, *args[6:], **kwargs)

    monkeypatch.setattr(eagle_train, "train_head", stopping)
    with pytest.raises(Killed):
        thread_processes(world, lambda: train_eagle(model, sequences, run, CFG, progress=False))
    monkeypatch.setattr(eagle_train, "train_head", real_step)
    return torch.load(run / "checkpoint" / "checkpoint.pt", weights_only=False)["step"]


@pytest.mark.parametrize("resume_world", [2, 1])
def test_killed_and_resumed_run_ends_with_the_uninterrupted_weights(
    tiny_data, thread_processes, tmp_path, monkeypatch, resume_world
):
    """Resumed with the same or another process count: the same run up to float summation order (the checkpoint
    holds the global state; the report names both counts). Threads share torch's intra-op thread settings, so
    this test allows float noise; real processes resume to the very same bytes (the slow test below)."""
    model, sequences, _ = tiny_data
    train = lambda run: lambda: train_eagle(model, sequences, run, CFG, progress=False)  # noqa: E731
    whole, _ = thread_processes(2, train(tmp_path / "whole"))[0]
    step = train_until_killed(thread_processes, 2, tmp_path / "cut", monkeypatch, model, sequences)
    assert 0 < step < len(trainer_history(tmp_path / "whole"))
    resumed, report = thread_processes(resume_world, train(tmp_path / "cut"))[0]
    for a, b in zip(whole.state_dict().values(), resumed.state_dict().values(), strict=True):
        # Adam turns summation noise into steps of up to lr: a few learning rates over the run
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=10 * CFG.lr)
    assert [r["processes"] for r in report["num_processes_by_step"]] == [2, resume_world][: 3 - resume_world]
    losses = [h["loss"] for h in trainer_history(tmp_path / "whole")]
    assert [h["loss"] for h in trainer_history(tmp_path / "cut")] == pytest.approx(losses, rel=1e-2)


def test_a_process_without_items_still_joins_the_gradient_sum(tiny_data, thread_processes, tmp_path):
    """Global batches of one long sequence leave the second process without items: it computes one with weight 0
    and the step still matches one process's."""
    model, sequences, _ = tiny_data
    cfg = EagleTrainConfig(
        draft_vocab=80, epochs=1, lr=2e-3, batch_tokens=64, heldout=0
    )  # one sequence a batch
    one, _ = thread_processes(
        1, lambda: train_eagle(model, sequences, tmp_path / "one", cfg, progress=False)
    )[0]
    two, _ = thread_processes(
        2, lambda: train_eagle(model, sequences, tmp_path / "two", cfg, progress=False)
    )[0]
    torch.testing.assert_close(one.fc.weight, two.fc.weight, rtol=0, atol=WEIGHT_ATOL)


def test_exit_heads_on_two_processes_match_one(thread_processes):
    """`hf-spec train exits`' loop: each process takes its share of every batch's positions."""
    from hf_spec.methods.early_exit.exit_heads import ExitHeads
    from hf_spec.training.exit_features import extract_features
    from tests.conftest import prompt_ids

    model = make_tiny_model("llama", layers=4)
    seqs = [
        (model.generate(prompt_ids(6, seed=s), max_new_tokens=20, do_sample=False)[0], 5) for s in range(3)
    ]
    feats = extract_features(model, seqs, [1, 2], top_k=4)
    torch.manual_seed(0)
    start = ExitHeads.for_target(model, [1, 2], rank=4)
    heads = [copy.deepcopy(start) for _ in range(3)]
    kw = dict(steps=8, batch_size=16, lr=1e-2, negatives=8)
    one = thread_processes(1, lambda: exits_train.train_heads(model, heads[0], feats, **kw))[0]
    rank = iter(range(1, 3))
    two = thread_processes(
        2, lambda: exits_train.train_heads(model, heads[next(rank)], feats, **kw), staggered=False
    )
    assert two[0] == two[1] == pytest.approx(one, rel=LOSS_RTOL)  # the global loss, on every process
    for a, b in zip(heads[0].state_dict().values(), heads[1].state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=3 * 1e-2)


# ---- real processes: accelerate launch --multi_gpu --num_processes 2 (gloo on this CPU) ----------------------


def _prompts(tmp_path: Path) -> Path:
    path = tmp_path / "tasks.jsonl"
    words = ["cat", "dog", "girl", "boy", "tree", "ball", "bird", "car", "sun", "boat"]
    path.write_text(
        "".join(
            json.dumps({"id": f"t{i}", "instruction": f"Once upon a time a {w}"}) + "\n"
            for i, w in enumerate(words)
        )
    )
    return path


def _train_argv(
    tmp_path: Path, out: str, run: str, kind: str = "eagle", batch_tokens: int = 256
) -> list[str]:
    return [
        "train", kind, "--target", str(STORIES), "--prompts", str(_prompts(tmp_path)),
        "--data-dir", str(tmp_path / "data"), "--max-new-tokens", "24", "--draft-vocab", "256",
        "--epochs", "2", "--batch-tokens", str(batch_tokens), "--heldout", "2", "--save-every", "1", "--dtype", "float32",
        "--out", str(tmp_path / out), "--checkpoint-dir", str(tmp_path / run), "--threads", "1",
    ]  # fmt: skip


def _launch(argv: list[str], processes: int, **popen) -> subprocess.Popen:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    if processes == 1:
        command = [sys.executable, "-m", "hf_spec.cli.main", *argv]
    else:
        command = [
            sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(processes), "--multi_gpu",
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(29500 + os.getpid() % 1000), "-m", "hf_spec.cli.main", *argv,
        ]  # fmt: skip
    return subprocess.Popen(command, env=env, start_new_session=True, **popen)


def _run(argv: list[str], processes: int) -> None:
    proc = _launch(argv, processes, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, output[-3000:]


@pytest.mark.slow
@pytest.mark.ci_slow
def test_two_processes_match_one_on_stories(tmp_path):
    _run(_train_argv(tmp_path, "one", "run-one"), 1)  # also fills the answer and feature caches
    _run(_train_argv(tmp_path, "two", "run-two"), 2)
    one = json.loads((tmp_path / "one" / "training_report.json").read_text())
    two = json.loads((tmp_path / "two" / "training_report.json").read_text())
    assert two["num_processes"] == 2 and one["num_processes"] == 1
    assert two["global_batch_tokens"] == one["global_batch_tokens"] == 256
    assert two["steps"] == one["steps"]
    assert two["final_loss"] == pytest.approx(one["final_loss"], rel=1e-3)
    assert not (tmp_path / "two" / ".tmp").exists()


# imported by every Python process of a launch (launcher and workers): the main worker kills the whole launch, as
# a crash would, right after it has written the checkpoint of step KILL_AFTER_STEP
KILLER = """
import os, signal
if os.environ.get("KILL_AFTER_STEP"):
    from hf_spec.training import loop

    real_save = loop.Checkpoint.save

    def save(self, model, optimizer, scheduler, step, extra):
        real_save(self, model, optimizer, scheduler, step, extra)
        if step >= int(os.environ["KILL_AFTER_STEP"]):
            os.killpg(os.getpgid(0), signal.SIGKILL)

    loop.Checkpoint.save = save
"""


@pytest.mark.slow
def test_killed_and_resumed_two_processes_end_with_the_uninterrupted_weights(tmp_path, monkeypatch):
    small = dict(batch_tokens=64)  # one answer per step
    _run(_train_argv(tmp_path, "whole", "run-whole", **small), 2)
    total = json.loads((tmp_path / "whole" / "training_report.json").read_text())["steps"]
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(KILLER)
    path = os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])
    with monkeypatch.context() as env:
        env.setenv("PYTHONPATH", path)
        env.setenv("KILL_AFTER_STEP", str(total // 2))
        quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        proc = _launch(_train_argv(tmp_path, "cut", "run-cut", **small), 2, **quiet)
        assert proc.wait(timeout=900) != 0  # killed
    checkpoint = tmp_path / "run-cut" / "checkpoint" / "checkpoint.pt"
    assert torch.load(checkpoint, weights_only=False)["step"] == total // 2 > 0
    _run(_train_argv(tmp_path, "cut", "run-cut", **small), 2)
    whole = (tmp_path / "whole" / "model.safetensors").read_bytes()
    assert (tmp_path / "cut" / "model.safetensors").read_bytes() == whole
