"""What a benchmark or training report records about the machine and software it ran on."""

from __future__ import annotations

import datetime
import os
import platform
import re

import torch

from hf_spec.kernels.skinny_linear import bf16_kernel_decision, one_row_kernel_decision


def machine_info() -> dict:
    """CPU model, cores, torch threads, Python / torch / transformers versions, the UTC date, and the CPU kernel
    decisions hf-spec measured in this process (None where none was measured)."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    import transformers

    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "one_row_kernel": one_row_kernel_decision(),  # None: never measured (no one-row draft forward ran)
        "bf16_kernel_rows": bf16_kernel_decision(),  # None: never measured (no bfloat16 linear ran on hf-spec's path)
    }


def machine_class(machine: dict) -> str:
    """`amd-epyc-2c-bfloat16`: the CPU (or device) name, core count and dtype, as a folder name."""
    name = (
        machine.get("cpu", "cpu") if machine.get("device", "cpu") == "cpu" else machine.get("device", "gpu")
    )
    slug = re.sub(r"\(r\)|\(tm\)|processor|cpu|\d+-core", "", name.lower())
    slug = re.sub(r"[^a-z0-9]+", "-", slug).strip("-") or "machine"
    return f"{slug}-{machine.get('cores', 0)}c-{machine.get('dtype', 'float32')}"
