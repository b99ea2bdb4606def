"""Compare two commits of hf-spec in ONE interleaved benchmark run.

Each commit is checked out as a git worktree and served by its own worker process (same Python, torch and
transformers; only `hf_spec` differs, imported through PYTHONPATH). Both workers load the target once. For every
prompt and method the driver asks one worker, then the other, for the same generation (the order alternates from
one pair to the next), so both columns see the same machine state and drift between runs cancels in the ratio.
Only one worker computes at a time.

    python benchmarks/ab_commits.py --base 5e12e8a --new HEAD --out OUT_DIR \
        --target qwen2.5-coder-0.5b-instruct --dtype bfloat16 --threads 2 --max-new-tokens 128 \
        --prompts benchmarks/prompts/spec_bench_dev.jsonl --per-category 1 \
        --methods ar,pld,retrieval:benchmarks/configs/retrieval-qwen2.5-coder-0.5b-instruct.json

Relative paths in `--methods` resolve in each worker's checkout, as they would for a user there. Writes
OUT_DIR/ab.json (every run) and OUT_DIR/ab.md (per method: tokens/s of each commit, the geometric mean of the
per-prompt ratio new/base with a 95% bootstrap interval, and each commit's speedup over its own `ar`). `ar` runs on
both sides: its ratio is the measurement's own noise. Greedy outputs are compared: each method against its side's
`ar` (a departure is explained when it
is a numeric near-tie in the target's dtype, as `hf-spec bench --check-lossless` counts it), and the two commits
against each other.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------------------------- worker side
def worker_main() -> None:
    """Serve generation requests on stdin (one JSON object per line), answer on stdout."""
    import torch

    import hf_spec
    from hf_spec.bench.runner import ForwardCounter, Method, compare_greedy, encode_chat
    from hf_spec.cli.common import load_target, set_threads

    global PROTOCOL
    PROTOCOL = os.fdopen(os.dup(1), "w")  # replies only; anything else printed goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    init = json.loads(sys.stdin.readline())
    set_threads(init["threads"])
    args = argparse.Namespace(target=init["target"], dtype=init["dtype"], device="cpu")
    model, tokenizer = load_target(args)
    methods = {n: Method(n, model, tokenizer, init["max_new_tokens"]) for n in init["methods"]}
    counter = ForwardCounter(model)
    reply({"hf_spec": str(Path(hf_spec.__file__).parent), "torch": torch.__version__})
    for line in sys.stdin:
        request = json.loads(line)
        method = methods[request["method"]]
        input_ids = encode_chat(tokenizer, request["messages"])
        saved = method.kwargs["max_new_tokens"]
        method.kwargs["max_new_tokens"] = request.get("max_new_tokens", saved)
        out, row = method.generate(input_ids, None, counter)
        method.kwargs["max_new_tokens"] = saved
        tokens = out[0, input_ids.shape[1] :].tolist()
        answer = {"tokens": tokens, "seconds": row["seconds"], "tau": row["tau"]}
        if request.get("ar_tokens") is not None:  # where it departs from plain generate, and whether at a tie
            answer["lossless"] = compare_greedy(model, input_ids, request["ar_tokens"], tokens)
        reply(answer)


PROTOCOL = sys.stdout


def reply(obj: dict) -> None:
    PROTOCOL.write(json.dumps(obj) + "\n")
    PROTOCOL.flush()


# ----------------------------------------------------------------------------------------------- driver side
class Worker:
    def __init__(self, side: str, checkout: Path, init: dict) -> None:
        env = {**os.environ, "PYTHONPATH": str(checkout), "HF_HUB_OFFLINE": "1"}
        self.side = side
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker"],
            cwd=checkout,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        hello = self.call(init)
        if not hello["hf_spec"].startswith(str(checkout)):
            raise RuntimeError(f"{side} worker imported hf_spec from {hello['hf_spec']}, not from {checkout}")

    def call(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.side} worker stopped (rc {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def checkout_of(rev: str) -> Path:
    """A worktree of `rev` next to this checkout (created once; the working tree itself is never used)."""
    sha = subprocess.check_output(["git", "rev-parse", "--short", rev], cwd=HERE, text=True).strip()
    path = HERE.parent / f"hf-spec-ab-{sha}"
    if not path.exists():
        subprocess.check_call(["git", "worktree", "add", "--detach", str(path), sha], cwd=HERE)
    return path


def load_prompts(path: str, limit: int | None, per_category: int | None) -> list[dict]:
    """Spec-Bench rows: the first `per_category` of each category in file order, then the first `limit`."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if per_category:
        seen: dict[str, int] = {}
        kept = []
        for row in rows:
            seen[row["category"]] = seen.get(row["category"], 0) + 1
            if seen[row["category"]] <= per_category:
                kept.append(row)
        rows = kept
    return rows[:limit] if limit else rows


def geometric_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def bootstrap_interval(values: list[float], draws: int = 4000, seed: int = 0) -> tuple[float, float]:
    rng = random.Random(seed)
    means = sorted(geometric_mean([rng.choice(values) for _ in values]) for _ in range(draws))
    return means[int(0.025 * draws)], means[int(0.975 * draws) - 1]


