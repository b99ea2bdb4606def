"""`hf-spec eval-head`: a draft head's top-1 agreement with its target by draft depth, on the target's answers to
prompts or on a feature store (its fixed held-out set, the figure training reports give, or chosen sources)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hf_spec.cli.argtypes import int_at_least, nonnegative_int, positive_int


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from hf_spec.cli.common import DATA_DTYPE, add_dtype_argument, examples
    from hf_spec.cli.data import add_data_args
    from hf_spec.training.head_eval import METHODS

    parser = subparsers.add_parser(
        "eval-head",
        help="a draft head's agreement with its target by draft depth, on its answers to prompts or stored features",
        description="Top-1 agreement of a draft head with the target's next tokens at draft depths 1..N, the head "
        "reading its own states from depth 2 on: on the target's answers to --prompts (generated and captured "
        "as for training, at the layers the head reads), or on a feature store (--features; without --sources "
        "its fixed held-out set, the sequences every training report on that store is evaluated on).",
        **examples(
            "hf-spec eval-head --target smollm2-135m-instruct --head my-head --prompts HELD_OUT.json --limit 16",
            "hf-spec eval-head --target smollm2-135m-instruct --head my-head --features STORE --out agreement.json",
        ),
    )
    add_data_args(parser, prompts_required=False)  # --prompts, or --features below
    add_dtype_argument(
        parser, DATA_DTYPE
    )  # the target's dtype as it answers --prompts (heads train in float32)
    parser.add_argument("--head", required=True, help="head folder or Hub id (ours or a published layout)")
    parser.add_argument(
        "--method",
        choices=METHODS,
        help="how the head drafts (default: from the head's files; needed for published EAGLE-1 heads)",
    )
    parser.add_argument("--features", help="feature store of the target to evaluate on, instead of --prompts")
    parser.add_argument(
        "--sources",
        help="with --features: every sequence of these sources (comma-separated names or patterns; ALL: every "
        "one) instead of the store's held-out set",
    )
    parser.add_argument(
        "--limit-tokens", type=positive_int, help="with --sources: the first N tokens of them"
    )
    parser.add_argument(
        "--heldout-sources", default="auto", help="the sources of a store's held-out set (auto: answers)"
    )
    parser.add_argument(
        "--heldout", type=nonnegative_int, default=16, help="prompts in a store's held-out set"
    )
    parser.add_argument("--depths", type=int_at_least(4), default=4, help="draft depths to evaluate (>= 4)")
    parser.add_argument("--max-len", type=int_at_least(2), default=1024, help="longest sequence kept")
    parser.add_argument("--out", help="also write the result as JSON to this file")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hf_spec.cli.training_args import check_data_options
    from hf_spec.io.output_folder import check_output_file
    from hf_spec.training.head_eval import head_agreement, head_method, load_for_evaluation

    check_data_options(args)
    if args.limit_tokens and not args.sources:
        raise ValueError(
            "--limit-tokens selects from --sources: give --sources (or evaluate on the held-out set)"
        )
    args.method = args.method or head_method(args.head)
    if args.method is None:
        raise ValueError(
            f"{args.head!r} does not say how it drafts (no hf-spec recipe, not an EAGLE-3 checkpoint): give --method"
        )
    if args.out:  # before any work
        check_output_file(args.out, lambda p: _is_result(p), "agreement result")
    target, sequences, store, about = _prompt_sequences(args) if args.prompts else _store_sequences(args)
    head = load_for_evaluation(args.method, args.head, target)
    result = head_agreement(
        args.method, head, target, sequences, args.depths, args.max_len, store_layers=store.aux_layers
    )
    result |= {"head": args.head, "method": args.method, "features": str(store.folder)} | about
    result |= {"tokens": sum(len(s["input_ids"]) for s in sequences), "command": args.command_line}
    if result.get("held_out_from_training") is False:
        print(
            "note: the head's training report does not show these sequences were held out from its training: "
            "a head trained on them agrees more with the target on them than on new text"
        )
    print(
        f"{args.method} head {args.head}: top-1 agreement by depth {result['accuracy_by_depth']} over "
        f"{result['sequences']} sequences ({result['tokens']} tokens) of {result['sources']}"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def _prompt_sequences(args: argparse.Namespace):
    """`(target, sequences, store, about)`: the target's answers to `--prompts` (generated and captured when
    missing, as training does; an EAGLE-3 head's layers kept)."""
    from hf_spec.cli.train_eagle3 import layers_read_by
    from hf_spec.cli.training_args import answer_data

    aux = layers_read_by(args.head) if args.method == "eagle3" else None
    target, sequences, _, _, store, _ = answer_data(args, "evaluation", aux)
    return target, sequences, store, {"sources": f"answers to {', '.join(args.prompts)}"}


def _store_sequences(args: argparse.Namespace):
    """`(target, sequences, store, about)`: a store's fixed held-out set, or every sequence of `--sources`."""
    from hf_spec.cli.common import loading_kwargs, resolve_device, resolve_dtype, set_threads
    from hf_spec.models.fetch import load_model
    from hf_spec.training.features import FeatureStore
    from hf_spec.training.head_eval import held_out_from_training
    from hf_spec.training.lazy_store import lazy_sequences
    from hf_spec.training.store_data import HEAD_KEYS, check_store, split_store

    store = FeatureStore.open(args.features)
    set_threads(args.threads)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    target, _ = load_model(args.target, dtype=dtype, device=device, **loading_kwargs(args))
    keys = (*HEAD_KEYS, "aux_features") if args.method == "eagle3" else HEAD_KEYS
    check_store(store, target, keys, f"evaluating an {args.method} head")
    if args.sources:
        ids = split_store(store, args.sources, args.limit_tokens, "none", 0).train
        about = {"sources": args.sources}
    else:
        ids = split_store(store, None, None, args.heldout_sources, args.heldout).heldout
        if not ids:
            raise ValueError(
                f"{args.features} has no held-out set (no sequences of --heldout-sources {args.heldout_sources!r}): "
                "give --sources to evaluate on"
            )
        about = {
            "sources": f"held-out ({args.heldout} prompts of {args.heldout_sources})",
            # held out from this head's training? (heads trained on the store's held-out set say so)
            "held_out_from_training": held_out_from_training(args.head, ids),
        }
    return target, list(lazy_sequences(store, set(ids), keys)), store, about


def _is_result(path: Path) -> bool:
    """Whether `path` is an earlier agreement result (which may be replaced)."""
    try:
        return "accuracy_by_depth" in json.loads(path.read_text())
    except (OSError, ValueError, TypeError):
        return False
