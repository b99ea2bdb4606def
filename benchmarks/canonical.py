"""The canonical benchmark: every method's recommended config for a target, side by side in one `hf-spec bench` run,
and every figure of the docs, the README and the model cards regenerated from the results.

    python benchmarks/canonical.py run --target qwen2.5-coder-0.5b-instruct     # bench, then report
    python benchmarks/canonical.py run --target smollm2-135m-instruct
    python benchmarks/canonical.py report            # regenerate tables, plots and cards from the kept results
    python benchmarks/canonical.py report --check    # fail if a generated block is out of date (no plots drawn)

`run` writes `benchmarks/results/<machine class>/<target>/` (results.json, results.md and the plots); the machine
class names the CPU (or GPU), its core count and the dtype, so runs on different machines never mix. `report` reads
every `benchmarks/results/<class>/<run>/results.json` that `run` wrote (not other benches kept beside them) and
rewrites the blocks between `<!-- canonical:KEY -->` and `<!-- /canonical -->` in docs/benchmarks.md (all
classes), docs/methods/*.md and README.md (the primary class), and the model cards under model_cards/ (their
results table, from the primary class). Every table carries the command, machine and date of the run it comes
from. Run from anywhere; paths are the repository's.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the checkout's hf_spec and scripts/, also when not installed in editable mode

from hf_spec.bench.machine import machine_class  # noqa: E402
from hf_spec.bench.plots import run_target, short_label, write_plots  # noqa: E402
from hf_spec.bench.prompts import spec_bench_group  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
ASSETS = REPO / "docs" / "assets" / "benchmarks"
# the prompt set of every figure; its source and licence: benchmarks/prompts/README.md
PROMPTS = REPO / "benchmarks" / "prompts" / "spec_bench_dev.jsonl"
# the path the kept runs read the same prompt file from before it was shipped (byte for byte: prompts/README.md)
OLD_PROMPTS = "../shared/data/eval/spec_bench_dev.jsonl"
C = "benchmarks/configs"
Q, S = "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"

# the recommended config of each method, per target (the method pages link these files)
CANONICAL: dict[str, list[str]] = {
    Q: [
        "ar",
        "ar-kernels",
        "hf-pld",
        "pld",
        f"retrieval:{C}/retrieval-{Q}.json",
        f"eagle:{C}/hass-{Q}-int4-d4k2t5.json",
        f"eagle3:{C}/eagle3-{Q}-int4-d4k2t5.json",
        f"lyanna:{C}/lyanna-{Q}-int4-b3.json",
        f"early-exit:{C}/early-exit-{Q}.json",
        f"hispec:{C}/hispec-{Q}.json",
        f"postuse:{C}/postuse-{Q}.json",
        f"talon:{C}/talon-{Q}-eagle3.json",
        "oracle:8",
    ],
    S: [
        "ar",
        "ar-kernels",
        "hf-pld",
        "pld",
        f"eagle:{C}/hass-{S}-int4-chain2.json",
        f"eagle3:{C}/eagle3-{S}-int4-chain2.json",
        f"lyanna:{C}/lyanna-{S}-int4-chain2.json",
        "oracle:8",
    ],
    "stories260K": [
        "ar",
        "hf-pld",
        "pld",
        "early-exit:3",
        "oracle:4",
    ],  # the tiny test model: smoke runs only
}

# one line per method for the README's table, in its order
METHODS = {
    "pld": "prompt lookup: n-gram continuations of the prompt and output, merged into one tree",
    "retrieval": "suffix matches in a datastore and the context, as a pruned trie",
    "eagle": "EAGLE-2 dynamic trees from an EAGLE or HASS draft head",
    "eagle3": "EAGLE-2 dynamic trees from an EAGLE-3 head reading three inner target layers",
    "lyanna": "a hidden-state chain head, token-info trees, re-sampling of rejected branches",
    "postuse": "Post-use token cache + Pre-cut draft-length controller around another drafter",
    "hispec": "early exit checked by a deeper exit before the full model",
    "talon": "a retrieval tree and a model drafter's tree fused into one verification",
    "early-exit": "the target's own first layers (with trained exit heads, packed draft weights)",
    "draft-model": "a small model of the same tokenizer",
    "oracle": "diagnostic: the true continuation (the loop's ceiling)",
}
BASELINES = {
    "hf-pld": "transformers' own prompt lookup (`prompt_lookup_num_tokens=10`), for comparison",
    "ar-kernels": "plain decoding on hf-spec's CPU kernels, no speculation (the kernels' share)",
}
BLOCK = re.compile(r"(<!-- canonical:(?P<key>[^>]*?) -->\n)(?P<body>.*?)(<!-- /canonical -->)", re.S)


# ---------------------------------------------------------------------------------------------------- run


def run(args: argparse.Namespace) -> int:
    from hf_spec.cli.main import main as hf_spec

    key = Path(args.target).name
    if key not in CANONICAL:
        raise SystemExit(f"no canonical methods for {key!r}; known targets: {', '.join(CANONICAL)}")
    missing = missing_datastore_sources(CANONICAL[key])
    if missing:
        raise SystemExit(
            f"the datastores of {key}'s canonical run are built from training files that are not here: "
            f"{', '.join(missing)} (paths relative to benchmarks/configs/; put them there, or point the configs' "
            "`datastore` recipes at your own training files)"
        )
    root = Path(args.out_root)
    tmp = root / f".running-{key}"
    shutil.rmtree(tmp, ignore_errors=True)
    bench = [
        "bench",
        "--target",
        args.target,
        "--methods",
        ",".join(CANONICAL[key]),
        "--prompts",
        str(args.prompts),
    ]
    bench += ["--max-new-tokens", str(args.max_new_tokens), "--check-lossless", "--dtype", args.dtype]
    bench += ["--limit", str(args.limit)] if args.limit else ["--per-category", str(args.per_category)]
    bench += ["--threads", str(args.threads)] if args.threads else []
    print("hf-spec " + " ".join(shlex.quote(a) for a in bench + ["--out", str(tmp)]), flush=True)
    if hf_spec([*bench, "--out", str(tmp)]) != 0:
        return 1
    results = json.loads((tmp / "results.json").read_text())
    results["command"] = repo_relative(results["command"])
    cls = args.machine_class or machine_class(results["machine"])
    results["canonical"] = {
        "command": "python benchmarks/canonical.py " + " ".join(sys.argv[1:]),
        "class": cls,
    }
    (tmp / "results.json").write_text(json.dumps(results, indent=2, default=float) + "\n")
    final = root / cls / key
    shutil.rmtree(final, ignore_errors=True)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(final)
    print(f"wrote {final}")
    return 0 if args.no_report else report(argparse.Namespace(primary=cls, check=False, results_root=root))


def missing_datastore_sources(specs: list[str]) -> list[str]:
    """The training files named by the datastore recipes of `specs`' config files that do not exist (paths as
    the configs give them, relative to their folder)."""

    def recipes(node):
        if isinstance(node, dict):
            if isinstance(node.get("datastore"), dict):
                yield node["datastore"]
            for value in node.values():
                yield from recipes(value)

    missing = []
    for spec in specs:
        _, _, arg = spec.partition(":")
        config = REPO / arg
        if not arg.endswith(".json") or not config.is_file():
            continue
        for recipe in recipes(json.loads(config.read_text())):
            for path in (*recipe.get("corpus", []), *recipe.get("responses", [])):
                if not (config.parent / path).exists() and path not in missing:
                    missing.append(path)
    return missing


def shown_command(command: str) -> str:
    """A kept run's command as a user reruns it from a clone: the prompt file by its shipped path."""
    return command.replace(OLD_PROMPTS, "benchmarks/prompts/spec_bench_dev.jsonl")


