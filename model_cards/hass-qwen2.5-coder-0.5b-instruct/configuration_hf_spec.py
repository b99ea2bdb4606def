"""Re-exports hf-spec's config classes for `trust_remote_code` loading. Requires `pip install hf-spec`."""

from hf_spec.methods.eagle.modeling import EagleHeadConfig  # noqa: F401
