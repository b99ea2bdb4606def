"""Exit heads: light adapters that let a target's own final norm and LM head read an intermediate layer."""

from hf_spec.heads.exits.config import ExitHeadsConfig
from hf_spec.heads.exits.model import ExitAdapter, ExitHeads, ExitLM

__all__ = ["ExitAdapter", "ExitHeads", "ExitHeadsConfig", "ExitLM"]
