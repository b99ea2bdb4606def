from hf_spec.core.registry import register_method
from hf_spec.methods.pld.config import PLDConfig
from hf_spec.methods.pld.drafter import PLDDrafter

register_method("pld", PLDConfig, PLDDrafter)
