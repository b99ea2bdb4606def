"""`ExitChain`: a greedy chain drafter made of the target's first layers + an exit head, with its own KV cache.

Owning its cache (a copy of the target's first `exit_layer` cache layers, taken after the prompt prefill) lets
it draft while the target verifies, on another thread. It keeps the tokens it has drafted beyond the committed
text: when the target commits a prefix of them, the rest is the next draft for free.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers import DynamicCache

from hf_spec.datastore.sources import ExitHead
from hf_spec.engine.target.cache import crop_cache
from hf_spec.engine.target.placement import input_device
from hf_spec.kernels.weight_only import QuantizedWeight
from hf_spec.models.layers import decoder_parts, run_layers
from hf_spec.tree.masks import causal_mask

if TYPE_CHECKING:
    from hf_spec.engine.backend import Backend


class ExitChain:
    """Greedy drafts from layers `[0, exit_layer)` of the target followed by `head` (default: the target's final
    norm + LM head; trained exit heads plug in here), the layers' linears packed where `quantized` has them.

    Protocol: `begin(cache, tokens)` -> (`sync(committed)` -> `draft(n)`)* ; every call from one thread at a
    time (the `talon` drafter waits for the worker before touching it).
    """

    def __init__(
        self,
        model,
        exit_layer: int,
        head: ExitHead | None = None,
        min_confidence: float = 0.0,
        quantized: Mapping[nn.Linear, QuantizedWeight] | None = None,
    ):
        self.parts = decoder_parts(model)
        if not 0 < exit_layer < self.parts.num_layers:
            raise ValueError(f"exit_layer must be in [1, {self.parts.num_layers - 1}], got {exit_layer}")
        self.model = model
        self.exit_layer = exit_layer
        self.head = head or (lambda h: self.parts.lm_head(self.parts.norm(h)))
        self.min_confidence = min_confidence
        # packed draft weights of the layers: lossless, since the chain's cache is its own
        self.quantized = quantized or {}
        self.cache: DynamicCache | None = None
        self.seq: list[int] = []  # committed tokens + drafted ones
        self.cached = 0  # positions of `seq` whose keys/values are in `cache`
        self.committed = 0  # len of the committed prefix of `seq`
        self.stalled = False  # confidence fell below `min_confidence`: stop drafting further

    def begin(self, target_cache, tokens: list[int], backend: Backend) -> None:
        """Start from the target's cache of `tokens[:-1]` (right after the prompt prefill); the layers run their
        packed copies through `backend`, the target's kernel backend."""
        self.backend = backend
        self.cache = DynamicCache(config=self.model.config)
        cached = 0
        for i in range(self.exit_layer):
            src = target_cache.layers[i]
            if src.keys is not None and src.keys.numel():
                self.cache.update(src.keys.clone(), src.values.clone(), i)
                cached = src.keys.shape[-2]
        self.seq = list(tokens)
        self.cached = min(cached, len(tokens) - 1)
        crop_cache(self.cache, self.cached, range(self.exit_layer))
        self.committed = len(tokens)
        self.stalled = False

    def end(self) -> None:
        self.cache = None
        self.seq = []

    def sync(self, committed: list[int]) -> None:
        """The target committed `committed` (the whole sequence): keep drafted tokens it agrees with."""
        old = self.committed
        agree = old
        while agree < len(committed) and agree < len(self.seq) and self.seq[agree] == committed[agree]:
            agree += 1
        if agree < len(committed):  # diverged: drop the rest of the draft and its cache
            self.seq = list(committed)
            self.cached = min(self.cached, agree)
            crop_cache(self.cache, self.cached, range(self.exit_layer))
            self.stalled = False
        self.committed = len(committed)

    @torch.no_grad()
    def draft(self, n: int, stop: threading.Event | None = None) -> list[int]:
        """The next `n` tokens after the committed text (drafting only those not drafted yet)."""
        while len(self.seq) < self.committed + n and not self.stalled:
            if stop is not None and stop.is_set():
                break
            self._step()
        return self.seq[self.committed : self.committed + n]

    def _step(self) -> None:
        parts = self.parts
        device = input_device(self.model)  # an offloaded embedding's weight is a `meta` placeholder
        ids = torch.tensor([self.seq[self.cached :]], device=device)
        q = ids.shape[1]
        positions = torch.arange(self.cached, self.cached + q, device=device).unsqueeze(0)
        mask = causal_mask(q, self.cached, self.model.dtype, device) if q > 1 else None
        with self.backend.packed_linears(self.model, self.quantized):
            hidden = run_layers(
                parts, parts.embed_tokens(ids), positions, self.cache, 0, self.exit_layer, mask
            )
            logits = self.head(hidden[:, -1:])[0, -1].float()
        token = int(logits.argmax())
        self.cached += q
        self.seq.append(token)
        if self.min_confidence > 0 and float(torch.softmax(logits, -1)[token]) < self.min_confidence:
            self.stalled = True
