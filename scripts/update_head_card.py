"""Rewrite the model card (README.md) of a head folder or an exit-heads folder, with a results table from
`hf-spec bench` results.

Usage: python scripts/update_head_card.py <folder> [<results.json> ...]   (run from the repository root)

A method of a results file measures the folder when its spec names it: directly (`eagle:<folder>`), or through a
config whose `head` or `exit_heads` is the folder (also inside a wrapped `drafter`). Without results files the card
is rewritten with no results table. `benchmarks/canonical.py report` calls `update_card` for every committed
folder with the canonical run's results.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hf_spec.bench.plots import run_target, short_label
from hf_spec.heads.card import exit_heads_card, head_card


def _resolve(path: str, base: Path) -> Path:
    """A path written in a config read from `base` (its folder), as hf-spec reads it: next to the config first."""
    return (base / path).resolve() if (base / path).exists() else Path(path).resolve()


def _same(path: str | None, folder: Path, base: Path) -> bool:
    return bool(path) and _resolve(path, base) == folder.resolve()


def _config_names(data: dict, folder: Path, base: Path) -> bool:
    """Whether a method config (a dict read from folder `base`) uses `folder` as its head or exit heads, or wraps a
    drafter that does."""
    if _same(data.get("head"), folder, base) or _same(data.get("exit_heads"), folder, base):
        return True
    inner = data.get("drafter")
    if isinstance(inner, dict):
        return _config_names(inner, folder, base)
    if isinstance(inner, str):
        return names_folder(inner, folder, base)
    return False


def names_folder(method: str, folder: Path, base: Path = Path(".")) -> bool:
    """Whether a bench method spec measures `folder` (see the module docstring); relative paths in the spec are read
    from `base` (the folder of the config that holds it; the current directory for a bench command)."""
    _, _, arg = method.partition(":")
    if not arg:
        return False
    path = _resolve(arg, base) if not arg.count(":") else Path(arg)
    if path.is_file() and path.suffix == ".json":
        return _config_names(json.loads(path.read_text()), folder, path.parent)
    if ":" in arg:  # a wrapped spec: postuse:eagle:<folder>
        return names_folder(arg, folder, base)
    return path == folder.resolve()


def measured_rows(folder: Path, results_files: list[str]) -> list[dict]:
    rows = []
    for name in results_files:
        results = json.loads(Path(name).read_text())
        machine = results["machine"]
        target = run_target(results)
        for method, entry in results["summary"].items():
            if names_folder(method, folder):
                rows.append(
                    {
                        "method": method,
                        "label": short_label(method, target),
                        "prompts": entry["prompts"],
                        "tau": entry["tau"],
                        "speedup": entry["speedup_vs_ar"],
                        "tokens_per_s": entry.get("tokens_per_s"),
                        "machine": f"{machine['cpu']}, {machine['torch_threads']} threads, "
                        f"{machine.get('dtype', 'float32')}",
                        "date": machine["date"].split(" ")[0],
                        # the command that reruns the whole measurement (the canonical run's), else the bench's
                        "command": results.get("canonical", {}).get("command") or results.get("command", ""),
                    }
                )
    return rows


def _exit_heads_command(folder: Path, config: dict) -> str:
    """The training command: recorded in the config by newer runs, else the one the old card's `## Command` shows."""
    command = config.get("training", {}).get("command")
    if command:
        return command
    card = (folder / "README.md").read_text() if (folder / "README.md").is_file() else ""
    block = card.split("## Command", 1)[-1].split("```")
    return block[1].strip().removeprefix("bash").strip() if len(block) > 2 else ""


def update_card(folder: str | Path, results_files: list[str], allow_collapsed: bool = False) -> int:
    """Rewrite `folder`'s README.md; returns the number of measured rows (a head's: those of its own method). A
    collapsed head (`hf_spec.heads.collapse.collapse_reason`) is refused, unless `allow_collapsed` (then its card says
    it is not for publishing, as the trainer's did)."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    rows = measured_rows(folder, results_files)
    if (folder / "training_report.json").is_file():  # a draft head
        report = json.loads((folder / "training_report.json").read_text())
        method = json.loads((folder / "hf_spec_config.json").read_text())["method"]
        hass = "HASS" if report.get("config", {}).get("topk") else "EAGLE"
        kind = {"lyanna": "Lyanna", "eagle3": "EAGLE-3"}.get(method, hass)
        # an EAGLE-3 folder keeps its target in the hf_spec.json sidecar (config.json is the SGLang layout's)
        holder = json.loads((folder / "hf_spec.json").read_text()) if method == "eagle3" else config
        target = Path(holder["target"]["name_or_path"]).name
        # the head's own method only, not hybrids that use it
        rows = [r for r in rows if r["method"].partition(":")[0] == method]
        card = head_card(kind, method, target, report, report.get("command", ""), rows, allow_collapsed)
    else:  # exit heads
        card = exit_heads_card(config, _exit_heads_command(folder, config), rows)
    write_card(folder, card)
    return len(rows)


def write_card(folder: Path, card: str) -> None:
    """Write `folder`'s README.md; a folder with a checksum list gets its list renewed, after checking that its
    other files are still the ones listed (so a damaged file is never blessed by a card update)."""
    import json

    from hf_spec.io.integrity import CHECKSUM_FILE, IntegrityError, file_sha256, write_checksums

    readme = folder / "README.md"
    if readme.is_file() and readme.read_text() == card:
        return
    listed = folder / CHECKSUM_FILE
    if listed.is_file():  # every listed file but the card being replaced must still be the one listed
        for name, digest in json.loads(listed.read_text()).get("files", {}).items():
            if name != "README.md" and file_sha256(folder / name) != digest:
                raise IntegrityError(
                    f"{folder / name} does not match {listed}: not renewing the list of a damaged head"
                )
    readme.write_text(card)
    if listed.is_file():
        write_checksums(folder)


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    folder, results_files = Path(sys.argv[1]), sys.argv[2:]
    count = update_card(folder, results_files)
    print(f"{folder}/README.md: {count} measured row(s)")


if __name__ == "__main__":
    main()
