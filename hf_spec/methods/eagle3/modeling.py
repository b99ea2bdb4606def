"""The EAGLE-3 draft head ([EAGLE-3](https://arxiv.org/abs/2503.01840)) as one `nn.Module`, for decoding and training.

The module's `state_dict` keys are the SpecForge/SGLang layout (`LlamaForCausalLMEagle3`), which is also hf-spec's
own EAGLE-3 head format (`hf_spec.methods.eagle3.published.save_eagle3_head`):

    fc.weight                      [H, k * H_target]   fuses k target hidden states (low, mid, high: k = 3)
    midlayer.self_attn.{q,k,v}_proj.weight  [*, 2H]    read cat(input_layernorm(embed), hidden_norm(h))
    midlayer.self_attn.o_proj.weight, midlayer.mlp.{gate,up,down}_proj.weight
    midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}.weight
    norm.weight                    [H]
    lm_head.weight                 [draft_vocab_size, H]
    d2t                            [draft_vocab_size]  offsets: target id = draft id + d2t[draft id]
    t2d                            [vocab_size]        bool: which target ids the draft vocabulary holds
    embed_tokens.weight            [vocab_size, H]     optional (absent: the target's embedding)

One step, for the pair (state g at position t-1, token x_t):

    g = fc(cat(a_low, a_mid, a_high))   # the first step after committed positions: the target's states
    g = h_prev                          # later draft steps: the head's own output, fed back without `fc`
    r = g (or hidden_norm(g) with `norm_before_residual`)
    y = r + Attn(cat(input_layernorm(E(x_t)), hidden_norm(g)))
    h = y + MLP(post_attention_layernorm(y))            # the head state, fed back at the next step
    p(x_{t+1}) = softmax(lm_head(norm(h)))              # over the draft vocabulary
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig, PreTrainedModel
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from hf_spec.core.compat import forward_cache_name


def default_hidden_state_indices(num_layers: int) -> tuple[int, ...]:
    """The EAGLE-3 default: the states entering layers 2, L//2 and L-3 (indices into `output_hidden_states`,
    whose entry `i` is the input of decoder layer `i`), in layer order."""
    return tuple(sorted({2, num_layers // 2, num_layers - 3}))


@dataclass
class Eagle3HeadConfig:
    """Shapes and options of an EAGLE-3 head.

    Args:
        hidden_size / intermediate_size / num_attention_heads / num_key_value_heads / head_dim / hidden_act /
            rms_norm_eps / rope_theta / rope_scaling / max_position_embeddings / attention_bias / mlp_bias: the
            Llama decoder layer of the head (`head_dim` None: hidden_size / num_attention_heads).
        vocab_size: the target's vocabulary size.
        draft_vocab_size: rows of the head's LM head.
        hidden_state_indices: the target states the head reads, as indices into the target's
            `output_hidden_states` (0: the embeddings, i: the output of decoder layer i - 1), increasing; the fused
            input is their concatenation in this order.
        target_hidden_size: the target's hidden size when it differs from the head's (None: equal).
        fc_bias: `fc` has a bias.
        norm_before_residual: the residual around the attention is `hidden_norm(g)` instead of `g` (vLLM's
            speculators heads).
        target_model_type: the target family the checkpoint names (None: not declared).
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    draft_vocab_size: int
    hidden_state_indices: tuple[int, ...]
    target_hidden_size: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    attention_bias: bool = False
    mlp_bias: bool = False
    fc_bias: bool = False
    norm_before_residual: bool = False
    target_model_type: str | None = field(default=None)

    def __post_init__(self) -> None:
        self.hidden_state_indices = tuple(int(i) for i in self.hidden_state_indices)
        ids = self.hidden_state_indices
        if not ids or list(ids) != sorted(set(ids)):
            raise ValueError(
                f"EAGLE-3 head: hidden_state_indices must be distinct and increasing, got {list(ids)}"
            )
        if self.fused_width == self.hidden_size:
            raise ValueError(
                "EAGLE-3 head: the fused target width equals the head's hidden size, so target states and the "
                "head's own states could not be told apart"
            )
        if self.draft_vocab_size < 1 or self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"EAGLE-3 head: draft_vocab_size {self.draft_vocab_size} outside 1..{self.vocab_size}"
            )

    @property
    def fused_width(self) -> int:
        """Width of `fc`'s input: the concatenated target states."""
        return len(self.hidden_state_indices) * (self.target_hidden_size or self.hidden_size)

    def layer_config(self) -> LlamaConfig:
        """The Llama config of the head's decoder layer (q/k/v are widened to 2H by `Eagle3MidLayer`)."""
        fields = dict(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim or self.hidden_size // self.num_attention_heads,
            hidden_act=self.hidden_act,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings,
            attention_bias=self.attention_bias,
            mlp_bias=self.mlp_bias,
            num_hidden_layers=1,
            vocab_size=self.vocab_size,
        )
        if self.rope_scaling:
            fields["rope_scaling"] = dict(self.rope_scaling)
        config = LlamaConfig(**fields)
        config._attn_implementation = "sdpa"
        return config

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["hidden_state_indices"] = list(self.hidden_state_indices)
        return data

    @classmethod
    def for_target(
        cls,
        target: PreTrainedModel,
        draft_vocab_size: int | None = None,
        hidden_state_indices: tuple[int, ...] | None = None,
        **fields,
    ) -> Eagle3HeadConfig:
        """A head for `target`: its hidden size, vocabulary and decoder-layer shape (any field may be overridden
        by keyword), reading the default low/mid/high states unless `hidden_state_indices` is given."""
        c = target.config
        vocab = int(target.get_input_embeddings().weight.shape[0])
        layers = int(c.num_hidden_layers)
        indices = hidden_state_indices or default_hidden_state_indices(layers)
        if len(indices) < 3 and hidden_state_indices is None:
            raise ValueError(
                f"a {layers}-layer target has no three distinct default EAGLE-3 layers: pass hidden_state_indices"
            )
        rope = getattr(c, "rope_parameters", None) or {}
        # the target's RoPE scaling (llama3, yarn, ...) carries over; its theta is a field of its own
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        scaling = scaling if scaling.get("rope_type", "default") != "default" else None
        base = dict(
            hidden_size=int(c.hidden_size),
            intermediate_size=int(c.intermediate_size),
            num_attention_heads=int(c.num_attention_heads),
            num_key_value_heads=int(getattr(c, "num_key_value_heads", None) or c.num_attention_heads),
            head_dim=getattr(c, "head_dim", None),
            hidden_act=str(getattr(c, "hidden_act", "silu")),
            rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))),
            rope_scaling=scaling,
            max_position_embeddings=int(getattr(c, "max_position_embeddings", 2048)),
            vocab_size=vocab,
            draft_vocab_size=min(draft_vocab_size or vocab, vocab),
            hidden_state_indices=tuple(indices),
            target_model_type=str(c.model_type),
        )
        return cls(**(base | fields))


