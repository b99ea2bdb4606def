"""hf-spec: lossless speculative decoding behind Hugging Face `model.generate`."""

from hf_spec.config import MethodConfig
from hf_spec.decoder import SpeculativeDecoder
from hf_spec.engine.sequence import speculative_generate
from hf_spec.methods.base import Drafter, RoundResult, SpecState
from hf_spec.outputs import SpecDecodeOutput, SpecStats
from hf_spec.registry import get_method, list_methods, parse_method, register_method
from hf_spec.tree.draft_tree import DraftTree

__version__ = "0.1.0"

__all__ = [
    "Drafter",
    "DraftTree",
    "MethodConfig",
    "RoundResult",
    "SpecDecodeOutput",
    "SpecState",
    "SpecStats",
    "SpeculativeDecoder",
    "get_method",
    "list_methods",
    "parse_method",
    "register_method",
    "speculative_generate",
]
