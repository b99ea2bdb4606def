"""`benchmarks/gpu_check.py` keeps working without a GPU (`--tiny`: tiny shapes on the CPU, the Triton kernels under
the interpreter), and `hf-spec bench --record-rounds` writes what its replay reads."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from hf_spec.bench.rounds import (
    ROUNDS_FORMAT,
    interpolate,
    monotone,
    paper_ratios,
    read_rounds,
    replay_speedup,
    write_rounds,
)
from hf_spec.cli.main import main
from tests.conftest import STORIES

ROOT = Path(__file__).resolve().parents[1]
# the committed recording of the real target's rounds (docs/gpu.md: how it was recorded)
RECORDED = ROOT / "benchmarks" / "results" / "rounds" / "qwen2.5-coder-0.5b-instruct.json"
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
        "--dtype",
        "float32",
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


def test_rounds_file_is_columnar_and_reads_back_what_was_recorded(recording, tmp_path):
    """The file lists each distinct tree and draft work once and the rounds by column; reading it gives one dict a
    round again, and writing that gives the same file."""
    raw = json.loads(recording.read_text())
    assert raw["format"] == ROUNDS_FORMAT and raw["machine"]["cores"] > 0
    pld = raw["methods"]["pld"]
    assert set(pld["rounds"]) == {"tree", "last", "n", "work", "us"} and len(pld["work"]) < len(
        pld["rounds"]["n"]
    )
    again = tmp_path / "again.json"
    write_rounds(again, read_rounds(recording))
    assert again.read_text() == recording.read_text()
    rounds = [  # a tree, a chain, a partial verification (HiSpec's later layers), a round cut at EOS
        {"p": [-1, -1, 0, 2], "a": [1], "n": 2, "t": [], "d": [[3, 1]], "v": [[5, 4]], "lm": 6, "s": 0.002},
        {"p": 3, "a": [0, 1, 2], "n": 4, "t": [[1, 3]], "d": [], "v": [[4, 4]], "lm": 0, "s": 0.000125},
        {"p": [-1, 0, 0], "a": [0, 2], "n": 3, "t": [[1, 2]], "d": [], "v": [[4, 2]], "lm": 2, "s": 0.0},
        {"p": [-1, 0, 0], "a": [0], "n": 1, "t": [[1, 2]], "d": [], "v": [[4, 2]], "lm": 2, "s": 0.0},
    ]
    data = {"format": "hf-spec rounds 1", "target": "t", "num_layers": 4, "hidden_size": 8, "vocab_size": 9,
            "methods": {"m": {"family": "hispec", "rounds": rounds}}}  # fmt: skip
    write_rounds(tmp_path / "m.json", data)
    assert read_rounds(tmp_path / "m.json") == data
    assert len(json.loads((tmp_path / "m.json").read_text())["methods"]["m"]["work"]) == 3
    bad = {**data, "methods": {"m": {"family": "x", "rounds": [{**rounds[0], "a": [0, 1]}]}}}
    with pytest.raises(ValueError, match="not a path from the root"):
        write_rounds(tmp_path / "bad.json", bad)


def test_replay_scales_the_recorded_targets_layers():
    """Layer calls of the recorded target count as the same share of the replayed target's layers; a head's own
    layers (`d`) count as they are."""
    r = {"p": 1, "a": [0], "n": 2, "t": [[1, 2]], "d": [[1, 1]], "v": [[2, 4]], "lm": 0, "s": 0.0}
    cost = {1: 1.0, 2: 1.0}
    same = replay_speedup([r], cost, {1: 0.0, 2: 0.0}, 4, 0.0, 1.0, recorded_layers=4)
    double = replay_speedup([r], cost, {1: 0.0, 2: 0.0}, 8, 0.0, 1.0, recorded_layers=4)
    assert same["ms_per_round"] == pytest.approx(1e3 * (4 + 2 + 1))
    assert double["ms_per_round"] == pytest.approx(1e3 * (8 + 4 + 1))


def test_replay_costs_never_fall_with_more_rows():
    """A noisy cost curve (a dip after a spike, as a loaded machine measures) is pooled into a non-decreasing one:
    no extrapolated size costs less than a measured one, nor less than nothing."""
    noisy = {1: 1.0, 2: 36.0, 3: 11.0, 5: 0.5, 9: 2.0}
    smooth = monotone(noisy)
    assert list(smooth.values()) == sorted(smooth.values()) and smooth[1] == 1.0
    assert sum(smooth.values()) == pytest.approx(sum(noisy.values()))
    assert interpolate(smooth, 40) >= smooth[9] and monotone({1: -1.0}) == {1: 0.0}
    r = {"p": 30, "a": [0], "n": 2, "t": [], "d": [], "v": [], "lm": 0, "s": 0.001}
    assert replay_speedup([r], noisy, noisy, 2, 0.0, 1.0)["speedup"] > 0


def test_committed_recording_of_the_real_target_gives_the_paper_ratios():
    """`benchmarks/results/rounds/`: every canonical method's rounds on Spec-Bench prompts, small, and enough for
    the replay's three ratios (here at made-up flat costs: a tree costs what one token costs)."""
    assert RECORDED.stat().st_size < 200_000
    data = read_rounds(RECORDED)
    families = {e["family"] for e in data["methods"].values()}
    assert {"pld", "retrieval", "eagle", "lyanna", "early-exit", "hispec", "postuse", "talon"} <= families
    flat = {q: 1e-3 for q in (1, 2, 64)}
    speedups = {name: replay_speedup(e["rounds"], flat, {1: 1e-3}, 32, 1e-4, 0.035, data["num_layers"])["speedup"]
                for name, e in data["methods"].items()}  # fmt: skip
    assert all(s and s > 0 for s in speedups.values()), speedups
    assert all(v and v > 0 for v in paper_ratios(speedups, data["methods"]).values())


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
    """Every section of the GPU check on tiny shapes, both backends (the triton one under the interpreter), and the
    compiled rows with inductor on the CPU."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gpu_check = load_gpu_check()
    # a budget no CPU run reaches: every phase runs however busy the machine is
    argv = ["--out", str(tmp_path), "--tiny", "--rounds", str(recording), "--budget-s", "36000"]
    assert gpu_check.main(argv) == 0
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
    ratios = shape["replay"][recording.name]["ratios"]
    assert set(ratios) == {"lyanna_vs_hass", "hispec_vs_best_exit", "talon_vs_better_half"}
    assert "| greedy_accept |" in (tmp_path / "gpu_check.md").read_text()
    assert "HF_SPEC_BACKEND" not in os.environ and "gpu_check" not in sys.modules
    # the compiled rows: transformers' compiled static-cache generate and the static-cache verification curve
    compiled = shape["compiled_generate"]
    assert compiled["tokens_per_s"] > 0 and compiled["first_call_s"] > 0, compiled
    assert compiled["same_tokens_as_eager"] and compiled["first_difference"] is None
    static = shape["verify_static"]
    assert set(static["compiled"]) == set(static["eager"]) == {"1", "4"} and not static["skipped_widths"]
    assert all(s > 0 for kind in ("eager", "compiled", "compile_s") for s in static[kind].values()), static
    assert set(shape["replay_compiled"][recording.name]["methods"]) == set(replayed)
    assert all(m["speedup"] > 0 for m in shape["replay_compiled"][recording.name]["methods"].values())
    assert not shape["skipped"] and not report["skipped_shapes"]
    assert {"compiled_generate", "verify_static", "backends", "replay_compiled"} <= set(
        shape["phase_seconds"]
    )
    text = (tmp_path / "gpu_check.md").read_text()
    assert "compiled `generate` (static cache, `default`)" in text and "| compiled ms |" in text


def test_gpu_check_budget_skips_phases_and_compile_hook_reports(tmp_path, monkeypatch):
    """A spent budget skips every timed phase and says so; `--compile` records whether a compiled speculative
    decoder exists in this hf-spec (and, where it does, that it gives plain `generate`'s tokens)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gpu_check = load_gpu_check()
    from benchmarks import gpu_compiled

    spent = ["--out", str(tmp_path / "spent"), "--tiny", "--budget-s", "0"]
    assert gpu_check.main(spent) == 0
    assert json.loads((tmp_path / "spent" / "gpu_check.json").read_text())["skipped_shapes"] == ["tiny"]
    monkeypatch.setattr(gpu_compiled.Budget, "allows", lambda self, need_s, until=None: False)
    assert gpu_check.main(["--out", str(tmp_path / "none"), "--tiny", "--compile"]) == 0
    (shape,) = json.loads((tmp_path / "none" / "gpu_check.json").read_text())["shapes"]
    assert shape["plain_tokens_per_s"] > 0
    assert {"compiled_generate", "verify", "verify_static", "backends"} <= set(shape["skipped"])
    assert "Skipped (time budget): compiled_generate" in (tmp_path / "none" / "gpu_check.md").read_text()
    monkeypatch.undo()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from tests.conftest import make_tiny_model, prompt_ids

    model, ids = make_tiny_model("llama"), prompt_ids(12)
    reference = model.generate(ids, max_new_tokens=8, do_sample=False)
    row = gpu_compiled.compiled_speculative(model, ids, [2], 8, reference, compiled_s=1.0)
    if not gpu_compiled.decoder_takes_compile():
        assert row == {
            "available": False,
            "reason": "SpeculativeDecoder has no compile keyword in this hf-spec",
        }
    else:
        assert row["available"] and row["same_tokens"] == {2: True} and row["oracle_speedup"][2] > 0
