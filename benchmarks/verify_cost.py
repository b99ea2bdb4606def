"""Cost of one target forward of k new tokens after a 200-token cache, stock vs hf-spec's verification
kernels (`fast_linears`), in float32 and bfloat16.
Usage: python benchmarks/verify_cost.py [--target NAME] [--threads N] [--dtypes float32,bfloat16]"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from hf_spec.kernels.skinny_linear import fast_linears
from hf_spec.models import load_model
from hf_spec.verify.cache import crop_cache


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--past", type=int, default=200)
    ap.add_argument("--dtypes", default="float32", help="comma list: float32, bfloat16")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for dtype in args.dtypes.split(","):
        print(f"\n{args.target}, {dtype}, {args.past} cached tokens, median of 5 (ms)\n")
        measure(load_model(args.target, dtype=getattr(torch, dtype))[0], args.past)


def measure(model, past: int) -> None:
    """The C++ kernels are float32 only: in other dtypes the second column differs from stock only where
    `mm_trick_pays` routes 8-32 rows through `(W @ x.T).T` (`HF_SPEC_MM_TRICK=0/1` forces either)."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.randint(100, 10000, (1, past)), past_key_values=cache, use_cache=True)
        print("| k | stock ms | hf-spec kernels ms |\n|---|---|---|")
        for k in (1, 2, 3, 4, 6, 9, 13, 17, 25, 33):
            row = []
            for fast in (False, True):
                times = []
                for _ in range(6):
                    x = torch.randint(100, 10000, (1, k))
                    start = time.perf_counter()
                    with fast_linears(model, fast):
                        pos = torch.arange(past, past + k)[None]
                        model(input_ids=x, position_ids=pos, past_key_values=cache, use_cache=True)
                    times.append(time.perf_counter() - start)
                    crop_cache(cache, past)
                row.append(statistics.median(times[1:]) * 1000)
            print(f"| {k} | {row[0]:.1f} | {row[1]:.1f} |")


if __name__ == "__main__":
    main()