def repo_relative(command: str) -> str:
    """`command` with this checkout's absolute paths written relative to its root, as a user would type them."""
    # the checkout's own paths first: they also start with its parent's
    return command.replace(f"{REPO}/", "").replace(f"{REPO.parent}/", "../")


# ---------------------------------------------------------------------------------------------------- report


def load_runs(root: Path) -> dict[str, list[tuple[str, dict]]]:
    """{machine class: [(run name, results)]}, each class's runs in canonical target order, a target's own run
    before other runs of it."""
    order = list(CANONICAL)
    classes: dict[str, list[tuple[str, dict]]] = {}
    for cls_dir in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        runs = []
        for p in sorted(cls_dir.iterdir()):
            if (p / "results.json").is_file():
                results = json.loads((p / "results.json").read_text())
                # only `run`'s results: not another script's (a scaling curve, ...) nor a side bench beside them
                if "summary" not in results or "canonical" not in results:
                    continue
                results["_file"] = str((p / "results.json").resolve())  # for the model cards; never written
                runs.append((p.name, results))
        if runs:

            def rank(run: tuple[str, dict]) -> tuple[int, bool, str]:
                target = run_target(run[1]) or run[0]
                return (order.index(target) if target in order else len(order), run[0] != target, run[0])

            classes[cls_dir.name] = sorted(runs, key=rank)
    return classes


