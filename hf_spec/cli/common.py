"""Helpers shared by sub-commands."""

from __future__ import annotations

import os

import torch


def set_threads(threads: int | None) -> int:
    n = threads or os.cpu_count() or 1
    torch.set_num_threads(n)
    return n


DTYPES = ("float32", "bfloat16", "float16", "auto")


def add_dtype_argument(parser, default: str = "float32") -> None:
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default=default,
        help="target weights' dtype; auto: bfloat16 on a CPU with AMX/AVX512-BF16 (multi-token forwards cost "
        "little more than one there), float32 otherwise",
    )


def resolve_dtype(name: str) -> torch.dtype:
    """`auto` picks bfloat16 where the CPU multiplies it natively, else float32."""
    if name == "auto":
        probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")  # private in torch 2.x: probe softly
        native = any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)
        return torch.bfloat16 if native else torch.float32
    return getattr(torch, name)
