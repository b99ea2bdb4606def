"""hf-spec: lossless speculative decoding behind Hugging Face `model.generate`."""

from hf_spec.core.config import MethodConfig
from hf_spec.core.drafter import Drafter, RoundResult, SpecState
from hf_spec.core.registry import get_method, list_methods, register_method
from hf_spec.core.specs import parse_method
from hf_spec.decoder import SpeculativeDecoder
from hf_spec.engine.outputs import SpecDecodeOutput, SpecStats
from hf_spec.engine.sequence import speculative_generate
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
