"""`hf-spec eval-head`: a draft head's top-1 agreement with its target by draft depth, on a feature store (the
store's fixed held-out set, the figure training reports give, or the sequences of chosen sources)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hf_spec.cli.argtypes import int_at_least, nonnegative_int, positive_int


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from hf_spec.cli.common import add_device_argument
    from hf_spec.training.head_eval import METHODS

    parser = subparsers.add_parser(
        "eval-head",
        help="a draft head's agreement with its target by draft depth, on stored features",
        description="Top-1 agreement of a draft head with the target's next tokens at draft depths 1..N, the head "
        "reading its own states from depth 2 on, on a feature store captured with `hf-spec data features` "
        "(with --aux-layers for EAGLE-3 heads). Without --sources: the store's fixed held-out set, the "
        "sequences every training report on that store is evaluated on.",
    )
    parser.add_argument("--target", required=True, help="target model: known name, local folder or Hub id")
    parser.add_argument(
        "--method",
        choices=METHODS,
        help="how the head drafts (default: from the head's files; needed for published EAGLE-1 heads)",
    )
    parser.add_argument("--head", required=True, help="head folder or Hub id (ours or a published layout)")
    parser.add_argument("--features", required=True, help="feature store of the target")
    parser.add_argument(
        "--sources",
        help="evaluate on every sequence of these sources (comma-separated names or patterns; ALL: every one) "
        "instead of the held-out set",
    )
    parser.add_argument(
        "--limit-tokens", type=positive_int, help="with --sources: the first N tokens of them"
    )
    parser.add_argument(
        "--heldout-sources",
        default="auto",
        help="without --sources: sources of the held-out set (auto: answers)",
    )
    parser.add_argument("--heldout", type=nonnegative_int, default=16, help="prompts in the held-out set")
    parser.add_argument("--depths", type=int_at_least(4), default=4, help="draft depths to evaluate (>= 4)")
    parser.add_argument("--max-len", type=int_at_least(2), default=1024, help="longest sequence kept")
    parser.add_argument("--threads", type=positive_int, help="torch CPU threads")
    parser.add_argument("--out", help="also write the result as JSON to this file")
    add_device_argument(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hf_spec.cli.common import loading_kwargs, resolve_device, set_threads
    from hf_spec.models.fetch import load_model
    from hf_spec.output_folder import check_output_file
    from hf_spec.training.features import FeatureStore
    from hf_spec.training.head_eval import (
        head_agreement,
        head_method,
        held_out_from_training,
        load_for_evaluation,
    )
    from hf_spec.training.lazy_store import lazy_sequences
    from hf_spec.training.store_data import HEAD_KEYS, check_store, split_store

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
    store = FeatureStore.open(args.features)
    set_threads(args.threads)
    target, _ = load_model(args.target, device=resolve_device(args.device), **loading_kwargs(args))
    keys = (*HEAD_KEYS, "aux_features") if args.method == "eagle3" else HEAD_KEYS
    check_store(store, target, keys, f"evaluating an {args.method} head")
    if args.sources:
        ids = split_store(store, args.sources, args.limit_tokens, "none", 0).train
    else:
        ids = split_store(store, None, None, args.heldout_sources, args.heldout).heldout
        if not ids:
            raise ValueError(
                f"{args.features} has no held-out set (no sequences of --heldout-sources {args.heldout_sources!r}): "
                "give --sources to evaluate on"
            )
    head = load_for_evaluation(args.method, args.head, target)
    sequences = list(lazy_sequences(store, set(ids), keys))
    result = head_agreement(
        args.method, head, target, sequences, args.depths, args.max_len, store_layers=store.aux_layers
    )
    result |= {
        "head": args.head,
        "method": args.method,
        "features": str(store.folder),
        "sources": args.sources or f"held-out ({args.heldout} prompts of {args.heldout_sources})",
        "tokens": sum(store.captured()[cid] for cid in ids),
        "command": args.command_line,
    }
    if (
        not args.sources
    ):  # held out from this head's training? (heads trained on the store's held-out set say so)
        result["held_out_from_training"] = held_out_from_training(args.head, ids)
        if not result["held_out_from_training"]:
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


def _is_result(path: Path) -> bool:
    """Whether `path` is an earlier agreement result (which may be replaced)."""
    try:
        return "accuracy_by_depth" in json.loads(path.read_text())
    except (OSError, ValueError, TypeError):
        return False
