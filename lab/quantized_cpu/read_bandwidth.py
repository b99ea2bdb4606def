"""What reading memory costs on this CPU at 1 and 2 threads: `torch.max` over 150 MB (a plain stream) against the
Qwen GGUF target's one-row LM head (Q8_0, 153 MB of codes) on hf-spec's kernel, alternated 5 times in one process.

    python lab/quantized_cpu/read_bandwidth.py
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from hf_spec.models.fetch import load_model  # noqa: E402

torch.set_grad_enabled(False)
model, _ = load_model("qwen2.5-coder-0.5b-instruct", dtype=torch.bfloat16, quantize="gguf")
head = model.lm_head
x = torch.randn(1, head.in_features, dtype=torch.bfloat16)
stream = torch.randint(-100, 100, (150_000_000,), dtype=torch.int8).view(torch.int32)


def ms(fn, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return 1e3 * (time.perf_counter() - t0) / reps


res: dict[tuple[str, int], list[float]] = {}
for _ in range(5):
    for threads in (1, 2):
        torch.set_num_threads(threads)
        res.setdefault(("torch.max, 150 MB", threads), []).append(ms(stream.max, 3))
        res.setdefault(("LM head, 1 row", threads), []).append(ms(lambda: head(x), 10))
for (name, threads), times in res.items():
    mb = 150 if name.startswith("torch") else 153
    med = statistics.median(times)
    print(
        f"{name}, {threads} thread(s): {med:.2f} ms ({mb / med:.1f} GB/s), runs {[round(t, 2) for t in times]}"
    )
