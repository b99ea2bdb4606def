"""What the round needs to know about a target model, worked out once per (model, dtype, device).

A round asks the same questions of the target every time: which layers slide, by what name its forward takes the
cache, whether its attention dispatches by name (so the grouped-attention kernel may replace `sdpa`), which kernel
backend runs it, whether its LM head may be screened. `target_profile(model)` answers them once and keeps the
answers on the model, recomputed when the model's dtype, device, attention config or an `HF_SPEC_*` setting they
depend on changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from hf_spec import envs
from hf_spec.compat import forward_cache_name
from hf_spec.engine.backend import Backend, backend_for
from hf_spec.verify.windows import attention_windows

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
        device / dtype: where and in what precision the model's weights are.
    """

    windows: tuple[int | None, ...]
    cache_name: str
    dispatches_attention: bool
    backend: Backend
    can_screen: bool
    device: torch.device
    dtype: torch.dtype

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
    weight = next(model.parameters())
    config = model.config
    key = (
        weight.device,
        weight.dtype,
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
    backend = backend_for(weight.device.type, key[3])
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
        device=weight.device,
        dtype=weight.dtype,
    )
    model.__dict__[_PROFILE_KEY] = (key, profile)
    return profile
