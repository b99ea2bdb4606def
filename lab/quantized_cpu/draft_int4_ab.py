"""int4 draft weights on torch's int4 kernel against hf-spec's int8-input kernel, at the Qwen EAGLE-3 head's shapes
(its fused input, attention, MLP and 16,384-row draft LM head), bfloat16 x, medians of alternated calls.

    python lab/quantized_cpu/draft_int4_ab.py --rows 1,4
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hf_spec.kernels.group_quant import group_linear  # noqa: E402
from hf_spec.kernels.weight_only import QuantizedWeight, tiles_run  # noqa: E402

# (out, in) of one step: fc, q, k, v, o, gate, up, down, draft LM head
SHAPES = [(896, 2688), (896, 896), (128, 896), (128, 896), (896, 896), (4864, 896), (4864, 896), (896, 4864),
          (16384, 896)]  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,4")
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not tiles_run():
        print("hf-spec's kernel does not build here: int4 drafts run torch's kernel only")
        return 1
    torch.manual_seed(0)
    weights = [torch.randn(out, inp, dtype=torch.bfloat16) * 0.02 for out, inp in SHAPES]
    torch_int4 = [QuantizedWeight.from_weight(w, "int4", group_size=64) for w in weights]
    hf_spec_int4 = [QuantizedWeight.from_weight(w, "int4") for w in weights]
    print(
        f"torch {torch.__version__}, {args.threads} threads, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n"
    )
    print(
        "| rows of x | torch's int4 kernel, groups of 64 (ms a step) | hf-spec's int8-input kernel, groups of 32 | ratio |"
    )
    print("|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(rows, inp, dtype=torch.bfloat16) for _, inp in SHAPES]
        times: dict[str, list[float]] = {"torch": [], "hf-spec": []}
        for _ in range(args.repeats):
            for name, packed in (("torch", torch_int4), ("hf-spec", hf_spec_int4)):
                t0 = time.perf_counter()
                for q, x in zip(packed, xs, strict=True):
                    q.linear(x)
                times[name].append(time.perf_counter() - t0)
        a, b = (statistics.median(times[k][10:]) * 1e3 for k in ("torch", "hf-spec"))
        print(f"| {rows} | {a:.3f} | {b:.3f} | {b / a:.2f} |")
    # the kernel computes its torch twin (x rounded to int8 per run of 32, the de-quantized weight)
    x = torch.randn(4, 896, dtype=torch.bfloat16)
    q = hf_spec_int4[1]
    err = (q.linear(x).float() - group_linear(x.float(), q.tiles)).abs().max().item()
    print(f"\nlargest difference from the float32 kernel on the same int8 x: {err:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
