"""EAGLE-3 checkpoints in the layouts in use, read into one `Eagle3Head` (`hf_spec.heads.published.eagle3_model`).

| layout | written by | config.json | weight keys |
|---|---|---|---|
| `sglang` | the EAGLE authors (`yuhuili/EAGLE3-*`), SpecForge, hf-spec | a Llama config, `draft_vocab_size`, optional `eagle_config`, `target_hidden_size` | `midlayer.*` |
| `vllm` | vLLM's speculators | `speculators_model_type: "eagle3"`, `transformer_layer_config`, `norm_before_residual` | `layers.0.*` |

Both hold `fc.weight` [H, k * H_target], `norm.weight`, `lm_head.weight` [draft_vocab, H], `d2t` (offsets: target id
= draft id + d2t[draft id]), `t2d` (bool mask) and optionally `embed_tokens.weight`.

Which target states a head reads, as indices into `output_hidden_states` (entry i enters decoder layer i):
- `eagle_config.eagle_aux_hidden_state_layer_ids` (SpecForge/SGLang): ids of the layers whose OUTPUT is read,
  i.e. index id + 1 (SGLang captures layer id + 1's input);
- a top-level `eagle_aux_hidden_state_layer_ids` (vLLM, speculators): the index itself (vLLM captures the input
  of layer id);
- neither (the EAGLE authors' heads): indices 2, L // 2 and L - 3 of an L-layer target.
A config naming both is read by `eagle_config`'s.
The states are joined in layer order, as every engine captures them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from hf_spec.heads.published.compat import check_fits_target
from hf_spec.heads.published.eagle import load_checked
from hf_spec.heads.published.eagle3_model import Eagle3Head, Eagle3HeadConfig, default_hidden_state_indices
from hf_spec.heads.published.files import read_config, read_weights
from hf_spec.integrity import CHECKSUM_FILE, check_finite, marked, verify_checksums
from hf_spec.models.fingerprint import check_fingerprint

SIDECAR = "hf_spec.json"  # hf-spec's metadata next to a head it wrote (format version, target fingerprint)
SIDECAR_FORMAT = "hf_spec_eagle3"
SIDECAR_VERSION = 1


def is_eagle3_checkpoint(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> bool:
    """Whether `(config.json, tensors)` is an EAGLE-3 head in one of the layouts above."""
    return (
        config.get("speculators_model_type") == "eagle3"
        or any(k.startswith("midlayer.") for k in tensors)
        or "layers.0.hidden_norm.weight" in tensors
    )


def layout_of(config: dict[str, Any]) -> str:
    """`"vllm"` for a speculators config, else `"sglang"` (the EAGLE authors' and SpecForge's)."""
    return "vllm" if "speculators_model_type" in config or "transformer_layer_config" in config else "sglang"


def hidden_state_indices(config: dict[str, Any], num_layers: int | None) -> tuple[int, ...]:
    """The target states a head reads (indices into `output_hidden_states`), from its config (see the module
    docstring), in layer order; the EAGLE-3 defaults of a `num_layers`-layer target when it names none."""
    eagle_config = config.get("eagle_config") or {}
    if not isinstance(eagle_config, dict):
        raise ValueError(f"eagle_config must be an object, got {type(eagle_config).__name__}")
    if eagle_config.get("eagle_aux_hidden_state_layer_ids"):
        ids = [int(i) + 1 for i in eagle_config["eagle_aux_hidden_state_layer_ids"]]
    elif config.get("eagle_aux_hidden_state_layer_ids"):
        ids = [int(i) for i in config["eagle_aux_hidden_state_layer_ids"]]
    elif num_layers is None:
        raise ValueError(
            "the head names no target layers (EAGLE-3's defaults depend on the target): name the target"
        )
    else:
        ids = list(default_hidden_state_indices(num_layers))
    return tuple(sorted(set(ids)))


def head_config(
    config: dict[str, Any], tensors: dict, what: str, num_layers: int | None = None
) -> Eagle3HeadConfig:
    """The `Eagle3HeadConfig` a published `config.json` describes, checked against its tensors' shapes.
    `num_layers`: the target's layer count, for a head that names no layer ids (the EAGLE-3 defaults)."""
    layer = config.get("transformer_layer_config") or config
    vllm = layout_of(config) == "vllm"
    if config.get("norm_before_fc"):
        raise ValueError(f"cannot load {what}: norm_before_fc heads (an RMSNorm before fc) are not supported")
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise ValueError(
            f"cannot load {what}: {layer['num_hidden_layers']} decoder layers; hf-spec runs one-layer EAGLE-3 heads"
        )
    try:
        hidden, heads = int(layer["hidden_size"]), int(layer["num_attention_heads"])
        vocab = int(layer.get("vocab_size") or config["vocab_size"])
        lm = tensors.get("lm_head.weight")
        draft_vocab = int(config.get("draft_vocab_size") or (lm.shape[0] if lm is not None else vocab))
        target_hidden = config.get("target_hidden_size")
        fields = dict(
            hidden_size=hidden,
            intermediate_size=int(layer["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
            head_dim=int(layer["head_dim"]) if layer.get("head_dim") else None,
            hidden_act=str(layer.get("hidden_act", "silu")),
            rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
            rope_theta=float(layer.get("rope_theta", 10000.0)),
            rope_scaling=layer.get("rope_scaling") or None,
            max_position_embeddings=int(layer.get("max_position_embeddings", 2048)),
            attention_bias=bool(layer.get("attention_bias", False)),
            mlp_bias=bool(layer.get("mlp_bias", False)),
            vocab_size=vocab,
            draft_vocab_size=draft_vocab,
            target_hidden_size=int(target_hidden) if target_hidden else None,
            fc_bias="fc.bias" in tensors,
            # vLLM reads a speculators config without the field as True, any other config as False
            norm_before_residual=bool(config.get("norm_before_residual", vllm)),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"cannot load {what}: config.json lacks or garbles a field ({err!r})") from None
    model_type = layer.get("model_type")
    try:
        indices = hidden_state_indices(config, num_layers)
    except (TypeError, ValueError) as err:
        raise ValueError(f"cannot load {what}: bad eagle_aux_hidden_state_layer_ids ({err})") from None
    fc = tensors.get("fc.weight")
    width = len(indices) * (fields["target_hidden_size"] or hidden)
    if fc is not None and fc.ndim == 2 and fc.shape[1] != width:
        raise ValueError(
            f"{what}: fc.weight reads {fc.shape[1]} features, but {len(indices)} target layers {list(indices)} of "
            f"width {fields['target_hidden_size'] or hidden} give {width} (layer ids missing from its config?)"
        )
    try:
        return Eagle3HeadConfig(**fields, hidden_state_indices=indices, target_model_type=model_type)
    except ValueError as err:
        raise ValueError(f"cannot load {what}: {err}") from None


def check_indices(what: str, indices: tuple[int, ...], target: PreTrainedModel) -> None:
    """Raise `ValueError` unless every index names the input of one of `target`'s decoder layers (0..L-1: the
    states every engine can capture; index L would be the output after the final norm)."""
    layers = int(target.config.num_hidden_layers)
    bad = [i for i in indices if not 0 <= i < layers]
    if bad:
        raise ValueError(
            f"{what} reads the target states entering layers {bad}, but the target has {layers} layers "
            f"(indices 0..{layers - 1} of output_hidden_states): it was made for another model"
        )


def check_head_fits(what: str, config: Eagle3HeadConfig, target: PreTrainedModel) -> None:
    """Raise `ValueError` naming the first mismatch between an EAGLE-3 head and `target`."""
    check_fits_target(
        what,
        target,
        config.hidden_size,
        config.vocab_size,
        config.target_model_type,
        target_hidden_size=config.target_hidden_size,
    )
    check_indices(what, config.hidden_state_indices, target)


def canonical_state(
    tensors: dict[str, torch.Tensor], config: Eagle3HeadConfig, target: PreTrainedModel | None, what: str
) -> tuple[dict[str, torch.Tensor], bool]:
    """The tensors under `Eagle3Head`'s keys (`layers.0.` read as `midlayer.`), with what a layout may leave out
    filled in; returns `(state, whether the head keeps its own embedding)`. With a `target`, a stored embedding
    equal to the target's is dropped (the target's is used, not a copy) and a missing LM head of the full
    vocabulary is the target's (as SGLang does)."""
    state = {
        ("midlayer." + k.removeprefix("layers.0.") if k.startswith("layers.0.") else k): v
        for k, v in tensors.items()
    }
    own_embedding = False
    embed = state.pop("embed_tokens.weight", None)
    if embed is not None and target is None:
        state["embed_tokens.weight"], own_embedding = embed, True
    elif embed is not None:
        want = target.get_input_embeddings().weight
        if tuple(embed.shape) != tuple(want.shape):
            raise ValueError(
                f"{what} stores an embedding of shape {tuple(embed.shape)}, the target's is {tuple(want.shape)}"
            )
        if not torch.equal(embed.to(want.dtype), want.detach().cpu()):
            state["embed_tokens.weight"], own_embedding = embed, True
    full = config.draft_vocab_size == config.vocab_size
    if "lm_head.weight" not in state and full and target is not None:
        state["lm_head.weight"] = target.get_output_embeddings().weight.detach().cpu()  # SGLang's fallback
    if "d2t" not in state:
        if config.draft_vocab_size != config.vocab_size:
            raise ValueError(
                f"{what} has a reduced draft vocabulary but no d2t mapping: a damaged checkpoint"
            )
        state["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)
    state["d2t"] = state["d2t"].long()
    ids = state["d2t"] + torch.arange(state["d2t"].shape[0])
    if ids.min() < 0 or ids.max() >= config.vocab_size:
        raise ValueError(f"{what}: d2t maps draft ids outside the target's {config.vocab_size} tokens")
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    if "t2d" in state and not torch.equal(state["t2d"].bool(), t2d):
        raise ValueError(f"{what}: t2d does not mark the target ids d2t maps to: a damaged checkpoint")
    state["t2d"] = t2d
    return state, own_embedding


def verify_folder(folder: str | os.PathLike, what: str) -> None:
    """Check a head folder hf-spec wrote against its `hf_spec_checksums.json` (`IntegrityError` naming a damaged,
    missing or unlisted file, or a list removed from a folder whose `config.json` says it had one; a warning for an
    hf-spec EAGLE-3 folder saved before checksums, which has only `hf_spec.json`). A third-party folder has none of
    these and is not checked."""
    folder = Path(folder)
    if (folder / CHECKSUM_FILE).is_file() or (folder / SIDECAR).is_file() or marked(folder) is not None:
        verify_checksums(folder, what)


def read_sidecar(folder: str | os.PathLike, what: str) -> dict[str, Any]:
    """hf-spec's `hf_spec.json` next to the checkpoint (empty when absent)."""
    file = Path(folder) / SIDECAR
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot load {what}: bad {SIDECAR} ({err})") from None
    if not isinstance(data, dict) or data.get("format") != SIDECAR_FORMAT:
        raise ValueError(f"cannot load {what}: {SIDECAR} does not describe an hf-spec EAGLE-3 head")
    if int(data.get("format_version", 0)) > SIDECAR_VERSION:
        raise ValueError(
            f"cannot load {what}: {SIDECAR} has format_version {data['format_version']}, this hf-spec reads "
            f"up to {SIDECAR_VERSION}: upgrade hf-spec"
        )
    return data


def load_eagle3_checkpoint(
    folder: str | os.PathLike,
    target: PreTrainedModel,
    what: str,
    config: dict[str, Any] | None = None,
    tensors: dict[str, torch.Tensor] | None = None,
) -> Eagle3Head:
    """The EAGLE-3 head in `folder`, checked against `target` (and against the target fingerprint and weight
    checksums hf-spec recorded when it wrote the folder), in the target's dtype on its LM head's device, embedding
    with the target's unless it stores its own. Given `tensors`, the caller has checked the folder
    (`verify_folder`)."""
    config = read_config(folder, what) if config is None else config
    if tensors is None:
        verify_folder(folder, what)
        tensors = read_weights(folder, what)
    sidecar = read_sidecar(folder, what)
    if sidecar.get("target"):
        check_fingerprint(sidecar["target"], target, what)
    cfg = head_config(config, tensors, what, int(target.config.num_hidden_layers))
    check_head_fits(what, cfg, target)
    recorded = sidecar.get("hidden_state_indices")
    if recorded is not None and tuple(recorded) != cfg.hidden_state_indices:
        raise ValueError(
            f"{what}: {SIDECAR} records target states {recorded}, config.json gives "
            f"{list(cfg.hidden_state_indices)}: a damaged or hand-edited folder"
        )
    state, own_embedding = canonical_state(tensors, cfg, target, what)
    head = Eagle3Head(cfg, own_embeddings=own_embedding).to(next(target.parameters()).dtype)
    load_checked(head, state, what)
    check_finite(head, what)
    return place_on_target(head.eval(), target)


def place_on_target(head: Eagle3Head, target: PreTrainedModel) -> Eagle3Head:
    """Move `head` to the device of the target's LM head in the target's dtype (rotary frequencies kept in
    float32) and let it embed with the target's embedding unless it has its own."""
    lm = target.get_output_embeddings().weight
    head = head.to(device=lm.device, dtype=next(target.parameters()).dtype)
    head.rotary_emb = type(head.rotary_emb)(config=head.config.layer_config()).to(lm.device)
    head.use_target_embeddings(target.get_input_embeddings())
    return head


__all__ = [
    "check_head_fits",
    "is_eagle3_checkpoint",
    "layout_of",
    "load_eagle3_checkpoint",
    "place_on_target",
    "read_sidecar",
    "verify_folder",
]
