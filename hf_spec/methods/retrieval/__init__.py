from hf_spec.core.registry import register_method
from hf_spec.methods.retrieval.config import RetrievalConfig
from hf_spec.methods.retrieval.drafter import RetrievalDrafter

register_method("retrieval", RetrievalConfig, RetrievalDrafter)
