"""Quantized targets: a loaded model's linears replaced by `QuantizedLinear`s, which run hf-spec's group-quantized
kernel, so stock `generate` and hf-spec's verification compute the same quantized function.

Schemes (`load_model(..., quantize=...)`, `--quantize`):
- `gguf`: the blocks of the GGUF a known target was fetched from (`hf-spec fetch NAME`), repacked, not
  de-quantized (`hf_spec.models.gguf_blocks`); each linear's weight is exactly the GGUF's de-quantized weight and,
  as llama.cpp runs a GGUF, its inputs are rounded to int8 per run of 32 and multiplied as integers
  (`GroupQuantWeight.int8_activations`; `quantize_gguf(..., int8_activations=False)` multiplies them in float32
  instead). The embedding de-quantizes its rows on lookup; a tied LM head shares its blocks. Tensors stored in
  float stay as loaded.
- `int8`: weight-only int8 made here, one scale per output channel (symmetric, as torchao's
  `Int8WeightOnlyConfig` and optimum-quanto's `qint8` weights).
- `int4`: weight-only int4 made here, groups of 32 inputs with a scale and a min each (asymmetric, as torchao's
  `Int4WeightOnlyConfig` and optimum-quanto's `qint4` with their group sizes); the scales are rounded to bfloat16 so
  `scale * code` is exact.
Linears whose `in_features` the layout cannot take (int8: not a multiple of 16; int4: of 32) stay as they are;
`quantization_report` lists what runs where.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from torch import nn

from hf_spec.kernels.group_quant_weight import (
    INT4_GROUP,
    RUN,
    TILE_ROWS,
    quantize_int4,
    quantize_int8,
)
from hf_spec.kernels.rows_attention import ROWS_ATTENTION, use_rows_attention
from hf_spec.models.downloads import MARKER
from hf_spec.models.quant_modules import FusedRMSNorm, QuantizedEmbedding, QuantizedLinear, fuse_rms_norms

SCHEMES = ("int8", "int4", "gguf")
_CHECK_ROWS = 8  # rows of each weight compared with the loaded model's (mapping and permutation checks)


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    module.train(getattr(parent, child).training)  # a new module is in training mode; keep the replaced one's
    setattr(parent, child, module)


def _dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def quantize_made_here(model: nn.Module, scheme: str) -> int:
    """Replace `model`'s `nn.Linear`s by int8 / int4 `QuantizedLinear`s (in place); returns how many."""
    if scheme not in ("int8", "int4"):
        raise ValueError(f"quantize_made_here takes int8 or int4, not {scheme!r}")
    step = 16 if scheme == "int8" else INT4_GROUP
    dtype, done = _dtype(model), 0
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or module.in_features % step or module.weight.device.type != "cpu":
            continue
        packed = quantize_int8(module.weight) if scheme == "int8" else quantize_int4(module.weight)
        _replace(model, name, QuantizedLinear(packed, module.bias, scheme, dtype))
        done += 1
    return done


def gguf_of_folder(folder: str | Path) -> Path:
    """The GGUF a target folder was converted from by `hf-spec fetch` (its `hf_spec_fetch.json` names it; the file
    lies in the cache's `gguf/`); ValueError where the folder did not come from a GGUF or the file is gone."""
    folder = Path(folder)
    try:
        info = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        raise ValueError(
            f"quantize='gguf' keeps the blocks of the GGUF a known target was fetched from (`hf-spec fetch NAME`), "
            f"but {folder} has no readable {MARKER}: it was not converted from a GGUF; use quantize='int8' or 'int4'"
        ) from None
    path = folder.parent.parent / "gguf" / str(info.get("gguf_file", ""))
    if not path.is_file():
        raise ValueError(
            f"{folder} was converted from {path}, which is missing: run `hf-spec fetch {folder.name}`"
        )
    return path


def _row_order(processor, name: str, rows: int) -> np.ndarray | None:
    """The order transformers' GGUF tensor processor puts a tensor's rows in (None: as stored)."""
    probe = np.arange(rows, dtype=np.float64)[:, None]
    out = processor.process(weights=probe, name=name, tensor_key_mapping={}, parsed_parameters={}).weights
    order = np.asarray(out).reshape(-1).astype(np.int64)
    return None if np.array_equal(order, np.arange(rows)) else order


