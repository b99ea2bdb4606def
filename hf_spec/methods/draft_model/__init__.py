from hf_spec.methods.draft_model.config import DraftModelConfig
from hf_spec.methods.draft_model.drafter import DraftModelDrafter
from hf_spec.registry import register_method

register_method("draft-model", DraftModelConfig, DraftModelDrafter)
