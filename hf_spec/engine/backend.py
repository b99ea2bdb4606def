"""Kernel backends: which implementation runs the target's and the drafters' forwards, and the round's own work.

A backend is chosen once per target (model, dtype, device; see `hf_spec.engine.target.profile`) and entered as a context
around the two kinds of forward a round makes:

- `verification(model, screen)`: the one target forward over `[root] + tree`;
- `drafting(module, linears)`: a drafter's own forward through the target's layers or a draft model;
- `attention(config)` / `packed_linears(module, weights)`: a draft head's layer attention and its packed weights;
- `plain_decoding(model)`: transformers' own loop, where a batch is decoded without speculation.

A backend also does the round's own work where it has kernels for it (each method's default is the torch code the
loop runs without them):

- `accept(...)`: accepting a verified tree (None: the loop's host rules in `hf_spec.engine.commit`);
- `compact_cache(cache, past, keep)`: keeping the root's and the accepted nodes' cache slots;
- `tree_inputs(tree, past, dtype, device)`: the tree's position ids and attention mask;
- `draft_topk(logits, k)` / `token_info_topk(...)`: a draft head's top-k children (EAGLE, Lyanna).

Nothing else in the loop, the drafter base class or the decoder knows a kernel exists. `TorchBackend` runs stock
torch everywhere (the reference); `CpuBackend` routes few-row linears through hf-spec's skinny-GEMM kernel, verifies
greedy rounds with the int8-screened LM head where nothing but the argmax is read, and runs few-row attention
without `repeat_kv` copies (`hf_spec/kernels/`); `TritonBackend` runs stock torch forwards and the round's own work
in Triton kernels (`hf_spec/kernels/triton/`, imported only by it). All give the same tokens: the kernels compute the
same sums in another order, the screen returns the exact argmax, and the acceptance kernels follow the same rules
with the same random numbers.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import Cache, LogitsProcessorList

    from hf_spec.engine.acceptance import Acceptance
    from hf_spec.tree import DraftTree


class Backend:
    """Stock torch: every context is a no-op (the reference; accelerators)."""

    name: ClassVar[str] = "torch"

    @contextlib.contextmanager
    def verification(self, model: nn.Module, screen: bool = False) -> Iterator[None]:
        """Around the verification forward of `model`; `screen`: only each row's argmax is read."""
        yield

    @contextlib.contextmanager
    def drafting(self, module: nn.Module, linears: bool = False) -> Iterator[None]:
        """Around a drafter's forward through `module` (the target's layers, or a draft model); `linears`: its
        few-row linears may take the fast path too (their results feed a verification: HiSpec's stages)."""
        yield

    @contextlib.contextmanager
    def plain_decoding(self, model: nn.Module) -> Iterator[None]:
        """Around transformers' own decoding loop over `model` (no speculation)."""
        yield

    @contextlib.contextmanager
    def attention(self, config) -> Iterator[None]:
        """Around the forward of layers built from `config` (a draft head's decoder layer)."""
        yield

    @contextlib.contextmanager
    def packed_linears(self, module: nn.Module, weights: Mapping) -> Iterator[None]:
        """`module`'s linears read the packed copies in `weights` (`{nn.Linear: QuantizedWeight}`, a drafter's
        `quantize` setting); an empty mapping changes nothing."""
        if not weights:
            yield
            return
        from hf_spec.kernels.weight_only import draft_linears

        with draft_linears(module, weights):
            yield

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`F.linear(x, weight, bias)` for a drafter's own few-row products (a head's LM rows, an exit head's
        vocabulary rows)."""
        return nn.functional.linear(x, weight, bias)

    def can_screen(self, model: nn.Module) -> bool:
        """Whether greedy verification of `model` may read the int8-screened LM head (model-level facts only)."""
        return False

    # ---- the round's own work ------------------------------------------------------------------------------
    def accept(
        self,
        tree: DraftTree,
        logits: torch.Tensor,
        prefix: torch.Tensor,
        processors: LogitsProcessorList,
        do_sample: bool,
        generator: torch.Generator | None,
        want_scores: bool,
    ) -> Acceptance | None:
        """Accept `tree` against its verification logits `(num_nodes + 1, vocab)` on the device, or None: the
        loop's host rules run (`hf_spec.engine.commit.accept`, which has the same arguments)."""
        return None

    def compact_cache(self, cache: Cache, past: int, keep: list[int]) -> None:
        """Keep the block slots `keep` (relative to `past`) of every cache layer (`hf_spec.engine.target.cache`)."""
        from hf_spec.engine.target.cache import compact_cache

        compact_cache(cache, past, keep)

    def tree_inputs(
        self, tree: DraftTree, past: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(position_ids (1, n + 1), additive mask (1, 1, n + 1, past + n + 1))` of `[root] + tree`."""
        from hf_spec.tree.masks import tree_attention_mask, tree_position_ids

        return tree_position_ids(tree, past, device), tree_attention_mask(tree, past, dtype, device)

    def draft_topk(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(values, indices)` `(rows, k)`: the top-k of each row of `log_softmax(logits.float())`."""
        return torch.topk(torch.log_softmax(logits.float(), dim=-1), k)

    def token_info_topk(
        self, raw: torch.Tensor, token_info, tokens: list[int | None], k: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Lyanna's step: `raw` `(V_draft,)` plus the token-info bias of each frontier token (None: no bias) ->
        `(values, indices)` `(len(tokens), k)` of each row's log-softmax top-k; None: the drafter's torch code."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


TorchBackend = Backend


class CpuBackend(Backend):
    """hf-spec's CPU kernels (skinny GEMM, screened LM head, grouped attention) where they apply."""

    name: ClassVar[str] = "cpu"

    @contextlib.contextmanager
    def verification(self, model: nn.Module, screen: bool = False) -> Iterator[None]:
        from hf_spec.kernels.grouped_attention import grouped_attention
        from hf_spec.kernels.screened_head import screened_lm_head
        from hf_spec.kernels.skinny_linear import fast_linears

        # the screened head first: `fast_linears` leaves modules it finds patched alone
        with screened_lm_head(model, enabled=screen), fast_linears(model), grouped_attention(model):
            yield

    @contextlib.contextmanager
    def drafting(self, module: nn.Module, linears: bool = False) -> Iterator[None]:
        from hf_spec.kernels.grouped_attention import grouped_attention
        from hf_spec.kernels.skinny_linear import fast_linears

        with fast_linears(module, enabled=linears), grouped_attention(module):
            yield

    @contextlib.contextmanager
    def plain_decoding(self, model: nn.Module) -> Iterator[None]:
        with self.drafting(model, linears=True):
            yield

    @contextlib.contextmanager
    def attention(self, config) -> Iterator[None]:
        from hf_spec.kernels.rows_attention import rows_attention_of

        with rows_attention_of(config):
            yield

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        from hf_spec.kernels.skinny_linear import skinny_linear

        return skinny_linear(x, weight, bias)

    def can_screen(self, model: nn.Module) -> bool:
        from hf_spec.kernels.screened_head import screening_applies

        return screening_applies(model, do_sample=False, has_processors=False, returns_scores=False)


class TritonBackend(Backend):
    """Stock torch forwards; acceptance, cache compaction, tree masks and draft top-k in Triton kernels
    (`hf_spec/kernels/triton/`). Greedy rounds read the device once (the packed accepted path); sampling rounds
    once too where the logits processors act on each row alone (temperature, top-k/p, ...), else the host rules
    run. On CPU tensors the kernels need Triton's interpreter (`TRITON_INTERPRET=1`)."""

    name: ClassVar[str] = "triton"
    # logits processors that act on each row alone, whatever the prefix: every row may be processed at once
    ROW_WISE: ClassVar[frozenset[str]] = frozenset(
        {
            "TemperatureLogitsWarper",
            "TopKLogitsWarper",
            "TopPLogitsWarper",
            "MinPLogitsWarper",
            "TypicalLogitsWarper",
            "EpsilonLogitsWarper",
            "EtaLogitsWarper",
            "LogitNormalization",
        }
    )

    @staticmethod
    def check(device_type: str) -> None:
        """Raise `ValueError` where the kernels cannot run for weights on `device_type`."""
        if not triton_available():
            raise ValueError(
                "HF_SPEC_BACKEND=triton needs the triton package (pip install 'hf-spec[triton]')"
            )
        # Triton's own switch, read as Triton reads it when its kernels are defined
        interpreted = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")
        if device_type != "cuda" and not interpreted:
            raise ValueError(
                f"HF_SPEC_BACKEND=triton runs its kernels on CUDA; for a model on {device_type!r} set "
                "TRITON_INTERPRET=1 (Triton's interpreter, before triton is imported) or use another backend"
            )

    @staticmethod
    def _on_device(tree: DraftTree, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The tree's `(parents, tokens)` on `device`: one host-to-device copy per tree, kept with the tree."""
        key = ("triton", str(device))
        if key not in tree._cache:
            both = torch.stack([tree.parents, tree.tokens]).to(device) if len(tree) else None
            tree._cache[key] = (both[0], both[1]) if both is not None else (tree.parents, tree.tokens)
        return tree._cache[key]

    def accept(self, tree, logits, prefix, processors, do_sample, generator, want_scores):
        from hf_spec.engine.acceptance import Acceptance

        if not do_sample and processors:  # greedy processors see each path's own prefix: the host rule
            return None
        if do_sample and not all(type(p).__name__ in self.ROW_WISE for p in processors):
            return None
        parents, tokens = self._on_device(tree, logits.device)
        if do_sample:
            from hf_spec.kernels.triton.sampling_accept import sampling_accept, unpack_sampling

            if processors:  # one call for every row: each is processed as it would be alone
                logits = processors(prefix.expand(logits.shape[0], -1), logits.clone())
            packed = sampling_accept(logits, parents, tokens, tree.draft_probs, generator)
            path, bonus = unpack_sampling(packed.tolist())  # the round's one read
            predictions = None
        else:
            from hf_spec.kernels.triton.greedy_accept import greedy_accept, unpack_greedy

            packed = greedy_accept(logits, parents, tokens)
            path, bonus, predictions = unpack_greedy(packed.tolist(), len(tree))  # the round's one read
        scores = [logits[k] for k in [0, *(i + 1 for i in path)]] if want_scores else []
        return Acceptance(path, bonus, scores, predictions)

    def compact_cache(self, cache, past, keep):
        from hf_spec.engine.target.cache import cache_layers, compact_cache, crop_cache

        if keep == list(range(len(keep))):  # a prefix: a crop
            crop_cache(cache, past + len(keep))
            return
        layers = [layer for layer in cache_layers(cache) if layer.keys is not None and layer.keys.numel()]
        tensors = [t for layer in layers for t in (layer.keys, layer.values)]
        if not all(t.dtype in _KERNEL_DTYPES and t.dim() == 4 and t.stride(-1) == 1 for t in tensors):
            compact_cache(cache, past, keep)
            return
        from hf_spec.kernels.triton.kv_compact import kv_compact

        kv_compact(tensors, past, keep)
        crop_cache(cache, past + len(keep))

    def tree_inputs(self, tree, past, dtype, device):
        from hf_spec.kernels.triton.tree_mask import tree_inputs

        if not len(tree) or dtype not in _KERNEL_DTYPES:
            return super().tree_inputs(tree, past, dtype, device)
        return tree_inputs(self._on_device(tree, device)[0], past, dtype)

    def draft_topk(self, logits, k):
        from hf_spec.kernels.triton.draft_topk import draft_topk

        return draft_topk(logits, k)

    def token_info_topk(self, raw, token_info, tokens, k):
        from hf_spec.kernels.triton.token_info_topk import token_info_topk

        device = raw.device
        has = torch.tensor([t is not None for t in tokens], device=device)
        if token_info is None or not any(t is not None for t in tokens):
            return token_info_topk(raw, k, len(tokens), has)
        ids = torch.tensor([0 if t is None else t for t in tokens], device=device)
        # a low-rank token info hands over its factors: the bias never exists as a (frontier, vocab) tensor
        factors = getattr(token_info, "factors", None)
        if factors is not None:
            low, w2, scale, known = factors(ids)
            return token_info_topk(raw, k, len(tokens), has & known, factors=(low, w2, scale))
        return token_info_topk(raw, k, len(tokens), has, bias=token_info(ids))


_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

BACKENDS: dict[str, type[Backend]] = {"torch": TorchBackend, "cpu": CpuBackend, "triton": TritonBackend}


def triton_available() -> bool:
    """Whether triton is installed (looked up, not imported: the CPU path never imports it)."""
    return importlib.util.find_spec("triton") is not None


def backend_for(device_type: str, forced: str | None = None) -> Backend:
    """The backend for weights on `device_type`: `cpu` on the CPU, `triton` on CUDA where triton is installed (and
    a CUDA device is present), `torch` elsewhere; `forced` (a name in `BACKENDS`, from `HF_SPEC_BACKEND`) overrides
    the choice."""
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"HF_SPEC_BACKEND must be one of {sorted(BACKENDS)}, got {forced!r}")
        if forced == "triton":
            TritonBackend.check(device_type)
        return BACKENDS[forced]()
    if device_type == "cpu":
        return CpuBackend()
    on_gpu = device_type == "cuda" and torch.cuda.is_available()
    return TritonBackend() if on_gpu and triton_available() else TorchBackend()
