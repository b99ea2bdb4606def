"""The contract every other part of hf-spec builds on, importing nothing above it.

- `drafter`: the `Drafter` interface, `SpecState` and `RoundResult` (with `hf_spec.tree.DraftTree`, what a drafter
  proposes);
- `config`: `MethodConfig`, the typed base of every method's settings, and its schema;
- `registry`: method name -> (config class, drafter class), built-in methods imported only when asked for;
- `specs`: method specs (`"pld"`, `"early-exit:6"`, a saved config, a Hub id) read into configs;
- `compat` (transformers-version shims), `envs` (every `HF_SPEC_*` variable), `hub_ids` (Hub ids as folders).
"""

from hf_spec.core.config import MethodConfig
from hf_spec.core.drafter import Drafter, RoundResult, SpecState
from hf_spec.core.registry import get_method, list_methods, register_method
from hf_spec.core.specs import parse_method
from hf_spec.tree.draft_tree import DraftTree

__all__ = [
    "DraftTree",
    "Drafter",
    "MethodConfig",
    "RoundResult",
    "SpecState",
    "get_method",
    "list_methods",
    "parse_method",
    "register_method",
]
