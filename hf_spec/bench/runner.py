"""`hf-spec bench`: methods run interleaved prompt by prompt, Spec-Bench style scoring.

speedup = mean per-prompt tokens/s of a method / that of `ar`;
tau     = tokens committed per target forward (`ar` = 1.00).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from hf_spec.decoder import SpeculativeDecoder
from hf_spec.generate import sum_counts
from hf_spec.kernels.grouped_attention import grouped_attention
from hf_spec.kernels.skinny_linear import bf16_kernel_decision, fast_linears, one_row_kernel_decision
from hf_spec.models.fetch import dtype_name

# Spec-Bench's six groups: the eight MT-bench categories count as one
MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
NEAR_TIE = 1e-3  # float32: logits of one position agree to ~1e-5 across the forward shapes used
# bfloat16: incremental decoding and one full forward of the same Qwen2.5-0.5B text differ by up to 0.31 in a
# logit (median 0.19; 239 positions measured, docs/benchmarks.md), so a choice within 0.5 is a numeric tie there
NEAR_TIE_BY_DTYPE = {torch.bfloat16: 0.5, torch.float16: 0.0625}


def near_tie_threshold(dtype: torch.dtype) -> float:
    """Logit gap below which two forwards of different shape may rank two tokens either way in `dtype`."""
    return NEAR_TIE_BY_DTYPE.get(dtype, NEAR_TIE)


def spec_bench_group(category: str) -> str:
    return "mt_bench" if category in MT_BENCH else category


@dataclass
class Prompt:
    question_id: str
    category: str
    turns: list[str]


def load_prompts(
    path: str | os.PathLike, limit: int | None = None, per_category: int | None = None
) -> list[Prompt]:
    """Spec-Bench questions; `per_category` keeps the first K of each category (file order), then `limit`."""
    prompts = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                turns = row["turns"]
                if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
                    raise TypeError(f"turns must be a non-empty list of strings, got {turns!r:.60}")
                prompts.append(Prompt(str(row["question_id"]), row.get("category", "all"), turns))
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ValueError(f"{path}:{line_no}: not a Spec-Bench question ({err})") from None
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    if per_category:
        seen: dict[str, int] = defaultdict(int)
        kept = []
        for p in prompts:
            seen[p.category] += 1
            if seen[p.category] <= per_category:
                kept.append(p)
        prompts = kept
    return prompts[:limit] if limit else prompts


def encode_chat(tokenizer, messages: list[dict]) -> torch.Tensor:
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    return tokenizer("\n".join(m["content"] for m in messages), return_tensors="pt").input_ids


class ForwardCounter:
    """Counts full target forwards: calls that reach the last decoder layer (early-exit drafts stop sooner)."""

    def __init__(self, model) -> None:
        self.count = 0
        self._handle = model.model.layers[-1].register_forward_pre_hook(self._hook)

    def _hook(self, *_) -> None:
        self.count += 1

    def close(self) -> None:
        self._handle.remove()


def synchronize(device: torch.device) -> None:
    """Wait for the GPU's queued work, so that wall-clock times cover it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Method:
    """One benchmarked method: `generate(input_ids, reference)` -> (sequence, stats)."""

    def __init__(self, name: str, model, tokenizer, max_new_tokens: int) -> None:
        self.name = name
        self.model = model
        self.kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False)
        self.decoder: SpeculativeDecoder | None = None
        # ar-kernels: plain decoding on hf-spec's CPU kernels (linears, attention), to measure their share alone
        self.kernels = name == "ar-kernels"
        if name in ("ar", "ar-kernels"):
            pass
        elif name == "hf-pld":
            self.kwargs["prompt_lookup_num_tokens"] = 10
        elif name.startswith("hf-early-exit"):
            _, _, k = name.partition(":")
            self.kwargs["assistant_early_exit"] = int(k or 6)
        else:
            self.decoder = SpeculativeDecoder(name, tokenizer=tokenizer)
            self.kwargs["custom_generate"] = self.decoder
        self.needs_reference = self.decoder is not None and self.decoder.config.method == "oracle"

    def generate(self, input_ids: torch.Tensor, reference: torch.Tensor | None, counter: ForwardCounter):
        if self.needs_reference:
            self.decoder.drafter_for(self.model).set_reference(reference)
        counter.count = 0
        input_ids = input_ids.to(self.model.device)
        synchronize(self.model.device)
        start = time.perf_counter()
        with (
            fast_linears(self.model, enabled=self.kernels),
            grouped_attention(self.model, enabled=self.kernels),
        ):
            out = self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **self.kwargs)
        synchronize(self.model.device)
        elapsed = time.perf_counter() - start
        new = out.shape[1] - input_ids.shape[1]
        row = {"new_tokens": new, "seconds": elapsed, "tokens_per_s": new / elapsed}
        if self.decoder is not None:
            stats = self.decoder.last_stats.to_dict()
            row.update(tau=stats["tau"], draft_utilization=stats["draft_utilization"], stats=stats)
            counts = getattr(self.decoder.drafter_for(self.model), "counts", None)  # e.g. HiSpec's rejections
            if counts:
                row["drafter_counts"] = dict(counts)
        else:  # ar: one forward per token; transformers' assisted loops: one per round
            row["tau"] = new / max(counter.count, 1)
        return out, row


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.no_grad()
def top2_gap(model, prefix: torch.Tensor) -> float:
    logits = model(input_ids=prefix).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def choice_gap(model, prefix: torch.Tensor, ar_token: int, other_token: int) -> float:
    """`|logit(ar's token) - logit(the other token)|` after `prefix`: how far apart the two choices were."""
    logits = model(input_ids=prefix).logits[0, -1].float()
    return float((logits[ar_token] - logits[other_token]).abs())


