"""Which hf-spec methods a given causal LM can run, found by the same checks the methods run themselves."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from hf_spec.engine.target.check import check_tree_verification
from hf_spec.engine.target.windows import attention_windows
from hf_spec.kernels.screened_head import int8_x_applies, max_screened_rows, screening_applies
from hf_spec.models.layers import check_layerwise_forward, decoder_parts
from hf_spec.models.quantize import quantization_report


def _attention(model: PreTrainedModel) -> str:
    windows = attention_windows(model)
    sliding = [w for w in windows if w is not None]
    if not sliding:
        return f"full attention, {len(windows)} layers"
    return (
        f"sliding window {min(sliding)} on {len(sliding)} of {len(windows)} layers (hf-spec keeps every key and "
        "masks the window)"
    )


def _greedy_head(model: PreTrainedModel) -> str:
    """How a greedy verification reads this model's LM head here (`hf_spec.kernels.screened_head`)."""
    if not screening_applies(model, False, False, False):
        head = model.get_output_embeddings()
        weight = getattr(head, "weight", None)
        why = (
            f"{weight.dtype} weights (screened in float32, and in bfloat16 on CPUs with AVX512-BF16)"
            if weight is not None and weight.dtype != torch.float32
            else "not a bias-free nn.Linear on CPU, or no C++ kernel"
        )
        return f"no: the full LM head: {why}"
    weight = model.get_output_embeddings().weight
    x = "in int8 from 3 rows (AVX512-VNNI)" if int8_x_applies(weight.numel()) else "in float32"
    rows = max_screened_rows(weight.numel(), weight.dtype)
    return f"yes: int8-screened LM head for 1-{rows} rows, x {x}; same argmax"


def support_report(model: PreTrainedModel) -> dict[str, str]:
    """`{topic: verdict}`: attention layout, tree verification, and each family of methods. A verdict starts with
    "yes" or "no"; the reason follows."""
    try:
        attention = _attention(model)
    except ValueError as err:
        return {"attention": f"no: {err}", "tree verification": "no: see attention"}
    report = {"attention": attention}
    try:
        check_tree_verification(model)
    except ValueError as err:
        report["tree verification"] = f"no: {err}"
        return report
    report["tree verification"] = "yes: a chain and a tree give the logits of a plain forward"
    report["greedy verification's LM head"] = _greedy_head(model)
    report["quantized linears"] = quantization_report(model)
    report["pld, retrieval, draft-model, talon (retrieval part)"] = "yes"
    report["eagle, lyanna (draft heads)"] = (
        "yes, once a head is trained for this model (hf-spec train eagle|lyanna)"
    )
    try:
        parts = decoder_parts(model)
    except ValueError as err:
        report["early-exit, postuse around it, talon's exit drafter"] = f"no: {err}"
        report["hispec"] = "no: see early-exit"
        return report
    limit = (
        f" (sequences up to {parts.window} tokens: the sliding window)" if parts.window is not None else ""
    )
    report["early-exit, postuse around it, talon's exit drafter"] = f"yes{limit}"
    try:
        check_layerwise_forward(model, parts, "hispec")
        report["hispec"] = f"yes{limit}"
    except ValueError as err:
        report["hispec"] = f"no: {err}"
    return report
