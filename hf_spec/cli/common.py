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
        help="target weights' dtype; auto: bfloat16 on a GPU that has it and on a CPU with AMX/AVX512-BF16 "
        "(multi-token forwards cost little more than one there), float32 otherwise",
    )


def add_device_argument(parser) -> None:
    parser.add_argument(
        "--device",
        default="auto",
        help="where the target runs: auto (cuda when torch sees a GPU, else cpu), cpu, cuda, cuda:1, ...",
    )


def resolve_device(name: str) -> torch.device:
    """`auto`: the first CUDA device when torch sees one, else the CPU; otherwise the named device, checked."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"--device {name!r} is not a device torch knows ({err})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: torch sees no CUDA device (a CPU-only torch build, or no GPU)")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: torch sees {torch.cuda.device_count()} CUDA device(s)")
    return device


def load_target(args):
    """`(model, tokenizer)` of `--target` on `--device`, in `--dtype` (float32 for commands without one)."""
    from hf_spec.models import load_model

    device = resolve_device(args.device)
    dtype = resolve_dtype(getattr(args, "dtype", "float32"), device)
    return load_model(args.target, dtype=dtype, device=device)


def resolve_dtype(name: str, device: torch.device | str = "cpu") -> torch.dtype:
    """`auto` picks bfloat16 on a GPU that has it and where the CPU multiplies it natively, else float32."""
    if name == "auto" and torch.device(device).type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    if name == "auto":
        probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")  # private in torch 2.x: probe softly
        native = any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)
        return torch.bfloat16 if native else torch.float32
    return getattr(torch, name)
