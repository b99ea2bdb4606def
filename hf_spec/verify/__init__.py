"""Verification: acceptance rules for token trees and KV-cache bookkeeping."""

from hf_spec.verify.acceptance import Acceptance, accept_greedy, accept_sampling
from hf_spec.verify.cache import cache_length, compact_cache, crop_cache

__all__ = ["Acceptance", "accept_greedy", "accept_sampling", "cache_length", "compact_cache", "crop_cache"]
