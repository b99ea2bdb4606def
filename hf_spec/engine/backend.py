"""Kernel backends: which implementation runs the target's and the drafters' forwards.

A backend is chosen once per target (model, dtype, device; see `hf_spec.engine.profile`) and entered as a context
around the two kinds of forward a round makes:

- `verification(model, screen)`: the one target forward over `[root] + tree`;
- `drafting(module, linears)`: a drafter's own forward through the target's layers or a draft model;
- `attention(config)` / `packed_linears(module, weights)`: a draft head's layer attention and its packed weights;
- `plain_decoding(model)`: transformers' own loop, where a batch is decoded without speculation.

Nothing else in the loop, the drafter base class or the decoder knows a kernel exists. `TorchBackend` runs stock
torch everywhere (the reference, and what runs on accelerators); `CpuBackend` routes few-row linears through
hf-spec's skinny-GEMM kernel, verifies greedy rounds with the int8-screened LM head where nothing but the argmax is
read, and runs few-row attention without `repeat_kv` copies (`hf_spec/kernels/`). Both give the same tokens: the
kernels compute the same sums in another order, and the screen returns the exact argmax.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import ClassVar

from torch import nn


class Backend:
    """Stock torch: every context is a no-op (the reference; accelerators)."""

    name: ClassVar[str] = "torch"

    @contextlib.contextmanager
    def verification(self, model: nn.Module, screen: bool = False) -> Iterator[None]:
        """Around the verification forward of `model`; `screen`: only each row's argmax is read."""
        yield

    @contextlib.contextmanager
    def drafting(self, module: nn.Module, linears: bool = False) -> Iterator[None]:
        """Around a drafter's forward through `module` (the target's layers, or a draft model); `linears`: its
        few-row linears may take the fast path too (their results feed a verification: HiSpec's stages)."""
        yield

    @contextlib.contextmanager
    def plain_decoding(self, model: nn.Module) -> Iterator[None]:
        """Around transformers' own decoding loop over `model` (no speculation)."""
        yield

    @contextlib.contextmanager
    def attention(self, config) -> Iterator[None]:
        """Around the forward of layers built from `config` (a draft head's decoder layer)."""
        yield

    @contextlib.contextmanager
    def packed_linears(self, module: nn.Module, weights: Mapping) -> Iterator[None]:
        """`module`'s linears read the packed copies in `weights` (`{nn.Linear: QuantizedWeight}`, a drafter's
        `quantize` setting); an empty mapping changes nothing."""
        if not weights:
            yield
            return
        from hf_spec.kernels.weight_only import draft_linears

        with draft_linears(module, weights):
            yield

    def can_screen(self, model: nn.Module) -> bool:
        """Whether greedy verification of `model` may read the int8-screened LM head (model-level facts only)."""
        return False

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


TorchBackend = Backend


class CpuBackend(Backend):
    """hf-spec's CPU kernels (skinny GEMM, screened LM head, grouped attention) where they apply."""

    name: ClassVar[str] = "cpu"

    @contextlib.contextmanager
    def verification(self, model: nn.Module, screen: bool = False) -> Iterator[None]:
        from hf_spec.kernels.grouped_attention import grouped_attention
        from hf_spec.kernels.screened_head import screened_lm_head
        from hf_spec.kernels.skinny_linear import fast_linears

        # the screened head first: `fast_linears` leaves modules it finds patched alone
        with screened_lm_head(model, enabled=screen), fast_linears(model), grouped_attention(model):
            yield

    @contextlib.contextmanager
    def drafting(self, module: nn.Module, linears: bool = False) -> Iterator[None]:
        from hf_spec.kernels.grouped_attention import grouped_attention
        from hf_spec.kernels.skinny_linear import fast_linears

        with fast_linears(module, enabled=linears), grouped_attention(module):
            yield

    @contextlib.contextmanager
    def plain_decoding(self, model: nn.Module) -> Iterator[None]:
        with self.drafting(model, linears=True):
            yield

    @contextlib.contextmanager
    def attention(self, config) -> Iterator[None]:
        from hf_spec.kernels.grouped_attention import attention_of

        with attention_of(config):
            yield

    def can_screen(self, model: nn.Module) -> bool:
        from hf_spec.kernels.screened_head import screening_applies

        return screening_applies(model, do_sample=False, has_processors=False, returns_scores=False)


BACKENDS: dict[str, type[Backend]] = {"torch": TorchBackend, "cpu": CpuBackend}


def backend_for(device_type: str, forced: str | None = None) -> Backend:
    """The backend for weights on `device_type`: `cpu` on the CPU, `torch` elsewhere; `forced` (a name in
    `BACKENDS`, from `HF_SPEC_BACKEND`) overrides the choice."""
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"HF_SPEC_BACKEND must be one of {sorted(BACKENDS)}, got {forced!r}")
        return BACKENDS[forced]()
    return CpuBackend() if device_type == "cpu" else TorchBackend()
