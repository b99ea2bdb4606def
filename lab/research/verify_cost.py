"""Cost of one target forward of k new tokens after a 200-token cache, stock vs hf-spec's verification
kernels (`fast_linears`), those with hf-spec's attention (`grouped_attention`, as in its loop), and (float32) with
the greedy loop's int8-screened LM head, x in fp32 or (AVX512-VNNI) quantized too (`HF_SPEC_SCREEN_INT8_X`), in
float32 and bfloat16.
Usage: python lab/research/verify_cost.py [--target NAME] [--threads N] [--dtypes float32,bfloat16]"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from unittest import mock

import torch
from transformers import DynamicCache

from hf_spec.engine.target.cache import crop_cache
from hf_spec.kernels.grouped_attention import grouped_attention
from hf_spec.kernels.screened_head import int8_x_applies, screened_lm_head, screening_applies
from hf_spec.kernels.skinny_linear import fast_linears
from hf_spec.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--past", type=int, default=200)
    ap.add_argument("--dtypes", default="float32", help="comma list: float32, bfloat16")
    ap.add_argument(
        "--text",
        default="../shared/data/eval/spec_bench_dev.jsonl",
        help="prompts (.jsonl): the cache and the k tokens are real text; 'random': random token ids",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for dtype in args.dtypes.split(","):
        print(f"\n{args.target}, {dtype}, {args.past} cached tokens, median of 5 (ms)\n")
        model, tok = load_model(args.target, dtype=getattr(torch, dtype))
        measure(model, args.past, _text_ids(tok, args.text, args.past + 40))


def _text_ids(tok, path: str, n: int) -> torch.Tensor | None:
    """n token ids of the prompts in `path` run together (None: random ids)."""
    if path == "random":
        return None
    from hf_spec.bench.runner import load_prompts

    text = "\n\n".join(p.turns[0] for p in load_prompts(path))
    return tok(text, return_tensors="pt").input_ids[0, :n]


def measure(model, past: int, text: torch.Tensor | None = None) -> None:
    """In bfloat16 the second column is the kernel's AVX512-BF16 path for 1..`bf16_kernel_rows()` rows
    (`HF_SPEC_BF16_KERNEL=0/1` forces none / 1-20), else torch's, or `(W @ x.T).T` for 2-32 rows where
    `mm_trick_pays` (`HF_SPEC_MM_TRICK=0/1`)."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        ids = torch.randint(100, 10000, (1, past)) if text is None else text[None, :past]
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        setups = [
            ("stock", False, None),
            ("hf-spec kernels", True, None),
            ("+ grouped attention", True, "ga"),
        ]
        if screening_applies(model, False, False, False):
            setups.append(("+ screened head, fp32 x", True, "0"))
            if int8_x_applies():
                setups.append(("+ screened head, int8 x", True, "1"))
        print("| k | " + " | ".join(f"{name} ms" for name, _, _ in setups) + " |")
        print("|---" * (len(setups) + 1) + "|")
        for k in (1, 2, 3, 4, 6, 9, 13, 17, 25, 33):
            row = []
            for _, fast, int8_x in setups:
                times = []
                for _ in range(6):
                    x = torch.randint(100, 10000, (1, k)) if text is None else text[None, past : past + k]
                    start = time.perf_counter()
                    with _screen(model, int8_x), fast_linears(model, fast):
                        pos = torch.arange(past, past + k)[None]
                        model(input_ids=x, position_ids=pos, past_key_values=cache, use_cache=True)
                    times.append(time.perf_counter() - start)
                    crop_cache(cache, past)
                row.append(statistics.median(times[1:]) * 1000)
            print(f"| {k} | " + " | ".join(f"{t:.1f}" for t in row) + " |")


@contextlib.contextmanager
def _screen(model, int8_x: str | None):
    """The screened LM head with x quantized ("1") or not ("0"); None: the model's own head; "ga": the model's own
    head, attention by `grouped_attention` (as in hf-spec's loop)."""
    if int8_x is None:
        yield
        return
    if int8_x == "ga":
        with grouped_attention(model):
            yield
        return
    with mock.patch.dict(os.environ, {"HF_SPEC_SCREEN_INT8_X": int8_x}), screened_lm_head(model):
        yield


if __name__ == "__main__":
    main()
