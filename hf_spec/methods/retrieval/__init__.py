from hf_spec.methods.retrieval.config import RetrievalConfig
from hf_spec.methods.retrieval.drafter import RetrievalDrafter
from hf_spec.registry import register_method

register_method("retrieval", RetrievalConfig, RetrievalDrafter)
