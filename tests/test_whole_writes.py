"""Writers leave a folder whole or absent: each is killed (SIGKILL, in a forked child) before one of its file-system
writes, renames or replaces, at several points, and what is left must load as the earlier or the new artefact,
be absent, or be refused by name; a writer that fails (a full disk) leaves the earlier folder as it was."""

from __future__ import annotations

import builtins
import io
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hf_spec.core.specs import parse_method
from hf_spec.datastore import DatastoreRecipe, TokenIndex, load_datastore, save_datastore
from hf_spec.integrations import save_custom_generate
from hf_spec.io.output_folder import staged_folder
from hf_spec.methods.eagle3 import Eagle3Head, Eagle3HeadConfig, load_eagle3_head, save_eagle3_head
from hf_spec.methods.early_exit.exit_heads import ExitHeads
from hf_spec.training.features import FeatureStore, capture_sequences
from hf_spec.training.loop import Checkpoint
from tests.conftest import make_tiny_model, prompt_ids
from tests.test_reliability import eagle_head, load_eagle

_WRITE_MODES = ("w", "a", "x", "+")


def run_killed_at(event: int, write: Callable[[], None]) -> bool:
    """Run `write` in a forked child that kills itself (SIGKILL) just before its `event`-th file-system write (an
    `open` for writing, a rename or replace, a safetensors/numpy/torch save). Returns whether it was killed
    (False: `write` finished with fewer events)."""
    pid = os.fork()
    if pid == 0:  # the child: count the writes, die at the chosen one
        try:
            torch.set_num_threads(1)  # the parent's OpenMP pool is not usable after a fork
            count = [0]

            def hook(fn):
                def wrapped(*args, **kwargs):
                    mode = args[1] if fn in (_open, _io_open) and len(args) > 1 else kwargs.get("mode", "r")
                    if fn not in (_open, _io_open) or any(m in str(mode) for m in _WRITE_MODES):
                        count[0] += 1
                        if count[0] == event:
                            os.kill(os.getpid(), signal.SIGKILL)
                    return fn(*args, **kwargs)

                return wrapped

            import numpy
            import safetensors.torch
            import transformers.modeling_utils as modeling

            builtins.open, io.open = hook(_open), hook(_io_open)
            os.replace, os.rename = hook(os.replace), hook(os.rename)
            safetensors.torch.save_file = hook(safetensors.torch.save_file)
            modeling.safe_save_file = hook(modeling.safe_save_file)
            numpy.save, torch.save = hook(numpy.save), hook(torch.save)
            write()
        except BaseException:  # noqa: BLE001 - the parent sees the failure as exit status 1
            os._exit(1)
        os._exit(0)
    deadline = time.monotonic() + 120
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"the writer hung at event {event}")
        time.sleep(0.02)
    if os.WIFSIGNALED(status):
        assert os.WTERMSIG(status) == signal.SIGKILL
        return True
    assert os.WEXITSTATUS(status) == 0, f"the writer failed at event {event} (not killed)"
    return False


_open, _io_open = builtins.open, io.open


def kill_everywhere(
    tmp_path: Path,
    prepare: Callable[[Path], None],
    write: Callable[[Path], None],
    check: Callable[[Path], str],
    allowed: set[str],
    stride: int = 1,
) -> set[str]:
    """Kill `write(scene)` before its 1st, (1 + stride)-th, ... write until it finishes, each time on a fresh scene
    (`prepare(scene)`), then `check(scene)`, which names the state left; every state must be in `allowed`. Returns
    the states seen, the finished run's as `"finished:<state>"`."""
    seen: set[str] = set()
    event = 1
    while True:
        scene = tmp_path / f"kill-{event}"
        scene.mkdir(parents=True)
        prepare(scene)
        killed = run_killed_at(event, lambda scene=scene: write(scene))
        state = check(scene)
        assert state in allowed, f"killed before write {event}: {state}"
        if not killed:
            return seen | {"finished:" + state}
        seen.add(state)
        event += stride


@pytest.fixture(scope="module")
def target():
    return make_tiny_model("llama")


def embedded_recipe(folder: Path) -> dict:
    """The recipe `custom_generate/generate.py` carries (its `RECIPE = '...'` line)."""
    import ast

    line = next(
        x
        for x in (folder / "custom_generate" / "generate.py").read_text().splitlines()
        if x.startswith("RECIPE")
    )
    return json.loads(ast.literal_eval(line.split("=", 1)[1].strip()))


def recipe_state(folder: Path) -> str:
    if not folder.exists():
        return "absent"
    config = parse_method(str(folder))
    assert embedded_recipe(folder)["method"] == config.method, "config and generate.py name other methods"
    return config.method


