"""The LM head alone on a target's real final hidden states: the fp32 head against the int8 screen with x in fp32
and (AVX512-VNNI) in two int8 levels, for 1-32 rows; also checks every screened argmax against the fp32 head's.
Usage: python benchmarks/screen_cost.py [--target NAME] [--threads N] [--text PROMPTS.jsonl | random]"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from hf_spec.bench.runner import load_prompts
from hf_spec.kernels import cpu_skinny_gemm
from hf_spec.kernels.screened_head import Int8Screen
from hf_spec.kernels.skinny_linear import skinny_linear
from hf_spec.models import load_model

ROWS = (1, 2, 3, 4, 6, 8, 10, 13, 16, 24, 32)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--text", default="../shared/data/eval/spec_bench_dev.jsonl")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.target, dtype=torch.float32)
    if args.text == "random":
        ids = torch.randint(100, 10000, (1, 400))
    else:
        ids = tok("\n\n".join(p.turns[0] for p in load_prompts(args.text)), return_tensors="pt").input_ids[
            :, :600
        ]
    with torch.no_grad():
        hidden = (
            model(ids, output_hidden_states=True).hidden_states[-1][0, 8:].contiguous()
        )  # past the first tokens
    weight = model.get_output_embeddings().weight.detach()
    screen = Int8Screen.from_weight(weight)
    paths = {"fp32 x": "0"} | ({"int8 x": "1"} if cpu_skinny_gemm.has_vnni() else {})
    print(f"\n{args.target}, {len(hidden)} final hidden states ({args.text}), ms (median of 7)\n")
    print("| rows | fp32 head | " + " | ".join(f"screen, {p} | candidates" for p in paths) + " |")
    print("|---" * (2 + 2 * len(paths)) + "|")
    for rows in ROWS:
        x = hidden[100 : 100 + rows].contiguous()
        cells = [f"{_ms(lambda x=x: skinny_linear(x, weight)):.1f}"]
        for flag in paths.values():
            os.environ["HF_SPEC_SCREEN_INT8_X"] = flag
            if screen.top1_logits(x) is None:
                cells += ["-", "-"]
                continue
            counts = []
            for start in range(0, len(hidden) - rows, max(rows, 9)):
                xs = hidden[start : start + rows].contiguous()
                assert torch.equal(screen.top1_logits(xs).argmax(-1), skinny_linear(xs, weight).argmax(-1))
                counts.append(len(screen.candidates(xs)))
            cells += [f"{_ms(lambda x=x: screen.top1_logits(x)):.1f}", f"{statistics.mean(counts):.0f}"]
        print(f"| {rows} | " + " | ".join(cells) + " |")
    os.environ.pop("HF_SPEC_SCREEN_INT8_X", None)
    print("\nevery screened argmax equal to the fp32 head's")


def _ms(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


if __name__ == "__main__":
    main()
