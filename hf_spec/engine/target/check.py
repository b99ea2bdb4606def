"""Whether a model gives a token tree's logits when called the way hf-spec calls it.

hf-spec never forks a modeling file: it calls the stock model with explicit `position_ids`, a 4D mask and its
cache. Most architectures honour all three; some build positions or attention biases from a 2D padding mask
(ALiBi in Bloom and Falcon's `alibi` variant) or test `_attn_implementation` themselves. Rather than list them,
`check_tree_verification` runs a small tree through the model once, as the loop would, and compares every row
with plain forwards of the same paths; a model that fails is refused by name instead of decoding wrongly.

A quantized target adds a second question: does a linear layer compute a row the same alone as beside other rows?
`generate` feeds one token per step, a tree forward many; a quantizer that scales or splits its inputs over all
rows of a forward (bitsandbytes' LLM.int8 outlier columns, per-tensor activation scales) computes a tree's rows
differently from the steps they stand for. `_row_failure` feeds each kind of quantized linear a row alone and
beside a row of large values, in the backend's verification context (where hf-spec's row-local LLM.int8 runs).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel

from hf_spec.core import envs
from hf_spec.core.compat import cache_kwargs
from hf_spec.engine.target.cache import crop_cache
from hf_spec.engine.target.profile import target_profile
from hf_spec.engine.target.windows import sequence_mask, target_cache
from hf_spec.tree.draft_tree import DraftTree
from hf_spec.tree.masks import tree_attention_mask, tree_position_ids

# of the logits' range; a tree forward and a plain one round differently (bfloat16: 1.5-1.8% on SmolLM2 and Qwen)
TOLERANCE = {torch.float32: 0.02, torch.float64: 0.02}
LOW_PRECISION_TOLERANCE = 0.08
# of a quantized linear's output range: one row alone vs beside a row of large values (rounding: ~1e-7 in float32,
# one bfloat16 step at most; LLM.int8's shared outlier columns: ~2%)
ROW_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-3}
LOW_PRECISION_ROW_TOLERANCE = 5e-3


def _failure(model: PreTrainedModel) -> str | None:
    """`None` if, after a 3-token prefix, a chain `[root, b]` and a tree `[root, a, b, c]` (`a` and `b` siblings,
    `c` under `b`) give the logits of one plain forward of `prefix + [root, b, c]`; else what went wrong."""
    embeddings = model.get_input_embeddings().weight
    # the inputs' device: an offloaded embedding's weight is a `meta` placeholder
    vocab, device = embeddings.shape[0], target_profile(model).device
    # ordinary tokens from the middle of the vocabulary: the first ids are special tokens in most vocabularies, and
    # those give some models huge activations (SmolLM2: ~25,000 from its 12th layer) where bfloat16's rounding
    # noise alone can exceed the tolerance
    tokens = [(vocab // 3 + 7 * i) % vocab for i in range(7)]
    prefix, (root, a, b, c) = tokens[:3], tokens[3:]
    tolerance = TOLERANCE.get(model.dtype, LOW_PRECISION_TOLERANCE)
    # int8 inputs (LLM.int8, GGUF linears): float noise can cross their rounding steps
    if target_profile(model).rounded_inputs:
        tolerance = LOW_PRECISION_TOLERANCE
    with torch.no_grad(), target_profile(model).backend.verification(model):
        want = model(input_ids=torch.tensor([[*prefix, root, b, c]], device=device)).logits[0, 3:].float()
        scale = float(want.abs().max()) + 1e-6
        cache = target_cache(model)
        model(input_ids=torch.tensor([prefix], device=device), use_cache=True, **cache_kwargs(model, cache))
        for kind, tree, rows in (
            ("chain", DraftTree.chain([b]), [0, 1]),
            ("tree", DraftTree([a, b, c], [-1, -1, 1]), [0, 2, 3]),
        ):
            crop_cache(cache, len(prefix))
            positions = tree_position_ids(tree, len(prefix), device)
            mask = None if tree.is_chain else tree_attention_mask(tree, len(prefix), model.dtype, device)
            got = (
                model(
                    input_ids=torch.tensor([[root, *tree.tokens.tolist()]], device=device),
                    position_ids=positions,
                    attention_mask=sequence_mask(model, mask, positions),
                    **cache_kwargs(model, cache),
                    use_cache=True,
                )
                .logits[0, rows]
                .float()
            )
            gap = float((got - want[: len(rows)]).abs().max())
            if gap > tolerance * scale:
                return f"a {kind} verified with position_ids and a cache differs from a plain forward by {gap:.3g}"
    return None


def _quantized_linears(model: PreTrainedModel) -> list[nn.Module]:
    """One linear layer of each kind (module class, weight class) that is not a plain `nn.Linear`: the quantized
    ones (bitsandbytes, HQQ, quanto modules; torchao's tensor-subclass weights)."""
    kinds: dict[tuple[type, type], nn.Module] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not hasattr(module, "in_features") or weight is None:
            continue
        kind = (type(module), type(getattr(weight, "data", weight)))
        if kind != (nn.Linear, torch.Tensor):
            kinds.setdefault(kind, module)
    return list(kinds.values())


def _row_failure(model: PreTrainedModel) -> str | None:
    """`None` if each kind of quantized linear computes a row alone as it does beside a row of large values (in the
    backend's verification context); else which layer differs and by how much."""
    dtype = model.get_input_embeddings().weight.dtype
    tolerance = ROW_TOLERANCE.get(dtype, LOW_PRECISION_ROW_TOLERANCE)
    device = target_profile(model).device
    with torch.no_grad(), target_profile(model).backend.verification(model):
        for layer in _quantized_linears(model):
            x = 0.5 * torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(0))
            x[1, 0] = 5.0  # a row's own large entry, under LLM.int8's default outlier threshold (6)
            x[0] = 100.0  # a row of outliers beside it
            x = x.to(device, dtype)[None]  # [1, 3, in]: as a forward's hidden states
            alone, beside = layer(x[:, 1:2])[0, 0].float(), layer(x)[0, 1].float()
            gap = float((alone - beside).abs().max()) / (float(alone.abs().max()) + 1e-6)
            if gap > tolerance:
                name = type(layer).__name__
                return f"its {name} layers compute a row differently beside other rows (by {gap:.2%} of the output)"
    return None


def check_tree_verification(model: PreTrainedModel) -> None:
    """Raise `ValueError` where the model cannot verify trees as hf-spec drives it (checked once per model and
    attention implementation, in eval mode; `HF_SPEC_TREE_CHECK=0` skips it, e.g. for a large model on a CPU, where
    its four short forwards take seconds)."""
    if not envs.HF_SPEC_TREE_CHECK:
        return
    key = getattr(model.config, "_attn_implementation", None)
    cached = model.__dict__.get("_hf_spec_tree_check")
    if cached is None or cached[0] != key:
        training = model.training
        model.eval()
        try:
            failure = _failure(model) or _row_failure(model)
        except Exception as err:  # noqa: BLE001 - any failure of the probe means the same thing to the user
            failure = f"{type(err).__name__}: {err}"
        finally:
            model.train(training)
        cached = model.__dict__["_hf_spec_tree_check"] = (key, failure)
    failure = cached[1]
    if failure is not None:
        raise ValueError(
            f"{type(model).__name__} does not verify token trees when called with a 4D mask, position_ids and a "
            f"KV cache ({failure}); position schemes built from a 2D padding mask (ALiBi) are not supported, nor "
            "quantizers whose rows depend on each other"
        )
