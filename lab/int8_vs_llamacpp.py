"""hf-spec on an int8 target against llama.cpp's plain decoding of the GGUF that target comes from.

A `generate` user on a CPU compares hf-spec with llama.cpp. This script decodes the same chat prompts (the same
token ids) greedily, with the same number of new tokens, with:

- transformers' own `generate` on the target quantized to int8 (`--quantizer`): the reference every hf-spec row
  must equal, and the number of new tokens every engine makes for that prompt;
- each hf-spec method of `--methods` on that int8 target; the best one (tokens/s) is named in the summary;
- llama.cpp (llama-cpp-python) on the GGUF the known target was converted from (`hf_spec.models.fetch`), plain
  decoding of exactly as many tokens as the reference made (its end-of-sequence token does not stop it).

The engines are measured side by side in one run, interleaved: every round asks each engine for each prompt in turn,
in an order that rotates from call to call (transformers first in the first round: it gives the reference), so a
load on the machine that comes and goes hits every engine alike. Each engine is warmed up once before the first
round. Tokens/s counts new tokens over the wall time of the whole call (prefill included, as a user sees it);
llama.cpp's rows also give its decode-only rate. The 1-minute load average is recorded before every call, and each
engine's ratio to llama.cpp is taken per (round, prompt) pair, so the spread says how much the load moved it.

    python lab/int8_vs_llamacpp.py --target qwen2.5-coder-0.5b-instruct --threads 2 \\
        --prompts benchmarks/prompts/spec_bench_dev.jsonl --per-category 1 --max-new-tokens 128 --rounds 2 \\
        --methods pld,retrieval:benchmarks/configs/retrieval-qwen2.5-coder-0.5b-instruct.json \\
        --out lab/results/int8-vs-llamacpp

writes `int8_vs_llamacpp.json` (every call) and `int8_vs_llamacpp.md` (the table, the command, the machine) into
`--out` (not `results.json`, which `benchmarks/canonical.py report` would read as a canonical run).
`pip install llama-cpp-python` builds llama.cpp from source (several minutes); without it the llama.cpp rows are
skipped. `--gguf none` skips them too (e.g. for a local target without a GGUF).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

DEFAULT_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Explain what a hash map is and give a short example in Python.",
]
LLAMA = "llama.cpp plain"
# llama.cpp's `general.file_type` values (llama_ftype) this script names
GGUF_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 15: "Q4_K_M",
                   17: "Q5_K_M", 18: "Q6_K", 32: "BF16"}  # fmt: skip


def quantization_config(name: str):
    """The transformers config of `--quantizer`."""
    if name == "bnb-int8":
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(load_in_8bit=True)
    if name == "quanto-int8":
        from transformers import QuantoConfig

        return QuantoConfig(weights="int8")
    if name == "torchao-int8":
        from torchao.quantization import Int8WeightOnlyConfig
        from transformers import TorchAoConfig

        return TorchAoConfig(Int8WeightOnlyConfig())
    raise ValueError(f"--quantizer must be bnb-int8, quanto-int8 or torchao-int8, got {name!r}")


def default_gguf(target: str) -> Path | None:
    """The GGUF a known target was converted from, if fetched (`$HF_SPEC_CACHE/gguf/`)."""
    from hf_spec.models.fetch import KNOWN_MODELS, cache_root

    spec = KNOWN_MODELS.get(target)
    if spec is None:
        return None
    path = cache_root() / "gguf" / spec.gguf_file
    return path if path.exists() else None


class Engine:
    """One way of decoding: `call(ids, new)` -> `(new token ids, seconds, extra fields of the row)`."""

    name: str

    def call(self, ids: torch.Tensor, new: int) -> tuple[list[int], float, dict]:
        raise NotImplementedError


class Transformers(Engine):
    """`model.generate(do_sample=False)`, plain or with `custom_generate=SpeculativeDecoder(spec)`."""

    def __init__(self, model, name: str, decoder=None) -> None:
        self.model, self.name, self.decoder = model, name, decoder

    def call(self, ids: torch.Tensor, new: int) -> tuple[list[int], float, dict]:
        kw = dict(max_new_tokens=new, do_sample=False, attention_mask=torch.ones_like(ids))
        if self.decoder is not None:
            kw["custom_generate"] = self.decoder
        t0 = time.perf_counter()
        out = self.model.generate(ids, **kw)
        seconds = time.perf_counter() - t0
        stats = self.decoder.last_stats if self.decoder is not None else None
        extra = {"tau": round(stats.tau, 3)} if stats is not None else {}
        return out[0, ids.shape[1] :].tolist(), seconds, extra


class LlamaCpp(Engine):
    """llama.cpp's plain greedy decoding of exactly `new` tokens (its end-of-sequence token does not stop it: every
    engine makes as many tokens as the reference), from an empty cache every call."""

    name = LLAMA

    def __init__(self, llm) -> None:
        self.llm = llm

    def call(self, ids: torch.Tensor, new: int) -> tuple[list[int], float, dict]:
        self.llm.reset()  # no prefix of an earlier call is reused
        tokens: list[int] = []
        t0 = time.perf_counter()
        first = None
        gen = self.llm.generate(ids[0].tolist(), temp=0.0, top_k=1, top_p=1.0, repeat_penalty=1.0, reset=True)
        for token in gen:
            first = first if first is not None else time.perf_counter() - t0
            tokens.append(int(token))
            if len(tokens) >= new:
                break
        seconds = time.perf_counter() - t0
        decode = (len(tokens) - 1) / (seconds - first) if first is not None and len(tokens) > 1 else None
        return tokens, seconds, {"first_token_seconds": first, "decode_tokens_per_s": decode}


def order_of(engines: list[Engine], round_: int, call: int) -> list[Engine]:
    """The engines in the order of one (round, prompt) call: rotated by the call's index; in round 0 the reference
    (`engines[0]`) goes first, since the others need its token count."""
    if round_ == 0:
        rest = engines[1:]
        k = call % len(rest) if rest else 0
        return [engines[0], *rest[k:], *rest[:k]]
    k = call % len(engines)
    return engines[k:] + engines[:k]


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_spec import SpeculativeDecoder
    from hf_spec.bench.lossless import compare_greedy, first_divergence
    from hf_spec.bench.machine import machine_info
    from hf_spec.bench.prompts import encode_chat, load_prompts
    from hf_spec.models.fetch import resolve_model

    torch.set_num_threads(args.threads)
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # a cast warning on every int8 forward
    if args.prompts:
        loaded = load_prompts(args.prompts, None, args.per_category)
        if args.categories:
            wanted = args.categories.split(",")
            loaded = [p for c in wanted for p in loaded if p.category == c]
            if not loaded:
                raise ValueError(f"no prompts of categories {args.categories!r} in {args.prompts}")
        loaded = loaded[: args.limit]
        texts, names = [p.turns[0] for p in loaded], [f"{p.category}/{p.question_id}" for p in loaded]
    else:
        texts = DEFAULT_PROMPTS[: args.limit]
        names = [f"built-in/{i}" for i in range(len(texts))]
    path = resolve_model(args.target)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": t}]) for t in texts]
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=quantization_config(args.quantizer)
    )
    model.eval()
    reference = Transformers(model, f"transformers {args.quantizer}")
    engines: list[Engine] = [reference]
    for spec in args.methods.split(","):
        engines.append(Transformers(model, f"hf-spec {spec}", SpeculativeDecoder(spec, tokenizer=tokenizer)))

    gguf = None if args.gguf == "none" else (Path(args.gguf) if args.gguf else default_gguf(args.target))
    gguf_info = None
    if gguf is not None:
        try:
            import llama_cpp
        except ImportError:
            print("llama-cpp-python is not installed: the llama.cpp rows are skipped", file=sys.stderr)
        else:
            llm = llama_cpp.Llama(
                str(gguf),
                n_threads=args.threads,
                n_threads_batch=args.threads,
                n_ctx=4096,
                verbose=False,
                seed=0,
            )
            file_type = llm.metadata.get("general.file_type")
            if file_type is not None:
                file_type = GGUF_FILE_TYPES.get(int(file_type), file_type)
            gguf_info = {
                "path": str(gguf),
                "file_type": file_type,
                "llama_cpp_python": llama_cpp.__version__,
                "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
            }
            engines.append(LlamaCpp(llm))

    # one-time costs (kernels chosen, datastores read, llama.cpp's buffers) off the clock
    for engine in engines:
        engine.call(prompts[0], args.warmup_tokens)
    refs: list[list[int] | None] = [None] * len(prompts)
    rows: list[dict] = []
    departed: dict[tuple[str, int], list[int]] = {}  # (hf-spec engine, prompt) -> its first departing tokens
    calls = 0
    for round_ in range(args.rounds):
        for i, ids in enumerate(prompts):
            for engine in order_of(engines, round_, calls):
                new = args.max_new_tokens if refs[i] is None else len(refs[i])
                load = os.getloadavg()[0]
                tokens, seconds, extra = engine.call(ids, new)
                if engine is reference and refs[i] is None:
                    refs[i] = tokens
                row = {"round": round_, "prompt": i, "engine": engine.name, "new_tokens": len(tokens),
                       "seconds": round(seconds, 4), "tokens_per_s": round(len(tokens) / seconds, 3),
                       "loadavg_1min": round(load, 2)} | extra  # fmt: skip
                if engine is not reference:
                    at = first_divergence(refs[i], tokens)
                    row["equal_to_int8_generate"] = at is None
                    row["departs_at"] = at
                    if at is not None and isinstance(engine, Transformers):
                        departed.setdefault((engine.name, i), tokens)
                rows.append(row)
                print(f"round {round_} prompt {i} {engine.name:<40} {row['tokens_per_s']:>7.2f} tokens/s "
                      f"(load {load:.1f})", flush=True)  # fmt: skip
            calls += 1
    # hf-spec outputs that depart from the int8 reference: where, and the logit gap between the two choices there
    departures = [
        {"engine": name, "prompt": i} | compare_greedy(model, prompts[i], refs[i], tokens)
        for (name, i), tokens in departed.items()
    ]
    return {
        "target": args.target,
        "quantizer": args.quantizer,
        "gguf": gguf_info,
        "threads": args.threads,
        "max_new_tokens": args.max_new_tokens,
        "rounds": args.rounds,
        "prompts": [
            {"name": n, "prompt_tokens": int(p.shape[1])} for n, p in zip(names, prompts, strict=True)
        ],
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "machine": machine_info(),
        "rows": rows,
        "departures": departures,
        "summary": summarize(rows),
    }


def summarize(rows: list[dict]) -> dict:
    """Per engine: tokens/s over all calls (total new tokens / total seconds), the spread of its calls, its
    per-(round, prompt) ratio to llama.cpp, whether it equals the int8 reference; and the best hf-spec method."""
    engines: dict[str, dict] = {}
    for row in rows:
        e = engines.setdefault(row["engine"], {"new_tokens": 0, "seconds": 0.0, "calls": [], "exact": True})
        e["new_tokens"] += row["new_tokens"]
        e["seconds"] += row["seconds"]
        e["calls"].append(row["tokens_per_s"])
        if row["engine"].startswith("hf-spec"):
            e["exact"] &= row["equal_to_int8_generate"]
    llama = {(r["round"], r["prompt"]): r["tokens_per_s"] for r in rows if r["engine"] == LLAMA}
    for name, e in engines.items():
        e["tokens_per_s"] = round(e["new_tokens"] / e["seconds"], 3)
        calls = e.pop("calls")
        e["call_tokens_per_s"] = {"min": min(calls), "median": statistics.median(calls), "max": max(calls)}
        ratios = [
            r["tokens_per_s"] / llama[(r["round"], r["prompt"])]
            for r in rows
            if r["engine"] == name and (r["round"], r["prompt"]) in llama
        ]
        if ratios and name != LLAMA:
            e["vs_llama_cpp"] = {
                "geometric_mean": round(statistics.geometric_mean(ratios), 4),
                "min": round(min(ratios), 4),
                "max": round(max(ratios), 4),
                "pairs": len(ratios),
            }
        if not name.startswith("hf-spec"):
            e.pop("exact")
    spec = {k: v for k, v in engines.items() if k.startswith("hf-spec")}
    best = max(spec, key=lambda k: spec[k]["tokens_per_s"]) if spec else None
    loads = [r["loadavg_1min"] for r in rows]
    return {
        "engines": engines,
        "best_hf_spec": best,
        "loadavg_1min": {"min": min(loads), "mean": round(statistics.fmean(loads), 2), "max": max(loads)},
    }


def markdown(result: dict) -> str:
    """The results table with the command, the machine and the load it ran under."""
    s, m, g = result["summary"], result["machine"], result["gguf"]
    lines = [
        f"# hf-spec on an int8 target ({result['quantizer']}) vs llama.cpp: {result['target']}",
        "",
        "| engine | tokens/s (all calls) | per call: min / median / max | vs llama.cpp per call: geo-mean [min, max]"
        " | equal to int8 `generate` |",
        "|---|---|---|---|---|",
    ]
    for name, e in s["engines"].items():
        c, v = e["call_tokens_per_s"], e.get("vs_llama_cpp")
        vs = f"{v['geometric_mean']:.3f}x [{v['min']:.3f}, {v['max']:.3f}]" if v else "-"
        exact = {True: "yes", False: "no (see departures)"}.get(e.get("exact"), "-")
        best = " (best hf-spec)" if name == s["best_hf_spec"] else ""
        lines.append(
            f"| `{name}`{best} | {e['tokens_per_s']:.2f} | {c['min']:.2f} / {c['median']:.2f} / {c['max']:.2f} "
            f"| {vs} | {exact} |"
        )
    lines += ["", f"Prompts: {len(result['prompts'])} ({', '.join(p['name'] for p in result['prompts'])}), "
              f"{result['rounds']} interleaved round(s), up to {result['max_new_tokens']} new tokens (every engine "
              "makes as many as the int8 reference), greedy."]  # fmt: skip
    if result["departures"]:
        lines += [
            "",
            "Departures from the int8 reference (hf-spec rows; gap: logit gap between the two choices):",
        ]
        for d in result["departures"]:
            lines.append(
                f"- `{d['engine']}` prompt {d['prompt']}: token {d.get('diverged_at')}, gap "
                f"{d.get('choice_gap', 0):.3f} ({'a numeric tie' if d.get('near_tie') else 'NOT a numeric tie'})"
            )
    if g:
        lines += ["", f"llama.cpp: llama-cpp-python {g['llama_cpp_python']} on `{Path(g['path']).name}` "
                  f"(file type {g['file_type']}); {g['system_info']}"]  # fmt: skip
    load = s["loadavg_1min"]
    lines += [
        "",
        f"Command: `{result['command']}`",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {result['threads']} threads for every engine; torch {m['torch']}, "
        f"transformers {m['transformers']}; {m['date']}. 1-minute load average before each call: min "
        f"{load['min']}, mean {load['mean']}, max {load['max']}.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-0.5b-instruct", help="known model name or local folder")
    p.add_argument("--quantizer", default="bnb-int8", help="bnb-int8, quanto-int8 or torchao-int8")
    p.add_argument(
        "--gguf", help="the GGUF for llama.cpp (default: the known target's fetched GGUF; 'none': skip)"
    )
    p.add_argument("--methods", default="pld", help="comma list of hf-spec method specs to time")
    p.add_argument("--prompts", help="Spec-Bench JSONL (default: two built-in prompts)")
    p.add_argument("--per-category", type=int, help="first K prompts of each category")
    p.add_argument("--categories", help="comma list: only these categories' prompts, in this order")
    p.add_argument("--limit", type=int, help="at most N prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds over every prompt and engine")
    p.add_argument(
        "--warmup-tokens", type=int, default=8, help="new tokens of each engine's one warm-up call"
    )
    p.add_argument("--out", help="write int8_vs_llamacpp.json and .md into this folder")
    args = p.parse_args(argv)
    for name in ("rounds", "max_new_tokens", "threads", "warmup_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    result = run(args)
    for engine, e in result["summary"]["engines"].items():
        exact = "" if e.get("exact", True) else "  (departs from int8 generate)"
        print(f"{engine:<40} {e['tokens_per_s']:>8.2f} tokens/s{exact}")
    print(f"best hf-spec method: {result['summary']['best_hf_spec']}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "int8_vs_llamacpp.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / "int8_vs_llamacpp.md").write_text(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
