"""All linears of the Qwen GGUF target (or with `--quantize int8|int4`, the int8 / int4 target hf-spec makes at
load, on the float-input kernel) once each, on hf-spec's C++ kernel built from an earlier commit's sources
and from the checkout's, alternated in one process (the machine's speed drifts too much for two runs to compare):
1, 2, 4 and 8 rows of bfloat16 x (decoding, and verifications of 1-7 drafted tokens). Also checks that both builds
give the same bits.

    python lab/quantized_cpu/kernel_build_ab.py --base e7676f0~1 [--repeats 6] [--threads 1] [--by-format] [--quantize int4]

Both builds are called with the checkout's arguments: a base before 59a8255 (where the group-quantized kernel took
its zero point and float16 scales) cannot be called by a later checkout, and one before 8337bf1 reads no tiled
layout (`--row-major` gives both builds the row-major weights the target's tiled ones come from).
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hf_spec.kernels import cpu_skinny_gemm as csg  # noqa: E402
from hf_spec.kernels.group_quant import kernel_group_linear  # noqa: E402
from hf_spec.models.fetch import load_model  # noqa: E402
from hf_spec.models.quant_modules import QuantizedLinear  # noqa: E402


def build(csrc: Path):
    """The kernel module built from the sources in `csrc`."""
    saved = csg.CSRC
    csg.CSRC, csg._tried, csg._module = csrc, False, None
    try:
        return csg.load_kernel()
    finally:
        csg.CSRC = saved


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the commit whose hf_spec/csrc is the A side")
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--rows", default="1,2,4,8")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--isa", type=int, default=csg.ISA_AUTO, help="1: AVX2 (-1: the CPU's best)")
    p.add_argument("--by-format", action="store_true", help="also a table per GGUF format and shape")
    p.add_argument("--row-major", action="store_true", help="the weights untiled (for bases without tiles)")
    p.add_argument(
        "--quantize", default="gguf", choices=("gguf", "int8", "int4"), help="the target's weights"
    )
    args = p.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    with tempfile.TemporaryDirectory() as tmp:
        names = subprocess.run(["git", "ls-tree", "--name-only", args.base, "hf_spec/csrc/"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
        for name in names:
            blob = subprocess.run(
                ["git", "show", f"{args.base}:{name}"], cwd=ROOT, capture_output=True, check=True
            )
            (Path(tmp) / Path(name).name).write_bytes(blob.stdout)
        base = build(Path(tmp))
    head = build(csg.CSRC)
    model, _ = load_model("qwen2.5-coder-0.5b-instruct", dtype=torch.bfloat16, quantize=args.quantize)
    mods = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    bias = {m: None if m.bias is None else m.bias.float() for m in mods}
    weight = {m: m.packed.untiled() if args.row_major else m.packed for m in mods}
    xs = {
        (r, k): torch.randn(r, k).to(torch.bfloat16) for r in rows_list for k in {m.in_features for m in mods}
    }

    def outputs(module, rows):
        csg._module = module
        return [
            kernel_group_linear(xs[(rows, m.in_features)], weight[m], bias[m], isa=args.isa) for m in mods
        ]

    def seconds(module, rows):
        csg._module = module
        t0 = time.perf_counter()
        for m in mods:
            kernel_group_linear(xs[(rows, m.in_features)], weight[m], bias[m], isa=args.isa)
        return time.perf_counter() - t0

    def format_of(m) -> str:
        return f"{m.scheme}, {m.in_features} x {m.out_features}"

    by_format = {}
    for m in mods:
        by_format.setdefault(format_of(m), []).append(m)

    def seconds_by_format(module, rows):
        csg._module = module
        out = {}
        for name, group in by_format.items():
            t0 = time.perf_counter()
            for m in group:
                kernel_group_linear(xs[(rows, m.in_features)], weight[m], bias[m], isa=args.isa)
            out[name] = time.perf_counter() - t0
        return out

    for rows in rows_list:
        same = all(torch.equal(a, b) for a, b in zip(outputs(base, rows), outputs(head, rows), strict=True))
        print(f"{rows} rows: same bits in both builds: {same}")
    times = {(side, r): [] for side in ("base", "head") for r in rows_list}
    formats = {(side, r, f): [] for side in ("base", "head") for r in rows_list for f in by_format}
    for rep in range(args.repeats):
        order = (("base", base), ("head", head)) if rep % 2 == 0 else (("head", head), ("base", base))
        for side, module in order:
            for rows in rows_list:
                times[(side, rows)].append(1e3 * seconds(module, rows))
                if args.by_format:
                    for f, t in seconds_by_format(module, rows).items():
                        formats[(side, rows, f)].append(1e3 * t)
    if args.by_format:
        print(
            "| rows | format, in x out | base (ms) | checkout (ms) | checkout / base |\n|---|---|---|---|---|"
        )
        for (side, rows, f), v in formats.items():
            if side == "head":
                a = statistics.median(formats[("base", rows, f)])
                print(
                    f"| {rows} | {f} | {a:.2f} | {statistics.median(v):.2f} | {statistics.median(v) / a:.2f} |"
                )
    print(f"| rows | {args.base} (ms) | checkout (ms) | checkout / base |\n|---|---|---|---|")
    for rows in rows_list:
        a, b = statistics.median(times[("base", rows)]), statistics.median(times[("head", rows)])
        print(f"| {rows} | {a:.1f} | {b:.1f} | {b / a:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
