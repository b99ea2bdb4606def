"""`hf-spec bench` end to end on the real stories260K model (no chat template: plain text prompts)."""

from __future__ import annotations

import json

import pytest
import torch

from hf_spec.bench.runner import (
    acceptance_by_depth,
    first_divergence,
    load_prompts,
    near_tie_threshold,
    spec_bench_group,
)
from hf_spec.cli.common import resolve_dtype
from hf_spec.cli.main import main
from hf_spec.engine.outputs import SpecStats
from tests.conftest import STORIES

pytestmark = pytest.mark.usefixtures("keep_threads")


@pytest.fixture
def prompt_file(tmp_path):
    rows = [
        {
            "question_id": 1,
            "category": "writing",
            "turns": ["Once upon a time, there was a little girl", "Then"],
        },
        {"question_id": 2, "category": "summarization", "turns": ["Tom had a big red ball. Tom had a big"]},
        {"question_id": 3, "category": "summarization", "turns": ["The cat sat on the mat. The dog"]},
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_bench_writes_spec_bench_results(prompt_file, tmp_path):
    out = tmp_path / "out"
    methods = "ar,ar-kernels,hf-pld,hf-early-exit:3,pld,early-exit:3,oracle:4"
    code = main(
        [
            "bench",
            "--target",
            str(STORIES),
            "--methods",
            methods,
            "--prompts",
            str(prompt_file),
            "--max-new-tokens",
            "24",
            "--check-lossless",
            "--threads",
            "1",
            "--dtype",
            "float32",  # exact tokens (bench's default is the published figures' bfloat16)
            "--out",
            str(out),
        ]
    )
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert list(results["summary"]) == methods.split(",")
    ar = results["summary"]["ar"]
    assert ar["speedup_vs_ar"] == pytest.approx(1.0) and ar["tau"] == pytest.approx(1.0)
    for name, entry in results["summary"].items():
        assert {
            "speedup_vs_ar",
            "tau",
            "tokens_per_s",
            "per_category",
            "per_group",
            "draft_utilization",
        } <= set(entry)
        assert set(entry["per_category"]) == {"writing", "summarization"}
        if name != "ar":
            assert entry["lossless_mismatches"] == 0 and entry["near_tie_mismatches"] == 0
    oracle = results["summary"]["oracle:4"]
    assert oracle["tau"] > 3.5
    # plain decoding on hf-spec's kernels: one token a forward
    assert results["summary"]["ar-kernels"]["tau"] == pytest.approx(1.0)
    # the oracle drafts 4 correct tokens a round: every round that drafts accepts all of them
    assert oracle["acceptance_by_depth"] == [1.0] * 4
    assert len(results["runs"]) == 7 * 3
    assert results["machine"]["torch_threads"] == 1
    assert results["machine"]["one_row_kernel"] in (True, False, None)  # the measured decision, if any
    assert results["machine"]["bf16_kernel_rows"] in (None, *range(21))  # the bf16 kernel's rows, if measured
    assert results["command"].startswith("hf-spec bench --target")
    assert (out / "results.md").read_text().startswith("| method |")
    assert (out / "speedup.png").stat().st_size > 1000


def test_bench_all_turns_and_bad_prompt_file(prompt_file, tmp_path):
    code = main(
        [
            "bench",
            "--target",
            str(STORIES),
            "--methods",
            "ar,pld",
            "--prompts",
            str(prompt_file),
            "--limit",
            "1",
            "--turns",
            "all",
            "--max-new-tokens",
            "8",
            "--out",
            str(tmp_path / "o"),
        ]
    )
    assert code == 0
    runs = json.loads((tmp_path / "o" / "results.json").read_text())["runs"]
    assert sorted((r["method"], r["turn"]) for r in runs) == [("ar", 0), ("ar", 1), ("pld", 0), ("pld", 1)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: not a Spec-Bench question"):
        load_prompts(bad)
    for turns in ('"Hi"', "[]", "[1]"):  # a string is not split into one-character turns
        bad.write_text(f'{{"question_id": 1, "turns": {turns}}}\n')
        with pytest.raises(ValueError, match="turns must be a non-empty list of strings"):
            load_prompts(bad)


def test_helpers():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert spec_bench_group("coding") == "mt_bench" and spec_bench_group("rag") == "rag"
    assert acceptance_by_depth([8, 5, 0], [10, 8, 0]) == [0.8, 0.625]
    stats = SpecStats()
    for depth, accepted in [(3, 0), (3, 3), (2, 1), (3, 1)]:
        stats.record_round(depth, accepted)
    assert stats.depth_tries == [4, 3, 1] and stats.depth_hits == [3, 1, 1]


def test_bench_in_bfloat16_counts_only_ties(prompt_file, tmp_path):
    """`--dtype bfloat16` runs every method on the bfloat16 target; outputs may part from `ar` only at
    bfloat16 ties, and each departure is counted and classified."""
    out = tmp_path / "bf16"
    argv = ["bench", "--target", str(STORIES), "--methods", "ar,pld,oracle:4", "--prompts", str(prompt_file)]
    argv += ["--max-new-tokens", "24", "--check-lossless", "--threads", "1", "--dtype", "bfloat16"]
    assert main([*argv, "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["machine"]["dtype"] == "bfloat16"
    assert "--dtype bfloat16" in results["command"]
    assert "bfloat16 weights" in (out / "results.md").read_text()
    for name in ("pld", "oracle:4"):
        entry = results["summary"][name]
        assert entry["lossless_mismatches"] == entry["near_tie_mismatches"]
    for run in results["runs"]:
        if run.get("lossless") is False:
            assert run["choice_gap"] < near_tie_threshold(torch.bfloat16)


def test_dtype_choice(monkeypatch):
    assert resolve_dtype("float32") is torch.float32 and resolve_dtype("bfloat16") is torch.bfloat16
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    assert resolve_dtype("auto") is torch.float32
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert resolve_dtype("auto") is torch.bfloat16
    assert (
        near_tie_threshold(torch.float32)
        < near_tie_threshold(torch.float16)
        < near_tie_threshold(torch.bfloat16)
    )


def test_sweep_hispec_writes_the_grid_the_best_pair_and_the_size_sweeps(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    rows = [
        {"question_id": i, "category": "writing", "turns": [t]} for i, t in enumerate(["Once upon", "Lily"])
    ]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["sweep", "hispec", "--target", str(STORIES), "--prompts", str(prompts), "--max-new-tokens", "10"]
    argv += ["--draft-layers", "1,2", "--verify-layers", "3", "--nd-values", "1,2", "--ni-values", "2"]
    assert main([*argv, "--threads", "1", "--dtype", "float32", "--out", str(tmp_path / "out")]) == 0
    sweep = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert sweep["best"] in sweep["summary"] and (tmp_path / "out" / "heatmap.png").exists()
    assert all(s["mismatches"] == 0 for name, s in sweep["summary"].items() if not name.startswith("ar"))
    assert len([k for k in sweep["summary"] if not k.startswith("ar")]) >= 4  # 2 pairs + N_d 1, 2 + N_i 2


def test_bench_compiled_rows_beside_eager_ones(prompt_file, tmp_path, monkeypatch):
    """`+compiled` names: transformers' compiled static-cache generate and hf-spec's compiled rounds in the same
    interleaved run, lossless, and recorded as compiled (aot_eager here: the same graphs, no code generation)."""
    from transformers import CompileConfig

    from hf_spec.bench import runner

    def fast_config():
        config = CompileConfig(backend="aot_eager", fullgraph=True)
        config._compile_all_devices = True
        return config

    monkeypatch.setattr(runner, "compiled_generate_config", fast_config)
    out = tmp_path / "out"
    args = [
        "bench",
        "--target",
        str(STORIES),
        "--methods",
        "ar,ar+compiled,pld,pld+compiled,oracle:4+compiled",
    ]
    args += ["--prompts", str(prompt_file), "--max-new-tokens", "24", "--check-lossless", "--threads", "1"]
    assert main([*args, "--dtype", "float32", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["compiled"] == ["ar+compiled", "oracle:4+compiled", "pld+compiled"]
    rows = {name: row for name, row in results["summary"].items()}
    for name in ("ar+compiled", "pld+compiled", "oracle:4+compiled"):
        assert rows[name]["lossless_mismatches"] == 0, name
    compiled_runs = [r for r in results["runs"] if r["method"] == "pld+compiled"]
    assert all(r["stats"]["compiled_rounds"] == r["stats"]["target_forwards"] for r in compiled_runs)
    with pytest.raises(ValueError, match="cannot run compiled"):
        runner.Method("hf-pld+compiled", None, None, 8)


def test_compiled_methods_keep_one_cache_length():
    """`fix_cache_length` gives a compiled method one static cache size for every call (one compile serves every
    prompt), transformers' compiled `generate` and hf-spec's compiled rounds alike; an eager method keeps
    transformers' default cache."""
    from hf_spec.bench import runner

    compiled, eager = runner.Method("ar+compiled", None, None, 8), runner.Method("ar", None, None, 8)
    rounds = runner.Method("pld+compiled", None, None, 8)
    for method in (compiled, eager, rounds):
        method.fix_cache_length(300)
    assert compiled.kwargs["max_cache_len"] == 300 and rounds.kwargs["max_cache_len"] == 300
    assert compiled.kwargs["cache_implementation"] == "static"
    assert "max_cache_len" not in eager.kwargs
