"""The Qwen GGUF target's last logits after a prompt prefilled into a static cache, a dynamic cache and no cache
(bfloat16, 2 threads): the largest difference and the argmax of each. Equal bit for bit where the row attention
reads "no mask" as `sdpa`'s `is_causal`.

    python lab/quantized_cpu/static_cache_prefill_check.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from transformers import DynamicCache, StaticCache  # noqa: E402

from hf_spec.models.fetch import load_model  # noqa: E402

torch.set_num_threads(2)
torch.set_grad_enabled(False)
model, tok = load_model("qwen2.5-coder-0.5b-instruct", dtype=torch.bfloat16, quantize="gguf")
messages = [{"role": "user", "content": "Write a short story about a lighthouse keeper who finds a message."}]
ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
    "input_ids"
]
print(f"attention: {model.config._attn_implementation}; prompt: {ids.shape[1]} tokens")
alone = model(ids).logits[0, -1].float()
for name, cache in (
    ("static", StaticCache(config=model.config, max_cache_len=400)),
    ("dynamic", DynamicCache(config=model.config)),
):
    got = model(ids, past_key_values=cache, use_cache=True).logits[0, -1].float()
    print(f"{name}: largest difference {(got - alone).abs().max().item():.4f}, argmax {got.argmax().item()} "
          f"(no cache: {alone.argmax().item()})")  # fmt: skip
