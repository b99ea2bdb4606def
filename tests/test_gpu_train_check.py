"""`benchmarks/gpu_train_check.py` keeps working without a GPU: on the CPU with stories260K's shape and tokenizer it
captures a store, trains both heads from it and benches them losslessly against plain decoding; `--profile` adds each
step's costliest functions to one file."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest

from tests.conftest import STORIES

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("keep_threads")


def load_check():
    spec = importlib.util.spec_from_file_location(
        "gpu_train_check", ROOT / "benchmarks" / "gpu_train_check.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def small_corpus(path: Path, docs: int = 60) -> Path:
    rng = random.Random(0)
    words = "once upon a time there was a little girl named lily she liked to play with her red ball".split()
    with path.open("w") as f:
        for i in range(docs):
            source = "answers" if i % 2 == 0 else "sharegpt"
            messages = [
                ["user", " ".join(rng.choices(words, k=8))],
                ["assistant", " ".join(rng.choices(words, k=60))],
            ]
            f.write(json.dumps({"id": f"{source}/{i}", "source": source, "messages": messages}) + "\n")
    return path


def test_capture_train_and_lossless_bench_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_SPEC_CACHE", str(tmp_path / "cache"))  # the steps' subprocesses inherit it
    check = load_check()
    out = tmp_path / "out"
    argv = ["--out", str(out), "--work", str(tmp_path / "work"), "--target", str(STORIES), "--corpus",
            str(small_corpus(tmp_path / "corpus.jsonl")), "--limit-tokens", "2000", "--aux-layers", "1,2,3",
            "--heldout", "2", "--new-tokens", "8", "--bench-prompts", "1", "--batch-tokens", "512",
            "--device", "cpu", "--docs-per-forward", "1,4"]  # fmt: skip
    assert check.main(argv) == 0
    assert not (tmp_path / "cache" / "runs").exists()  # training checkpoints stay in the work folder
    (result,) = json.loads((out / "gpu_train_check.json").read_text())["results"]
    assert result["shape"]["layers"] == 5
    assert result["capture"]["rc"] == 0 and result["capture"]["tokens"] >= 2000
    assert result["capture"]["tokens_per_second"] > 0  # the capture's own log line was read
    one, four = result["captures"]  # --docs-per-forward 1,4: the same tokens, in stores of their own
    assert (one["docs_per_forward"], four["docs_per_forward"]) == (1, 4) and four["tokens"] == one["tokens"]
    assert four["rc"] == 0 and four["tokens_per_second"] > 0
    for head in ("eagle3", "hass"):
        assert result[head]["rc"] == 0, head
        assert result[head]["tokens_per_second"] > 0 and result[head]["tokens_seen"] > 0
        assert len(result[head]["heldout_by_depth"]) >= 3
    methods = result["bench"]["methods"]
    assert set(methods) == {"ar", "eagle3", "hass"}
    assert methods["eagle3"]["lossless_mismatches"] == methods["hass"]["lossless_mismatches"] == 0  # float32
    table = (out / "gpu_train_check.md").read_text()
    assert (
        "| stories260K" in table
        and "; 4 a forward: " in table
        and "eagle3: 0" in table
        and "hass: 0" in table
    )


def test_profile_appends_a_steps_costliest_functions(tmp_path):
    profile = tmp_path / "profile.txt"
    profile.write_text("# earlier steps\n")
    step = load_check().run_step("help", ["--help"], tmp_path / "help.log", 120, profile)
    assert step["rc"] == 0 and not step["timed_out"]
    text = profile.read_text()
    assert text.startswith("# earlier steps\n") and f"## {tmp_path.name}: help (" in text
    assert "Ordered by: internal time" in text
