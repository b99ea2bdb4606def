"""Greedy output checks for benchmarks: where a method's tokens first depart from plain decoding's, and whether
that departure is a numeric tie between two forwards of different shape (not a bug) in the model's dtype."""

from __future__ import annotations

import torch

NEAR_TIE = 1e-3  # float32: logits of one position agree to ~1e-5 across the forward shapes used
# bfloat16 and float16: incremental decoding and one full forward of the same text differ by tenths of a logit in
# bfloat16, so a choice within these gaps is a numeric tie there
NEAR_TIE_BY_DTYPE = {torch.bfloat16: 0.5, torch.float16: 0.0625}
# targets whose linears round activations to int8 (bitsandbytes' LLM.int8, hf-spec's GGUF linears): float noise
# between forward shapes crosses an outlier threshold or an int8 rounding step now and then and moves a row's logits
# by up to ~2 (SmolLM2-135M, LLM.int8)
INT8_ACTIVATIONS_NEAR_TIE = 2.0


def near_tie_threshold(dtype: torch.dtype) -> float:
    """Logit gap below which two forwards of different shape may rank two tokens either way in `dtype`."""
    return NEAR_TIE_BY_DTYPE.get(dtype, NEAR_TIE)


def _threshold(model) -> float:
    from hf_spec.engine.target.profile import target_profile

    quantized = target_profile(model).rounded_inputs
    return max(near_tie_threshold(model.dtype), INT8_ACTIVATIONS_NEAR_TIE if quantized else 0.0)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.no_grad()
def top2_gap(model, prefix: torch.Tensor) -> float:
    logits = model(input_ids=prefix).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def choice_gap(model, prefix: torch.Tensor, ar_token: int, other_token: int) -> float:
    """`|logit(ar's token) - logit(the other token)|` after `prefix`: how far apart the two choices were."""
    logits = model(input_ids=prefix).logits[0, -1].float()
    return float((logits[ar_token] - logits[other_token]).abs())


def compare_greedy(model, input_ids: torch.Tensor, ar_tokens: list[int], new_ids: list[int]) -> dict:
    """Where `new_ids` first departs from `ar_tokens` (both new tokens after `input_ids` `(1, P)`), the logit gap
    between the two choices there, and whether that gap is a numeric tie in the model's dtype."""
    at = first_divergence(ar_tokens, new_ids)
    if at is None:
        return {"lossless": True}
    prefix = torch.cat(
        [input_ids[0], torch.tensor(ar_tokens[:at], dtype=torch.long, device=input_ids.device)]
    )[None]
    both = at < len(ar_tokens) and at < len(new_ids)
    with torch.no_grad():
        gap = choice_gap(model, prefix, ar_tokens[at], new_ids[at]) if both else float("inf")
    return {
        "lossless": False,
        "diverged_at": at,
        "choice_gap": gap,
        "near_tie": gap < _threshold(model),
    }
