"""Draft-phase time split of head drafters (Lyanna paper Figure 13 analogue): time in the head's decoder layer
(`run_layer`, catch-up included), in LM-head calls and in the rest (fc, token-info, tree building), per
round, over real generations. Timers wrap the library's functions from outside; nothing in hf_spec changes.

Usage: python lab/research/draft_time_split.py --target qwen2.5-coder-0.5b-instruct \
    --methods eagle:benchmarks/configs/hass-qwen2.5-coder-0.5b-instruct.json,lyanna:benchmarks/configs/lyanna-...
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

import hf_spec.methods.eagle.drafter as eagle_drafter
import hf_spec.methods.lyanna.drafter as lyanna_drafter
from hf_spec import SpeculativeDecoder
from hf_spec.bench.runner import encode_chat, load_prompts
from hf_spec.heads.base import DraftHeadModel
from hf_spec.models import load_model

TIMES: dict[str, float] = defaultdict(float)


def timed(name: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[name] += time.perf_counter() - start

    return wrapper


@contextmanager
def instrumented():
    """Time `DraftHeadModel.run_layer` and the drafters' LM-head matmuls."""
    saved = (DraftHeadModel.run_layer, eagle_drafter.skinny_linear, lyanna_drafter.skinny_linear)
    DraftHeadModel.run_layer = timed("layer", DraftHeadModel.run_layer)
    eagle_drafter.skinny_linear = timed("lm_head", eagle_drafter.skinny_linear)
    lyanna_drafter.skinny_linear = timed("lm_head", lyanna_drafter.skinny_linear)
    try:
        yield
    finally:
        DraftHeadModel.run_layer, eagle_drafter.skinny_linear, lyanna_drafter.skinny_linear = saved


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--methods", required=True, help="comma list of eagle:/lyanna: specs")
    ap.add_argument("--prompts", default="../shared/data/eval/spec_bench_dev.jsonl")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.target)
    prompts = load_prompts(args.prompts, args.limit, args.per_category)
    rows = []
    print("| method | rounds | draft ms/round | layer ms | LM head ms | other ms | LM head share |")
    print("|---|---|---|---|---|---|---|")
    for spec in args.methods.split(","):
        decoder = SpeculativeDecoder(spec, tokenizer=tok)
        warm = encode_chat(tok, [{"role": "user", "content": prompts[0].turns[0]}])
        model.generate(warm, max_new_tokens=8, do_sample=False, custom_generate=decoder)
        TIMES.clear()
        draft, rounds = 0.0, 0
        with instrumented():
            for p in prompts:
                ids = encode_chat(tok, [{"role": "user", "content": p.turns[0]}])
                model.generate(
                    ids, max_new_tokens=args.max_new_tokens, do_sample=False, custom_generate=decoder
                )
                draft += decoder.last_stats.time_draft
                rounds += decoder.last_stats.target_forwards
        per = {k: 1000 * v / rounds for k, v in TIMES.items()} | {"draft": 1000 * draft / rounds}
        other = per["draft"] - per.get("layer", 0.0) - per.get("lm_head", 0.0)
        row = {"method": spec, "rounds": rounds, **{f"{k}_ms": round(v, 2) for k, v in per.items()}}
        rows.append(row | {"other_ms": round(other, 2)})
        print(
            f"| `{spec}` | {rounds} | {per['draft']:.1f} | {per.get('layer', 0):.1f} | "
            f"{per.get('lm_head', 0):.1f} | {other:.1f} | {per.get('lm_head', 0) / per['draft']:.0%} |"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
