"""Helpers shared by sub-commands."""

from __future__ import annotations

import os

import torch


def set_threads(threads: int | None) -> int:
    n = threads or os.cpu_count() or 1
    torch.set_num_threads(n)
    return n
