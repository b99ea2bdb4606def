"""`hf-spec datastore build|info`: token datastores for the `retrieval` and `talon` methods."""

from __future__ import annotations

import argparse
import json
import sys
import time

from hf_spec.cli.argtypes import nonnegative_int, positive_int
from hf_spec.cli.common import (
    DATA_DTYPE,
    add_deprecated_alias,
    add_device_argument,
    add_dtype_argument,
    examples,
    load_target,
)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "datastore",
        help="build or inspect a retrieval datastore",
        **examples(
            "hf-spec datastore build --target smollm2-135m-instruct --corpus TRAIN.json --out runs/datastore",
            "hf-spec datastore info runs/datastore",
        ),
    )
    sub = p.add_subparsers(dest="datastore_command", required=True)
    b = sub.add_parser(
        "build",
        help="build a datastore from training data (never from eval prompts)",
        **examples(
            "hf-spec datastore build --target qwen2.5-coder-0.5b-instruct --corpus TRAIN.json "
            "--responses ANSWERS.jsonl --out runs/datastore",
            "hf-spec datastore build --target qwen2.5-coder-0.5b-instruct --recipe recipe.json --out runs/datastore",
        ),
    )
    b.add_argument("--target", required=True, help="known model name, local folder or Hub id (its tokenizer)")
    b.add_argument(
        "--corpus",
        action="append",
        default=[],
        metavar="FILE",
        help="training text file (.json ShareGPT, .jsonl Alpaca, .txt), segmented by the tokenizer; repeatable",
    )
    add_deprecated_alias(b, "--from", "--corpus", metavar="FILE")
    b.add_argument(
        "--responses",
        action="append",
        default=[],
        metavar="FILE",
        help="cache of the target's own answers (JSONL with prompt, response); repeatable",
    )
    b.add_argument(
        "--early-exit-prompts",
        action="append",
        default=[],
        metavar="FILE",
        help="training prompts continued by the target's early-exit layers; repeatable",
    )
    b.add_argument(
        "--early-exit-layer", type=nonnegative_int, default=0, help="exit layer (0: 3/4 of the depth)"
    )
    b.add_argument("--early-exit-max-prompts", type=positive_int, default=64)
    b.add_argument("--early-exit-new-tokens", type=positive_int, default=64)
    b.add_argument("--recipe", default=None, help="a recipe .json instead of the source flags")
    b.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: all cores)")
    add_dtype_argument(b, DATA_DTYPE)  # with --early-exit-prompts: the target's dtype as it continues them
    add_device_argument(b)
    b.add_argument("--out", required=True, help="output folder")
    b.set_defaults(func=run_build)
    i = sub.add_parser(
        "info",
        help="print a datastore's recipe and statistics",
        **examples("hf-spec datastore info runs/datastore"),
    )
    i.add_argument("path")
    i.set_defaults(func=run_info)
    return p


def run_build(args: argparse.Namespace) -> int:
    from hf_spec.cli.common import set_threads
    from hf_spec.datastore import DatastoreRecipe, build_datastore, save_datastore
    from hf_spec.datastore.store import is_datastore_folder
    from hf_spec.io.output_folder import check_output_folder

    check_output_folder(args.out, is_datastore_folder, "datastore")  # before the build, not after
    if args.recipe:
        recipe = DatastoreRecipe.from_dict(json.loads(open(args.recipe).read()))
    else:
        recipe = DatastoreRecipe(
            corpus=args.corpus,
            responses=args.responses,
            early_exit_prompts=args.early_exit_prompts,
            early_exit_layer=args.early_exit_layer,
            early_exit_max_prompts=args.early_exit_max_prompts,
            early_exit_new_tokens=args.early_exit_new_tokens,
        )
    if recipe.empty:
        print("no source: give --corpus, --responses or --early-exit-prompts (or --recipe)", file=sys.stderr)
        return 2
    set_threads(args.threads)
    start = time.perf_counter()
    if recipe.early_exit_prompts:
        model, tokenizer = load_target(args)
    else:  # only the tokenizer is needed
        model, tokenizer = None, _load_tokenizer(args.target)
    index, meta = build_datastore(recipe, model, tokenizer)
    save_datastore(args.out, index, recipe, meta)
    print(json.dumps(meta, indent=2))
    print(f"wrote {args.out} in {time.perf_counter() - start:.1f} s")
    return 0


def _load_tokenizer(target: str):
    from transformers import AutoTokenizer

    from hf_spec.models.fetch import KNOWN_MODELS, fetch_model

    path = fetch_model(target) if target in KNOWN_MODELS else target
    return AutoTokenizer.from_pretrained(path)


def run_info(args: argparse.Namespace) -> int:
    from pathlib import Path

    folder = Path(args.path)
    for name in ("recipe.json", "meta.json"):
        if not (folder / name).exists():
            print(f"no datastore at {folder} ({name} missing)", file=sys.stderr)
            return 2
        print(f"{name}:\n{(folder / name).read_text()}")
    return 0
