"""Attention of a few query rows against a KV cache in one call of hf-spec's C++ kernel (`module.cpp`'s
`rows_attention`), each row computed alone: the attention of hf-spec's quantized CPU targets.

transformers' `sdpa` runs torch's CPU flash kernel, whose result for a row depends on how many rows come with it
(blocking), and whose call costs ~90 us in bfloat16 for one row on a 2-core CPU, 24 times a step of a small model.
This kernel computes each (head, row) alone in float32: `q . k` over 8 lanes, keys in order, masked keys skipped
(they add exact zeros), the softmax's sum and the weighted values in key order, the output rounded once to the
model's dtype. A verification's rows therefore get the bits of one-row decoding, in bfloat16 too, which `sdpa`
and hf-spec's grouped attention (`hf_spec.kernels.grouped_attention`) do not promise. It is another function than
`sdpa` up to float32 rounding: a model runs it in its own `generate` and in hf-spec's rounds alike, as
`quantize_target` sets it (`ROWS_ATTENTION`, registered with transformers' `AttentionInterface`).

It takes batch 1 and 1..`MAX_QUERY_ROWS` rows on CPU, float32 or bfloat16, a 4D additive or boolean mask, or none
(one row: every key; more rows: causal, aligned top left as `sdpa` reads `is_causal`). Anything else (prefill of
longer prompts, batches, dropout, soft-capping, sinks, autograd) goes to transformers' `sdpa_attention_forward`.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from hf_spec.kernels import cpu_skinny_gemm
from hf_spec.kernels.grouped_attention import NAME as GROUPED
from hf_spec.kernels.grouped_attention import attention_of
from hf_spec.kernels.ops import define_cpu_op

ROWS_ATTENTION = "hf_spec_rows"
MAX_QUERY_ROWS = 64  # beyond (a prompt's prefill) torch's flash kernel is the better choice
_MASK_KINDS = {torch.float32: 1, torch.bfloat16: 2, torch.bool: 3}
_DTYPES = (torch.float32, torch.bfloat16)


def _causal(rows: int, keys: int) -> torch.Tensor:
    """`(rows, keys)` bool: row r sees keys 0..r, the mask `sdpa`'s `is_causal` means (aligned top left). transformers
    passes no mask with several rows only where that is the right one: as many keys as rows, or a prefill into an
    empty static cache (the keys past the prompt are the cache's unwritten slots)."""
    return torch.ones(rows, keys, dtype=torch.bool).tril()


def _rows_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scaling: float,
    causal: bool,
) -> torch.Tensor:  # fmt: skip
    """The kernel: query `(1, heads, rows, dim)`, key `(1, kv_heads, keys, dim)`, value `(1, kv_heads, keys,
    dim_v)` (last dimensions contiguous), mask `(rows, keys)` (float32, bfloat16 additive, or bool) or
    None (`causal`, or every key) -> `(1, rows, heads, dim_v)` in query's dtype."""
    if query.dtype not in _DTYPES or key.dtype is not query.dtype or value.dtype is not query.dtype:
        raise ValueError(
            "rows_attention takes float32 or bfloat16 query, key and value of one dtype, got "
            f"{query.dtype}, {key.dtype}, {value.dtype}"
        )
    _, heads, rows, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    if mask is None and causal and rows > 1:
        mask = _causal(rows, keys)
    if mask is not None and not mask.is_contiguous():
        mask = mask.contiguous()
    out = query.new_empty((1, rows, heads, value.shape[-1]))
    cpu_skinny_gemm.load_kernel().rows_attention(
        query.data_ptr(), key.data_ptr(), value.data_ptr(), 0 if mask is None else mask.data_ptr(), out.data_ptr(),
        heads, kv_heads, rows, keys, dim, value.shape[-1], query.stride(1), query.stride(2), key.stride(1), key.stride(2),
        value.stride(1), value.stride(2), 0 if mask is None else _MASK_KINDS[mask.dtype], float(scaling),
        query.dtype is torch.bfloat16,
    )  # fmt: skip
    return out


def _rows_attention_fake(query, key, value, mask, scaling, causal):
    return query.new_empty((1, query.shape[2], query.shape[1], value.shape[-1]))


