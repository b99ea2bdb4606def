"""Rewrite a saved head's model card (README.md) with measured rows from `hf-spec bench` results.

Usage: python scripts/update_head_card.py <head folder> <results.json> [<results.json> ...]
Every method in a results file whose spec names the head folder (directly or through a config whose "head" is
that folder) adds a row: prompts, tau, speedup vs `ar`, machine, date and the bench command.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hf_spec.heads.card import head_card


def names_head(method: str, folder: Path) -> bool:
    _, _, arg = method.partition(":")
    if not arg:
        return False
    path = Path(arg)
    if path.is_file():
        head = json.loads(path.read_text()).get("head", "")
        return bool(head) and Path(head).resolve() == folder.resolve()
    return path.resolve() == folder.resolve()


def measured_rows(folder: Path, results_files: list[str]) -> list[dict]:
    rows = []
    for name in results_files:
        results = json.loads(Path(name).read_text())
        machine = results["machine"]
        for method, entry in results["summary"].items():
            if names_head(method, folder):
                rows.append(
                    {
                        "method": method,
                        "prompts": entry["prompts"],
                        "tau": entry["tau"],
                        "speedup": entry["speedup_vs_ar"],
                        "machine": f"{machine['cpu']}, {machine['torch_threads']} threads, {machine.get('dtype', 'float32')}",
                        "date": machine["date"],
                        "command": results.get("command", ""),
                    }
                )
    return rows


def main() -> None:
    folder, results_files = Path(sys.argv[1]), sys.argv[2:]
    report = json.loads((folder / "training_report.json").read_text())
    recipe = json.loads((folder / "hf_spec_config.json").read_text())
    config = json.loads((folder / "config.json").read_text())
    method = recipe["method"]
    kind = "Lyanna" if method == "lyanna" else ("HASS" if folder.name.startswith("hass") else "EAGLE")
    target = Path(config["target"]["name_or_path"]).name
    rows = measured_rows(folder, results_files)
    if not rows:
        raise SystemExit(f"no method in {results_files} uses {folder}")
    card = head_card(kind, method, target, report, report.get("command", ""), rows)
    (folder / "README.md").write_text(card)
    print(f"{folder}/README.md: {len(rows)} measured row(s)")


if __name__ == "__main__":
    main()