def summarize(runs: list[dict], methods: list[str]) -> list[dict]:
    rows = []
    ar_tps = {side: _mean([r[side]["tps"] for r in runs if r["method"] == "ar"]) for side in ("base", "new")}
    for m in methods:
        mine = [r for r in runs if r["method"] == m]
        ratios = [r["new"]["tps"] / r["base"]["tps"] for r in mine]
        low, high = bootstrap_interval(ratios)
        row = {"method": m, "prompts": len(mine), "ratio": geometric_mean(ratios), "low": low, "high": high}
        for side in ("base", "new"):
            tps = _mean([r[side]["tps"] for r in mine])
            row[f"{side}_tps"] = tps
            row[f"{side}_x_ar"] = tps / ar_tps[side] if ar_tps[side] else float("nan")
            row[f"{side}_tau"] = _mean([r[side]["tau"] for r in mine])
            row[f"{side}_differs_from_ar"] = sum(r[side]["differs_from_ar"] for r in mine)
            row[f"{side}_unexplained"] = sum(
                not r[side].get("lossless", {}).get("lossless", True)
                and not r[side]["lossless"].get("near_tie", False)
                for r in mine
            )
        row["sides_differ"] = sum(r["base"]["tokens"] != r["new"]["tokens"] for r in mine)
        rows.append(row)
    return rows


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def markdown(summary: list[dict], meta: dict) -> str:
    lines = [
        "| method | base tok/s | new tok/s | new / base (95% CI) | base x ar | new x ar | base tau | new tau "
        "| outputs != ar (base/new) | unexplained (base/new) | base != new |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary:
        lines.append(
            f"| {r['method']} | {r['base_tps']:.2f} | {r['new_tps']:.2f} | {r['ratio']:.3f} "
            f"({r['low']:.3f}-{r['high']:.3f}) | {r['base_x_ar']:.2f} | {r['new_x_ar']:.2f} | "
            f"{r['base_tau']:.2f} | {r['new_tau']:.2f} | {r['base_differs_from_ar']}/{r['new_differs_from_ar']} "
            f"| {r['base_unexplained']}/{r['new_unexplained']} | {r['sides_differ']} |"
        )
    lines.append("")
    lines.append(
        f"base {meta['base']}, new {meta['new']}; {meta['cpu']}; {meta['dtype']}, {meta['threads']} threads, "
        f"{meta['max_new_tokens']} new tokens, {meta['prompts']} prompts x {meta['reps']} repeat(s); "
        f"{meta['started']} - {meta['finished']} UTC"
    )
    lines.append(f"command: {meta['command']}")
    return "\n".join(lines) + "\n"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + f", {os.cpu_count()} cores"
    except OSError:
        pass
    return f"{os.cpu_count()} cores"


def driver_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the older commit")
    p.add_argument("--new", default="HEAD", help="the newer commit (a commit, never the working tree)")
    p.add_argument("--out", required=True, help="a new output folder")
    p.add_argument("--target", required=True)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompts", required=True)
    p.add_argument("--per-category", type=int, default=None)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--methods", required=True, help="comma list as for `hf-spec bench` (ar is added first)")
    p.add_argument("--reps", type=int, default=1, help="times each prompt is run on each side")
    args = p.parse_args(argv)
    out = Path(args.out)
    if out.exists():
        p.error(f"--out {out} exists: pick a new folder")
    methods = [m.strip() for m in args.methods.split(",") if m.strip() and m.strip() != "ar"]
    methods.insert(0, "ar")
    if any(m.split(":")[0] == "oracle" for m in methods):
        p.error("oracle needs a reference output: compare it with `hf-spec bench`, not here")
    prompts = load_prompts(args.prompts, args.limit, args.per_category)
    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    init = {
        "target": args.target,
        "dtype": args.dtype,
        "threads": args.threads,
        "methods": methods,
        "max_new_tokens": args.max_new_tokens,
    }
    revs = {"base": args.base, "new": args.new}
    workers = {side: Worker(side, checkout_of(rev), init) for side, rev in revs.items()}
    try:
        warm = [{"role": "user", "content": prompts[0]["turns"][0]}]
        for m in methods:
            for w in workers.values():
                w.call({"method": m, "messages": warm, "max_new_tokens": 8})
        runs: list[dict] = []
        pair = 0
        for rep in range(args.reps):
            for i, prompt in enumerate(prompts):
                messages = [{"role": "user", "content": prompt["turns"][0]}]
                ar_tokens: dict[str, list[int]] = {}
                for m in methods:
                    order = ("base", "new") if pair % 2 == 0 else ("new", "base")
                    pair += 1
                    run: dict = {"method": m, "question_id": prompt.get("question_id"), "rep": rep}
                    for side in order:
                        request = {"method": m, "messages": messages, "ar_tokens": ar_tokens.get(side)}
                        got = workers[side].call(request)
                        got["tps"] = len(got["tokens"]) / got["seconds"]
                        if m == "ar":
                            ar_tokens[side] = got["tokens"]
                        got["differs_from_ar"] = got["tokens"] != ar_tokens[side]
                        run[side] = got
                    runs.append(run)
                    print(
                        f"[{rep}:{i + 1}/{len(prompts)}] {m}: base {run['base']['tps']:.2f} tok/s, "
                        f"new {run['new']['tps']:.2f} tok/s",
                        file=sys.stderr,
                        flush=True,
                    )
    finally:
        for w in workers.values():
            w.close()
    meta = {
        "base": subprocess.check_output(
            ["git", "rev-parse", "--short", args.base], cwd=HERE, text=True
        ).strip(),
        "new": subprocess.check_output(
            ["git", "rev-parse", "--short", args.new], cwd=HERE, text=True
        ).strip(),
        "cpu": cpu_name(),
        "dtype": args.dtype,
        "threads": args.threads,
        "max_new_tokens": args.max_new_tokens,
        "prompts": len(prompts),
        "reps": args.reps,
        "started": started,
        "finished": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "command": "python benchmarks/ab_commits.py " + " ".join(argv),
    }
    summary = summarize(runs, methods)
    out.mkdir(parents=True)
    (out / "ab.json").write_text(json.dumps({"meta": meta, "summary": summary, "runs": runs}, indent=1))
    text = markdown(summary, meta)
    (out / "ab.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        worker_main()
    else:
        sys.exit(driver_main(sys.argv[1:]))
