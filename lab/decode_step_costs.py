"""Where a decoding step of a `--quantize gguf` target goes: its linears per GGUF format at 1 and 2 threads, the
whole step, and the step with every linear replaced by an empty output (what transformers' modules and attention
cost around them); with `--llama-python`, llama.cpp's decoding step on the same GGUF in the same run.

    python lab/decode_step_costs.py --target qwen2.5-coder-0.5b-instruct [--llama-python ../peers/llama/bin/python]

Each figure is the median of `--repeats` passes (the machine's other work moves single passes by 10% or more):
a pass calls every linear of the model once with a one-row bfloat16 input (weights streamed from memory, as a
step reads them), or decodes 20 tokens after a short prompt (bfloat16, dynamic cache).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's hf_spec

from hf_spec.kernels.group_quant import kernel_group_linear  # noqa: E402
from hf_spec.models.fetch import load_model  # noqa: E402
from hf_spec.models.quant_modules import QuantizedLinear  # noqa: E402

PROMPT = "Write a Python function that reverses a string."
LLAMA = """
import sys, time
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_threads=int(sys.argv[2]), n_ctx=512, verbose=False)
prompt = llm.tokenize(sys.argv[3].encode())
for _ in range(int(sys.argv[4])):
    llm.reset(); llm.eval(prompt)
    t0 = time.perf_counter()
    for _ in range(20):
        llm.eval([llm.sample(temp=0)])
    print((time.perf_counter() - t0) / 20)
"""


def linear_costs(model, threads: int, repeats: int, rows: int = 1) -> dict[tuple, float]:
    """Seconds a pass over each format's linears takes with `rows` rows of x, median of `repeats`, at `threads`
    threads."""
    torch.set_num_threads(threads)
    groups: dict[tuple, list] = defaultdict(list)
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            groups[(m.scheme, m.in_features, m.out_features)].append(m)
    out = {}
    for key, mods in sorted(groups.items()):
        x = torch.randn(rows, key[1]).to(torch.bfloat16)
        bias = [None if m.bias is None else m.bias.float() for m in mods]
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            for m, b in zip(mods, bias, strict=True):
                kernel_group_linear(x, m.packed, b)
            times.append(time.perf_counter() - t0)
        out[key] = (len(mods), sum(m.packed.nbytes for m in mods), statistics.median(times[1:]))
    return out


def step_cost(model, ids, repeats: int) -> float:
    """Seconds a decoding step takes, median of `repeats` passes of 20 steps."""
    from transformers import DynamicCache

    times = []
    with torch.no_grad():
        for _ in range(repeats + 1):
            cache = DynamicCache()
            nxt = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            t0 = time.perf_counter()
            for _ in range(20):
                nxt = model(nxt, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            times.append((time.perf_counter() - t0) / 20)
    return statistics.median(times[1:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--llama-python", default=None, help="the Python of the llama.cpp side environment")
    args = p.parse_args()
    model, tok = load_model(args.target, dtype=torch.bfloat16, quantize="gguf")
    ids = tok(PROMPT, return_tensors="pt").input_ids
    lines = [
        "| format, in x out | linears | MB | 1 thread (ms) | 2 threads (ms) | GB/s at 2 |",
        "|---|---|---|---|---|---|",
    ]
    one, two = linear_costs(model, 1, args.repeats), linear_costs(model, 2, args.repeats)
    for key, (count, nbytes, s1) in one.items():
        s2 = two[key][2]
        lines.append(f"| {key[0]}, {key[1]} x {key[2]} | {count} | {nbytes / 1e6:.1f} | {1e3 * s1:.2f} | "
                     f"{1e3 * s2:.2f} | {nbytes / s2 / 1e9:.1f} |")  # fmt: skip
    lines.append(f"| all | {sum(v[0] for v in one.values())} | {sum(v[1] for v in one.values()) / 1e6:.0f} | "
                 f"{1e3 * sum(v[2] for v in one.values()):.1f} | {1e3 * sum(v[2] for v in two.values()):.1f} | |")  # fmt: skip
    lines += [
        "",
        "| rows of x (a verification's tree + root), 2 threads | all linears (ms) | / one row |",
        "|---|---|---|",
    ]
    base = None
    for rows in (1, 2, 4, 8):
        total = sum(v[2] for v in linear_costs(model, 2, args.repeats, rows).values())
        base = base or total
        lines.append(f"| {rows} | {1e3 * total:.1f} | {total / base:.2f}x |")
    torch.set_num_threads(2)
    step = step_cost(model, ids, args.repeats)
    saved = {}
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            saved[m] = m.forward
            m.forward = (lambda mm: lambda x: x.new_zeros(*x.shape[:-1], mm.out_features))(m)
    empty = step_cost(model, ids, args.repeats)
    for m, f in saved.items():
        m.forward = f
    lines += ["", "| decoding step, 2 threads | ms |", "|---|---|", f"| whole step | {1e3 * step:.1f} |",
              f"| linears given empty outputs (the rest of the step) | {1e3 * empty:.1f} |"]  # fmt: skip
    if args.llama_python:
        from hf_spec.models.quantize import gguf_of_folder

        gguf = gguf_of_folder(model.config.name_or_path)
        for threads in (1, 2):
            run = subprocess.run([args.llama_python, "-c", LLAMA, str(gguf), str(threads), PROMPT, str(args.repeats)],
                                 capture_output=True, text=True, check=True)  # fmt: skip
            ms = 1e3 * statistics.median(float(v) for v in run.stdout.split())
            lines.append(
                f"| llama.cpp's whole step, {threads} thread{'s' if threads > 1 else ''} | {ms:.1f} |"
            )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
