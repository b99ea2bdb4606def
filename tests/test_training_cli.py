"""`hf-spec data` / `hf-spec train` end to end on the real 260K-parameter stories model: answers generated and
cached, features captured, a head trained, saved as a Hub-style folder, resumed, and used by generate."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_spec.cli.main import main
from hf_spec.training.prompts import load_train_prompts
from hf_spec.training.responses import ResponseCache
from tests.conftest import STORIES


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "tasks.jsonl"
    rows = [
        {"id": f"t{i}", "instruction": f"Once upon a time there was a {w}"}
        for i, w in enumerate(["cat", "dog", "girl", "boy", "tree", "ball", "bird", "car"])
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_eval_sets_are_refused(tmp_path):
    bad = tmp_path / "eval" / "spec_bench_dev.jsonl"
    bad.parent.mkdir()
    bad.write_text("{}\n")
    with pytest.raises(ValueError, match="evaluation prompt set"):
        load_train_prompts(bad)


@pytest.mark.parametrize("kind", ["eagle", "lyanna"])
def test_train_cli_end_to_end_and_resume(tmp_path, prompts_file, kind):
    data, out = tmp_path / "data", tmp_path / "head"
    args = [
        "train",
        kind,
        "--target",
        str(STORIES),
        "--prompts",
        str(prompts_file),
        "--data-dir",
        str(data),
        "--max-new-tokens",
        "24",
        "--batch-size",
        "4",
        "--draft-vocab",
        "256",
        "--epochs",
        "2",
        "--lr",
        "1e-3",
        "--batch-tokens",
        "256",
        "--heldout",
        "2",
        "--save-every",
        "2",
        "--out",
        str(out),
        "--checkpoint-dir",
        str(tmp_path / "run"),
        "--threads",
        "1",
    ]
    assert main(args) == 0
    assert len(ResponseCache(data).load()) == 8  # answers cached: a second run generates nothing
    report = json.loads((out / "training_report.json").read_text())
    assert report["steps"] > 0 and report["final_loss"] < report["first_loss"]
    assert (out / "custom_generate" / "generate.py").exists() and (out / "README.md").read_text().startswith(
        "---"
    )
    # resume: the finished checkpoint is picked up, no step is redone
    assert main(args) == 0
    again = json.loads((out / "training_report.json").read_text())
    assert again["steps"] == report["steps"] and again["final_loss"] == report["final_loss"]

    tok = AutoTokenizer.from_pretrained(STORIES)
    model = AutoModelForCausalLM.from_pretrained(STORIES).eval()
    ids = tok("Once upon a time there was a frog", return_tensors="pt").input_ids
    ref = model.generate(ids, max_new_tokens=32, do_sample=False)
    out_ids = model.generate(
        ids, max_new_tokens=32, do_sample=False, custom_generate=str(out), trust_remote_code=True
    )
    assert torch.equal(out_ids, ref)


def test_head_card_lists_measured_rows_with_their_config():
    from hf_spec.heads.card import head_card

    row = {"method": "eagle:c.json", "prompts": 13, "tau": 1.5, "speedup": 1.1, "machine": "cpu", "date": "d"}
    rows = [row | {"command": "hf-spec bench A"}, row | {"tau": 1.2, "command": "hf-spec bench A"}]
    card = head_card("HASS", "eagle", "t", {"config": {}}, "cmd", rows)
    assert "| `eagle:c.json` | 13 | 1.50 | 1.10x | cpu | d |" in card and "| 1.20 |" in card
    assert card.count("- `hf-spec bench A`") == 1  # one line per distinct command
