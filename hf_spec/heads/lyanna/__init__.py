from hf_spec.heads.lyanna.modeling import LyannaHeadConfig, LyannaHeadModel

__all__ = ["LyannaHeadConfig", "LyannaHeadModel"]
