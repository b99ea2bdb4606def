"""What every `hf-spec train <head>` command shares: its flags (one vocabulary for all head kinds), the training data
they name (the target's answers to `--prompts`, or a feature store), and the run from data to a saved head folder."""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

from hf_spec.cli.argtypes import (
    int_at_least,
    nonnegative_float,
    nonnegative_int,
    positive_float,
    positive_int,
)


def add_common_train_args(parser: argparse.ArgumentParser, draft_vocab: int = 32768) -> None:
    from hf_spec.cli.data import add_data_args

    add_data_args(parser, prompts_required=False)  # --prompts, or --features below
    add_store_args(parser)
    parser.add_argument("--out", required=True, help="output folder (Hub-style head repo)")
    parser.add_argument(
        "--draft-vocab",
        type=positive_int,
        help=f"reduced draft vocabulary size (default {draft_vocab}; with --init-from: the head's own)",
    )
    parser.set_defaults(default_draft_vocab=draft_vocab)
    parser.add_argument(
        "--init-from",
        metavar="HEAD",
        help="start from this head's weights and draft vocabulary (a folder or Hub id of a head hf-spec trained "
        "for this target, of this kind): train it on more data or fine-tune it on your domain",
    )
    parser.add_argument("--epochs", type=positive_float, default=4.0)
    parser.add_argument("--lr", type=positive_float, default=1e-3)
    parser.add_argument(
        "--feature-weight", type=nonnegative_float, help="weight of the feature regression (method default)"
    )
    parser.add_argument(
        "--ce-weight", type=nonnegative_float, help="weight of the soft cross-entropy (method default)"
    )
    parser.add_argument("--batch-tokens", type=positive_int, default=2048)
    parser.add_argument("--max-len", type=int_at_least(2), default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--heldout",
        type=nonnegative_int,
        default=16,
        help="prompts held out for evaluation (with --features: of --heldout-sources)",
    )
    parser.add_argument("--save-every", type=positive_int, default=50, help="checkpoint every N steps")
    add_eval_every_argument(parser)
    parser.add_argument(
        "--init-from-last-layer",
        action="store_true",
        help="warm-start the head's layer from the target's last layer (an unquantized target in memory)",
    )
    add_training_dtype_argument(parser)
    parser.add_argument(
        "--checkpoint-dir", help="default: $HF_SPEC_CACHE/runs/<out folder name>-<hash of its path>"
    )


# `--dtype` of the trainers -> the training configs' `precision`
PRECISIONS = {"auto": "auto", "bfloat16": "bf16", "float32": "fp32"}


def add_training_dtype_argument(parser: argparse.ArgumentParser) -> None:
    """`--dtype` of a trainer: the head's compute dtype while training (the target's answers and features are
    float32 whatever it says); `--precision bf16|fp32` is its old spelling."""
    from hf_spec.cli.common import add_deprecated_alias

    parser.add_argument(
        "--dtype",
        dest="precision",
        choices=tuple(PRECISIONS),
        default="auto",
        help="training compute dtype (default auto: bfloat16 autocast where the hardware multiplies it natively, "
        "else float32); the target's answers and features stay float32",
    )
    add_deprecated_alias(
        parser,
        "--precision",
        "--dtype",
        dest="precision",
        choices=("auto", "bf16", "fp32"),
        values_map={"bf16": "bfloat16", "fp32": "float32"},
    )


def add_eval_every_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--eval-every",
        type=nonnegative_int,
        default=0,
        help="also evaluate on the held-out set every N steps, shown and kept in the report (0: at the end only)",
    )


def add_store_args(parser: argparse.ArgumentParser, features_required: bool = False) -> None:
    """`--features STORE` and what of it a trainer trains and evaluates on (`hf_spec.training.store_data`)."""
    group = parser.add_argument_group("training from a feature store (`hf-spec data features --corpus`)")
    group.add_argument(
        "--features",
        required=features_required,
        help="feature store to train on instead of --prompts (read shard by shard)",
    )
    group.add_argument(
        "--sources",
        help="train only on these sources (comma-separated names or patterns, e.g. answers,pypi-*; ALL: every one)",
    )
    group.add_argument(
        "--limit-tokens", type=positive_int, help="train on the first N tokens of those sources"
    )
    group.add_argument(
        "--heldout-sources",
        default="auto",
        help="sources of the fixed held-out set that no selection trains on (auto: answers when the store has "
        "them; none: held out from the training selection)",
    )


