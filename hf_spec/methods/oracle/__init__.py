from hf_spec.core.registry import register_method
from hf_spec.methods.oracle.config import OracleConfig
from hf_spec.methods.oracle.drafter import OracleDrafter

register_method("oracle", OracleConfig, OracleDrafter)
