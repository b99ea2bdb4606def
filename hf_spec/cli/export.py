"""`hf-spec export HEAD --format {eagle3-sglang,eagle3-vllm,eagle} --out DIR`: write a draft head as the checkpoint
SGLang or vLLM loads (config fields and weight names they read).

    eagle3-sglang   SpecForge/SGLang layout (`LlamaForCausalLMEagle3`, `midlayer.*`), also hf-spec's own
    eagle3-vllm     vLLM's speculators layout (`speculators_model_type: eagle3`, `layers.0.*`)
    eagle           the EAGLE authors' EAGLE-1/2 layout (`fc.*`, `layers.0.*`), as safetensors: a published
                    EAGLE-1/2 head, or an hf-spec EAGLE head trained with `--architecture eagle1`

The weights are written as they are (or cast with `--dtype`), so a head exported and loaded back through
`eagle3:` / `eagle:` drafts the same tokens. A head folder hf-spec wrote is checked against its checksums first;
the folder written gets a checksum list too (engines ignore it).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

FORMATS = ("eagle3-sglang", "eagle3-vllm", "eagle")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# sidecar fields the writer sets itself; the rest (target fingerprint, training recipe) is carried over
_WRITER_FIELDS = ("format", "format_version", "layout", "hidden_state_indices", "target_model_type")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `export` sub-command."""
    from hf_spec.cli.common import examples

    parser = subparsers.add_parser(
        "export",
        help="write a draft head as an SGLang or vLLM checkpoint",
        description="Write an EAGLE-3 head (hf-spec's own or published, any layout) in the SGLang or vLLM "
        "layout, or an EAGLE-1/2 head (published, or hf-spec's trained with --architecture eagle1) in the EAGLE "
        "authors' layout as safetensors.",
        **examples(
            "hf-spec export my-eagle3-head --format eagle3-vllm --out my-head-vllm",
            "hf-spec export my-eagle3-head --format eagle3-sglang --dtype float16 --out my-head-sglang",
        ),
    )
    parser.add_argument("head", help="head folder or Hub id")
    parser.add_argument("--format", required=True, choices=FORMATS, help="checkpoint layout to write")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument(
        "--target",
        default=None,
        help="target model folder or Hub id (only its config is read): names the default layers of an "
        "EAGLE-3 head whose config names none",
    )
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="cast the weights (default: as stored)"
    )
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    out = export_head(args.head, args.format, args.out, args.target, DTYPES.get(args.dtype))
    print(out, flush=True)
    return 0


def export_head(
    head: str, fmt: str, out: str | Path, target: str | None = None, dtype: torch.dtype | None = None
) -> Path:
    """Write the head `head` (folder or Hub id) as `fmt` into `out`; returns `out`.

    Args:
        fmt: one of `FORMATS`.
        target: the target model (folder or Hub id), read for its layer count only where an EAGLE-3 head names
            no layer ids (the EAGLE authors' heads).
        dtype: store the weights in this dtype (default: as they are).
    """
    from hf_spec.core.hub_ids import resolve_head_folder
    from hf_spec.heads.published import detect_format
    from hf_spec.heads.published_files import read_config, read_weights
    from hf_spec.methods.eagle3.export import eagle1_checkpoint, save_eagle3_head, save_eagle_checkpoint
    from hf_spec.methods.eagle3.published import canonical_state, head_config, read_sidecar, verify_folder

    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}: one of {', '.join(FORMATS)}")
    what = f"the head {head!r}"
    folder = resolve_head_folder(head, "head")
    config = read_config(folder, what)
    model_type = str(config.get("model_type", ""))
    if model_type.startswith("hf_spec") and not is_eagle1_head(config):
        raise ValueError(own_head_message(head, model_type))
    verify_folder(folder, what)
    tensors = read_weights(folder, what)
    if model_type.startswith("hf_spec"):  # an eagle1-layout hf-spec EAGLE head
        if fmt != "eagle":
            raise ValueError(f"{what} is an EAGLE-1 head (architecture eagle1): export it as eagle")
        return save_eagle_checkpoint(out, *eagle1_checkpoint(config, tensors, what), dtype)
    found = detect_format(config, tensors)
    if found is None:
        raise ValueError(
            f"{what} is neither an EAGLE-1/2 nor an EAGLE-3 checkpoint in a layout hf-spec reads"
        )
    if fmt == "eagle":
        if found != "eagle":
            raise ValueError(f"{what} is an EAGLE-3 head: export it as eagle3-sglang or eagle3-vllm")
        return save_eagle_checkpoint(out, config, tensors, dtype)
    if found != "eagle3":
        raise ValueError(f"{what} is an EAGLE-1/2 head: export it as eagle")
    try:
        cfg = head_config(config, tensors, what, target_layers(target) if target else None)
    except ValueError as err:
        if "names no target layers" in str(err):
            raise ValueError(f"{err} with --target (its config gives the layer count)") from None
        raise
    layout = fmt.removeprefix("eagle3-")
    if layout == "sglang" and cfg.norm_before_residual:
        raise ValueError(
            f"{what} takes its residual after hidden_norm (norm_before_residual), which SGLang's EAGLE-3 layer "
            "cannot: export it as eagle3-vllm"
        )
    state, _ = canonical_state(tensors, cfg, None, what)
    sidecar = read_sidecar(folder, what)
    metadata = {k: v for k, v in sidecar.items() if k not in _WRITER_FIELDS}
    return save_eagle3_head(out, state, cfg, layout=layout, metadata=metadata, dtype=dtype)


def target_layers(target: str) -> int:
    """The decoder-layer count of the model `target` names (its config only)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(target)
    config = getattr(config, "text_config", None) or config
    return int(config.num_hidden_layers)


def is_eagle1_head(config: dict) -> bool:
    """Whether a `config.json` object is an hf-spec EAGLE head of the `eagle1` layout (the published layer)."""
    from hf_spec.methods.eagle.eagle1 import EAGLE1
    from hf_spec.methods.eagle.modeling import EagleHeadConfig

    return config.get("model_type") == EagleHeadConfig.model_type and config.get("layout") == EAGLE1


def own_head_message(head: str, model_type: str) -> str:
    """Why an hf-spec EAGLE/HASS (default architecture) or Lyanna head has no engine layout to be written in."""
    retrain = (
        "train it with `hf-spec train eagle --architecture eagle1` (the published EAGLE-1 layer) to get a head "
        "that exports as eagle; "
        if model_type == "hf_spec_eagle"
        else ""
    )
    return (
        f"{head!r} is an hf-spec {model_type} head, which no engine's layout can hold without changing its drafts: "
        "its decoder layer normalises its input (input_layernorm) and its drafts read the target's final norm "
        "before the LM head, while the EAGLE-1/2 layer vLLM and SGLang load has neither. EAGLE-3 heads (an "
        f"hf-spec EAGLE-3 head folder, or any published one) export as eagle3-sglang / eagle3-vllm; {retrain}"
        "serve this head with hf-spec"
    )
