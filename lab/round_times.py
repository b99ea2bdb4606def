"""Where a speculative round's time goes on a target: for each method, tokens/s over a few prompts and, per round,
the milliseconds spent drafting, verifying and on the rest (`SpecStats.time_draft` / `time_verify` /
`time_other`), with tokens a round; plain eager `generate` (`ar`) alongside, per token. Each method runs the prompts
twice and reports the second pass (the first compiles, for `+compiled` methods, and warms caches).

    python lab/round_times.py --target qwen2.5-coder-0.5b-instruct --quantize gguf \\
        eagle3:eagle3-qwen2.5-coder-0.5b-instruct-int4-chain2.json pld:2 pld:2+compiled

Relative config paths are read from `benchmarks/configs`.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hf_spec import SpeculativeDecoder  # noqa: E402
from hf_spec.bench.runner import compiled_generate_config  # noqa: E402
from hf_spec.models.fetch import load_model  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("methods", nargs="+", help="method specs; a +compiled suffix compiles the rounds")
    p.add_argument("--target", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--quantize", default=None, choices=(None, "int8", "int4", "gguf"))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompts", default=str(ROOT / "benchmarks/prompts/spec_bench_dev.jsonl"))
    p.add_argument("--count", type=int, default=4, help="prompts, one every 7 lines of the file")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument(
        "--ar-compiled", action="store_true", help="also transformers' compiled static-cache generate"
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    model, tok = load_model(args.target, dtype=getattr(torch, args.dtype), quantize=args.quantize)
    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    prompts = rows[7 : 7 * (args.count + 1) : 7]

    def ids_of(row: dict) -> torch.Tensor:
        text = row.get("prompt") or row.get("turns", [""])[0]
        ids = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt"
        )
        return ids if torch.is_tensor(ids) else ids["input_ids"]

    def run(kwargs: dict, decoder: SpeculativeDecoder | None) -> dict:
        total = dict(tokens=0, seconds=0.0, draft=0.0, verify=0.0, other=0.0, prefill=0.0, rounds=0)
        for row in prompts:
            ids = ids_of(row)
            t0 = time.perf_counter()
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens, do_sample=False,
                **kwargs,
            )  # fmt: skip
            total["seconds"] += time.perf_counter() - t0
            total["tokens"] += out.shape[1] - ids.shape[1]
            if decoder is not None:
                s = decoder.last_stats
                total["draft"] += s.time_draft
                total["verify"] += s.time_verify
                total["other"] += s.time_other
                total["prefill"] += s.time_prefill
                total["rounds"] += s.target_forwards - 1  # the prefill is a forward too
        return total

    print(f"{args.target} (--quantize {args.quantize}, {args.dtype}), {args.threads} threads, {len(prompts)} prompts, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")  # fmt: skip
    print(
        "| method | tok/s | ms a token | rounds | draft (ms a round) | verify | rest | tokens a round "
        "| prefill (ms a prompt) | outside the rounds (ms a prompt) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for _ in range(2):
        plain = run({}, None)
    print(f"| ar | {plain['tokens'] / plain['seconds']:.1f} | {1e3 * plain['seconds'] / plain['tokens']:.1f} | - | - "
          "| - | - | 1 | - | - |")  # fmt: skip
    if args.ar_compiled:  # as the benchmarks run `ar+compiled`: one static cache size for every prompt
        longest = max(ids_of(row).shape[1] for row in prompts) + args.max_new_tokens
        kwargs = dict(
            cache_implementation="static", compile_config=compiled_generate_config(), max_cache_len=longest
        )
        for _ in range(2):
            plain = run(kwargs, None)
        print(f"| ar+compiled | {plain['tokens'] / plain['seconds']:.1f} | "
              f"{1e3 * plain['seconds'] / plain['tokens']:.1f} | - | - | - | - | 1 | - | - |")  # fmt: skip
    config_dir = ROOT / "benchmarks/configs"
    for spec in args.methods:
        compiled = spec.endswith("+compiled")
        here = os.getcwd()
        os.chdir(config_dir)  # relative config paths, as the benchmarks give them
        try:
            decoder = SpeculativeDecoder(
                spec.removesuffix("+compiled"), tokenizer=tok, compile=compiled or None
            )
        finally:
            os.chdir(here)
        kwargs = {"custom_generate": decoder}
        if compiled:
            kwargs["compile_config"] = compiled_generate_config()
        for _ in range(2):
            t = run(kwargs, decoder)
        r = max(t["rounds"], 1)
        print(
            f"| {spec} | {t['tokens'] / t['seconds']:.1f} | {1e3 * t['seconds'] / t['tokens']:.1f} | {r} | "
            f"{1e3 * t['draft'] / r:.1f} | {1e3 * t['verify'] / r:.1f} | {1e3 * t['other'] / r:.1f} | "
            f"{t['tokens'] / r:.2f} | {1e3 * t['prefill'] / len(prompts):.0f} | "
            f"{1e3 * (t['seconds'] - t['draft'] - t['verify'] - t['other'] - t['prefill']) / len(prompts):.0f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
