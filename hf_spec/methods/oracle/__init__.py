from hf_spec.methods.oracle.config import OracleConfig
from hf_spec.methods.oracle.drafter import OracleDrafter
from hf_spec.registry import register_method

register_method("oracle", OracleConfig, OracleDrafter)
