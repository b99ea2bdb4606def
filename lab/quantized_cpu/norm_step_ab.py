"""The Qwen GGUF target's decoding step with `FusedRMSNorm` and with transformers' `Qwen2RMSNorm`, alternated 8
times in one process.

    python lab/quantized_cpu/norm_step_ab.py
"""

import statistics
import sys

import torch

ROOT = str(__import__("pathlib").Path(__file__).resolve().parents[2])
sys.path.insert(0, ROOT)
sys.path.insert(0, ROOT + "/lab")
from decode_step_costs import PROMPT, step_cost  # noqa: E402
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm  # noqa: E402

from hf_spec.models.fetch import load_model  # noqa: E402
from hf_spec.models.quant_modules import FusedRMSNorm  # noqa: E402

torch.set_num_threads(2)
model, tok = load_model("qwen2.5-coder-0.5b-instruct", dtype=torch.bfloat16, quantize="gguf")
ids = tok(PROMPT, return_tensors="pt").input_ids
fused = {n: m for n, m in model.named_modules() if isinstance(m, FusedRMSNorm)}
plain = {}
for n, m in fused.items():
    p = Qwen2RMSNorm(m.weight.shape[0], eps=m.variance_epsilon)
    p.weight = m.weight
    plain[n] = p


def use(mods):
    for n, m in mods.items():
        parent, _, child = n.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, m)


res = {"plain": [], "fused": []}
for r in range(8):
    for name, mods in (
        (("plain", plain), ("fused", fused)) if r % 2 == 0 else (("fused", fused), ("plain", plain))
    ):
        use(mods)
        res[name].append(1e3 * step_cost(model, ids, 3))
    print(r, {k: round(v[-1], 1) for k, v in res.items()}, flush=True)
print(
    {k: round(statistics.median(v), 1) for k, v in res.items()},
    "paired diffs",
    sorted(round(a - b, 1) for a, b in zip(res["plain"], res["fused"], strict=False)),
)
