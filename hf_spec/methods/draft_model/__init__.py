from hf_spec.core.registry import register_method
from hf_spec.methods.draft_model.config import DraftModelConfig
from hf_spec.methods.draft_model.drafter import DraftModelDrafter

register_method("draft-model", DraftModelConfig, DraftModelDrafter)
