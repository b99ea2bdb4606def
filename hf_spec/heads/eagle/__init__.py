from hf_spec.heads.eagle.modeling import EagleHeadConfig, EagleHeadModel

__all__ = ["EagleHeadConfig", "EagleHeadModel"]
