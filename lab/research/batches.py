"""A left-padded batch of chat prompts: plain batched `generate` against hf-spec methods, which verify every row's
tree in one forward (`--batches batched`, `hf_spec.engine.batch`) or decode row by row (`rows`, `hf_spec.engine.rows`), side by
side in one process, with outputs compared to the batched ones.
Usage: python lab/research/batches.py [--target NAME] [--methods pld,talon,...] [--batches batched,rows]
           [--batch-size 4] [--max-new-tokens 64] [--threads 2] [--dtype float32]"""

from __future__ import annotations

import argparse
import json
import time

import torch

from hf_spec import SpeculativeDecoder
from hf_spec.bench.runner import compare_greedy
from hf_spec.kernels.skinny_linear import fast_linears
from hf_spec.models import load_model


def first_prompts(path: str, n: int) -> list[str]:
    """The first turn of the first prompt of each category, then the next ones, until n."""
    rows = [json.loads(line) for line in open(path) if line.strip()]
    firsts, rest, seen = [], [], set()
    for row in rows:
        (rest if row["category"] in seen else firsts).append(row["turns"][0])
        seen.add(row["category"])
    return (firsts + rest)[:n]


def new_tokens(out: torch.Tensor, width: int, eos: set[int]) -> int:
    """Generated tokens of a batch output, up to and including each row's EOS."""
    total = 0
    for row in out[:, width:].tolist():
        total += next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
    return total


def compare_rows(model, enc, ref: torch.Tensor, out: torch.Tensor, eos: set[int]) -> str:
    """`equal/rows`, plus how many rows departed at a numeric near-tie and how many did not (a bug)."""
    width, equal, ties, bad = enc.input_ids.shape[1], 0, 0, 0
    for r in range(ref.shape[0]):
        if torch.equal(out[r], ref[r]):
            equal += 1
            continue
        prompt = enc.input_ids[r : r + 1, enc.attention_mask[r].bool()]
        want, got = (t[r, width:].tolist() for t in (ref, out))
        cut = [next((i + 1 for i, t in enumerate(x) if t in eos), len(x)) for x in (want, got)]
        verdict = compare_greedy(model, prompt, want[: cut[0]], got[: cut[1]])
        ties += bool(verdict.get("near_tie"))
        bad += not verdict["lossless"] and not verdict.get("near_tie")
    return f"{equal}/{ref.shape[0]}" + (f" ({ties} near-tie, {bad} not)" if ties or bad else "")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--methods", default="pld", help="comma list of hf-spec method specs or config paths")
    ap.add_argument("--prompts", default="../shared/data/eval/spec_bench_dev.jsonl")
    ap.add_argument(
        "--batches", default="batched,rows", help="comma list of SpeculativeDecoder batches= modes"
    )
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.target, dtype=getattr(torch, args.dtype))
    texts = [
        tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
        for t in first_prompts(args.prompts, args.batch_size)
    ]
    enc = tok(texts, return_tensors="pt", padding=True)
    width = enc.input_ids.shape[1]
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])

    decoders = {}
    for spec in args.methods.split(","):
        for mode in args.batches.split(","):
            dec = SpeculativeDecoder(spec, tokenizer=tok, batches=mode)
            try:  # builds drafters and datastores before the clock runs
                model.generate(**enc, **{**kwargs, "max_new_tokens": 2}, custom_generate=dec)
            except ValueError as err:  # a drafter that cannot run in this mode
                print(f"skipped {spec} ({mode}): {err}")
                continue
            decoders[f"{spec} ({mode})"] = dec
    t0 = time.perf_counter()
    ref = model.generate(**enc, **kwargs)
    base = time.perf_counter() - t0
    n_ref = new_tokens(ref, width, eos)
    with fast_linears(model):  # plain batched decoding on hf-spec's linear kernels: their share of a speedup
        t0 = time.perf_counter()
        plain = model.generate(**enc, **kwargs)
        kernels = time.perf_counter() - t0
    # batches="plain": the same on hf-spec's linears and attention (one-row steps in bfloat16 / float16)
    t0 = time.perf_counter()
    plain_all = model.generate(**enc, **kwargs, custom_generate=SpeculativeDecoder("pld", batches="plain"))
    kernels_all = time.perf_counter() - t0
    print(
        f"{args.target}, {args.dtype}, batch {args.batch_size}, {args.max_new_tokens} new tokens, {args.threads} threads"
    )
    print(
        "\n| method | s | tok/s | speedup vs batched generate | tau | rows equal to batched |\n|---|---|---|---|---|---|"
    )
    print(f"| batched `generate` | {base:.1f} | {n_ref / base:.1f} | 1.00x | 1.00 | - |")
    same = compare_rows(model, enc, ref, plain, eos)
    print(
        f"| batched `generate` on hf-spec's linear kernels (no speculation) | {kernels:.1f} | {n_ref / kernels:.1f} | "
        f"{base / kernels:.2f}x | 1.00 | {same} |"
    )
    same = compare_rows(model, enc, ref, plain_all, eos)
    print(
        f'| `batches="plain"`: linears and attention on hf-spec\'s kernels | {kernels_all:.1f} | '
        f"{n_ref / kernels_all:.1f} | {base / kernels_all:.2f}x | 1.00 | {same} |"
    )
    for spec, dec in decoders.items():
        t0 = time.perf_counter()
        out = model.generate(**enc, **kwargs, custom_generate=dec)
        took = time.perf_counter() - t0
        same = compare_rows(model, enc, ref, out, eos)
        n = new_tokens(out, width, eos)
        tau = f"{dec.last_stats.tau:.2f}" if dec.last_stats is not None else "-"
        print(f"| `{spec}` | {took:.1f} | {n / took:.1f} | {base / took:.2f}x | {tau} | {same} |")


if __name__ == "__main__":
    main()
