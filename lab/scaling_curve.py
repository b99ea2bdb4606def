"""How much does a head gain from more data, and from which sources? One head per arm of a feature store, every
head evaluated on the same held-out target answers.

    python lab/scaling_curve.py --target qwen2.5-coder-0.5b-instruct --features STORE --out DIR \\
        --method eagle --epochs 1 --align-steps 1 --threads 2 \\
        --arm answers:answers:ALL --arm fixed:python-docs,python-stdlib,pypi-*:120k \\
        --arm mix-0.4M:ALL:400k --arm mix-1M:ALL:1M --arm mix-4M:ALL:4M -- --batch-tokens 4096

An arm is `NAME:SOURCES:TOKENS`: NAME names its folder (letters, digits, `.`, `_`, `-`), SOURCES are the store's
sources (comma-separated names or shell patterns such as `pypi-*`; `ALL`: every one) and TOKENS how many of their
tokens to train on (`ALL`, or a count such as `120000`, `400k`, `1M`), the held-out set excluded. Arguments after
`--` go to every `hf-spec train METHOD` command unchanged.

Each arm runs `hf-spec train METHOD --features STORE --sources SOURCES --limit-tokens N` in a subprocess (log:
DIR/arms/NAME/train.log) with its own `--out` (DIR/arms/NAME/head) and `--checkpoint-dir` (DIR/arms/NAME/run):
re-running the same command after a kill resumes the interrupted arm from its checkpoint and skips the finished
ones. An arm's token count is fixed when it first starts (DIR/arms/NAME/arm.json), so a store that grows meanwhile
does not change what it trains on. An arm asking for more tokens than the store holds is refused before anything
trains, unless `--allow-short` (then it trains on what there is, and the table says so). Every arm gets the same
`--heldout` and `--heldout-sources`, so all heads are evaluated on the same sequences (checked, and stated in the
table). Writes DIR/results.json and DIR/results.md after each arm.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # hf_spec from this checkout

NAME = re.compile(r"[A-Za-z0-9._-]+")
SUFFIXES = {"k": 1_000, "m": 1_000_000, "g": 1_000_000_000}
DEPTHS = 4


def parse_tokens(text: str) -> int | None:
    """`ALL` -> None; `120000`, `400k`, `0.4M` -> a positive count."""
    if text.upper() == "ALL":
        return None
    scale = SUFFIXES.get(text[-1:].lower(), 1)
    try:
        value = float(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        value = 0
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(
            f"tokens must be ALL or a positive count such as 120000, 400k or 1M, got {text!r}"
        )
    return int(value)


def parse_arm(text: str) -> dict:
    """`NAME:SOURCES:TOKENS` -> `{"name", "sources", "tokens"}` (tokens None: all of them)."""
    parts = text.split(":")
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(
            f"--arm wants NAME:SOURCES:TOKENS (e.g. fixed:python-docs,pypi-*:120k), got {text!r}"
        )
    name, sources, tokens = (p.strip() for p in parts)
    if not NAME.fullmatch(name):
        raise argparse.ArgumentTypeError(
            f"--arm {text!r}: the name may hold only letters, digits, '.', '_' and '-'"
        )
    if not sources:
        raise argparse.ArgumentTypeError(f"--arm {text!r}: no sources (ALL trains on every source)")
    return {"name": name, "sources": sources, "tokens": parse_tokens(tokens)}


def parse_args(argv: list[str]) -> argparse.Namespace:
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="target model: known name or local folder")
    p.add_argument("--features", required=True, help="feature store (hf-spec data features --corpus)")
    p.add_argument("--out", required=True, help="folder of the arms, results.json and results.md")
    p.add_argument(
        "--arm", action="append", required=True, type=parse_arm, help="NAME:SOURCES:TOKENS; repeat"
    )
    p.add_argument("--method", choices=("eagle", "lyanna", "eagle3"), default="eagle")
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument(
        "--align-steps", type=int, help="--align-steps (lyanna: --chain-steps); default: the method's"
    )
    p.add_argument("--topk", type=int, help="HASS top-K distillation K (eagle, eagle3)")
    p.add_argument("--heldout", type=int, default=16, help="held-out prompts, the same for every arm")
    p.add_argument("--heldout-sources", default="auto", help="as `hf-spec train --heldout-sources`")
    p.add_argument("--threads", type=int, help="torch CPU threads of each training run")
    p.add_argument(
        "--allow-short", action="store_true", help="train an arm larger than the store on all it has"
    )
    args = p.parse_args(argv)
    args.train_args = extra
    names = [arm["name"] for arm in args.arm]
    if len(set(names)) != len(names):
        p.error(f"arm names must differ, got {names}")
    if args.method == "lyanna" and args.topk is not None:
        p.error("--topk: Lyanna heads have no top-K distillation")
    return args


def plan_arms(args: argparse.Namespace) -> list[dict]:
    """Every arm with its `limit` (tokens to train on): the one fixed when it first started (arm.json), else
    resolved against the store now; refuses a store too small for an arm unless --allow-short."""
    from hf_spec.training.features import FeatureStore
    from hf_spec.training.store_data import split_store

    store = FeatureStore.open(args.features)
    if not store.shards:
        raise SystemExit(f"{args.features} holds no features: capture them with `hf-spec data features`")
    planned, refused = [], []
    for arm in args.arm:
        folder = Path(args.out) / "arms" / arm["name"]
        saved = json.loads((folder / "arm.json").read_text()) if (folder / "arm.json").exists() else None
        if saved is not None:
            if (saved["sources"], saved["tokens"]) != (arm["sources"], arm["tokens"]):
                refused.append(
                    f"arm {arm['name']}: {folder} holds the arm {saved['sources']}:{saved['tokens'] or 'ALL'}; "
                    "give this one another name, or delete that folder"
                )
            planned.append(saved | {"folder": folder})
            continue
        try:
            available = split_store(store, arm["sources"], None, args.heldout_sources, args.heldout)
        except ValueError as err:
            refused.append(f"arm {arm['name']}: {err}")
            continue
        have = available.available_tokens
        short = arm["tokens"] is not None and arm["tokens"] > have
        if short and not args.allow_short:
            refused.append(
                f"arm {arm['name']}: asks for {arm['tokens']:,} tokens of {arm['sources']}, the store holds "
                f"{have:,} outside the held-out set (--allow-short trains on those)"
            )
        limit = have if arm["tokens"] is None or short else arm["tokens"]
        planned.append(arm | {"requested": arm["tokens"], "limit": limit, "short": short, "folder": folder})
    if refused:
        raise SystemExit("refused before training:\n  " + "\n  ".join(refused))
    return planned


def train_command(args: argparse.Namespace, arm: dict) -> list[str]:
    folder = arm["folder"]
    cmd = ["train", args.method, "--target", args.target, "--features", str(args.features)]
    cmd += ["--sources", arm["sources"], "--limit-tokens", str(arm["limit"]), "--epochs", str(args.epochs)]
    cmd += ["--heldout", str(args.heldout), "--heldout-sources", args.heldout_sources]
    cmd += ["--out", str(folder / "head"), "--checkpoint-dir", str(folder / "run")]
    if args.align_steps is not None:
        cmd += ["--chain-steps" if args.method == "lyanna" else "--align-steps", str(args.align_steps)]
    if args.topk is not None:
        cmd += ["--topk", str(args.topk)]
    if args.threads is not None:
        cmd += ["--threads", str(args.threads)]
    return cmd + list(args.train_args)


def _die_with_parent() -> None:
    """In the child: SIGKILL when the script dies, so a killed script leaves no training behind (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_arm(args: argparse.Namespace, arm: dict) -> tuple[str, str]:
    """Train one arm (or resume it); `(status, message)`, status `done`, `skipped` or `failed`."""
    folder, cmd = arm["folder"], train_command(args, arm)
    state = {k: v for k, v in arm.items() if k != "folder"} | {"command": cmd}
    saved_path = folder / "arm.json"
    if saved_path.exists():
        saved = json.loads(saved_path.read_text())
        if saved.get("command") != cmd:
            return "failed", (
                f"{folder} was started with another command ({shlex.join(saved.get('command', []))}); use "
                "another --out, or delete that folder to restart the arm"
            )
    if (folder / "head" / "training_report.json").exists():
        return "skipped", "finished earlier"
    folder.mkdir(parents=True, exist_ok=True)
    saved_path.write_text(json.dumps(state, indent=1) + "\n")
    env = os.environ | {"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    with open(folder / "train.log", "a") as log:
        log.write(f"\n$ hf-spec {shlex.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(
            [sys.executable, "-m", "hf_spec.cli.main", *cmd],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        try:
            code = proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
    if code != 0:
        tail = (folder / "train.log").read_text().strip().splitlines()[-1:] or [""]
        return "failed", f"exit {code}: {tail[0]} (see {folder / 'train.log'})"
    return "done", "trained"


def arm_row(arm: dict, status: str, message: str) -> dict:
    """An arm's results, read from its training report."""
    row = {
        "arm": arm["name"],
        "sources": arm["sources"],
        "requested_tokens": arm["requested"],
        "limit_tokens": arm["limit"],
        "short": arm["short"],
        "status": "done" if status == "skipped" else status,  # an arm finished by an earlier run is done
        "message": message,
    }
    path = arm["folder"] / "head" / "training_report.json"
    if not path.exists():
        return row
    report = json.loads(path.read_text())
    return row | {
        "trained_tokens": report.get("train_tokens"),
        "train_sequences": report.get("train_conversations"),
        "steps": report.get("steps"),
        "wall_seconds": report.get("wall_seconds"),
        "tokens_per_second": report.get("tokens_per_second"),
        "heldout_sequences": report.get("heldout_conversations"),
        "heldout_accuracy_by_depth": report.get("heldout", {}).get("accuracy_by_depth", [])[:DEPTHS],
        "heldout_ids": report.get("heldout_ids"),
        "report": str(path),
    }


def current_commit() -> str:
    def git(*words: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *words], cwd=REPO, capture_output=True, text=True)

    head = git("rev-parse", "--short", "HEAD").stdout.strip() or "unknown"
    return head + (" + uncommitted changes" if git("diff", "--quiet", "HEAD").returncode == 1 else "")


def write_results(args: argparse.Namespace, argv: list[str], rows: list[dict]) -> None:
    from hf_spec.bench.machine import machine_info

    machine = machine_info() | {"torch_threads": args.threads}
    held = {json.dumps(r.get("heldout_ids")) for r in rows if r.get("heldout_ids") is not None}
    results = {
        "command": "python lab/scaling_curve.py " + shlex.join(argv),
        "machine": machine,
        "date": machine["date"],
        "commit": current_commit(),
        "method": args.method,
        "same_heldout_set": len(held) <= 1,
        "arms": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "results.md").write_text(results_markdown(results))


def results_markdown(results: dict) -> str:
    m = results["machine"]
    lines = [
        f"# Data-scaling curve: `{results['method']}` heads",
        "",
        f"- Command: `{results['command']}`",
        f"- Machine: {m['cpu']}, {m['cores']} cores, torch threads per run: {m['torch_threads'] or 'default'}; "
        f"torch {m['torch']}, transformers {m['transformers']}",
        f"- Date: {results['date']}; commit {results['commit']}",
        "- Held-out set: "
        + ("the same sequences for every arm" if results["same_heldout_set"] else "DIFFERS between arms"),
        "",
        "| arm | sources | tokens | steps | wall s | tokens/s | "
        + " | ".join(f"depth {d}" for d in range(1, DEPTHS + 1))
        + " | status |",
        "|---|---|---:|---:|---:|---:|" + "---:|" * DEPTHS + "---|",
    ]
    notes = [
        "",
        "Tokens: of the arm's training sequences, prompt and text (the loss reads the trained messages' positions); "
        "tokens/s: tokens of every step over the training wall time. Depth d: held-out top-1 agreement with the "
        "target d tokens ahead, the head reading its own states from depth 2 on.",
    ]
    for r in results["arms"]:
        acc = list(r.get("heldout_accuracy_by_depth") or [])
        acc += [None] * (DEPTHS - len(acc))
        status = r["status"] + (
            f" (short: {r['requested_tokens']:,} asked, {r['limit_tokens']:,} in the store)"
            if r["short"]
            else ""
        )
        cells = [
            r["arm"],
            f"`{r['sources']}`",
            r.get("trained_tokens"),
            r.get("steps"),
            r.get("wall_seconds"),
        ]
        cells += [r.get("tokens_per_second"), *acc, status]
        lines.append("| " + " | ".join("-" if c is None else str(c) for c in cells) + " |")
    return "\n".join(lines + notes) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    arms = plan_arms(args)
    rows, failed = [], 0
    for arm in arms:
        print(f"arm {arm['name']}: {arm['sources']}, {arm['limit']:,} tokens ...", flush=True)
        started = time.perf_counter()
        status, message = run_arm(args, arm)
        failed += status == "failed"
        row = arm_row(arm, status, message)
        rows.append(row)
        acc = row.get("heldout_accuracy_by_depth")
        print(
            f"arm {arm['name']}: {status} ({message}) in {time.perf_counter() - started:.0f} s; "
            f"{row.get('tokens_per_second')} tokens/s, held-out agreement by depth {acc}",
            flush=True,
        )
        write_results(args, argv, rows + [arm_row(a, "pending", "") for a in arms[len(rows) :]])
    print(f"results: {Path(args.out) / 'results.md'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
