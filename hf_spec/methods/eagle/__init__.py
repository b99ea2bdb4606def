from hf_spec.core.registry import register_method
from hf_spec.methods.eagle.config import EagleConfig
from hf_spec.methods.eagle.drafter import EagleDrafter

register_method("eagle", EagleConfig, EagleDrafter)
