"""`hf_spec.bench.plots`: short labels, per-prompt spreads and both plots of a bench run."""

from __future__ import annotations

import pytest

from hf_spec.bench.plots import per_prompt, per_prompt_by_group, run_target, short_label, write_plots

Q = "qwen2.5-coder-0.5b-instruct"


def _results() -> dict:
    runs = []
    for qid, cat, ar, pld in (
        (1, "summarization", 10.0, 30.0),
        (2, "writing", 10.0, 12.0),
        (3, "qa", 20.0, 20.0),
    ):
        runs.append(
            {"method": "ar", "question_id": qid, "turn": 0, "category": cat, "tokens_per_s": ar, "tau": 1.0}
        )
        runs.append(
            {
                "method": "pld",
                "question_id": qid,
                "turn": 0,
                "category": cat,
                "tokens_per_s": pld,
                "tau": 2.0,
                "draft_utilization": 0.5,
            }
        )
    entry = {
        "speedup_vs_ar": 62 / 40 * 1.0,
        "tau": 2.0,
        "tokens_per_s": 62 / 3,
        "draft_utilization": 0.5,
        "per_group": {"summarization": 3.0, "mt_bench": 1.2, "qa": 1.0},
        "prompts": 3,
    }
    ar = {
        "speedup_vs_ar": 1.0,
        "tau": 1.0,
        "tokens_per_s": 40 / 3,
        "draft_utilization": None,
        "per_group": {"summarization": 1.0, "mt_bench": 1.0, "qa": 1.0},
        "prompts": 3,
    }
    machine = {"cpu": "Test CPU", "torch_threads": 2, "dtype": "float32"}
    command = f"hf-spec bench --target /models/{Q} --methods ar,pld --out x"
    return {"summary": {"ar": ar, "pld": entry}, "runs": runs, "machine": machine, "command": command}


def test_short_labels_name_the_config():
    assert short_label(f"retrieval:benchmarks/configs/retrieval-{Q}-long.json", Q) == "retrieval-long"
    assert short_label(f"eagle:benchmarks/configs/hass-{Q}-int4-chain2.json", Q) == "hass-int4-chain2"
    assert short_label(f"talon:benchmarks/configs/talon-{Q}.json", Q) == "talon"
    assert short_label(f"eagle:model_cards/hass-{Q}", Q) == "hass"
    assert short_label("early-exit:12", Q) == "early-exit:12" and short_label("pld") == "pld"
    assert (
        short_label(f"eagle3:benchmarks/configs/eagle3-{Q}-chain3.json+compiled", Q)
        == "eagle3-chain3+compiled"
    )
    assert short_label("pld+compiled", Q) == "pld+compiled"
    assert run_target(_results()) == Q


def test_per_prompt_values_are_against_ar_on_the_same_prompt():
    results = _results()
    assert per_prompt(results, "speedup")["pld"] == [3.0, 1.2, 1.0]
    assert per_prompt(results, "draft_utilization")["pld"] == [0.5, 0.5, 0.5]
    assert per_prompt_by_group(results)["pld"]["mt_bench"] == [1.2]  # writing is an MT-bench category


def test_both_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    paths = write_plots(_results(), tmp_path)
    assert [p.name for p in paths] == ["speedup.png", "acceptance.png"]
    assert all(p.stat().st_size > 1000 for p in paths)
