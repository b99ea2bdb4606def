"""What the round needs to know about a target model, worked out once per (model, dtype, device).

A round asks the same questions of the target every time: which layers slide, by what name its forward takes the
cache, whether its attention dispatches by name (so the grouped-attention kernel may replace `sdpa`), which kernel
backend runs it, whether its LM head may be screened, how its weights are stored and placed (quantized, offloaded:
`hf_spec.engine.target.placement`). `target_profile(model)` answers them once and keeps the
answers on the model, recomputed when the model's dtype, device, attention config or an `HF_SPEC_*` setting they
depend on changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from hf_spec.core import envs
from hf_spec.core.compat import forward_cache_name
from hf_spec.engine.backend import Backend, TorchBackend, backend_for
from hf_spec.engine.target.placement import Int8RowsBackend, TargetPlacement, input_device, target_placement
from hf_spec.engine.target.windows import attention_windows

_PROFILE_KEY = "_hf_spec_profile"


@dataclass(frozen=True)
class TargetProfile:
    """Facts about a target model that hold for a whole generation.

    Args:
        windows: each decoder layer's sliding window (`None`: full attention).
        cache_name: the forward argument that takes the KV cache (`cache` or `past_key_values`).
        dispatches_attention: layers take their attention function from transformers' `AttentionInterface`.
        backend: the kernel backend for this model's forwards.
        can_screen: greedy verification may read the int8-screened LM head (when nothing but the argmax is read).
        device / dtype: where the model takes its inputs (the embedding's device) and its compute precision.
        placement: how the weights are stored and placed (quantization, offloading, devices).
    """

    windows: tuple[int | None, ...]
    cache_name: str
    dispatches_attention: bool
    backend: Backend
    can_screen: bool
    device: torch.device
    dtype: torch.dtype
    placement: TargetPlacement

    @property
    def int8_rows(self) -> bool:
        """The target's LLM.int8 layers pick outlier columns over all rows of a forward: the prefill takes the
        whole prompt, as `generate` does (`hf_spec.engine.target.int8_rows`)."""
        return self.placement.int8_rows

    @property
    def rounded_inputs(self) -> bool:
        """Some linears round their inputs to int8 (`TargetPlacement.rounded_inputs`)."""
        return self.placement.rounded_inputs

    @property
    def sliding(self) -> bool:
        return any(w is not None for w in self.windows)

    def screens(self, do_sample: bool, has_processors: bool, returns_scores: bool) -> bool:
        """Whether this generation reads nothing but each verification row's argmax, and the head may be screened
        (`HF_SPEC_SCREENED_HEAD=0` turns screening off)."""
        return (
            self.can_screen
            and envs.HF_SPEC_SCREENED_HEAD
            and not (do_sample or has_processors or returns_scores)
        )


def target_profile(model: PreTrainedModel) -> TargetProfile:
    """The model's `TargetProfile`, computed at the first call and again when what it depends on changed."""
    weight = _embedding_weight(model)  # a quantized model's first parameter may be int8
    config = model.config
    placement = target_placement(model)
    key = (
        weight.device,
        weight.dtype,
        placement,
        getattr(config, "_attn_implementation", None),
        envs.HF_SPEC_BACKEND,
        envs.HF_SPEC_SCREENED_HEAD,
        envs.HF_SPEC_NO_CPP_KERNELS,
        tuple(
            attention_windows(model)
        ),  # cached on the model; raises for layers a tree cannot be verified with
    )
    cached = model.__dict__.get(_PROFILE_KEY)
    if cached is not None and cached[0] == key:
        return cached[1]
    backend = _backend(placement, key[4])
    dispatches = (
        getattr(type(model), "_supports_attention_backend", False)
        and not getattr(config, "sub_configs", None)  # a composite model: its parts keep their own settings
    )
    profile = TargetProfile(
        windows=key[-1],
        cache_name=forward_cache_name(type(model)),
        dispatches_attention=bool(dispatches),
        backend=backend,
        can_screen=backend.can_screen(model),
        device=input_device(model),
        dtype=weight.dtype,
        placement=placement,
    )
    model.__dict__[_PROFILE_KEY] = (key, profile)
    return profile


def _embedding_weight(model: PreTrainedModel) -> torch.Tensor:
    try:
        return model.get_input_embeddings().weight
    except (NotImplementedError, AttributeError):  # a model without the accessor: its first parameter
        return next(model.parameters())


def _backend(placement: TargetPlacement, forced: str | None) -> Backend:
    """`backend_for` the target's device, stock torch where hf-spec's CPU kernels cannot read its weights
    (offloaded, spread over devices, quantized tensor subclasses), row-local LLM.int8 layers where they need it."""
    kinds = {torch.device(d).type for d in placement.devices} or {"cpu"}
    device_type = kinds.pop() if len(kinds) == 1 else "mixed"  # "mixed": stock torch
    backend = backend_for(device_type, forced)
    if type(backend) is not TorchBackend and device_type == "cpu" and not placement.cpu_kernels_apply:
        if forced:
            raise ValueError(
                f"HF_SPEC_BACKEND={forced}: hf-spec's CPU kernels cannot run this target ({placement.describe()}: "
                "they read plain weights resident on the CPU); unset it to run stock torch"
            )
        backend = TorchBackend()
    return Int8RowsBackend(backend) if placement.int8_rows else backend
