"""Attention for a few query rows against a long KV cache on CPU: grouped-query heads without `repeat_kv`.

A verification forward feeds 2..`MAX_QUERY_ROWS` tokens (a chain or a tree) with a 4D mask. For GQA models
transformers' `sdpa` then copies every layer's keys and values `num_key_value_groups` times (`repeat_kv`: only an
unmasked single query row may use `enable_gqa`) and runs torch's CPU flash kernel on the copies, a cost that grows
with the cache. Here each KV head's group of query heads is one matrix, `(groups * rows, head_dim) @ (head_dim,
kv_len)`, plus the mask, a softmax and `@ V`, with no copy of the cache. Same function, fp32 rounding aside (as any
other kernel choice).

One query row with no mask (a plain step or a one-token draft step) is given an all-zero mask and left to `sdpa`:
torch's CPU kernel runs one unmasked row far slower than its masked path (above all in bfloat16 / float16), and
the masked path also beats the grouped product for one row.

Only inside `grouped_attention(model)` (hf-spec's decoding loop), only where the model runs `sdpa` on CPU; every
other call (prefill, one row, dropout, biases, sinks) goes to transformers' own `sdpa_attention_forward`;
`HF_SPEC_GROUPED_ATTENTION=0` turns it off.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from hf_spec.core import envs

NAME = "hf_spec_grouped"
MAX_QUERY_ROWS = 64  # beyond (prefill) torch's flash kernel is the better choice


def _applies(
    query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, dropout: float, kwargs
) -> bool:
    return (
        2 <= query.shape[2] <= MAX_QUERY_ROWS
        and mask is not None
        and query.device.type == "cpu"
        and mask.dim() == 4
        and mask.shape[0] in (1, query.shape[0])
        and mask.shape[1] == 1
        and mask.shape[-1] == key.shape[2]
        and dropout == 0.0
        and query.shape[1] % key.shape[1] == 0
        and query.dtype == key.dtype
        and not torch.is_grad_enabled()
        and all(kwargs.get(k) is None for k in ("softcap", "position_bias", "s_aux", "sinks", "cache"))
    )


def grouped_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface. query `(batch, heads, rows, head_dim)`, key/value `(batch, kv_heads,
    kv_len, head_dim)`, mask `(batch or 1, 1, rows, kv_len)` (bool: True attends; or additive) -> `(batch, rows,
    heads, head_dim)`."""
    if attention_mask is None and query.shape[2] == 1 and query.is_cpu:
        attention_mask = torch.zeros(1, 1, 1, key.shape[2], dtype=query.dtype)  # torch's faster masked path
    if not _applies(query, key, attention_mask, dropout, kwargs):
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    return grouped_product(query, key, value, attention_mask, scaling), None


def grouped_product(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor,
    scaling: float | None,
) -> torch.Tensor:
    """Each KV head's query heads as one matrix: query `(batch, heads, rows, head_dim)`, key/value `(batch,
    kv_heads, kv_len, head_dim)`, mask `(batch or 1, 1, rows, kv_len)` -> `(batch, rows, heads, head_dim)`."""
    batch, heads, rows, dim = query.shape
    kv_heads, kv_len, dim_v = key.shape[1], key.shape[2], value.shape[-1]
    groups = heads // kv_heads
    # fp32 scores and softmax, as torch's flash kernel keeps them, also for bf16/fp16 models
    q, k, v = query.float(), key.float(), value.float()
    scale = dim**-0.5 if scaling is None else scaling
    q = q.reshape(batch * kv_heads, groups * rows, dim)  # each KV head's query heads, rows inner
    k, v = k.reshape(batch * kv_heads, kv_len, dim), v.reshape(batch * kv_heads, kv_len, dim_v)
    mask = attention_mask[:, 0]  # (batch or 1, rows, kv_len)
    if mask.dtype == torch.bool:
        # the lowest float, not -inf: a fully masked row (a padding query in a padded prefill) then averages its
        # values instead of turning NaN, which the next layer's keys would spread to every row
        mask = torch.zeros(mask.shape).masked_fill_(~mask, torch.finfo(torch.float32).min)
    bias = mask.float()[:, None, None].expand(batch, kv_heads, groups, rows, kv_len)
    bias = bias.reshape(batch * kv_heads, groups * rows, kv_len)
    # (batch * kv_heads, groups * rows, kv_len)
    scores = torch.baddbmm(bias, q, k.transpose(1, 2), alpha=scale)
    out = torch.bmm(torch.softmax(scores, dim=-1), v)  # (batch * kv_heads, groups * rows, dim_v)
    return out.view(batch, heads, rows, dim_v).transpose(1, 2).to(query.dtype).contiguous()


AttentionInterface.register(NAME, grouped_attention_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)


def grouped_attention_disabled() -> bool:
    """`HF_SPEC_GROUPED_ATTENTION=0` keeps transformers' `sdpa` (read on every call)."""
    return not envs.HF_SPEC_GROUPED_ATTENTION


@contextlib.contextmanager
def grouped_attention(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Inside the block a CPU model that runs `sdpa` runs `grouped_attention_forward` instead (same masks).

    Only models that dispatch attention through transformers' `AttentionInterface` (`_supports_attention_backend`):
    others (Falcon, ...) test `_attn_implementation == "sdpa"` themselves and would take their eager branch, with
    the registered mask function's boolean mask added to the scores as if it were additive."""
    config = getattr(model, "config", None)
    with attention_of(config if enabled and dispatches_attention(model) else None):
        yield


def dispatches_attention(model: nn.Module) -> bool:
    """Whether `model` is a CPU model whose layers take their attention function from `AttentionInterface` by
    config name (a draft head built from its family's layer class dispatches the same way)."""
    config = getattr(model, "config", None)
    return (
        config is not None
        and getattr(type(model), "_supports_attention_backend", False)
        and not getattr(config, "sub_configs", None)  # a composite model: its parts keep their own settings
        and next(model.parameters()).device.type == "cpu"
    )


@contextlib.contextmanager
def attention_of(config, name: str = NAME) -> Iterator[None]:
    """Inside the block the layers built from `config` (a model's, or a draft head's layer config) run the attention
    function registered as `name` (default `grouped_attention_forward`) where they ran `sdpa`; `None` or
    `HF_SPEC_GROUPED_ATTENTION=0`: unchanged."""
    if (
        config is None
        or grouped_attention_disabled()
        or getattr(config, "_attn_implementation", None) != "sdpa"
    ):
        yield
        return
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"
