"""A target model's fingerprint, recorded by everything trained for it (draft heads, exit heads, tables).

The signature is a few statistics of the embedding and LM-head rows, compared with a tolerance so the same
target loaded in float32, bfloat16 or float16 still matches while a different model (or a different size of the
same family) does not.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel

_ROW_FRACTIONS = (0.0, 0.001, 0.01, 0.1, 0.25, 0.5, 0.75, 0.999)


def _row_stats(weight: torch.Tensor) -> list[float]:
    rows = sorted({min(int(f * weight.shape[0]), weight.shape[0] - 1) for f in _ROW_FRACTIONS})
    picked = weight.detach()[rows].float()  # [num_rows, hidden_size]
    return [round(v, 6) for v in torch.cat([picked.mean(-1), picked.abs().mean(-1)]).tolist()]


@torch.no_grad()
def target_fingerprint(model: PreTrainedModel) -> dict[str, Any]:
    """`{"model_type", "hidden_size", "vocab_size", "num_hidden_layers", "signature"}` of `model`."""
    from hf_spec.engine.target.placement import resident_weight

    config = model.config
    embedding = resident_weight(model.get_input_embeddings(), "the target's fingerprint reads its embedding")
    signature = _row_stats(embedding)
    head = model.get_output_embeddings()
    if head is not None and head.weight is not model.get_input_embeddings().weight:
        signature += _row_stats(resident_weight(head, "the target's fingerprint reads its LM head"))
    return {
        "model_type": config.model_type,
        "hidden_size": int(config.hidden_size),
        "vocab_size": int(model.get_input_embeddings().weight.shape[0]),
        "num_hidden_layers": int(config.num_hidden_layers),
        "signature": signature,
    }


def check_fingerprint(expected: dict[str, Any], model: PreTrainedModel, what: str) -> None:
    """Raise `ValueError` naming the first difference when `model` is not the target `expected` describes."""
    actual = target_fingerprint(model)
    for key in ("model_type", "hidden_size", "vocab_size", "num_hidden_layers"):
        if key in expected and expected[key] != actual[key]:
            raise ValueError(
                f"{what} was trained for a target with {key}={expected[key]!r}, but this model has "
                f"{key}={actual[key]!r}: use the head trained for this model"
            )
    want = torch.tensor(expected.get("signature", []), dtype=torch.float64)
    have = torch.tensor(actual["signature"], dtype=torch.float64)
    if want.shape != have.shape:  # one of the two ties its LM head to its embedding, the other does not
        tied = "ties" if have.numel() < want.numel() else "does not tie"
        raise ValueError(
            f"{what} was trained for a {actual['model_type']} model whose LM head is {'not ' * (tied == 'ties')}"
            f"tied to its embedding, and this model {tied} them: another model, or the same model in another build "
            "(a GGUF build stores the LM head apart where the Hub's model ties it). Load the build the head's card "
            "names (`hf-spec fetch NAME`), or fine-tune the head on your weights (`hf-spec train ... --init-from HEAD`)"
        )
    if not torch.allclose(want, have, rtol=0.05, atol=2e-3):
        raise ValueError(
            f"{what} was trained for a different {actual['model_type']} model of the same shape (embedding/LM-head "
            "fingerprint differs): use the head trained for this model. If it is the same model in another build "
            "(the Hub's weights against the de-quantized GGUF build `hf-spec fetch` makes, which hf-spec's committed "
            "heads are for, or a re-quantized copy), load the build the head's card names, or fine-tune the head "
            "on your weights (`hf-spec train ... --init-from HEAD`)"
        )
