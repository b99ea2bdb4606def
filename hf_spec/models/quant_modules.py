"""The modules a quantized target runs on: `QuantizedLinear` (an `nn.Linear` replacement whose forward is hf-spec's
group-quantized kernel) and `QuantizedEmbedding` (rows de-quantized on lookup), both holding a `GroupQuantWeight`.

The packed tensors are plain attributes, not parameters or buffers: `model.to(torch.bfloat16)` leaves the float32
scales as they are (they define the weight), and moving the model off the CPU raises. A tied LM head and embedding
share one `GroupQuantWeight`. `.weight` (read by drafters that borrow the LM head, and by fingerprints) is the
de-quantized weight in the model's dtype, made on first read and kept.
"""

from __future__ import annotations

import torch
from torch import nn

from hf_spec.kernels.group_quant import GroupQuantWeight, quantized_linear


class _Packed(nn.Module):
    """What both modules share: the packed weight, its scheme's name and the model's dtype for `.weight`."""

    def __init__(self, packed: GroupQuantWeight, scheme: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.packed = packed
        self.scheme = scheme  # e.g. "int8", "int4", "gguf Q5_0"
        self.dense_dtype = dtype

    @property
    def weight(self) -> torch.Tensor:
        """The de-quantized weight `(rows, columns)` in the model's dtype (made once, then kept)."""
        cache = self.packed.__dict__.setdefault("_dense", {})
        if self.dense_dtype not in cache:
            cache[self.dense_dtype] = self.packed.dequantize().to(self.dense_dtype)
        return cache[self.dense_dtype]

    def _apply(self, fn, recurse: bool = True):
        probes = [fn(torch.zeros(1, dtype=dtype)) for dtype in (torch.float32, torch.float16)]
        if probes[0].device.type != "cpu":
            raise ValueError(
                f"{type(self).__name__} ({self.scheme}) runs on the CPU only, not on {probes[0].device}"
            )
        if probes[0].dtype == probes[1].dtype and probes[0].is_floating_point():
            self.dense_dtype = probes[
                0
            ].dtype  # `.weight` follows a cast of the model; the packed weight does not
        return super()._apply(fn, recurse)


class QuantizedLinear(_Packed):
    """`y = x @ W.T (+ bias)` `(..., out_features)` for x `(..., in_features)` with W group-quantized: float32 sums,
    y in x's dtype, by hf-spec's kernel for 1..64 rows (each row's bits independent of the others) and by its torch
    twin otherwise (`hf_spec.kernels.group_quant`)."""

    def __init__(
        self, packed: GroupQuantWeight, bias: torch.Tensor | None, scheme: str, dtype: torch.dtype
    ) -> None:
        super().__init__(packed, scheme, dtype)
        self.in_features, self.out_features = packed.in_features, packed.out_features
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quantized_linear(x, self.packed, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"scheme={self.scheme}, group_size={self.packed.group_size}"
        )


class QuantizedEmbedding(_Packed):
    """An `nn.Embedding` whose rows are de-quantized on lookup: ids `(...)` -> `(..., embedding_dim)` in the
    model's dtype, the float32 weight rows rounded once (as an embedding de-quantized at load holds them)."""

    def __init__(
        self, packed: GroupQuantWeight, scheme: str, dtype: torch.dtype, padding_idx: int | None = None
    ) -> None:
        super().__init__(packed, scheme, dtype)
        self.num_embeddings, self.embedding_dim = packed.out_features, packed.in_features
        self.padding_idx = padding_idx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.packed.dequantize(ids.reshape(-1))
        return rows.to(self.dense_dtype).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, scheme={self.scheme}"


__all__ = ["QuantizedEmbedding", "QuantizedLinear"]
