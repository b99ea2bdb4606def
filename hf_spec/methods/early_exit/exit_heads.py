"""Exit heads and the exit "language model" they make of a target's first k layers.

    exit_logits(k, h) = lm_head(final_norm(adapter_k(h)))      # h: hidden state after k decoder layers
    adapter_k(h)      = h * (1 + s_k) + rms(h) * U_k V_k rmsnorm(h) + rms(h) * b_k

`final_norm` and `lm_head` are the target's own, frozen. The adapter is scale-equivariant (scaling `h` scales the
output), so after the RMS final norm only the direction of `h` matters, and at initialisation (`s = 0`, `U = 0`,
`b = 0`) it is the identity: an untrained head is the stock logit lens.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file
from torch import nn
from torch.nn import functional as F
from transformers import PreTrainedModel

from hf_spec.core.hub_ids import resolve_folder
from hf_spec.io.integrity import check_finite, save_tensors, verify_checksums, write_checksums
from hf_spec.io.output_folder import check_output_folder, holds_model_type, staged_folder
from hf_spec.kernels.weight_only import QuantizedWeight
from hf_spec.methods.early_exit.exit_heads_config import MODEL_TYPE, ExitHeadsConfig
from hf_spec.models.fingerprint import check_fingerprint, target_fingerprint
from hf_spec.models.layers import DecoderParts, decoder_parts

if TYPE_CHECKING:
    from hf_spec.engine.backend import Backend

WEIGHTS_NAME = "model.safetensors"


def _rms(h: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps)


class ExitAdapter(nn.Module):
    """Maps a layer-k hidden state `(..., hidden_size)` towards the last layer's, for the target's final norm."""

    def __init__(self, hidden_size: int, rank: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.zeros(hidden_size))  # s
        self.bias = nn.Parameter(torch.zeros(hidden_size))  # b
        self.down = nn.Linear(hidden_size, rank, bias=False) if rank else None  # V
        self.up = nn.Linear(rank, hidden_size, bias=False) if rank else None  # U, zero-initialised
        if self.up is not None:
            nn.init.normal_(self.down.weight, std=hidden_size**-0.5)
            nn.init.zeros_(self.up.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rms = _rms(hidden.float(), self.eps).to(hidden.dtype)  # [..., 1]
        out = hidden * (1 + self.scale) + rms * self.bias
        if self.up is not None:
            out = out + rms * self.up(self.down(hidden / rms))
        return out


class ExitHeads(nn.Module):
    """One `ExitAdapter` per exit layer of `config.layers`; a Hub-style folder with `save_pretrained`."""

    def __init__(self, config: ExitHeadsConfig) -> None:
        super().__init__()
        self.config = config
        self.adapters = nn.ModuleDict(
            {str(k): ExitAdapter(config.hidden_size, config.rank, config.rms_norm_eps) for k in config.layers}
        )
        self.draft_vocab: torch.Tensor | None = None  # [draft_vocab_size] sorted token ids

    @classmethod
    def for_target(
        cls, model: PreTrainedModel, layers: list[int], rank: int = 64, **config_kwargs
    ) -> ExitHeads:
        """Fresh (identity) heads for `model`, fingerprinted to it."""
        num_layers = decoder_parts(model).num_layers
        bad = [k for k in layers if not 0 < k < num_layers]
        if bad:
            raise ValueError(f"exit layers must be in [1, {num_layers - 1}] for this target, got {bad}")
        eps = float(getattr(model.config, "rms_norm_eps", 1e-6))
        config = ExitHeadsConfig(
            layers=list(layers),
            hidden_size=int(model.config.hidden_size),
            rank=rank,
            rms_norm_eps=eps,
            target=target_fingerprint(model),
            **config_kwargs,
        )
        return cls(config)

    def has_layer(self, layer: int) -> bool:
        return str(layer) in self.adapters

    def forward(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """`hidden` `(..., hidden_size)` after `layer` decoder layers -> adapted, same shape."""
        if not self.has_layer(layer):
            raise ValueError(f"no exit head for layer {layer}; these heads have layers {self.config.layers}")
        return self.adapters[str(layer)](hidden)

    def save_pretrained(
        self, folder: str | os.PathLike, dtype: torch.dtype = torch.bfloat16, card: str | None = None
    ) -> Path:
        """Write the heads (and `card` as `README.md`) to `folder`, whole or not at all."""
        path = Path(folder)
        check_output_folder(path, holds_model_type(MODEL_TYPE), "exit-heads folder")
        with staged_folder(path) as new:  # whole or not at all
            self.write_files(new, dtype)
            if card is not None:
                (new / "README.md").write_text(card)
            write_checksums(new)  # last
        return path

    def write_files(self, path: Path, dtype: torch.dtype = torch.bfloat16) -> None:
        """The config and weights into `path` (a `staged_folder`; its checksum list is the caller's)."""
        self.config.save(path)
        state = {
            f"layers.{name}": t.detach().to(dtype).contiguous()
            for name, t in self.adapters.state_dict().items()
        }
        if self.draft_vocab is not None:
            state["draft_vocab"] = self.draft_vocab.long().contiguous()
        save_tensors(state, str(path / WEIGHTS_NAME), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike, model: PreTrainedModel | None = None) -> ExitHeads:
        """Load float32 heads; with `model`, check they were trained for it (clear `ValueError` otherwise)."""
        config = ExitHeadsConfig.load(folder)
        if model is not None:
            check_fingerprint(config.target, model, f"the exit heads at {folder}")
        heads = cls(config)
        file = Path(folder) / WEIGHTS_NAME
        if not file.is_file():
            raise FileNotFoundError(f"no exit heads at {folder} (missing {WEIGHTS_NAME})")
        verify_checksums(folder, f"the exit heads at {folder}")  # first: a damaged file is named as such
        try:
            tensors = load_file(str(file))
        except Exception as err:  # noqa: BLE001 - safetensors' own errors: a truncated or foreign file
            raise ValueError(f"{file} is not a readable safetensors file ({err})") from None
        check_finite(tensors, str(file))
        vocab = tensors.pop("draft_vocab", None)
        if vocab is not None and model is not None and vocab.numel():
            size = model.get_output_embeddings().weight.shape[0]
            if not 0 <= int(vocab.min()) <= int(vocab.max()) < size:
                raise ValueError(f"{file}: its draft vocabulary names token ids outside the target's {size}")
        state = {k.removeprefix("layers."): v.float() for k, v in tensors.items()}
        missing, unexpected = heads.adapters.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"{file} does not match its config: missing {missing}, unexpected {unexpected}")
        heads.draft_vocab = vocab
        return heads.eval()

    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Keep `token_ids` (any order, unique) as the draft vocabulary."""
        self.draft_vocab = torch.unique(token_ids.long())
        self.config.draft_vocab_size = int(self.draft_vocab.numel())


class ExitLM:
    """The exit predictions of a target: its final norm and LM head read the (adapted) hidden state of layer `k`.

    Without heads (`heads=None`) the final norm and LM head read the raw hidden state (right for LayerSkip-style
    models trained to exit early). With `draft_vocab`, only the LM-head rows of the heads' draft vocabulary are
    computed (the other logits are -inf): a draft or an early check then costs a fraction of the LM head, and
    misses the tokens outside that vocabulary. The final verification always uses the full LM head.
    """

    def __init__(
        self, parts: DecoderParts, heads: ExitHeads | None = None, draft_vocab: bool = False
    ) -> None:
        self.parts = parts
        self.heads = heads
        self.vocab: torch.Tensor | None = None  # [V'] token ids
        self.vocab_weight: torch.Tensor | None = None  # [V', hidden_size] rows of the LM head
        if draft_vocab:
            if heads is None or heads.draft_vocab is None:
                raise ValueError(
                    "draft_vocab needs exit heads saved with a draft vocabulary (hf-spec train exits --draft-vocab N)"
                )
            self.vocab = heads.draft_vocab.to(parts.lm_head.weight.device)
            self.vocab_weight = parts.lm_head.weight.detach()[self.vocab].contiguous()
        self.head_int8: QuantizedWeight | None = None  # `quantize_head`: drafts read an int8 copy
        # the draft-vocabulary product; a drafter hands over its kernel backend's (`use_backend`)
        self.linear: Callable[..., torch.Tensor] = F.linear

    def use_backend(self, backend: Backend) -> None:
        """Compute the draft-vocabulary logits with `backend`'s linear (hf-spec's few-row kernel on a CPU)."""
        self.linear = backend.linear

    def quantize_head(self) -> None:
        """Compute the exit logits with an int8 copy of the LM-head rows used (drafts only: never the final
        verification's logits)."""
        from hf_spec.engine.target.placement import resident_weight

        weight = self.vocab_weight
        if weight is None:
            weight = resident_weight(self.parts.lm_head, "quantize copies the LM head").detach()
        self.head_int8 = QuantizedWeight.from_weight(weight, "int8", max_rows=32)

    def check_layers(self, *layers: int) -> None:
        if self.heads is not None:
            missing = [k for k in layers if not self.heads.has_layer(k)]
            if missing:
                raise ValueError(
                    f"the exit heads have no head for layer(s) {missing}; trained layers: {self.heads.config.layers}"
                )

    def logits(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """`hidden` `(1, q_len, hidden_size)` after `layer` layers -> logits `(1, q_len, vocab_size)`."""
        if self.heads is not None:
            hidden = self.heads(layer, hidden)
        hidden = self.parts.norm(hidden)
        if self.vocab is None:
            return self.parts.lm_head(hidden) if self.head_int8 is None else self.head_int8.linear(hidden)
        sub = (
            self.linear(hidden, self.vocab_weight)
            if self.head_int8 is None
            else self.head_int8.linear(hidden)
        )
        logits = sub.new_full((*sub.shape[:-1], self.parts.lm_head.weight.shape[0]), float("-inf"))
        logits[..., self.vocab] = sub
        return logits


def load_exit_lm(
    model: PreTrainedModel, heads_path: str | os.PathLike | None, draft_vocab: bool = False
) -> ExitLM:
    """`ExitLM` of `model` with the heads saved at `heads_path` (fingerprint-checked), or the stock exits."""
    if heads_path:  # a folder or a Hub id `org/name[@revision]` (its local snapshot)
        heads_path = resolve_folder(heads_path, "exit heads")
    heads = ExitHeads.from_pretrained(heads_path, model) if heads_path else None
    if heads is not None:  # the heads read hidden states where the LM head is
        heads.to(model.get_output_embeddings().weight.device, next(model.parameters()).dtype)
    return ExitLM(decoder_parts(model), heads, draft_vocab)
