"""hf-spec on an int8 target against llama.cpp's plain decoding of the GGUF that target comes from.

A `generate` user on a CPU compares hf-spec with llama.cpp. This script decodes the same chat prompts (the same
token ids) greedily with:

- llama.cpp (llama-cpp-python) on the GGUF the known target was converted from (`hf_spec.models.fetch`), plain
  decoding;
- transformers' own `generate` on the target quantized to int8 (`--quantizer`): the reference every hf-spec row
  must equal;
- each hf-spec method of `--methods` on that int8 target; the best one (tokens/s) is named in the summary.

Each (prompt, engine) pair runs `--repeats` times after one warm-up; tokens/s counts new tokens over the wall
time of the whole call (prefill included, as a user sees it). llama.cpp's row also gives its decode-only rate.

    python benchmarks/int8_vs_llamacpp.py --target qwen2.5-coder-0.5b-instruct --threads 2 \\
        --prompts ../shared/data/eval/spec_bench_dev.jsonl --per-category 1 --max-new-tokens 128 \\
        --methods pld,retrieval:benchmarks/configs/retrieval-qwen2.5-coder-0.5b-instruct.json \\
        --out runs/int8-vs-llamacpp.json

`pip install llama-cpp-python` builds llama.cpp from source (several minutes); without it the llama.cpp row is
skipped. `--gguf none` skips it too (e.g. for a local target without a GGUF).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import torch

DEFAULT_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Explain what a hash map is and give a short example in Python.",
]


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


def timed(fn, repeats: int) -> tuple[float, object]:
    """`(median seconds of `repeats` calls after one warm-up, the last result)`."""
    out = fn()
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds), out


def llama_cpp_run(llm, prompt_ids: list[int], new: int) -> tuple[list[int], float | None]:
    """Greedy tokens after `prompt_ids` and the seconds to the first of them (`None`: none generated)."""
    llm.reset()
    tokens: list[int] = []
    t0 = time.perf_counter()
    first = None
    for token in llm.generate(prompt_ids, temp=0.0, top_k=1, top_p=1.0, repeat_penalty=1.0, reset=True):
        first = first if first is not None else time.perf_counter() - t0
        if llm.token_eos() == token:
            break
        tokens.append(int(token))
        if len(tokens) >= new:
            break
    return tokens, first


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_spec import SpeculativeDecoder
    from hf_spec.bench.machine import machine_info
    from hf_spec.bench.prompts import encode_chat, load_prompts
    from hf_spec.models.fetch import resolve_model

    torch.set_num_threads(args.threads)
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # a cast warning on every int8 forward
    texts = (
        [p.turns[0] for p in load_prompts(args.prompts, args.limit, args.per_category)]
        if args.prompts
        else DEFAULT_PROMPTS[: args.limit]
    )
    path = resolve_model(args.target)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": t}]) for t in texts]
    config = quantization_config(args.quantizer)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=config).eval()
    rows: list[dict] = []

    gguf = None if args.gguf == "none" else (Path(args.gguf) if args.gguf else default_gguf(args.target))
    llm = None
    if gguf is not None:
        try:
            from llama_cpp import Llama
        except ImportError:
            print("llama-cpp-python is not installed: the llama.cpp row is skipped", file=sys.stderr)
        else:
            llm = Llama(str(gguf), n_threads=args.threads, n_ctx=4096, verbose=False, seed=0)
    for i, ids in enumerate(prompts):
        kw = dict(max_new_tokens=args.max_new_tokens, do_sample=False, attention_mask=torch.ones_like(ids))
        seconds, ref = timed(lambda ids=ids, kw=kw: model.generate(ids, **kw), args.repeats)
        new = ref.shape[1] - ids.shape[1]
        rows.append({"prompt": i, "engine": f"transformers {args.quantizer}", "new_tokens": new,
                     "seconds": seconds, "tokens_per_s": new / seconds})  # fmt: skip
        for spec in args.methods.split(","):
            decoder = SpeculativeDecoder(spec, tokenizer=tokenizer)
            seconds, out = timed(
                lambda ids=ids, kw=kw, d=decoder: model.generate(ids, custom_generate=d, **kw), args.repeats
            )
            stats = decoder.last_stats
            rows.append({"prompt": i, "engine": f"hf-spec {spec}", "new_tokens": out.shape[1] - ids.shape[1],
                         "seconds": seconds, "tokens_per_s": (out.shape[1] - ids.shape[1]) / seconds,
                         "tau": stats.tau if stats else None, "equal_to_generate": torch.equal(out, ref)})  # fmt: skip
        if llm is not None:
            prompt_ids = ids[0].tolist()
            seconds, (tokens, first) = timed(
                lambda p=prompt_ids: llama_cpp_run(llm, p, args.max_new_tokens), args.repeats
            )
            decode = (len(tokens) - 1) / (seconds - first) if first is not None and len(tokens) > 1 else None
            rows.append({"prompt": i, "engine": "llama.cpp plain", "new_tokens": len(tokens), "seconds": seconds,
                         "tokens_per_s": len(tokens) / seconds, "decode_tokens_per_s": decode,
                         "same_tokens_as_int8_generate": tokens == ref[0, ids.shape[1]:].tolist()})  # fmt: skip
    summary = summarize(rows)
    return {
        "target": args.target,
        "quantizer": args.quantizer,
        "gguf": str(gguf) if gguf else None,
        "threads": args.threads,
        "max_new_tokens": args.max_new_tokens,
        "machine": machine_info(),
        "rows": rows,
        "summary": summary,
    }


def summarize(rows: list[dict]) -> dict:
    """Per engine: tokens/s over all prompts (total new tokens / total seconds), and the best hf-spec method."""
    engines: dict[str, dict] = {}
    for row in rows:
        e = engines.setdefault(row["engine"], {"new_tokens": 0, "seconds": 0.0, "exact": True})
        e["new_tokens"] += row["new_tokens"]
        e["seconds"] += row["seconds"]
        e["exact"] &= row.get("equal_to_generate", True)
    for e in engines.values():
        e["tokens_per_s"] = round(e["new_tokens"] / e["seconds"], 2)
    spec = {k: v for k, v in engines.items() if k.startswith("hf-spec")}
    best = max(spec, key=lambda k: spec[k]["tokens_per_s"]) if spec else None
    return {"engines": engines, "best_hf_spec": best}


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
    p.add_argument("--limit", type=int, help="at most N prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument(
        "--repeats", type=int, default=1, help="timed calls per prompt and engine (after a warm-up)"
    )
    p.add_argument("--out", help="write the rows and summary as JSON here")
    args = p.parse_args(argv)
    result = run(args)
    for engine, e in result["summary"]["engines"].items():
        exact = "" if e["exact"] else "  (departs from int8 generate!)"
        print(f"{engine:<40} {e['tokens_per_s']:>8.2f} tokens/s{exact}")
    print(f"best hf-spec method: {result['summary']['best_hf_spec']}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