class Eagle3MidLayer(nn.Module):
    """The head's decoder layer: Llama's attention and MLP, q/k/v reading `2 * hidden_size` inputs."""

    def __init__(self, config: Eagle3HeadConfig) -> None:
        super().__init__()
        layer = config.layer_config()
        hidden = config.hidden_size
        self.norm_before_residual = config.norm_before_residual
        self.self_attn = LlamaAttention(layer, layer_idx=0)
        # looked up here: a compiled head step traces no lookup
        self._attn_cache_name = forward_cache_name(LlamaAttention)
        attn = self.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(attn, name)
            setattr(attn, name, nn.Linear(2 * hidden, old.out_features, bias=config.attention_bias))
        self.mlp = LlamaMLP(layer)
        self.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.input_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache=None,
    ) -> torch.Tensor:
        """`embeds`, `hidden` `(batch, q_len, hidden_size)` -> the head state `(batch, q_len, hidden_size)`."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [batch, q_len, 2H]
        attn = self.self_attn(
            x,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            **{self._attn_cache_name: cache},
        )[0]
        y = residual + attn
        return y + self.mlp(self.post_attention_layernorm(y))


class Eagle3Head(nn.Module):
    """An EAGLE-3 draft head (see the module docstring for its keys and step).

    Decoding and training use the same `forward`; a trainer unrolls steps by feeding each step's output back as
    `hidden` with an explicit `attention_mask` and `position_ids` (and, to attend to earlier steps, one cache
    across the steps, as `hf_spec.training.eagle` does for EAGLE heads).

    Args:
        config: the head's shapes.
        own_embeddings: the head stores an embedding (`embed_tokens`); otherwise call
            `use_target_embeddings(target.get_input_embeddings())` before `forward`.
    """

    def __init__(self, config: Eagle3HeadConfig, own_embeddings: bool = False) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden) if own_embeddings else None
        self.fc = nn.Linear(config.fused_width, hidden, bias=config.fc_bias)
        self.midlayer = Eagle3MidLayer(config)
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))  # [draft_vocab]
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))  # [vocab]
        self.t2d[: config.draft_vocab_size] = True  # the identity mapping until `set_vocab_mapping`
        self.rotary_emb = LlamaRotaryEmbedding(config=config.layer_config())  # inv_freq: not persistent
        self._target_embeddings: list[nn.Module] = []  # the target's embedding, kept out of the state dict

    # ---- vocabulary -----------------------------------------------------------------------------------------
    def set_vocab_mapping(self, draft_to_target: torch.Tensor) -> None:
        """Set `d2t` / `t2d` from the target id of each draft id, `torch.LongTensor` of shape
        `(draft_vocab_size,)` (distinct ids)."""
        ids = torch.as_tensor(draft_to_target, dtype=torch.long).to(self.d2t.device)
        if ids.shape != self.d2t.shape:
            raise ValueError(f"EAGLE-3 head: {tuple(ids.shape)} draft ids for {self.d2t.shape[0]} draft rows")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size or len(set(ids.tolist())) != len(ids):
            raise ValueError("EAGLE-3 head: draft ids must be distinct target ids")
        self.d2t.copy_(ids - torch.arange(len(ids), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def draft_token_ids(self) -> torch.Tensor:
        """`torch.LongTensor` of shape `(draft_vocab_size,)`: the target id of each draft id."""
        return self.d2t + torch.arange(self.d2t.shape[0], device=self.d2t.device)

    # ---- embeddings -----------------------------------------------------------------------------------------
    def use_target_embeddings(self, embedding: nn.Module) -> None:
        """Embed tokens with the target's (frozen) embedding; ignored when the head has its own."""
        self._target_embeddings = [embedding]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`torch.LongTensor` of shape `(batch, q_len)` -> `(batch, q_len, hidden_size)`."""
        if self.embed_tokens is not None:
            return self.embed_tokens(input_ids)
        if not self._target_embeddings:
            raise RuntimeError(
                "this EAGLE-3 head has no embedding: call head.use_target_embeddings(...) first"
            )
        return self._target_embeddings[0](input_ids)

    # ---- forward --------------------------------------------------------------------------------------------
    def fuse(self, target_states: torch.Tensor) -> torch.Tensor:
        """The concatenated target states `(batch, q_len, fused_width)` -> `(batch, q_len, hidden_size)`."""
        return self.fc(target_states)

    def forward(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor | None,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache=None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One head step for every query position.

        Args:
            hidden: `(batch, q_len, fused_width)` concatenated target states (`hidden_state_indices`, taken at
                position t-1 for query token x_t), fused by `fc`; or `(batch, q_len, hidden_size)`, the head's
                own states from the previous step, used as they are.
            input_ids: `torch.LongTensor` of shape `(batch, q_len)`, the tokens x_t (target ids).
            position_ids: `torch.LongTensor` of shape `(batch, q_len)`, rotary positions (EAGLE places the pair
                at t - 1; only differences matter).
            attention_mask: additive `(batch, 1, q_len, kv_len)` over the cached positions then these (None:
                causal, without a cache).
            cache: a `transformers.Cache` the step's keys/values are appended to (None: no cache).
            inputs_embeds: `(batch, q_len, hidden_size)` instead of `input_ids`.

        Returns:
            h: `(batch, q_len, hidden_size)`, the state before `norm` (what the next step feeds back).
        """
        if hidden.shape[-1] == self.config.fused_width:
            hidden = self.fc(hidden.to(self.fc.weight.dtype))
        elif hidden.shape[-1] != self.config.hidden_size:
            raise ValueError(
                f"EAGLE-3 head: hidden width {hidden.shape[-1]} is neither the fused target width "
                f"{self.config.fused_width} nor the head's {self.config.hidden_size}"
            )
        embeds = inputs_embeds if inputs_embeds is not None else self.embed(input_ids)
        position_embeddings = self.rotary_emb(hidden, position_ids=position_ids)
        return self.midlayer(embeds.to(hidden.dtype), hidden, position_embeddings, attention_mask, cache)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Head states `(..., hidden_size)` -> logits over the draft vocabulary `(..., draft_vocab_size)`."""
        return self.lm_head(self.norm(h))


__all__ = ["Eagle3Head", "Eagle3HeadConfig", "Eagle3MidLayer", "default_hidden_state_indices"]
