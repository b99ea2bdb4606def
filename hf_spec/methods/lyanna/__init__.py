from hf_spec.methods.lyanna.config import LyannaConfig
from hf_spec.methods.lyanna.drafter import LyannaDrafter
from hf_spec.registry import register_method

register_method("lyanna", LyannaConfig, LyannaDrafter)
