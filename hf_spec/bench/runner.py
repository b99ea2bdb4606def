"""`hf-spec bench`: methods run interleaved prompt by prompt, Spec-Bench style scoring.

speedup = mean per-prompt tokens/s of a method / that of `ar`;
tau     = tokens committed per target forward (`ar` = 1.00).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch

from hf_spec.bench.lossless import (
    NEAR_TIE,
    NEAR_TIE_BY_DTYPE,
    choice_gap,
    compare_greedy,
    first_divergence,
    near_tie_threshold,
    top2_gap,
)
from hf_spec.bench.machine import machine_info
from hf_spec.bench.prompts import MT_BENCH, Prompt, encode_chat, load_prompts, spec_bench_group
from hf_spec.bench.report import acceptance_by_depth, markdown_table, plot_speedups, summarize, write_outputs
from hf_spec.bench.rounds import RoundRecorder
from hf_spec.decoder import SpeculativeDecoder
from hf_spec.engine.target.profile import target_profile
from hf_spec.models.fetch import dtype_name


class ForwardCounter:
    """Counts full target forwards: calls that reach the last decoder layer (early-exit drafts stop sooner)."""

    def __init__(self, model) -> None:
        self.count = 0
        self._layer = model.model.layers[-1]
        self._handle = self._layer.register_forward_pre_hook(self._hook)

    def _hook(self, *_) -> None:
        self.count += 1

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No counting inside the block: a compiled forward would trace the hook (and recompile at every count)."""
        self._handle.remove()
        try:
            yield
        finally:
            self._handle = self._layer.register_forward_pre_hook(self._hook)

    def close(self) -> None:
        self._handle.remove()


def synchronize(device: torch.device) -> None:
    """Wait for the GPU's queued work, so that wall-clock times cover it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_early_exit_layer(name: str) -> int:
    """The exit layer K of the method name `hf-early-exit[:K]` (default 6)."""
    stem, _, k = name.partition(":")
    if stem != "hf-early-exit" or (k and not (k.isdigit() and int(k) > 0)):
        raise ValueError(
            f"--methods {name}: transformers' early exit is written hf-early-exit:K with K a layer count >= 1 "
            "(e.g. hf-early-exit:6)"
        )
    return int(k or 6)


COMPILED = "+compiled"  # a method name's suffix: that method compiled (`ar+compiled`, `pld+compiled`, ...)


def compiled_generate_config():
    """transformers' `CompileConfig` for a compiled `generate` on any device (transformers compiles by itself only
    on accelerators), with `fullgraph` as hf-spec's compiled rounds use it."""
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=True)
    config._compile_all_devices = True
    return config


class Method:
    """One benchmarked method: `generate(input_ids, reference)` -> (sequence, stats).

    Compiled (`compile=True`, or a name ending in `+compiled`): `ar` is transformers' own compiled static-cache
    `generate`, an hf-spec method runs `SpeculativeDecoder(..., compile=True)`.
    """

    def __init__(self, name: str, model, tokenizer, max_new_tokens: int, compile: bool = False) -> None:
        self.name = name
        self.model = model
        self.kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False)
        self.decoder: SpeculativeDecoder | None = None
        base = name.removesuffix(COMPILED)
        self.compiled = compile or base != name
        # ar-kernels: plain decoding on hf-spec's CPU kernels (linears, attention), to measure their share alone
        self.kernels = base == "ar-kernels"
        if self.compiled and (self.kernels or base.startswith("hf-")):
            raise ValueError(
                f"{base} cannot run compiled: ar-kernels patches the model's modules, and transformers' assisted "
                "decoding (hf-pld, hf-early-exit) uses a dynamic cache"
            )
        if base in ("ar", "ar-kernels"):
            if self.compiled:
                self.kwargs.update(cache_implementation="static", compile_config=compiled_generate_config())
        elif base == "hf-pld":
            self.kwargs["prompt_lookup_num_tokens"] = 10
        elif base.startswith("hf-early-exit"):
            self.kwargs["assistant_early_exit"] = hf_early_exit_layer(base)
        else:
            self.decoder = SpeculativeDecoder(base, tokenizer=tokenizer, compile=self.compiled or None)
            self.kwargs["custom_generate"] = self.decoder
            if self.compiled:
                self.kwargs["compile_config"] = compiled_generate_config()
        self.needs_reference = self.decoder is not None and self.decoder.config.method == "oracle"

    def fix_cache_length(self, tokens: int) -> None:
        """A compiled method keeps a static cache of `tokens` for every call (prompt and new tokens of the longest
        call): transformers' compiled `generate` (`ar+compiled`) and hf-spec's compiled rounds alike (hf-spec sizes
        its own static cache for `max_cache_len` where that is larger than the call's `max_length`). One compiled
        graph then serves every prompt, where a prompt that outgrew the last cache would compile again inside its
        timed call. No effect on eager methods."""
        if self.compiled:
            self.kwargs["max_cache_len"] = tokens

    def generate(self, input_ids: torch.Tensor, reference: torch.Tensor | None, counter: ForwardCounter):
        if self.needs_reference:
            self.decoder.drafter_for(self.model).set_reference(reference)
        counter.count = 0
        input_ids = input_ids.to(self.model.device)
        synchronize(self.model.device)
        start = time.perf_counter()
        plain_on_kernels = target_profile(self.model).backend.plain_decoding if self.kernels else None
        with (
            plain_on_kernels(self.model) if plain_on_kernels else nullcontext(),
            counter.paused() if self.compiled else nullcontext(),
        ):
            out = self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **self.kwargs)
        synchronize(self.model.device)
        elapsed = time.perf_counter() - start
        new = out.shape[1] - input_ids.shape[1]
        row = {"new_tokens": new, "seconds": elapsed, "tokens_per_s": new / elapsed}
        if self.decoder is not None:
            stats = self.decoder.last_stats.to_dict()
            row.update(tau=stats["tau"], draft_utilization=stats["draft_utilization"], stats=stats)
            counts = getattr(self.decoder.drafter_for(self.model), "counts", None)  # e.g. HiSpec's rejections
            if counts:
                row["drafter_counts"] = dict(counts)
        elif self.compiled:  # compiled ar (not counted): one forward per token
            row["tau"] = 1.0
        else:  # ar: one forward per token; transformers' assisted loops: one per round
            row["tau"] = new / max(counter.count, 1)
        return out, row


