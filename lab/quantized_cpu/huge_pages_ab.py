"""The Qwen GGUF target's linears (one bfloat16 row each, all 169 once a pass) with their packed weights where
the loader leaves them (4 KB pages) and copied into one arena the kernel is asked to back with 2 MB pages
(`madvise(MADV_HUGEPAGE)`, as transparent huge pages set to `madvise` allow), alternated in one process at 1 and 2
threads: what the TLB and the 4 KB prefetch boundary cost a decoding step.

    python lab/quantized_cpu/huge_pages_ab.py [--repeats 8]
"""

import argparse
import dataclasses
import mmap
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from hf_spec.kernels.group_quant import GroupQuantWeight, kernel_group_linear  # noqa: E402
from hf_spec.models.fetch import load_model  # noqa: E402
from hf_spec.models.quant_modules import QuantizedLinear  # noqa: E402

HUGE = 2 << 20
ALIGN = 64


def arena_copies(weights: list[GroupQuantWeight]) -> tuple[list[GroupQuantWeight], mmap.mmap]:
    """The weights with their tensors copied, in order, into one anonymous mapping advised to use huge pages."""
    fields = ("codes", "scale", "min", "high")
    sizes = [getattr(w, f).nbytes for w in weights for f in fields if getattr(w, f) is not None]
    total = sum((s + ALIGN - 1) // ALIGN * ALIGN for s in sizes) + HUGE
    buf = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(buf, dtype=torch.uint8)
    offset = (-raw.data_ptr()) % HUGE
    out = []
    for w in weights:
        copies = {}
        for f in fields:
            t = getattr(w, f)
            if t is None:
                continue
            n = t.nbytes
            view = raw[offset : offset + n].view(t.dtype).view(t.shape)
            view.copy_(t)
            copies[f] = view
            offset += (n + ALIGN - 1) // ALIGN * ALIGN
        out.append(dataclasses.replace(w, **copies))
    return out, buf


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=8)
    args = p.parse_args()
    torch.set_grad_enabled(False)
    model, _ = load_model("qwen2.5-coder-0.5b-instruct", dtype=torch.bfloat16, quantize="gguf")
    mods = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    plain = [m.packed for m in mods]
    huge, _buf = arena_copies(plain)
    bias = [None if m.bias is None else m.bias.float() for m in mods]
    xs = {k: torch.randn(1, k).to(torch.bfloat16) for k in {m.in_features for m in mods}}
    same = all(
        torch.equal(
            kernel_group_linear(xs[a.in_features], a, b), kernel_group_linear(xs[a.in_features], h, b)
        )
        for a, h, b in zip(plain, huge, bias, strict=True)
    )
    print(f"same outputs: {same}; huge pages in use: {_anon_huge_kb()} kB")

    def ms(weights):
        t0 = time.perf_counter()
        for w, b in zip(weights, bias, strict=True):
            kernel_group_linear(xs[w.in_features], w, b)
        return 1e3 * (time.perf_counter() - t0)

    for threads in (1, 2):
        torch.set_num_threads(threads)
        res = {"4 KB pages": [], "2 MB pages": []}
        for rep in range(args.repeats):
            sides = (("4 KB pages", plain), ("2 MB pages", huge))
            for name, weights in sides if rep % 2 == 0 else sides[::-1]:
                res[name].append(ms(weights))
        med = {k: statistics.median(v) for k, v in res.items()}
        print(
            f"{threads} thread(s): "
            + ", ".join(f"{k} {v:.1f} ms" for k, v in med.items())
            + f"; ratio {med['2 MB pages'] / med['4 KB pages']:.2f}"
        )
    return 0


def _anon_huge_kb() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return -1


if __name__ == "__main__":
    sys.exit(main())
