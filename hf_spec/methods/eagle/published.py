"""EAGLE-1/2 heads as the EAGLE authors publish them (e.g. `yuhuili/EAGLE-LLaMA3-Instruct-8B`).

Layout: `config.json` is a Llama config with `num_hidden_layers: 1`, the target's hidden and vocab sizes, an
optional `"bias"` (of `fc`, true when absent) and an optional `"qkv_bias"` (biases on q/k/v, for Qwen2
targets); weights in `model.safetensors` or `pytorch_model.bin`:

    fc.weight                      [H, 2H]   (+ fc.bias [H])
    layers.0.self_attn.{q,k,v,o}_proj.weight
    layers.0.mlp.{gate,up,down}_proj.weight
    layers.0.post_attention_layernorm.weight          (the layer has no input norm)
    embed_tokens.weight            [V, H]    optional: a copy of the target's embedding, not used

The head reads the target's last hidden state after its final norm, `y_{t-1}`, not hf-spec's unit features:

    h_t = Layer(fc([E(x_t); y_{t-1}]))       # embedding first; the pair at t sits at rotary position t - 1
    p(x_{t+1}) = softmax(LMHead(h_t))        # the target's LM head, no norm in between

Later draft steps feed `h_t` back in place of `y_t`, as in hf-spec's own heads.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from hf_spec.heads.published_compat import check_fits_target
from hf_spec.methods.eagle.eagle1 import layer_config
from hf_spec.methods.eagle.modeling import EagleHeadConfig, EagleHeadModel

FORMAT = "eagle"  # EAGLE-1/2, the EAGLE authors' layout


class PublishedEagleHead(EagleHeadModel):
    """An EAGLE-1/2 head of the EAGLE authors' layout: an `eagle1`-layout `EagleHeadModel` (the same layer, inputs
    and LM-head read, `hf_spec.methods.eagle.modeling`) checked against its target by shapes, as a published
    checkpoint carries no fingerprint; run by hf-spec's `eagle` drafter."""

    def __init__(self, config: EagleHeadConfig, fc_bias: bool = True) -> None:
        super().__init__(config)
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=fc_bias)
        self.what = "this EAGLE head"

    def attach_target(self, target: PreTrainedModel) -> PublishedEagleHead:
        """Check the head fits `target` (shapes, vocabulary), move it to the device of the target's LM head and
        borrow the target's embedding and LM head (read without a norm in between)."""
        check_fits_target(self.what, target, self.config.hidden_size, self.config.draft_vocab_size)
        self.attach_published_parts(target)
        return self


def load_eagle_head(
    config: dict[str, Any], tensors: dict[str, torch.Tensor], target: PreTrainedModel, what: str
) -> PublishedEagleHead:
    """Build the head from a published `config.json` and its tensors, checked against `target` first."""
    try:
        hidden = int(config["hidden_size"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"cannot load {what}: config.json has no hidden_size") from None
    vocab = config.get("vocab_size")
    check_fits_target(what, target, hidden, vocab, config.get("model_type"))
    if int(config.get("num_hidden_layers", 1)) != 1:
        raise ValueError(
            f"cannot load {what}: {config['num_hidden_layers']} layers, EAGLE-1/2 heads have one"
        )
    try:
        fields = layer_config(config)
    except ValueError as err:
        raise ValueError(f"cannot load {what}: {err}") from None
    head_config = EagleHeadConfig(
        layout="eagle1",
        layer_config=fields,
        draft_vocab_size=int(target.get_output_embeddings().weight.shape[0]),
    )
    head = PublishedEagleHead(head_config, fc_bias=bool(config.get("bias", True)))
    head.what = what
    state = {}
    for key, tensor in tensors.items():
        if key == "embed_tokens.weight":  # the target's embedding, stored for EAGLE's own loader: check only
            want = tuple(target.get_input_embeddings().weight.shape)
            if tuple(tensor.shape) != want:
                raise ValueError(
                    f"{what} stores an embedding of shape {tuple(tensor.shape)}, the target's is {want}"
                )
            continue
        state["layer." + key.removeprefix("layers.0.") if key.startswith("layers.0.") else key] = tensor
    load_checked(head, state, what, ignore=("d2t",))
    return head.to(next(target.parameters()).dtype).eval().attach_target(target)


def load_checked(
    module: nn.Module, state: dict[str, torch.Tensor], what: str, ignore: tuple[str, ...] = ()
) -> None:
    """`module.load_state_dict(state)`, with one `ValueError` naming the missing, unexpected or misshapen
    tensors of a damaged or foreign checkpoint."""
    own = {k: v for k, v in module.state_dict().items() if k not in ignore}
    missing = sorted(k for k in own if k not in state)
    if missing:
        raise ValueError(f"{what} lacks weights {missing[:5]}: a damaged or foreign checkpoint")
    unexpected = sorted(k for k in state if k not in own)
    if unexpected:
        raise ValueError(f"{what} holds unexpected weights {unexpected[:5]}: not this format, or damaged")
    for key, tensor in state.items():
        if tuple(tensor.shape) != tuple(own[key].shape):
            raise ValueError(
                f"{what}: {key} has shape {tuple(tensor.shape)}, its config implies {tuple(own[key].shape)}"
            )
    module.load_state_dict(state, strict=False)


def load_published(
    folder, target: PreTrainedModel, what: str, config: dict[str, Any], tensors: dict
) -> EagleHeadModel:
    """The EAGLE-1/2 head of `folder` (its `config.json` and tensors already read), for `load_published_head`."""
    return load_eagle_head(config, tensors, target, what)
