"""The int8-screened LM head (`hf_spec/kernels/screened_head.py`) on a real target, two measurements:

1. `--head`: time of the target's LM head on k rows of real verification hidden states (its own greedy answers to
   Spec-Bench prompts): the fp32 (`--dtype bfloat16`: bf16) kernel against screening with x in fp32 and (AVX512-VNNI) in int8; candidates
   kept per block; argmax mismatches (must be 0).
2. `--method SPEC`: a same-process A/B of a method with screening on and off (`--switch HF_SPEC_SCREENED_HEAD`,
   the default) or with x in int8 and in fp32 (`--switch HF_SPEC_SCREEN_INT8_X`), alternating the order per
   prompt; total and verification seconds, and whether the two outputs are identical.

Usage: python lab/research/screened_head.py [--target NAME] [--head] [--method SPEC] [--switch VAR] [--prompts 13]
    [--max-new-tokens 128] [--threads 2] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from skinny_gemm_rows import median_seconds  # benchmarks/ is this script's folder

from hf_spec import SpeculativeDecoder
from hf_spec.core.specs import parse_method
from hf_spec.kernels import cpu_skinny_gemm
from hf_spec.kernels.screened_head import BF16_ROUNDING, Int8Screen, max_screened_rows
from hf_spec.models.fetch import load_model

PROMPTS = "../shared/data/eval/spec_bench_dev.jsonl"


def first_per_category(path: str, limit: int) -> list[dict]:
    seen, rows = set(), []
    for line in open(path):
        row = json.loads(line)
        if row["category"] not in seen:
            seen.add(row["category"])
            rows.append(row)
    return rows[:limit]


def encode(tokenizer, text: str) -> torch.Tensor:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt"
    )
    return ids["input_ids"] if hasattr(ids, "keys") else ids


@torch.no_grad()
def head_table(model, tokenizer, rows: list[dict], max_new_tokens: int) -> None:
    weight = model.get_output_embeddings().weight.detach()
    start = time.perf_counter()
    screen = Int8Screen.from_weight(weight)
    print(f"int8 screen built in {time.perf_counter() - start:.2f} s")
    hidden = []
    for row in rows:
        ids = encode(tokenizer, row["turns"][0])
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        h = model.model(out).last_hidden_state[0]
        hidden.append(h[ids.shape[1] - 1 :])  # the answer's positions: what verification sees
    paths = {"fp32 x": "0"} | ({"int8 x": "1"} if cpu_skinny_gemm.has_vnni() else {})
    cells = " | ".join(f"{p}: screened ms | candidates median / max | argmax mismatches" for p in paths)
    dtype = weight.dtype
    kernel = cpu_skinny_gemm.kernel_linear if dtype == torch.float32 else cpu_skinny_gemm.kernel_linear_bf16
    rounding = BF16_ROUNDING if dtype == torch.bfloat16 else 0.0
    print(f"| rows | {str(dtype)[6:]} kernel ms | {cells} |\n" + "|---" * (2 + 3 * len(paths)) + "|")
    for k in (1, 2, 3, 4, 6, 8, 13, 20, 24, 32):
        x = hidden[0][:k].contiguous()
        row = [f"{median_seconds(lambda x=x: kernel(x, weight), 9) * 1e3:.1f}"]
        for flag in paths.values():
            os.environ["HF_SPEC_SCREEN_INT8_X"] = flag
            if k > max_screened_rows(dtype=dtype):
                row += ["-", "-", "-"]
                continue
            counts, mismatches = [], 0
            for h in hidden:
                for s in range(0, h.shape[0] - k + 1, k):
                    xs = h[s : s + k].contiguous()
                    counts.append(len(screen.candidates(xs.float(), rounding)))
                    full = kernel(xs, weight)
                    mismatches += int((screen.top1_logits(xs).argmax(-1) != full.argmax(-1)).sum())
            screened_ms = median_seconds(lambda x=x: screen.top1_logits(x), 9) * 1e3
            row += [f"{screened_ms:.1f}", f"{statistics.median(counts):.0f} / {max(counts)}", str(mismatches)]
        print(f"| {k} | " + " | ".join(row) + " |")
    os.environ.pop("HF_SPEC_SCREEN_INT8_X", None)


def _set(switch: str, flag: str | None) -> None:
    """Set (None: unset) the environment variable `switch`; "none" sets nothing (both runs alike: run-to-run noise)."""
    if switch == "none":
        return
    if flag is None:
        os.environ.pop(switch, None)
    else:
        os.environ[switch] = flag


def method_ab(
    model, tokenizer, rows: list[dict], spec: str, max_new_tokens: int, switch: str = "HF_SPEC_SCREENED_HEAD"
) -> None:
    """Generate with `switch` set to "1" (on) and "0" (off), alternating which goes first."""
    decoder = SpeculativeDecoder(parse_method(spec), tokenizer=tokenizer)
    warm = encode(tokenizer, rows[0]["turns"][0])
    for flag in ("1", "0"):
        _set(switch, flag)
        model.generate(warm, max_new_tokens=16, do_sample=False, custom_generate=decoder)
    total = {"1": 0.0, "0": 0.0}
    verify = {"1": 0.0, "0": 0.0}
    different = 0
    for i, row in enumerate(rows):
        ids = encode(tokenizer, row["turns"][0])
        outs = {}
        for flag in ("1", "0") if i % 2 else ("0", "1"):
            _set(switch, flag)
            start = time.perf_counter()
            outs[flag] = model.generate(
                ids, max_new_tokens=max_new_tokens, do_sample=False, custom_generate=decoder
            )
            total[flag] += time.perf_counter() - start
            verify[flag] += decoder.last_stats.time_verify
        different += int(not torch.equal(outs["1"], outs["0"]))
        print(
            f"{row['category']}: {switch}=1 {total['1']:.1f} s (verify {verify['1']:.1f}), "
            f"=0 {total['0']:.1f} s (verify {verify['0']:.1f})",
            flush=True,
        )
    _set(switch, None)
    print(
        f"{spec}: time {switch}=1 / =0 {total['1'] / total['0']:.3f}, verification "
        f"{verify['1'] / verify['0']:.3f}; outputs that differ: {different} of {len(rows)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--head", action="store_true", help="time the LM head alone on real hidden states")
    parser.add_argument("--method", help="A/B this method with `--switch` on and off")
    parser.add_argument(
        "--switch",
        default="HF_SPEC_SCREENED_HEAD",
        choices=(
            "HF_SPEC_SCREENED_HEAD",
            "HF_SPEC_SCREEN_INT8_X",
            "HF_SPEC_BF16_KERNEL",
            "HF_SPEC_GROUPED_ATTENTION",
            "none",
        ),
        help="screening on/off, x in int8/fp32, the bf16 kernel on/off, hf-spec's attention on/off, or none (the "
        "same settings twice)",
    )
    parser.add_argument(
        "--prompts", type=int, default=13, help="first prompt of each category, up to this many"
    )
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.target, dtype=getattr(torch, args.dtype))
    rows = first_per_category(PROMPTS, args.prompts)
    if args.head:
        head_table(model, tokenizer, rows, min(args.max_new_tokens, 48))
    if args.method:
        method_ab(model, tokenizer, rows, args.method, args.max_new_tokens, args.switch)


if __name__ == "__main__":
    main()
