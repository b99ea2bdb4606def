"""Model cards (README.md) for saved heads: what it is for, how it was trained, what it measured."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any


def head_card(
    kind: str,
    method: str,
    target: str,
    report: dict[str, Any],
    command: str,
    measured: list[dict[str, Any]] | None = None,
) -> str:
    """Markdown card. `measured`: rows of `{"method", "prompts", "tau", "speedup", "command", "machine", "date"}`."""
    cfg = report.get("config", {})
    heldout = report.get("heldout", {})
    lines = [
        "---",
        "library_name: hf-spec",
        f"base_model: {target}",
        "tags: [speculative-decoding, draft-head, hf-spec]",
        "---",
        "",
        f"# {kind} draft head for {target}",
        "",
        f"A draft head for lossless speculative decoding of `{target}` with "
        f"hf-spec (`{method}` method). Output is identical to plain greedy "
        "`generate`; sampling keeps the target distribution. Loading it onto another model raises an error "
        "(the config records the target's fingerprint).",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM",
        "target = AutoModelForCausalLM.from_pretrained(TARGET_FOLDER)",
        "out = target.generate(input_ids, max_new_tokens=256, custom_generate=THIS_FOLDER, trust_remote_code=True)",
        "```",
        f"or `hf-spec bench --target {target} --methods ar,{method}:THIS_FOLDER`.",
        "",
        "## Training",
        "",
        f"- Command: `{command}`",
        f"- Data: the target's own greedy answers to {report.get('train_conversations')} training conversations "
        f"(prompts: {_prompt_sources(report)}; never evaluation prompts), "
        f"{report.get('train_tokens')} tokens; {report.get('heldout_conversations')} conversations held out.",
        f"- Objective: {_objective(cfg)}",
        f"- Draft vocabulary: {cfg.get('draft_vocab')} most frequent answer tokens "
        f"(coverage {report.get('draft_vocab_coverage')} of "
        f"{report.get('draft_vocab_coverage_on', 'training')} answer tokens).",
        f"- Steps: {report.get('steps')} ({report.get('epochs')} epochs), lr {cfg.get('lr')}, batch "
        f"{cfg.get('batch_tokens')} tokens, seed {cfg.get('seed')}; wall time {report.get('wall_seconds')} s "
        "on the CPU named in the command's log.",
        f"- Loss: {report.get('first_loss')} (first step) -> {report.get('final_loss')} (last step); held-out loss "
        f"{heldout.get('loss')}.",
        f"- Held-out top-1 agreement with the target by draft depth (alignment-masked): "
        f"{heldout.get('accuracy_by_depth')}.",
        "",
        "## Measured decoding",
        "",
    ]
    if measured:
        lines += [
            "| decoding config | prompts | tau | speedup vs plain generate | machine | date |",
            "|---|---|---|---|---|---|",
        ]
        for row in measured:
            lines.append(
                f"| `{row.get('method', '')}` | {row['prompts']} | {row['tau']:.2f} | {row['speedup']:.2f}x "
                f"| {row['machine']} | {row['date']} |"
            )
        lines += ["", "Commands:", ""] + [f"- `{c}`" for c in dict.fromkeys(r["command"] for r in measured)]
    else:
        lines.append("Not benchmarked yet: run the `hf-spec bench` command above; see docs/benchmarks.md.")
    lines += ["", "## Training report", "", "```json", json.dumps(report, indent=1)[:6000], "```", ""]
    return "\n".join(lines)


def _prompt_sources(report: dict[str, Any]) -> str:
    """The training prompt files, from the report or else the `--prompts` of its command (default: both files)."""
    from hf_spec.training.data import DEFAULT_PROMPTS

    files = report.get("prompt_files")
    if not files:
        words = shlex.split(report.get("command", ""))
        files = [b for a, b in zip(words, words[1:], strict=False) if a == "--prompts"] or DEFAULT_PROMPTS
    return ", ".join(f"`{Path(f).name}`" for f in files)


def _objective(cfg: dict[str, Any]) -> str:
    if "token_info_rank" in cfg:  # Lyanna
        return (
            f"alpha={cfg.get('feature_weight')} x MSE(h, H) + beta={cfg.get('ce_weight')} x soft cross-entropy, over a "
            f"{cfg.get('align_steps')}-step hidden-state chain; token-info rank {cfg.get('token_info_rank')}; "
            f"first-token fusion {cfg.get('first_token_fusion')}"
        )
    parts = [
        f"EAGLE feature SmoothL1 (x{cfg.get('feature_weight')}) + soft cross-entropy (x{cfg.get('ce_weight')})"
    ]
    if cfg.get("topk"):
        parts.append(f"HASS top-{cfg['topk']} distillation (x{cfg.get('topk_weight')})")
    steps = cfg.get("align_steps", 1)
    parts.append(
        f"HASS context alignment, {steps} steps" if steps > 1 else "no context alignment (plain EAGLE)"
    )
    return "; ".join(parts)
