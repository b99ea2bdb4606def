"""Markdown table of a head ablation (`lab/research/ablation_heads.sh align|lyanna`): per head, its training wall
time and held-out top-1 accuracy by depth (`training_report.json`), and from the bench run its speedup, tau and
conditional acceptance by draft depth.

    python lab/research/ablation_table.py lab/results/ablation-align-smollm2-135m-instruct
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _fmt(values: list[float] | None) -> str:
    return " / ".join(f"{v:.2f}" for v in values) if values else "-"


def table(results_dir: Path) -> str:
    results = json.loads((results_dir / "results.json").read_text())
    lines = [
        "| head | train s | held-out top-1 by depth | speedup | tau | acceptance by depth (bench) |",
        "|---|---|---|---|---|---|",
    ]
    for name, entry in results["summary"].items():
        if name == "ar":
            continue
        folder = Path(name.split(":", 1)[1])
        report_path = folder / "training_report.json"
        report = json.loads(report_path.read_text()) if report_path.exists() else {}
        lines.append(
            f"| `{folder.name}` | {report.get('wall_seconds', '-')} | "
            f"{_fmt(report.get('heldout', {}).get('accuracy_by_depth'))} | {entry['speedup_vs_ar']:.2f}x | "
            f"{entry['tau']:.2f} | {_fmt(entry.get('acceptance_by_depth'))} |"
        )
    ar = results["summary"].get("ar", {})
    m = results["machine"]
    lines.append(
        f"\n`ar` {ar.get('tokens_per_s', float('nan')):.1f} tok/s; {m['cpu']}, {m['torch_threads']} threads, "
        f"torch {m['torch']}, {m.get('dtype', 'float32')}, {m['date']}"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(f"### {arg}\n\n{table(Path(arg))}\n")