def quantize_gguf(model: nn.Module, gguf_path: str | Path, int8_activations: bool = True) -> int:
    """Replace `model`'s linears and embedding whose GGUF tensors are quantized by modules holding those blocks
    (in place); `model` must be the GGUF's de-quantized conversion (a sample of rows of each weight is compared,
    bit for bit in the model's dtype). With `int8_activations` the linears quantize their inputs to int8 per run of
    32 and multiply integers, as llama.cpp runs a GGUF; without, they multiply the inputs as given in float32.
    Returns how many modules were replaced."""
    try:
        from gguf import GGMLQuantizationType, GGUFReader
    except ImportError:
        raise ImportError(
            "quantize='gguf' reads the GGUF with the gguf package: pip install 'hf-spec[gguf]'"
        ) from None
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        LlamaTensorProcessor,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    from hf_spec.models.gguf_blocks import SUPPORTED, repack

    reader = GGUFReader(str(gguf_path))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    cls = TENSOR_PROCESSORS.get(arch, TensorProcessor)
    if cls not in (TensorProcessor, LlamaTensorProcessor):
        raise NotImplementedError(
            f"GGUF targets of architecture {arch!r} are not supported (its tensors are reshaped)"
        )
    config = model.config
    processor = cls(
        config={
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": getattr(config, "num_key_value_heads", config.num_attention_heads),
        }
    )
    hf_names = get_gguf_hf_weights_map(model, processor)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and embed is not None and head.weight is embed.weight
    modules = dict(model.named_modules())
    dtype, replacements = _dtype(model), []
    float_types = (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
    for tensor in reader.tensors:
        hf_name = hf_names.get(tensor.name)
        if hf_name is None or not hf_name.endswith(".weight") or tensor.tensor_type in float_types:
            continue
        module = modules.get(hf_name.removesuffix(".weight"))
        if type(module) not in (nn.Linear, nn.Embedding) or tensor.tensor_type not in SUPPORTED:
            continue
        weight = module.weight
        packed = repack(np.asarray(tensor.data), tensor.tensor_type, tuple(weight.shape))
        order = _row_order(processor, tensor.name, weight.shape[0])
        if order is not None:
            packed = packed.select_rows(torch.from_numpy(order))
        packed.int8_activations = int8_activations
        rows = torch.linspace(0, weight.shape[0] - 1, _CHECK_ROWS).long().unique()
        if not torch.equal(packed.dequantize(rows).to(weight.dtype), weight.detach()[rows]):
            raise ValueError(
                f"{Path(gguf_path).name}'s {tensor.name} does not de-quantize to the loaded {hf_name}: the model was "
                "not converted from this GGUF"
            )
        if int8_activations and packed.out_features % TILE_ROWS == 0 and packed.in_features % RUN == 0:
            packed = packed.tiled()  # the int8-input kernel's fast layout
        scheme = f"gguf {GGMLQuantizationType(tensor.tensor_type).name}"
        replacements.append((hf_name.removesuffix(".weight"), module, packed, scheme))
    # replaced once every tensor has been checked: a refused GGUF leaves the model as it was
    for name, module, packed, scheme in replacements:
        if isinstance(module, nn.Embedding):
            _replace(model, name, QuantizedEmbedding(packed, scheme, dtype, module.padding_idx))
            if tied:
                _replace(model, _module_name(model, head), QuantizedLinear(packed, head.bias, scheme, dtype))
        else:
            _replace(model, name, QuantizedLinear(packed, module.bias, scheme, dtype))
    return len(replacements) + int(tied and any(isinstance(r[1], nn.Embedding) for r in replacements))


def _module_name(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


def quantize_target(model: nn.Module, scheme: str, gguf_path: str | Path | None = None) -> nn.Module:
    """`model` with its linears quantized by `scheme` (in place, returned): `int8`, `int4`, or `gguf` (with the
    GGUF file it was converted from: `gguf_path`, or the one its folder's `hf_spec_fetch.json` names); its
    Llama-family RMSNorms become `FusedRMSNorm`s (one kernel call each) and a model that runs `sdpa` runs
    `hf_spec.kernels.rows_attention` (each query row computed alone)."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantize={scheme!r}: use one of {', '.join(SCHEMES)}")
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise ValueError(f"quantize={scheme!r} targets run on the CPU: load the model on the CPU")
    if scheme == "gguf":
        path = gguf_path if gguf_path is not None else gguf_of_folder(model.config.name_or_path)
        done = quantize_gguf(model, path)
        if not done:
            raise ValueError(f"{Path(path).name} has no quantized tensor hf-spec can keep for this model")
    else:
        done = quantize_made_here(model, scheme)
        if not done:
            raise ValueError(f"quantize={scheme!r}: no linear of this model has a width the layout takes")
    # what is left of a decoding step around the linears is mostly tiny ops' dispatch: the norms take one call,
    # attention one call that also gives each row of a verification the bits of one-row decoding
    fuse_rms_norms(model)
    use_rows_attention(model)
    return model


def quantization_report(model: nn.Module) -> str:
    """One line: how many linears run on hf-spec's group-quantized kernel, by scheme, and how many do not."""
    quantized = Counter(m.scheme for m in model.modules() if isinstance(m, QuantizedLinear))
    dense = sum(1 for m in model.modules() if isinstance(m, nn.Linear))
    if not quantized:
        return f"no: {dense} nn.Linear (load with --quantize int8|int4|gguf to run them on quantized kernels)"
    kinds = ", ".join(f"{n} {s}" for s, n in sorted(quantized.items()))
    embed = model.get_input_embeddings()
    lookup = "; embedding de-quantized by row" if isinstance(embed, QuantizedEmbedding) else ""
    rounded = sum(1 for m in model.modules() if isinstance(m, QuantizedLinear) and m.packed.int8_activations)
    if rounded:
        lookup += f"; {rounded} with int8 inputs (rounded per 32, as llama.cpp)"
    norms = sum(1 for m in model.modules() if isinstance(m, FusedRMSNorm))
    if norms:
        lookup += f"; {norms} RMSNorms in one kernel call each"
    if getattr(model.config, "_attn_implementation", None) == ROWS_ATTENTION:
        lookup += "; attention on hf-spec's row kernel"
    rest = f"; {dense} nn.Linear unquantized" if dense else ""
    return f"yes: {sum(quantized.values())} linears on hf-spec's quantized kernel ({kinds}){lookup}{rest}"


__all__ = [
    "SCHEMES",
    "gguf_of_folder",
    "quantization_report",
    "quantize_gguf",
    "quantize_int4",
    "quantize_int8",
    "quantize_made_here",
    "quantize_target",
]
