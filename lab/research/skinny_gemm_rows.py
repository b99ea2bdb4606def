"""Time of hf-spec's skinny-GEMM kernel against `F.linear` by rows of x, on one layer's worth of Qwen2.5-0.5B MLP
weights x 8 (12 gate/up (4864, 896) + 12 down (896, 4864) matrices, 418 MB: streamed from DRAM as in a forward).

Usage: python lab/research/skinny_gemm_rows.py [--threads N] [--dtype bfloat16] [--against OTHER_cpu_skinny_gemm.py]
`--dtype bfloat16` times the AVX512-BF16 kernel (`kernel_linear_bf16`) on twice as many bf16 matrices (same bytes)
against torch's bfloat16 `F.linear`.
`--against` loads another version of `hf_spec/kernels/cpu_skinny_gemm.py` (e.g. from `git show REV:...`) and
times both in the same process, alternating, for an A/B of kernel changes.
Two more columns: torch's `(W @ x.T).T` and `skinny_linear`, the path hf-spec routes these rows to here (measured
decisions, `hf_spec/kernels/skinny_linear.py`)."""

from __future__ import annotations

import argparse
import importlib.util
import time

import torch
import torch.nn.functional as F

from hf_spec.kernels import cpu_skinny_gemm
from hf_spec.kernels.skinny_linear import skinny_linear

ROWS = (1, 2, 3, 4, 6, 9, 13, 17, 25, 32)


def load_other(path: str):
    spec = importlib.util.spec_from_file_location("other_cpu_skinny_gemm", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def median_seconds(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2]


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--against", default=None, help="another cpu_skinny_gemm.py to compare with")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    copies = 12 if dtype == torch.float32 else 24  # the same 418 MB
    weights = [torch.randn(4864, 896, dtype=dtype) for _ in range(copies)]
    weights += [torch.randn(896, 4864, dtype=dtype) for _ in range(copies)]
    linear_of = "kernel_linear" if dtype == torch.float32 else "kernel_linear_bf16"
    kernels = {"kernel": cpu_skinny_gemm}
    if args.against:
        kernels = {"other kernel": load_other(args.against), **kernels}
    for module in kernels.values():
        module.MIN_ROWS = 1  # time one row too (what `one_row_kernel_pays` decides on)
    torch_paths = {"F.linear": F.linear, "(W @ x.T).T": _mm, "skinny_linear": skinny_linear}
    print("| rows | " + " | ".join(f"{name} ms" for name in (*torch_paths, *kernels)) + " |")
    print("|---|" + "---|" * (len(torch_paths) + len(kernels)))
    for rows in ROWS:
        xs = {k: torch.randn(rows, k, dtype=dtype) for k in (896, 4864)}

        def run(linear, xs=xs):
            return lambda: [linear(xs[w.shape[1]], w, None) for w in weights]

        best = {name: float("inf") for name in (*torch_paths, *kernels)}
        for _ in range(3):  # alternate, keep each one's best median
            for name, linear in torch_paths.items():
                best[name] = min(best[name], median_seconds(run(linear)))
            for name, module in kernels.items():
                best[name] = min(best[name], median_seconds(run(getattr(module, linear_of))))
        print(f"| {rows} | " + " | ".join(f"{best[name] * 1e3:.1f}" for name in best) + " |")


def _mm(x: torch.Tensor, w: torch.Tensor, bias: None) -> torch.Tensor:
    return torch.mm(w, x.t()).t()


if __name__ == "__main__":
    main()
