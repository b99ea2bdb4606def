"""`lab/same_tokens.sh` end to end on the real stories260K model: an EAGLE-3 head and a HASS head trained
on the same tokens of a store (two steps), then decoded side by side in one lossless `hf-spec bench` run."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from hf_spec.training.features import capture_sequences
from tests.conftest import STORIES
from tests.test_train_from_store import items

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # about a minute: two trainings, two fine-tunings and a nine-method bench
def test_same_tokens_trains_both_heads_on_one_selection_and_benches_them(stories, tmp_path):
    model, _ = stories
    store = capture_sequences(
        model, items(model), tmp_path / "store", topk=16, aux_layers=(1, 2, 3), progress=False
    )
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"question_id": i, "category": "writing", "turns": [f"Once upon a time {i}"]}) + "\n"
            for i in range(2)
        )
    )
    out = tmp_path / "out"
    env = os.environ | {
        "HF_HUB_OFFLINE": "1",
        "FEATURES": str(store.folder),
        "OUT": str(out),
        "TOKENS": "200",
        "HELDOUT": "2",
        "DRAFT_VOCAB": "64",
        "VOCAB_LIMIT": "32",
        "BATCH_TOKENS": "256",
        "PROMPTS": str(prompts),
        "BENCH_ARGS": "--limit 2 --max-new-tokens 12",
    }
    done = subprocess.run(
        ["bash", "lab/same_tokens.sh", str(STORIES)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    # step 1: both heads on the same sequences, evaluated on the same held-out answers
    first = {
        kind: json.loads((out / kind / "arms" / "same-200" / "head" / "training_report.json").read_text())
        for kind in ("eagle3", "hass")
    }
    assert first["eagle3"]["heldout_ids"] == first["hass"]["heldout_ids"] and first["hass"]["heldout_ids"]
    assert first["eagle3"]["selected_tokens"] == first["hass"]["selected_tokens"] >= 200
    # step 2: on from each head, over the answers only
    for kind in ("eagle3", "hass"):
        report = json.loads((out / "step2" / kind / "head" / "training_report.json").read_text())
        assert report["started_from"]["training"]["heldout"] == first[kind]["heldout"]
        assert report["sources"] == "answers" and report["heldout_ids"] == first[kind]["heldout_ids"]
    # decoding: ar and the four heads at two trees, every output the target's own
    bench = json.loads((out / "bench" / "results.json").read_text())
    assert len(bench["summary"]) == 9 and "ar" in bench["summary"]
    configs = sorted(p.name for p in (out / "configs").iterdir())
    assert configs == sorted(
        f"{kind}{step}-{tree}.json"
        for kind in ("eagle3", "hass")
        for step in ("", "-step2")
        for tree in ("d4k2t5", "d6k3t12")
    )
    assert all(run.get("lossless", True) or run.get("near_tie") for run in bench["runs"])
