"""Benchmark harness behind `hf-spec bench`."""

from hf_spec.bench.runner import load_prompts, run_bench, write_outputs

__all__ = ["load_prompts", "run_bench", "write_outputs"]
