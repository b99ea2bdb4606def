"""transformers' `sdpa` against hf-spec's grouped attention (`hf_spec/kernels/grouped_attention.py`) on CPU.

    python lab/research/grouped_attention.py layer [--dtype bfloat16]   # one layer's attention, Qwen2.5-0.5B shapes (us)
    python lab/research/grouped_attention.py forward    # a whole verification forward, interleaved (ms)
    python lab/research/grouped_attention.py generate --method retrieval:CONFIG.json [--new 64]
        # hf-spec generations on the first Spec-Bench prompt of each category, on and off alternately

Options: --target (default qwen2.5-coder-0.5b-instruct), --threads (2), --prompts (Spec-Bench dev split).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from transformers import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_spec.engine.target.cache import crop_cache
from hf_spec.kernels.grouped_attention import grouped_attention, grouped_attention_forward, grouped_product
from hf_spec.kernels.screened_head import screened_lm_head
from hf_spec.kernels.skinny_linear import fast_linears

HEADS, KV_HEADS, HEAD_DIM = 14, 2, 64  # Qwen2.5-0.5B


def _causal(rows: int, kv_len: int) -> torch.Tensor:
    """Additive `(1, 1, rows, kv_len)` mask: the last `rows` positions are causal among themselves."""
    mask = torch.zeros(1, 1, rows, kv_len)
    mask[..., kv_len - rows :] = torch.triu(torch.full((rows, rows), torch.finfo(torch.float32).min), 1)
    return mask


def layer(dtype: torch.dtype) -> None:
    """One layer's attention as transformers calls `sdpa` (no mask for one row, else a causal mask), `sdpa` given
    an explicit mask (all-true for one row), hf-spec's grouped product, and what hf-spec's interface picks."""
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = HEADS // KV_HEADS, True

    def best_us(fn, *args, n: int = 200) -> float:
        for _ in range(20):
            fn(*args)
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(n):
                fn(*args)
            best = min(best, (time.perf_counter() - start) / n)
        return best * 1e6

    print(
        f"{dtype}\n| cached tokens | rows | sdpa us | sdpa, explicit mask us | grouped product us | hf-spec's pick us |"
        "\n|---|---|---|---|---|---|"
    )
    with torch.no_grad():
        for kv_len in (200, 600, 1500):
            for rows in (1, 2, 6, 12):
                q = torch.randn(1, HEADS, rows, HEAD_DIM, dtype=dtype)
                k, v = (torch.randn(1, KV_HEADS, kv_len, HEAD_DIM, dtype=dtype) for _ in range(2))
                mask = _causal(rows, kv_len)
                us = [
                    best_us(sdpa_attention_forward, module, q, k, v, None if rows == 1 else mask),
                    best_us(sdpa_attention_forward, module, q, k, v, mask),
                    best_us(grouped_product, q, k, v, mask, None),
                    best_us(grouped_attention_forward, module, q, k, v, None if rows == 1 else mask),
                ]
                print(f"| {kv_len} | {rows} | " + " | ".join(f"{u:.0f}" for u in us) + " |", flush=True)


def forward(model, repeats: int = 12) -> None:
    print("| cached tokens | rows | sdpa ms | grouped ms | ratio |\n|---|---|---|---|---|")
    for past in (100, 300, 700, 1500):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            prompt = torch.randint(100, 20000, (1, past))
            model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
        for rows in (2, 6, 12):
            x, pos = torch.randint(100, 20000, (1, rows)), torch.arange(past, past + rows)[None]
            mask = _causal(rows, past + rows)
            times: dict[bool, list[float]] = {False: [], True: []}
            for rep in range(repeats):
                for on in (True, False) if rep % 2 else (False, True):
                    with (
                        torch.no_grad(),
                        fast_linears(model),
                        grouped_attention(model, on),
                        screened_lm_head(model),
                    ):
                        start = time.perf_counter()
                        model(
                            input_ids=x,
                            position_ids=pos,
                            attention_mask=mask,
                            past_key_values=cache,
                            use_cache=True,
                        )
                        times[on].append(time.perf_counter() - start)
                    crop_cache(cache, past)
            off, on = (1000 * statistics.median(times[o][2:]) for o in (False, True))
            print(f"| {past} | {rows} | {off:.1f} | {on:.1f} | {on / off:.2f} |", flush=True)


def generate(model, tokenizer, method: str, prompts: str, new: int) -> None:
    from hf_spec import SpeculativeDecoder
    from hf_spec.bench.runner import encode_chat, load_prompts

    decoder = SpeculativeDecoder(method, tokenizer=tokenizer)
    total = {"0": 0.0, "1": 0.0}
    for i, p in enumerate(load_prompts(prompts, per_category=1)):
        ids = encode_chat(tokenizer, [{"role": "user", "content": p.turns[0]}])
        if i == 0:
            model.generate(ids, max_new_tokens=8, do_sample=False, custom_generate=decoder)  # warm-up
        outs = {}
        for flag in ("1", "0") if i % 2 else ("0", "1"):
            os.environ["HF_SPEC_GROUPED_ATTENTION"] = flag
            start = time.perf_counter()
            outs[flag] = model.generate(ids, max_new_tokens=new, do_sample=False, custom_generate=decoder)
            total[flag] += time.perf_counter() - start
        same = torch.equal(outs["0"], outs["1"])
        print(
            f"{p.category}: {ids.shape[1]} prompt tokens, outputs {'equal' if same else 'DIFFER'}",
            flush=True,
        )
    os.environ.pop("HF_SPEC_GROUPED_ATTENTION")
    print(f"grouped off {total['0']:.1f} s, on {total['1']:.1f} s: on / off {total['1'] / total['0']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("layer", "forward", "generate"))
    ap.add_argument("--target", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--method", default="retrieval:benchmarks/configs/retrieval-qwen2.5-coder-0.5b-instruct-long.json"
    )
    ap.add_argument("--prompts", default="../shared/data/eval/spec_bench_dev.jsonl")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.what == "layer":
        return layer(getattr(torch, args.dtype))
    from hf_spec.models import load_model

    model, tokenizer = load_model(args.target)
    if args.what == "forward":
        forward(model)
    else:
        generate(model, tokenizer, args.method, args.prompts, args.new)


if __name__ == "__main__":
    main()
