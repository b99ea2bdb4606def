"""Writing heads as the checkpoints other engines load: EAGLE-3 heads in the SpecForge/SGLang layout (hf-spec's own
EAGLE-3 format) or vLLM's speculators layout, EAGLE-1/2 heads in the EAGLE authors' layout.

hf-spec's own EAGLE-3 head folder (the contract `hf-spec train eagle3` writes and `eagle3:` reads):

    config.json          the SGLang layout: architectures ["LlamaForCausalLMEagle3"], the Llama layer fields,
                         vocab_size, draft_vocab_size, target_hidden_size (when it differs), "bias" (of fc),
                         eagle_config.eagle_aux_hidden_state_layer_ids (SGLang's ids: index - 1)
    model.safetensors    midlayer.*, fc.*, norm.weight, lm_head.weight, d2t, t2d (+ embed_tokens.weight when the
                         head has its own)
    hf_spec.json         {"format": "hf_spec_eagle3", "format_version": 1, "layout", "hidden_state_indices",
                         "target": the target's fingerprint (when known), ...metadata}
    hf_spec_checksums.json   sha256 of every other file, written last and checked at load (`hf_spec.io.integrity`)

Every folder written here gets the checksum list (engines ignore the extra file) and is written into a temporary
sibling renamed into place (`hf_spec.io.output_folder.staged_folder`), so it is whole or absent; an `eagle1`-layout hf-spec
EAGLE head (`hf-spec train eagle --architecture eagle1`) is written in the EAGLE authors' layout
(`eagle1_checkpoint`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import PreTrainedModel

from hf_spec.io.integrity import save_tensors, write_checksums
from hf_spec.io.output_folder import check_output_folder, staged_folder
from hf_spec.methods.eagle.eagle1 import EAGLE1, config_of_layer
from hf_spec.methods.eagle3.modeling import Eagle3Head, Eagle3HeadConfig
from hf_spec.methods.eagle3.published import SIDECAR, SIDECAR_FORMAT, SIDECAR_VERSION
from hf_spec.models.fingerprint import target_fingerprint

Eagle3Layout = Literal["sglang", "vllm"]
WEIGHTS = "model.safetensors"


def _layer_fields(config: Eagle3HeadConfig) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim or config.hidden_size // config.num_attention_heads,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": config.attention_bias,
        "mlp_bias": config.mlp_bias,
        "num_hidden_layers": 1,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": False,
    }


def eagle3_config_json(
    config: Eagle3HeadConfig,
    layout: Eagle3Layout = "sglang",
    target_name: str | None = None,
    target_architectures: list[str] | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, Any]:
    """The `config.json` of `config` in `layout` (the fields SGLang resp. vLLM read)."""
    dtype_name = str(dtype).removeprefix("torch.")
    if layout == "sglang":
        data = {"architectures": ["LlamaForCausalLMEagle3"], **_layer_fields(config)}
        data |= {
            "draft_vocab_size": config.draft_vocab_size,
            "bias": config.fc_bias,
            "torch_dtype": dtype_name,
        }
        if config.norm_before_residual:  # SGLang's layer has no such option; vLLM and hf-spec read it
            data["norm_before_residual"] = True
        if config.target_hidden_size:
            data["target_hidden_size"] = config.target_hidden_size
        data["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in config.hidden_state_indices],
            "use_aux_hidden_state": True,
        }
        return data
    if layout != "vllm":
        raise ValueError(f"unknown EAGLE-3 layout {layout!r}: sglang or vllm")
    data = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "draft_vocab_size": config.draft_vocab_size,
        "norm_before_residual": config.norm_before_residual,
        "eagle_aux_hidden_state_layer_ids": list(config.hidden_state_indices),
        "transformer_layer_config": _layer_fields(config),
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": 3,
                    "accept_tolerance": 0.0,
                    "verifier_accept_k": 1,
                }
            ],
            "verifier": {"name_or_path": target_name, "architectures": target_architectures or []},
        },
        "torch_dtype": dtype_name,
    }
    if config.target_hidden_size:
        data["target_hidden_size"] = config.target_hidden_size
    return data


def eagle3_weights(
    state: dict[str, torch.Tensor], layout: Eagle3Layout = "sglang"
) -> dict[str, torch.Tensor]:
    """`Eagle3Head` state (`midlayer.*` keys) -> the tensors of `layout` (`layers.0.*` for vLLM's speculators)."""
    if layout == "sglang":
        return dict(state)
    return {
        ("layers.0." + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k): v
        for k, v in state.items()
    }


def save_eagle3_head(
    folder: str | os.PathLike,
    module_or_state_dict: Eagle3Head | dict[str, torch.Tensor],
    config: Eagle3HeadConfig | None = None,
    target: PreTrainedModel | None = None,
    layout: Eagle3Layout = "sglang",
    metadata: dict[str, Any] | None = None,
    dtype: torch.dtype | None = None,
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Write an EAGLE-3 head folder (hf-spec's own format with the default `layout="sglang"`; see the module
    docstring), whole or not at all; returns the folder. `folder` must be new, empty or an earlier EAGLE-3 head or
    export.

    Args:
        module_or_state_dict: an `Eagle3Head`, or its `state_dict()` (keys `midlayer.*`, `fc.*`, `norm.weight`,
            `lm_head.weight`, `d2t` offsets, `t2d`, optional `embed_tokens.weight`).
        config: the head's config (required with a state dict; default: the module's).
        target: the target the head was trained for: its fingerprint goes to `hf_spec.json` and is checked when
            the folder is loaded.
        layout: `"sglang"` (SpecForge/SGLang, hf-spec's own) or `"vllm"` (vLLM's speculators).
        metadata: extra JSON-serialisable fields for `hf_spec.json` (training recipe, ...).
        dtype: the dtype the weights are stored in (default: as they are).
        extra_files: more files of the folder (relative path -> text: recipe, model card), listed in its checksums.
    """
    folder = Path(folder)
    check_output_folder(folder, holds_eagle_output, "EAGLE-3 head")
    if isinstance(module_or_state_dict, Eagle3Head):
        config = config or module_or_state_dict.config
        state = module_or_state_dict.state_dict()
    elif config is None:
        raise ValueError("save_eagle3_head: pass the head's Eagle3HeadConfig with a state dict")
    else:
        state = dict(module_or_state_dict)
    if layout == "vllm" and config.fc_bias:
        raise ValueError(
            "vLLM's EAGLE-3 layer has no fc bias: this head cannot be written in the vllm layout"
        )
    check_state(state, config)
    tensors = {
        k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v) for k, v in state.items()
    }
    tensors = {k: v.detach().cpu().contiguous() for k, v in eagle3_weights(tensors, layout).items()}
    stored = dtype or state["fc.weight"].dtype
    name = str(getattr(target, "name_or_path", "") or "") or None
    architectures = list(getattr(getattr(target, "config", None), "architectures", None) or [])
    config_json = eagle3_config_json(config, layout, name, architectures, stored)
    sidecar = {
        "format": SIDECAR_FORMAT,
        "format_version": SIDECAR_VERSION,
        "layout": layout,
        "hidden_state_indices": list(config.hidden_state_indices),
        "target_model_type": config.target_model_type,
    }
    if target is not None:
        sidecar["target"] = target_fingerprint(target) | {"name_or_path": name}
    with staged_folder(folder) as new:
        for relative, text in (extra_files or {}).items():
            (new / relative).parent.mkdir(parents=True, exist_ok=True)
            (new / relative).write_text(text)
        (new / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
        save_tensors(tensors, str(new / WEIGHTS), metadata={"format": "pt"})
        (new / SIDECAR).write_text(json.dumps(sidecar | (metadata or {}), indent=2) + "\n")
        write_checksums(new)  # last
    return folder


def holds_eagle_output(folder: Path) -> bool:
    """An earlier output of `save_eagle3_head` or `save_eagle_checkpoint` (a head or an export), which a new one
    may replace: a checksum list or `hf_spec.json` beside a `config.json` of an engine's layout (not one of
    hf-spec's own `hf_spec_*` heads or exit heads, nor a target model, which has neither file)."""
    from hf_spec.io.integrity import CHECKSUM_FILE

    if not ((folder / CHECKSUM_FILE).is_file() or (folder / SIDECAR).is_file()):
        return False
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and not str(config.get("model_type", "")).startswith(
        ("hf_spec", "hf-spec")
    )


def check_state(state: dict[str, torch.Tensor], config: Eagle3HeadConfig) -> None:
    """Raise `ValueError` naming the missing, unexpected or misshapen tensors of a state dict for `config`."""
    with torch.device("meta"):  # shapes only
        own = Eagle3Head(config, own_embeddings="embed_tokens.weight" in state)
    want = {k: tuple(v.shape) for k, v in own.state_dict().items()}
    missing = sorted(set(want) - set(state))
    extra = sorted(set(state) - set(want))
    wrong = sorted(k for k in set(want) & set(state) if tuple(state[k].shape) != want[k])
    if missing or extra or wrong:
        raise ValueError(
            f"not an EAGLE-3 head state for this config: missing {missing[:5]}, unexpected {extra[:5]}, "
            f"misshapen {[(k, tuple(state[k].shape), want[k]) for k in wrong[:5]]}"
        )


# ---- EAGLE-1/2 --------------------------------------------------------------------------------------------------
def save_eagle_checkpoint(
    folder: str | os.PathLike,
    config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    dtype: torch.dtype | None = None,
) -> Path:
    """Write an EAGLE-1/2 head (a published checkpoint's `config.json` object and tensors) in the EAGLE authors'
    layout as `model.safetensors`: `fc.*` and `layers.0.*`, `bias` stated in the config, the embedding copy
    dropped (every engine uses the target's)."""
    kept = {k: v for k, v in tensors.items() if k.startswith(("fc.", "layers.0."))}
    kept = {k: (v.to(dtype) if dtype is not None else v).detach().cpu().contiguous() for k, v in kept.items()}
    config = dict(config) | {"bias": "fc.bias" in kept, "num_hidden_layers": 1}
    config["torch_dtype"] = str(kept["fc.weight"].dtype).removeprefix("torch.")
    folder = Path(folder)
    check_output_folder(folder, holds_eagle_output, "EAGLE head export")
    with staged_folder(folder) as new:  # whole or not at all
        (new / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_tensors(kept, str(new / WEIGHTS), metadata={"format": "pt"})
        write_checksums(new)  # last
    return folder


def eagle1_checkpoint(
    config: dict[str, Any], tensors: dict[str, torch.Tensor], what: str
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """An `eagle1`-layout hf-spec EAGLE head (its `config.json` object and tensors) as the EAGLE authors'
    `(config.json, tensors)`: the config its layer fields describe (`config_of_layer`), `layer.*` named
    `layers.0.*`, the draft-vocabulary map dropped (an `eagle1` head drafts over the whole vocabulary in token-id
    order, as the published layout does)."""
    if config.get("layout") != EAGLE1:
        raise ValueError(f"{what} is not an eagle1-layout EAGLE head")
    vocab = int(config.get("draft_vocab_size", 0))
    target_vocab = (config.get("target") or {}).get("vocab_size")
    d2t = tensors.get("d2t")
    if (target_vocab is not None and vocab != int(target_vocab)) or (
        d2t is None or not torch.equal(d2t.long(), torch.arange(vocab))
    ):
        raise ValueError(
            f"{what}: an eagle1 head drafts over the whole vocabulary in token-id order, this one's d2t or "
            "draft_vocab_size says otherwise: a damaged or hand-edited folder"
        )
    try:
        published = config_of_layer(config["layer_config"], vocab, fc_bias="fc.bias" in tensors)
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{what}: its layer is not the EAGLE-1 layer ({err})") from None
    weights = {
        ("layers.0." + k.removeprefix("layer.") if k.startswith("layer.") else k): v
        for k, v in tensors.items()
        if k != "d2t"
    }
    unknown = sorted(k for k in weights if not k.startswith(("fc.", "layers.0.")))
    if unknown:
        raise ValueError(f"{what} holds weights the EAGLE-1 layout has no place for: {unknown[:5]}")
    return published, weights


__all__ = [
    "eagle1_checkpoint",
    "eagle3_config_json",
    "eagle3_weights",
    "save_eagle3_head",
    "save_eagle_checkpoint",
    "holds_eagle_output",
]
