"""`keep_freed_memory` (CPU head training): on glibc tensors allocated again after ones of their size were freed
reuse their pages instead of faulting them in again; `HF_SPEC_KEEP_FREED_MEMORY=0` leaves malloc as it is."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from hf_spec.training import host_memory

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

REALLOCATE = """
import resource, sys, torch
from hf_spec.training.host_memory import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else False
x = torch.ones(16 * 2**20)  # 64 MB: above glibc's largest mmap threshold
del x
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):  # two 64 MB tensors a cycle, both freed before the next, as in a training step
    y = torch.ones(16 * 2**20) + 1
    del y
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
PAGES = 20 * 16 * 2**20 * 4 // 4096  # the 20 tensors' 4 KiB pages: each faulted in when none is reused


def page_faults_of_reallocations(mode: str, switch: str = "1") -> tuple[str, int]:
    env = os.environ | {"HF_SPEC_KEEP_FREED_MEMORY": switch}
    out = subprocess.run([sys.executable, "-c", REALLOCATE, mode], capture_output=True, text=True, env=env,
                         check=True).stdout.split()  # fmt: skip
    return out[0], int(out[1])


@glibc
def test_freed_pages_are_reused_instead_of_faulted_in_again():
    applied, kept = page_faults_of_reallocations("keep")
    assert applied == "True"
    applied, plain = page_faults_of_reallocations("plain")
    assert applied == "False" and plain > 0.9 * PAGES  # every tensor's pages fresh from the kernel
    assert kept < plain / 3  # most tensors reuse the pages the last one freed
    applied, off = page_faults_of_reallocations("keep", switch="0")
    assert applied == "False" and off > 0.9 * PAGES


def test_switched_off_by_its_variable(monkeypatch):
    monkeypatch.setattr(host_memory, "_applied", False)
    monkeypatch.setenv("HF_SPEC_KEEP_FREED_MEMORY", "0")
    assert host_memory.keep_freed_memory() is False
    monkeypatch.setenv("HF_SPEC_KEEP_FREED_MEMORY", "maybe")
    with pytest.raises(ValueError, match="HF_SPEC_KEEP_FREED_MEMORY"):
        host_memory.keep_freed_memory()
