"""`hf-spec train exits`: exit heads for early-exit and HiSpec self-speculation (see `hf_spec.methods.early_exit.exit_heads`)."""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

from hf_spec.cli.argtypes import int_at_least, nonnegative_int, positive_float, positive_int
from hf_spec.cli.common import (
    DATA_DTYPE,
    add_deprecated_alias,
    add_device_argument,
    add_dtype_argument,
    examples,
    load_target,
    set_threads,
)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "exits",
        help="fit light exit heads (adapter -> frozen final norm + LM head) by distillation",
        **examples(
            "hf-spec train exits --target smollm2-135m-instruct --layers 8,16,24 --responses ANSWERS.jsonl "
            "--out my-exits",
        ),
    )
    p.add_argument("--target", required=True, help="known model name or local folder")
    add_dtype_argument(p, DATA_DTYPE)
    add_device_argument(p)
    p.add_argument("--layers", required=True, help="comma list of exit layers, e.g. 4,8,12,16,20")
    p.add_argument("--out", required=True, help="output folder (config.json, model.safetensors, README.md)")
    responses = p.add_mutually_exclusive_group(required=True)  # required, and its old spelling counts
    responses.add_argument(
        "--responses",
        help="the target's answers, .jsonl with 'prompt' and 'response' (training prompts only, never eval); "
        "'{target}' in it is replaced by the target's folder name",
    )
    add_deprecated_alias(responses, "--data", "--responses")
    p.add_argument(
        "--rank", type=nonnegative_int, default=64, help="rank of each adapter's low-rank correction"
    )
    p.add_argument("--steps", type=positive_int, default=600)
    p.add_argument("--batch-size", type=positive_int, default=256, help="positions per step")
    p.add_argument("--lr", type=positive_float, default=2e-3)
    p.add_argument("--topk", type=positive_int, default=32, help="teacher tokens kept per position")
    add_deprecated_alias(p, "--top-k", "--topk", type=positive_int)
    p.add_argument("--negatives", type=nonnegative_int, default=1024, help="random negative tokens per batch")
    p.add_argument(
        "--max-positions", type=positive_int, default=60000, help="training positions to extract at most"
    )
    p.add_argument("--max-len", type=int_at_least(2), default=384, help="tokens per sequence at most")
    p.add_argument("--heldout", type=nonnegative_int, default=24, help="rows held out to measure agreement")
    p.add_argument(
        "--draft-vocab",
        type=nonnegative_int,
        default=32768,
        help="save the N most frequent training tokens as a draft vocabulary (exits may argmax over it); 0: none",
    )
    p.add_argument(
        "--vocab-texts",
        default="",
        help="comma list of training files (ShareGPT .json, Alpaca-style .jsonl) whose texts count for the draft "
        "vocabulary besides --responses (default: --responses alone)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads", type=positive_int, default=1, help="torch threads (default 1: runs beside benchmarks)"
    )
    p.add_argument("--work-dir", default=None, help="features + checkpoint (default: <out>.work), resumable")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm.auto import tqdm

    from hf_spec.bench.machine import machine_info
    from hf_spec.io.output_folder import check_output_folder, holds_model_type
    from hf_spec.methods.early_exit.card import model_card
    from hf_spec.methods.early_exit.exit_heads import ExitHeads
    from hf_spec.methods.early_exit.exit_heads_config import MODEL_TYPE
    from hf_spec.training.distributed import current_processes
    from hf_spec.training.exit_data import load_training_rows, tokenize_rows
    from hf_spec.training.exit_features import extract_cached
    from hf_spec.training.exits import evaluate_heads, timed, train_heads

    set_threads(args.threads)
    torch.manual_seed(args.seed)
    try:
        layers = sorted({int(x) for x in args.layers.split(",") if x.strip()})
        if not layers:
            raise ValueError
    except ValueError:
        print(f"--layers must be a comma list of integers, got {args.layers!r}", file=sys.stderr)
        return 2
    check_output_folder(args.out, holds_model_type(MODEL_TYPE), "exit-heads folder")  # before any work
    data = args.responses.format(target=Path(args.target).name)
    if not Path(data).is_file():
        print(f"no training data at {data} (pass --responses)", file=sys.stderr)
        return 2
    missing = [path for path in filter(None, args.vocab_texts.split(",")) if not Path(path).is_file()]
    if missing:
        print(f"--vocab-texts: no file {missing[0]}", file=sys.stderr)
        return 2
    model, tokenizer = load_target(args)
    heads = ExitHeads.for_target(model, layers, rank=args.rank, target_name=Path(args.target).name)
    work = Path(args.work_dir or f"{args.out.rstrip('/')}.work")

    rows = load_training_rows(data)
    if not 1 <= args.heldout < len(rows):
        raise ValueError(
            f"{data} holds {len(rows)} rows: --heldout {args.heldout} must leave rows on both sides "
            f"(1 <= heldout < {len(rows)})"
        )
    random.Random(args.seed).shuffle(rows)
    heldout = tokenize_rows(tokenizer, rows[: args.heldout], args.max_len)
    train = tokenize_rows(tokenizer, rows[args.heldout :], args.max_len)
    if not train or not heldout:
        side = "training" if not train else "held-out"
        raise ValueError(
            f"the {side} rows of {data} give no answer tokens to learn from (empty responses, or --max-len "
            f"{args.max_len} shorter than the prompts)"
        )
    vocab = model.get_output_embeddings().weight.shape[0]
    if args.topk > vocab:
        raise ValueError(f"--topk {args.topk} exceeds the target's vocabulary ({vocab} tokens)")
    kept, positions = [], 0
    for ids, start in train:
        if positions >= args.max_positions:
            break
        kept.append((ids, start))
        positions += ids.shape[0] - 1 - start

    processes = current_processes()
    bars = tqdm if processes.is_main else None
    extract = dict(layers=layers, top_k=args.topk, work_dir=work, progress=bars)
    # the main process extracts the features into the work folder, the others read them
    with processes.main_first():
        (train_feats, t_train), (held_feats, t_held) = (
            timed(extract_cached, model, kept, name="train", **extract),
            timed(extract_cached, model, heldout, name="heldout", **extract),
        )
    history, t_fit = timed(
        train_heads,
        model,
        heads,
        train_feats,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        negatives=args.negatives,
        checkpoint=work / "checkpoint.pt",
        progress=tqdm,
    )
    if not processes.is_main:  # one process measures and writes the folder
        return 0
    measured = evaluate_heads(model, heads, held_feats)
    coverage = None
    if args.draft_vocab:
        vocab = draft_vocabulary(tokenizer, rows[args.heldout :], args.vocab_texts, args.draft_vocab)
        heads.set_draft_vocab(vocab)
        coverage = float(torch.isin(held_feats.top_ids[:, 0], heads.draft_vocab).float().mean())
    command = args.command_line  # as given to `hf-spec` (set by hf_spec.cli.main)
    heads.config.training = {
        "data": data,
        "train_sequences": len(kept),
        "train_positions": len(train_feats),
        "heldout_sequences": len(heldout),
        "heldout_positions": min(len(held_feats), 2048),
        "top_k": args.topk,
        "negatives": args.negatives,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "seed": args.seed,
        "threads": args.threads,
        "num_processes": processes.world,
        "global_batch_positions": args.batch_size,  # per optimizer step, over all processes
        "first_loss": history[0] if history else float("nan"),
        "last_loss": sum(history[-20:]) / max(len(history[-20:]), 1),
        "extract_seconds": t_train + t_held,
        "train_seconds": t_fit,
        "machine": machine_info()["cpu"],
        "heldout": {str(k): v for k, v in measured.items()},
        "draft_vocab_coverage": coverage,
        "command": command,
    }
    heads.save_pretrained(args.out, card=model_card(heads, command))
    print("| layer | stock agreement | trained agreement |")
    for k, m in measured.items():
        print(f"| {k} | {m['stock_agreement']:.3f} | {m['agreement']:.3f} |")
    print(f"wrote {args.out}")
    return 0


def draft_vocabulary(tokenizer, rows: list[dict], vocab_texts: str, size: int):
    """The `size` most frequent tokens of the response cache and the `vocab_texts` files, plus special tokens."""
    from hf_spec.training.exit_data import frequent_tokens, vocabulary_texts

    texts = [r["prompt"] + r["response"] for r in rows]
    for path in filter(None, vocab_texts.split(",")):
        if not Path(path).is_file():
            raise FileNotFoundError(f"--vocab-texts: no file {path}")
        texts += vocabulary_texts(path)
    ids = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    return frequent_tokens(ids, size, always=list(tokenizer.all_special_ids))
