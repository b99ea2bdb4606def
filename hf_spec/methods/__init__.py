"""Built-in methods; importing this package registers them."""

from hf_spec.methods import draft_model, early_exit, oracle, pld  # noqa: F401
from hf_spec.methods.base import Drafter, RoundResult, SpecState

__all__ = ["Drafter", "RoundResult", "SpecState"]
