from hf_spec.core.registry import register_method
from hf_spec.methods.lyanna.config import LyannaConfig
from hf_spec.methods.lyanna.drafter import LyannaDrafter

register_method("lyanna", LyannaConfig, LyannaDrafter)
