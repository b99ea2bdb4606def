"""`hf-spec data responses|features`: the training-data pipeline's steps, each cached and resumable."""

from __future__ import annotations

import argparse

from hf_spec.cli.argtypes import nonnegative_int, positive_float, positive_int
from hf_spec.cli.common import (
    add_device_argument,
    add_dtype_argument,
    resolve_device,
    resolve_dtype,
    set_threads,
)


def add_data_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="target model: known name or local folder")
    parser.add_argument(
        "--prompts",
        action="append",
        required=True,
        help="training prompt file (ShareGPT .json or Alpaca-style .jsonl; never evaluation prompts); repeatable",
    )
    parser.add_argument(
        "--seed-cache", help="JSONL of earlier answers by this target to import instead of generating"
    )
    parser.add_argument("--data-dir", help="where the cache lives (default: $HF_SPEC_CACHE/data/<target>)")
    parser.add_argument("--limit", type=positive_int, help="use the first N prompts of each file")
    parser.add_argument("--max-new-tokens", type=positive_int, default=256)
    parser.add_argument("--batch-size", type=positive_int, default=8)
    parser.add_argument("--threads", type=positive_int, help="torch CPU threads")
    add_device_argument(parser)  # where answers and features are computed (and heads trained)
    parser.add_argument(
        "--samples",
        type=nonnegative_int,
        default=0,
        help="answers per prompt sampled from the target besides its greedy one (more data from the same prompts)",
    )
    parser.add_argument(
        "--temperature", type=positive_float, default=0.7, help="temperature of the sampled answers"
    )
    parser.add_argument(
        "--cached-only",
        action="store_true",
        help="use only answers already cached (or seeded); generate none",
    )


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("data", help="build the training data of heads: target answers, features")
    steps = parser.add_subparsers(dest="step", required=True)
    responses = steps.add_parser("responses", help="generate (or import) the target's greedy answers")
    add_data_args(responses)
    # bfloat16 batches cost about what one row does on AMX; the answers are tagged with their dtype
    add_dtype_argument(responses)
    responses.add_argument(
        "--continue-cut",
        action="store_true",
        help="continue cached answers that an earlier, smaller --max-new-tokens cut (no EOS) up to this one",
    )
    responses.set_defaults(func=run_responses)
    features = steps.add_parser("features", help="capture the target's features and top-K probabilities")
    add_data_args(features)
    features.add_argument(
        "--topk", type=positive_int, default=16, help="target probabilities kept per position"
    )
    features.set_defaults(func=run_features)


def conversations_from_args(args: argparse.Namespace):
    """`(model, tokenizer, conversations)` for the data options of `add_data_args`; the target in `args.dtype`
    where the step has one (answers), float32 otherwise (features: the fingerprint and the heads' inputs)."""
    from hf_spec.training.data import load_conversations

    set_threads(args.threads)
    device = resolve_device(args.device)
    return load_conversations(
        args.target,
        args.prompts,
        args.seed_cache,
        args.data_dir,
        args.limit,
        args.max_new_tokens,
        args.batch_size,
        generate=not args.cached_only,
        dtype=resolve_dtype(getattr(args, "dtype", "float32"), device),
        device=device,
        continue_cut=getattr(args, "continue_cut", False),
        samples=args.samples,
        temperature=args.temperature,
    )


def run_responses(args: argparse.Namespace) -> int:
    from hf_spec.training.responses import SAMPLE_MARK

    _, _, convs = conversations_from_args(args)
    tokens = sum(len(c.response_ids) for c in convs)
    seeded = sum(c.source == "seed" for c in convs)
    continued = sum("+" in c.source for c in convs)
    sampled = sum(SAMPLE_MARK in c.id for c in convs)
    print(
        f"{len(convs)} conversations ({seeded} imported from the seed cache, {continued} continued answers, "
        f"{sampled} sampled answers), {tokens} response tokens"
    )
    return 0


def run_features(args: argparse.Namespace) -> int:
    from hf_spec.training.features import capture_features

    model, _, convs = conversations_from_args(args)
    store = capture_features(model, convs, args.data_dir or None, target=args.target, topk=args.topk)
    print(f"features: {store.num_tokens} tokens in {len(store.shards)} shards at {store.folder}")
    return 0
