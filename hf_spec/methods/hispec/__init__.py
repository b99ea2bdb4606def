from hf_spec.methods.hispec.config import HiSpecConfig
from hf_spec.methods.hispec.drafter import HiSpecDrafter
from hf_spec.registry import register_method

register_method("hispec", HiSpecConfig, HiSpecDrafter)
