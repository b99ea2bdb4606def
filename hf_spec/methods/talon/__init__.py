from hf_spec.core.registry import register_method
from hf_spec.methods.talon.config import TalonConfig
from hf_spec.methods.talon.drafter import TalonDrafter

register_method("talon", TalonConfig, TalonDrafter)
