"""One bfloat16 attention call (14 heads over 2 KV heads of 64, one query row) at 40 / 150 / 600 keys: hf-spec's
row attention, `sdpa` without a mask (plain decoding's path) and `sdpa` with a zero mask
best of 3 x 200 calls.

    python lab/quantized_cpu/attention_call_costs.py
"""

import time

import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

from hf_spec.kernels.rows_attention import rows_attention_forward  # noqa: E402

m = nn.Module()
m.is_causal = True
m.num_key_value_groups = 7
q1 = torch.randn(1, 14, 1, 64).bfloat16()
rows_attention_forward(
    m, q1, torch.randn(1, 2, 5, 64).bfloat16(), torch.randn(1, 2, 5, 64).bfloat16(), None, scaling=0.125
)
for L in (40, 150, 600):
    k = torch.randn(1, 2, L, 64).bfloat16()
    v = torch.randn(1, 2, L, 64).bfloat16()
    zm = torch.zeros(1, 1, 1, L, dtype=torch.bfloat16)
    res = {}
    for _rep in range(3):
        for name, f, mask in (
            ("rows", rows_attention_forward, None),
            ("sdpa-none", sdpa_attention_forward, None),
            ("sdpa-zero", sdpa_attention_forward, zm),
        ):
            t0 = time.perf_counter()
            for _ in range(200):
                f(m, q1, k, v, mask, scaling=0.125)
            res.setdefault(name, []).append((time.perf_counter() - t0) / 200 * 1e6)
    print(L, {k: round(min(v), 1) for k, v in res.items()})
