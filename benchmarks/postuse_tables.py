"""Paper Table 3 / Table 4 analogues from `hf-spec bench` outputs of postuse configs.

    python benchmarks/postuse_tables.py benchmarks/results/postuse-qwen2.5-coder-0.5b-instruct [more result dirs]

Prints one markdown table per results folder: speedup vs `ar`, speed relative to the fixed-lambda config
(`*-fixed.json`) of the same run, tau (mean tokens per target forward = mean accepted length + 1) and draft
utilization (accepted tree nodes / proposed tree nodes, cached branches included), plus lossless mismatches.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def table(results: dict) -> str:
    summary = results["summary"]
    fixed = next((e for n, e in summary.items() if n.endswith("-fixed.json")), None)
    head = "| method | speedup vs ar | vs fixed lambda | tau | mean accepted length | draft util. | util. vs fixed | mismatches |"
    lines = [head, "|---|---|---|---|---|---|---|---|"]
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
    m = results["machine"]
    lines += [
        "",
        f"Command: `{results.get('command', '')}`",
        "",
        f"{m['cpu']}, {m['torch_threads']} threads, {m['date']}",
    ]
    return "\n".join(lines)


def main() -> None:
    for folder in sys.argv[1:]:
        results = json.loads((Path(folder) / "results.json").read_text())
        print(f"### {folder}\n")
        print(table(results) + "\n")


if __name__ == "__main__":
    main()