def method_name(spec: str) -> str:
    return spec.partition(":")[0]


def config_cell(spec: str) -> str:
    """The config a method ran with, as a link-free code span (`pld` for a bare spec)."""
    _, _, arg = spec.partition(":")
    return f"`{arg}`" if arg else "defaults"


def machine_line(results: dict) -> str:
    m = results["machine"]
    return (
        f"{m['cpu']}, {m['cores']} cores, {m['torch_threads']} torch threads, {m.get('dtype', 'float32')}, "
        f"{m.get('device', 'cpu')}; torch {m['torch']}, transformers {m['transformers']}"
    )


def run_lines(results: dict) -> list[str]:
    """The command, machine and date of a run, printed beside every table from it."""
    command = shown_command(results.get("canonical", {}).get("command") or results.get("command", ""))
    lines = [f"Command: `{command}`"]
    if results.get("canonical"):
        lines.append(f" (which ran `{shown_command(results.get('command', ''))}`)")
    return ["".join(lines), "", f"Machine: {machine_line(results)}. Date: {results['machine']['date']}."]


def fmt(value: float | None, pattern: str = "{:.2f}") -> str:
    return "-" if value is None or value != value else pattern.format(value)


def run_table(results: dict) -> list[str]:
    target = run_target(results)
    summary = results["summary"]
    groups = sorted({spec_bench_group(r["category"]) for r in results.get("runs", [])})
    head = ["method", "config", "speedup", "tok/s", "tau", "draft util.", *groups, "mismatches (near-tie)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for spec, e in summary.items():
        row = [
            f"`{short_label(spec, target)}`",
            config_cell(spec),
            fmt(e["speedup_vs_ar"], "{:.2f}x"),
            fmt(e["tokens_per_s"], "{:.1f}"),
            fmt(e["tau"]),
            fmt(e.get("draft_utilization")),
        ]
        row += [fmt(e["per_group"].get(g), "{:.2f}x") for g in groups]
        row.append(
            f"{e['lossless_mismatches']} ({e['near_tie_mismatches']})" if "lossless_mismatches" in e else "-"
        )
        lines.append("| " + " | ".join(row) + " |")
    return lines


def benchmarks_block(classes: dict[str, list[tuple[str, dict]]]) -> str:
    out: list[str] = []
    for cls, runs in classes.items():
        out += [f"### {cls}", ""]
        for name, results in runs:
            target = run_target(results) or name
            prompts = max((e["prompts"] for e in results["summary"].values()), default=0)
            title = target if name == target else f"{target} ({name.removeprefix(target).strip('-')})"
            out += [f"#### {title}", "", f"{prompts} prompts, greedy, batch size 1.", ""]
            out += run_table(results) + [""] + run_lines(results) + [""]
            for plot in ("speedup", "acceptance"):
                out += [f"![{plot}: {title}](assets/benchmarks/{cls}/{name}-{plot}.png)", ""]
    return (
        "\n".join(out)
        if out
        else "No canonical run is kept yet: `python benchmarks/canonical.py run --target ...`.\n"
    )


def primary_rows(runs: list[tuple[str, dict]], method: str) -> list[tuple[dict, str, dict]]:
    """(results, spec, summary entry) of every run of the primary class that ran `method`."""
    return [(r, spec, e) for _, r in runs for spec, e in r["summary"].items() if method_name(spec) == method]


def method_block(runs: list[tuple[str, dict]], method: str) -> str:
    rows = primary_rows(runs, method)
    if not rows:
        return "Not in the current canonical run.\n"
    lines = [
        "| target | config | speedup over `ar` | tok/s | tau | draft util. |",
        "|---|---|---|---|---|---|",
    ]
    seen: list[dict] = []
    for results, spec, e in rows:
        lines.append(
            f"| {run_target(results)} | {config_cell(spec)} | {fmt(e['speedup_vs_ar'], '{:.2f}x')} | "
            f"{fmt(e['tokens_per_s'], '{:.1f}')} | {fmt(e['tau'])} | {fmt(e.get('draft_utilization'))} |"
        )
        if not any(r is results for r in seen):
            seen.append(results)
    for results in seen:
        lines += [""] + run_lines(results)
    return "\n".join(lines + ["", "All methods side by side: [Benchmarks](../benchmarks.md)."]) + "\n"


def _preferred(found: list[tuple[dict, str, dict]], target: str | None) -> tuple[dict, str, dict]:
    """The row of the target's canonical config where a run has it, else the first one found."""
    canonical = set(CANONICAL.get(target or "", []))
    return next((row for row in found if row[1] in canonical), found[0])


def readme_block(runs: list[tuple[str, dict]]) -> str:
    main_target = next((run_target(r) for _, r in runs), None)
    main_runs = [(n, r) for n, r in runs if run_target(r) == main_target]
    lines = ["| method | drafts from | speedup over `generate` |", "|---|---|---|"]
    used: list[dict] = []
    for method, what in list(METHODS.items()) + list(BASELINES.items()):
        found = (
            primary_rows(main_runs, method)
            if method in METHODS
            else [(r, s, e) for _, r in main_runs for s, e in r["summary"].items() if s == method]
        )
        cell = "not measured"
        if found:
            results, spec, e = _preferred(found, main_target)
            cell = f"{e['speedup_vs_ar']:.2f}x (`{short_label(spec, main_target)}`)"
            used += [] if any(u is results for u in used) else [results]
        link = f"[`{method}`](docs/methods/{method}.md)" if method in METHODS else f"`{method}`"
        lines.append(f"| {link} | {what} | {cell} |")
    if used:
        dates = ", ".join(dict.fromkeys(u["machine"]["date"].split(" ")[0] for u in used))
        lines += [
            "",
            f"Speedup = tokens/s over plain `model.generate` (`ar`) in the same run; {main_target}, Spec-Bench "
            f"prompts, greedy, batch size 1. Machine: {machine_line(used[0])}; {dates}. "
            f"Command{'s' if len(used) > 1 else ''}:",
            "",
        ]
        for u in used:
            prompts = max(e["prompts"] for e in u["summary"].values())
            lines.append(
                f"- `{u.get('canonical', {}).get('command') or u.get('command', '')}` ({prompts} prompts)"
            )
    return "\n".join(lines) + "\n"


def replace_blocks(path: Path, blocks: dict[str, str], check: bool) -> bool:
    """Rewrite the blocks of `path`; returns whether the file changed (with `check`, nothing is written)."""
    text = path.read_text()
    keys = {m["key"] for m in BLOCK.finditer(text)}
    missing = set(blocks) - keys
    if missing:
        raise SystemExit(f"{path.relative_to(REPO)} lacks the generated block(s) {sorted(missing)}")
    new = BLOCK.sub(lambda m: m[1] + blocks.get(m["key"], m["body"]) + m[4], text)
    if new != text and not check:
        path.write_text(new)
    return new != text


def report(args: argparse.Namespace) -> int:
    root = Path(args.results_root)
    classes = load_runs(root)
    primary = args.primary or max(
        classes, key=lambda c: max(r["machine"]["date"] for _, r in classes[c]), default=None
    )
    if primary is not None and primary not in classes:
        raise SystemExit(
            f"no results for machine class {primary!r} under {root}; found: {', '.join(classes)}"
        )
    runs = classes.get(primary, [])
    changed = []
    if not args.check:
        for cls, cls_runs in classes.items():  # plots from the results, into the run folder and the docs
            (ASSETS / cls).mkdir(parents=True, exist_ok=True)
            for name, results in cls_runs:
                for png in write_plots(results, root / cls / name):
                    shutil.copyfile(png, ASSETS / cls / f"{name}-{png.name}")
    peer_runs = load_peer_runs(root / "peers")
    if not args.check:  # the peers' plots beside hf-spec's
        for cls, name, _ in peer_runs:
            if (root / "peers" / cls / name / "speedup.png").is_file():
                (ASSETS / "peers" / cls).mkdir(parents=True, exist_ok=True)
                shutil.copyfile(
                    root / "peers" / cls / name / "speedup.png", ASSETS / "peers" / cls / f"{name}.png"
                )
    docs = {
        REPO / "docs" / "benchmarks.md": {"tables": benchmarks_block(classes)},
        REPO / "README.md": {"readme": readme_block(runs)},
        REPO / "docs" / "engines.md": {
            "peers": peers_block(peer_runs),
            "peers-check": peers_check_block(peer_runs),
        },
    }
    for method in METHODS:
        page = REPO / "docs" / "methods" / f"{method}.md"
        if "<!-- canonical:method" in page.read_text():
            docs[page] = {f"method {method}": method_block(runs, method)}
    for path, blocks in docs.items():
        if replace_blocks(path, blocks, args.check):
            changed.append(path)
    changed += update_cards(runs, args.check)
    for path in changed:
        print(f"{'out of date' if args.check else 'rewrote'}: {path.relative_to(REPO)}")
    return 1 if args.check and changed else 0


def load_peer_runs(root: Path) -> list[tuple[str, str, dict]]:
    """(machine class, run, results) of every `benchmarks/peers.py` run kept under `root`
    (`benchmarks/results/peers/<class>/<target>/results.json`)."""
    found = []
    for path in sorted(root.glob("*/*/results.json")) if root.is_dir() else []:
        results = json.loads(path.read_text())
        if "engines" in results and "summary" in results:
            found.append((path.parent.parent.name, path.parent.name, results))
    return found


def peers_block(peer_runs: list[tuple[str, str, dict]]) -> str:
    """docs/engines.md: each kept peers run's table (hf-spec's methods beside the other engines) and plot."""
    from peers import markdown

    out: list[str] = []
    for cls, name, results in peer_runs:
        prompts = max((e["prompts"] for e in results["summary"].values()), default=0)
        out += [f"#### {name} ({cls})", "", f"{prompts} prompts, greedy, batch size 1.", ""]
        out += [
            markdown(results).rstrip("\n"),
            "",
            f"![tokens/s: {name}](assets/benchmarks/peers/{cls}/{name}.png)",
            "",
        ]
    return "\n".join(out) if out else "No run of `benchmarks/peers.py` is kept yet.\n"


def peers_check_block(peer_runs: list[tuple[str, str, dict]]) -> str:
    """docs/engines.md: what each kept peers run verified of the exported EAGLE-3 head in vLLM."""
    from peers import check_line

    lines = [f"- {name} ({cls}): {check_line(r['eagle3_check'])}" for cls, name, r in peer_runs
             if r.get("eagle3_check", {}).get("ran")]  # fmt: skip
    return (
        "\n".join(lines) + "\n"
        if lines
        else "No run of `benchmarks/peers.py` with `--check-eagle3` is kept yet.\n"
    )


def update_cards(runs: list[tuple[str, dict]], check: bool) -> list[Path]:
    """Regenerate every committed head and exit-heads card with the primary class's results for its target."""
    sys.path.insert(0, str(REPO / "scripts"))
    from update_head_card import update_card, write_card

    changed = []
    with _cwd(REPO):  # configs name heads relative to the repository
        for folder in sorted(p for p in (REPO / "model_cards").iterdir() if (p / "config.json").is_file()):
            target = folder.name.split("-", 1)[1]
            files = _results_files(runs, target)
            card = folder / "README.md"
            before = card.read_text() if card.is_file() else ""
            update_card(folder, files)
            if card.read_text() != before:
                changed.append(card)
                if check:
                    write_card(folder, before)
    return changed


def _results_files(runs: list[tuple[str, dict]], target: str) -> list[str]:
    return [r["_file"] for _, r in runs if run_target(r) == target]


class _cwd:
    def __init__(self, path: Path) -> None:
        self.path, self.old = path, Path.cwd()

    def __enter__(self) -> None:
        import os

        os.chdir(self.path)

    def __exit__(self, *exc) -> None:
        import os

        os.chdir(self.old)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="bench the canonical configs of a target, then report")
    r.add_argument("--target", required=True, help=f"one of: {', '.join(CANONICAL)} (a name or a folder)")
    r.add_argument("--prompts", default=str(PROMPTS), help="Spec-Bench style .jsonl (default: the dev split)")
    r.add_argument("--per-category", type=int, default=1, help="first K prompts of each category (default 1)")
    r.add_argument("--limit", type=int, default=None, help="first N prompts instead (smoke runs)")
    r.add_argument("--max-new-tokens", type=int, default=128)
    r.add_argument("--dtype", default="auto", help="the target's dtype (default auto)")
    r.add_argument("--threads", type=int, default=None)
    r.add_argument("--machine-class", default=None, help="results folder name (default: from the machine)")
    r.add_argument("--out-root", default=str(RESULTS), help="where machine classes live")
    r.add_argument("--no-report", action="store_true", help="bench only")
    r.set_defaults(func=run)
    s = sub.add_parser("report", help="regenerate tables, plots and model cards from the kept results")
    s.add_argument(
        "--primary",
        default=None,
        help="machine class of the README, method pages and model cards "
        "(default: the class with the newest run)",
    )
    s.add_argument(
        "--check", action="store_true", help="change nothing; exit 1 if a generated block is stale"
    )
    s.add_argument("--results-root", default=str(RESULTS))
    s.set_defaults(func=report)
    return p


if __name__ == "__main__":
    parsed = build_parser().parse_args()
    sys.exit(parsed.func(parsed))
