"""Sweep of `generate` arguments: each method's greedy output against plain `generate`'s on the real stories260K
model (tests/fixtures), or the error either side raises. One line per (argument set, method): OK / DIFF / ERR.
Usage: python lab/research/generate_args.py [--methods pld,early-exit:3,oracle:4]"""

from __future__ import annotations

import argparse
import copy
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from hf_spec import SpeculativeDecoder

os.environ.setdefault("HF_HUB_OFFLINE", "1")
STORIES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "stories260K"

CASES = {
    "max_length": dict(max_length=40),
    "min_new_tokens": dict(max_new_tokens=30, min_new_tokens=25),
    "eos_list": dict(max_new_tokens=40, eos_token_id=[2, 13]),
    "bad_words": dict(max_new_tokens=30, bad_words_ids=[[365]]),
    "suppress": dict(max_new_tokens=30, suppress_tokens=[13, 29889]),
    "begin_suppress": dict(max_new_tokens=30, begin_suppress_tokens=[13]),
    "sequence_bias": dict(max_new_tokens=30, sequence_bias={(13,): -10.0}),
    "forced_eos": dict(max_new_tokens=30, forced_eos_token_id=2),
    "exp_decay": dict(max_new_tokens=30, exponential_decay_length_penalty=(5, 1.5)),
    "renormalize": dict(max_new_tokens=30, renormalize_logits=True),
    "no_repeat": dict(max_new_tokens=30, no_repeat_ngram_size=2),
    "repetition": dict(max_new_tokens=30, repetition_penalty=1.5),
    "encoder_rep": dict(max_new_tokens=30, encoder_repetition_penalty=1.2),
    "max_time": dict(max_new_tokens=30, max_time=10.0),
    "scores": dict(max_new_tokens=20, return_dict_in_generate=True, output_scores=True),
    "greedy_2_returns": dict(max_new_tokens=20, num_return_sequences=2),
    "low_memory": dict(max_new_tokens=20, low_memory=True),
    "contrastive": dict(max_new_tokens=20, penalty_alpha=0.6, top_k=4),
    "dola": dict(max_new_tokens=20, dola_layers="low"),
    "guidance": dict(max_new_tokens=20, guidance_scale=1.5),
    "static_cache": dict(max_new_tokens=20, cache_implementation="static"),
    "watermark": dict(max_new_tokens=20, watermarking_config={"bias": 2.0, "greenlist_ratio": 0.25}),
    "top_k_greedy": dict(max_new_tokens=20, top_k=5),
    "temperature_0": dict(max_new_tokens=20, do_sample=True, temperature=0.0),
    "group_beams": dict(max_new_tokens=20, num_beam_groups=2, num_beams=2, diversity_penalty=1.0),
}


def run_case(model, tok, ids, kwargs: dict, method: str | None):
    """`generate` with `kwargs` (greedy unless they say otherwise), plain (`method` None) or with the method."""
    kw = {"do_sample": False, **kwargs}
    if method is not None:
        kw["custom_generate"] = SpeculativeDecoder(method, tokenizer=tok)
    return model.generate(**ids, **kw)


def outcome(model, tok, ids, method: str, kwargs: dict | None, cached: int = 0) -> str:
    """OK / DIFF against plain `generate`, or the error. `cached`: a cache of the prompt's first tokens is passed."""
    sequences = []
    for m in (None, method):
        kw = dict(kwargs or dict(max_new_tokens=20))
        if cached:
            cache = DynamicCache(config=model.config)
            with torch.no_grad():
                model(ids["input_ids"][:, :cached], past_key_values=cache)
            kw["past_key_values"] = copy.deepcopy(cache)
        try:
            out = run_case(model, tok, ids, kw, m)
        except Exception as e:  # noqa: BLE001 - reported, not handled
            return f"ERR ({'plain' if m is None else 'hf-spec'}) {type(e).__name__}: {str(e)[:110]}"
        sequences.append(out.sequences if hasattr(out, "sequences") else out)
    ref, got = sequences
    return "OK" if ref.shape == got.shape and torch.equal(ref, got) else "DIFF"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--methods", default="pld,early-exit:3,oracle:4")
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(STORIES)
    model = AutoModelForCausalLM.from_pretrained(STORIES).eval()
    ids = tok("Once upon a time, there was a little girl named Lily. She", return_tensors="pt")
    length = ids["input_ids"].shape[1]
    for name, kwargs in [*CASES.items(), ("cached_prefix", None), ("cached_prompt", None)]:
        cached = {"cached_prefix": 6, "cached_prompt": length}.get(name, 0)
        for method in args.methods.split(","):
            print(f"{name:16s} {method:14s} {outcome(model, tok, ids, method, kwargs, cached)}", flush=True)


if __name__ == "__main__":
    main()