def common_train_config(args: argparse.Namespace) -> dict:
    keys = (
        "draft_vocab",
        "epochs",
        "lr",
        "batch_tokens",
        "max_len",
        "seed",
        "heldout",
        "save_every",
        "eval_every",
        "precision",
        "init_from_last_layer",
    )
    optional = ("feature_weight", "ce_weight")  # None: the method's default
    values = {key: getattr(args, key) for key in keys} | {
        key: getattr(args, key) for key in optional if getattr(args, key) is not None
    }
    values["precision"] = PRECISIONS[values["precision"]]
    if values["draft_vocab"] is None:  # with --init-from, train_and_save takes the head's own size
        values["draft_vocab"] = args.default_draft_vocab
    if args.init_from:  # part of the run's identity: a resume keeps its start head
        values["extra"] = {"init_from": args.init_from}
    return values


def train_and_save(args: argparse.Namespace, cfg, train_fn, recipe_cls, kind: str, head_cls) -> int:
    """Data (cached answers and features, or a feature store) -> train (resumable; from `--init-from`'s head when
    given) -> Hub-style folder with card and report."""
    from hf_spec.core.specs import HEAD_IN_THIS_FOLDER
    from hf_spec.heads.card import head_card
    from hf_spec.heads.hub import save_head_folder
    from hf_spec.io.output_folder import check_output_folder, holds_model_type
    from hf_spec.training.distributed import current_processes
    from hf_spec.training.warm_start import started_from

    model_type = head_cls.config_class.model_type
    check_data_options(args)
    out = Path(args.out)
    check_output_folder(out, holds_model_type(model_type), f"{model_type} head")  # before hours of training
    processes = current_processes()
    load = store_data if args.features else answer_data
    with processes.main_first():  # the main process fills the answer and feature caches, the others read them
        model, sequences, heldout, groups, store, info = load(args, f"{kind} training")
    if getattr(cfg, "topk", 0) > store.topk:
        raise ValueError(
            f"--topk {cfg.topk} exceeds the {store.topk} target probabilities captured per position in the "
            "features (`hf-spec data features --topk N ...` captures more)"
        )
    start = load_start_head(args, head_cls, recipe_cls.method, model, cfg)
    run_dir = Path(args.checkpoint_dir) if args.checkpoint_dir else default_run_dir(out)
    head, report = train_fn(model, sequences, run_dir, cfg, groups=groups, heldout=heldout, init_from=start)
    if not processes.is_main:  # one process writes the head folder
        return 0
    command = args.command_line
    report = report | {"command": command} | info | started_from(args.init_from)
    head.config.training = report
    card = head_card(kind, recipe_cls.method, Path(args.target).name, report, command, allow_collapsed=True)
    warn_if_collapsed(report, kind)
    report_file = {"training_report.json": json.dumps(report, indent=1) + "\n"}
    save_head_folder(head, out, recipe_cls(head=HEAD_IN_THIS_FOLDER), card, extra_files=report_file)
    print(
        f"saved {kind} head to {out}: held-out accuracy by depth {report['heldout'].get('accuracy_by_depth')}, "
        f"{report['tokens_per_second']:.0f} trained tokens/s over {report['wall_seconds']} s"
    )
    return 0


def warn_if_collapsed(report: dict, kind: str) -> None:
    """Say on stderr when the trained head collapsed on its held-out data (its card says so too)."""
    import sys

    from hf_spec.heads.collapse import collapse_reason

    reason = collapse_reason(report)
    if reason:
        print(
            f"warning: the {kind} head collapsed ({reason}): its card marks it not for publishing",
            file=sys.stderr,
        )


def check_data_options(args: argparse.Namespace) -> None:
    """One source of training data: `--prompts` (the target answers them) or `--features` (a captured store),
    and the store's selection options only with a store."""
    if bool(args.prompts) == bool(args.features):
        raise ValueError(
            "give --prompts (the target answers them) or --features (a captured store), one of them"
        )
    if not args.features and (args.sources or args.limit_tokens or args.heldout_sources != "auto"):
        raise ValueError(
            "--sources, --limit-tokens and --heldout-sources select from a store: give --features"
        )


