from hf_spec.core.registry import register_method
from hf_spec.methods.hispec.config import HiSpecConfig
from hf_spec.methods.hispec.drafter import HiSpecDrafter

register_method("hispec", HiSpecConfig, HiSpecDrafter)
