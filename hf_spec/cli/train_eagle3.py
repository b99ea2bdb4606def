"""`hf-spec train eagle3`: a feature store with EAGLE-3's aux layers -> EAGLE-3 head -> head folder
(SpecForge/SGLang layout + `hf_spec.json`, loadable by the `eagle3` method)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hf_spec.cli.argtypes import (
    int_at_least,
    nonnegative_float,
    nonnegative_int,
    positive_float,
    positive_int,
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from hf_spec.cli.common import examples
    from hf_spec.cli.data import add_data_args
    from hf_spec.cli.training_args import add_eval_every_argument, add_store_args, add_training_dtype_argument

    parser = subparsers.add_parser(
        "eagle3",
        help="train an EAGLE-3 head on the target's answers to --prompts, or on a feature store captured with "
        "--aux-layers (hf-spec data features)",
        **examples(
            "hf-spec train eagle3 --target smollm2-135m-instruct --prompts TRAIN.json --out my-eagle3-head",
            "hf-spec train eagle3 --target smollm2-135m-instruct --features STORE --sources ALL --epochs 1 "
            "--out my-eagle3-head",
        ),
    )
    add_data_args(parser, prompts_required=False)  # --prompts, or --features below
    parser.add_argument("--out", required=True, help="output head folder")
    # STORE: captured with --aux-layers eagle3 (see `hf-spec data features`)
    add_store_args(parser)
    parser.add_argument(
        "--aux-layers",
        help="with --prompts: the target layers the head reads (hidden_states indices, comma-separated; default "
        "eagle3: 2, N/2, N-3); a store's are those it was captured with",
    )
    parser.add_argument("--align-steps", type=positive_int, default=4, help="training-time-test steps")
    parser.add_argument("--topk", type=nonnegative_int, default=0, help="HASS top-K distillation K (0 = off)")
    parser.add_argument("--topk-weight", type=nonnegative_float, default=1.0)
    parser.add_argument(
        "--draft-vocab",
        type=positive_int,
        help="reduced draft vocabulary size (default 32768; with --init-from: the head's own)",
    )
    parser.add_argument(
        "--init-from",
        metavar="HEAD",
        help="start from this EAGLE-3 head's weights and draft vocabulary (folder or Hub id, any layout "
        "`eagle3:` loads): fine-tune a published head or train one of yours on more data",
    )
    parser.add_argument("--epochs", type=positive_float, default=2.0)
    # the target's raw middle and high states carry outliers in the thousands: EAGLE-3 heads train at 1e-4
    parser.add_argument("--lr", type=positive_float, default=1e-4)
    parser.add_argument("--batch-tokens", type=positive_int, default=4096)
    parser.add_argument("--max-len", type=int_at_least(2), default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--heldout",
        type=nonnegative_int,
        default=16,
        help="prompts held out for evaluation (see --heldout-sources)",
    )
    parser.add_argument("--save-every", type=positive_int, default=50, help="checkpoint every N steps")
    add_eval_every_argument(parser)
    add_training_dtype_argument(parser)
    parser.add_argument("--checkpoint-dir", help="default: $HF_SPEC_CACHE/runs/<out name>-<hash of its path>")
    parser.add_argument(
        "--save-dtype",
        choices=("bfloat16", "float16", "float32"),
        default="bfloat16",
        help="dtype of the saved weights (published EAGLE-3 heads are bfloat16 or float16)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from hf_spec.cli.training_args import (
        PRECISIONS,
        answer_data,
        check_data_options,
        default_run_dir,
        store_data,
        warn_if_collapsed,
    )
    from hf_spec.core.specs import HEAD_IN_THIS_FOLDER
    from hf_spec.heads.card import head_card
    from hf_spec.heads.hub import recipe_and_card_files
    from hf_spec.io.output_folder import check_output_folder
    from hf_spec.methods.eagle3 import Eagle3Config, load_eagle3_head
    from hf_spec.methods.eagle3.export import save_eagle3_head
    from hf_spec.methods.eagle3.published import SIDECAR, SIDECAR_FORMAT
    from hf_spec.training.distributed import current_processes
    from hf_spec.training.eagle3 import Eagle3TrainConfig, train_eagle3
    from hf_spec.training.features import FeatureStore
    from hf_spec.training.store_data import HEAD_KEYS
    from hf_spec.training.warm_start import started_from

    out = Path(args.out)
    check_output_folder(out, lambda f: _sidecar_format(f / SIDECAR) == SIDECAR_FORMAT, "EAGLE-3 head")
    check_data_options(args)
    if args.features and args.aux_layers:
        raise ValueError(
            f"--aux-layers goes with --prompts: {args.features} holds the layers it was captured with"
        )
    if args.features:  # before loading the target
        check_eagle3_store(FeatureStore.open(args.features), args.topk, args.features)
    processes = current_processes()  # under accelerate launch / torchrun: each trains on its share of a batch

    with processes.main_first():  # the main process fills the answer and feature caches, the others read them
        if args.features:  # read batch by batch: the store may not fit in memory
            model, sequences, heldout, groups, store, info = store_data(
                args, "EAGLE-3 training", (*HEAD_KEYS, "aux_features")
            )
        else:  # the layers: --aux-layers, else those of the head to start from, else EAGLE-3's default three
            model, sequences, heldout, groups, store, info = answer_data(
                args,
                "EAGLE-3 training",
                args.aux_layers or (layers_read_by(args.init_from) if args.init_from else "eagle3"),
            )
            check_eagle3_store(store, args.topk, store.folder)
    start = load_eagle3_head(args.init_from, model) if args.init_from else None
    cfg = Eagle3TrainConfig(
        align_steps=args.align_steps,
        topk=args.topk,
        topk_weight=args.topk_weight,
        draft_vocab=args.draft_vocab or (start.config.draft_vocab_size if start is not None else 32768),
        epochs=args.epochs,
        lr=args.lr,
        batch_tokens=args.batch_tokens,
        max_len=args.max_len,
        seed=args.seed,
        heldout=args.heldout,
        save_every=args.save_every,
        eval_every=args.eval_every,
        precision=PRECISIONS[args.precision],
        extra={"init_from": args.init_from} if args.init_from else {},
    )
    run_dir = Path(args.checkpoint_dir) if args.checkpoint_dir else default_run_dir(out)
    layers = tuple(store.aux_layers)
    head, report = train_eagle3(
        model, sequences, run_dir, cfg, layers, groups=groups, heldout=heldout, init_from=start
    )
    if not processes.is_main:  # one process writes the head folder
        return 0
    command = args.command_line
    report |= {"command": command} | info | started_from(args.init_from)
    card = head_card("EAGLE-3", "eagle3", Path(args.target).name, report, command, allow_collapsed=True)
    warn_if_collapsed(report, "EAGLE-3")
    files = recipe_and_card_files(Eagle3Config(head=HEAD_IN_THIS_FOLDER), card)
    files["training_report.json"] = json.dumps(report, indent=1) + "\n"
    dtype = getattr(torch, args.save_dtype)  # the folder is written whole, its checksum list last
    save_eagle3_head(out, head, target=model, metadata={"training": report}, dtype=dtype, extra_files=files)
    print(
        f"saved EAGLE-3 head to {out}: held-out accuracy by depth {report['heldout'].get('accuracy_by_depth')}, "
        f"{report['tokens_per_second']:.0f} trained tokens/s over {report['wall_seconds']} s"
    )
    return 0


def layers_read_by(head: str):
    """The target layers (`hidden_states` indices) the EAGLE-3 head `head` reads, as a function of the loaded
    target (`answer_data`'s `aux_layers`): a published head's are read against the target's layer count."""
    from hf_spec.methods.eagle3 import load_eagle3_head

    def layers(target) -> tuple[int, ...]:
        return tuple(load_eagle3_head(head, target).config.hidden_state_indices)

    return layers


def check_eagle3_store(store, topk: int, name) -> None:
    """Refuse a feature store an EAGLE-3 head cannot train on: empty, without the layers it reads, or with fewer
    target probabilities a position than `--topk`."""
    if not store.shards:
        raise ValueError(f"{name} holds no features: capture them with `hf-spec data features`")
    if len(store.aux_layers) < 2:
        raise ValueError(f"{name} was captured without EAGLE-3's layers: capture with --aux-layers eagle3")
    if topk > store.topk:
        raise ValueError(f"--topk {topk} exceeds the {store.topk} target probabilities in {name}")


def _sidecar_format(path: Path) -> str | None:
    try:
        return json.loads(path.read_text()).get("format")
    except (OSError, ValueError, AttributeError):
        return None
