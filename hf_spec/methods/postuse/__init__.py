from hf_spec.core.registry import register_method
from hf_spec.methods.postuse.config import PostUseConfig
from hf_spec.methods.postuse.controller import PreCutController
from hf_spec.methods.postuse.drafter import PostUseDrafter
from hf_spec.methods.postuse.token_cache import TokenCache

register_method("postuse", PostUseConfig, PostUseDrafter)

__all__ = ["PostUseConfig", "PostUseDrafter", "PreCutController", "TokenCache"]
