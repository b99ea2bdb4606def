"""Would `torch.compile` pay for hf-spec's verification forwards on this CPU? One target forward of k new tokens
after a `--past`-token cache: stock eager, eager with hf-spec's kernels (`fast_linears`), and the stock forward
compiled by inductor (dynamic shapes). Compile time is printed apart; the same inputs feed every variant and the
compiled logits are compared with eager's.
Usage: python lab/research/compile_probe.py [--target NAME] [--threads N] [--past N] [--rows 1,4,8]"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from hf_spec.engine.target.cache import crop_cache
from hf_spec.kernels.skinny_linear import fast_linears
from hf_spec.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--past", type=int, default=300)
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.target, dtype=torch.float32)[0].eval()
    cache = DynamicCache(config=model.config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        model(input_ids=torch.randint(100, 10000, (1, args.past), generator=generator), past_key_values=cache)
    compiled = torch.compile(model.forward, dynamic=True)

    def forward(fn, ids: torch.Tensor, fast: bool) -> tuple[float, torch.Tensor]:
        pos = torch.arange(args.past, args.past + ids.shape[1])[None]
        start = time.perf_counter()
        with torch.no_grad(), fast_linears(model, fast):
            logits = fn(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True).logits
        seconds = time.perf_counter() - start
        crop_cache(cache, args.past)
        return seconds, logits

    rows = [int(k) for k in args.rows.split(",")]
    for k in rows:
        seconds, _ = forward(compiled, torch.randint(100, 10000, (1, k), generator=generator), False)
        print(f"first compiled call with {k} rows: {seconds:.1f} s", flush=True)
    print(
        f"\n{args.target}, float32, {args.past} cached tokens, {args.threads} threads, median of "
        f"{args.repeats} (ms)\n\n| k | eager stock | eager + hf-spec kernels | compiled stock | max abs logit diff |"
    )
    print("|---|---|---|---|---|")
    for k in rows:
        times: dict[str, list[float]] = {"eager": [], "kernels": [], "compiled": []}
        diff = 0.0
        for _ in range(args.repeats):
            ids = torch.randint(100, 10000, (1, k), generator=generator)
            t_eager, eager = forward(model.forward, ids, False)
            t_kernels, _ = forward(model.forward, ids, True)
            t_compiled, comp = forward(compiled, ids, False)
            for name, t in zip(times, (t_eager, t_kernels, t_compiled), strict=True):
                times[name].append(t * 1000)
            diff = max(diff, (eager - comp).abs().max().item())
        med = {name: statistics.median(v) for name, v in times.items()}
        print(
            f"| {k} | {med['eager']:.1f} | {med['kernels']:.1f} | {med['compiled']:.1f} | {diff:.2e} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
