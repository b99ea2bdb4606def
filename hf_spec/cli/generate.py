"""`hf-spec generate`: one speculative generation, timed side by side with plain `generate`."""

from __future__ import annotations

import argparse
import os
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
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=3,
        help="timed runs of each (speculative, plain, speculative, ...: interleaved, so a load on the machine hits "
        "both alike); the speedup printed is their median, with its spread",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="verify with compiled forwards over a static cache (SpeculativeDecoder(compile=True)); plain generate "
        "then runs compiled over a static cache too. The first call compiles (minutes on a CPU)",
    )
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
    decoder = SpeculativeDecoder(args.method, tokenizer=tokenizer, compile=args.compile or None)
    if args.compile:  # plain generate compiled as transformers does it, on any device
        from hf_spec.bench.runner import compiled_generate_config

        kwargs.update(cache_implementation="static", compile_config=compiled_generate_config())
    # warm-up; compiled: at the timed length, so the static cache the timed runs use is the one compiled over
    warm = (
        kwargs
        if args.compile
        else dict(max_new_tokens=4, do_sample=False, attention_mask=kwargs["attention_mask"])
    )
    model.generate(input_ids, custom_generate=decoder, **warm)
    print(f"--- {args.target} ({model.dtype}), method {args.method}, {threads} threads ---")
    load_before = _load_average()
    # the streamed run is the first timed speculative run
    spec_s, out = _timed(
        model.generate,
        input_ids,
        custom_generate=decoder,
        streamer=TextStreamer(tokenizer, skip_prompt=True),
        **kwargs,
    )
    stats = decoder.last_stats
    print("---")
    spec_tps = [stats.new_tokens / spec_s]
    print(
        f"hf-spec {args.method}: {stats.new_tokens} tokens in {spec_s:.2f} s = {spec_tps[0]:.1f} tokens/s; "
        f"mean accepted tokens per target forward (tau) = {stats.tau:.2f}"
    )
    if args.no_compare:
        return 0
    model.generate(input_ids, **warm)  # warm-up, as the speculative run had
    ar_tps, ref = [], None
    for i in range(args.repeats):  # plain, speculative, plain, ...: each plain run after a speculative one
        if i:
            seconds, _ = _timed(model.generate, input_ids, custom_generate=decoder, **kwargs)
            spec_tps.append(decoder.last_stats.new_tokens / seconds)
        seconds, plain = _timed(model.generate, input_ids, **kwargs)
        ar_tps.append((plain.shape[1] - input_ids.shape[1]) / seconds)
        ref = plain if ref is None else ref
    new = ref.shape[1] - input_ids.shape[1]
    print(
        f"plain generate: {new} tokens, {_median(ar_tps):.1f} tokens/s (median of {len(ar_tps)} runs; "
        f"hf-spec: {_median(spec_tps):.1f} tokens/s)"
    )
    ratios = sorted(s / a for s, a in zip(spec_tps, ar_tps, strict=True))
    spread = (
        f"; {ratios[0]:.2f}x-{ratios[-1]:.2f}x over {len(ratios)} interleaved runs" if len(ratios) > 1 else ""
    )
    print(f"speedup: {_median(ratios):.2f}x{spread}")
    print(_load_line(load_before, _load_average(), ratios))
    if not args.sample:
        print(f"identical to plain greedy generate: {_compare(model, input_ids, out, ref)}")
    return 0


def _timed(fn, *args, **kwargs):
    """`(seconds, fn(*args, **kwargs))`."""
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return time.perf_counter() - start, result


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _load_average() -> float | None:
    """The machine's 1-minute load average (None where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


# a machine counts as busy when its load average before the runs exceeds half its cores (other work was running),
# and timings as noisy when the fastest and slowest speedups of the interleaved runs differ by more than 20%
BUSY_LOAD_PER_CORE = 0.5
NOISY_SPREAD = 1.2


def _load_line(before: float | None, after: float | None, ratios: list[float]) -> str:
    """The load-average line, with a warning when the machine was busy or the runs disagree."""
    cores = os.cpu_count() or 1
    if before is None:
        line = "load average: unknown on this OS"
    else:
        line = f"load average: {before:.2f} before the runs, {after:.2f} after ({cores} cores)"
    warnings = []
    if before is not None and before > BUSY_LOAD_PER_CORE * cores:
        warnings.append(f"the machine was busy (load {before:.2f} on {cores} cores before the runs)")
    if len(ratios) > 1 and ratios[-1] > NOISY_SPREAD * ratios[0]:
        warnings.append(f"the runs disagree ({ratios[0]:.2f}x to {ratios[-1]:.2f}x)")
    if warnings:
        line += (
            "\nwarning: "
            + " and ".join(warnings)
            + ": this speedup may not be the machine's; rerun when it is idle, "
            "or measure over many prompts with `hf-spec bench`"
        )
    return line


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
