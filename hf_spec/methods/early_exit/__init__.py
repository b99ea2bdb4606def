from hf_spec.core.registry import register_method
from hf_spec.methods.early_exit.config import EarlyExitConfig
from hf_spec.methods.early_exit.drafter import EarlyExitDrafter

register_method("early-exit", EarlyExitConfig, EarlyExitDrafter)
