"""The user-facing docs: every generated figure matches the kept benchmark results, no development history in the
README, docs or model cards, the API page's drafter example runs, and the canonical benchmark script runs end to
end on the tiny stories260K model. (`scripts/test.sh` builds the site itself with `mkdocs build --strict`.)"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import STORIES

REPO = Path(__file__).resolve().parents[1]
USER_DOCS = [REPO / "README.md", *(REPO / "docs").rglob("*.md"), *(REPO / "model_cards").rglob("README.md")]


def test_generated_figures_match_the_kept_results():
    """README, docs and model cards hold exactly what `benchmarks/canonical.py report` writes from the kept
    results: no figure typed by hand, none left stale."""
    done = subprocess.run(
        [sys.executable, "benchmarks/canonical.py", "report", "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_user_docs_carry_no_development_history():
    pattern = re.compile(r"session [0-9]|issue [0-9]", re.IGNORECASE)
    found = [f"{p.relative_to(REPO)}: {m[0]}" for p in USER_DOCS for m in pattern.finditer(p.read_text())]
    assert not found, found


def test_the_drafter_example_runs_and_is_lossless(tmp_path):
    """The `Drafter` example of docs/api/drafter.md registers a method that decodes as plain greedy `generate`
    (in a subprocess: it registers a method)."""
    script = tmp_path / "example.py"
    script.write_text(
        "import re, sys, torch\n"
        "from pathlib import Path\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f"exec(re.search(r'```python\\n(.*?)```', Path({str(REPO / 'docs/api/drafter.md')!r}).read_text(), re.S)[1])\n"
        "from hf_spec import SpeculativeDecoder\n"
        f"model = AutoModelForCausalLM.from_pretrained({str(STORIES)!r}).eval()\n"
        f"tok = AutoTokenizer.from_pretrained({str(STORIES)!r})\n"
        "ids = tok('Once upon a time', return_tensors='pt').input_ids\n"
        "ref = model.generate(ids, max_new_tokens=24, do_sample=False)\n"
        "out = model.generate(ids, max_new_tokens=24, do_sample=False, custom_generate=SpeculativeDecoder('repeat:4'))\n"
        "sys.exit(0 if torch.equal(ref, out) else 1)\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.slow
def test_canonical_run_on_stories(tmp_path):
    """`benchmarks/canonical.py run` benches the target's canonical methods into `<root>/<machine class>/<target>/`,
    with both plots, and records its own command."""
    prompts = tmp_path / "prompts.jsonl"
    rows = [
        {"question_id": 1, "category": "summarization", "turns": ["Tom had a big red ball. Tom had a big"]},
        {"question_id": 2, "category": "writing", "turns": ["Once upon a time, there was a little girl"]},
    ]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["--target", str(STORIES), "--prompts", str(prompts), "--limit", "2", "--max-new-tokens", "16"]
    args += ["--dtype", "float32", "--threads", "1", "--no-report", "--out-root", str(tmp_path / "results")]
    command = [sys.executable, "benchmarks/canonical.py", "run", *args]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (run_dir,) = (tmp_path / "results").glob("*/stories260K")
    results = json.loads((run_dir / "results.json").read_text())
    assert results["canonical"]["command"].startswith("python benchmarks/canonical.py run")
    assert set(results["summary"]) == {"ar", "hf-pld", "pld", "early-exit:3", "oracle:4"}
    assert (run_dir / "speedup.png").is_file() and (run_dir / "acceptance.png").is_file()


def test_recorded_commands_name_checkout_paths_as_a_user_types_them():
    """Paths inside the checkout are written relative to it and paths beside it (../shared) from its parent."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from canonical import repo_relative

    command = (
        f"hf-spec bench --prompts {REPO.parent}/shared/p.jsonl --out {REPO}/benchmarks/results/.running-x"
    )
    assert (
        repo_relative(command)
        == "hf-spec bench --prompts ../shared/p.jsonl --out benchmarks/results/.running-x"
    )


def test_report_reads_canonical_runs_only(tmp_path):
    """A plain `hf-spec bench` kept under benchmarks/results/ (a tree sweep, ...) is not a canonical run."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from canonical import load_runs

    machine = {"date": "2026-01-01 00:00 UTC"}
    for name, extra in [
        ("canonical", {"canonical": {"command": "python benchmarks/canonical.py run"}}),
        ("side", {}),
    ]:
        (tmp_path / name / "stories260K").mkdir(parents=True)
        results = {"summary": {"ar": {}}, "machine": machine, "command": "hf-spec bench", **extra}
        (tmp_path / name / "stories260K" / "results.json").write_text(json.dumps(results))
    assert list(load_runs(tmp_path)) == ["canonical"]
