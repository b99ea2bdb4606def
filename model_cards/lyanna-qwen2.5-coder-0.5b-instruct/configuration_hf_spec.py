"""Re-exports hf-spec's config classes for `trust_remote_code` loading. Requires `pip install hf-spec`."""

from hf_spec.methods.lyanna.modeling import LyannaHeadConfig  # noqa: F401
