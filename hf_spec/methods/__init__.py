"""Built-in methods: every sub-package registers itself on import (`register_method` in its `__init__`)."""

import importlib
import pkgutil

from hf_spec.methods.base import Drafter, RoundResult, SpecState

for _info in pkgutil.iter_modules(__path__):
    if _info.ispkg:
        importlib.import_module(f"{__name__}.{_info.name}")

__all__ = ["Drafter", "RoundResult", "SpecState"]
