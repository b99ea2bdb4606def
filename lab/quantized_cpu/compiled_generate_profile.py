"""Where the time of transformers' compiled `generate` goes on the Qwen GGUF target (static cache, inductor,
bfloat16, 2 threads): one warm-up call compiles, one timed call of 65 tokens, then the same call under cProfile,
sorted by time spent inside each function. Read it for the share of hf-spec's kernel calls against the rest of
the step (Python wrappers, inductor's own kernels, transformers' per-step logits processors).

    python lab/quantized_cpu/compiled_generate_profile.py [--min-new-tokens]

`--min-new-tokens` asks for exactly 65 tokens with `min_new_tokens`, whose logits processor works over the whole
vocabulary every step; without it the end of sequence is ignored (`eos_token_id=None`), as `benchmarks/peers.py`
asks transformers' rows other than its reference.
"""

import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from hf_spec.bench.runner import compiled_generate_config  # noqa: E402
from hf_spec.models.fetch import load_model  # noqa: E402

torch.set_num_threads(2)
torch.set_grad_enabled(False)
model, tok = load_model("qwen2.5-coder-0.5b-instruct", dtype=torch.bfloat16, quantize="gguf")
messages = [
    {"role": "user", "content": "Write a Python function that checks whether a number is prime, with tests."}
]
ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
    "input_ids"
]
kwargs = dict(
    cache_implementation="static", compile_config=compiled_generate_config(), max_cache_len=320,
    attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=65,
)  # fmt: skip
kwargs |= dict(min_new_tokens=65) if "--min-new-tokens" in sys.argv else dict(eos_token_id=None)
model.generate(ids, **(kwargs | dict(max_new_tokens=8, min_new_tokens=0)))  # compiles
t0 = time.perf_counter()
model.generate(ids, **kwargs)
print(f"65 tokens (prompt {ids.shape[1]} tokens): {time.perf_counter() - t0:.2f} s")
profile = cProfile.Profile()
profile.enable()
model.generate(ids, **kwargs)
profile.disable()
pstats.Stats(profile).sort_stats("tottime").print_stats(20)
