"""Helpers shared by sub-commands."""

from __future__ import annotations

import argparse
import json
import os
import warnings

import torch


def set_threads(threads: int | None) -> int:
    n = threads or os.cpu_count() or 1
    torch.set_num_threads(n)
    return n


DTYPES = ("float32", "bfloat16", "float16", "auto")

# `--dtype` defaults, one per role: commands that decode for the user or time decoding run the target in the dtype
# the published figures use; commands that build training data or check exactness run it in float32, the dtype the
# heads, their fingerprints and the exactness checks are defined in
RUN_DTYPE = "bfloat16"
DATA_DTYPE = "float32"


def add_dtype_argument(parser, default: str = RUN_DTYPE) -> None:
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default=default,
        help=f"target weights' dtype (default {default}); auto: bfloat16 on a GPU that has it and on a CPU with "
        "AMX/AVX512-BF16 (multi-token forwards cost little more than one there), float32 otherwise",
    )


class _DeprecatedAlias(argparse.Action):
    """A hidden old spelling of an option: stores into the new option's `dest` and warns once it is used."""

    def __init__(self, option_strings, dest, new: str, values_map: dict | None = None, **kwargs):
        self.new, self.values_map = new, values_map or {}
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        warnings.warn(
            f"{option_string} is deprecated and will be removed; use {self.new}", FutureWarning, stacklevel=2
        )
        if self.nargs == 0:
            values = self.const
        elif isinstance(values, str):
            values = self.values_map.get(values, values)
        if isinstance(getattr(namespace, self.dest, None), list) and not isinstance(values, list):
            values = [*getattr(namespace, self.dest), values]  # an `append` option's old spelling appends too
        setattr(namespace, self.dest, values)


def add_deprecated_alias(parser, old: str, new: str, values_map: dict | None = None, **kwargs) -> None:
    """Keep `old` working as a hidden spelling of the option `new` (its `dest`, `type` given in `kwargs` if any):
    it warns (`FutureWarning`) and is left out of `--help` and the CLI reference. `values_map` renames values
    (`--precision bf16` -> `--dtype bfloat16`)."""
    dest = kwargs.pop("dest", new.lstrip("-").replace("-", "_"))
    parser.add_argument(
        old,
        dest=dest,
        action=_DeprecatedAlias,
        new=new,
        values_map=values_map,
        help=argparse.SUPPRESS,
        **kwargs,
    )


EXAMPLES_HEADER = "examples:"


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, but the `examples:` epilog keeps its lines as written (descriptions still wrap)."""

    def _fill_text(self, text, width, indent):
        if text.startswith(EXAMPLES_HEADER):
            return "\n".join(indent + line for line in text.splitlines())
        return super()._fill_text(text, width, indent)


def examples(*lines: str) -> dict:
    """`add_parser` keywords that end `--help` with these example command lines (`# ...` comments kept)."""
    text = EXAMPLES_HEADER + "\n" + "\n".join(f"  {line}" for line in lines)
    return {"epilog": text, "formatter_class": HelpFormatter}


def add_device_argument(parser) -> None:
    """`--device`, and how the target is loaded: quantized (`--load-in-8bit`, `--load-in-4bit`, hf-spec's own
    `--quantize`) or placed by accelerate (`--device-map`, `--max-memory`, `--offload-folder`), spelled as in
    `from_pretrained`."""
    parser.add_argument(
        "--device",
        default="auto",
        help="where the target runs: auto (cuda when torch sees a GPU, else cpu), cpu, cuda, cuda:1, ...",
    )
    group = parser.add_argument_group("target loading (as transformers' from_pretrained; docs/targets.md)")
    bits = group.add_mutually_exclusive_group()
    bits.add_argument(
        "--load-in-8bit", action="store_true", help="quantize the target with bitsandbytes LLM.int8"
    )
    bits.add_argument("--load-in-4bit", action="store_true", help="quantize the target with bitsandbytes NF4")
    bits.add_argument(
        "--quantize",
        choices=("int8", "int4", "gguf"),
        help="run the target's linears on hf-spec's quantized CPU kernels: gguf keeps the blocks of the GGUF a "
        "known target was fetched from; int8 (per channel) and int4 (groups of 32) are made at load",
    )
    group.add_argument(
        "--device-map",
        type=_device_map,
        help="let accelerate place the target's layers: auto, balanced, sequential, or a JSON map such as "
        '\'{"model.embed_tokens": "cpu", "model.layers": "disk", "model.norm": "cpu", "lm_head": "cpu"}\'',
    )
    group.add_argument(
        "--max-memory",
        type=_json_object,
        help='with --device-map: JSON such as \'{"0": "10GiB", "cpu": "30GiB"}\'',
    )
    group.add_argument("--offload-folder", help="with --device-map: where layers mapped to 'disk' are kept")


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON ({err.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    # accelerate names GPUs by integer index: "0" -> 0
    return {int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in value.items()}


def _device_map(text: str) -> str | dict:
    if text in ("auto", "balanced", "balanced_low_0", "sequential"):
        return text
    if not text.lstrip().startswith("{"):
        raise argparse.ArgumentTypeError(
            f"--device-map takes auto, balanced, balanced_low_0, sequential or a JSON object, got {text!r}"
        )
    return _json_object(text)


def loading_kwargs(args) -> dict:
    """The `load_model` keywords of `add_device_argument`'s loading options (none set: `{}`)."""
    kwargs = {
        "load_in_8bit": getattr(args, "load_in_8bit", False),
        "load_in_4bit": getattr(args, "load_in_4bit", False),
        "quantize": getattr(args, "quantize", None),
        "device_map": getattr(args, "device_map", None),
        "max_memory": getattr(args, "max_memory", None),
        "offload_folder": getattr(args, "offload_folder", None),
    }
    if kwargs["device_map"] is not None and getattr(args, "device", "auto") != "auto":
        raise ValueError(f"give --device or --device-map, not both (--device {args.device})")
    return {key: value for key, value in kwargs.items() if value not in (None, False)}


def resolve_device(name: str) -> torch.device:
    """`auto`: the CUDA device of this process when torch sees one (`LOCAL_RANK` under `accelerate launch`),
    else the CPU; otherwise the named device, checked."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        return torch.device("cpu")
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
    """`(model, tokenizer)` of `--target` on `--device` (or placed by `--device-map`), in `--dtype` (float32 for
    commands without one), quantized as `--load-in-8bit` / `--load-in-4bit` / `--quantize` say."""
    from hf_spec.models import load_model

    device = resolve_device(args.device)
    dtype = resolve_dtype(getattr(args, "dtype", "float32"), device)
    return load_model(args.target, dtype=dtype, device=device, **loading_kwargs(args))


def resolve_dtype(name: str, device: torch.device | str = "cpu") -> torch.dtype:
    """`auto` picks bfloat16 on a GPU that has it and where the CPU multiplies it natively, else float32."""
    if name == "auto" and torch.device(device).type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    if name == "auto":
        probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")  # private in torch 2.x: probe softly
        native = any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)
        return torch.bfloat16 if native else torch.float32
    return getattr(torch, name)
