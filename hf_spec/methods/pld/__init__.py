from hf_spec.methods.pld.config import PLDConfig
from hf_spec.methods.pld.drafter import PLDDrafter
from hf_spec.registry import register_method

register_method("pld", PLDConfig, PLDDrafter)
