"""`hf-spec generate` (the demo command) on the real stories260K model."""

from __future__ import annotations

import pytest
import torch

from hf_spec.cli.generate import _compare
from hf_spec.cli.main import console_main, main
from hf_spec.models import load_model
from tests.conftest import STORIES

pytestmark = pytest.mark.usefixtures("keep_threads")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_generate_prints_speedup_and_losslessness(capsys, dtype):
    argv = ["generate", "--target", str(STORIES), "--method", "pld", "--prompt", "Once upon a time, Tom"]
    assert main([*argv, "--max-new-tokens", "24", "--threads", "1", "--dtype", dtype]) == 0
    text = capsys.readouterr().out
    assert f"torch.{dtype}" in text and "speedup: " in text and "tau) = " in text
    verdict = text.split("identical to plain greedy generate: ")[1].splitlines()[0]
    if dtype == "float32":
        assert verdict == "yes"
    else:
        assert verdict == "yes" or "bfloat16 near-tie" in verdict


def test_compare_names_the_divergence():
    model, tok = load_model(str(STORIES))
    ids = tok("Once upon a time", return_tensors="pt").input_ids
    ref = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert _compare(model, ids, ref, ref) == "yes"
    with torch.no_grad():
        logits = model(ref[:, : ids.shape[1] + 2]).logits[0, -1]
    worst = int(logits.argmin())  # a choice far from the argmax: not a tie
    bad = ref.clone()
    bad[0, ids.shape[1] + 2] = worst
    assert "from token 2" in _compare(model, ids, bad, ref) and "NOT a near-tie" in _compare(
        model, ids, bad, ref
    )
    assert "lengths differ" in _compare(model, ids, ref[:, :-1], ref)


def test_methods_lists_every_field_with_its_default(capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    assert "pld  (name:VALUE sets num_draft_tokens)" in out
    assert "    datastore = {}: " in out  # a factory default shows its value
    assert "    switch (None: off): " in out
    assert "    switch.rule = 'match' ['match' | 'cost' | 'best']: " in out
    assert "    precut.alpha = 0.1: " in out  # the fields of a config's parts, by their dotted names
    assert "MISSING" not in out


def test_console_errors_are_one_line(capsys, monkeypatch):
    """The shell command reports bad input in one line (exit 2) before loading anything; HF_SPEC_DEBUG re-raises."""
    monkeypatch.delenv("HF_SPEC_DEBUG", raising=False)
    assert console_main(["generate", "--target", str(STORIES), "--method", "pld:-3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf-spec: error: pld: num_draft_tokens must be >= 1, got -3") and "\n" not in err
    assert console_main(["generate", "--target", "./no/such/folder", "--method", "pld"]) == 2
    assert "no model folder at ./no/such/folder" in capsys.readouterr().err
    monkeypatch.setenv("HF_SPEC_DEBUG", "1")
    with pytest.raises(ValueError, match="num_draft_tokens"):
        console_main(["generate", "--target", str(STORIES), "--method", "pld:0"])


def test_generate_reports_the_spread_and_a_busy_machine(monkeypatch):
    """The demo's speedup is a median of interleaved runs with its spread; a busy machine or runs that disagree
    get a warning instead of one number taken as the truth."""
    from hf_spec.cli import generate

    monkeypatch.setattr(generate.os, "cpu_count", lambda: 2)
    assert generate._median([1.0, 3.0, 2.0]) == 2.0 and generate._median([1.0, 2.0]) == 1.5
    quiet = generate._load_line(0.4, 1.9, [1.70, 1.74, 1.78])
    assert quiet == "load average: 0.40 before the runs, 1.90 after (2 cores)"
    busy = generate._load_line(3.5, 4.0, [1.70, 1.74, 1.78])
    assert "warning: the machine was busy (load 3.50 on 2 cores before the runs)" in busy
    noisy = generate._load_line(0.1, 1.0, [0.46, 1.60, 1.74])
    assert "warning: the runs disagree (0.46x to 1.74x)" in noisy and "busy" not in noisy


def test_generate_times_interleaved_repeats(capsys):
    argv = ["generate", "--target", str(STORIES), "--method", "pld", "--prompt", "Once upon a time, Tom"]
    assert (
        main([*argv, "--max-new-tokens", "12", "--threads", "1", "--dtype", "float32", "--repeats", "2"]) == 0
    )
    text = capsys.readouterr().out
    assert "(median of 2 runs;" in text and "over 2 interleaved runs" in text and "load average: " in text
