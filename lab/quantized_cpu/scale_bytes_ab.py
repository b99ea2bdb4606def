"""What the bytes of a GGUF target's scales and mins cost: the Qwen GGUF target's 169 linears once each, with their
weights as loaded (Q8_0 / Q4_0 / Q5_0 scales in float16, Q4_0 / Q5_0 mins as a zero point), with those scales
widened to float32, and with the mins stored as float32 too (as the kernel read them before), alternated 8 times in
one process, 2 threads, 1 and 4 bfloat16 rows. Also checks that all three give the same bits.

    python lab/quantized_cpu/scale_bytes_ab.py
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from hf_spec.kernels.group_quant import kernel_group_linear  # noqa: E402
from hf_spec.kernels.group_quant_weight import GroupQuantWeight  # noqa: E402
from hf_spec.models.fetch import load_model  # noqa: E402
from hf_spec.models.quant_modules import QuantizedLinear  # noqa: E402

torch.set_num_threads(2)
torch.set_grad_enabled(False)
model, _ = load_model("qwen2.5-coder-0.5b-instruct", dtype=torch.bfloat16, quantize="gguf")
loaded = [m.packed for m in model.modules() if isinstance(m, QuantizedLinear)]


def float32_scales(w: GroupQuantWeight, stored_min: bool = False) -> GroupQuantWeight:
    scale = w.scale.float()
    mins, zero_point = (w.mins().contiguous(), 0) if stored_min and w.zero_point else (w.min, w.zero_point)
    return GroupQuantWeight(
        w.codes, scale, mins, w.high, w.layout, w.group_size, w.in_features, w.int8_activations, zero_point
    )


sides = {
    "as loaded": loaded,
    "float32 scales": [float32_scales(w) for w in loaded],
    "float32 scales and mins": [float32_scales(w, stored_min=True) for w in loaded],
}
print("MB:", {k: round(sum(w.nbytes for w in ws) / 1e6) for k, ws in sides.items()})
for rows in (1, 4):
    xs = {k: torch.randn(rows, k).to(torch.bfloat16) for k in {w.in_features for w in loaded}}
    outs = {k: [kernel_group_linear(xs[w.in_features], w) for w in ws] for k, ws in sides.items()}
    same = all(
        all(torch.equal(a, b) for a, b in zip(o, outs["as loaded"], strict=True)) for o in outs.values()
    )
    times: dict[str, list[float]] = {k: [] for k in sides}
    for r in range(8):
        for name, ws in list(sides.items())[:: 1 if r % 2 == 0 else -1]:
            t0 = time.perf_counter()
            for w in ws:
                kernel_group_linear(xs[w.in_features], w)
            times[name].append(time.perf_counter() - t0)
    medians = {k: round(1e3 * statistics.median(v), 2) for k, v in times.items()}
    print(f"{rows} rows, all linears (ms, median of 8): {medians}; same bits: {same}", flush=True)
