"""Scoring and writing a benchmark run: per-method summary (speedup vs `ar`, tau, per category and Spec-Bench
group, acceptance by depth), `results.json`, a markdown table and the plots of `hf_spec.bench.plots`."""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from pathlib import Path

from hf_spec.bench.plots import plot_speedups, write_plots  # noqa: F401 - plot_speedups: re-exported (runner)
from hf_spec.bench.prompts import spec_bench_group
from hf_spec.engine.outputs import sum_counts


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
        write_plots(results, out)
    except ImportError:
        print("matplotlib is not installed (pip install 'hf-spec[bench]'): no plots", file=sys.stderr)


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
        + _bf16_kernel_note(m.get("bf16_kernel_rows")),
    ]
    return "\n".join(lines) + "\n"


def _bf16_kernel_note(rows: int | None) -> str:
    """The machine line's note on hf-spec's bfloat16 linear kernel: the rows it takes (0: none on this CPU)."""
    if rows is None:
        return ""
    return "; bf16 kernel off" if rows == 0 else f"; bf16 kernel on 1-{rows} rows"
