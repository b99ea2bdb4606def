"""The GPU check's compiled rows (`benchmarks/gpu_check.py`), and the time budget its phases run within.

- `compiled_generate`: transformers' own compiled decoding, `generate(..., cache_implementation="static",
  compile_config=CompileConfig(...))`: tokens/s after a warm-up generation (which compiles), and whether its greedy
  tokens equal eager `generate`'s;
- `static_verification_costs`: the target's forward over a `StaticCache` at fixed widths (1, 2, 4, ..., 64 rows:
  the root and a branching tree, its attention mask padded to the cache's length), eager and compiled (each width
  compiled once, `fullgraph=True`, static shapes; on CUDA `mode="reduce-overhead"`, CUDA graphs), timed after
  warm-up: the verification cost curve once kernel launches are gone;
- `compiled_speculative`: each `oracle:k` against compiled `generate`, for a `SpeculativeDecoder` that takes
  `compile=True`; where the installed hf-spec has no such keyword it is recorded as not available;
- `Budget`: the phases' deadline (`--budget-s`): a phase that would start too late is skipped and recorded.
"""

from __future__ import annotations

import inspect
import time

# rows of the compiled verification curve: the buckets a compiled round pads its tree to
WIDTHS = [1, 2, 4, 8, 16, 32, 64]


class Budget:
    """Seconds left for the check's phases; each phase is timed (`phase_seconds`) and printed, and one that cannot
    start in time is listed in `skipped` with the reason."""

    def __init__(self, seconds: float, first_compile_guess_s: float = 0.0) -> None:
        self.deadline = time.perf_counter() + seconds
        # the longest compile seen so far (a guess before the first)
        self.compile_guess_s = first_compile_guess_s

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def allows(self, need_s: float, until: float | None = None) -> bool:
        """Whether `need_s` seconds fit before `until` (default: the deadline)."""
        end = self.deadline if until is None else min(until, self.deadline)
        return end - time.perf_counter() >= need_s

    def saw_compile(self, seconds: float) -> None:
        self.compile_guess_s = max(self.compile_guess_s, seconds)


def compile_options(device) -> dict:
    """`torch.compile` arguments of the compiled rows: one static graph per shape, no graph break; on CUDA
    `reduce-overhead` (CUDA graphs), elsewhere inductor's default mode."""
    return dict(fullgraph=True, dynamic=False, mode="reduce-overhead" if device.type == "cuda" else "default")