def load_start_head(args: argparse.Namespace, head_cls, method: str, target, cfg):
    """`--init-from`'s head, loaded for `target` (its fingerprint checked), or None; fills `cfg.draft_vocab` with
    the head's own size when `--draft-vocab` was not given. Only heads hf-spec trained: a published head's
    layout (EAGLE-1's) is refused by name."""
    if not args.init_from:
        return None
    from hf_spec.methods.head_drafter import load_draft_head

    if args.init_from_last_layer:
        raise ValueError(
            "--init-from starts from a trained head, --init-from-last-layer from a target layer: give one"
        )
    head = load_draft_head(head_cls, args.init_from, target, method)
    if type(head) is not head_cls:
        raise ValueError(
            f"--init-from {args.init_from!r} is a published {type(head).__name__}: `hf-spec train {method}` trains "
            f"on from heads it trained itself ({head_cls.__name__}); published EAGLE-3 heads train on with "
            "`hf-spec train eagle3 --init-from`"
        )
    if args.draft_vocab is None:
        cfg.draft_vocab = head.config.draft_vocab_size
    return head


def answer_data(args: argparse.Namespace, what: str, aux_layers=None):
    """`(model, sequences, None, groups, store, info)` of the target's answers to `--prompts` (generated and
    captured when missing); the trainer holds out every k-th prompt. `aux_layers`: also capture (and read) these
    layers' states, for EAGLE-3 heads: `--aux-layers`' text (`eagle3` or indices), or a function of the loaded
    target giving the indices."""
    from hf_spec.cli.data import conversations_from_args, parse_aux_layers
    from hf_spec.training.corpus_features import eagle3_layers
    from hf_spec.training.features import capture_features
    from hf_spec.training.responses import prompt_id_of
    from hf_spec.training.store_data import HEAD_KEYS

    model, _, convs = conversations_from_args(args)
    if callable(aux_layers):
        aux = tuple(aux_layers(model))
    else:
        aux = parse_aux_layers(aux_layers, model.config.num_hidden_layers, eagle3_layers)
    store = capture_features(model, convs, args.data_dir, target=args.target, aux_layers=aux)
    wanted = {c.id for c in convs}
    groups = [prompt_id_of(cid) for cid in store.ordered_ids(wanted)]  # sampled answers go with their prompt
    keys = (*HEAD_KEYS, "aux_features") if aux else None
    return model, store.load_sequences(wanted, keys), None, groups, store, {"prompt_files": args.prompts}


def store_data(args: argparse.Namespace, what: str, keys: tuple[str, ...] | None = None):
    """`(model, sequences, heldout, groups, store, info)` of `--features` (read lazily): the `--sources` /
    `--limit-tokens` selection and the fixed held-out set (`hf_spec.training.store_data`); the target is loaded
    for its embedding, LM head and fingerprint."""
    from hf_spec.cli.common import loading_kwargs, resolve_device, set_threads
    from hf_spec.models.fetch import load_model
    from hf_spec.training.features import FeatureStore
    from hf_spec.training.store_data import HEAD_KEYS, store_training_data

    store = FeatureStore.open(args.features)
    if not store.shards:  # before loading the target
        raise ValueError(f"{args.features} holds no features: capture them with `hf-spec data features`")
    set_threads(args.threads)
    model, _ = load_model(args.target, device=resolve_device(args.device), **loading_kwargs(args))
    sequences, heldout, groups, info = store_training_data(
        store,
        model,
        keys or HEAD_KEYS,
        what,
        sources=args.sources,
        limit_tokens=args.limit_tokens,
        heldout_sources=args.heldout_sources,
        heldout=args.heldout,
    )
    return model, sequences, heldout, groups, store, info


def default_run_dir(out: Path) -> Path:
    """`$HF_SPEC_CACHE/runs/<out's name>-<hash of its full path>`: two `--out`s with the same name never share a
    checkpoint."""
    from hf_spec.models.fetch import cache_root

    resolved = out.resolve()
    return cache_root() / "runs" / f"{resolved.name}-{hashlib.sha1(str(resolved).encode()).hexdigest()[:8]}"
