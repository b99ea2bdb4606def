"""`benchmarks/gpu_check.py` keeps working without a GPU (`--tiny`: tiny shapes on the CPU, the Triton kernels under
the interpreter), and `hf-spec bench --record-rounds` writes what its replay reads."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from hf_spec.bench.rounds import interpolate, paper_ratios, read_rounds, replay_speedup
from hf_spec.cli.main import main
from tests.conftest import STORIES

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("keep_threads")


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def recording(tmp_path_factory) -> Path:
    """Rounds of a short `hf-spec bench` on stories260K: a chain method, a tree method and early exit."""
    tmp = tmp_path_factory.mktemp("rounds")
    prompts = tmp / "prompts.jsonl"
    rows = [{"question_id": 1, "category": "writing", "turns": ["Once upon a time, there was a little girl"]},
            {"question_id": 2, "category": "qa", "turns": ["Tom had a big red ball. Tom had a big"]}]  # fmt: skip
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    path = tmp / "rounds.json"
    argv = [
        "bench",
        "--target",
        str(STORIES),
        "--methods",
        "ar,pld,early-exit:2,oracle:4",
        "--prompts",
        str(prompts),
    ]
    argv += [
        "--max-new-tokens",
        "24",
        "--threads",
        "1",
        "--record-rounds",
        str(path),
        "--out",
        str(tmp / "out"),
    ]
    assert main(argv) == 0
    return path


def test_record_rounds_writes_every_round_of_every_method(recording):
    data = read_rounds(recording)
    assert set(data["methods"]) == {"pld", "early-exit:2", "oracle:4"}  # ar has no rounds
    assert data["num_layers"] == 5 and data["vocab_size"] == 512
    results = json.loads((recording.parent / "out" / "results.json").read_text())
    for name, entry in data["methods"].items():
        runs = [r for r in results["runs"] if r["method"] == name]
        rounds = entry["rounds"]
        assert sum(r["n"] for r in rounds) == sum(run["new_tokens"] for run in runs)
        assert len(rounds) == sum(run["stats"]["target_forwards"] for run in runs)
        for r in rounds:
            nodes = r["p"] if isinstance(r["p"], int) else len(r["p"])
            assert len(r["a"]) <= nodes and r["n"] <= len(r["a"]) + 1
            assert sum(c for _, c in r["v"]) == data["num_layers"]  # one verification forward a round
    early = data["methods"]["early-exit:2"]["rounds"]
    assert any(r["t"] for r in early)  # early exit drafts through the target's first layers
    assert all(q == 1 for r in early for q, _ in r["t"])  # one token a draft step
    assert not any(r["t"] or r["d"] for r in data["methods"]["pld"]["rounds"])  # prompt lookup runs no model
    assert data["methods"]["early-exit:2"]["family"] == "early-exit"
    with pytest.raises(ValueError, match="not an `hf-spec bench --record-rounds` file"):
        read_rounds(recording.parent / "out" / "results.json")


def test_replay_prices_rounds():
    layer = {1: 1.0, 9: 1.0}  # verification costs as much as one step (flat): a chain's tokens are free
    rounds = [{"p": 8, "a": list(range(8)), "n": 9, "t": [], "d": [], "v": [], "lm": 0, "s": 0.0}] * 4
    fast = replay_speedup(rounds, layer, {1: 0.0, 9: 0.0}, num_layers=2, overhead=0.0, token_seconds=2.0)
    assert fast["speedup"] == pytest.approx(9.0) and fast["tau"] == 9
    host = [{**r, "s": 2.0} for r in rounds]  # a host-only drafter pays its recorded seconds
    assert replay_speedup(host, layer, {1: 0.0}, 2, 0.0, 2.0)["speedup"] == pytest.approx(4.5)
    assert interpolate({1: 1.0, 3: 3.0}, 2) == 2.0 and interpolate({1: 1.0, 3: 3.0}, 5) == 5.0
    families = {"eagle:h": {"family": "eagle"}, "lyanna:h": {"family": "lyanna"}, "early-exit:2": {"family":
                "early-exit"}, "early-exit:4": {"family": "early-exit"}, "hispec": {"family": "hispec"},
                "retrieval": {"family": "retrieval"}, "talon": {"family": "talon", "halves": ["retrieval", "eagle"]}}  # fmt: skip
    speed = {"eagle:h": 2.0, "lyanna:h": 2.5, "early-exit:2": 1.2, "early-exit:4": 1.5, "hispec": 1.8,
             "retrieval": 2.2, "talon": 2.42}  # fmt: skip
    ratios = paper_ratios(speed, families)
    assert ratios == pytest.approx(
        {"lyanna_vs_hass": 1.25, "hispec_vs_best_exit": 1.2, "talon_vs_better_half": 1.1}
    )
    assert paper_ratios({"eagle:h": 2.0}, families)["lyanna_vs_hass"] is None


def test_gpu_check_tiny_runs_on_the_cpu(recording, tmp_path, monkeypatch):
    """Every section of the GPU check on tiny shapes, both backends (the triton one under the interpreter)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gpu_check = load_gpu_check()
    assert gpu_check.main(["--out", str(tmp_path), "--tiny", "--rounds", str(recording)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    (shape,) = report["shapes"]
    assert shape["plain_tokens_per_s"] > 0 and shape["verify_relative"]["0"] == 1.0
    assert set(shape["backends"]) == {"torch", "triton"}
    for backend in shape["backends"].values():
        assert set(backend["oracle_speedup"]) == {"2", "4"} and backend["syncs_per_round"] >= 1
    assert set(shape["kernels"]) == {"greedy_accept", "sampling_accept", "kv_compact", "tree_mask", "draft_topk",
                                     "token_info_topk"}  # fmt: skip
    assert all(k["max_error"] < 1e-3 for k in shape["kernels"].values()), shape["kernels"]
    replayed = shape["replay"][recording.name]["methods"]
    assert set(replayed) == {"pld", "early-exit:2", "oracle:4"} and all(
        m["speedup"] > 0 for m in replayed.values()
    )
    assert "| greedy_accept |" in (tmp_path / "gpu_check.md").read_text()
    assert "HF_SPEC_BACKEND" not in os.environ and "gpu_check" not in sys.modules