# the operator: `_rows_attention` for CompositeExplicitAutograd, overridden by a C++ CPU kernel
# (`op_norm_attention.cpp`) once the kernel module loads, which hands what it does not take to `rows_attention_py`
rows_attention_op = define_cpu_op(
    "rows_attention", _rows_attention, _rows_attention_fake, "CompositeExplicitAutograd"
)
rows_attention_py = define_cpu_op("rows_attention_py", _rows_attention, _rows_attention_fake)


def _applies(query, key, value, mask, dropout: float, kwargs) -> bool:
    rows = query.shape[2]
    return (
        query.dim() == 4
        and query.shape[0] == 1
        and 1 <= rows <= MAX_QUERY_ROWS
        and query.is_cpu
        and query.dtype in _DTYPES
        and key.dtype is query.dtype
        and value.dtype is query.dtype
        and key.shape[0] == value.shape[0] == 1
        and key.shape[2] == value.shape[2]
        and key.shape[-1] == query.shape[-1]
        and query.shape[1] % key.shape[1] == 0
        and value.shape[1] == key.shape[1]
        and query.stride(-1) == key.stride(-1) == value.stride(-1) == 1
        and dropout == 0.0
        and (mask is None or (mask.dim() == 4 and mask.shape[:2] == (1, 1) and mask.shape[2:] == (rows, key.shape[2])))
        and not (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad))
        and all(kwargs.get(k) is None for k in ("softcap", "position_bias", "s_aux", "sinks"))
        and cpu_skinny_gemm.kernel_state()[0]
    )  # fmt: skip


def rows_attention_forward(
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
    """transformers' attention interface: query `(batch, heads, rows, head_dim)`, key/value `(batch, kv_heads,
    kv_len, head_dim)`, mask `(batch or 1, 1, rows, kv_len)` (bool: True attends; or additive) or None ->
    `(batch, rows, heads, head_dim)`: the kernel where it applies, else `sdpa`."""
    if not _applies(query, key, value, attention_mask, dropout, kwargs):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
            **kwargs,
        )  # fmt: skip
    mask = None if attention_mask is None else attention_mask[0, 0]
    if mask is not None and mask.dtype not in _MASK_KINDS:
        mask = mask.float()
    if mask is not None and not mask.is_contiguous():
        mask = mask.contiguous()
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    run = rows_attention_op if torch.compiler.is_compiling() else _rows_attention
    return run(query, key, value, mask, scale, causal), None


AttentionInterface.register(ROWS_ATTENTION, rows_attention_forward)
AttentionMaskInterface.register(ROWS_ATTENTION, sdpa_mask)


def use_rows_attention(model: nn.Module) -> bool:
    """Make `model` (a CPU model that runs `sdpa` through transformers' `AttentionInterface`) run
    `rows_attention_forward`; returns whether it does now."""
    config = getattr(model, "config", None)
    if (
        config is None
        or not getattr(type(model), "_supports_attention_backend", False)
        or getattr(config, "sub_configs", None)
        or getattr(config, "_attn_implementation", None) not in ("sdpa", ROWS_ATTENTION)
        or cpu_skinny_gemm.load_kernel() is None
    ):
        return False
    model.set_attn_implementation(ROWS_ATTENTION)
    return True


def rows_attention_of(config) -> contextlib.AbstractContextManager[None]:
    """Inside the block the layers built from `config` (a draft head's layer config) run `rows_attention_forward`
    where they ran `sdpa` and the kernel loads: a head step's one to few rows against its cache, compiled or not
    (torch's flash kernel costs far more for a row, above all over a compiled step's whole static cache). Else
    grouped attention (`hf_spec.kernels.grouped_attention.attention_of`); `HF_SPEC_GROUPED_ATTENTION=0`: neither."""
    rows = (
        getattr(config, "_attn_implementation", None) == "sdpa" and cpu_skinny_gemm.load_kernel() is not None
    )
    return attention_of(config, ROWS_ATTENTION if rows else GROUPED)


__all__ = [
    "MAX_QUERY_ROWS",
    "ROWS_ATTENTION",
    "rows_attention_forward",
    "rows_attention_of",
    "use_rows_attention",
]
