"""Paper Table 3 / Table 4 analogues from `hf-spec bench` outputs of postuse configs.

    python lab/research/postuse_tables.py lab/results/postuse-qwen2.5-coder-0.5b-instruct [more result dirs]
        [--fixed=-lambda2.json]

Prints one markdown table per results folder: speedup vs `ar`, speed relative to the fixed-lambda config
(`*-fixed.json`, or the config whose name ends with `--fixed`) of the same run, tau (mean tokens per target forward = mean accepted length + 1), draft
utilization (accepted tree nodes / proposed tree nodes, cached branches included), plus lossless mismatches.
Where the run recorded the postuse drafter's counters (`drafter_counts`) it adds draft calls per
round and the drafter's utilization: output tokens that came from the drafter's chain or from cached phrases /
tokens the drafter drafted (the paper's "drafted tokens converted into output"; the cache only recycles text).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def drafter_counts(results: dict) -> dict[str, dict[str, float]]:
    """Per method, the sum of its prompts' postuse counters."""
    total: dict[str, dict[str, float]] = {}
    for run in results["runs"]:
        if not run["method"].startswith("postuse:"):  # e.g. HiSpec's counters
            continue
        for k, v in run.get("drafter_counts", {}).items():
            acc = total.setdefault(run["method"], {})
            acc[k] = acc.get(k, 0) + v
    return total


def drafter_utilization(c: dict[str, float]) -> float:
    return (c["chain_accepted"] + c["cache_accepted"]) / max(c["chain_tokens"], 1)


def table(results: dict, fixed_suffix: str = "-fixed.json") -> str:
    summary = results["summary"]
    counts = drafter_counts(results)
    fixed_name = next((n for n in summary if n.endswith(fixed_suffix)), None)
    fixed = summary.get(fixed_name)
    head = "| method | speedup vs ar | vs fixed lambda | tau | mean accepted length | draft util. | util. vs fixed | mismatches |"
    sep = "|---|---|---|---|---|---|---|---|"
    if counts:
        head += " draft calls / round | drafter util. | drafter util. vs fixed |"
        sep += "---|---|---|"
    lines = [head, sep]
    for name, e in summary.items():
        short = name
        if name.startswith("postuse:"):
            short = Path(name.split(":", 1)[1]).stem.replace("postuse-qwen2.5-coder-0.5b-instruct", "postuse")
        util = e.get("draft_utilization")
        rel = e["tokens_per_s"] / fixed["tokens_per_s"] if fixed else float("nan")
        rel_util = util / fixed["draft_utilization"] if fixed and util else float("nan")
        lines.append(
            f"| `{short}` | {e['speedup_vs_ar']:.2f}x | {rel:.2f}x | {e['tau']:.2f} | {e['tau'] - 1:.2f} | "
            + (f"{util:.2f}" if util else "-")
            + f" | {rel_util:.2f}x | {e.get('lossless_mismatches', '-')} |"
        )
        if counts:
            c, base = counts.get(name), counts.get(fixed_name)
            if c:
                du = drafter_utilization(c)
                rel_du = f"{du / drafter_utilization(base):.2f}x" if base else "-"
                lines[-1] += f" {c['draft_calls'] / max(c['rounds'], 1):.2f} | {du:.2f} | {rel_du} |"
            else:
                lines[-1] += " - | - | - |"
    m = results["machine"]
    lines += [
        "",
        f"Command: `{results.get('command', '')}`",
        "",
        f"{m['cpu']}, {m['torch_threads']} threads, {m['date']}",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folders", nargs="+")
    ap.add_argument("--fixed", default="-fixed.json", help="name suffix of the fixed-lambda baseline config")
    args = ap.parse_args()
    for folder in args.folders:
        results = json.loads((Path(folder) / "results.json").read_text())
        print(f"### {folder}\n")
        print(table(results, args.fixed) + "\n")


if __name__ == "__main__":
    main()
