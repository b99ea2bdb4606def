"""The Qwen GGUF target's compiled decoding step (static cache, bfloat16, 2 threads) with the quantized linear's
operator on its C++ CPU kernel (`hf_spec::group_quant_linear`, as loaded) and on the same function in Python
(`hf_spec::group_quant_linear_py`, swapped in before the second compile), alternated 6 times in one process after
both compiles; also whether both made the same tokens.

    python lab/quantized_cpu/operator_step_ab.py
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from transformers import StaticCache  # noqa: E402

from hf_spec.kernels import group_quant  # noqa: E402
from hf_spec.models.fetch import load_model  # noqa: E402

torch.set_num_threads(2)
torch.set_grad_enabled(False)
model, tok = load_model("qwen2.5-coder-0.5b-instruct", dtype=torch.bfloat16, quantize="gguf")
ids = tok("Write a Python function that reverses a string.", return_tensors="pt").input_ids
length = ids.shape[1]
cache = StaticCache(config=model.config, max_cache_len=256)


def forward_cpp(tokens, positions):
    return model(tokens, past_key_values=cache, cache_position=positions, use_cache=True).logits


def forward_python(tokens, positions):  # a second function: its own compiled graph
    return model(tokens, past_key_values=cache, cache_position=positions, use_cache=True).logits


def steps(fn, n: int = 20) -> tuple[float, list[int]]:
    """ms a decoding step over n greedy steps after the prompt, and the tokens."""
    cache.reset()
    nxt = fn(ids, torch.arange(length)).argmax(-1)[:, -1:]
    tokens = []
    t0 = time.perf_counter()
    for i in range(n):
        nxt = fn(nxt, torch.tensor([length + i])).argmax(-1)[:, -1:]
        tokens.append(int(nxt))
    return 1e3 * (time.perf_counter() - t0) / n, tokens


cpp = torch.compile(forward_cpp, dynamic=False)
steps(cpp, 2)
operator = group_quant.group_quant_linear
group_quant.group_quant_linear = group_quant.group_quant_linear_py  # what quantized_linear traces into
python = torch.compile(forward_python, dynamic=False)
steps(python, 2)
group_quant.group_quant_linear = operator
sides = {"C++ operator": cpp, "Python operator": python}
ms: dict[str, list[float]] = {k: [] for k in sides}
tokens: dict[str, list[int]] = {}
for r in range(6):
    for name, fn in list(sides.items())[:: 1 if r % 2 == 0 else -1]:
        t, tokens[name] = steps(fn)
        ms[name].append(t)
    print({k: round(v[-1], 1) for k, v in ms.items()}, flush=True)
same = tokens["C++ operator"] == tokens["Python operator"]
print("median ms a step:", {k: round(statistics.median(v), 1) for k, v in ms.items()}, "same tokens:", same)
