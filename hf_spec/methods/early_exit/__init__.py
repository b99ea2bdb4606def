from hf_spec.methods.early_exit.config import EarlyExitConfig
from hf_spec.methods.early_exit.drafter import EarlyExitDrafter
from hf_spec.registry import register_method

register_method("early-exit", EarlyExitConfig, EarlyExitDrafter)
