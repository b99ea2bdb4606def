"""The Qwen GGUF target's decoding step with `sdpa` and with hf-spec's row attention, alternated in one process
(the machine's speed drifts between processes), after a 10-token and a ~400-token prompt.

    python lab/quantized_cpu/attention_step_ab.py
"""

import statistics
import sys

import torch

ROOT = str(__import__("pathlib").Path(__file__).resolve().parents[2])
sys.path.insert(0, ROOT)
sys.path.insert(0, ROOT + "/lab")
from decode_step_costs import PROMPT, step_cost  # noqa: E402

from hf_spec.kernels.rows_attention import ROWS_ATTENTION  # noqa: E402
from hf_spec.models.fetch import load_model  # noqa: E402

torch.set_num_threads(2)
model, tok = load_model("qwen2.5-coder-0.5b-instruct", dtype=torch.bfloat16, quantize="gguf")
print(model.config._attn_implementation)
short = tok(PROMPT, return_tensors="pt").input_ids
long = tok(PROMPT + " " + open(ROOT + "/README.md").read()[:1500], return_tensors="pt").input_ids
print("prompt tokens", short.shape[1], long.shape[1])
for ids, label in ((short, "short"), (long, "long")):
    res = {"sdpa": [], "rows": []}
    for r in range(4):
        for name in ("sdpa", "rows") if r % 2 == 0 else ("rows", "sdpa"):
            model.set_attn_implementation("sdpa" if name == "sdpa" else ROWS_ATTENTION)
            res[name].append(1e3 * step_cost(model, ids, 3))
    print(
        label,
        {k: round(statistics.median(v), 1) for k, v in res.items()},
        "pairs",
        [round(a - b, 1) for a, b in zip(res["sdpa"], res["rows"], strict=False)],
        flush=True,
    )
