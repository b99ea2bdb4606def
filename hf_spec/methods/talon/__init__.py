from hf_spec.methods.talon.config import TalonConfig
from hf_spec.methods.talon.drafter import TalonDrafter
from hf_spec.registry import register_method

register_method("talon", TalonConfig, TalonDrafter)
