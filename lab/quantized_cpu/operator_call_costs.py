"""The Qwen GGUF target's 168 layer linears called once each (one bfloat16 row): directly, through hf-spec's
operator (a library fragment), through the same function as a `torch.library.custom_op` (how the operator was
defined before), and through a fragment operator taking a weight handle
median of 7 passes, 3 rounds.

    python lab/quantized_cpu/operator_call_costs.py
"""

import sys
import time

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from hf_spec.kernels.group_quant import group_linear  # noqa: E402
from hf_spec.models.fetch import load_model  # noqa: E402
from hf_spec.models.quant_modules import QuantizedLinear  # noqa: E402

torch.set_num_threads(2)
model, tok = load_model("qwen2.5-coder-0.5b-instruct", dtype=torch.bfloat16, quantize="gguf")
mods = [m for m in model.modules() if isinstance(m, QuantizedLinear) and m.out_features != 151936]
REG = [m.packed for m in mods]
lib = torch.library.Library("hfx", "DEF")
lib.define("gq(Tensor x, Tensor? bias, int handle) -> Tensor")
lib.impl("gq", lambda x, b, h: group_linear(x, REG[h], b), "CPU")
x = {k: torch.randn(1, 1, k).bfloat16() for k in (896, 4864)}


def t(f):
    ts = []
    for _ in range(7):
        t0 = time.perf_counter()
        for i, m in enumerate(mods):
            f(i, m, x[m.in_features])
        ts.append(time.perf_counter() - t0)
    return round(1e3 * sorted(ts)[3], 1)


op = torch.ops.hf_spec.group_quant_linear
from hf_spec.kernels.group_quant import _group_quant_linear  # noqa: E402

old = torch.library.custom_op("hfx_old::group_quant_linear", _group_quant_linear, mutates_args=())


def W(m):
    return m.packed


for _ in range(3):
    print(
        "group_linear",
        t(lambda i, m, x: group_linear(x, m.packed, m.bias)),
        "fragment op",
        t(
            lambda i, m, x: op(
                x,
                W(m).codes,
                W(m).scale,
                W(m).min,
                W(m).high,
                m.bias,
                int(W(m).layout),
                W(m).group_size,
                W(m).int8_activations,
                W(m).zero_point,
            )
        ),
        "custom_op",
        t(
            lambda i, m, x: old(
                x,
                W(m).codes,
                W(m).scale,
                W(m).min,
                W(m).high,
                m.bias,
                int(W(m).layout),
                W(m).group_size,
                W(m).int8_activations,
                W(m).zero_point,
            )
        ),
        "handle op",
        t(lambda i, m, x: torch.ops.hfx.gq(x, m.bias, i)),
    )