def machine_info() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    import transformers

    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "one_row_kernel": one_row_kernel_decision(),  # None: never measured (no one-row draft forward ran)
        "bf16_kernel_rows": bf16_kernel_decision(),  # None: never measured (no bfloat16 linear ran on hf-spec's path)
    }


def run_bench(
    model,
    tokenizer,
    method_names: list[str],
    prompts: list[Prompt],
    max_new_tokens: int = 128,
    turns: str = "first",
    check_lossless: bool = False,
    progress: Callable | None = None,
) -> dict:
    """Run every method on every prompt, interleaved, after one warm-up call each."""
    if len(set(method_names)) != len(method_names):
        raise ValueError("a method is listed twice")
    methods = [Method(n, model, tokenizer, max_new_tokens) for n in method_names]
    counter = ForwardCounter(model)
    runs: list[dict] = []
    try:
        warm = encode_chat(tokenizer, [{"role": "user", "content": prompts[0].turns[0]}]).to(model.device)
        for m in methods:
            ref = model.generate(warm, max_new_tokens=8, do_sample=False) if m.needs_reference else None
            m.kwargs["max_new_tokens"], saved = 8, m.kwargs["max_new_tokens"]
            m.generate(warm, ref, counter)
            m.kwargs["max_new_tokens"] = saved
        bar = progress(total=len(prompts) * len(methods)) if progress else None
        for p in prompts:
            histories: dict[str, list[dict]] = {m.name: [] for m in methods}
            for turn_idx, turn in enumerate(p.turns if turns == "all" else p.turns[:1]):
                reference = None
                ar_tokens: list[int] | None = None
                for m in methods:
                    messages = histories[m.name] + [{"role": "user", "content": turn}]
                    input_ids = encode_chat(tokenizer, messages).to(model.device)
                    if m.needs_reference and reference is None:
                        reference = model.generate(input_ids, do_sample=False, max_new_tokens=max_new_tokens)
                    out, row = m.generate(input_ids, reference, counter)
                    new_ids = out[0, input_ids.shape[1] :].tolist()
                    if m.name == "ar":
                        reference, ar_tokens = out, new_ids
                    row.update(method=m.name, question_id=p.question_id, category=p.category, turn=turn_idx)
                    if check_lossless and m.name != "ar" and ar_tokens is not None:
                        row.update(compare_greedy(model, input_ids, ar_tokens, new_ids))
                    runs.append(row)
                    answer = tokenizer.decode(new_ids, skip_special_tokens=True)
                    histories[m.name] = messages + [{"role": "assistant", "content": answer}]
                    if bar:
                        bar.update(1 if turn_idx == 0 else 0)
        if bar:
            bar.close()
    finally:
        counter.close()
    machine = {**machine_info(), "dtype": dtype_name(model.dtype), "device": model.device.type}
    return {"summary": summarize(runs, method_names, check_lossless), "runs": runs, "machine": machine}


def compare_greedy(model, input_ids: torch.Tensor, ar_tokens: list[int], new_ids: list[int]) -> dict:
    """Where `new_ids` first departs from `ar_tokens` (both new tokens after `input_ids` `(1, P)`), the logit gap
    between the two choices there, and whether that gap is a numeric tie in the model's dtype."""
    at = first_divergence(ar_tokens, new_ids)
    if at is None:
        return {"lossless": True}
    prefix = torch.cat(
        [input_ids[0], torch.tensor(ar_tokens[:at], dtype=torch.long, device=input_ids.device)]
    )[None]
    both = at < len(ar_tokens) and at < len(new_ids)
    with torch.no_grad():
        gap = choice_gap(model, prefix, ar_tokens[at], new_ids[at]) if both else float("inf")
    return {
        "lossless": False,
        "diverged_at": at,
        "choice_gap": gap,
        "near_tie": gap < near_tie_threshold(model.dtype),
    }


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def acceptance_by_depth(hits: list[int], tries: list[int]) -> list[float]:
    """Conditional acceptance rate at each draft depth: rounds accepting depth d / rounds whose draft reached
    depth d with depths 1..d-1 accepted (HASS Figure 5, Lyanna Table 1)."""
    return [h / t for h, t in zip(hits, tries, strict=True) if t]


