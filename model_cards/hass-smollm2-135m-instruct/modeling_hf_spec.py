"""Re-exports hf-spec's model classes for `trust_remote_code` loading. Requires `pip install hf-spec`."""

from hf_spec.methods.eagle.modeling import EagleHeadConfig, EagleHeadModel  # noqa: F401