# ---- recipes (save_custom_generate) ------------------------------------------------------------------------------
def test_a_recipe_killed_anywhere_is_the_earlier_the_new_or_absent(tmp_path):
    seen = kill_everywhere(
        tmp_path,
        lambda scene: save_custom_generate(scene / "recipe", "pld:5"),
        lambda scene: save_custom_generate(scene / "recipe", "early-exit:2"),
        lambda scene: recipe_state(scene / "recipe"),
        {"absent", "pld", "early-exit"},
    )
    assert {"pld", "finished:early-exit"} <= seen
    fresh = kill_everywhere(
        tmp_path / "fresh",
        lambda scene: None,
        lambda scene: save_custom_generate(scene / "recipe", "pld:5"),
        lambda scene: recipe_state(scene / "recipe"),
        {"absent", "pld"},
    )
    assert fresh == {"absent", "finished:pld"}
    killed = tmp_path / "kill-2"  # a later write there removes what the killed one left beside the folder
    save_custom_generate(killed / "recipe", "pld:7")
    assert sorted(p.name for p in killed.iterdir()) == ["recipe"]


def test_a_recipe_write_that_fails_leaves_the_earlier_folder_as_it_was(tmp_path, monkeypatch):
    save_custom_generate(tmp_path / "recipe", "pld:5")
    real = Path.write_text

    def full_disk(self, *args, **kwargs):
        if self.name == "generate.py":
            raise OSError(28, "No space left on device")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(OSError, match="No space left"):
        save_custom_generate(tmp_path / "recipe", "early-exit:2")
    with pytest.raises(OSError, match="No space left"):
        save_custom_generate(tmp_path / "new", "early-exit:2")
    monkeypatch.undo()
    assert recipe_state(tmp_path / "recipe") == "pld"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe"]  # no half-written folder, no leftovers


@pytest.mark.slow
def test_overwriting_a_head_folder_s_recipe_keeps_the_head_whole(target, tmp_path):
    def check(scene: Path) -> str:
        if not (scene / "head").exists():  # killed between its two renames: the next write puts it in place
            save_custom_generate(scene / "head", "pld:6", overwrite=True)
            assert recipe_state(scene / "head") == "pld"
            load_eagle(scene / "head", target)
            return "absent"
        load_eagle(scene / "head", target)  # intact, its checksum list renewed or as it was
        return recipe_state(scene / "head")

    seen = kill_everywhere(
        tmp_path,
        lambda scene: eagle_head(target, scene / "head"),
        lambda scene: save_custom_generate(scene / "head", "pld:5", overwrite=True),
        check,
        {"eagle", "pld", "absent"},
    )
    assert {"eagle", "absent", "finished:pld"} <= seen


# ---- training checkpoints ----------------------------------------------------------------------------------------
def checkpoint_at(folder: Path, step: int) -> None:
    from hf_spec.training.loop import warmup_linear_decay

    torch.manual_seed(step)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    Checkpoint(folder).save(
        model, optimizer, warmup_linear_decay(optimizer, 10, 2), step, {"history": [step]}
    )


def test_a_checkpoint_killed_anywhere_is_the_earlier_or_the_new(tmp_path):
    seen = kill_everywhere(
        tmp_path,
        lambda scene: checkpoint_at(scene, 1),
        lambda scene: checkpoint_at(scene, 2),
        lambda scene: str(Checkpoint(scene).read()["step"]),
        {"1", "2"},
    )
    assert seen == {"1", "finished:2"}


# ---- heads, exit heads, exports, datastores, feature stores -------------------------------------------------------
def head_state(folder: Path, target) -> str:
    if not folder.exists():
        return "absent"
    load_eagle(folder, target)
    return (folder / "README.md").read_text()


def other_head(target, folder: Path) -> None:
    from hf_spec.heads.hub import save_head_folder
    from hf_spec.methods.eagle import EagleConfig
    from hf_spec.methods.eagle.modeling import EagleHeadConfig, EagleHeadModel

    torch.manual_seed(1)
    head = EagleHeadModel(EagleHeadConfig.for_target(target, 64))
    head.d2t.copy_(torch.arange(64))
    save_head_folder(head.attach_target(target).eval(), folder, EagleConfig(head="."), "new card")


