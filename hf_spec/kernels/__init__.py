"""Kernels: pure functions, each with a plain torch reference. CPU paths never import triton."""