def summarize(runs: list[dict], method_names: list[str], check_lossless: bool) -> dict:
    by = defaultdict(list)
    for r in runs:
        by[r["method"]].append(r)
    base = {(r["question_id"], r["turn"]): r["tokens_per_s"] for r in by.get("ar", [])}
    base_tps = _mean(list(base.values())) if base else float("nan")
    summary = {}
    for name in method_names:
        rows = by[name]
        tps = _mean([r["tokens_per_s"] for r in rows])
        cats = defaultdict(list)
        groups = defaultdict(list)
        for r in rows:
            cats[r["category"]].append(r)
            groups[spec_bench_group(r["category"])].append(r)

        def speedup(sub: list[dict]) -> float:
            ar = [base[(r["question_id"], r["turn"])] for r in sub if (r["question_id"], r["turn"]) in base]
            return _mean([r["tokens_per_s"] for r in sub]) / _mean(ar) if ar else float("nan")

        entry = {
            "speedup_vs_ar": tps / base_tps if base else float("nan"),
            "tau": _mean([r["tau"] for r in rows]),
            "tokens_per_s": tps,
            "per_category": {c: speedup(sub) for c, sub in sorted(cats.items())},
            "per_group": {g: speedup(sub) for g, sub in sorted(groups.items())},
            "draft_utilization": _mean(utils)
            if (utils := [r["draft_utilization"] for r in rows if "draft_utilization" in r])
            else None,
            "prompts": len(rows),
        }
        if any("stats" in r for r in rows):
            keys = ("time_prefill", "time_draft", "time_verify", "time_other", "target_forwards")
            entry["totals"] = {k: sum(r["stats"][k] for r in rows) for k in keys}
            tries = sum_counts(r["stats"].get("depth_tries", []) for r in rows)
            hits = sum_counts(r["stats"].get("depth_hits", []) for r in rows)
            entry["acceptance_by_depth"] = [round(a, 4) for a in acceptance_by_depth(hits, tries)]
            entry["overhead_ms_per_round"] = (
                1000 * entry["totals"]["time_other"] / max(entry["totals"]["target_forwards"], 1)
            )
        if check_lossless and name != "ar":
            bad = [r for r in rows if r.get("lossless") is False]
            entry["lossless_mismatches"] = len(bad)
            entry["near_tie_mismatches"] = sum(1 for r in bad if r["near_tie"])
        summary[name] = entry
    return summary


def write_outputs(results: dict, out_dir: str | os.PathLike) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=float) + "\n")
    (out / "results.md").write_text(markdown_table(results))
    try:
        plot_speedups(results, out / "speedup.png")
    except ImportError:
        print("matplotlib is not installed (pip install 'hf-spec[bench]'): no speedup.png", file=sys.stderr)


def markdown_table(results: dict) -> str:
    summary = results["summary"]
    groups = sorted({g for e in summary.values() for g in e["per_group"]})
    lossless = any("lossless_mismatches" in e for e in summary.values())
    head = (
        ["method", "speedup", "tau", "tok/s", "draft util."]
        + groups
        + (["mismatches (near-tie)"] if lossless else [])
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, e in summary.items():
        util = e.get("draft_utilization")
        row = [
            f"`{name}`",
            f"{e['speedup_vs_ar']:.2f}x",
            f"{e['tau']:.2f}",
            f"{e['tokens_per_s']:.1f}",
            f"{util:.2f}" if util else "-",
        ]
        row += [f"{e['per_group'].get(g, float('nan')):.2f}x" for g in groups]
        if lossless:
            row.append(
                f"{e['lossless_mismatches']} ({e['near_tie_mismatches']})"
                if "lossless_mismatches" in e
                else "-"
            )
        lines.append("| " + " | ".join(row) + " |")
    m = results["machine"]
    lines += [
        "",
        f"Command: `{results.get('command', '')}`",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['torch_threads']} torch threads; "
        f"{m.get('dtype', 'float32')} weights; torch {m['torch']}, "
        f"transformers {m['transformers']}; {m['date']}"
        + (
            ""
            if m.get("one_row_kernel") is None
            else f"; one-row kernel {'on' if m['one_row_kernel'] else 'off'}"
        )
        + ("" if m.get("bf16_kernel_rows") is None else f"; bf16 kernel on 1-{m['bf16_kernel_rows']} rows"),
    ]
    return "\n".join(lines) + "\n"


def plot_speedups(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = {k: v for k, v in results["summary"].items() if k != "ar"}
    groups = sorted({g for e in summary.values() for g in e["per_group"]}) + ["overall"]
    width = 0.8 / max(len(summary), 1)
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(groups)), 4))
    for i, (name, e) in enumerate(summary.items()):
        vals = [e["per_group"].get(g, 0) for g in groups[:-1]] + [e["speedup_vs_ar"]]
        ax.bar([j + i * width for j in range(len(groups))], vals, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))], groups, rotation=20)
    ax.set_ylabel("speedup vs ar")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
