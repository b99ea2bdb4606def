from hf_spec.methods.eagle.config import EagleConfig
from hf_spec.methods.eagle.drafter import EagleDrafter
from hf_spec.registry import register_method

register_method("eagle", EagleConfig, EagleDrafter)
