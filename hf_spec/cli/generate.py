"""`hf-spec generate`: one speculative generation, timed side by side with plain `generate`."""

from __future__ import annotations

import argparse
import time

import torch

from hf_spec.cli.argtypes import float_in, positive_float, positive_int
from hf_spec.cli.common import (
    add_device_argument,
    add_dtype_argument,
    examples,
    load_target,
    set_threads,
)

DEFAULT_PROMPT = """Add type hints and a docstring to this function, and keep everything else unchanged:

def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            averages.append(total / window)
    return averages
"""


DEFAULT_TARGET = "qwen2.5-coder-0.5b-instruct"


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "generate",
        help="generate with a method and compare with plain generate",
        description="Generate once with a method, streaming the text, then time it against plain generate "
        "(interleaved and repeated, --repeats) and say whether the outputs are the same.",
        **examples(
            "hf-spec generate --target smollm2-135m-instruct --method pld",
            "hf-spec generate --target qwen2.5-coder-0.5b-instruct --method early-exit:12 --dtype float32",
            'hf-spec generate --method pld --prompt "Summarise this: ..." --sample --temperature 0.8',
        ),
    )
    p.add_argument(
        "--target", default=None, help=f"known model name, folder or Hub id (default: {DEFAULT_TARGET})"
    )
    p.add_argument("--method", default="pld", help="hf-spec method spec, e.g. pld, early-exit:6, oracle:8")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="user message (chat template applied)")
    p.add_argument("--max-new-tokens", type=positive_int, default=160)
    p.add_argument("--sample", action="store_true", help="do_sample=True (temperature/top-p below)")
    p.add_argument("--temperature", type=positive_float, default=0.7)
    p.add_argument("--top-p", type=float_in(0.0, 1.0), default=0.9)
    p.add_argument("--no-compare", action="store_true", help="skip the plain-generate baseline")
    p.add_argument("--threads", type=positive_int, default=None)
    add_dtype_argument(p)
    add_device_argument(p)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from transformers import TextStreamer

    from hf_spec import SpeculativeDecoder
    from hf_spec.bench.prompts import encode_chat
    from hf_spec.core.specs import parse_method
    from hf_spec.models.fetch import check_default_target

    parse_method(args.method)  # a bad method spec fails before the model loads
    if args.target is None:  # no model named: the default, not downloaded unasked while HF_HUB_OFFLINE is set
        check_default_target(DEFAULT_TARGET)
        args.target = DEFAULT_TARGET
    threads = set_threads(args.threads)
    model, tokenizer = load_target(args)
    input_ids = encode_chat(tokenizer, [{"role": "user", "content": args.prompt}]).to(model.device)
    kwargs = dict(max_new_tokens=args.max_new_tokens, attention_mask=torch.ones_like(input_ids))
    kwargs.update(
        do_sample=True, temperature=args.temperature, top_p=args.top_p
    ) if args.sample else kwargs.update(do_sample=False)
    decoder = SpeculativeDecoder(args.method, tokenizer=tokenizer)
    model.generate(input_ids, max_new_tokens=4, do_sample=False, custom_generate=decoder)  # warm-up
    print(f"--- {args.target} ({model.dtype}), method {args.method}, {threads} threads ---")
    start = time.perf_counter()
    out = model.generate(
        input_ids, custom_generate=decoder, streamer=TextStreamer(tokenizer, skip_prompt=True), **kwargs
    )
    spec_s = time.perf_counter() - start
    stats = decoder.last_stats
    print("---")
    spec_tps = stats.new_tokens / spec_s
    print(
        f"hf-spec {args.method}: {stats.new_tokens} tokens in {spec_s:.2f} s = {spec_tps:.1f} tokens/s; "
        f"mean accepted tokens per target forward (tau) = {stats.tau:.2f}"
    )
    if not args.no_compare:
        model.generate(input_ids, max_new_tokens=4, do_sample=False)  # warm-up, as the speculative run had
        start = time.perf_counter()
        ref = model.generate(input_ids, **kwargs)
        ar_s = time.perf_counter() - start
        ar_tps = (ref.shape[1] - input_ids.shape[1]) / ar_s
        print(
            f"plain generate: {ref.shape[1] - input_ids.shape[1]} tokens in {ar_s:.2f} s = {ar_tps:.1f} tokens/s"
        )
        print(f"speedup: {spec_tps / ar_tps:.2f}x")
        if not args.sample:
            print(f"identical to plain greedy generate: {_compare(model, input_ids, out, ref)}")
    return 0


def _compare(model, input_ids: torch.Tensor, out: torch.Tensor, ref: torch.Tensor) -> str:
    """'yes', or where the outputs part and whether the two choices were a numeric tie in the model's dtype."""
    from hf_spec.bench.lossless import compare_greedy
    from hf_spec.models import dtype_name

    start = input_ids.shape[1]
    new, want = out[0, start:].tolist(), ref[0, start:].tolist()
    verdict = compare_greedy(model, input_ids, want, new)
    if verdict["lossless"]:
        return "yes"
    if verdict["diverged_at"] >= min(len(new), len(want)):
        return f"NO (lengths differ: {len(new)} vs {len(want)} tokens)"
    kind = f"a {dtype_name(model.dtype)} near-tie" if verdict["near_tie"] else "NOT a near-tie: a bug"
    return f"NO, from token {verdict['diverged_at']}: logit gap {verdict['choice_gap']:.4f} between the two choices, {kind}"
