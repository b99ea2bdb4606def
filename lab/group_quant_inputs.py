"""Float32 inputs against int8 inputs on hf-spec's group-quantized kernel, per layout and number of rows.

For each layout a GGUF target uses (a 4864x896 Q5_0-like U5 weight with mins, 896x4864 Q4_K-like U4 with mins,
896x4864 Q6_K-like I8 in groups of 16) it makes 16 random weights, so that calling them in turn streams them from
memory as a decoding step does, and times `kernel_group_linear` with and without `int8_activations`, alternated,
keeping the better of two passes. With one thread it reads the thread's CPU time (less disturbed by other work on
the machine), with more the wall clock.

    python lab/group_quant_inputs.py --threads 1 --rows 1,4,8,16
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's hf_spec

from hf_spec.kernels.group_quant import CodeLayout, GroupQuantWeight, kernel_group_linear  # noqa: E402

SHAPES = {
    "Q5_0-like U5 4864x896": (CodeLayout.U5, 4864, 896, 32, True),
    "Q4_K-like U4 896x4864": (CodeLayout.U4, 896, 4864, 32, True),
    "Q6_K-like I8 896x4864": (CodeLayout.I8, 896, 4864, 16, False),
}


def random_weight(layout: CodeLayout, n: int, k: int, group: int, mins: bool) -> GroupQuantWeight:
    top = {CodeLayout.U4: 15, CodeLayout.U5: 31}.get(layout)
    codes = torch.randint(-127, 128, (n, k)) if top is None else torch.randint(0, top + 1, (n, k))
    scale = (torch.rand(n, k // group) * 0.01 + 0.001).to(torch.bfloat16).float()
    low = torch.randn(n, k // group) * 0.01 if mins else None
    return GroupQuantWeight.from_codes(codes, scale, low, layout, group)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", default="1,4,8,16")
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    for name, shape in SHAPES.items():
        floats = [random_weight(*shape) for _ in range(16)]
        ints = [dataclasses.replace(w, int8_activations=True) for w in floats]
        megabytes = floats[0].nbytes / 1e6
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, floats[0].in_features)
            best = {"float": float("inf"), "int8": float("inf")}
            for label, weights in (("float", floats), ("int8", ints)) * 2:
                start = clock()
                for _ in range(4):
                    for w in weights:
                        kernel_group_linear(x, w)
                best[label] = min(best[label], (clock() - start) / (4 * len(weights)) * 1e3)
            print(
                f"{name} ({megabytes:.1f} MB) rows {rows:2d}: float inputs {best['float']:.3f} ms, "
                f"int8 inputs {best['int8']:.3f} ms ({best['float'] / best['int8']:.2f}x)"
            )


if __name__ == "__main__":
    main()
