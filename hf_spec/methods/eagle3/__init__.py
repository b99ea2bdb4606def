"""`eagle3`: EAGLE-3 heads (published or hf-spec's own) drafting EAGLE-2 dynamic trees.

Public names other parts of hf-spec build on: `Eagle3Head` / `Eagle3HeadConfig` (the head module, for decoding and
training) and `save_eagle3_head` (hf-spec's EAGLE-3 head folder format).
"""

from hf_spec.core.registry import register_method
from hf_spec.methods.eagle3.config import Eagle3Config
from hf_spec.methods.eagle3.drafter import Eagle3Drafter, load_eagle3_head
from hf_spec.methods.eagle3.export import save_eagle3_head
from hf_spec.methods.eagle3.modeling import Eagle3Head, Eagle3HeadConfig, default_hidden_state_indices
from hf_spec.methods.eagle3.published import load_eagle3_checkpoint

register_method("eagle3", Eagle3Config, Eagle3Drafter)

__all__ = [
    "Eagle3Config",
    "Eagle3Drafter",
    "Eagle3Head",
    "Eagle3HeadConfig",
    "default_hidden_state_indices",
    "load_eagle3_checkpoint",
    "load_eagle3_head",
    "save_eagle3_head",
]
