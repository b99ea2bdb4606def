"""Every `HF_SPEC_*` environment variable hf-spec reads, in one table (`ENVIRONMENT_VARIABLES`).

Read them as attributes of this module: `envs.HF_SPEC_SCREENED_HEAD` parses the variable at each read (a module
`__getattr__`), so a value changed while the process runs (`os.environ[...] = ...`, pytest's `monkeypatch.setenv`)
applies from the next read on. An unset or empty variable means its default; a value that is not one of the
accepted spellings raises `ValueError` naming the variable. `docs/environment.md` shows this table
(`markdown_table()`; a test keeps the two equal).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class EnvVar:
    """One variable: `parse(value)` turns its value (stripped; None where unset or empty) into what the code
    reads, raising `ValueError` for a value it does not accept."""

    parse: Callable[[str | None], Any]
    default: str  # what an unset variable means, as docs/environment.md shows it
    doc: str  # one line: what it does


def _switch(value: str | None, default: bool | None) -> bool | None:
    if value is None:
        return default
    word = value.lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    if default is None and word == "auto":
        return None
    measured = ", auto (measure)" if default is None else ""
    raise ValueError(f"{value!r} is not one of 1, 0, true, false, yes, no, on, off{measured}")


def _flag(default: bool) -> Callable[[str | None], bool]:
    """An on/off switch."""
    return lambda value: _switch(value, default)


def _forced(value: str | None) -> bool | None:
    """A decision hf-spec measures at run time: None (unset or `auto`) measures, 1 / 0 force it."""
    return _switch(value, None)


def _backend_name(value: str | None) -> str | None:
    """None (unset or `auto`): chosen by the model's device; else a backend's name, checked where it is used."""
    return None if value is None or value.lower() == "auto" else value.lower()


def _cache_root(value: str | None) -> Path:
    return Path(value).expanduser() if value else Path.home() / ".cache" / "hf-spec"


def _kernel_cache(value: str | None) -> Path:
    if value:
        return Path(value).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "hf-spec" / "torch_extensions"


ENVIRONMENT_VARIABLES: dict[str, EnvVar] = {
    "HF_SPEC_BACKEND": EnvVar(
        _backend_name,
        "auto",
        "Kernel backend of every forward: `cpu` (hf-spec's CPU kernels), `triton` (stock torch forwards, the "
        "round's acceptance, cache compaction, tree masks and draft top-k in Triton kernels; on CPU tensors only "
        "with `TRITON_INTERPRET=1`), `torch` (stock torch); auto: `cpu` for a model on the CPU, `triton` on CUDA "
        "where triton is installed, `torch` elsewhere.",
    ),
    "HF_SPEC_CACHE": EnvVar(
        _cache_root,
        "`~/.cache/hf-spec`",
        "Cache root: fetched models, training data and features, run checkpoints, retrieval datastores.",
    ),
    "HF_SPEC_DEBUG": EnvVar(
        _flag(False), "0", "1: the `hf-spec` command shows the traceback of bad input, not a one-line error."
    ),
    "HF_SPEC_TREE_CHECK": EnvVar(
        _flag(True),
        "1",
        "0: skip the one-time check that a model verifies token trees correctly (a few forwards of a small tree).",
    ),
    "HF_SPEC_NO_CPP_KERNELS": EnvVar(
        _flag(False), "0", "1: never build or use the C++ CPU kernels; torch's matmuls run instead."
    ),
    "HF_SPEC_KERNEL_CACHE": EnvVar(
        _kernel_cache,
        "`$XDG_CACHE_HOME/hf-spec/torch_extensions` (`~/.cache/...` without `XDG_CACHE_HOME`)",
        "Where the C++ kernels are built (one folder per Python, torch and kernel source version).",
    ),
    "HF_SPEC_ONE_ROW_KERNEL": EnvVar(
        _forced,
        "auto",
        "1 / 0: one-row float32 linears do / do not use the C++ kernel (auto: timed once against torch).",
    ),
    "HF_SPEC_MM_TRICK": EnvVar(
        _forced,
        "auto",
        "1 / 0: few-row linears outside the kernel do / do not run as `(W @ x.T).T` (auto: timed once).",
    ),
    "HF_SPEC_BF16_KERNEL": EnvVar(
        _forced,
        "auto",
        "1 / 0: bfloat16 linears of 1-20 rows do / do not use the AVX512-BF16 kernel (auto: timed per row count).",
    ),
    "HF_SPEC_KEEP_FREED_MEMORY": EnvVar(
        _flag(True),
        "1",
        "0: head training on the CPU lets glibc return freed memory to the kernel (else each step reuses the pages "
        "the last one freed, instead of faulting its large tensors in again).",
    ),
    "HF_SPEC_GROUPED_ATTENTION": EnvVar(
        _flag(True),
        "1",
        "0: keep transformers' `sdpa` for verification's few query rows instead of the grouped-query product.",
    ),
    "HF_SPEC_SCREENED_HEAD": EnvVar(
        _flag(True),
        "1",
        "0: greedy verification computes the full LM head instead of screening it with int8 weights.",
    ),
    "HF_SPEC_CPP_WRAPPER": EnvVar(
        _flag(True),
        "1",
        "0: hf-spec's compiled CPU rounds keep inductor's Python wrapper instead of its C++ one (`cpp_wrapper`).",
    ),
    "HF_SPEC_SCREEN_INT8_X": EnvVar(
        _flag(True),
        "1",
        "0: the screened LM head keeps x in float32 (else quantized to int8 too on AVX512-VNNI CPUs).",
    ),
}


def __getattr__(name: str) -> Any:
    var = ENVIRONMENT_VARIABLES.get(name)
    if var is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        return var.parse(os.environ.get(name, "").strip() or None)
    except ValueError as e:
        raise ValueError(f"environment variable {name}: {e}") from None


def is_set(name: str) -> bool:
    """Whether the known variable `name` is in the environment at all: the cheap test a per-call check makes before
    reading (and parsing) it."""
    if name not in ENVIRONMENT_VARIABLES:
        raise KeyError(f"unknown hf-spec environment variable {name!r}")
    return name in os.environ


def __dir__() -> list[str]:
    return sorted([*globals(), *ENVIRONMENT_VARIABLES])


def markdown_table() -> str:
    """The table of docs/environment.md: one row per variable (name, default, what it does)."""
    rows = ["| Variable | Default | What it does |", "| --- | --- | --- |"]
    rows += [f"| `{name}` | {var.default} | {var.doc} |" for name, var in ENVIRONMENT_VARIABLES.items()]
    return "\n".join(rows)