@pytest.mark.slow
def test_a_head_killed_anywhere_loads_whole_or_is_absent(target, tmp_path):
    seen = kill_everywhere(
        tmp_path,
        lambda scene: eagle_head(target, scene / "head"),
        lambda scene: other_head(target, scene / "head"),
        lambda scene: head_state(scene / "head", target),
        {"absent", "card", "new card"},
    )
    assert {"card", "finished:new card"} <= seen
    fresh = kill_everywhere(
        tmp_path / "fresh",
        lambda scene: None,
        lambda scene: other_head(target, scene / "head"),
        lambda scene: head_state(scene / "head", target),
        {"absent", "new card"},
        stride=3,
    )
    assert fresh == {"absent", "finished:new card"}


def test_exit_heads_killed_anywhere_load_whole_or_are_absent(target, tmp_path):
    def save(folder: Path, card: str) -> None:
        ExitHeads.for_target(target, [2], rank=2).save_pretrained(folder, card=card)

    def check(scene: Path) -> str:
        if not (scene / "exits").exists():
            return "absent"
        ExitHeads.from_pretrained(scene / "exits", target)
        return (scene / "exits" / "README.md").read_text()

    seen = kill_everywhere(
        tmp_path,
        lambda s: save(s / "exits", "old"),
        lambda s: save(s / "exits", "new"),
        check,
        {"old", "new", "absent"},
    )
    assert {"old", "finished:new"} <= seen


@pytest.mark.slow
def test_an_export_killed_anywhere_loads_whole_or_is_absent(target, tmp_path):
    from hf_spec.cli.export import export_head

    torch.manual_seed(0)
    source = save_eagle3_head(
        tmp_path / "src", Eagle3Head(Eagle3HeadConfig.for_target(target, 50, (1, 2, 3))), target=target
    )

    def check(scene: Path) -> str:
        if not (scene / "out").exists():
            return "absent"
        load_eagle3_head(str(scene / "out"), target)
        return json.loads((scene / "out" / "hf_spec.json").read_text())["layout"]

    seen = kill_everywhere(
        tmp_path,
        lambda scene: export_head(str(source), "eagle3-sglang", scene / "out"),
        lambda scene: export_head(str(source), "eagle3-vllm", scene / "out"),
        check,
        {"sglang", "vllm", "absent"},
    )
    assert {"sglang", "finished:vllm"} <= seen


def test_a_datastore_killed_anywhere_loads_whole_or_is_absent(tmp_path):
    # built here, not in the forked writer: the suffix sort may run an OpenMP pool, not usable after a fork
    indexes = {n: TokenIndex.from_documents([list(range(3, 3 + n)), list(range(5, 40))]) for n in (20, 50)}

    def save(folder: Path, n: int) -> None:
        save_datastore(folder, indexes[n], DatastoreRecipe(), {"format": 1, "tokenizer": None})

    def check(scene: Path) -> str:
        return str(load_datastore(scene / "ds").num_tokens) if (scene / "ds").exists() else "absent"

    seen = kill_everywhere(
        tmp_path, lambda s: save(s / "ds", 20), lambda s: save(s / "ds", 50), check, {"57", "87", "absent"}
    )
    assert {"57", "finished:87"} <= seen


@pytest.mark.slow
def test_a_feature_store_killed_anywhere_holds_whole_conversations(target, tmp_path):
    items = [(f"c{i}", prompt_ids(6 + i, seed=i)[0].tolist(), [0] * 3 + [1] * (3 + i)) for i in range(4)]

    def capture(folder: Path, part: list) -> None:
        capture_sequences(target, part, folder, topk=4, shard_tokens=8, progress=False)

    def check(scene: Path) -> str:
        store = FeatureStore.open(scene / "features")
        sequences = store.load_sequences()
        lengths = {cid: len(ids) for cid, ids, _ in items}
        assert [len(s["input_ids"]) for s in sequences] == [lengths[c] for c in store.ordered_ids()]
        return str(len(sequences))

    seen = kill_everywhere(
        tmp_path,
        lambda scene: capture(scene / "features", items[:2]),
        lambda scene: capture(scene / "features", items),
        check,
        {"2", "3", "4"},
        stride=2,
    )
    assert {"2", "finished:4"} <= seen


def test_staged_folder_leaves_the_earlier_folder_when_the_block_fails(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "a.txt").write_text("earlier")
    with pytest.raises(RuntimeError), staged_folder(tmp_path / "out") as new:
        (new / "a.txt").write_text("new")
        raise RuntimeError("failed half-way")
    assert (tmp_path / "out" / "a.txt").read_text() == "earlier"
    with staged_folder(tmp_path / "out", carry=lambda path: True) as new:
        assert (new / "a.txt").read_text() == "earlier"
        (new / "a.txt").unlink()  # replaced, not edited in place: the earlier folder's file is a hard link
        (new / "a.txt").write_text("new")
    assert (tmp_path / "out" / "a.txt").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
