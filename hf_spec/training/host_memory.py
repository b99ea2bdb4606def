"""Host memory for CPU training: keep what a step frees for the next step.

A training step on the CPU allocates tensors of tens of megabytes (the draft vocabulary's logits, the attention
scores of the unrolled steps, their gradients) and frees them at its end. glibc hands blocks that large to the
kernel as they are freed (`mmap` / `munmap`, and trims the heap's free top), so the next step's same-sized tensors
fault every page in again, each one zeroed by the kernel. Serving every allocation from the heap and never trimming
it lets the next step reuse those pages: the process keeps its peak memory, which a training run reaches every step
anyway. docs/training.md gives what it saved on one machine."""

from __future__ import annotations

import ctypes
import platform

from hf_spec.core import envs

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # mallopt parameters (glibc's malloc.h)
_INT_MAX = 2**31 - 1  # mallopt takes an int: never trim a free heap top below 2 GiB
_applied = False


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory in this process (no `mmap` for large blocks, no heap trimming);
    returns whether it applies: once per process, not with `HF_SPEC_KEEP_FREED_MEMORY=0`, and only where the C
    library is glibc (other allocators are left as they are)."""
    global _applied
    if _applied:
        return True
    if not envs.HF_SPEC_KEEP_FREED_MEMORY or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    _applied = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _INT_MAX))
    return _applied
