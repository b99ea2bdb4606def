"""`hf-spec data responses|features`: the training-data pipeline's steps, each cached and resumable.

`features` captures either the target's answers to training prompts (`--prompts`) or a fixed-text corpus
(`--corpus`, prefill only: no generation)."""

from __future__ import annotations

import argparse

from hf_spec.cli.argtypes import nonnegative_int, positive_float, positive_int
from hf_spec.cli.common import (
    DATA_DTYPE,
    add_device_argument,
    add_dtype_argument,
    examples,
    loading_kwargs,
    resolve_device,
    resolve_dtype,
    set_threads,
)


def add_data_args(parser: argparse.ArgumentParser, prompts_required: bool = True) -> None:
    parser.add_argument("--target", required=True, help="target model: known name or local folder")
    parser.add_argument(
        "--prompts",
        action="append",
        required=prompts_required,
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
    parser = subparsers.add_parser(
        "data",
        help="build the training data of heads: target answers, features",
        **examples(
            "hf-spec data responses --target smollm2-135m-instruct --prompts TRAIN.json",
            "hf-spec data features --target smollm2-135m-instruct --prompts TRAIN.json",
        ),
    )
    steps = parser.add_subparsers(dest="step", required=True)
    responses = steps.add_parser(
        "responses",
        help="generate (or import) the target's greedy answers",
        **examples(
            "hf-spec data responses --target smollm2-135m-instruct --prompts TRAIN.json --limit 200",
            "hf-spec data responses --target qwen2.5-coder-0.5b-instruct --prompts TRAIN.json "
            "--seed-cache ANSWERS.jsonl --dtype bfloat16",
        ),
    )
    add_data_args(responses)
    # bfloat16 batches cost about what one row does on AMX; the answers are tagged with their dtype
    add_dtype_argument(responses, DATA_DTYPE)
    responses.add_argument(
        "--continue-cut",
        action="store_true",
        help="continue cached answers that an earlier, smaller --max-new-tokens cut (no EOS) up to this one",
    )
    responses.set_defaults(func=run_responses)
    features = steps.add_parser(
        "features",
        help="capture the target's features and top-K probabilities",
        **examples(
            "hf-spec data features --target smollm2-135m-instruct --prompts TRAIN.json --aux-layers eagle3",
            "hf-spec data features --target smollm2-135m-instruct --corpus CORPUS.jsonl --limit-tokens 1000000",
        ),
    )
    add_data_args(features, prompts_required=False)
    features.add_argument(
        "--topk", type=positive_int, default=16, help="target probabilities kept per position"
    )
    add_corpus_args(features)
    add_dtype_argument(features, DATA_DTYPE)  # the target's dtype in the feature forwards
    features.set_defaults(func=run_features)


def add_corpus_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("fixed-text corpora (prefill only, instead of --prompts)")
    group.add_argument(
        "--corpus",
        action="append",
        help="corpus JSONL (scripts/build_corpus.py), chat/ShareGPT/Alpaca file or .txt; repeatable, in order",
    )
    group.add_argument(
        "--features-dir", help="feature store (default: <data dir>/corpus-<first corpus>-<dtype>)"
    )
    group.add_argument(
        "--aux-layers",
        help="also keep these hidden_states indices (comma-separated; `eagle3`: 2,N/2,N-3) for EAGLE-3 heads",
    )
    group.add_argument("--max-len", type=positive_int, default=1024, help="tokens kept per document")
    group.add_argument("--limit-tokens", type=positive_int, help="capture only the corpus' first N tokens")
    group.add_argument(
        "--shard-tokens", type=positive_int, default=65536, help="tokens per shard (checkpoint)"
    )
    group.add_argument(
        "--docs-per-forward",
        type=positive_int,
        default=1,
        help="documents in one prefill forward, right-padded to the longest: more work per forward for a GPU; on "
        "a CPU the padding costs what real tokens cost",
    )
    group.add_argument("--log", help="append a progress line per shard to this file")
    group.add_argument(
        "--min-free-gb", type=positive_float, default=10.0, help="stop (resumably) under this much free disk"
    )


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
        load=loading_kwargs(args),  # --load-in-8bit, --device-map, ...
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

    if args.corpus:
        return run_corpus_features(args)
    if args.docs_per_forward != 1:
        raise ValueError(
            "--docs-per-forward batches the documents of --corpus; the answers' capture takes one a forward"
        )
    if not args.prompts:
        raise ValueError("give --prompts (the target's answers to training prompts) or --corpus (fixed text)")
    from hf_spec.training.corpus_features import eagle3_layers

    model, _, convs = conversations_from_args(args)
    aux = parse_aux_layers(args.aux_layers, model.config.num_hidden_layers, eagle3_layers)
    store = capture_features(
        model, convs, args.data_dir or None, target=args.target, topk=args.topk, aux_layers=aux
    )
    print(f"features: {store.num_tokens} tokens in {len(store.shards)} shards at {store.folder}")
    return 0


def run_corpus_features(args: argparse.Namespace) -> int:
    from pathlib import Path

    from hf_spec.models.fetch import dtype_name, load_model
    from hf_spec.training.corpus import load_corpus
    from hf_spec.training.corpus_features import capture_corpus, eagle3_layers
    from hf_spec.training.responses import default_data_dir

    if args.prompts:
        raise ValueError(
            "give either --prompts or --corpus, not both (their features go to different stores)"
        )
    set_threads(args.threads)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    documents = [doc for path in args.corpus for doc in load_corpus(path)]
    model, tokenizer = load_model(args.target, dtype=dtype, device=device, **loading_kwargs(args))
    layers = model.config.num_hidden_layers
    aux = parse_aux_layers(args.aux_layers, layers, eagle3_layers)
    folder = (
        Path(args.features_dir)
        if args.features_dir
        else (
            Path(args.data_dir or default_data_dir(args.target))
            / f"corpus-{Path(args.corpus[0]).stem}-{dtype_name(dtype)}"
        )
    )
    store = capture_corpus(
        model,
        tokenizer,
        documents,
        folder,
        topk=args.topk,
        aux_layers=aux,
        max_len=args.max_len,
        limit_tokens=args.limit_tokens,
        shard_tokens=args.shard_tokens,
        log_file=args.log,
        min_free_gb=args.min_free_gb,
        batch_size=args.docs_per_forward,
    )
    print(f"features: {store.num_tokens} tokens in {len(store.shards)} shards at {store.folder}")
    return 0


def parse_aux_layers(value: str | None, num_layers: int, eagle3_layers) -> tuple[int, ...]:
    """`--aux-layers`: None -> none; `eagle3` -> EAGLE-3's three; else comma-separated hidden_states indices."""
    if not value:
        return ()
    if value == "eagle3":
        return eagle3_layers(num_layers)
    try:
        return tuple(int(x) for x in value.split(","))
    except ValueError:
        raise ValueError(f"--aux-layers: comma-separated layer indices or `eagle3`, got {value!r}") from None