def allow_recompiles(limit: int = 64):
    """A context in which dynamo recompiles up to `limit` times per code object: one graph per width and the decoding
    step share the forward's code objects (dynamo's default allows 8)."""
    import torch._dynamo

    return torch._dynamo.config.patch(recompile_limit=max(torch._dynamo.config.recompile_limit, limit))


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, reps: int) -> float:
    """Median seconds of `fn()` over `reps` runs after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def generate_tokens(model, ids, new: int, **kw) -> tuple[float, list[int]]:
    """`(seconds, new greedy tokens)` of one `model.generate` call (no EOS: every run decodes `new` tokens)."""
    sync(model.device)
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new, do_sample=False, **kw)
    sync(model.device)
    return time.perf_counter() - t0, out[0, ids.shape[1] :].tolist()


def compiled_generate(model, ids, new: int, eager_tokens: list[int]) -> dict:
    """transformers' compiled static-cache `generate`: `{tokens_per_s, first_call_s (compiles), same_tokens_as_eager,
    first_difference (None where equal), mode}`."""
    from transformers import CompileConfig

    options = compile_options(model.device)
    config = CompileConfig(fullgraph=options["fullgraph"], dynamic=options["dynamic"], mode=options["mode"])
    if model.device.type != "cuda":
        config._compile_all_devices = True  # transformers compiles on accelerators only unless asked
    kw = dict(cache_implementation="static", compile_config=config)
    # the first call compiles the decoding step; CUDA graph trees record on a later call than the first
    first_s, _ = generate_tokens(model, ids, new, **kw)
    generate_tokens(model, ids, new, **kw)
    seconds, tokens = generate_tokens(model, ids, new, **kw)
    differ = [i for i, (a, b) in enumerate(zip(tokens, eager_tokens, strict=True)) if a != b]
    return {"tokens_per_s": new / seconds, "first_call_s": first_s, "same_tokens_as_eager": not differ,
            "first_difference": differ[0] if differ else None, "mode": options["mode"]}  # fmt: skip


def tree_block(width: int, past: int, max_len: int, dtype, device):
    """`(input_ids (1, W), position_ids (1, W), additive mask (1, 1, W, max_len))` of a root and a `W - 1`-node tree
    (a chain with its last node moved up a level, as the eager curve verifies) after `past` cached tokens, the mask
    padded with masked columns to the static cache's length."""
    import torch

    from hf_spec.tree import DraftTree
    from hf_spec.tree.masks import tree_attention_mask, tree_position_ids

    n = width - 1
    parents = list(range(-1, n - 2)) + [n - 3] if n > 2 else list(range(-1, n - 1))
    tree = DraftTree(torch.full((n,), 7), torch.tensor(parents, dtype=torch.long))
    mask = tree_attention_mask(tree, past, dtype, device)  # (1, 1, W, past + W)
    padded = torch.full((1, 1, width, max_len), torch.finfo(dtype).min, dtype=dtype, device=device)
    padded[..., : past + width] = mask
    ids = torch.full((1, width), 7, dtype=torch.long, device=device)
    return ids, tree_position_ids(tree, past, device), padded


def rewind(cache, past: int) -> None:
    """Set every static layer's length back to `past` (the forward's slots are then overwritten by the next)."""
    for layer in cache.layers:
        layer.cumulative_length.fill_(past)


def static_verification_costs(model, ids, widths: list[int], reps: int, budget: Budget, until: float) -> dict:
    """Median seconds of the target's forward over a `StaticCache` after `ids`, per width, eager and compiled:
    `{"eager": {W: s}, "compiled": {W: s}, "compile_s": {W: s}, "skipped_widths": [...]}`. A width whose compile may
    not finish before `until` (the longest compile so far) is skipped."""
    import torch
    from transformers import StaticCache

    from hf_spec.core.compat import cache_kwargs

    device, past = model.device, ids.shape[1] - 1
    max_len = past + max(widths)
    cache = StaticCache(config=model.config, max_cache_len=max_len)
    out: dict = {"eager": {}, "compiled": {}, "compile_s": {}, "skipped_widths": []}
    with torch.no_grad():
        model(input_ids=ids[:, :-1], **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)

        def forward(inputs, positions, mask):
            return model(input_ids=inputs, position_ids=positions, attention_mask=mask, **cache_kwargs(model, cache),
                         use_cache=True).logits  # fmt: skip

        def median_s(fn, block) -> float:
            times = []
            for _ in range(reps):
                rewind(cache, past)
                sync(device)
                t0 = time.perf_counter()
                fn(*block)
                sync(device)
                times.append(time.perf_counter() - t0)
            rewind(cache, past)
            return sorted(times)[len(times) // 2]

        for width in widths:
            block = tree_block(width, past, max_len, model.dtype, device)
            forward(*block)  # warm-up
            out["eager"][width] = median_s(forward, block)
            if not budget.allows(1.2 * budget.compile_guess_s, until):
                out["skipped_widths"].append(width)
                continue
            compiled = torch.compile(forward, **compile_options(device))
            t0 = time.perf_counter()
            for _ in range(3):  # compiles, then CUDA graph trees warm up and record
                rewind(cache, past)
                compiled(*block)
            sync(device)
            out["compile_s"][width] = time.perf_counter() - t0
            budget.saw_compile(out["compile_s"][width])
            out["compiled"][width] = median_s(compiled, block)
    return out


def bucketed(costs: dict[int, float], most: int) -> dict[int, float]:
    """`{rows: cost of the smallest measured width >= rows}` for 1..`most` rows: a compiled round pads its tree to
    the next width, so it pays that width's cost."""
    widths = sorted(costs)
    return {q: costs[next((w for w in widths if w >= q), widths[-1])] for q in range(1, most + 1)}


def decoder_takes_compile() -> bool:
    """Whether the installed hf-spec's `SpeculativeDecoder` takes `compile=True`."""
    from hf_spec import SpeculativeDecoder

    return "compile" in inspect.signature(SpeculativeDecoder.__init__).parameters


def compiled_speculative(model, ids, ks: list[int], new: int, reference, compiled_s: float) -> dict:
    """`oracle:k` with `SpeculativeDecoder(..., compile=True)` against compiled `generate` (`compiled_s` seconds for
    `new` tokens): `{"available": bool, "oracle_speedup": {k: x}, "same_tokens": {k: bool}}`."""
    from hf_spec import SpeculativeDecoder

    if not decoder_takes_compile():
        return {"available": False, "reason": "SpeculativeDecoder has no compile keyword in this hf-spec"}
    want = reference[0, ids.shape[1] :].tolist()
    speedup, same = {}, {}
    for k in ks:
        decoder = SpeculativeDecoder(f"oracle:{k}", compile=True)
        decoder.drafter_for(model).set_reference(reference)
        generate_tokens(model, ids, new, custom_generate=decoder)  # warm-up: compiles its buckets
        seconds, tokens = generate_tokens(model, ids, new, custom_generate=decoder)
        speedup[k], same[k] = compiled_s / seconds, tokens == want
    return {"available": True, "oracle_speedup": speedup, "same_tokens": same}
