"""What the Python around the Qwen GGUF target's linears costs an eager decoding step: its 169 `QuantizedLinear`
modules called once each (one bfloat16 row), the same linears through `group_linear` (no module call), and the
kernel calls alone, made straight from a list of prepared arguments (outputs and float32 biases made beforehand),
alternated in one process, 2 threads.

    python lab/quantized_cpu/linear_call_overhead.py [--repeats 10]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from hf_spec.kernels import cpu_skinny_gemm  # noqa: E402
from hf_spec.kernels.group_quant import group_linear  # noqa: E402
from hf_spec.models.fetch import load_model  # noqa: E402
from hf_spec.models.quant_modules import QuantizedLinear  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    torch.set_num_threads(2)
    torch.set_grad_enabled(False)
    model, _ = load_model("qwen2.5-coder-0.5b-instruct", dtype=torch.bfloat16, quantize="gguf")
    mods = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    xs = {k: torch.randn(1, k).to(torch.bfloat16) for k in {m.in_features for m in mods}}
    kernel = cpu_skinny_gemm.load_kernel()
    calls, keep = [], []  # keep: the outputs and biases the prepared pointers point into
    for m in mods:
        # (codes, high, scale, min) addresses, out, in, layout, group, int8 x, zero point, float16 scales
        plan = m.packed.kernel_plan()
        ptrs, n, layout, group, int8_x, zero_point, f16 = plan[:4], plan[4], *plan[6:]
        y = torch.empty(1, n, dtype=torch.bfloat16)
        bias = None if m.bias is None else m.bias.float()
        keep.append((y, bias))
        gemm = kernel.gemm_gq_q8 if int8_x else kernel.gemm_gq
        x = xs[m.in_features]
        calls.append((gemm, (x.data_ptr(), *ptrs, 0 if bias is None else bias.data_ptr(), y.data_ptr(), 1, n,
                             m.in_features, layout, group, cpu_skinny_gemm.ISA_AUTO, True, True, zero_point, f16)))  # fmt: skip

    def direct() -> float:
        t0 = time.perf_counter()
        for gemm, call in calls:
            gemm(*call)
        return 1e3 * (time.perf_counter() - t0)

    def modules() -> float:
        t0 = time.perf_counter()
        for m in mods:
            m(xs[m.in_features])
        return 1e3 * (time.perf_counter() - t0)

    def python_path() -> float:
        t0 = time.perf_counter()
        for m in mods:
            group_linear(xs[m.in_features], m.packed, m.bias)
        return 1e3 * (time.perf_counter() - t0)

    res = {"kernel calls alone": [], "QuantizedLinear modules": [], "group_linear": []}
    for rep in range(args.repeats):
        sides = (
            ("kernel calls alone", direct),
            ("QuantizedLinear modules", modules),
            ("group_linear", python_path),
        )
        for name, fn in sides if rep % 2 == 0 else sides[::-1]:
            res[name].append(fn())
    med = {k: statistics.median(v) for k, v in res.items()}
    print(", ".join(f"{k}: {v:.1f} ms" for k, v in med.items()))
    for side in ("QuantizedLinear modules", "group_linear"):
        per_call = (med[side] - med["kernel calls alone"]) * 1e3 / len(mods)
        print(f"{side}: {per_call:.0f} us a linear more than the kernel call alone ({len(mods)} linears)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
