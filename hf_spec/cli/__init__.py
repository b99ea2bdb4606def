"""The `hf-spec` command line."""
