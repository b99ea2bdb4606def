"""All linears of the Qwen GGUF target once each, in the tiled layouts the int8-input kernel reads (what `--quantize
gguf` loads) and in the row-major layouts they tile (`GroupQuantWeight.untiled()`), alternated in one process on one
build (the machine's speed drifts too much for two runs to compare): 1, 2, 3, 4 and 8 rows of bfloat16 x (decoding,
and verifications of 1-7 drafted tokens). Both compute the same weights on the same rounded x, in a different order
of float32 sums: the script checks they agree to float32 rounding.

    python lab/quantized_cpu/tiled_layout_ab.py [--repeats 6] [--threads 2] [--rows 1,2,3,4,8] [--by-format] [--isa 1]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hf_spec.kernels import cpu_skinny_gemm  # noqa: E402
from hf_spec.kernels.group_quant import kernel_group_linear  # noqa: E402
from hf_spec.models.fetch import load_model  # noqa: E402
from hf_spec.models.quant_modules import QuantizedLinear  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--rows", default="1,2,3,4,8")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--by-format", action="store_true", help="also a table per GGUF format and shape")
    p.add_argument("--isa", type=int, default=cpu_skinny_gemm.ISA_AUTO, help="1: AVX2 (-1: the CPU's best)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    if cpu_skinny_gemm.load_kernel() is None:
        raise SystemExit("hf-spec's C++ kernel did not build here")
    model, _ = load_model(args.target, dtype=torch.bfloat16, quantize="gguf")
    mods = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    tiled = [m.packed for m in mods]
    if not all(w.layout.is_tiled for w in tiled):
        raise SystemExit("some linears did not load tiled: this checkout predates the tiled layouts")
    row_major = [w.untiled() for w in tiled]
    kinds = [f"{m.scheme}, {m.in_features} x {m.out_features}" for m in mods]
    rows_list = [int(r) for r in args.rows.split(",")]
    totals, by_kind = {}, {}
    for rows in rows_list:
        xs = {k: torch.randn(rows, k).to(torch.bfloat16) for k in {w.in_features for w in tiled}}
        for a, b in zip(tiled, row_major, strict=True):
            ya = kernel_group_linear(xs[a.in_features], a, isa=args.isa).float()
            yb = kernel_group_linear(xs[b.in_features], b, isa=args.isa).float()
            scale = float(yb.abs().amax()) + 1e-6
            if float((ya - yb).abs().amax()) > 2e-2 * scale:  # bfloat16 outputs, rounded once each
                raise SystemExit("the tiled and row-major kernels disagree")
        seconds = {"row-major": [], "tiled": []}
        per = {(side, kind): [] for side in seconds for kind in set(kinds)}
        for _ in range(args.repeats):
            for side, weights in (("row-major", row_major), ("tiled", tiled)):
                each = dict.fromkeys(set(kinds), 0.0)
                t0 = time.perf_counter()
                for w, kind in zip(weights, kinds, strict=True):
                    t = time.perf_counter()
                    kernel_group_linear(xs[w.in_features], w, isa=args.isa)
                    each[kind] += time.perf_counter() - t
                seconds[side].append(time.perf_counter() - t0)
                for kind, s in each.items():
                    per[(side, kind)].append(s)
        totals[rows] = {side: statistics.median(v) * 1e3 for side, v in seconds.items()}
        by_kind[rows] = {key: statistics.median(v) * 1e3 for key, v in per.items()}
    isa = "the CPU's best ISA" if args.isa < 0 else f"ISA {args.isa}"
    print(
        f"{args.target} --quantize gguf, bfloat16 x, {args.threads} threads, {isa}, median of {args.repeats}\n"
    )
    print(
        "| rows of x | row-major (ms) | tiled (ms) | tiled / row-major | row-major / its 1 row | tiled / its 1 row |"
    )
    print("|---|---|---|---|---|---|")
    first = totals[rows_list[0]]
    for rows, t in totals.items():
        print(
            f"| {rows} | {t['row-major']:.1f} | {t['tiled']:.1f} | {t['tiled'] / t['row-major']:.2f} | "
            f"{t['row-major'] / first['row-major']:.2f}x | {t['tiled'] / first['tiled']:.2f}x |"
        )
    if args.by_format:
        print("\n| rows of x | format, in x out | row-major (ms) | tiled (ms) | tiled / row-major |")
        print("|---|---|---|---|---|")
        for rows, table in by_kind.items():
            for kind in sorted(set(kinds)):
                a, b = table[("row-major", kind)], table[("tiled", kind)]
                print(f"| {rows} | {kind} | {a:.2f} | {b:.2f} | {b / a:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
