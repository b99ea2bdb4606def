"""The Qwen GGUF target's decoding step (static cache, bfloat16, 2 threads) eager and under `torch.compile`
(inductor, static shapes), alternated 6 times in one process after the compile: whether compiling removes the
Python and dispatch cost around hf-spec's kernels. A third side runs the compiled step with the quantized-linear
operator's general path (a `GroupQuantWeight` built for each call) instead of its direct kernel call.
`--profile` instead runs `torch.profiler` over 20 compiled steps after the compile and prints the self CPU time per
operator and per inductor kernel, the top `--rows` rows: where a compiled step goes. `--operator` instead compares
the compiled step with hf-spec's operators on their C++ CPU kernels (`hf_spec::group_quant_linear`, `rms_norm`,
`rows_attention`, as loaded) and handing every call to the same functions in Python (`..._py`, which they do while
`HF_SPEC_NO_CPP_KERNELS` is set; the hand-on itself costs a little), alternated 6 times, and whether both made the
same tokens.

    python lab/quantized_cpu/compiled_step_ab.py [--profile [--rows 40] | --operator]
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from transformers import StaticCache  # noqa: E402

from hf_spec.kernels import group_quant  # noqa: E402
from hf_spec.models.fetch import load_model  # noqa: E402

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--profile", action="store_true", help="profile compiled steps instead of the A/B")
p.add_argument("--rows", type=int, default=40, help="rows of the profile's table")
p.add_argument("--operator", action="store_true", help="the operator's C++ kernel against its Python one")
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


tokens: list[int] = []  # the last `step_ms` call's


def step_ms(fn, steps: int = 20) -> float:
    cache.reset()
    tokens.clear()
    nxt = fn(ids, torch.arange(length)).argmax(-1)[:, -1:]
    t0 = time.perf_counter()
    for i in range(steps):
        nxt = fn(nxt, torch.tensor([length + i])).argmax(-1)[:, -1:]
        tokens.append(int(nxt))
    return 1e3 * (time.perf_counter() - t0) / steps


t0 = time.perf_counter()
step_ms(compiled, 2)
print(f"compile (prefill and decoding graphs): {time.perf_counter() - t0:.0f} s", flush=True)
if args.profile:
    print(f"step without the profiler: {step_ms(compiled):.1f} ms")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ms = step_ms(compiled)
    print(f"step under the profiler: {ms:.1f} ms (20 steps; times below are totals over them)")
    print(
        prof.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=70
        )
    )
    sys.exit(0)
if args.operator:
    # one compiled graph; the C++ kernel hands every call to the Python one while HF_SPEC_NO_CPP_KERNELS is set
    # (to "0": set but false, so the Python one still runs the kernel)
    sides = {"C++ operator": None, "Python operator": "0"}
    ms: dict[str, list[float]] = {k: [] for k in sides}
    made: dict[str, list[int]] = {}
    for r in range(6):
        for name, switch in list(sides.items())[:: 1 if r % 2 == 0 else -1]:
            if switch is None:
                os.environ.pop("HF_SPEC_NO_CPP_KERNELS", None)
            else:
                os.environ["HF_SPEC_NO_CPP_KERNELS"] = switch
            ms[name].append(step_ms(compiled))
            made[name] = list(tokens)
        print({k: round(v[-1], 1) for k, v in ms.items()}, flush=True)
    os.environ.pop("HF_SPEC_NO_CPP_KERNELS", None)
    same = made["C++ operator"] == made["Python operator"]
    print(
        "median ms a step:", {k: round(statistics.median(v), 1) for k, v in ms.items()}, "same tokens:", same
    )
    sys.exit(0)
direct_call = group_quant._kernel_call


def general_path(tokens, positions):
    group_quant._kernel_call = lambda *args: None
    try:
        return compiled(tokens, positions)
    finally:
        group_quant._kernel_call = direct_call


res = {"eager": [], "compiled": [], "compiled, general operator path": []}
for r in range(6):
    sides = (("eager", forward), ("compiled", compiled), ("compiled, general operator path", general_path))
    for name, fn in sides if r % 2 == 0 else sides[::-1]:
        res[name].append(step_ms(fn))
    print({k: round(v[-1], 1) for k, v in res.items()}, flush=True)
print("median ms:", {k: round(statistics.median(v), 1) for k, v in res.items()})
