"""`hf-spec bench`: speed, tau and losslessness of methods against plain `generate`."""

from __future__ import annotations

import argparse
import sys

from hf_spec.cli.argtypes import positive_int
from hf_spec.cli.common import (
    add_device_argument,
    add_dtype_argument,
    examples,
    load_target,
    set_threads,
)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench",
        help="benchmark methods against plain generate (Spec-Bench style)",
        description="Time methods against plain generate on Spec-Bench style prompts: the runs of all methods "
        "interleave prompt by prompt, and every speed-up is over `ar` (plain generate) in the same run.",
        **examples(
            "hf-spec bench --target smollm2-135m-instruct --methods ar,hf-pld,pld --prompts benchmarks/prompts/spec_bench_dev.jsonl "
            "--per-category 1 --out runs/bench",
            "hf-spec bench --target qwen2.5-coder-0.5b-instruct --methods ar,pld,eagle:HEAD --prompts benchmarks/prompts/spec_bench_dev.jsonl "
            "--limit 8 --check-lossless --out runs/eagle",
        ),
    )
    p.add_argument("--target", required=True, help="known model name, local folder or Hub id")
    p.add_argument(
        "--methods",
        required=True,
        help="comma list: ar, ar-kernels (plain decoding on hf-spec's CPU kernels), hf-pld, hf-early-exit:K, "
        "or hf-spec name[:arg]",
    )
    p.add_argument("--prompts", required=True, help="Spec-Bench style .jsonl (question_id, category, turns)")
    p.add_argument("--limit", type=positive_int, default=None, help="first N prompts")
    p.add_argument("--per-category", type=positive_int, default=None, help="first K prompts of each category")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--turns", choices=["first", "all"], default="first")
    p.add_argument("--check-lossless", action="store_true", help="compare every output with ar's")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: all cores)")
    add_dtype_argument(p)
    add_device_argument(p)
    p.add_argument(
        "--record-rounds",
        default=None,
        metavar="FILE",
        help="also write every round's tree shape, accepted path and draft work per method to FILE (JSON), for "
        "benchmarks/gpu_check.py to replay at GPU costs",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="run every method compiled: ar as transformers' compiled static-cache generate, hf-spec methods with "
        "SpeculativeDecoder(compile=True); or name single methods with a +compiled suffix (ar,ar+compiled,pld,"
        "pld+compiled) for eager and compiled side by side",
    )
    p.add_argument("--out", required=True, help="output folder for results.json/.md and speedup.png")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from hf_spec.bench.runner import (
        hf_early_exit_layer,
        load_prompts,
        markdown_table,
        run_bench,
        write_outputs,
    )
    from hf_spec.io.output_folder import check_output_folder

    # before any work: a run is not lost at the end to an --out that cannot be written
    check_output_folder(args.out, _holds_bench_results, "bench results folder")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods:
        raise ValueError("--methods names no method (e.g. --methods ar,pld)")
    if args.check_lossless and "ar" not in methods:
        print("--check-lossless needs `ar` among the methods", file=sys.stderr)
        return 2
    for name in methods:  # a bad method name fails before the model loads
        if name.startswith("hf-early-exit"):
            hf_early_exit_layer(name)
    if "ar" in methods:  # ar runs first on every prompt: it is the reference
        methods.remove("ar")
        methods.insert(0, "ar")
    set_threads(args.threads)
    prompts = load_prompts(args.prompts, args.limit, args.per_category)
    model, tokenizer = load_target(args)
    recorder = None
    if args.record_rounds:
        from hf_spec.bench.rounds import RoundRecorder

        recorder = RoundRecorder(model)
    results = run_bench(
        model,
        tokenizer,
        methods,
        prompts,
        max_new_tokens=args.max_new_tokens,
        turns=args.turns,
        check_lossless=args.check_lossless,
        progress=lambda total: tqdm(total=total, desc="bench", unit="run"),
        recorder=recorder,
        compile=args.compile,
    )
    if recorder is not None:
        recorder.write(args.record_rounds)
        print(f"wrote the rounds of every method to {args.record_rounds}")
    results["command"] = args.command_line  # as given to `hf-spec` (set by hf_spec.cli.main)
    write_outputs(results, args.out)
    print(markdown_table(results))
    print(f"wrote {args.out}/results.json, results.md, speedup.png")
    return 0


def _holds_bench_results(folder) -> bool:
    """An earlier `hf-spec bench` output folder (its results may be replaced)."""
    return (folder / "results.json").is_file()
