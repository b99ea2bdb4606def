"""Where a compiled decoding step of the Qwen GGUF target goes (static cache, inductor, bfloat16, 2 threads):
`torch.profiler` over 20 steps after the compile, self CPU time per operator and per inductor kernel, the top rows.

    python lab/quantized_cpu/compiled_step_profile.py [--rows 40]
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from transformers import StaticCache  # noqa: E402

from hf_spec.models.fetch import load_model  # noqa: E402

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--rows", type=int, default=40)
p.add_argument("--steps", type=int, default=20)
args = p.parse_args()
torch.set_num_threads(2)
torch.set_grad_enabled(False)
model, tok = load_model("qwen2.5-coder-0.5b-instruct", dtype=torch.bfloat16, quantize="gguf")
ids = tok("Write a Python function that reverses a string.", return_tensors="pt").input_ids
length = ids.shape[1]
cache = StaticCache(config=model.config, max_cache_len=256)


def forward(tokens, positions):
    return model(tokens, past_key_values=cache, cache_position=positions, use_cache=True).logits


compiled = torch.compile(forward, dynamic=False)


def steps(n: int) -> float:
    cache.reset()
    nxt = compiled(ids, torch.arange(length)).argmax(-1)[:, -1:]
    t0 = time.perf_counter()
    for i in range(n):
        nxt = compiled(nxt, torch.tensor([length + i])).argmax(-1)[:, -1:]
    return 1e3 * (time.perf_counter() - t0) / n


steps(2)  # compiles
print(f"step without the profiler: {steps(args.steps):.1f} ms")
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    ms = steps(args.steps)
print(f"step under the profiler: {ms:.1f} ms ({args.steps} steps; times below are totals over them)")
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=70))
