"""Per-round time split (draft / verify / other, from `spec_stats`) and tau of methods, with `ar` timed on the
same prompts, in each dtype asked for.

Usage: python lab/research/round_time.py --dtypes float32,bfloat16 --methods lyanna:CFG,eagle:CFG [--prompts F]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from hf_spec import SpeculativeDecoder
from hf_spec.bench.runner import encode_chat
from hf_spec.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--methods", required=True, help="comma list of hf-spec method specs")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--prompts", default="../shared/data/eval/spec_bench_dev.jsonl")
    ap.add_argument("--count", type=int, default=4, help="prompts, spread over the file")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [json.loads(line) for line in open(args.prompts)]
    prompts = rows[:: max(1, len(rows) // args.count)][: args.count]
    print(
        "| method | dtype | tau | draft ms/round | verify ms/round | other ms/round | ar ms/token | speedup |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        model, tok = load_model(args.target, dtype=getattr(torch, dtype))
        for spec in args.methods.split(","):
            dec = SpeculativeDecoder(spec, tokenizer=tok)
            tokens = forwards = 0
            draft = verify = other = spec_s = ar_s = 0.0
            for i, p in enumerate(prompts):
                ids = encode_chat(tok, [{"role": "user", "content": p["turns"][0]}])
                kw = dict(
                    max_new_tokens=args.max_new_tokens, do_sample=False, attention_mask=torch.ones_like(ids)
                )
                if i == 0:  # warm-up
                    model.generate(ids, custom_generate=dec, max_new_tokens=8, do_sample=False)
                start = time.perf_counter()
                model.generate(ids, custom_generate=dec, **kw)
                spec_s += time.perf_counter() - start
                s = dec.last_stats
                tokens, forwards = tokens + s.new_tokens, forwards + s.target_forwards
                draft, verify, other = draft + s.time_draft, verify + s.time_verify, other + s.time_other
                start = time.perf_counter()
                model.generate(ids, **kw)
                ar_s += time.perf_counter() - start
            ms = 1000 / forwards
            print(
                f"| `{spec}` | {dtype} | {tokens / forwards:.2f} | {draft * ms:.1f} | {verify * ms:.1f} | "
                f"{other * ms:.1f} | {1000 * ar_s / tokens:.1f} | {ar_s / spec_s:.2f}x |",
                flush=True,
            )


if __name__ == "__main__":
    main()
