"""Re-exports hf-spec's model classes for `trust_remote_code` loading. Requires `pip install hf-spec`."""

from hf_spec.heads.lyanna.modeling import LyannaHeadConfig, LyannaHeadModel  # noqa: F401
