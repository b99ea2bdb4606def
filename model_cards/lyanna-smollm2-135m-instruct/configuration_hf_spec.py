"""Re-exports hf-spec's config classes for `trust_remote_code` loading. Requires `pip install hf-spec`."""

from hf_spec.heads.lyanna.modeling import LyannaHeadConfig  # noqa: F401
