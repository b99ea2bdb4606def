"""`hf-spec sweep <method>`: throughput of a method over its placement/size parameters, side by side with `ar`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from hf_spec.cli.argtypes import positive_int
from hf_spec.cli.common import (
    add_device_argument,
    add_dtype_argument,
    examples,
    load_target,
    set_threads,
)


def _ints(text: str | None) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()] if text else []
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}") from None


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "sweep",
        help="sweep a method's parameters (e.g. HiSpec's layer pair) against ar",
        **examples("hf-spec sweep hispec --help"),
    )
    methods = p.add_subparsers(dest="method", required=True)
    h = methods.add_parser(
        "hispec",
        help="(L_d, L_i) heat map, then N_d and N_i sweeps at the best pair; writes the best config",
        **examples(
            "hf-spec sweep hispec --target qwen2.5-coder-0.5b-instruct --prompts benchmarks/prompts/spec_bench_dev.jsonl --per-category 1 "
            "--draft-layers 4,6,8 --verify-layers 12,16,20 --out runs/hispec-sweep",
        ),
    )
    h.add_argument("--target", required=True, help="known model name or local folder")
    h.add_argument(
        "--exit-heads", default="", help="exit-heads folder (empty: the stock final norm + LM head)"
    )
    h.add_argument(
        "--draft-vocab",
        action="store_true",
        help="exits argmax over the heads' draft vocabulary (draft_vocab)",
    )
    h.add_argument("--prompts", required=True, help="Spec-Bench style .jsonl (first turns are used)")
    h.add_argument("--limit", type=positive_int, default=None)
    h.add_argument("--per-category", type=positive_int, default=None)
    h.add_argument("--max-new-tokens", type=positive_int, default=64)
    h.add_argument("--draft-layers", type=_ints, required=True, help="L_d values, e.g. 4,6,8")
    h.add_argument("--verify-layers", type=_ints, required=True, help="L_i values, e.g. 8,12,16")
    h.add_argument("--num-draft-tokens", type=positive_int, default=2, help="N_d during the layer grid")
    h.add_argument("--num-buffer-tokens", type=positive_int, default=4, help="N_i during the layer grid")
    h.add_argument("--nd-values", type=_ints, default=[], help="N_d values to sweep at the best pair")
    h.add_argument("--ni-values", type=_ints, default=[], help="N_i values to sweep at the best pair")
    h.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: all cores)")
    add_dtype_argument(h)
    add_device_argument(h)
    h.add_argument(
        "--out", required=True, help="folder for sweep.json/.md, heatmap.png, nd_ni.png, best config"
    )
    h.set_defaults(func=run_hispec)
    return p


def run_hispec(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from hf_spec.bench.runner import load_prompts
    from hf_spec.bench.sweep import (
        best_config,
        config_label,
        measure_configs,
        plot_heatmap,
        plot_lines,
        write_sweep,
    )
    from hf_spec.io.output_folder import check_writable_folder
    from hf_spec.methods.hispec.config import HiSpecConfig

    grid = [
        HiSpecConfig(
            draft_layer=d,
            verify_layer=i,
            num_draft_tokens=args.num_draft_tokens,
            num_buffer_tokens=args.num_buffer_tokens,
            exit_heads=args.exit_heads,
            draft_vocab=args.draft_vocab,
        )
        for d in args.draft_layers
        for i in args.verify_layers
        if d < i
    ]
    if not grid:
        print("no (L_d, L_i) pair with L_d < L_i in --draft-layers x --verify-layers", file=sys.stderr)
        return 2
    out = Path(args.out)
    check_writable_folder(out, "sweep results")  # before any work, not at the end of the sweep
    set_threads(args.threads)
    prompts = load_prompts(args.prompts, args.limit, args.per_category)
    model, tokenizer = load_target(args)

    def bar(total: int, desc: str):
        return tqdm(total=total, desc=desc, unit="run")

    summary: dict = {}
    configs = list(grid)
    if len(grid) > 1:
        summary.update(
            measure_configs(
                model,
                tokenizer,
                grid,
                prompts,
                args.max_new_tokens,
                out / "configs",
                lambda total: bar(total, "layer grid"),
            )
        )
        plot_heatmap(
            grid,
            summary,
            out / "heatmap.png",
            f"HiSpec speedup vs ar, {args.target}, N_d={args.num_draft_tokens}, N_i={args.num_buffer_tokens}",
        )
    pair = best_config(grid, summary) if summary else grid[0]
    command = args.command_line
    if summary:  # written now too, so a run stopped during the size sweep keeps the grid
        write_sweep(out, {"summary": summary, "best": config_label(pair), "command": command})
    sizes = [dataclasses.replace(pair, num_draft_tokens=n) for n in args.nd_values]
    sizes += [dataclasses.replace(pair, num_buffer_tokens=n) for n in args.ni_values]
    sizes = list({config_label(c): c for c in sizes}.values())
    if sizes:
        sized = measure_configs(
            model,
            tokenizer,
            sizes,
            prompts,
            args.max_new_tokens,
            out / "configs",
            lambda total: bar(total, "N_d / N_i"),
        )
        summary.update({f"{k} (size sweep)" if k in summary else k: v for k, v in sized.items()})
        series = {}
        if args.nd_values:
            series[f"N_d (N_i={pair.num_buffer_tokens})"] = [
                (n, sized[config_label(dataclasses.replace(pair, num_draft_tokens=n))]["speedup_vs_ar"])
                for n in args.nd_values
            ]
        if args.ni_values:
            series[f"N_i (N_d={pair.num_draft_tokens})"] = [
                (n, sized[config_label(dataclasses.replace(pair, num_buffer_tokens=n))]["speedup_vs_ar"])
                for n in args.ni_values
            ]
        plot_lines(
            series,
            out / "nd_ni.png",
            f"HiSpec at L_d={pair.draft_layer}, L_i={pair.verify_layer}, {args.target}",
        )
        configs += sizes
    measured = [c for c in configs if config_label(c) in summary]
    best = best_config(measured, summary) if summary else pair
    out.mkdir(parents=True, exist_ok=True)
    (out / "hispec-best.json").write_text(json.dumps(best.to_dict(), indent=2) + "\n")
    write_sweep(
        out,
        {
            "summary": summary,
            "best": config_label(best),
            "best_config": best.to_dict(),
            "command": command,
        },
    )
    print((out / "sweep.md").read_text())
    return 0