def run_bench(
    model,
    tokenizer,
    method_names: list[str],
    prompts: list[Prompt],
    max_new_tokens: int = 128,
    turns: str = "first",
    check_lossless: bool = False,
    progress: Callable | None = None,
    recorder: RoundRecorder | None = None,
    compile: bool = False,
) -> dict:
    """Run every method on every prompt, interleaved, after one warm-up call each; `recorder` records the rounds
    of every hf-spec method (not the warm-up calls); `compile`: every method compiled (`Method`)."""
    if len(set(method_names)) != len(method_names):
        raise ValueError("a method is listed twice")
    methods = [Method(n, model, tokenizer, max_new_tokens, compile) for n in method_names]
    if any(
        m.compiled for m in methods
    ):  # one static cache size for every prompt: no recompiling between them
        turns_run = max(len(p.turns) for p in prompts) if turns == "all" else 1
        longest = max(len(tokenizer(" ".join(p.turns)).input_ids) for p in prompts)
        for m in methods:
            m.fix_cache_length(longest + 16 * turns_run + max_new_tokens * turns_run)
    counter = ForwardCounter(model)
    runs: list[dict] = []
    try:
        warm = encode_chat(tokenizer, [{"role": "user", "content": prompts[0].turns[0]}]).to(model.device)
        for m in methods:
            ref = model.generate(warm, max_new_tokens=8, do_sample=False) if m.needs_reference else None
            m.kwargs["max_new_tokens"], saved = 8, m.kwargs["max_new_tokens"]
            m.generate(warm, ref, counter)
            m.kwargs["max_new_tokens"] = saved
        bar = progress(total=len(prompts) * len(methods)) if progress else None
        for p in prompts:
            histories: dict[str, list[dict]] = {m.name: [] for m in methods}
            for turn_idx, turn in enumerate(p.turns if turns == "all" else p.turns[:1]):
                reference = None
                ar_tokens: list[int] | None = None
                for m in methods:
                    messages = histories[m.name] + [{"role": "user", "content": turn}]
                    input_ids = encode_chat(tokenizer, messages).to(model.device)
                    if m.needs_reference and reference is None:
                        reference = model.generate(input_ids, do_sample=False, max_new_tokens=max_new_tokens)
                    record = recorder is not None and m.decoder is not None
                    with recorder.method(m.name, m.decoder) if record else nullcontext():
                        out, row = m.generate(input_ids, reference, counter)
                    new_ids = out[0, input_ids.shape[1] :].tolist()
                    if m.name == "ar":
                        reference, ar_tokens = out, new_ids
                    row.update(method=m.name, question_id=p.question_id, category=p.category, turn=turn_idx)
                    if check_lossless and m.name != "ar" and ar_tokens is not None:
                        row.update(compare_greedy(model, input_ids, ar_tokens, new_ids))
                    runs.append(row)
                    answer = tokenizer.decode(new_ids, skip_special_tokens=True)
                    histories[m.name] = messages + [{"role": "assistant", "content": answer}]
                    if bar:
                        bar.update(1 if turn_idx == 0 else 0)
        if bar:
            bar.close()
    finally:
        counter.close()
    machine = {**machine_info(), "dtype": dtype_name(model.dtype), "device": model.device.type}
    compiled = sorted(m.name for m in methods if m.compiled)
    return {
        "summary": summarize(runs, method_names, check_lossless),
        "runs": runs,
        "machine": machine,
        "compiled": compiled,  # methods that ran compiled (`ar`: transformers' compiled static-cache generate)
    }


__all__ = [  # the harness, and the names of its parts that callers import from here
    "MT_BENCH",
    "NEAR_TIE",
    "NEAR_TIE_BY_DTYPE",
    "ForwardCounter",
    "Method",
    "Prompt",
    "acceptance_by_depth",
    "choice_gap",
    "compare_greedy",
    "encode_chat",
    "first_divergence",
    "load_prompts",
    "machine_info",
    "markdown_table",
    "near_tie_threshold",
    "plot_speedups",
    "run_bench",
    "spec_bench_group",
    "summarize",
    "synchronize",
    "top2_gap",
    "write_outputs",
]
